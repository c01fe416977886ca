"""The counted random generator: a shuffle's whole RNG state in two integers."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import Optional

__all__ = ["CountedRandom"]

_BLOCK = 4096


class CountedRandom:
    """A random generator whose whole state is two integers, ``(seed, count)``.

    Draws come from a Mersenne Twister re-seeded every 4,096 draws from
    (``seed``, block number); restoring ``count`` re-seeds the block and skips
    at most 4,095 draws (a fraction of a millisecond), so saving and restoring
    the two integers restores the sequence exactly, where ``random.Random``
    would need its 2.5 KB state.  Each draw costs what a ``random()`` call costs.
    """

    __slots__ = ("seed", "count", "_rng", "_left")

    def __init__(self, seed: Optional[int] = None, count: int = 0) -> None:
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
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
        self.seed, self.count = int(state[0]), int(state[1])
        self._block(self.count // _BLOCK)
        for _ in range(self.count % _BLOCK):
            self._rng.random()
        self._left = _BLOCK - self.count % _BLOCK
