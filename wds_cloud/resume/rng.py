"""The counted random generator: a shuffle's whole RNG state in two integers."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import Optional

from ..errors import StateMismatchError
from ..io.datafile import shown
from .arguments import SEED_MAX, SEED_MIN, as_seed, is_seed

__all__ = ["CountedRandom"]

_BLOCK = 4096
#: more draws than any pass makes (a state claiming more was changed)
MAX_COUNT = 1 << 63


class CountedRandom:
    """A random generator whose whole state is two integers, ``(seed, count)``.

    Draws come from a Mersenne Twister re-seeded every 4,096 draws from
    (``seed``, block number); restoring ``count`` re-seeds the block and skips
    at most 4,095 draws (a fraction of a millisecond), so saving and restoring
    the two integers restores the sequence exactly, where ``random.Random``
    would need its 2.5 KB state.  Each draw costs what a ``random()`` call costs.

    ``seed``: a whole number (numpy's too) from :data:`~wds_cloud.resume.arguments.SEED_MIN` to ``SEED_MAX``, or
    None for a fresh one; anything else is a ConfigError here, not a failure when the first draw is made.
    """

    __slots__ = ("seed", "count", "_rng", "_left")

    def __init__(self, seed: Optional[int] = None, count: int = 0) -> None:
        chosen = as_seed("seed", seed)
        self.seed = int.from_bytes(os.urandom(8), "little") if chosen is None else chosen
        self.setstate([self.seed, count])

    def _block(self, block: int) -> None:
        self._rng = random.Random(f"{self.seed}/{block}")  # text seeds are hashed the same on every platform
        self._left = _BLOCK

    def random(self) -> float:
        if not self._left:
            self._block(self.count // _BLOCK)
        self._left -= 1
        self.count += 1
        return self._rng.random()

    def randbelow(self, n: int) -> int:
        """A uniform integer in ``[0, n)``."""
        return int(self.random() * n)

    def randint(self, a: int, b: int) -> int:
        return a + self.randbelow(b - a + 1)

    def getstate(self) -> list:
        return [self.seed, self.count]

    def setstate(self, state: Sequence[int]) -> None:
        """Restore ``[seed, count]`` (from :meth:`getstate`); a pair no generator gives is StateMismatchError."""
        seed, count = state[0], state[1]
        if not (is_seed(seed) and type(count) is int and 0 <= count < MAX_COUNT):
            raise StateMismatchError(
                f"the saved generator state {shown([seed, count])} is not a seed from {SEED_MIN} to {SEED_MAX} "
                "and a count of draws below 2**63: the state was changed; load the state that state_dict() returned",
                field="rng",
            )
        self.seed, self.count = seed, count
        self._block(self.count // _BLOCK)
        for _ in range(self.count % _BLOCK):
            self._rng.random()
        self._left = _BLOCK - self.count % _BLOCK
