"""Member tables at the sizes users run at (issue 50): keeping a table is one lookup, what is kept beside the tables
goes with them, and a table being recorded stops at the bound.

Each test counts (dict walks, bookkeeping entries, bytes a recorder holds, bytes allocated), never times."""

from __future__ import annotations

import collections
import os
import tarfile
import tracemalloc

import pytest

import wds_cloud as wds
from wds_cloud.tar import table as tables
from wds_cloud.tar.table import MemberTable, Recorder


@pytest.fixture(autouse=True)
def fresh_tables(monkeypatch):
    """No table held before or after; files written by a test keep their tables at once (they are seconds old)."""
    tables.forget()
    monkeypatch.setattr(tables, "SETTLED", -1.0)
    yield
    tables.forget()


def _tar(path, names, size=8) -> str:
    """A plain ustar file of members ``names`` of ``size`` bytes each, written without tarfile's record padding."""
    data = b"x" * size
    pad = b"\0" * (-size % 512)
    with open(path, "wb") as f:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = size
            info.mtime = 0
            f.write(info.tobuf(tarfile.USTAR_FORMAT) + data + pad)
        f.write(b"\0" * 1024)
    return str(path)


def _tiny_shards(folder, n) -> list[str]:
    return [_tar(folder / f"t-{i:05d}.tar", [f"s{i:05d}.txt", f"s{i:05d}.cls"]) for i in range(n)]


class _CountingWalks(collections.OrderedDict):
    """The held tables, counting every walk over them (values, items, keys, iteration)."""

    walks = 0

    def values(self):
        type(self).walks += 1
        return super().values()

    def items(self):
        type(self).walks += 1
        return super().items()

    def keys(self):
        type(self).walks += 1
        return super().keys()

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


@pytest.mark.parametrize("zero_copy", [False, True])
def test_keeping_a_table_walks_no_held_table(tmp_path, monkeypatch, zero_copy):
    """A first pass over 20 shards and over 200 keeps every table (split names included) without one walk over
    the tables held: keeping a table is a lookup, whatever is held (it walked them all once per keep)."""
    urls = _tiny_shards(tmp_path, 200)
    walks = []
    for n in (20, 200):
        tables.forget()
        monkeypatch.setattr(tables.CACHE, "tables", _CountingWalks())
        _CountingWalks.walks = 0
        assert len(list(wds.WebDataset(urls[:n], shardshuffle=False, zero_copy=zero_copy))) == n
        kept = list(tables.CACHE.tables.values())
        assert len(kept) == n and all(t._keyed for t in kept)
        walks.append(_CountingWalks.walks - 1)  # less the walk just above
    assert walks == [0, 0]


def test_nothing_beside_the_tables_outgrows_them(tmp_path, monkeypatch):
    """500 tiny shards read under a bound that holds a few tables: the bookkeeping of which tables this process
    kept has an entry per table held at most (it had one per shard ever read), and what is handed over is held."""
    monkeypatch.setenv("WDS_TABLE_CACHE", "2KiB")
    urls = _tiny_shards(tmp_path, 500)
    assert len(list(wds.WebDataset(urls, shardshuffle=False))) == 500
    count, held = tables.held()
    assert 0 < count < 20 and held <= 2048
    assert len(tables.CACHE.kept_by) <= count
    handed = tables.handed()
    assert len(handed) == count and not tables.CACHE.kept_by
    assert all(tables.CACHE.tables[identity] is table for identity, table in handed.items())
    tables.drop(next(iter(handed)))  # a table dropped takes its entry with it
    list(wds.WebDataset(urls[-3:], shardshuffle=False))
    assert len(tables.CACHE.kept_by) <= tables.held()[0]


def _watch_recorders(monkeypatch) -> list:
    """Each flush of a recorder, as (bytes it holds after, what the flush answered)."""
    seen: list = []
    flush = Recorder.flush

    def watched(self, least=Recorder.FLUSH):
        ok = flush(self, least)
        seen.append((self.nbytes, ok))
        return ok

    monkeypatch.setattr(Recorder, "flush", watched)
    return seen


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_recording_stops_at_the_bound(tmp_path, monkeypatch, zero_copy):
    """A first pass over one shard of 8,000 members under a 32 KiB bound: the recorder never holds more than the
    bound and a window's entries, is dropped as soon as it holds more than the bound (no flush after that), no
    table is kept, and every sample is read."""
    monkeypatch.setenv("WDS_TABLE_CACHE", "32KiB")
    url = _tar(tmp_path / "big.tar", (f"m{i:07d}.txt" for i in range(8_000)))
    seen = _watch_recorders(monkeypatch)
    assert len(list(wds.WebDataset(url, shardshuffle=False, zero_copy=zero_copy))) == 8_000
    assert seen and not seen[-1][1] and all(ok for _, ok in seen[:-1])  # stopped once, then asked no more
    window = (1 << 20) // 512 + Recorder.FLUSH  # the entries one window and an unflushed remainder hold at most
    assert all(nbytes <= (32 << 10) + window * 40 for nbytes, _ in seen)
    assert len(seen) < 20  # a flush per window at most, not per member
    assert tables.held() == (0, 0)


