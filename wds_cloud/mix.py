"""Mixing datasets: round robin, or random with given probabilities (seedable)."""

from __future__ import annotations

import random
from typing import Any, Iterator, Optional, Sequence

from .pytorch import IterableDataset

__all__ = ["RoundRobin", "RandomMix", "round_robin_shortest", "round_robin_longest", "random_samples"]


def round_robin_shortest(*sources: Any) -> Iterator:
    """One item of each source in turn, until any source ends."""
    iterators = [iter(s) for s in sources]
    while True:
        for it in iterators:
            try:
                yield next(it)
            except StopIteration:
                return


def round_robin_longest(*sources: Any) -> Iterator:
    """One item of each source in turn, dropping sources as they end."""
    iterators = [iter(s) for s in sources]
    while iterators:
        for it in list(iterators):
            try:
                yield next(it)
            except StopIteration:
                iterators.remove(it)


class RoundRobin(IterableDataset):
    """Interleave ``datasets``; ``longest=True`` goes on until every one has ended."""

    def __init__(self, datasets: Sequence[Any], longest: bool = False) -> None:
        self.datasets = datasets
        self.longest = longest

    def __iter__(self) -> Iterator:
        sources = [iter(d) for d in self.datasets]
        return round_robin_longest(*sources) if self.longest else round_robin_shortest(*sources)


def random_samples(sources: Sequence[Any], probs: Optional[Sequence[float]] = None, longest: bool = False,
                   rng: Optional[random.Random] = None) -> Iterator:
    """Items drawn from ``sources`` with probabilities ``probs``."""
    rng = rng or random.Random()
    sources = list(sources)
    probs = list(probs) if probs is not None else [1.0] * len(sources)
    while sources:
        i = rng.choices(range(len(sources)), weights=probs)[0]
        try:
            yield next(sources[i])
        except StopIteration:
            if not longest:
                return
            del sources[i], probs[i]


class RandomMix(IterableDataset):
    """Mix ``datasets`` at random with weights ``probs``; ``seed`` makes the mix reproducible."""

    def __init__(self, datasets: Sequence[Any], probs: Optional[Sequence[float]] = None, longest: bool = False,
                 seed: Optional[int] = None) -> None:
        self.datasets = datasets
        self.probs = probs
        self.longest = longest
        self.seed = seed

    def __iter__(self) -> Iterator:
        rng = random.Random(self.seed) if self.seed is not None else random.Random()
        return random_samples([iter(d) for d in self.datasets], self.probs, self.longest, rng)
