"""The shard cache with real processes over a real S3 server (moto), counting the bytes the server sends."""

import hashlib
import logging
import multiprocessing
import os
import signal
import time

import pytest

import wds_cloud as wds
from wds_cloud.cache import FileCache, url_to_cache_name
from wds_cloud.testing.faults import FaultProxy
from wds_cloud.writer import ShardWriter

SAMPLE = 50_000


def _digest(sample: dict) -> tuple:
    return sample["__key__"], hashlib.md5(sample["bin"]).hexdigest()


def _read(spec, options, cache_dir, cache_size=-1, stop_after=None, ready=None, go=None):
    """Read the dataset through the cache (in a child process); returns (samples, stats)."""
    ds = wds.WebDataset(spec, shardshuffle=False, storage_options=options, cache_dir=cache_dir, cache_size=cache_size)
    out = []
    for sample in ds:
        out.append(_digest(sample))
        if ready is not None and len(out) == 1:
            ready.set()
            if go is not None:
                go.wait(60)
        if stop_after is not None and len(out) >= stop_after:
            time.sleep(3600)  # killed by the test
    return out, ds.stats.as_dict()


def _read_into(results, *args, **kw):
    results.put(_read(*args, **kw))


def _read_with_small_disk(spec, options, cache_dir, limit):
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return _read(spec, options, cache_dir)


@pytest.fixture
def store(s3_bucket, moto_endpoint):
    """Four 2 MB shards on moto, and storage options that reach it through a byte-counting proxy."""
    bucket, options = s3_bucket
    pattern = f"s3://{bucket}/cache/shard-%06d.tar"
    with ShardWriter(pattern, maxcount=40, storage_options=options) as sink:
        for i in range(160):
            sink.write({"__key__": f"{i:04d}", "bin": os.urandom(SAMPLE)})
    spec = f"s3://{bucket}/cache/shard-{{000000..000003}}.tar"
    clean = [_digest(s) for s in wds.WebDataset(spec, shardshuffle=False, storage_options=options)]
    proxy = FaultProxy(moto_endpoint)
    yield spec, dict(options, endpoint_url=proxy.url), clean, proxy
    proxy.stop()


def _entries(cache_dir):
    return sorted(f for f in os.listdir(cache_dir) if f.endswith(".tar"))


def _shard_bytes(cache_dir):
    return sum(os.path.getsize(os.path.join(cache_dir, f)) for f in _entries(cache_dir))


@pytest.fixture
def spawn():
    return multiprocessing.get_context("spawn")


def test_four_processes_download_each_shard_once(store, tmp_path, spawn):
    spec, options, clean, proxy = store
    cache_dir = str(tmp_path / "cache")
    with spawn.Pool(4) as pool:
        results = pool.starmap(_read, [(spec, options, cache_dir)] * 4)
    for samples, _ in results:
        assert samples == clean
    assert sum(stats["cache_misses"] for _, stats in results) == 4  # one download per shard
    assert sum(stats["cache_hits"] for _, stats in results) == 12
    total = _shard_bytes(cache_dir)
    assert len(_entries(cache_dir)) == 4
    proxy.wait_idle()
    assert total <= proxy.bytes_forwarded < total + 4 * 4096  # the objects once, plus response headers
    assert not [f for f in os.listdir(cache_dir) if f.endswith(".part")]

    sent = proxy.bytes_forwarded
    with spawn.Pool(4) as pool:  # epoch 2: nothing from the server
        again = pool.starmap(_read, [(spec, options, cache_dir)] * 4)
    assert all(samples == clean for samples, _ in again)
    proxy.wait_idle()
    assert proxy.bytes_forwarded == sent
    assert sum(stats["bytes_saved"] for _, stats in again) == 4 * total


