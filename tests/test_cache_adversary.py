"""What an adversary found in the shard cache: each test failed before its fix (hangs are caught by bounded waits)."""

import logging
import multiprocessing
import os
import stat
import threading

import pytest

import wds_cloud as wds
from wds_cloud.errors import ConfigError
from wds_cloud.io import cacheledger
from wds_cloud.io.parallel import Fetcher
from wds_cloud.io.shardcache import ShardCache
from wds_cloud.testing.objects import http_server

from .remote import Remote

WAIT = 60  # seconds a step may take before it counts as a hang (each step takes well under one)


def bounded(fn, *args):
    """``fn(*args)`` in a thread: its result, or a failure naming the hang when it does not return in time."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {WAIT} s: it hangs")
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def served():
    """A loopback HTTP server holding four 850 kB objects: (base URL, their bytes)."""
    server, store = http_server()
    data = [os.urandom(850_000) for _ in range(4)]
    for j, d in enumerate(data):
        store.put(f"/big-{j}.tar", d)
    yield server.url, data
    server.stop()


def test_streams_read_to_their_end_but_never_closed_do_not_block_the_next_shard(served, tmp_path):
    """F1: FileCache over HTTP opens the next shard when the caller reads each stream to its end without close()."""
    base, data = served
    fc = wds.cache.FileCache(str(tmp_path / "c"))
    kept = []  # held, never closed, so that garbage collection cannot close them either

    def read_all():
        for s in fc(iter([{"url": f"{base}/big-{j}.tar"} for j in range(4)])):
            kept.append(s["stream"])
            kept.append(s["stream"].read())
        return kept[1::2]

    assert bounded(read_all) == data


def test_an_unread_unclosed_stream_does_not_block_opening_another(served):
    """F1, every path of that kind: a shard opened and left unread (not closed) lets the next one open and read."""
    base, data = served
    fetcher = Fetcher()
    first = fetcher.open(f"{base}/big-0.tar")  # noqa: F841 (held open, unread)
    second = bounded(fetcher.open, f"{base}/big-1.tar")
    assert bounded(second.read) == data[1]
    assert bounded(first.read) == data[0]


@pytest.mark.parametrize(
    "given, bound", [("50KB", 50_000), ("1.5KiB", 1536), ("1e5", 100_000), (4096, 4096), (-1, None), (0, None)]
)
def test_file_cache_reads_sizes_as_webdataset_does(tmp_path, given, bound):
    """F3: FileCache(cache_size=) takes the documented size strings; -1 and 0 leave it unbounded (webdataset's)."""
    assert wds.cache.FileCache(str(tmp_path), cache_size=given).cache.size_limit == bound


@pytest.mark.parametrize("given", [float("nan"), float("inf"), 1e999, -5, 2**70, True, "", "lots"])
def test_file_cache_refuses_sizes_webdataset_refuses(tmp_path, given):
    """F3: a size WebDataset(cache_size=) refuses is refused by FileCache too, with a ConfigError naming cache_size."""
    with pytest.raises(ConfigError, match="cache_size"):
        wds.cache.FileCache(str(tmp_path), cache_size=given)
    if given != "":  # WebDataset's "" is "no cache" (WDS_CACHE_SIZE's unset)
        with pytest.raises(ConfigError, match="cache_size"):
            wds.WebDataset(str(tmp_path / "a.tar"), cache_dir=str(tmp_path), cache_size=given)


DATA = os.urandom(100_000)


def read_through(cache: ShardCache, url: str) -> bytes:
    with cache.open(url, lambda offset: Remote(DATA, offset)) as stream:
        return stream.read()


def plant(path: str, kind: str) -> None:
    """Put a FIFO, an empty folder or a folder with a file in it at ``path``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkdir(path)
        if kind == "full folder":
            with open(os.path.join(path, "keep"), "wb") as f:
                f.write(b"precious")


@pytest.mark.parametrize("where", ["ledger lock", "entry lock", "ledger", "meta", "part"])
@pytest.mark.parametrize("kind", ["fifo", "folder", "full folder"])
def test_things_planted_in_the_cache_never_block_nor_fail_a_read(tmp_path, caplog, where, kind):
    """F2/F5: a FIFO or folder planted as a lock, the ledger, a record or a part file costs no read and no hang."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=10 * len(DATA))
    url = "https://host/data/shard-0.tar"
    path = cache.path_for(url)
    target = {
        "ledger lock": os.path.join(cache.directory, ".evict.lock"),
        "ledger": os.path.join(cache.directory, ".evict.ledger"),
        "entry lock": path + ".lock",
        "meta": path + ".meta",
        "part": path + ".part",
    }[where]
    plant(target, kind)
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        assert bounded(read_through, cache, url) == DATA
    if kind == "full folder":  # not removed (it holds a file), said once however many reads it costs
        assert os.path.exists(os.path.join(target, "keep"))
        planted = [r for r in caplog.records if target in r.getMessage() and "remove it" in r.getMessage()]
        assert len(planted) <= 1
    else:  # removed and made anew: the shard is cached
        assert os.path.isfile(path) and not stat.S_ISFIFO(os.stat(target).st_mode if os.path.exists(target) else 0)


def test_a_full_folder_as_the_ledger_is_reported_once_and_costs_no_walk_per_miss(tmp_path, caplog):
    """F5: a folder with files in it where the ledger goes: one warning naming it, reads uncached, no walk per miss."""
    cache = ShardCache(str(tmp_path / "c"), size_limit=10 * len(DATA))
    ledger = os.path.join(cache.directory, ".evict.ledger")
    plant(ledger, "full folder")
    caplog.set_level(logging.INFO)
    for i in range(5):
        assert bounded(read_through, cache, f"https://host/data/shard-{i}.tar") == DATA
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and ledger in r.getMessage()]
    assert len(warned) == 1 and "remove it" in warned[0].getMessage()
    assert cacheledger.view_of(cache.directory, lambda: []).rebuilds == 0


