"""Versions of HTTP objects without ETags: what pins the parts of a shard and the resumes of a stream.

Python's ``http.server``, RangeHTTPServer and many file servers send ``Last-Modified`` and no ETag, and ignore
``If-Match``; some servers send weak ETags (``W/"..."``), which ``If-Match`` never matches on a server that
honours it.  The servers here are our object server in those modes (``validators=``, ``conditions=``); each
replacement it stores is dated a second after the one before, so a change of version never hangs on a clock.
"""

from __future__ import annotations

import io
import json

import pytest

import wds_cloud as wds
from wds_cloud.errors import ObjectChangedError
from wds_cloud.io import pinning_headers, version_of
from wds_cloud.io.parallel import Fetcher
from wds_cloud.testing.conformance import BackendConformance
from wds_cloud.testing.faults import FaultProxy
from wds_cloud.testing.objects import http_server

from .cloud import unique

KiB = 1024


def shard(tag: int, samples: int = 100, size: int = 200_000) -> bytes:
    """Samples of a ``bin`` and a ``json`` each; shards of two tags have the same size and layout, other bytes."""
    out = io.BytesIO()
    with wds.TarWriter(out) as writer:
        for i in range(samples):
            writer.write({"__key__": f"{i:05d}", "bin": bytes([tag]) * size, "json": json.dumps({"tag": tag}).encode()})
    return out.getvalue()


@pytest.fixture
def file_server():
    """Our server answering as RangeHTTPServer does: 206 to ranges, Last-Modified and no ETag, conditions ignored."""
    server, store = http_server(validators="last-modified", conditions=False)
    yield server, store
    server.stop()


def test_a_shard_replaced_mid_read_on_a_server_without_etags_is_an_error_not_a_splice(file_server):
    """The user's read (4 connections, 1 MB parts, nothing fetched ahead) of a shard replaced after 3 samples by one
    of the same size: the parts asked for after the replacement bring another Last-Modified, and the read stops with
    ObjectChangedError naming the URL, both dates and the fix; every sample before it is of the first version.
    (At most level x part_size = 4 MB are asked for ahead of the reader, so most of this 20 MB shard is asked for
    after the replacement.)"""
    server, store = file_server
    first, second = shard(1), shard(2)
    assert len(first) == len(second)
    store.put("/d/s.tar", first)
    url = f"{server.url}/d/s.tar"
    dataset = wds.WebDataset(url, shardshuffle=False, concurrency=4, part_size="1MB", prefetch=0)
    tags = []
    with pytest.raises(ObjectChangedError) as info:
        for sample in dataset:
            assert set(sample) >= {"bin", "json"}, sorted(sample)  # never a sample cut between two versions
            tags.append((sample["bin"][0], json.loads(sample["json"])["tag"]))
            if len(tags) == 3:
                store.put("/d/s.tar", second)
    assert 3 <= len(tags) < 100 and set(tags) == {(1, 1)}
    message = str(info.value)
    assert url in message and message.count("Last-Modified") == 2 and "read it again" in message


def test_a_server_without_etags_that_honours_if_unmodified_since_refuses_the_old_version():
    """Parts pinned to a Last-Modified date ask with If-Unmodified-Since: a server that honours it answers a part of
    a replaced object with 412, an ObjectChangedError (before, nothing was asked and the parts were spliced)."""
    server, store = http_server(validators="last-modified", conditions=True)
    try:
        data = shard(1, samples=8, size=100_000)
        store.put("/d/o.bin", data)
        with Fetcher(part_size=64 * KiB, concurrency=2, prefetch=0).open(f"{server.url}/d/o.bin") as stream:
            assert stream.read(1000) == data[:1000]
            store.put("/d/o.bin", shard(2, samples=8, size=100_000))
            with pytest.raises(ObjectChangedError, match="HTTP 412") as info:
                while stream.read(64 * KiB):
                    pass
        assert "read it again" in str(info.value)
    finally:
        server.stop()