def test_killed_fill_is_resumed_by_a_fresh_run(store, tmp_path, spawn):
    spec, options, clean, proxy = store
    cache_dir = str(tmp_path / "cache")
    first = spec.replace("{000000..000003}", "000000")
    ready = spawn.Event()
    child = spawn.Process(target=_read, args=(first, options, cache_dir), kwargs={"stop_after": 1, "ready": ready})
    child.start()
    assert ready.wait(60)
    deadline = time.time() + 120  # a safety net: the loop ends when the part file has bytes
    while time.time() < deadline:
        part = [os.path.join(cache_dir, f) for f in os.listdir(cache_dir) if f.endswith(".part")]
        if part and os.path.getsize(part[0]):
            break
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    had = os.path.getsize(part[0])
    assert had > 0 and not _entries(cache_dir)  # never published
    proxy.wait_idle()  # the killed reader's connection is over and counted
    sent = proxy.bytes_forwarded
    samples, stats = _read(first, options, cache_dir)
    proxy.wait_idle()
    assert samples == clean[:40]
    size = _shard_bytes(cache_dir)
    assert proxy.bytes_forwarded - sent < size - had + 4096  # resumed where the killed fill stopped
    assert not os.path.exists(part[0]) and len(_entries(cache_dir)) == 1
    assert _read(first, options, cache_dir)[1]["cache_hits"] == 1


def test_a_reader_stopping_early_leaves_nothing_served(store, tmp_path):
    spec, options, clean, proxy = store
    cache_dir = str(tmp_path / "cache")
    ds = wds.WebDataset(spec, shardshuffle=False, storage_options=options, cache_dir=cache_dir)
    it = iter(ds)
    next(it)
    it.close()
    assert not _entries(cache_dir)
    samples, _ = _read(spec, options, cache_dir)
    assert samples == clean and len(_entries(cache_dir)) == 4


def test_eviction_spares_the_entry_in_use(store, tmp_path, spawn):
    spec, options, clean, proxy = store
    cache_dir = str(tmp_path / "cache")
    first = spec.replace("{000000..000003}", "000000")
    _read(first, options, cache_dir)
    shard = _shard_bytes(cache_dir)
    limit = int(shard * 1.5)
    ready, go, results = spawn.Event(), spawn.Event(), spawn.Queue()
    child = spawn.Process(
        target=_read_into, args=(results, first, options, cache_dir, limit), kwargs={"ready": ready, "go": go}
    )
    child.start()
    try:
        assert ready.wait(60)
        samples, stats = _read(spec.replace("{000000..000003}", "{000001..000003}"), options, cache_dir, limit)
        assert samples == clean[40:]
        assert stats["cache_evictions"] >= 1
        assert any("shard-000000" in name for name in _entries(cache_dir))  # in use: kept
    finally:
        go.set()
        held, held_stats = results.get(timeout=60)
        child.join()
    assert held == clean[:40] and held_stats["cache_hits"] == 1
    samples, _ = _read(spec, options, cache_dir, limit)
    assert samples == clean
    assert _shard_bytes(cache_dir) <= limit + shard  # the bound holds to within one shard
    for name in os.listdir(tmp_path):
        assert name == "cache"  # nothing outside the cache directory touched


def test_corrupted_entry_is_detected_and_fetched_again(store, tmp_path, caplog):
    spec, options, clean, proxy = store
    cache_dir = str(tmp_path / "cache")
    _read(spec, options, cache_dir)
    entry = os.path.join(cache_dir, _entries(cache_dir)[1])
    with open(entry, "r+b") as f:
        f.seek(700_000)
        data = f.read(100)
        f.seek(700_000)
        f.write(bytes(b ^ 0xFF for b in data))
    proxy.wait_idle()
    sent = proxy.bytes_forwarded
    with caplog.at_level(logging.WARNING, logger="wds_cloud"):
        samples, stats = _read(spec, options, cache_dir)
    proxy.wait_idle()
    assert samples == clean
    assert stats["cache_misses"] == 1 and stats["cache_hits"] == 3
    assert proxy.bytes_forwarded - sent >= os.path.getsize(entry)
    assert "modified after it was stored" in caplog.text and entry in caplog.text


def test_verify_checks_every_hit_against_its_checksum(store, tmp_path):
    """With verify=True a damaged entry is caught even when its modification time was put back."""
    from wds_cloud.gopen import gopen
    from wds_cloud.io.shardcache import ShardCache

    spec, options, clean, proxy = store
    url = spec.replace("{000000..000003}", "000002")
    cache = ShardCache(str(tmp_path / "cache"), verify=True)

    def opener(offset):
        return gopen(url, offset=offset, storage_options=options)

    with cache.open(url, opener) as stream:
        whole = stream.read()
    entry = cache.path_for(url)
    st = os.stat(entry)
    with open(entry, "r+b") as f:
        f.seek(1000)
        f.write(b"\0" * 10 if whole[1000:1010] != b"\0" * 10 else b"\1" * 10)
    os.utime(entry, ns=(st.st_atime_ns, st.st_mtime_ns))
    with cache.open(url, opener) as stream:
        assert stream.read() == whole
    assert cache.stats.snapshot().cache_misses == 2


