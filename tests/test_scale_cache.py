"""A size-bounded shard cache at scale: a miss costs the same work at 20 entries as at 200 (counted, not timed),
processes sharing one cache agree on what it holds and keep its bound, and its ledger is data from an untrusted
writer: a torn or forged line is ignored, a damaged ledger rebuilt, and nothing outside the directory touched."""

import contextlib
import functools
import json
import multiprocessing
import os
import pathlib
import stat
import threading

import pytest

from wds_cloud.io import cacheledger, shardcache
from wds_cloud.io.shardcache import ShardCache

from .remote import Remote

SIZE = 1000
DATA = os.urandom(SIZE)
WAIT = 60  # seconds a step may take before it counts as a hang (each takes well under one)


def fill(cache: ShardCache, url: str, data: bytes = DATA) -> bytes:
    with cache.open(url, lambda offset: Remote(data, offset)) as stream:
        return stream.read()


def url(i) -> str:
    return f"https://host/data/shard-{i}.tar"


def on_disk(directory) -> int:
    """Bytes of the entries and fills in the directory (other processes may remove some meanwhile)."""
    total = 0
    for root, _, names in os.walk(directory):
        for n in names:
            if n.endswith((".tar", ".part")):
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(root, n))
    return total


def ledger_path(cache: ShardCache) -> str:
    return os.path.join(cache.directory, cacheledger.LEDGER)


def newcomer(directory) -> tuple:
    """(entries, bytes) by the ledger as a process that has not read it yet sees them."""
    fresh = cacheledger.Ledger(str(directory), functools.partial(shardcache._scan, str(directory)))
    with fresh.locked() as ledger:
        return len(ledger), ledger.total


def plant_old_entries(cache: ShardCache, n: int, start: int = 0) -> None:
    """Entries as a version without a ledger left them: the file and its complete record, oldest first."""
    os.makedirs(cache.directory, exist_ok=True)
    for i in range(start, start + n):
        path = cache.path_for(url(i))
        with open(path, "wb") as f:
            f.write(DATA)
        st = os.stat(path)
        os.utime(path, ns=(10**18 + i, st.st_mtime_ns))
        record = {"url": url(i), "size": SIZE, "version": "v1", "md5": None, "complete": True, "crc32": None}
        with open(path + ".meta", "w") as f:
            json.dump(dict(record, mtime_ns=st.st_mtime_ns), f)


@pytest.fixture
def counted(monkeypatch):
    """Counts of the records read, the directory walks made and the ledger lines read."""
    counts = {"meta": 0, "walk": 0, "lines": 0}
    read_meta, walk, apply_line = shardcache._read_meta, os.walk, cacheledger.Ledger._apply_line

    def counting_read_meta(path):
        counts["meta"] += 1
        return read_meta(path)

    def counting_walk(*args, **kw):
        counts["walk"] += 1
        return walk(*args, **kw)

    def counting_apply_line(self, line):
        counts["lines"] += 1
        return apply_line(self, line)

    monkeypatch.setattr(shardcache, "_read_meta", counting_read_meta)
    monkeypatch.setattr(shardcache.os, "walk", counting_walk)
    monkeypatch.setattr(cacheledger.Ledger, "_apply_line", counting_apply_line)
    return counts


def test_a_miss_reads_as_many_records_at_200_entries_as_at_20(tmp_path, counted):
    """Records read, directory walks and ledger lines read per miss of a full bounded cache do not grow with the
    entries it holds, even with a new cache object per miss (as a reader made per read has)."""
    per_miss = {}
    for n in (20, 200):
        directory = str(tmp_path / f"c{n}")
        cache = ShardCache(directory, size_limit=n * SIZE)
        plant_old_entries(cache, n)
        fill(cache, url("first"))  # the first miss of a process finds no ledger: one walk
        assert counted["walk"] == 1 and cache.usage() == (n, n * SIZE)
        counted.update(meta=0, walk=0, lines=0)
        for i in range(10):
            assert fill(ShardCache(directory, size_limit=n * SIZE), url(f"new-{i}")) == DATA
        per_miss[n] = {k: v / 10 for k, v in counted.items()}
        counted.update(meta=0, walk=0, lines=0)
        assert len([f for f in os.listdir(directory) if f.endswith(".tar")]) == n
    assert per_miss[20] == per_miss[200]
    assert per_miss[200]["walk"] == per_miss[200]["lines"] == 0 and per_miss[200]["meta"] <= 3


