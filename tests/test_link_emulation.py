"""The fault proxy as a distant link (first-byte latency, per-connection pacing) delivers the same bytes.

Only what the proxy did is checked (its counters), never how long it took: tests do not time things.
"""

from __future__ import annotations

import os

import pytest

import wds_cloud as wds
from wds_cloud.testing.faults import FaultProxy

from . import servers


def test_a_paced_link_with_latency_delivers_every_byte_and_ranges():
    """Whole and ranged reads through latency + pacing give the object's bytes; each response was held back."""
    server, store = servers.http_server()
    proxy = FaultProxy(server.url, latency=0.002, rate=64e6)
    try:
        data = os.urandom(3 << 20)
        store.put("/b/obj.bin", data)
        with wds.gopen(f"{proxy.url}/b/obj.bin") as stream:
            assert stream.read() == data
        with wds.gopen(f"{proxy.url}/b/obj.bin", offset=1000, length=5000) as stream:
            assert stream.read() == data[1000:6000]
        proxy.wait_idle()
        assert proxy.delayed >= 2 and proxy.bytes_forwarded >= len(data) + 5000
    finally:
        proxy.stop()
        server.stop()


def test_a_dataset_reads_through_the_emulated_link(tmp_path):
    """A WebDataset over the emulated link yields the same samples as over the plain server."""
    server, store = servers.http_server()
    proxy = FaultProxy(server.url, latency=0.001, rate=32e6)
    try:
        with wds.ShardWriter(str(tmp_path / "s-%02d.tar"), maxcount=20) as sink:
            for i in range(60):
                sink.write({"__key__": f"{i:03d}", "bin": os.urandom(2000)})
        for path in sorted(tmp_path.glob("s-*.tar")):
            store.put(f"/d/{path.name}", path.read_bytes())
        direct = [s["bin"] for s in wds.WebDataset(f"{server.url}/d/s-{{00..02}}.tar", shardshuffle=False)]
        linked = [s["bin"] for s in wds.WebDataset(f"{proxy.url}/d/s-{{00..02}}.tar", shardshuffle=False)]
        assert linked == direct and len(direct) == 60
        proxy.wait_idle()
        assert proxy.delayed >= 3
    finally:
        proxy.stop()
        server.stop()


def test_an_emulated_link_serves_a_folder_with_ranges(tmp_path):
    """EmulatedLink: the files of a folder behind latency and pacing; parallel parts read them whole."""
    from wds_cloud.testing.link import EmulatedLink

    data = os.urandom(600_000)
    (tmp_path / "obj.bin").write_bytes(data)
    with EmulatedLink(str(tmp_path), latency=0.001, rate=64e6) as link:
        with wds.gopen(f"{link.url}/obj.bin", offset=10, length=100) as stream:
            assert stream.read() == data[10:110]
        from wds_cloud.io.parallel import Fetcher

        with Fetcher(part_size=128 << 10, concurrency=3).open(f"{link.url}/obj.bin") as stream:
            assert stream.read() == data
        link.proxy.wait_idle()
        assert link.proxy.delayed >= 2 and len(link.store.requests) >= 3


def test_a_reader_that_stops_early_leaves_no_server_traceback(tmp_path, capfd):
    """New user: reading through EmulatedLink printed "Exception occurred during processing of request ...
    BrokenPipeError" for every part a reader gave up; a client that goes away is no error of the server's."""
    from wds_cloud.testing.link import EmulatedLink

    with wds.TarWriter(str(tmp_path / "s-0.tar")) as sink:
        for i in range(40):
            sink.write({"__key__": f"k{i:03d}", "bin": os.urandom(100_000)})
    with EmulatedLink(str(tmp_path), latency=0.001, rate=None) as link:
        for _ in range(3):
            stream = wds.gopen(f"{link.store_url}/s-0.tar")
            stream.read(1000)
            stream.close()  # the rest of the answer is refused: the server's write fails
        ds = wds.WebDataset(f"{link.url}/s-0.tar", shardshuffle=False)
        assert next(iter(ds))["__key__"] == "k000"
        link.proxy.wait_idle()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err


def test_a_fault_proxy_says_what_upstream_it_needs_and_stops_as_a_context_manager():
    """``FaultProxy("http://localhost/")`` failed with "not enough values to unpack"; it says what to give, and
    ``with FaultProxy(...)`` stops it on leaving."""
    with pytest.raises(ValueError, match="names no port.*http://127.0.0.1:8000"):
        FaultProxy("http://localhost/")
    with FaultProxy("http://127.0.0.1:9") as proxy:
        assert proxy.port and proxy.url.endswith(str(proxy.port))
    assert proxy._stopped.is_set()
    assert FaultProxy.__doc__ and "context manager" in FaultProxy.__doc__
