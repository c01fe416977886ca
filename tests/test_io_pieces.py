"""The small shared pieces of the I/O layer: URL facts, the commit-or-abort base, wrapped streams."""

from __future__ import annotations

import io

import pytest

from wds_cloud.io import Publishing, is_local, local_path, split_scheme
from wds_cloud.io.backend import WrappedStream
from wds_cloud.io.urls import url_to_cache_name


@pytest.mark.parametrize(
    "url, local",
    [
        ("/data/a.tar", True),
        ("data/a.tar", True),
        ("file:/data/a.tar", True),
        ("file:///data/a.tar", True),
        ("C:\\data\\a.tar", True),
        ("-", False),
        ("s3://b/a.tar", False),
        ("pipe:cat a.tar", False),
        ("https://h/a.tar", False),
    ],
)
def test_is_local_is_one_answer_for_every_caller(url, local):
    """Bare paths and file: URLs are local; stdio ('-'), pipes and remote schemes are not."""
    assert is_local(url) is local


def test_local_path_and_scheme():
    """file: URLs map to paths; the scheme is lower-cased; a Windows drive is no scheme."""
    assert local_path("file:///x/y.tar") == "/x/y.tar" and local_path("file://localhost/x") == "/x"
    assert split_scheme("S3://b/k") == ("s3", "//b/k") and split_scheme("C:\\x") == (None, "C:\\x")


def test_cache_names_hold_no_credentials():
    """The readable part of a cache name drops userinfo and the query; the hash keeps such URLs apart."""
    a = url_to_cache_name("https://user:secret@h/d/a.tar?sig=XYZ")
    b = url_to_cache_name("https://user:other@h/d/a.tar?sig=ABC")
    assert "secret" not in a and "XYZ" not in a and a != b and a.endswith(".tar")


class _Recorder(Publishing):
    def __init__(self, fail: bool = False) -> None:
        self.events: list[str] = []
        self.fail = fail

    def _publish(self) -> None:
        self.events.append("publish")
        if self.fail:
            raise OSError("disk full")

    def _discard(self) -> None:
        self.events.append("discard")


def test_publishing_publishes_once_and_a_failed_publish_discards():
    """close() publishes once; a failing publish discards and raises; abort after close does nothing."""
    ok = _Recorder()
    ok.close(), ok.close(), ok.abort()
    assert ok.events == ["publish"] and ok.closed
    bad = _Recorder(fail=True)
    with pytest.raises(OSError, match="disk full"):
        bad.close()
    assert bad.events == ["publish", "discard"] and bad.closed
    bad.close()
    assert bad.events == ["publish", "discard"]


def test_publishing_with_block_aborts_on_an_exception():
    """Leaving a with block by an exception discards; leaving it normally publishes."""
    with pytest.raises(KeyError):
        with _Recorder() as r:
            raise KeyError("x")
    assert r.events == ["discard"]
    with _Recorder() as s:
        pass
    assert s.events == ["publish"]


def test_wrapped_stream_passes_close_through():
    """A WrappedStream closes what it wraps and reports its state."""
    inner = io.BytesIO(b"abc")
    with WrappedStream(inner) as w:
        assert w.readable() and not w.closed
    assert inner.closed and w.closed


def test_stats_read_right_for_local_files_single_streams_and_parts(tmp_path):
    """A local dataset's figures are local files and bytes (not an empty transfer); over HTTP ``streams``
    counts shards and ``requests`` the GETs made: one per shard read whole, one per part."""
    import wds_cloud as wds
    from wds_cloud.testing.objects import http_server

    for s in range(2):
        with wds.TarWriter(str(tmp_path / f"s-{s}.tar")) as w:
            for i in range(40):
                w.write({"__key__": f"{s}-{i}", "bin": bytes(50_000)})
    size = sum((tmp_path / f"s-{s}.tar").stat().st_size for s in range(2))
    local = wds.WebDataset(str(tmp_path / "s-{0..1}.tar"), shardshuffle=False)
    assert len(list(local)) == 80
    stats = local.stats
    assert (stats.local_files, stats.local_bytes, stats.streams, stats.requests) == (2, size, 0, 0)
    server, store = http_server()
    try:
        store.put_directory(str(tmp_path))
        whole = wds.WebDataset(server.url + "/s-{0..1}.tar", shardshuffle=False, concurrency=1)
        assert len(list(whole)) == 80
        assert (whole.stats.streams, whole.stats.requests, whole.stats.bytes) == (2, 2, size)
        store.requests.clear()
        measured = wds.WebDataset(server.url + "/s-{0..1}.tar", shardshuffle=False, part_size="256KiB")
        assert len(list(measured)) == 80  # a fresh host starts at one connection (one GET per shard)
        gets = [r for r in store.requests if r[0] == "GET"]
        assert (measured.stats.streams, measured.stats.requests, measured.stats.bytes) == (2, len(gets), size)
        store.requests.clear()
        parts = wds.WebDataset(server.url + "/s-{0..1}.tar", shardshuffle=False, part_size="256KiB", concurrency=4)
        assert len(list(parts)) == 80
        gets = [r for r in store.requests if r[0] == "GET"]
        assert parts.stats.streams == 2 and parts.stats.requests == len(gets) > 2
        assert parts.stats.local_files == 0
    finally:
        server.stop()
