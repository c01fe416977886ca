"""Fetching a shuffle's buffered samples again on resume, with bounded ranged reads."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from ..errors import CorruptShardError, StateMismatchError, redact
from ..io.urls import is_local

__all__ = ["refetch"]


def _plan(locs: Sequence[tuple]) -> tuple[dict[tuple, list[int]], list[tuple[str, int, int]], dict[str, int]]:
    """(where each wanted sample goes, merged byte runs of plain shards, compressed shards -> bytes to read)."""
    wanted: dict[tuple, list[int]] = {}
    for i, (url, start, _end, _compressed) in enumerate(locs):
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
    return wanted, runs, whole


def refetch(
    locs: Sequence[tuple],
    read_range: Callable[[str, int, int], Any],
    read_from_start: Callable[[str], Any],
    parse: Callable[..., Iterable[tuple[int, dict]]],
    threads: int = 16,
    report: Optional[dict] = None,
) -> list[dict]:
    """The samples at ``locs`` (``(url, start, end, compressed)``), in that order.

    Plain shards: adjacent ranges of one shard are merged and each run is read
    with ``read_range(url, start, end)``, runs in parallel.  Compressed shards
    cannot be entered in the middle: each is read once from its start
    (``read_from_start(url)``) up to its last wanted sample.  ``parse(stream,
    url, start, ranged)`` yields ``(start offset, sample)`` pairs.
    """
    wanted, runs, whole = _plan(locs)
    #: what the state says each wanted sample spans: (url, start) -> end
    stated = {(url, start): end for url, start, end, _ in locs}

    def fetch_run(run: tuple[str, int, int]) -> list[tuple[int, dict]]:
        return _fetch_run(run, read_range, parse, stated)

    def fetch_whole(url: str) -> list[tuple[int, dict]]:
        return _fetch_whole(url, read_from_start, parse, wanted, whole[url])

    if report is not None:
        report.update(
            samples=len(locs),
            requests=len(runs) + len(whole),
            bytes=sum(end - start for _, start, end in runs) + sum(whole.values()),
        )
    jobs = [(fetch_run, run[0], run) for run in runs] + [(fetch_whole, url, url) for url in whole]
    if not jobs:
        return []
    return _in_order(locs, wanted, _run_jobs(jobs, threads))


def _fetch_run(
    run: tuple[str, int, int], read_range: Callable, parse: Callable, stated: dict
) -> list[tuple[int, dict]]:
    """``(offset, sample)`` of one run of a plain shard, read with one ranged read, each sample checked to span
    what the state says."""
    url, start, end = run
    try:
        stream = read_range(url, start, end)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        raise StateMismatchError(  # a local file cannot even be positioned there
            f"{redact(url)}: the saved state's buffered samples at bytes {start}-{end} lie where the shard "
            "cannot be read from; the state was changed: load the state state_dict() returned",
            url=url,
            offset=start,
            field="buffer",
        ) from None
    try:
        pairs = list(parse(stream, url, start, True))
        _check_extents(url, pairs, end, stated)
        return pairs
    except CorruptShardError as exc:  # the range the state names does not hold whole tar members
        raise StateMismatchError(
            f"{redact(url)}: the saved state's buffered samples at bytes {start}-{end} are not whole tar "
            f"members ({exc}); the state was changed, or the shard was: load the state state_dict() returned "
            "for these shards",
            url=url,
            offset=start,
            field="buffer",
        ) from exc
    finally:
        stream.close()


def _fetch_whole(
    url: str, read_from_start: Callable, parse: Callable, wanted: dict, last: int
) -> list[tuple[int, dict]]:
    """``(offset, sample)`` of the wanted samples of a compressed shard, read from its start up to ``last``."""
    stream = read_from_start(url)
    out = []
    try:
        for offset, sample in parse(stream, url, 0, False):
            if (url, offset) in wanted:
                out.append((offset, sample))
            if offset >= last:
                break
    finally:
        stream.close()
    return out


def _check_extents(url: str, pairs: list, end: int, stated: dict) -> None:
    """Each sample of a run spans exactly what the state says: up to the next one, the last to the run's end
    (a range that begins inside a sample gives a part of one, which must never be yielded as a sample)."""
    for i, (offset, _) in enumerate(pairs):
        _check_end(url, offset, pairs[i + 1][0] if i + 1 < len(pairs) else end, stated)


def _check_end(url: str, start: int, end: Optional[int], stated: dict) -> None:
    expected = stated.get((url, start))
    if expected is not None and end is not None and end != expected:
        raise StateMismatchError(
            f"{redact(url)}: the saved state says a buffered sample spans bytes {start}-{expected}, but the "
            f"sample read there ends at byte {end}: the state names a place inside or across samples, so it was "
            "changed (or the shard was): load the state state_dict() returned for these shards",
            url=url,
            offset=start,
            field="buffer",
        )


def _run_jobs(jobs: list, threads: int) -> list:
    """``(url, pairs)`` of every job ``(fetch, url, argument)``."""
    # Local files gain nothing from threads; remote runs go out in parallel, each thread taking a
    # contiguous share of the runs (one task per thread, not per run).
    # More lanes than about twice the cores only add contention (measured on loopback, where the
    # parsing is the cost); against a store's latency, more lanes overlap more waiting.
    local = all(is_local(job[1]) for job in jobs)
    lanes = 1 if local else max(1, min(threads, 2 * (os.cpu_count() or 1), len(jobs)))
    shares = [jobs[i::lanes] for i in range(lanes)]

    def work(share: list) -> list:
        return [(job[1], job[0](job[2])) for job in share]

    if lanes == 1:
        return work(jobs)
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        return [item for part in pool.map(work, shares) for item in part]


def _in_order(locs: Sequence[tuple], wanted: dict, results: list) -> list[dict]:
    """The samples fetched, in the order of ``locs``; refused when one is not where the state says."""
    found: dict[int, dict] = {}
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
            "changed since the state was saved",
            url=url,
            offset=start,
        )
    return [found[i] for i in range(len(locs))]