def test_entries_an_older_version_left_are_found_and_evicted_oldest_first(tmp_path):
    """Without a ledger, the first bounded miss walks the directory once and evicts by last access."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=5 * SIZE)
    plant_old_entries(cache, 8)
    fill(cache, url("new"))
    kept = sorted(f for f in os.listdir(cache.directory) if f.endswith(".tar"))
    assert kept == sorted(os.path.basename(cache.path_for(u)) for u in [url(4), url(5), url(6), url(7), url("new")])
    assert cache.usage() == newcomer(cache.directory) == (5, 5 * SIZE)


def test_an_entry_read_since_it_was_queued_gets_a_second_chance(tmp_path):
    """The clock evicts the least recently used: an entry hit after it was stored outlives one never read again."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=3 * SIZE)
    for i in range(3):
        fill(cache, url(i))
    assert fill(cache, url(0)) == DATA  # a hit
    fill(cache, url(3))
    assert os.path.exists(cache.path_for(url(0))) and not os.path.exists(cache.path_for(url(1)))


def test_an_entry_held_by_a_reader_is_not_evicted(tmp_path):
    """An entry open for reading survives any number of misses past the bound, and is evicted once closed."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=3 * SIZE)
    fill(cache, url(0))
    held = cache.open(url(0), lambda offset: Remote(DATA, offset))
    try:
        for i in range(1, 10):
            fill(cache, url(i))
        assert os.path.exists(cache.path_for(url(0)))
        assert held.read() == DATA
    finally:
        held.close()
    for i in range(10, 20):  # the read itself may count as an access (relatime): a second chance, then out
        fill(cache, url(i))
    assert not os.path.exists(cache.path_for(url(0)))
    assert on_disk(cache.directory) <= 3 * SIZE


def _share(directory, limit, me, misses, go, finished, report):
    """A process of a node filling the shared cache; it reports the most bytes it saw on disk, then its view."""
    cache = ShardCache(directory, size_limit=limit)
    go.wait()
    most = 0
    for i in range(misses):
        fill(cache, url(f"{me}-{i}"))
        most = max(most, on_disk(directory))
    report.send(most)
    finished.wait()
    report.send(cache.usage())
    report.close()


def test_processes_sharing_a_bounded_cache_agree_on_what_it_holds(tmp_path):
    """Four processes filling one cache at once: the disk never holds more than the bound plus one fill each,
    and afterwards every process's view is what the directory holds."""
    context = multiprocessing.get_context("fork")
    directory, limit, processes, misses = str(tmp_path / "c"), 6 * SIZE, 4, 8
    go, finished = context.Event(), context.Event()
    pipes, children = [], []
    for me in range(processes):
        ours, theirs = context.Pipe(duplex=False)
        child = context.Process(target=_share, args=(directory, limit, me, misses, go, finished, theirs))
        child.start()
        theirs.close()
        pipes.append(ours)
        children.append(child)
    go.set()
    most = [pipe.recv() for pipe in pipes]
    finished.set()
    views = [pipe.recv() for pipe in pipes]
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    held = on_disk(directory)
    assert max(most) <= limit + processes * SIZE
    assert held <= limit
    entries = len([f for f in os.listdir(directory) if f.endswith(".tar")])
    assert views == [(entries, held)] * processes
    assert newcomer(directory) == (entries, held)


def viewed_at_rest(cache: ShardCache) -> tuple:
    """(entries, bytes) the ledger holds once every fill ended, the same for this process's view and a newcomer's."""
    seen = cache.usage()
    assert newcomer(cache.directory) == seen
    return seen


def finish_in_a_thread(stream, monkeypatch) -> tuple:
    """Read ``stream`` to its end and close it in a thread: (the thread, an event set once its fill lock is let go)."""
    released = threading.Event()
    release = shardcache.CachedShard._release

    def releasing(self):
        was_held = self._lock is not None
        release(self)
        if was_held and self is stream:
            released.set()

    def run():
        stream.read()
        stream.close()

    monkeypatch.setattr(shardcache.CachedShard, "_release", releasing)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, released


