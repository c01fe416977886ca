"""Mixing datasets: round robin, or random with given probabilities (seedable)."""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from .errors import StateMismatchError
from .io.datafile import shown
from .mixing.sources import ReplayedSources
from .pytorch import IterableDataset
from .resume.protocol import Resumable, next_pass_state
from .resume.rng import CountedRandom
from .resume.state import expect

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


def random_samples(
    sources: Sequence[Any],
    probs: Optional[Sequence[float]] = None,
    longest: bool = False,
    rng: Optional[random.Random] = None,
) -> Iterator:
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


class RandomMix(ReplayedSources, IterableDataset):
    """Mix ``datasets`` at random with weights ``probs``; ``seed`` makes the mix reproducible.

    Resumable when every dataset is (a WebDataset or DataPipeline): its state holds the generator (two
    integers: :class:`~wds_cloud.resume.rng.CountedRandom`), the datasets still in the mix and each one's
    own state; a sample shuffle after it (``DataPipeline(RandomMix(...), wds.shuffle(n))``) resumes exactly
    too.  Without ``seed`` each pass draws a fresh one (saved in the state).
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        probs: Optional[Sequence[float]] = None,
        longest: bool = False,
        seed: Optional[int] = None,
    ) -> None:
        self.datasets = list(datasets)
        self.probs = probs
        self.longest = longest
        self.seed = seed
        self._live: Optional[tuple[CountedRandom, list[int]]] = None
        self._resume: Optional[dict] = None
        self._cursor = None
        self._replay: Optional[list] = None

    @property
    def resumable(self) -> bool:
        """Whether every dataset takes part in resume (has ``state_dict`` and ``load_state_dict``)."""
        return all(isinstance(ds, Resumable) for ds in self.datasets)

    def __iter__(self) -> Iterator:
        resume, self._resume = self._resume, None
        if resume is not None:
            rng, active = CountedRandom(*resume["rng"]), list(resume["active"])
        else:
            rng, active = CountedRandom(self.seed), list(range(len(self.datasets)))
        self._live = (rng, active)
        return self._mix(rng, active)

    def _mix(self, rng: CountedRandom, active: list[int]) -> Iterator:
        nexts = [iter(ds).__next__ for ds in self.datasets]
        weights = list(self.probs) if self.probs is not None else [1.0] * len(self.datasets)
        cursor = self._cursor
        yield from self._replayed(nexts)

        def table() -> list[float]:
            return list(itertools.accumulate(weights[i] for i in active))

        bounds = table()
        while active:
            k = bisect.bisect_right(bounds, rng.random() * bounds[-1])
            i = active[min(k, len(active) - 1)]
            try:
                sample = nexts[i]()
            except StopIteration:
                if not self.longest:
                    active.clear()
                    return
                active.remove(i)
                if active:
                    bounds = table()
                continue
            if cursor is not None:
                cursor.current = i
            yield sample

    # the Resumable protocol (wds_cloud.resume.protocol)
    def state_dict(self) -> dict:
        if self._resume is not None:
            return dict(self._resume)
        if self._live is None:
            return self.next_pass_state()
        rng, active = self._live
        return {
            "format": STATE_FORMAT,
            "rng": rng.getstate(),
            "active": list(active),
            "sources": [_state_of(ds) for ds in self.datasets],
        }

    def next_pass_state(self) -> dict:
        if self._resume is not None:
            return dict(self._resume)
        return {"format": STATE_FORMAT, "fresh": True, "sources": [next_pass_state(ds) for ds in self.datasets]}

    def load_state_dict(self, state: dict) -> None:
        expect(state, "RandomMix", dict, format=(str, lambda v: v == STATE_FORMAT), sources=list)
        if len(state["sources"]) != len(self.datasets):
            raise StateMismatchError(
                f"the RandomMix state holds {len(state['sources'])} sources' states; this mix "
                f"has {len(self.datasets)} datasets: load a state of the same mix",
                field="sources",
            )
        if not state.get("fresh"):
            expect(state, "RandomMix", dict, rng=list, active=list)
            rng, active = state["rng"], state["active"]
            if not (len(rng) == 2 and all(type(v) is int for v in rng) and 0 <= rng[1] < (1 << 63)):
                raise StateMismatchError(
                    f"the RandomMix state's 'rng' is {shown(rng)}, which no state_dict() gives: the state was changed",
                    field="rng",
                )
            if not (
                all(type(i) is int and 0 <= i < len(self.datasets) for i in active) and len(set(active)) == len(active)
            ):
                raise StateMismatchError(
                    f"the RandomMix state's 'active' is {shown(active)}, not a list of this mix's datasets",
                    field="active",
                )
        for ds, source_state in zip(self.datasets, state["sources"]):
            ds.load_state_dict(source_state)
        self._resume = None if state.get("fresh") else dict(state)


STATE_FORMAT = "wds_cloud.randommix/1"


def _state_of(dataset: Any) -> dict:
    """A dataset's exact state (``strict=True`` where it takes it): an inexact one cannot be mixed in."""
    try:
        return dataset.state_dict(strict=True)
    except TypeError:  # a Resumable of the user's without ``strict``
        return dataset.state_dict()
