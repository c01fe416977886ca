"""The backend conformance suite: every backend, built-in or third-party, passes the same tests.

Use it from your plugin's tests by subclassing :class:`BackendConformance`
and providing two fixtures (and, optionally, ``bad_credentials``)::

    import pytest
    from wds_cloud.testing.conformance import BackendConformance

    class TestMyStore(BackendConformance):
        @pytest.fixture
        def base_url(self, my_server):
            return "mystore://bucket/prefix/"      # a writable, empty prefix, ending in "/"

        @pytest.fixture
        def storage_options(self, my_server):
            return {"endpoint_url": my_server.url}  # what gopen/WebDataset need to reach it

        def bad_credentials(self, storage_options):
            return dict(storage_options, key="wrong")  # or None if the store checks none

The tests write small objects under ``base_url`` through ``gopen``, then read,
stat, list and stream them, build a multi-shard ``WebDataset`` over the scheme,
and read through a ``WDS_REWRITE`` rule that points at it.

When the backend declares ``ranged_reads``, the suite also checks parallel ranged reads: parts on
several connections give the bytes and samples of one stream (plain and gzip shards), and an
object replaced between parts raises ``ObjectChangedError``, also when the replacement has the same size
(where a read names the object's version: without one, only a change of size can be seen).

The fault tests run when the subclass also says how to reach the store through
a :class:`~wds_cloud.testing.faults.FaultProxy` (connection resets, stalls,
truncated bodies, 503 answers)::

        def route_through(self, proxy_url, base_url, storage_options):
            return base_url, dict(storage_options, endpoint_url=proxy_url)

        @pytest.fixture
        def upstream(self, my_server):
            return my_server.url    # what the proxy forwards to
"""

from __future__ import annotations

import io
import random
import time
from typing import Optional

import pytest

from ..compat import WebDataset
from ..errors import CredentialsError, ObjectChangedError, TransferError, WdsCloudError
from ..io.open import gopen, open_backend
from ..io.parallel import Fetcher
from ..writer import ShardWriter, TarWriter
from .faults import FaultProxy

__all__ = ["BackendConformance"]

PAYLOAD = bytes(range(256)) * 64 + b"the end"