@pytest.mark.parametrize("moment", ["after its record was read", "between its record and its rename"])
def test_a_fill_that_publishes_while_a_pass_looks_at_it_is_counted_and_evicted_whole(tmp_path, monkeypatch, moment):
    """A fill published (and its lock let go) while another process's eviction pass looks at it, at either moment,
    leaves no file without its record and none uncounted: at rest the directory is within its bound and is what
    every view says it holds."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=SIZE)
    first = cache.open(url(0), lambda offset: Remote(DATA, offset))
    assert len(first.read(10)) == 10  # a fill in progress, its lock held
    path = cache.path_for(url(0))
    threads = []
    if moment == "after its record was read":
        read_meta = shardcache._read_meta

        def publish_after_reading(at):
            meta = read_meta(at)
            if at == path and not threads and meta is not None and not meta.get("complete"):
                thread, released = finish_in_a_thread(first, monkeypatch)  # the filler publishes and lets go, right now
                threads.append(thread)
                assert released.wait(WAIT)
            return meta

        monkeypatch.setattr(shardcache, "_read_meta", publish_after_reading)
        fill(cache, url(1))  # its pass looks at the fill of url(0)
    else:
        write_meta, recorded, resume = shardcache._write_meta, threading.Event(), threading.Event()

        def pause_before_the_rename(at, meta):
            write_meta(at, meta)
            if at == path and meta.get("complete"):
                recorded.set()  # the record says complete; the entry is still N.part
                assert resume.wait(WAIT)

        monkeypatch.setattr(shardcache, "_write_meta", pause_before_the_rename)
        thread, _ = finish_in_a_thread(first, monkeypatch)
        threads.append(thread)
        assert recorded.wait(WAIT)
        fill(cache, url(1))  # its pass looks at url(0) between its record and its rename
        resume.set()
    threads[0].join(WAIT)
    assert not threads[0].is_alive() and first.closed
    entries = [f for f in os.listdir(cache.directory) if f.endswith(".tar")]
    assert all(os.path.exists(os.path.join(cache.directory, f + ".meta")) for f in entries)  # none left unrecorded
    assert on_disk(cache.directory) <= SIZE
    assert viewed_at_rest(cache) == (len(entries), on_disk(cache.directory)) == (1, SIZE)


@pytest.mark.parametrize("ends", ["published", "stopped early"])
def test_fills_that_ran_at_once_leave_the_cache_within_its_bound_once_they_end(tmp_path, ends):
    """A pass cannot evict a fill in progress, so fills running at once may hold the directory over its bound;
    the last one to end (published, or stopped early) brings it back within it."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=SIZE)
    first = cache.open(url(0), lambda offset: Remote(DATA, offset))
    assert len(first.read(10)) == 10  # a fill in progress, its lock held
    fill(cache, url(1))  # its pass finds only the fill of url(0) to evict, and cannot
    if ends == "published":
        assert first.read() == DATA[10:]
    first.close()
    assert on_disk(cache.directory) <= SIZE
    assert os.path.exists(cache.path_for(url(0)) + ("" if ends == "published" else ".part"))  # the last one read
    assert viewed_at_rest(cache) == (1, SIZE)  # a stopped fill counts at its announced size, to be resumed