def test_a_ledger_that_omits_entries_still_converges_to_the_bound(tmp_path, monkeypatch):
    """F4: entries a truncated ledger no longer lists are found by the periodic walk, and the bound holds again."""
    monkeypatch.setattr(cacheledger, "REWALK_MIN", 4)
    size = len(DATA)
    directory = str(tmp_path / "c")
    for i in range(3):
        assert read_through(ShardCache(directory, size_limit=3 * size), f"https://host/old-{i}.tar") == DATA
    with open(os.path.join(directory, cacheledger.LEDGER), "r+b") as f:
        f.truncate(len(cacheledger.HEADER))  # the ledger forgets every entry
    for i in range(12):
        assert read_through(ShardCache(directory, size_limit=3 * size), f"https://host/new-{i}.tar") == DATA
    held = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory) if n.endswith(".tar"))
    assert held <= 3 * size


def test_a_killed_compactions_temporary_file_is_swept(tmp_path):
    """Smaller: the .evict.ledger.PID.tmp of a process that died is removed when the ledger is next rebuilt."""
    directory = tmp_path / "c"
    directory.mkdir()
    dead = multiprocessing.Process(target=int)
    dead.start()
    dead.join()
    stale = directory / f"{cacheledger.LEDGER}.{dead.pid}.tmp"
    stale.write_bytes(cacheledger.HEADER)
    assert read_through(ShardCache(str(directory), size_limit=10 * len(DATA)), "https://host/a.tar") == DATA
    assert not stale.exists()


def test_the_periodic_walk_costs_one_walk_per_as_many_misses_as_entries(tmp_path, monkeypatch):
    """F4's rule counted: over 100 misses of a full 20-entry cache, one walk per 20 misses at most (O(1) amortized)."""
    monkeypatch.setattr(cacheledger, "REWALK_MIN", 4)
    directory = str(tmp_path / "c")
    bound = 20 * len(DATA)
    for i in range(20):
        read_through(ShardCache(directory, size_limit=bound), f"https://host/first-{i}.tar")
    view = cacheledger.view_of(os.path.abspath(directory), lambda: [])
    before = view.rebuilds
    for i in range(100):
        read_through(ShardCache(directory, size_limit=bound), f"https://host/next-{i}.tar")
    assert 1 <= view.rebuilds - before <= 100 // 20
