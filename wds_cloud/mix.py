"""Mixing datasets: round robin, or random with given probabilities (seedable)."""

from __future__ import annotations

import base64
import bisect
import itertools
import random
import struct
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import numpy as np

from .errors import NotResumableError, StateMismatchError
from .io.datafile import shown
from .mixing.sources import ReplayedSources
from .pytorch import IterableDataset
from .resume.arguments import SEED_MAX, SEED_MIN, as_seed, as_weights, is_seed
from .resume.protocol import Resumable, next_pass_state
from .resume.rng import MAX_COUNT, CountedRandom
from .resume.state import SEAL, check_seal, expect, refuse_unknown, seal
from .stages import for_pipeline

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
    """Items drawn from ``sources`` with probabilities ``probs``.

    Without ``rng`` each pick is a draw of Python's global ``random``, as webdataset's: a script or a
    ``worker_init_fn`` that seeds ``random`` gets the same picks as there.  ``rng``: any object with ``random()``.
    """
    draw = (rng or random).random
    sources = list(sources)
    probs = list(probs) if probs is not None else [1.0] * len(sources)
    # webdataset's pick: the first source whose share of the cumulated weights reaches the draw (its numpy
    # arithmetic, so the same draw picks the same source; clamped: the last bound can round below 1.0)
    bounds = _shares(probs)
    while sources:
        i = min(bisect.bisect_left(bounds, draw()), len(sources) - 1)
        try:
            yield next(sources[i])
        except StopIteration:
            if not longest:
                return
            del sources[i], probs[i]
            bounds = _shares(probs) if probs else bounds


def _shares(probs: list) -> list:
    """The cumulated shares of ``probs``, computed as webdataset computes them (once per change of the sources)."""
    return np.cumsum(np.array(probs, dtype=float) / np.sum(probs)).tolist()