def test_a_torn_last_line_is_closed_and_never_trusted(tmp_path):
    """A process killed while appending leaves a partial record: the next writer makes it an ignored line."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=5 * SIZE)
    for i in range(3):
        fill(cache, url(i))
    with open(ledger_path(cache), "ab") as f:
        f.write(b"+ 900000 12 " + os.path.basename(cache.path_for(url(1))).encode()[:5])
    fill(cache, url(3))
    assert b"\0\n+ " in pathlib.Path(ledger_path(cache)).read_bytes()
    assert newcomer(cache.directory) == cache.usage() == (4, 4 * SIZE)


FORGED = [
    b"+ 10 0 ../outside.tar",
    b"+ 10 0 %2e%2e/outside.tar",
    b"+ 10 0 ..%2foutside.tar",
    b"+ 10 0 /OUTSIDE/outside.tar",
    b"+ 10 0 %2FOUTSIDE/outside.tar",
    b"+ 10 0 a/../../outside.tar",
    b"+ 10 0 .hidden",
    b"+ 10 0 bad%00name",
    b"+ 10 0 bad%ffname",
    b"+ -5 0 negative.tar",
    b"+ 1e999 0 float.tar",
    b"+ 99999999999999999999999 0 huge.tar",
    b"+ 10 0",
    b"- ../outside.tar",
    b"* 10 0 star.tar",
    b"+ 10 0 " + b"x" * 100_000,
    b"\xff\xfe garbage",
]


def test_forged_ledger_lines_are_ignored_and_never_lead_outside(tmp_path):
    """Lines naming paths out of the directory in any spelling, bad numbers and junk are ignored; files outside,
    a folder linked from inside, and a file without a record of ours are never deleted."""
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "x.tar"
    precious.write_bytes(DATA)
    (outside / "x.tar.meta").write_text(json.dumps({"size": SIZE, "complete": True, "mtime_ns": 0}))
    (tmp_path / "outside.tar").write_bytes(DATA)
    cache = ShardCache(str(tmp_path / "c"), size_limit=3 * SIZE)
    fill(cache, url(0))
    os.symlink(outside, os.path.join(cache.directory, "link"))
    stranger = os.path.join(cache.directory, "users-own-file.tar")
    with open(stranger, "wb") as f:
        f.write(DATA)
    forged = [line.replace(b"/OUTSIDE", str(outside).encode()) for line in FORGED]
    forged += [b"+ 1000 0 link/x.tar", b"+ 1000 0 users-own-file.tar"]
    with open(ledger_path(cache), "ab") as f:
        f.write(b"\n".join(forged) + b"\n")
    for i in range(1, 8):
        assert fill(cache, url(i)) == DATA
    assert precious.read_bytes() == DATA and (outside / "x.tar.meta").exists()
    assert (tmp_path / "outside.tar").read_bytes() == DATA
    assert pathlib.Path(stranger).read_bytes() == DATA
    entries = [f for f in os.listdir(cache.directory) if f.endswith(".tar") and f != "users-own-file.tar"]
    assert cache.usage() == (len(entries), len(entries) * SIZE) and len(entries) <= 3


@pytest.mark.parametrize("planted", ["link", "fifo", "header", "stranger-header"])
def test_a_ledger_that_is_not_ours_is_rebuilt(tmp_path, planted):
    """A link, a FIFO or a file that does not begin as our ledger is replaced by one walk of the directory;
    what a link pointed to is untouched."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=3 * SIZE)
    for i in range(2):
        fill(cache, url(i))
    path = ledger_path(cache)
    os.unlink(path)
    target = tmp_path / "target"
    target.write_bytes(cacheledger.HEADER + b"+ 5 0 target-entry.tar\n")
    if planted == "link":
        os.symlink(target, path)
    elif planted == "fifo":
        os.mkfifo(path)
    elif planted == "header":
        with open(path, "wb") as f:
            f.write(b"wds-cloud cache ledger 99\n+ 5 0 a.tar\n")
    else:
        with open(path, "wb") as f:
            f.write(b'{"json": "not a ledger"}\n')
    assert cache.usage() == (2, 2 * SIZE)  # this process's view: it notices the file changed
    st = os.stat(path, follow_symlinks=False)
    assert stat.S_ISREG(st.st_mode) and pathlib.Path(path).read_bytes().startswith(cacheledger.HEADER)
    assert target.read_bytes() == cacheledger.HEADER + b"+ 5 0 target-entry.tar\n"
    for i in range(2, 6):
        fill(cache, url(i))
    assert on_disk(cache.directory) <= 3 * SIZE
    assert newcomer(cache.directory) == cache.usage()


def test_an_abandoned_fill_is_evicted_and_its_files_removed(tmp_path):
    """A fill whose process died (its record incomplete, nobody holding its lock) is counted, then removed."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=3 * SIZE)
    fill(cache, url(0))
    dead = cache.path_for(url("dead"))
    with open(dead + ".part", "wb") as f:
        f.write(DATA[:500])
    with open(dead + ".meta", "w") as f:
        json.dump({"url": "x", "size": SIZE, "version": "v1", "md5": None, "complete": False}, f)
    os.unlink(ledger_path(cache))  # as the dead process left it: unrecorded, found by the walk
    fresh = ShardCache(cache.directory, size_limit=3 * SIZE)
    assert fresh.usage() == (2, 2 * SIZE)
    for i in range(1, 4):
        fill(fresh, url(i))
    assert not any(os.path.exists(dead + s) for s in ("", ".part", ".meta", ".lock"))


def test_the_ledger_is_compacted_so_it_stays_proportional_to_what_is_held(tmp_path, monkeypatch):
    """Many misses through a small cache leave a ledger of a bounded number of lines."""
    monkeypatch.setattr(cacheledger, "MIN_COMPACT", 4)
    cache = ShardCache(str(tmp_path / "c"), size_limit=4 * SIZE)
    for i in range(30):
        fill(cache, url(i))
    lines = pathlib.Path(ledger_path(cache)).read_bytes().count(b"\n")
    assert lines <= 2 * (4 + 4) + 3
    assert newcomer(cache.directory) == cache.usage() == (4, 4 * SIZE)


def test_a_damaged_entry_found_by_a_hit_leaves_the_ledger(tmp_path):
    """An entry discarded as damaged is recorded as gone: the total does not keep counting it."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=3 * SIZE)
    for i in range(2):
        fill(cache, url(i))
    with open(cache.path_for(url(0)), "ab") as f:
        f.write(b"more")  # no longer the size recorded
    assert fill(cache, url(0)) == DATA  # fetched again
    assert cache.usage() == newcomer(cache.directory) == (2, 2 * SIZE)


