"""Exact mid-epoch resume: the pieces the resumable stages share.

How it works.  ``DataPipeline.state_dict()`` asks each resumable stage for its
state at the moment the pipeline last yielded (every stage is then suspended
at a yield, so the parts agree):

- the shard list: the epoch (and, when resampling, how many shards were drawn);
- the shard reader (:class:`~wds_cloud.tariterators.TarSamples`): how many of
  this worker's shards it started, the URL of the current one and the byte
  offset where its next sample begins (the next tar header);
- the sample shuffle (:class:`~wds_cloud.filters.Shuffle`): its random
  generator (two integers, :class:`CountedRandom`) and, for every sample in its
  buffer, the shard and byte range it came from (not the sample).

``load_state_dict(state)`` on a freshly built, identical pipeline hands these
back.  On the next pass the reader first fetches the buffered samples again
with ranged reads (:func:`refetch`; adjacent samples are read in one request,
requests run in parallel) and passes them down to the shuffle, which puts them
back in its buffer in their old order; then it opens the current shard at the
saved offset.  Consumed shards are not opened again.

Every state is plain JSON (ints, strings, lists, dicts).  A state that does not
fit the pipeline it is loaded into raises :class:`StateMismatchError` listing
what differs.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence

from ..errors import StateMismatchError, redact

__all__ = ["CountedRandom", "FORMAT", "StateURL", "check_same", "expect", "refetch", "same_url", "shown_url",
           "url_id"]

#: the format tag of a pipeline state; bumped when the layout changes incompatibly
FORMAT = "wds_cloud.state/1"

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
        import random

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


@functools.lru_cache(maxsize=4096)
def url_id(url: str) -> str:
    """What a state keeps of a URL besides its redacted text: a hash that matches it, and no secret."""
    import hashlib

    return hashlib.sha256(str(url).encode("utf-8", "surrogateescape")).hexdigest()[:24]


@functools.lru_cache(maxsize=4096)
def shown_url(url: str) -> str:
    """A URL as a state stores it: redacted (signatures, tokens and passwords never reach a checkpoint)."""
    return redact(url)


class StateURL(str):
    """A URL read from a saved state: its redacted text, and ``id`` (:func:`url_id`) when the state had one."""

    __slots__ = ("id",)

    def __new__(cls, text: str, ident: Optional[str] = None) -> "StateURL":
        obj = super().__new__(cls, text)
        obj.id = ident
        return obj


def same_url(url: str, saved: str, saved_id: Optional[str]) -> bool:
    """Whether the shard list's ``url`` is the one a state saved (by hash when it has one)."""
    return url_id(url) == saved_id if saved_id else url == saved


def expect(state: Any, what: str, kind: type, **fields: Any) -> None:
    """Check a saved state's shape: ``state`` is a ``kind``; each named field has its type (``type``,
    or ``(type, check, optional)``).  A state is input: anything else is StateMismatchError naming the field."""
    if not isinstance(state, kind):
        raise StateMismatchError(f"the saved {what} state is a {type(state).__name__}, not a {kind.__name__}: "
                                 "load the state that state_dict() returned", field=what)
    for name, spec in fields.items():
        typ, check, optional = (spec, None, False) if isinstance(spec, type) else (tuple(spec) + (None, False))[:3]
        if name not in state:
            if optional:
                continue
            raise StateMismatchError(f"the saved {what} state has no {name!r}: load the state that state_dict() "
                                     "returned", field=name)
        value = state[name]
        if value is None and optional:
            continue
        ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if ok and check is not None:
            ok = bool(check(value))
        if not ok:
            raise StateMismatchError(f"the saved {what} state's {name!r} is {value!r:.80}, which no state_dict() "
                                     "gives: the state was changed; load the state that state_dict() returned",
                                     field=name)


def check_same(what: str, saved: dict, current: dict) -> None:
    """Raise :class:`StateMismatchError` naming every key whose value differs between ``saved`` and ``current``."""
    diffs = [f"{key}: saved {saved.get(key)!r}, here {current.get(key)!r}"
             for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]
    if diffs:
        raise StateMismatchError(
            f"the saved state does not fit this {what}: " + "; ".join(diffs) +
            ". Load a state into a dataset built with the same shards, seed, splitting, shuffle and "
            "worker count (one state per rank and worker)", differences=diffs)


