"""A bounded shard cache read for several epochs: a loop over more shards than it holds still hits (about C of W
reads an epoch, where least-recently-used evicts each shard just before its reuse), the thrashing is said once with
the figures and the fix, and counted; a cache that fits, and readers of one shard moments apart, behave as before."""

import logging
import multiprocessing
import os
import random
import re

from wds_cloud.io import cacheledger, shardcache
from wds_cloud.io.shardcache import ShardCache

from .remote import Remote

SIZE = 1000
DATA = os.urandom(SIZE)
C = 8  # entries the cache holds


def read(cache: ShardCache, i: int) -> None:
    with cache.open(f"https://host/data/shard-{i}.tar", lambda offset: Remote(DATA, offset)) as stream:
        assert stream.read() == DATA


def epochs(cache: ShardCache, shards: int, count: int = 3, seed=None) -> list:
    """Hits per epoch reading ``shards`` shards in a fixed order (or one shuffled anew each epoch by ``seed``)."""
    rng, hits = random.Random(seed), []
    for _ in range(count):
        order = list(range(shards))
        if seed is not None:
            rng.shuffle(order)
        before = cache.stats.snapshot().cache_hits
        for i in order:
            read(cache, i)
        hits.append(cache.stats.snapshot().cache_hits - before)
    return hits


def bounded(tmp_path) -> ShardCache:
    return ShardCache(str(tmp_path / "c"), size_limit=C * SIZE)


def test_a_loop_twice_the_cache_keeps_most_of_the_cache_for_the_next_epoch(tmp_path):
    """W = 2C in a fixed order: the third epoch hits C - 1 shards (Belady's optimum), not 0."""
    cache = bounded(tmp_path)
    hits = epochs(cache, 2 * C)
    assert hits[2] >= C - 1, hits
    assert cache.stats.snapshot().cache_reuse_misses > 0


def test_a_loop_one_shard_over_the_cache_keeps_most_of_it(tmp_path):
    """W = C + 1 in a fixed order: the third epoch hits C - 1 of C + 1 shards, not 0."""
    assert epochs(bounded(tmp_path), C + 1)[2] >= C - 1