class RandomMix(ReplayedSources, IterableDataset):
    """Mix ``datasets`` at random with weights ``probs``; ``seed`` makes the mix reproducible.

    Resumable when every dataset is (a WebDataset or DataPipeline): its state holds the generator (two
    integers: :class:`~wds_cloud.resume.rng.CountedRandom`), the datasets still in the mix and each one's
    own state; a sample shuffle after it (``DataPipeline(RandomMix(...), wds.shuffle(n))``) resumes exactly
    too.  Without ``seed`` every pick is a draw of Python's global ``random``, made as webdataset makes it, so a
    ``worker_init_fn`` or a script that seeds ``random`` gets webdataset's very mix; the state then records where
    ``random`` stood, and a resumed pass puts ``random`` back there before it draws on (exact as long as nothing
    else draws from ``random`` while buffered samples are fetched again; give ``seed=`` for a mix of its own,
    independent of ``random``).  The state carries a checksum and
    is checked field by field on load (a dataset left out of the mix must have ended).

    ``probs``: one finite, non-negative weight per dataset (a list, tuple or numpy array), not all 0; ``seed``: a
    whole number (numpy's too).  Anything else is a ConfigError naming the argument, when the mix is built.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        probs: Optional[Sequence[float]] = None,
        longest: bool = False,
        seed: Optional[int] = None,
    ) -> None:
        # the mix's own copies (see wds_cloud.stages.PassHolder): a dataset also used elsewhere (peeked at, in
        # another mix) never moves the pass this mix's states describe
        self.datasets = [for_pipeline(ds) for ds in datasets]
        # plain floats and ints (numpy's too; they go into the state), nonsense refused here, where the user
        # wrote it, rather than on the first draw
        self.probs = as_weights("probs", probs, len(self.datasets)) if probs is not None else None
        self.longest = bool(longest)
        self.seed = as_seed("seed", seed)
        self._live: Optional[tuple[Any, list[int]]] = None
        self._resume: Optional[dict] = None
        self._cursor = None
        self._replay: Optional[list] = None

    @property
    def resumable(self) -> bool:
        """Whether every dataset takes part in resume (has ``state_dict`` and ``load_state_dict``)."""
        return all(isinstance(ds, Resumable) for ds in self.datasets)

    def __iter__(self) -> Iterator:
        resume, self._resume = self._resume, None
        rng: Any
        if resume is not None:
            active = list(resume["active"])
            if "random" in resume:  # a pass of picks from the global random: put it back where the state stood
                random.setstate(_decoded_random(resume["random"]))
                rng = GlobalDraws(resume["rng"][1])
            else:
                rng = CountedRandom(*resume["rng"])
        else:
            # without a seed every pick is a draw of the global random, as webdataset's: the user's seeding of it
            # (a worker_init_fn) decides the mix
            rng = CountedRandom(self.seed) if self.seed is not None else GlobalDraws(0)
            active = list(range(len(self.datasets)))
        self._live = (rng, active)
        return self._mix(rng, active)

    def _mix(self, rng: CountedRandom, active: list[int]) -> Iterator:
        nexts = [iter(ds).__next__ for ds in self.datasets]
        weights = list(self.probs) if self.probs is not None else [1.0] * len(self.datasets)
        cursor = self._cursor
        # a resumed pass whose state leaves sources out: each must really have ended (one, at least, when the
        # first to end ends the pass), or a source left out of 'active' would silently never give its samples
        out = [i for i in range(len(self.datasets)) if i not in active]
        later = set(self._replay or ()) if out else set()
        ended = self._confirm_ended(nexts, [i for i in out if i not in later], "RandomMix", every=self.longest)
        yield from self._replayed(nexts)
        ended += self._confirm_ended(nexts, [i for i in out if i in later], "RandomMix", every=self.longest)
        if out and not ended:
            raise StateMismatchError(
                "the saved RandomMix state ended the pass, but none of its datasets has ended: the state was "
                "changed; load the state that state_dict() returned",
                field="active",
            )

        # picks from the global random are made with webdataset's arithmetic (the same draw, the same source);
        # a seeded mix keeps its own, which its recorded orders follow
        upstream = isinstance(rng, GlobalDraws)

        def table() -> list[float]:
            if upstream:
                return _shares([weights[i] for i in active])
            return list(itertools.accumulate(weights[i] for i in active))

        bounds = table()
        while active:
            if upstream:
                k = bisect.bisect_left(bounds, rng.random())
            else:
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
    def state_dict(self, strict: bool = False) -> dict:
        """The generator, the datasets still in the mix and each dataset's state: plain JSON, with a checksum.

        A mix is exact or not at all: a source that cannot save an exact state raises
        :class:`~wds_cloud.errors.NotResumableError` naming why, ``strict`` or not (in a ``DataPipeline``, whose
        ``state_dict()`` then gives an inexact state); its state would restart that source alone, and deliver
        its samples again."""
        if self._resume is not None:
            return dict(self._resume)
        if self._live is None:
            return self.next_pass_state()
        rng, active = self._live
        state = {
            "format": STATE_FORMAT,
            "rng": rng.getstate(),
            "active": list(active),
            "sources": [_state_of(ds) for ds in self.datasets],
        }
        if isinstance(rng, GlobalDraws):
            state["random"] = _encoded_random(random.getstate())
        return seal(state)

    def next_pass_state(self) -> dict:
        if self._resume is not None:
            return dict(self._resume)
        return seal({"format": STATE_FORMAT, "fresh": True, "sources": [next_pass_state(ds) for ds in self.datasets]})

    def load_state_dict(self, state: dict) -> None:
        """Check ``state`` field by field (and its checksum), then hand each dataset its own state.  A state is
        input: one edited and sealed again is still refused where its fields disagree with each other or with
        this mix; 'active' is confirmed against the datasets when the pass begins."""
        expect(state, "RandomMix", dict, format=(str, lambda v: v == STATE_FORMAT), sources=list)
        if SEAL not in state:
            raise StateMismatchError(
                "the saved RandomMix state has no checksum: it was taken by an earlier version of wds_cloud "
                "(before RandomMix states carried one) or edited; take a new state with state_dict(), or start "
                "the pass again",
                field=SEAL,
            )
        fresh = "fresh" in state
        allowed = {"format", "sources", SEAL} | ({"fresh"} if fresh else {"rng", "active", "random"})
        refuse_unknown(state, allowed, "RandomMix")
        n = len(self.datasets)
        if len(state["sources"]) != n:
            raise StateMismatchError(
                f"the RandomMix state holds {len(state['sources'])} sources' states; this mix "
                f"has {n} datasets: load a state of the same mix",
                field="sources",
            )
        if fresh:
            expect(state, "RandomMix", dict, fresh=(bool, lambda v: v is True))
        else:
            expect(state, "RandomMix", dict, rng=list, active=list)
            self._check_fields(state["rng"], state["active"], state["sources"])
            self._check_random(state)
        check_seal(state, "RandomMix")
        for ds, source_state in zip(self.datasets, state["sources"]):
            ds.load_state_dict(source_state)
        self._resume = None if fresh else dict(state)

    def _check_random(self, state: dict) -> None:
        """A pass of picks from the global random records where it stood ('random') and says so in 'rng'; a pass
        of its own seed records neither.  The recorded state must be one Python's random can take."""
        drawn = state["rng"][0] == GlobalDraws.SOURCE
        if drawn != ("random" in state):
            raise StateMismatchError(
                "the RandomMix state's 'rng' and 'random' disagree (a mix without seed= records both, a seeded one "
                "neither): the state was changed; load the state that state_dict() returned",
                field="random",
            )
        if drawn:
            _decoded_random(state["random"])

    def _check_fields(self, rng: list, active: list, sources: list) -> None:
        n = len(self.datasets)
        seeded = len(rng) == 2 and (is_seed(rng[0]) or rng[0] == GlobalDraws.SOURCE)
        if not (seeded and type(rng[1]) is int and 0 <= rng[1] < MAX_COUNT):
            raise StateMismatchError(
                f"the RandomMix state's 'rng' is {shown(rng)}, which no state_dict() gives (a seed from "
                f"{SEED_MIN} to {SEED_MAX} and a count of draws): the state was changed",
                field="rng",
            )
        # the datasets still in the mix, in order; without longest=True the first to end ends the pass (all or none)
        if not (
            all(type(i) is int and 0 <= i < n for i in active)
            and all(a < b for a, b in zip(active, active[1:]))
            and (self.longest or len(active) in (0, n))
        ):
            raise StateMismatchError(
                f"the RandomMix state's 'active' is {shown(active)}, not the datasets this mix "
                f"(of {n}, longest={self.longest}) can still hold: the state was changed",
                field="active",
            )
        # every draw gave a sample of a dataset (counted in its own progress) or met one that ended (once each)
        yielded = [_items_yielded(s) for s in sources]
        given = sum(y for y in yielded if y is not None)
        # exactly: one draw per sample given, plus one per dataset that ended (the shortest ends the mix)
        ended = n - len(active)
        expected = given + (ended if self.longest else min(ended, 1))
        if None not in yielded and rng[1] != expected:
            raise StateMismatchError(
                f"the RandomMix state counts {rng[1]} draws, but its datasets gave {given} samples and {ended} "
                f"of them ended, which makes {expected} draws: the state was changed",
                field="rng",
            )