def _is_local(url: str) -> bool:
    from ..io.registry import split_scheme

    return split_scheme(url)[0] in (None, "file")


def refetch(locs: Sequence[tuple], read_range: Callable[[str, int, int], Any],
            read_from_start: Callable[[str], Any], parse: Callable[..., Iterable[tuple[int, dict]]],
            threads: int = 16, report: Optional[dict] = None) -> list[dict]:
    """The samples at ``locs`` (``(url, start, end, compressed)``), in that order.

    Plain shards: adjacent ranges of one shard are merged and each run is read
    with ``read_range(url, start, end)``, runs in parallel.  Compressed shards
    cannot be entered in the middle: each is read once from its start
    (``read_from_start(url)``) up to its last wanted sample.  ``parse(stream,
    url, start, ranged)`` yields ``(start offset, sample)`` pairs.
    """
    wanted: dict[tuple, list[int]] = {}
    for i, (url, start, end, compressed) in enumerate(locs):
        wanted.setdefault((url, start), []).append(i)  # a sample repeated by equal_work can be buffered twice
    runs: list[tuple[str, int, int]] = []
    whole: dict[str, int] = {}
    for url, start, end, compressed in sorted(set(locs)):
        if compressed:
            whole[url] = max(whole.get(url, 0), end)
        elif runs and runs[-1][0] == url and runs[-1][2] == start:
            runs[-1] = (url, runs[-1][1], end)
        else:
            runs.append((url, start, end))
    found: dict[int, dict] = {}

    def fetch_run(run: tuple[str, int, int]) -> list[tuple[int, dict]]:
        url, start, end = run
        stream = read_range(url, start, end)
        try:
            return [(offset, sample) for offset, sample in parse(stream, url, start, True)]
        finally:
            stream.close()

    def fetch_whole(url: str) -> list[tuple[int, dict]]:
        stream = read_from_start(url)
        out = []
        try:
            for offset, sample in parse(stream, url, 0, False):
                if (url, offset) in wanted:
                    out.append((offset, sample))
                if offset >= whole[url]:
                    break
        finally:
            stream.close()
        return out

    if report is not None:
        report.update(samples=len(locs), requests=len(runs) + len(whole),
                      bytes=sum(end - start for _, start, end in runs) + sum(whole.values()))
    jobs = [(fetch_run, run[0], run) for run in runs] + [(fetch_whole, url, url) for url in whole]
    if not jobs:
        return []
    # Local files gain nothing from threads; remote runs go out in parallel, each thread taking a
    # contiguous share of the runs (one task per thread, not per run).
    # More lanes than about twice the cores only add contention (measured on loopback, where the
    # parsing is the cost); against a store's latency, more lanes overlap more waiting.
    local = all(_is_local(job[1]) for job in jobs)
    lanes = 1 if local else max(1, min(threads, 2 * (os.cpu_count() or 1), len(jobs)))
    shares = [jobs[i::lanes] for i in range(lanes)]

    def work(share: list) -> list:
        return [(job[1], job[0](job[2])) for job in share]

    if lanes == 1:
        results = work(jobs)
    else:
        with ThreadPoolExecutor(max_workers=lanes) as pool:
            results = [item for part in pool.map(work, shares) for item in part]
    for url, pairs in results:
        for offset, sample in pairs:
            for n, index in enumerate(wanted.get((url, offset), ())):
                found[index] = sample if n == 0 else dict(sample)
    missing = [locs[i] for i in range(len(locs)) if i not in found]
    if missing:
        url, start, end, _ = missing[0]
        raise StateMismatchError(
            f"{redact(url)}: no sample starts at byte {start} (expected one ending at {end}); "
            f"{len(missing)} buffered sample(s) of the saved state are not where it says: the shard "
            "changed since the state was saved", url=url, offset=start)
    return [found[i] for i in range(len(locs))]