def test_a_loop_that_fits_hits_every_shard_after_the_first_epoch(tmp_path):
    """W = C/2: every read after the first epoch hits, nothing is evicted or counted as a reuse miss."""
    cache = bounded(tmp_path)
    assert epochs(cache, C // 2) == [0, C // 2, C // 2]
    stats = cache.stats.snapshot()
    assert stats.cache_evictions == stats.cache_reuse_misses == 0


def test_a_shuffled_loop_twice_the_cache_hits_well_above_least_recently_used(tmp_path):
    """W = 2C, shuffled anew each epoch (seeded): least-recently-used hits 5 in epochs 3 to 5; this, twice as many
    at least (a protected shard gives way by how long it went unread, so the margin is wide)."""
    hits = epochs(bounded(tmp_path), 2 * C, count=5, seed=1)
    assert sum(hits[2:]) >= 10, hits


def test_thrashing_is_said_once_with_the_figures_and_the_fix(tmp_path, caplog):
    """One warning per process: the cache's size, the bytes fetched between two reads of a shard, the hit rate,
    and the setting to raise (to at least the working set)."""
    cache = bounded(tmp_path)
    with caplog.at_level(logging.WARNING, logger="wds_cloud.io.shardcache"):
        epochs(cache, 2 * C)
    said = [r.getMessage() for r in caplog.records if "thrashes" in r.getMessage()]
    assert len(said) == 1, said
    assert "cache_size 8kB" in said[0] and "up to 16kB" in said[0] and "at least 16kB" in said[0]
    assert "WDS_CACHE_SIZE" in said[0] and "hits are 0 of" in said[0] and cache.directory in said[0]


def test_no_warning_when_the_loop_fits(tmp_path, caplog):
    """A loop that fits the cache is never reported as thrashing."""
    with caplog.at_level(logging.WARNING, logger="wds_cloud.io.shardcache"):
        epochs(bounded(tmp_path), C)
    assert not [r for r in caplog.records if "thrashes" in r.getMessage()]


def test_a_view_read_afresh_sees_the_protected_entries(tmp_path):
    """The ledger records protection: a process that reads it from the start (or after a compaction) keeps the
    same entries for the next epoch, and every line of it is one a version without protection reads too."""
    cache = bounded(tmp_path)
    epochs(cache, 2 * C)
    view = cacheledger.view_of(cache.directory, lambda: [])
    fresh = cacheledger.Ledger(cache.directory, lambda: [])
    with fresh.locked():
        assert list(fresh.protected) == list(view.protected) and len(fresh.protected) == C - 1
        assert (len(fresh), fresh.total) == (len(view), view.total)
    view._write_whole()  # a compaction
    again = cacheledger.Ledger(cache.directory, lambda: [])
    with again.locked():
        assert list(again.protected) == list(view.protected)


def test_the_ghost_stays_bounded_by_the_entries(tmp_path, monkeypatch):
    """Evictions are remembered up to a multiple of the entries held, however many shards pass."""
    monkeypatch.setattr(cacheledger, "GHOST_MIN", 0)
    cache = bounded(tmp_path)
    for i in range(5 * C):
        read(cache, i)
    view = cacheledger.view_of(cache.directory, lambda: [])
    assert cache.stats.snapshot().cache_evictions == 4 * C
    assert len(view.ghost) == cacheledger.GHOST_FACTOR * len(view) == 2 * C


def _rank(directory, me, shards, barrier, report):
    """A rank of a node: reads the loop in lockstep with the other ranks (one shard, then all wait)."""
    cache = ShardCache(directory, size_limit=C * SIZE)
    hits = []
    for _ in range(3):
        before = cache.stats.snapshot().cache_hits
        for i in range(shards):
            if me == 0:
                read(cache, i)
            barrier.wait()
            if me != 0:
                read(cache, i)
            barrier.wait()
        hits.append(cache.stats.snapshot().cache_hits - before)
    report.send(hits)
    report.close()


def test_ranks_sharing_the_cache_read_a_just_fetched_shard_and_keep_the_loop(tmp_path):
    """Three processes reading the same loop of 2C shards moments apart: the followers hit every shard the first
    one fetched, and the first one's third epoch hits C - 1 shards."""
    context = multiprocessing.get_context("fork")
    ranks, barrier = 3, context.Barrier(3)
    pipes, children = [], []
    for me in range(ranks):
        ours, theirs = context.Pipe(duplex=False)
        child = context.Process(target=_rank, args=(str(tmp_path / "c"), me, 2 * C, barrier, theirs))
        child.start()
        theirs.close()
        pipes.append(ours)
        children.append(child)
    hits = [pipe.recv() for pipe in pipes]
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    assert hits[1] == hits[2] == [2 * C] * 3
    assert hits[0][2] >= C - 1, hits


def test_a_thrashing_miss_reads_as_many_records_at_32_entries_as_at_4(tmp_path, monkeypatch):
    """Protection keeps a miss constant work: the records read per miss of a thrashing loop's third epoch do not
    grow with the entries the cache holds."""
    counts = {"meta": 0}
    read_meta = shardcache._read_meta

    def counting(path):
        counts["meta"] += 1
        return read_meta(path)

    monkeypatch.setattr(shardcache, "_read_meta", counting)
    per_miss = {}
    for entries in (4, 16):
        cache = ShardCache(str(tmp_path / f"c{entries}"), size_limit=entries * SIZE)
        epochs(cache, 2 * entries, count=2)
        counts["meta"], before = 0, cache.stats.snapshot().cache_misses
        epochs(cache, 2 * entries, count=1)
        per_miss[entries] = counts["meta"] / (cache.stats.snapshot().cache_misses - before)
    assert per_miss[16] <= 6 and per_miss[4] <= 6, per_miss


def test_a_forged_ledger_that_protects_everything_still_bounds_the_cache(tmp_path):
    """Protection is data anyone able to write the directory may forge: marks on every entry (and marks of names
    never held) cost no memory and keep no entry past the bound."""
    cache = bounded(tmp_path)
    for i in range(C):
        read(cache, i)
    path = os.path.join(cache.directory, cacheledger.LEDGER)
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    records = {line.rsplit(b" ", 1)[1]: line for line in lines[1:] if line.startswith(b"+ ")}  # the last of each
    forged = [lines[0]]
    for name, line in records.items():
        forged += [b"- " + name, line]
    forged += [b"- never-held-%d.tar\n" % i for i in range(1000)]
    with open(path, "wb") as f:
        f.write(b"".join(forged))
    fresh = cacheledger.Ledger(cache.directory, lambda: [])
    with fresh.locked():
        assert len(fresh.protected) == C and len(fresh.ghost) == 0
    for i in range(C, 3 * C):
        read(ShardCache(cache.directory, size_limit=C * SIZE), i)
    held = [n for n in os.listdir(cache.directory) if n.endswith(".tar")]
    assert len(held) <= C and any(f"shard-{2 * C}." in n or f"shard-{3 * C - 1}." in n for n in held)


def test_a_file_the_cache_did_not_write_is_never_evicted(tmp_path, caplog):
    """F4: a user's file with a record (size and mtime_ns not its own) and a ledger line was deleted by
    eviction: it is forgotten and left in place, said once."""
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "user.tar").write_bytes(b"mine\n")
    (folder / "user.tar.meta").write_text(
        '{"url": "http://127.0.0.1:18765/s-0003.tar", "size": 5, "version": null, "md5": null, '
        '"complete": true, "crc32": null, "mtime_ns": 1}'
    )
    (folder / ".evict.ledger").write_text("wds-cloud cache ledger 1\n+ 1 1 user.tar\n")
    caplog.set_level(logging.WARNING)
    cache = bounded(tmp_path)
    epochs(cache, 2 * C)
    assert (folder / "user.tar").read_bytes() == b"mine\n" and (folder / "user.tar.meta").exists()
    said = [r for r in caplog.records if "user.tar is not the file this cache wrote" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert cache.usage()[1] <= C * SIZE


def test_the_size_suggested_is_never_more_than_the_shards_read(tmp_path, caplog):
    """F5: shuffled, the warning asked for more than the whole epoch (it added the bytes fetched between two reads,
    fetches again included): it suggests the distinct shards' bytes, at most what was read."""
    shards, warned = C + 2, 0
    for seed in range(3):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="wds_cloud.io.shardcache"):
            epochs(ShardCache(str(tmp_path / f"c{seed}"), size_limit=C * SIZE), shards, count=4, seed=seed)
        said = [r.getMessage() for r in caplog.records if "thrashes" in r.getMessage()]
        warned += len(said)
        for message in said:
            for figure in re.findall(r"(?:up to|at least) ([\d.]+)kB", message):
                assert float(figure) * 1000 <= shards * SIZE, message
    assert warned, "no seed made the cache thrash: the test tests nothing"
