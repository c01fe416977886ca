"""Exact mid-epoch resume: the pieces the resumable stages share.

How it works.  ``DataPipeline.state_dict()`` asks each resumable stage for its
state at the moment the pipeline last yielded (every stage is then suspended
at a yield, so the parts agree):

- the shard list: the epoch (and, when resampling, how many shards were drawn);
- the shard reader (:class:`~wds_cloud.tariterators.TarSamples`): how many of
  this worker's shards it started, the URL of the current one and the byte
  offset where its next sample begins (the next tar header);
- the sample shuffle (:class:`~wds_cloud.filters.Shuffle`): its random
  generator (two integers, :class:`SplitMix`) and, for every sample in its
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

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence

from .errors import StateMismatchError, redact

__all__ = ["SplitMix", "FORMAT", "check_same", "refetch", "pack_locations", "unpack_locations"]

#: the format tag of a pipeline state; bumped when the layout changes incompatibly
FORMAT = "wds_cloud.state/1"

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class SplitMix:
    """A small counter-based random generator (SplitMix64): its whole state is ``(seed, count)``.

    ``randbelow(n)`` is the ``count``-th draw; saving and restoring the two
    integers restores the sequence exactly, which ``random.Random`` (a 2.5 KB
    state) cannot do cheaply.
    """

    __slots__ = ("seed", "count")

    def __init__(self, seed: Optional[int] = None, count: int = 0) -> None:
        self.seed = (int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)) & _MASK
        self.count = count

    def next64(self) -> int:
        self.count += 1
        z = (self.seed + self.count * _GOLDEN) & _MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def randbelow(self, n: int) -> int:
        """A uniform integer in ``[0, n)`` (the bias of the modulo is below 2**-40 for n < 2**24)."""
        return self.next64() % n

    def randint(self, a: int, b: int) -> int:
        return a + self.randbelow(b - a + 1)

    def random(self) -> float:
        return (self.next64() >> 11) / float(1 << 53)

    def getstate(self) -> list:
        return [self.seed, self.count]

    def setstate(self, state: Sequence[int]) -> None:
        self.seed, self.count = int(state[0]) & _MASK, int(state[1])


def check_same(what: str, saved: dict, current: dict) -> None:
    """Raise :class:`StateMismatchError` naming every key whose value differs between ``saved`` and ``current``."""
    diffs = [f"{key}: saved {saved.get(key)!r}, here {current.get(key)!r}"
             for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]
    if diffs:
        raise StateMismatchError(
            f"the saved state does not fit this {what}: " + "; ".join(diffs) +
            ". Load a state into a dataset built with the same shards, seed, splitting, shuffle and "
            "worker count (one state per rank and worker)", differences=diffs)


def pack_locations(locs: Iterable[tuple]) -> dict:
    """``(url, start, end, compressed)`` tuples as JSON: a URL table and a flat ``[url#, start, length]`` list."""
    table: dict[tuple, int] = {}
    flat: list[int] = []
    for url, start, end, compressed in locs:
        ref = table.setdefault((url, bool(compressed)), len(table))
        flat.extend((ref, start, end - start))
    return {"urls": [[u, c] for (u, c) in table], "samples": flat}


def unpack_locations(packed: Optional[dict]) -> list[tuple]:
    """The inverse of :func:`pack_locations`."""
    if not packed:
        return []
    urls = packed["urls"]
    flat = packed["samples"]
    out = []
    for i in range(0, len(flat), 3):
        url, compressed = urls[flat[i]]
        out.append((url, flat[i + 1], flat[i + 1] + flat[i + 2], bool(compressed)))
    return out


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
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(jobs)))) as pool:
        results = list(pool.map(lambda job: (job[1], job[0](job[2])), jobs))
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