def test_a_full_disk_costs_the_cache_entry_not_the_read(store, tmp_path, spawn, caplog):
    spec, options, clean, proxy = store
    cache_dir = str(tmp_path / "cache")
    with spawn.Pool(1) as pool:
        samples, stats = pool.apply(_read_with_small_disk, (spec, options, cache_dir, 300_000))
    assert samples == clean
    assert not _entries(cache_dir)
    assert not [f for f in os.listdir(cache_dir) if f.endswith(".part")]


def test_local_files_are_read_in_place_unless_asked(tmp_path, shards):
    cache_dir = tmp_path / "cache"
    assert len(list(wds.WebDataset(shards, shardshuffle=False, cache_dir=str(cache_dir)))) == 30
    assert not os.listdir(cache_dir)
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(shards), FileCache(str(cache_dir), cache_local=True), wds.tarfile_to_samples()
    )
    assert len(list(pipeline)) == 30 and len(_entries(cache_dir)) == 3


def test_environment_sets_the_cache(tmp_path, shards, monkeypatch):
    monkeypatch.setenv("WDS_CACHE", str(tmp_path / "envcache"))
    monkeypatch.setenv("WDS_CACHE_SIZE", "50GB")
    spec = "pipe:cat " + shards.replace("{000..002}", "000")
    ds = wds.WebDataset(spec, shardshuffle=False)
    assert len(list(ds)) == 10 and len(_entries(tmp_path / "envcache")) == 1


@pytest.mark.parametrize(
    "a,b",
    [
        ("s3://bucket-a/x/shard.tar", "s3://bucket-b/x/shard.tar"),
        ("s3://b/x/shard.tar", "gs://b/x/shard.tar"),
        ("s3://b/x/y_shard.tar", "s3://b/x_y/shard.tar"),
        ("http://h/a/shard.tar", "http://h/a/shard.tar?v=2"),
    ],
)
def test_cache_names_never_collide(a, b):
    assert url_to_cache_name(a) != url_to_cache_name(b)


def test_cache_names_are_safe_bounded_and_readable():
    name = url_to_cache_name("s3://bucket/" + "../" * 50 + "x" * 500 + "/train-0001.tar")
    assert "/" not in name and ".." not in name.replace("...", "") and len(name) <= 200
    assert name.endswith(".tar") and "train-0001" in name
    assert url_to_cache_name("gs://my-bucket/data/train-0001.tar").startswith("gs__my-bucket__data__train-0001")


def test_a_second_reader_follows_the_fill_and_takes_over_when_it_stops(store, tmp_path):
    """While one reader fills, another reads the bytes that arrived; when the filler stops early,
    the follower resumes the download where it stopped.  The server sends the object once."""
    from wds_cloud.gopen import gopen
    from wds_cloud.io.shardcache import CachedShard, ShardCache

    spec, options, clean, proxy = store
    url = spec.replace("{000000..000003}", "000001")
    with gopen(url, storage_options=options) as stream:
        whole = stream.read()
    proxy.wait_idle()  # every byte of that read counted before the count is taken
    sent = proxy.bytes_forwarded
    cache = ShardCache(str(tmp_path / "cache"))

    def opener(offset):
        return gopen(url, offset=offset, storage_options=options)

    filler = cache.open(url, opener)
    follower = cache.open(url, opener)
    assert isinstance(filler, CachedShard) and filler._remote is not None
    assert isinstance(follower, CachedShard) and follower._remote is None
    head = filler.read(300_000)
    assert follower.read(200_000) == whole[:200_000]
    filler.close()  # stops early: the follower must take over
    rest = follower.read()
    follower.close()
    proxy.wait_idle()
    assert head == whole[:300_000] and whole[:200_000] + rest == whole
    # the resumed GET starts at byte 300,000; what the first connection had in flight is all that is lost
    assert proxy.bytes_forwarded - sent < 2 * len(whole) - 300_000 + 8192
    with cache.open(url, opener) as hit:
        assert hit.read() == whole
    assert cache.stats.snapshot().cache_misses == 1
