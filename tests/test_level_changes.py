"""Whatever the controller decides, and whenever, a shard's bytes are the object's: property tests with the
level changed at random moments (up splits a shard read on one connection, down plans the rest again,
one connection hands the stream to the reader), over a real server, read with read() and readinto()."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from wds_cloud.io import concurrency
from wds_cloud.io.parallel import Fetcher
from wds_cloud.testing.objects import http_server

KiB = 1024


@pytest.fixture(scope="module")
def store():
    server, store = http_server()
    yield server, store
    server.stop()


class Chaos:
    """Replaces the controller's decisions: every few reports a window is due, and the level jumps to a level
    drawn from ``rng``."""

    def __init__(self, rng: random.Random, every: int) -> None:
        self.rng = rng
        self.every = every
        self.calls = 0
        self.changes = 0

    def due(self, controller, now):
        self.calls += 1
        return self.calls % self.every == 0

    def decide(self, controller, now, *args, **kwargs):
        # always another level: a decision that kept the level changed nothing to test (a read of few parts,
        # with one or two decisions, then moved no level about one time in three)
        new = self.rng.choice([level for level in (1, 2, 3, 4, 8) if level != controller.level])
        old = controller.level
        controller.level = new
        controller._open_window(now, 0.0)
        if new != old:
            self.changes += 1
            return new
        return None


def _read_all(stream, rng: random.Random) -> bytes:
    out = bytearray()
    while True:
        size = rng.choice([1, 511, 4096, 65536, 300_000, 1 << 20])
        if rng.random() < 0.5:
            data = stream.read(size)
            if not data:
                return bytes(out)
            out += data
        else:
            buf = bytearray(size)
            n = stream.readinto(buf)
            if not n:
                return bytes(out)
            out += buf[:n]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(sizes=[268873], part=64 * KiB, every=2, seed=0, start_level=1, offset_share=0.0)  # no level moved once
@given(
    sizes=st.lists(st.integers(0, 3_000_000), min_size=1, max_size=3),
    part=st.sampled_from([64 * KiB, 256 * KiB, 1 << 20]),
    every=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    start_level=st.sampled_from([1, 1, 2, 6]),
    offset_share=st.floats(0, 1),
)
def test_any_level_changes_keep_every_byte_in_place(
    store, monkeypatch, sizes, part, every, seed, start_level, offset_share
):
    server, objects = store
    rng = random.Random(seed)
    urls = []
    for i, size in enumerate(sizes):
        key = f"/chaos/{seed}-{i}.bin"
        objects.put(key, rng.randbytes(size))
        urls.append(server.url + key)
    chaos = Chaos(rng, every)
    monkeypatch.setattr(concurrency.Controller, "due", lambda self, now: chaos.due(self, now))
    monkeypatch.setattr(concurrency.Controller, "decide", lambda self, now, *a, **k: chaos.decide(self, now))
    concurrency.forget()
    concurrency.seed({server.url: {"level": start_level}})
    try:
        fetcher = Fetcher(part_size=part, prefetch=1)
        for i, url in enumerate(urls):
            data = objects.objects[url[len(server.url) :]]
            offset = int(len(data) * offset_share) if i == 0 else 0
            fetcher.prefetch(urls[i + 1 :])
            with fetcher.open(url, offset) as stream:
                assert _read_all(stream, rng) == data[offset:]
        fetcher.close()
        # the levels really moved while the bytes were read, where they were read in parts from the start (at one
        # connection an object of a few parts may come in one request, with no decision while it is read)
        if every <= 4 and start_level > 1 and sum(sizes) - int(sizes[0] * offset_share) > 4 * part:
            assert chaos.changes > 0
    finally:
        concurrency.forget()


@pytest.mark.parametrize("concurrency_", [None, 1, 4])
def test_an_empty_object_reads_as_empty_at_any_level(store, concurrency_):
    """A range of an empty object is not satisfiable (416, as S3 answers): that is an empty read, not an error."""
    server, objects = store
    objects.put("/chaos/empty.bin", b"")
    with Fetcher(concurrency=concurrency_).open(server.url + "/chaos/empty.bin") as stream:
        assert stream.read() == b""


class RiseOnce:
    """Replaces the controller's decisions: every report closes a window (so no window's length matters), and the
    first moves the level from one connection to two, where it stays."""

    def due(self, controller, now):
        return True

    def decide(self, controller, now, *args, **kwargs):
        if controller.level != 1:
            return None
        controller.level = 2
        return 2


class SmallParts(Fetcher):
    """A fetcher whose parts are ``part`` bytes, below the floor the settings hold ``part_size`` to: the floor is a
    policy (refused as a setting, see test_config), that the reader always makes progress is not."""

    def __init__(self, part, **given):
        super().__init__(**given)
        self.part = part

    def options(self, url):
        return dataclasses.replace(super().options(url), part_size=self.part)


@pytest.mark.parametrize("part", [1, 2, 3, 511, 4097])
def test_parts_smaller_than_a_piece_or_a_header_never_stall_the_reader(store, monkeypatch, part):
    """A part size below a tar header, a piece or FIRST_PIECE, one byte included, reads every byte: the next shard,
    fetched ahead on one connection (holding at most a part unread) and read after the level rose to two, too short
    to be split, is handed over by its filler piece by piece.  With a one-byte part that filler waited for the
    reader to leave less than none unread (half of one byte), the reader for its bytes: both, forever."""
    server, objects = store
    urls = []
    for i in range(2):
        key = f"/small/{part}-{i}.bin"
        objects.put(key, random.Random(i).randbytes(3000))
        urls.append(server.url + key)
    rise = RiseOnce()
    monkeypatch.setattr(concurrency.Controller, "due", lambda self, now: rise.due(self, now))
    monkeypatch.setattr(concurrency.Controller, "decide", lambda self, now, *a, **k: rise.decide(self, now))
    concurrency.forget()
    fetcher = SmallParts(part, prefetch=1)
    got: list = []

    def read():
        for i, url in enumerate(urls):
            with fetcher.open(url) as stream:
                fetcher.prefetch(urls[i + 1 :])  # the next shard is fetched ahead at one connection
                got.append(_read_all(stream, random.Random(part)))

    reader = threading.Thread(target=read, daemon=True)
    try:
        reader.start()
        reader.join(timeout=120)  # generous: only turns a hang into a failure (it takes well under a second)
        assert not reader.is_alive(), "the reader stalled"
        assert got == [objects.objects[url[len(server.url) :]] for url in urls]
    finally:
        fetcher.close()  # a stalled reader gets an error and ends
        concurrency.forget()
