"""Parallel ranged reads and shard prefetch (wds_cloud.io.parallel) against a real HTTP server with Range.

The per-backend checks (same samples as one stream on every remote backend, an object replaced between
parts) are in the conformance suite; these look at what the server saw (its request log), at memory in
a child process, and at settings.  Nothing is timed: waits are on the proxy's and fetcher's own events.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud.errors import ConfigError
from wds_cloud.io.parallel import MIN_PART, Fetcher, TransferOptions, plan_parts
from wds_cloud.testing.faults import FaultProxy

from . import servers

KiB = 1024


def shard_bytes(tag: str, samples: int = 30, size: int = 20_000) -> bytes:
    out = io.BytesIO()
    with wds.TarWriter(out) as writer:
        for i in range(samples):
            writer.write({"__key__": f"{tag}{i:04d}", "bin": bytes((i + j) % 253 for j in range(size))})
    return out.getvalue()


@pytest.fixture
def web():
    server, store = servers.http_server()
    yield server, store
    server.stop()


def gets(store: servers.Store, key: str) -> list:
    """The Range headers of the GETs of ``key``, in the order they came."""
    return [rng for method, k, rng in list(store.requests) if method == "GET" and k == key]


def span(rng: str) -> tuple[int, int]:
    first, last = rng.split("=", 1)[1].split("-")
    return int(first), int(last)


@given(
    start=st.integers(0, 10**6),
    length=st.integers(1, 10**7),
    part=st.integers(1 << 12, 1 << 25),
    concurrency=st.integers(1, 64),
)
def test_plan_covers_the_rest_in_order(start, length, part, concurrency):
    """Parts tile [start, size) in order, none longer than part_size, and as many as the connections
    allow while each keeps at least MIN_PART (or part_size)."""
    size = start + length
    parts = plan_parts(start, size, part, concurrency)
    assert parts[0][0] == start and parts[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    assert all(0 < e - s <= part for s, e in parts)
    assert len(parts) >= min(concurrency, length // min(part, MIN_PART))


def test_parts_give_the_bytes_of_one_stream_from_any_offset(web):
    server, store = web
    data = os.urandom(700 * KiB + 123)
    store.put("/b/obj.bin", data)
    for offset in (0, 1, 300 * KiB, len(data) - 5, len(data)):
        with Fetcher(part_size=64 * KiB, concurrency=4).open(f"{server.url}/b/obj.bin", offset) as stream:
            assert stream.read() == data[offset:]
            assert stream.size == len(data)


def test_a_reset_inside_a_part_resumes_that_part_only(web):
    """Each connection is reset 100 KB in: the resumed request starts inside the part it belongs to and ends
    where that part ends, so no other part is asked for again."""
    server, store = web
    data = os.urandom(1 << 20)
    store.put("/b/resets.bin", data)
    proxy = FaultProxy(server.url, reset_after=100_000)
    try:
        fetcher = Fetcher(part_size=256 * KiB, concurrency=3)
        with fetcher.open(f"{proxy.url}/b/resets.bin") as stream:
            assert stream.read() == data
    finally:
        proxy.stop()
    ranges = [span(r) for r in gets(store, "/b/resets.bin")]
    first = ranges[0]
    planned = [first] + [(s, e - 1) for s, e in plan_parts(first[1] + 1, len(data), 256 * KiB, 8)]
    planned_set = {p for p in ranges if any(p == q for q in planned)}
    resumed = [r for r in ranges if r not in planned_set]
    assert resumed, "the proxy reset connections, so some requests resumed"
    for s, e in resumed:
        owner = [p for p in ranges if p in planned_set and p[0] < s <= p[1]]
        assert owner and owner[0][1] == e  # inside one part, to that part's end
    assert fetcher.stats.snapshot().retries == len(resumed)


def test_a_small_shard_is_read_with_one_request(web):
    server, store = web
    data = shard_bytes("s", samples=5, size=1000)
    store.put("/b/small.tar", data)
    samples = list(wds.WebDataset(f"{server.url}/b/small.tar", shardshuffle=False))
    assert len(samples) == 5
    assert len(gets(store, "/b/small.tar")) == 1


class _NoRangeHandler(http.server.SimpleHTTPRequestHandler):
    """The standard library's file server: it ignores Range and always sends the whole file."""

    def log_message(self, *args) -> None:
        pass


