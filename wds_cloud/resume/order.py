"""The shuffled order of an epoch's shards, computed position by position, never held.

A job of 10^7 shards on 4,096 ranks x 8 workers cannot give every worker a list of 10^7 ints to shuffle
(80 MB a list, built again each epoch, in every worker).  :class:`ShardOrder` is a seeded permutation of
``range(n)`` whose i-th value is computed when asked: a keyed Feistel network over the smallest number
of bits that holds ``n``, walked again (cycle-walking) while its value falls at ``n`` or beyond,
so every index in ``range(n)`` appears exactly once.  Its round keys come from SHA-256 of the seed, the
epoch and ``n``, so the order is the same on every rank, worker and process whatever Python's hash seed.
Slicing gives a :class:`~wds_cloud.utils.SequenceView`, a strided view (``order[rank::world][worker::workers]``)
that holds a ``range`` of positions and nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any, Union, overload

from ..utils import ComputedSequence, SequenceView, position

__all__ = ["ShardOrder"]

_M64 = (1 << 64) - 1
#: rounds of the Feistel network: four make a keyed pseudo-random permutation (Luby-Rackoff)
_ROUNDS = 4


def _seed_text(seed: Any) -> str:
    # an int of any kind (numpy's too) by its value, so the same seed gives the same order however it is typed
    try:
        return str(int(seed)) if not isinstance(seed, str) else "s:" + seed
    except (TypeError, ValueError):
        return "s:" + str(seed)


class ShardOrder(ComputedSequence):
    """The permutation of ``range(n)`` for (``seed``, ``epoch``): ``order[i]`` is the shard read i-th, in O(1);
    :meth:`index` is its inverse, also O(1)."""

    __slots__ = ("n", "_bits", "_half", "_keys")

    def __init__(self, n: int, seed: Any, epoch: int) -> None:
        if n < 0:
            raise ValueError(f"a shard order of {n} shards: give a count of 0 or more")
        self.n = n
        self._bits = max(2, (n - 1).bit_length())  # the domain, 2**bits, holds range(n) and is under 2n
        self._half = self._bits // 2
        digest = hashlib.sha256(f"wds_cloud.order/1:{_seed_text(seed)}:{int(epoch)}:{n}".encode()).digest()
        self._keys = tuple(int.from_bytes(digest[8 * r : 8 * r + 8], "little") for r in range(_ROUNDS))

    def __len__(self) -> int:
        return self.n

    # The round function, written out in both directions (the loops are the per-shard cost): the low part plus
    # the round's key, multiplied, shift-xored and multiplied again; the top bits of that are xored into the
    # high part, and the parts swap.  The parts may differ by a bit (an odd number of bits: the domain stays
    # under 2n, so cycle-walking takes under two steps on average); they swap sizes each round, and after an
    # even number of rounds they are back.
    def _encrypt(self, x: int) -> int:
        high_bits, low_bits = self._bits - self._half, self._half
        high, low = x >> low_bits, x & ((1 << low_bits) - 1)
        for key in self._keys:
            z = ((low + key) * 0x9E3779B97F4A7C15) & _M64
            z = ((z ^ (z >> 29)) * 0xBF58476D1CE4E5B9) & _M64
            high, low = low, high ^ (z >> (64 - high_bits))
            high_bits, low_bits = low_bits, high_bits
        return (high << low_bits) | low

    def _decrypt(self, y: int) -> int:
        high_bits, low_bits = self._bits - self._half, self._half
        high, low = y >> low_bits, y & ((1 << low_bits) - 1)
        for key in reversed(self._keys):
            z = ((high + key) * 0x9E3779B97F4A7C15) & _M64
            z = ((z ^ (z >> 29)) * 0xBF58476D1CE4E5B9) & _M64
            high, low = low ^ (z >> (64 - low_bits)), high
            high_bits, low_bits = low_bits, high_bits
        return (high << low_bits) | low

    def _at(self, i: int) -> int:
        n = self.n
        y = self._encrypt(i)
        while y >= n:  # cycle-walking: the domain is under 4n, so a few steps on average
            y = self._encrypt(y)
        return y

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> SequenceView: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[int, SequenceView]:
        if isinstance(i, slice):
            return SequenceView(self, range(self.n)[i])
        return self._at(position(i, self.n, "position in a shard order"))

    def __iter__(self) -> Iterator[int]:
        at = self._at
        for i in range(self.n):
            yield at(i)

    def index(self, value: Any, start: int = 0, stop: Any = None) -> int:
        """The position of shard ``value`` in the order (the inverse permutation)."""
        n = self.n
        if type(value) is not int or not 0 <= value < n:
            raise ValueError(f"{value!r} is not a shard index of an order of {n} shards")
        x = self._decrypt(value)
        while x >= n:
            x = self._decrypt(x)
        if not (start <= x and (stop is None or x < stop)):
            raise ValueError(f"shard {value} is at position {x}, outside [{start}, {stop})")
        return x

    def __contains__(self, value: Any) -> bool:
        return type(value) is int and 0 <= value < self.n

    def __repr__(self) -> str:
        return f"ShardOrder({self.n} shards)"