STATE_FORMAT = "wds_cloud.randommix/1"


class GlobalDraws:
    """Draws of Python's global ``random`` (webdataset's RandomMix makes its picks so), counted for the state."""

    __slots__ = ("count",)
    #: what a state's ``rng`` names in place of a seed
    SOURCE = "random"

    def __init__(self, count: int = 0) -> None:
        self.count = count

    def random(self) -> float:
        self.count += 1
        return random.random()

    def getstate(self) -> list:
        return [self.SOURCE, self.count]


#: the Mersenne Twister's words (624 and the position) as Python's random.getstate() gives them (version 3)
_MT_WORDS = 625


def _encoded_random(state: tuple) -> list:
    """``random.getstate()`` as plain data: its words packed in base64 (3.3 KB), and the cached gauss draw."""
    _, words, gauss = state
    return [base64.b64encode(struct.pack(f"<{_MT_WORDS}I", *words)).decode("ascii"), gauss]


def _decoded_random(value: Any) -> tuple:
    """The ``random`` state a RandomMix state recorded (see :func:`_encoded_random`), checked as Python checks it;
    anything else is StateMismatchError."""
    try:
        text, gauss = value
        words = struct.unpack(f"<{_MT_WORDS}I", base64.b64decode(text.encode("ascii"), validate=True))
        if not (gauss is None or type(gauss) is float):
            raise ValueError("gauss")
        state = (3, words, gauss)
        random.Random().setstate(state)  # Python's own check of the words (their position, not all zero)
        return state
    except (ValueError, TypeError, AttributeError, struct.error):
        raise StateMismatchError(
            f"the RandomMix state's 'random' is {shown(value)}, not the state of Python's random that "
            "state_dict() records: the state was changed; load the state that state_dict() returned",
            field="random",
        ) from None


def _items_yielded(state: Any) -> Optional[int]:
    """How many items a dataset's pipeline state says it yielded this pass, or None (a state of another kind)."""
    progress = state.get("progress") if isinstance(state, dict) else None
    if isinstance(progress, list) and len(progress) == 2 and type(progress[1]) is int and progress[1] >= 0:
        return progress[1]
    return None


def _state_of(dataset: Any) -> dict:
    """A dataset's exact state (``strict=True`` where it takes it): an inexact one cannot be mixed in."""
    try:
        return dataset.state_dict(strict=True)
    except NotResumableError:  # (a TypeError too: not the one below) an inexact state would restart one source
        raise
    except TypeError:  # a Resumable of the user's without ``strict``
        return dataset.state_dict()