class BackendConformance:
    """Mix-in test class; see the module docstring."""

    supports_list = True
    supports_write = True

    @pytest.fixture
    def base_url(self) -> str:  # pragma: no cover - provided by the subclass
        raise NotImplementedError("provide a base_url fixture: a writable prefix ending in '/'")

    @pytest.fixture
    def storage_options(self) -> dict:
        return {}

    def bad_credentials(self, storage_options: dict) -> Optional[dict]:
        """Storage options that the store must reject, or None when it checks no credentials."""
        return None

    def route_through(self, proxy_url: str, base_url: str, storage_options: dict) -> Optional[tuple[str, dict]]:
        """(base_url, storage_options) that reach the store through the proxy; None skips the fault tests."""
        return None

    @pytest.fixture
    def upstream(self) -> Optional[str]:
        """The server address the fault proxy forwards to."""
        return None

    @pytest.fixture
    def faults(self, upstream, base_url, storage_options, monkeypatch):
        """A FaultProxy in front of the store and the (base_url, storage_options) that go through it."""
        if upstream is None:
            pytest.skip("this backend gives no route through a fault proxy")
        proxy = FaultProxy(upstream)
        route = self.route_through(proxy.url, base_url, storage_options)
        if route is None:
            proxy.stop()
            pytest.skip("this backend gives no route through a fault proxy")
        monkeypatch.setenv("WDS_RETRY_BACKOFF", "0.01")
        yield proxy, route[0], route[1]
        proxy.stop()

    # helpers
    def put(self, url: str, data: bytes, storage_options: dict) -> None:
        with gopen(url, "wb", storage_options=storage_options) as stream:
            stream.write(data)

    def get(self, url: str, storage_options: dict, offset: int = 0) -> bytes:
        with gopen(url, "rb", offset=offset, storage_options=storage_options) as stream:
            chunks: list[bytes] = []
            while True:
                chunk = stream.read(10000)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)

    # the suite
    def test_stream_whole_object(self, base_url: str, storage_options: dict) -> None:
        """A whole object streams back byte for byte."""
        self.put(base_url + "whole.bin", PAYLOAD, storage_options)
        assert self.get(base_url + "whole.bin", storage_options) == PAYLOAD

    def test_stream_from_offset(self, base_url: str, storage_options: dict) -> None:
        """A read opened at a byte offset starts there."""
        self.put(base_url + "offset.bin", PAYLOAD, storage_options)
        for offset in (1, 4096, len(PAYLOAD) - 7):
            assert self.get(base_url + "offset.bin", storage_options, offset) == PAYLOAD[offset:]

    def test_stat_size_and_version(self, base_url: str, storage_options: dict) -> None:
        """stat gives the size, and a version tag that changes when the object is replaced."""
        url = base_url + "stat.bin"
        self.put(url, PAYLOAD, storage_options)
        backend = open_backend(url, storage_options=storage_options)
        info = backend.stat(url)
        assert info.size == len(PAYLOAD)
        self.put(url, PAYLOAD[::-1] + b"x", storage_options)
        info2 = backend.stat(url)
        assert info2.size == len(PAYLOAD) + 1
        if info.version is not None:
            assert info2.version is not None and info2.version != info.version

    def test_write_then_read_and_abort(self, base_url: str, storage_options: dict) -> None:
        """A write is readable after close; an aborted write leaves no object under its name."""
        if not self.supports_write:
            pytest.skip("this backend cannot write")
        self.put(base_url + "written.bin", b"hello", storage_options)
        assert self.get(base_url + "written.bin", storage_options) == b"hello"
        with pytest.raises(RuntimeError):
            with gopen(base_url + "aborted.bin", "wb", storage_options=storage_options) as stream:
                stream.write(PAYLOAD * 4)
                raise RuntimeError("boom")
        with pytest.raises(FileNotFoundError):
            self.get(base_url + "aborted.bin", storage_options)

    def test_list(self, base_url: str, storage_options: dict) -> None:
        """list yields the URLs under a prefix."""
        if not self.supports_list:
            pytest.skip("this backend cannot list")
        for name in ("list/a.tar", "list/b.tar", "other.tar"):
            self.put(base_url + name, b"x", storage_options)
        backend = open_backend(base_url, storage_options=storage_options)
        found = sorted(backend.list(base_url + "list/"))
        assert found == [base_url + "list/a.tar", base_url + "list/b.tar"]

    def test_missing_object(self, base_url: str, storage_options: dict) -> None:
        """A missing object raises FileNotFoundError (ShardNotFoundError) naming the URL."""
        url = base_url + "no-such-object.tar"
        with pytest.raises(FileNotFoundError) as info:
            self.get(url, storage_options)
        assert isinstance(info.value, WdsCloudError) and url in str(info.value)

    def test_wrong_credentials(self, base_url: str, storage_options: dict) -> None:
        """Rejected or missing credentials raise CredentialsError (a PermissionError) saying what to set."""
        self.put(base_url + "secret.bin", b"x", storage_options)
        bad = self.bad_credentials(storage_options)
        if bad is None:
            pytest.skip("this store checks no credentials")
        with pytest.raises(PermissionError) as info:
            self.get(base_url + "secret.bin", bad)
        assert isinstance(info.value, CredentialsError)
        for secret in _secrets(bad):
            assert secret not in str(info.value)

    def test_wrong_credentials_on_write(self, base_url: str, storage_options: dict) -> None:
        """A write with rejected or missing credentials raises CredentialsError too, at once, naming no secret."""
        bad = self.bad_credentials(storage_options)
        if bad is None:
            pytest.skip("this store checks no credentials")
        with pytest.raises(PermissionError) as info:
            self.put(base_url + "refused.bin", b"x" * 1000, bad)
        assert isinstance(info.value, CredentialsError), repr(info.value)
        for secret in _secrets(bad):
            assert secret not in str(info.value)

    def test_webdataset_over_the_scheme(self, base_url: str, storage_options: dict) -> None:
        """ShardWriter writes shards to the scheme and WebDataset reads every sample back."""
        pattern = base_url + "ds/shard-%06d.tar"
        with ShardWriter(pattern, maxcount=7, storage_options=storage_options) as sink:
            for i in range(20):
                sink.write({"__key__": f"{i:04d}", "txt": f"sample {i}", "cls": i})
        spec = base_url + "ds/shard-{000000..000002}.tar"
        samples = list(WebDataset(spec, shardshuffle=False, storage_options=storage_options).decode())
        assert [s["cls"] for s in samples] == list(range(20))
        assert samples[0]["__url__"] == base_url + "ds/shard-000000.tar"

    def test_rewrite_onto_the_scheme(
        self, base_url: str, storage_options: dict, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A WDS_REWRITE rule sends another URL to this scheme; __url__ stays the URL given."""
        self.put(base_url + "rw/shard.tar", _tiny_tar(), storage_options)
        monkeypatch.setenv("WDS_REWRITE", f"virtual://data/={base_url}rw/")
        samples = list(WebDataset("virtual://data/shard.tar", shardshuffle=False, storage_options=storage_options))
        assert [s["__key__"] for s in samples] == ["a"] and samples[0]["__url__"] == "virtual://data/shard.tar"

    # parallel ranged reads
    def _ranged(self, url: str, storage_options: dict) -> None:
        backend = open_backend(url, storage_options=storage_options)
        if not (backend.resumable and getattr(backend, "ranged_reads", False)):
            pytest.skip("this backend declares no ranged reads: shards are read as one stream")

    def test_parallel_parts_read_like_one_stream(self, base_url: str, storage_options: dict) -> None:
        """Shards read as 64 KiB parts (the smallest part size) on 4 connections (the next shard fetched ahead)
        give the samples of one stream per shard, in the same order, plain and gzip-compressed."""
        self._ranged(base_url, storage_options)
        urls = []
        for name in ("parted-plain.tar", "parted-packed.tar.gz"):
            out = io.BytesIO()
            with TarWriter(out, compress=name.endswith(".gz")) as writer:
                for i in range(40):
                    # bytes gzip cannot shrink: the compressed shard too is several parts (about 180 KB each)
                    writer.write({"__key__": f"{name[7]}{i:03d}", "bin": random.Random(i).randbytes(3000), "cls": i})
            self.put(base_url + name, out.getvalue(), storage_options)
            urls.append(base_url + name)
        one = [
            (s["__key__"], s["bin"])
            for s in WebDataset(urls, shardshuffle=False, storage_options=storage_options, concurrency=1)
        ]
        dataset = WebDataset(
            urls, shardshuffle=False, storage_options=storage_options, part_size="64KiB", concurrency=4, prefetch=1
        )
        parted = [(s["__key__"], s["bin"]) for s in dataset]
        assert parted == one and len(one) == 80
        assert dataset.stats.requests >= 3 * len(urls)  # parts, not one request per shard
        for url in urls:
            with Fetcher(storage_options, part_size="64KiB", concurrency=3).open(url, 512) as stream:
                assert stream.read() == self.get(url, storage_options, 512)

    def test_object_replaced_between_parts(self, base_url: str, storage_options: dict) -> None:
        """A part requested after the object was replaced raises ObjectChangedError: never a splice."""
        self._ranged(base_url, storage_options)
        url = base_url + "swapped.bin"
        old = PAYLOAD * 64  # ~1 MiB: 32 KiB first, then 64 KiB parts, at most 2 in flight and 2 held
        self.put(url, old, storage_options)
        with Fetcher(storage_options, part_size=65536, concurrency=2, prefetch=0).open(url) as stream:
            assert stream.read(1000) == old[:1000]
            self.put(url, b"another version " * 40000, storage_options)
            with pytest.raises(ObjectChangedError, match="changed"):
                while stream.read(65536):
                    pass

    def _versioned(self, url: str, storage_options: dict) -> None:
        """Skip unless a read of ``url`` names its version (the ``version`` of the stream ``gopen`` opens)."""
        with gopen(url, "rb", storage_options=storage_options) as stream:
            if getattr(stream, "version", None) is None:
                pytest.skip("the store's reads name no version: a replacement of the same size cannot be seen")

    def test_object_replaced_by_one_of_the_same_size_between_parts(self, base_url: str, storage_options: dict) -> None:
        """A replacement of the same size, seen by its version alone: ObjectChangedError, never a splice."""
        self._ranged(base_url, storage_options)
        url = base_url + "swapped-same-size.bin"
        old = PAYLOAD * 64
        self.put(url, old, storage_options)
        self._versioned(url, storage_options)
        with Fetcher(storage_options, part_size=65536, concurrency=2, prefetch=0).open(url) as stream:
            assert stream.read(1000) == old[:1000]
            self.put(url, old[::-1], storage_options)
            with pytest.raises(ObjectChangedError, match="changed"):
                while stream.read(65536):
                    pass

    # faults
    #: how the store says "slow down": (status, body) the proxy answers with in the throttling test
    throttle: tuple = (429, b"")

    def _shards(self, base_url: str, storage_options: dict, per_shard: int = 20) -> tuple[str, list]:
        """Three shards of ``per_shard`` 100 KB samples (the last one shorter) and their clean read."""
        pattern = base_url + "faults/shard-%06d.tar"
        payload = bytes(range(256)) * 400  # 100 KB per sample
        with ShardWriter(pattern, maxcount=per_shard, storage_options=storage_options) as sink:
            for i in range(per_shard * 5 // 2):
                sink.write({"__key__": f"{i:04d}", "bin": payload[i:] + payload[:i], "cls": i})
        spec = base_url + "faults/shard-{000000..000002}.tar"
        clean = [
            (s["__key__"], s["bin"]) for s in WebDataset(spec, shardshuffle=False, storage_options=storage_options)
        ]
        return spec, clean

    @pytest.mark.parametrize("fault", ["reset", "truncate", "error503", "throttled", "stall"])
    def test_faults_lose_and_repeat_nothing(self, faults, base_url: str, storage_options: dict, fault: str) -> None:
        """Through resets every ~1 MB (over 20 MB of shards), truncated bodies, 503s, the store's
        "slow down" answer or a stall, the samples equal a clean read."""
        proxy, proxied_base, proxied_options = faults
        spec, clean = self._shards(base_url, storage_options, per_shard=84 if fault == "reset" else 20)
        spec = spec.replace(base_url, proxied_base)
        timeout = None
        if fault == "reset":
            proxy.reset_after = 1_000_000
        elif fault == "truncate":
            proxy.truncate_after = 1_500_000
        elif fault == "error503":
            proxy.error_first = 2
        elif fault == "throttled":
            proxy.error_status, proxy.error_body = self.throttle
            proxy.error_first = 3
        else:
            proxy.stall_after = 1_200_000
            timeout = 1.0
        dataset = WebDataset(spec, shardshuffle=False, storage_options=proxied_options, timeout=timeout)
        got = [(s["__key__"], s["bin"]) for s in dataset]
        assert got == clean
        assert proxy.faults > 0 and dataset.stats.retries > 0

    def test_object_replaced_mid_read(self, faults, base_url: str, storage_options: dict) -> None:
        """An object replaced while it is read raises ObjectChangedError on resume: no splicing."""
        proxy, proxied_base, proxied_options = faults
        url = base_url + "changing.bin"
        self.put(url, PAYLOAD * 50, storage_options)
        proxy.reset_after = 400_000
        with gopen(url.replace(base_url, proxied_base), storage_options=proxied_options) as stream:
            assert stream.read(100_000) == (PAYLOAD * 50)[:100_000]
            self.put(url, b"new version" * 50000, storage_options)
            with pytest.raises(ObjectChangedError, match="changed"):
                while stream.read(65536):
                    pass

    def test_object_replaced_by_one_of_the_same_size_mid_read(
        self, faults, base_url: str, storage_options: dict
    ) -> None:
        """A replacement of the same size, met on resume after a reset: ObjectChangedError, no splicing."""
        proxy, proxied_base, proxied_options = faults
        url = base_url + "changing-same-size.bin"
        old = PAYLOAD * 50
        self.put(url, old, storage_options)
        self._versioned(url, storage_options)
        proxy.reset_after = 400_000
        with gopen(url.replace(base_url, proxied_base), storage_options=proxied_options) as stream:
            assert stream.read(100_000) == old[:100_000]
            self.put(url, old[::-1], storage_options)
            with pytest.raises(ObjectChangedError, match="changed"):
                while stream.read(65536):
                    pass

    def test_reset_inside_parts_resumes_them(self, faults, base_url: str, storage_options: dict) -> None:
        """Every connection reset 100 KB in: each 256 KiB part resumes at its next unread byte, and the
        bytes equal the object's."""
        self._ranged(base_url, storage_options)
        proxy, proxied_base, proxied_options = faults
        url = base_url + "parted-resets.bin"
        data = PAYLOAD * 96  # ~1.5 MiB
        self.put(url, data, storage_options)
        proxy.reset_after = 100_000
        fetcher = Fetcher(proxied_options, part_size=256 << 10, concurrency=4)
        with fetcher.open(url.replace(base_url, proxied_base)) as stream:
            assert stream.read() == data
        stats = fetcher.stats.snapshot()
        assert proxy.faults > 0 and stats.retries > 0 and stats.requests >= 6

    def test_dead_endpoint_fails_within_bounds(self, faults, base_url: str, storage_options: dict) -> None:
        """An endpoint that keeps failing gives up after the attempts allowed, with the whole story."""
        proxy, proxied_base, proxied_options = faults
        url = base_url + "dead.bin"
        self.put(url, PAYLOAD, storage_options)
        proxy.error_first = 10**6
        started = time.perf_counter()
        with pytest.raises(TransferError) as info:
            with gopen(url.replace(base_url, proxied_base), storage_options=proxied_options, retries=3) as stream:
                stream.read()
        assert time.perf_counter() - started < 30
        message = str(info.value)
        assert url.replace(base_url, proxied_base) in message and "3 attempts" in message and "byte 0" in message


def _secrets(options: dict) -> list[str]:
    return [
        str(v)
        for k, v in options.items()
        if any(word in k for word in ("key", "secret", "token", "password", "connection")) and v and len(str(v)) > 6
    ]


def _tiny_tar() -> bytes:
    out = io.BytesIO()
    with TarWriter(out) as writer:
        writer.write({"__key__": "a", "txt": "x"})
    return out.getvalue()
