"""What an adversary found in the shard cache: each test failed before its fix (hangs are caught by bounded waits)."""

import os
import threading

import pytest

import wds_cloud as wds
from wds_cloud.errors import ConfigError
from wds_cloud.io.parallel import Fetcher
from wds_cloud.testing.objects import http_server

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