def test_a_resume_after_a_reset_on_a_server_without_etags_checks_the_date(file_server):
    """One stream, its connection reset every 300 KB: the resumed request of an object replaced meanwhile (same size)
    brings another Last-Modified, an ObjectChangedError; unchanged, the resumes give the object's bytes."""
    server, store = file_server
    data = shard(1, samples=8, size=100_000)
    store.put("/d/r.bin", data)
    proxy = FaultProxy(server.url, reset_after=300_000)
    try:
        with wds.gopen(f"{proxy.url}/d/r.bin") as stream:
            assert stream.read() == data and stream.stats.retries >= 2
        with wds.gopen(f"{proxy.url}/d/r.bin") as stream:
            assert stream.read(100_000) == data[:100_000]
            store.put("/d/r.bin", shard(2, samples=8, size=100_000))
            with pytest.raises(ObjectChangedError, match="Last-Modified"):
                while stream.read(64 * KiB):
                    pass
    finally:
        proxy.stop()


def test_weak_etags_pin_parts_without_if_match():
    """A server with weak ETags that honours If-Match (strong comparison: a weak tag never matches) reads in parts as
    one stream does (before, every part asked If-Match on the weak tag and was refused, on an unchanged object); a
    replacement is still seen, by the ETag of the answer."""
    server, store = http_server(validators="weak", conditions=True)
    try:
        data = shard(1, samples=8, size=100_000)
        store.put("/d/w.bin", data)
        with Fetcher(part_size=64 * KiB, concurrency=4, prefetch=0).open(f"{server.url}/d/w.bin") as stream:
            assert stream.read() == data
        with Fetcher(part_size=64 * KiB, concurrency=2, prefetch=0).open(f"{server.url}/d/w.bin") as stream:
            assert stream.read(1000) == data[:1000]
            store.put("/d/w.bin", shard(2, samples=8, size=100_000))
            with pytest.raises(ObjectChangedError, match="W/"):
                while stream.read(64 * KiB):
                    pass
    finally:
        server.stop()


def test_the_version_and_the_headers_that_pin_it():
    """An ETag is the version (If-Match; a weak one asks nothing); without one, the Last-Modified date
    (If-Unmodified-Since); neither: no version, nothing asked."""
    date = "Tue, 14 Nov 2023 22:13:20 GMT"
    assert version_of('"abc"', date) == '"abc"' and pinning_headers('"abc"') == {"If-Match": '"abc"'}
    assert version_of('W/"abc"', date) == 'W/"abc"' and pinning_headers('W/"abc"') == {}
    assert version_of(None, date) == f"Last-Modified: {date}"
    assert pinning_headers(version_of(None, date)) == {"If-Unmodified-Since": date}
    assert version_of(None, None) is None and version_of(" ", "") is None and pinning_headers(None) == {}


@pytest.fixture(scope="class")
def mode_server(request):
    """Our server in the mode of the test's class (its ``validators`` and ``conditions``), one per class."""
    server, _ = http_server(validators=request.cls.validators, conditions=request.cls.conditions)
    yield server
    server.stop()


class _OurServer(BackendConformance):
    """The conformance suite over our server in one of its modes (``validators``, ``conditions``)."""

    validators = "etag"
    conditions = True

    @pytest.fixture
    def base_url(self, mode_server):
        return f"{mode_server.url}/{unique('v')}/"

    @pytest.fixture
    def upstream(self, mode_server):
        return mode_server.url

    def route_through(self, proxy_url, base_url, storage_options):
        return base_url.replace(base_url.split("/")[2], proxy_url.split("/")[2]), storage_options


class TestHTTPWithoutETags(_OurServer):
    """As RangeHTTPServer answers: Last-Modified, no ETag, If-* ignored."""

    validators = "last-modified"
    conditions = False


class TestHTTPWithWeakETags(_OurServer):
    """Weak ETags, If-Match honoured with the strong comparison."""

    validators = "weak"


class TestHTTPWithoutVersions(_OurServer):
    """Neither an ETag nor a date: only a replacement of another size can be seen (the same-size tests skip)."""

    validators = "none"
    conditions = False