def test_a_server_that_ignores_range_is_read_as_one_stream(tmp_path):
    for i in range(2):
        (tmp_path / f"s-{i}.tar").write_bytes(shard_bytes(f"{i}-", samples=40, size=30_000))
    handler = lambda *a, **k: _NoRangeHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/s-{{0..1}}.tar"
        expected = [s["__key__"] for s in wds.WebDataset(url, shardshuffle=False, concurrency=1)]
        # measured (the default): a host starts at one connection, one request for each whole shard
        dataset = wds.WebDataset(url, shardshuffle=False, part_size=64 * KiB)
        assert [s["__key__"] for s in dataset] == expected and len(expected) == 80
        assert dataset.stats.streams == 2 and dataset.stats.requests == 2
        # pinned to 4: the first part's answer (the whole object) is its shard's one stream; the next shard one GET
        dataset = wds.WebDataset(url, shardshuffle=False, part_size=64 * KiB, concurrency=4)
        assert [s["__key__"] for s in dataset] == expected
        assert dataset.stats.requests == 2 and dataset.stats.streams == 2
    finally:
        httpd.shutdown()
        httpd.server_close()


class _CountingNoRangeHandler(_NoRangeHandler):
    """Python's file server, counting the GETs of each path (``gets``, one list per server)."""

    gets: list

    def do_GET(self) -> None:
        self.gets.append(self.path)
        super().do_GET()