def test_a_folder_planted_as_the_ledger_costs_no_read(tmp_path):
    """With an empty folder where the ledger goes, misses still read, the folder is replaced and the bound holds."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=3 * SIZE)
    fill(cache, url(0))
    os.unlink(ledger_path(cache))
    os.mkdir(ledger_path(cache))
    for i in range(1, 6):
        assert fill(cache, url(i)) == DATA
    assert on_disk(cache.directory) <= 3 * SIZE and os.path.isfile(ledger_path(cache))


def test_a_ledger_listing_more_entries_than_any_cache_holds_is_rebuilt(tmp_path, monkeypatch):
    """Claims of a forged ledger bound nothing: past the most entries a view holds, the directory is walked."""
    monkeypatch.setattr(cacheledger, "MAX_ENTRIES", 5)
    cache = ShardCache(str(tmp_path / "c"), size_limit=3 * SIZE)
    fill(cache, url(0))
    with open(ledger_path(cache), "ab") as f:
        f.write(b"".join(b"+ 1 0 forged-%d.tar\n" % i for i in range(50)))
    assert newcomer(cache.directory) == (1, SIZE)


class Unsized(Remote):
    """A stream of unknown length (a pipe): the cache learns its size at its end."""

    def __init__(self, data: bytes, offset: int = 0) -> None:
        super().__init__(data, offset)
        self.size = None


def test_an_unsized_fill_that_cannot_apply_the_bound_at_its_end_leaves_no_unrecorded_entry(tmp_path):
    """A stream of unknown length whose end cannot reach the ledger (a folder with files in it planted as its lock)
    is read whole, and leaves no shard on disk without its record nor more bytes than the ledger counts."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=3 * SIZE)
    stream = cache.open(url(0), lambda offset: Unsized(DATA, offset))
    assert len(stream.read(10)) == 10  # the fill began, recorded at 0 bytes (its size is not known yet)
    guard = os.path.join(cache.directory, cacheledger.GUARD)
    os.unlink(guard)
    os.mkdir(guard)
    with open(os.path.join(guard, "keep"), "wb") as f:
        f.write(b"precious")  # a folder the cache cannot remove
    assert stream.read() == DATA[10:]  # the read is not failed
    stream.close()
    entries = [f for f in os.listdir(cache.directory) if f.endswith(".tar")]
    assert all(os.path.exists(os.path.join(cache.directory, f + ".meta")) for f in entries)
    os.unlink(os.path.join(guard, "keep"))
    os.rmdir(guard)  # the ledger can be used again: nothing on disk escapes its count
    assert on_disk(cache.directory) <= newcomer(cache.directory)[1]
    assert fill(cache, url(0)) == DATA and viewed_at_rest(cache) == (1, SIZE)


def test_forgetting_a_damaged_entry_never_drops_a_new_fill_of_its_name(tmp_path, monkeypatch):
    """A damaged entry is discarded and forgotten while a new fill of the same shard may begin (another process):
    that fill, once recorded, stays counted, so the ledger never holds less than is on disk."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=3 * SIZE)
    fill(cache, url(0))
    path = cache.path_for(url(0))
    with open(path, "ab") as f:
        f.write(b"more")  # no longer the size recorded: the next hit discards it
    decided, other = threading.Event(), []
    forget, try_lock, make_room = ShardCache.forget, shardcache._try_lock, ShardCache.make_room

    def refusing(at, *args):  # the other fill finds the entry's fill lock held: it waits for it
        lock = try_lock(at, *args)
        if lock is None and at == path + ".lock" and threading.current_thread() in other:
            decided.set()
        return lock

    def recording(self, keep, size=None):  # the other fill is recorded
        make_room(self, keep, size)
        if keep == path and threading.current_thread() in other:
            decided.set()

    def forgetting(self, at):
        if at == path and not other:  # the discard forgets: another fill of the shard begins right now
            other.append(threading.Thread(target=fill, args=(cache, url(0)), daemon=True))
            other[0].start()
            assert decided.wait(WAIT)  # it is recorded, or waits for the lock the discard holds
        forget(self, at)

    monkeypatch.setattr(shardcache, "_try_lock", refusing)
    monkeypatch.setattr(ShardCache, "make_room", recording)
    monkeypatch.setattr(ShardCache, "forget", forgetting)
    assert fill(cache, url(0)) == DATA  # a hit finds the entry damaged, discards it, and reads the shard
    other[0].join(WAIT)
    assert not other[0].is_alive()
    assert os.path.getsize(path) == SIZE and os.path.exists(path + ".meta")
    assert viewed_at_rest(cache) == (1, SIZE) == (1, on_disk(cache.directory))