def test_the_memory_of_a_first_pass_stays_within_the_bound(tmp_path, monkeypatch):
    """The memory a first pass over a shard of 10,000 members allocates at its peak is within the bound (64 KiB)
    and a constant (768 KiB: a window's entries, the samples in flight): it held the whole table first (1.6 MB)
    and asked the bound after."""
    monkeypatch.setenv("WDS_TABLE_CACHE", "64KiB")
    url = _tar(tmp_path / "big.tar", (f"m{i:07d}.txt" for i in range(10_000)))
    list(wds.WebDataset(url, shardshuffle=False).slice(10))  # every module and lazy table loaded first
    tables.forget()
    ds = wds.WebDataset(url, shardshuffle=False)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        n = sum(1 for _ in ds)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert n == 10_000 and tables.held() == (0, 0)
    assert peak < (64 << 10) + (768 << 10), peak


def test_a_table_recorded_in_many_flushes_is_the_table_of_its_members(tmp_path, monkeypatch):
    """Flushed every few entries (names joined a flush at a time, offsets in arrays), the recorded table is the one
    made from the whole lists at once: the same names, name starts, offsets, sizes and gaps; a second pass reads
    the same samples from it."""
    monkeypatch.setattr(Recorder, "FLUSH", 3)
    names = [f"d/k{i // 2:03d}.{'txt' if i % 2 else 'cls'}" for i in range(41)] + ["", "z.bin"]
    heads = [i * 1024 for i in range(len(names))]
    heads[-1] += 4096  # a gap: a member the table does not hold lies before the last
    sizes = [5] * len(names)
    recorder = Recorder(limit=1 << 20)
    for at in range(0, len(names), 2):
        recorder.names += names[at : at + 2]
        recorder.heads += heads[at : at + 2]
        recorder.sizes += sizes[at : at + 2]
        assert recorder.flush()
    assert len(recorder) == len(names)
    made, whole = recorder.table(), MemberTable(names, heads, sizes)
    assert made is not None and made.nbytes <= whole.nbytes  # no more than a table made at once
    for field in ("names", "name_starts", "heads", "sizes", "gaps", "largest"):
        assert getattr(made, field) == getattr(whole, field), field
    assert [made.name(i) for i in range(len(names))] == names
    url = _tar(tmp_path / "s.tar", (f"k{i // 3:04d}.f{i % 3}" for i in range(100)))
    first = list(wds.WebDataset(url, shardshuffle=False))
    assert tables.held()[0] == 1
    assert list(wds.WebDataset(url, shardshuffle=False)) == first and len(first) == 34


def test_a_recorder_over_a_tiny_bound_keeps_nothing():
    """A bound smaller than the first entries: the first flush says stop, and the table is never made."""
    recorder = Recorder(limit=10)
    recorder.names += ["a.txt"] * 5
    recorder.heads += [0, 1024, 2048, 3072, 4096]
    recorder.sizes += [1] * 5
    assert not recorder.flush(0) and recorder.table() is None


def test_a_table_made_before_the_fork_hook_is_handed_only_by_its_keeper(tmp_path):
    """A forked process starts with no bookkeeping of its parent's tables (and a fresh lock): what it hands over
    is what it kept itself."""
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    urls = _tiny_shards(tmp_path, 2)
    list(wds.WebDataset(urls[:1], shardshuffle=False))
    assert len(tables.CACHE.kept_by) == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            before = len(tables.CACHE.kept_by)
            list(wds.WebDataset(urls[1:], shardshuffle=False))
            handed = tables.handed()
            os.write(write, f"{before} {len(handed)} {tables.held()[0]}".encode())
        finally:
            os._exit(0)
    os.close(write)
    got = b""
    while part := os.read(read, 100):  # until the child exits (it always does: os._exit)
        got += part
    os.close(read)
    os.waitpid(pid, 0)
    assert got.decode().split() == ["0", "1", "2"]