@pytest.mark.parametrize(
    "settings",
    [{}, {"part_size": 64 * KiB}, {"part_size": 64 * KiB, "concurrency": 4}, {"concurrency": 4, "prefetch": 3}],
    ids=["defaults", "measured", "pinned", "pinned-prefetch-3"],
)
def test_a_server_that_ignores_range_gets_one_get_per_shard(tmp_path, settings):
    """Python's ``http.server`` answers every GET with the whole file.  From the first shard on, each shard is one GET:
    every request of ours carries a Range (from byte 0 too), the first answer (a 200) is read on as its shard's one
    stream, and no part is asked of that host again; the shards asked for ahead before that answer came are one GET
    each the same way.  The samples are those of ``concurrency=1``, and ``ds.stats.hosts`` says why."""
    for i in range(6):
        (tmp_path / f"s-{i}.tar").write_bytes(shard_bytes(f"{i}-", samples=40, size=50_000))
    handler = type("H", (_CountingNoRangeHandler,), {"gets": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a, **k: handler(*a, directory=str(tmp_path), **k))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    host = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        url = f"{host}/s-{{0..5}}.tar"
        expected = [(s["__key__"], s["bin"]) for s in wds.WebDataset(url, shardshuffle=False, concurrency=1)]
        handler.gets.clear()
        dataset = wds.WebDataset(url, shardshuffle=False, **settings)
        assert [(s["__key__"], s["bin"]) for s in dataset] == expected and len(expected) == 240
        assert sorted(handler.gets) == [f"/s-{i}.tar" for i in range(6)]  # one GET per shard, no part
        figures = dataset.stats.hosts[host]
        assert figures["ignores_range"] is True and figures["level"] == 1
        assert "ignores Range" in figures["why"] and "one stream" in figures["why"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_host_that_stops_honouring_range_gets_no_part_after_its_first_whole_answer(web):
    """A host that honoured the first range of an object and ignores the later ones (a 200 with the whole object):
    the parts planned and not yet asked for are dropped, the rest is read on from an answer already coming (or one
    more request), so besides the first GET only the parts already in flight (at most the level, and one its reader
    waits on) reach it; the bytes are the object's, and the next object of the host is one GET."""

    class FirstRangeOnly(servers.HTTPObjectHandler):
        seen: set

        def do_GET(self) -> None:
            key = self._key()
            if key in self.seen and "Range" in self.headers:
                del self.headers["Range"]  # the whole object, 200
            self.seen.add(key)
            super().do_GET()

    store = servers.Store()
    server = servers.Server(type("H", (FirstRangeOnly,), {"store": store, "seen": set()}))
    try:
        data, other = os.urandom(2 << 20), os.urandom(300 * KiB)
        store.put("/h/a.bin", data)
        store.put("/h/b.bin", other)
        fetcher = Fetcher(part_size=64 * KiB, concurrency=4, prefetch=0)
        with fetcher.open(f"{server.url}/h/a.bin") as stream:
            assert stream.read() == data
        requested = gets(store, "/h/a.bin")
        assert len(plan_parts(32 * KiB, len(data), 64 * KiB, 4)) == 32  # what would have been asked for
        assert requested[0] == f"bytes=0-{32 * KiB - 1}" and len(requested) <= 1 + (4 + 1) + 1, requested
        with fetcher.open(f"{server.url}/h/b.bin") as stream:
            assert stream.read() == other
        assert gets(store, "/h/b.bin") == ["bytes=0-"]  # one stream: one request, from byte 0
    finally:
        server.stop()


def test_an_empty_object_answered_whole_says_nothing_of_range():
    """An empty object answered with a 200 (a range of nothing cannot be satisfied; some servers answer whole): the
    host is not taken for one that ignores Range, and its next object is read in parts."""

    class WholeWhenEmpty(servers.HTTPObjectHandler):
        def do_GET(self) -> None:
            if not self.store.objects.get(self._key(), b"x") and "Range" in self.headers:
                del self.headers["Range"]
            super().do_GET()

    store = servers.Store()
    server = servers.Server(type("H", (WholeWhenEmpty,), {"store": store}))
    try:
        data = os.urandom(600 * KiB)
        store.put("/e/empty.bin", b"")
        store.put("/e/full.bin", data)
        fetcher = Fetcher(part_size=64 * KiB, concurrency=4, prefetch=0)
        with fetcher.open(f"{server.url}/e/empty.bin") as stream:
            assert stream.read() == b""
        with fetcher.open(f"{server.url}/e/full.bin") as stream:
            assert stream.read() == data
        assert len(gets(store, "/e/full.bin")) > 2  # parts
    finally:
        server.stop()


def test_prefetch_follows_the_epoch_order_and_stops_with_the_reader(web):
    """The next shard of the (shuffled) order is asked for while one is read, never its last part; when
    the reader stops, every connection closes, and no shard it did not reach was fetched whole."""
    server, store = web
    sizes = {}
    for i in range(4):
        data = shard_bytes(f"{i}-", samples=30, size=20_000)
        store.put(f"/p/s-{i}.tar", data)
        sizes[f"/p/s-{i}.tar"] = len(data)
    proxy = FaultProxy(server.url)
    try:
        dataset = wds.WebDataset(
            f"{proxy.url}/p/s-{{0..3}}.tar", shardshuffle=4, seed=7, part_size=128 * KiB, concurrency=4, prefetch=1
        )
        order = [s["__url__"].rsplit("/p/", 1)[1] for s in dataset if s["__key__"].endswith("0000")]
        assert sorted(order) == [f"s-{i}.tar" for i in range(4)] and order != sorted(order)
        firsts = [key for method, key, rng in list(store.requests) if method == "GET" and rng.startswith("bytes=0-")]
        assert firsts == [f"/p/{name}" for name in order]  # every shard was first asked for in the epoch's order

        store.requests.clear()
        it = iter(dataset)
        first = next(it)
        it.close()  # stop after one sample
        proxy.wait_idle()  # every connection closed (waits on the proxy's count, not on time)
        current = first["__url__"].rsplit("/p", 1)[1]
        for key, size in sizes.items():
            if key == "/p" + current:
                continue
            fetched = [span(r) for r in gets(store, key)]
            assert all(e < size - 1 for _, e in fetched), f"{key} was fetched whole: {fetched}"
        for thread in [t for t in threading.enumerate() if t.name.startswith("wds_cloud part")]:
            thread.join(60)  # a part whose connection closed ends its thread (waits on the event, not a clock)
            assert not thread.is_alive()
    finally:
        proxy.stop()


def test_a_prefetched_shard_is_asked_for_ahead_and_its_parts_are_used(web):
    """While shard A is read, B's parts except its last are requested; opening B then uses them (its first
    range is asked for once) and requests only the rest."""
    server, store = web
    a, b = os.urandom(100 * KiB), os.urandom(600 * KiB)
    store.put("/f/a.bin", a)
    store.put("/f/b.bin", b)
    fetcher = Fetcher(part_size=128 * KiB, concurrency=4, prefetch=1)
    with fetcher.open(f"{server.url}/f/a.bin") as stream:
        assert stream.read() == a
        fetcher.prefetch([f"{server.url}/f/b.bin"])
        while fetcher.in_flight:
            threading.Event().wait(0.01)  # until the parts allowed ahead are in (polls the fetcher's state)
        ahead = [span(r) for r in gets(store, "/f/b.bin")]
        assert ahead and all(e < len(b) - 1 for _, e in ahead)  # asked for, but never its last part
    with fetcher.open(f"{server.url}/f/b.bin") as stream:
        assert stream.read() == b
    ranges = [span(r) for r in gets(store, "/f/b.bin")]
    assert len(ranges) == len(set(ranges)) and ranges[: len(ahead)] == ahead  # nothing asked for twice
    assert max(e for _, e in ranges) == len(b) - 1


def test_stats_report_parts_latency_and_connection_rate(web):
    server, store = web
    store.put("/b/big.tar", shard_bytes("b", samples=60, size=30_000))
    proxy = FaultProxy(server.url, latency=0.001)
    try:
        dataset = wds.WebDataset(f"{proxy.url}/b/big.tar", shardshuffle=False, part_size=128 * KiB, concurrency=4)
        assert len(list(dataset)) == 60
        stats = dataset.stats
        assert stats.requests > 1 and stats.concurrency > 1 and stats.part_bytes == stats.bytes
        assert stats.first_byte >= 0.001 and stats.connection_rate > 0
    finally:
        proxy.stop()


def test_memory_is_bounded_by_concurrency_times_part_size(web):
    """A 96 MiB object read with 1 MiB parts, 4 in flight: a reader that stops holds at most 4 MiB of it,
    and resident memory through a full read (in a child process, after every 1 MiB read) stays far
    below the object."""
    server, store = web
    store.put("/m/big.bin", bytes(range(256)) * (96 * 4096))
    child = textwrap.dedent(f"""
        import json, resource, sys, time
        from wds_cloud.io.parallel import Fetcher
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * resource.getpagesize()
        f = Fetcher(part_size=1 << 20, concurrency=4)
        with f.open("{server.url}/m/big.bin") as s:  # warm up imports and the first buffers
            s.read(1)
        base = rss()
        with f.open("{server.url}/m/big.bin") as s:
            s.read(1)
            while f.in_flight:
                time.sleep(0.01)  # until every part allowed is downloaded (polls the fetcher's state)
            held, stopped = f.held, rss() - base
            total = peak = 0
            while True:
                chunk = s.read(1 << 20)
                if not chunk:
                    break
                total += len(chunk)
                peak = max(peak, rss() - base)
        print(json.dumps({{"held": held, "stopped": stopped, "peak": peak, "total": total}}))
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["total"] == 96 * (1 << 20) - 1
    assert figures["held"] <= 4 << 20
    assert figures["stopped"] < 16 << 20
    assert figures["peak"] < 32 << 20


def test_settings_come_from_the_dataset_then_the_profile_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WDS_PART_SIZE", "2MB")
    monkeypatch.setenv("WDS_CONCURRENCY", "3")
    monkeypatch.setenv("WDS_PREFETCH", "2")
    profile = tmp_path / "profiles.toml"
    profile.write_text('["http://fast.example/"]\nconcurrency = 12\npart_size = "16MiB"\n')
    monkeypatch.setenv("WDS_CLOUD_CONFIG", str(profile))
    assert Fetcher().options("http://other.example/x.tar") == TransferOptions(2_000_000, 3, None, 2)
    assert Fetcher().options("http://fast.example/x.tar") == TransferOptions(16 << 20, 12, None, 2)
    assert Fetcher(concurrency=1, prefetch=0).options("http://fast.example/x.tar") == TransferOptions(
        16 << 20, 1, None, 0
    )
    assert Fetcher(prefetch=0).depth == 0 and Fetcher().depth == 2
    # the profile's transfer keys never reach the backend as storage options
    from wds_cloud.config import current
    from wds_cloud.io import profiles

    assert "concurrency" not in profiles.options_for("http://fast.example/x.tar", current())


@pytest.mark.parametrize("bad", [{"concurrency": 0}, {"part_size": "lots"}, {"prefetch": -1}, {"max_concurrency": 1.5}])
def test_bad_settings_are_config_errors(bad):
    with pytest.raises(ConfigError):
        wds.WebDataset("http://127.0.0.1:1/x.tar", **bad)


def test_bad_environment_is_a_config_error(monkeypatch):
    monkeypatch.setenv("WDS_CONCURRENCY", "0")
    with pytest.raises(ConfigError, match="WDS_CONCURRENCY"):
        wds.WebDataset("http://127.0.0.1:1/x.tar")


def test_dataloader_workers_read_every_sample_once_with_parts(web):
    torch = pytest.importorskip("torch")
    server, store = web
    for i in range(4):
        store.put(f"/w/s-{i}.tar", shard_bytes(f"{i}-", samples=25, size=20_000))
    url = f"{server.url}/w/s-{{0..3}}.tar"
    dataset = wds.WebDataset(url, shardshuffle=False, part_size=64 * KiB, concurrency=4, prefetch=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    keys = sorted(s["__key__"] for s in loader)
    assert keys == sorted(s["__key__"] for s in wds.WebDataset(url, shardshuffle=False, concurrency=1))
    assert len(keys) == 100


def test_the_shard_cache_tees_parts_into_a_complete_entry(web, tmp_path):
    """Through a cache directory, parts stream to the reader while the entry fills; the next pass reads
    the cache only, and its samples are the same."""
    server, store = web
    for i in range(3):
        store.put(f"/c/s-{i}.tar", shard_bytes(f"{i}-", samples=20, size=20_000))
    url = f"{server.url}/c/s-{{0..2}}.tar"
    clean = [(s["__key__"], s["bin"]) for s in wds.WebDataset(url, shardshuffle=False, concurrency=1)]
    dataset = wds.WebDataset(
        url, shardshuffle=False, cache_dir=str(tmp_path / "cache"), part_size=64 * KiB, concurrency=4
    )
    assert [(s["__key__"], s["bin"]) for s in dataset] == clean
    assert dataset.stats.requests > 3 and dataset.stats.cache_misses == 3
    store.requests.clear()
    again = wds.WebDataset(url, shardshuffle=False, cache_dir=str(tmp_path / "cache"), part_size=64 * KiB)
    assert [(s["__key__"], s["bin"]) for s in again] == clean
    assert not gets(store, "/c/s-0.tar") and again.stats.cache_hits == 3


@pytest.mark.parametrize("cut", [1, 17, 30, 44])
def test_resume_mid_shard_reads_the_rest_in_parts(web, cut):
    """A state saved mid-shard resumes at its byte offset with ranged parts: the pieces are the whole run."""
    server, store = web
    for i in range(3):
        store.put(f"/r/s-{i}.tar", shard_bytes(f"{i}-", samples=20, size=20_000))
    proxy = FaultProxy(server.url)
    url = f"{proxy.url}/r/s-{{0..2}}.tar"

    def build():
        return wds.WebDataset(url, shardshuffle=False, part_size=64 * KiB, concurrency=3)

    try:
        full = [s["__key__"] for s in build()]
        first = build()
        it = iter(first)
        got = [next(it)["__key__"] for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))
        it.close()
        for thread in [t for t in threading.enumerate() if t.name.startswith("wds_cloud part")]:
            thread.join(60)  # every part the first reader started has ended (none is still about to connect)
        proxy.wait_idle()  # and its connections are all closed: the log below is the second reader's
        store.requests.clear()
        second = build()
        second.load_state_dict(state)
        got += [s["__key__"] for s in second]
    finally:
        proxy.stop()
    assert got == full
    reader = next(st for _, kind, st in state["stages"] if kind == "TarSamples")
    resumed = [span(r) for r in gets(store, f"/r/{reader['url'].rsplit('/', 1)[1]}")]
    assert resumed and resumed[0][0] == reader["offset"]  # the saved shard opened at the saved byte


def test_a_server_answering_the_wrong_range_is_an_error_not_a_splice():
    """A 206 whose Content-Range starts elsewhere than asked fails with the URL and both offsets."""

    class Shifted(servers.HTTPObjectHandler):
        def do_GET(self):
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and not rng.startswith("bytes=0-"):
                start, _, end = rng[6:].partition("-")
                shifted = f"bytes={int(start) + 512}-{end}"
                self.headers.replace_header("Range", shifted)
            super().do_GET()

    store = servers.Store()
    server = servers.Server(type("H", (Shifted,), {"store": store}))
    try:
        store.put("/b/obj.bin", os.urandom(600 * KiB))
        with pytest.raises(wds.TransferError, match="asked for the bytes from") as info:
            with Fetcher(part_size=128 * KiB, concurrency=2).open(f"{server.url}/b/obj.bin") as stream:
                stream.read()
        assert "/b/obj.bin" in str(info.value)
    finally:
        server.stop()


@pytest.mark.parametrize(
    "sources",
    [
        ("environment", "environment"),
        ("environment", "argument"),
        ("argument", "environment"),
        ("profile", "argument"),
        ("argument", "profile"),
        ("environment", "profile"),
        ("profile", "profile"),
        ("argument", "argument"),
    ],
)
def test_concurrency_above_max_concurrency_is_refused_whatever_set_each(web, tmp_path, monkeypatch, sources):
    """WDS_CONCURRENCY=8 with WDS_MAX_CONCURRENCY=4 (or either of them an argument, or a profile's key) was taken,
    and the host was read at a level of 8 under a cap of 4: the settings resolved from every source are checked,
    and the error names where each value came from."""
    server, store = web
    store.put("/pair/s.tar", shard_bytes("p", samples=2, size=100))
    profile = tmp_path / "profiles.toml"
    arguments, keys, said = {}, [], []
    for key, value, source in zip(("concurrency", "max_concurrency"), (8, 4), sources):
        if source == "environment":
            monkeypatch.setenv(f"WDS_{key.upper()}", str(value))
            said.append(f"from WDS_{key.upper()}")
        elif source == "argument":
            arguments[key] = value
            said.append("given as an argument")
        else:
            keys.append(f"{key} = {value}")
            said.append(f'from the profile ["{server.url}/"] of {profile}')
    if keys:
        profile.write_text(f'["{server.url}/"]\n' + "\n".join(keys) + "\n")
        monkeypatch.setenv("WDS_CLOUD_CONFIG", str(profile))
    with pytest.raises(ConfigError) as info:
        list(wds.WebDataset(f"{server.url}/pair/s.tar", shardshuffle=False, **arguments))
    assert f"concurrency=8 ({said[0]}) is above max_concurrency=4 ({said[1]}): " in str(info.value)
    assert "give a concurrency of at most 4" in str(info.value)
    assert not [key for method, key, _ in store.requests if method == "GET"]  # refused before any request


def test_a_pair_in_conflict_is_taken_where_a_source_above_it_settles_it(web, tmp_path, monkeypatch):
    """What is checked is what is used: WDS_CONCURRENCY=8 over WDS_MAX_CONCURRENCY=4 is no conflict for a dataset
    given concurrency=2, nor for a URL whose profile raises the ceiling to 16."""
    server, store = web
    store.put("/pair/s.tar", shard_bytes("p", samples=2, size=100))
    monkeypatch.setenv("WDS_CONCURRENCY", "8")
    monkeypatch.setenv("WDS_MAX_CONCURRENCY", "4")
    ds = wds.WebDataset(f"{server.url}/pair/s.tar", shardshuffle=False, concurrency=2)
    assert len(list(ds)) == 2
    assert [(h["level"], h["cap"]) for h in ds.stats.hosts.values()] == [(2, 4)]
    profile = tmp_path / "profiles.toml"
    profile.write_text(f'["{server.url}/"]\nmax_concurrency = 16\n')
    monkeypatch.setenv("WDS_CLOUD_CONFIG", str(profile))
    ds = wds.WebDataset(f"{server.url}/pair/s.tar", shardshuffle=False)
    assert len(list(ds)) == 2
    assert [(h["level"], h["cap"]) for h in ds.stats.hosts.values()] == [(8, 16)]
