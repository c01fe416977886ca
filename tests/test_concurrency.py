"""The connection controller: measured per host, up and down (a simulated store and clock), then end to end
over the emulated link and over a store where every range costs the whole object (counters, not timings)."""

from __future__ import annotations

import random
import sys
import threading
import types

import pytest

import wds_cloud as wds
from wds_cloud.io import concurrency
from wds_cloud.io.concurrency import REPROBE, Controller, worker_share
from wds_cloud.io.parallel import (
    BIG_CHUNK,
    CHUNK,
    FIRST_PIECE,
    FIRST_SAMPLE_BYTES,
    Fetcher,
    ahead_due,
    connection_rate,
    part_step,
)
from wds_cloud.testing.link import EmulatedLink
from wds_cloud.testing.objects import HTTPObjectHandler, Server, Store, http_server

from .test_parallel_reads import shard_bytes

MB = 1e6


class SimulatedStore:
    """A store and a reader in simulated time: ``rate(level, t)`` bytes/s of all connections together, a reader
    that takes ``reader`` bytes/s at most; every step, what arrives and how long the reader waited."""

    def __init__(self, rate, reader=2000 * MB, latency=0.03, remaining=None, part_size=None):
        self.rate = rate
        self.reader = reader
        self.latency = latency
        self.remaining = remaining
        self.part_size = part_size  # given: the connection rate is told too (as the fetcher does)
        self.now = 0.0
        self.levels = []

    def run(self, controller: Controller, seconds: float, step: float = 0.002) -> Controller:
        controller.first_byte(self.latency)
        end = self.now + seconds
        while self.now < end:
            level = controller.level
            controller.flight(level, self.now)
            self.now += step
            store = self.rate(level, self.now)
            delivered = min(store, self.reader)
            controller.received(int(delivered * step), self.now)
            controller.waited(step * max(0.0, 1 - store / self.reader))
            if controller.due(self.now):
                per_connection = store / level if self.part_size else None
                controller.decide(self.now, self.remaining, per_connection, self.part_size)
            self.levels.append(controller.level)
        return controller


def paced(per_connection, total):
    return lambda level, t: min(level * per_connection, total)


def test_a_paced_link_grows_to_where_more_connections_stop_helping():
    store = SimulatedStore(paced(50 * MB, 400 * MB))
    controller = store.run(Controller(16), 3.0)
    # 8 x 50 MB/s fill the link: it settles where the link is full, below the 16 it tried
    assert 8 <= controller.level <= 10
    assert controller.rates[controller.level] == pytest.approx(400 * MB, rel=0.05)
    assert 16 in controller.rates and controller.rates[16] < controller.rates[controller.level] * 1.1
    assert store.levels[0] == 1  # it started from one connection


def test_a_store_where_ranges_cost_goes_back_to_one_connection():
    store = SimulatedStore(lambda level, t: 900 * MB / level)  # every extra request slows all
    controller = store.run(Controller(16), 3.0)
    assert controller.level == 1
    trials = sum(1 for a, b in zip(store.levels, store.levels[1:]) if b > a)
    assert trials <= 3  # 4, then 2, then it stays: the ceiling is remembered


def test_more_connections_are_not_tried_where_they_cannot_pay():
    # the reader waits, but what is left of the shard takes less than two first bytes at the current rate
    store = SimulatedStore(lambda level, t: 900 * MB / level, latency=0.09, remaining=64 << 20)
    controller = store.run(Controller(16), 2.0)
    assert set(store.levels) == {1}
    assert "would not pay" in controller.reason


def test_no_parts_where_a_part_would_wait_longer_for_its_first_byte_than_it_flows():
    # one connection carries 1.8 GB/s, a request waits 90 ms for its first byte: an 8 MiB part would
    # flow for 5 ms after waiting 90 (as on moto, which copies the whole object for every GET)
    store = SimulatedStore(lambda level, t: 1800 * MB, reader=4000 * MB, latency=0.09, part_size=8 << 20)
    controller = store.run(Controller(16), 2.0)
    assert set(store.levels) == {1} and "would not pay" in controller.reason
    # the same first byte on a link of 50 MB/s per connection: parts flow for 160 ms, and it grows
    store = SimulatedStore(paced(50 * MB, 800 * MB), latency=0.09, part_size=8 << 20)
    assert store.run(Controller(16), 4.0).level > 4


def test_a_reader_that_is_never_kept_waiting_stays_on_one_connection():
    store = SimulatedStore(paced(500 * MB, 4000 * MB), reader=100 * MB)
    controller = store.run(Controller(16), 2.0)
    assert set(store.levels) == {1}
    assert "not waiting" in controller.reason


def test_it_measures_again_and_follows_a_link_that_got_faster():
    store = SimulatedStore(lambda level, t: min(level * 50 * MB, 200 * MB if t < 5 else 800 * MB))
    controller = store.run(Controller(16), 4.9)
    assert controller.level == 4
    before = len(store.levels)
    store.run(controller, REPROBE + 6.0)
    # it ends at 16 (the level held since the link got faster; a re-probe may be on when the run stops)
    assert held(store.levels[before + (len(store.levels) - before) // 2 :]) == 16, controller.report()


def test_it_comes_down_when_the_store_starts_to_suffer_from_many_connections():
    def rate(level, t):
        if t < 3:
            return min(level * 50 * MB, 400 * MB)
        return 300 * MB if level <= 2 else 300 * MB * 2 / level  # many connections now cost

    store = SimulatedStore(rate)
    controller = store.run(Controller(16), 2.9)
    assert 8 <= controller.level <= 10
    store.run(controller, 3 * REPROBE + 3)
    assert controller.level <= 2


def test_a_level_learned_elsewhere_is_checked_against_fewer_connections_at_once():
    store = SimulatedStore(lambda level, t: 900 * MB / level)
    controller = store.run(Controller(16, start=8), 1.0)
    assert controller.level == 1


def test_a_pinned_level_is_never_measured_or_changed():
    store = SimulatedStore(lambda level, t: 900 * MB / level)
    controller = store.run(Controller(16, fixed=6), 1.0)
    assert set(store.levels) == {6} and controller.decisions == 0
    assert controller.report()["pinned"] and "concurrency=6" in controller.report()["why"]


def test_the_ceiling_is_a_share_of_the_machine(monkeypatch):
    assert worker_share(16) == 16 and worker_share(16, local_world_size=4) == 4
    fake_torch = types.ModuleType("torch")
    fake_torch.utils = types.SimpleNamespace(
        data=types.SimpleNamespace(get_worker_info=lambda: types.SimpleNamespace(num_workers=2, id=0))
    )
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert worker_share(16) == 8 and worker_share(16, local_world_size=2) == 4 and worker_share(3, 8) == 1


def test_what_is_learned_travels_to_a_spawned_worker_and_hostile_tables_are_ignored():
    concurrency.forget()
    try:
        concurrency.controller_for("http://a.example", 16).level = 6
        table = concurrency.learned()
        concurrency.forget()
        concurrency.seed(
            {
                **table,
                "http://b.example": {"level": 10**9},
                "http://c.example": "x",
                "http://d.example": {"level": True},
            }
        )
        assert concurrency.report()["http://a.example"]["level"] == 6
        assert set(concurrency.report()) == {"http://a.example"}
        # a worker's ceiling caps what it was handed
        assert concurrency.controller_for("http://a.example", 4).level == 4
    finally:
        concurrency.forget()


class SimulatedReader:
    """Shards read part by part as the fetcher reads them, in simulated time, from a host whose connections each
    carry ``per_connection(open, t)`` bytes/s while ``open`` connections transfer.  As the fetcher does: at one
    connection a request asks for the rest of its shard (split a little ahead of where it is when more are
    chosen), above one the rest is asked for as parts (:func:`part_step`); each part carries the controller's
    ticket; when fewer connections are chosen, the parts beyond the level that the reader needs last pause
    and ask for the rest of their ranges when there is room.  ``run`` returns the simulated seconds the read
    took."""

    def __init__(
        self, per_connection, shards=4, shard_size=64 << 20, part_size=8 << 20, latency=0.03, step=0.01, piece=None
    ):
        self.per_connection = per_connection
        self.piece = piece  # bytes a part hands on at once, as the fetcher's reads do (None: every step's)
        self.sizes = [shard_size] * shards
        self.part_size = part_size
        self.latency = latency
        self.step = step
        self.now = 0.0
        self.levels: list[int] = []

    def _send(self, controller, part, parts):
        part.update(first=self.now + self.latency, told=False, ticket=controller.ticket(), held=0)
        parts.append(part)
        controller.flight(len(parts), self.now)

    def run(self, controller: Controller) -> float:
        shard, cursor, left = 0, 0, sum(self.sizes)
        parts: list[dict] = []  # in flight: shard, pos, end, streamed, first (its first byte), ticket
        paused: list[dict] = []
        while left > 0:
            level = controller.level
            if level > 1:  # a request for the rest of the shard stops a little ahead; the rest becomes parts
                for p in parts:
                    if p["streamed"] and p["end"] == self.sizes[p["shard"]]:
                        ahead = -(-(p["pos"] + int(self.per_connection(len(parts), self.now) * self.latency)) // CHUNK)
                        if p["end"] - ahead * CHUNK >= 1 << 20:
                            p["end"], p["streamed"], cursor = ahead * CHUNK, False, ahead * CHUNK
                            p["ticket"] = Controller.CUT
            while paused and len(parts) < level:
                self._send(controller, paused.pop(0), parts)
            while len(parts) < level and shard < len(self.sizes):
                if cursor >= self.sizes[shard]:
                    shard, cursor = shard + 1, 0
                    continue
                if level == 1:
                    end = self.sizes[shard]
                else:
                    end = min(
                        self.sizes[shard], cursor + part_step(cursor, self.sizes[shard], self.part_size, level)[0]
                    )
                self._send(controller, {"shard": shard, "pos": cursor, "end": end, "streamed": level == 1}, parts)
                cursor = end
            self.now += self.step
            rate = self.per_connection(len(parts), self.now)
            arrived = 0
            for p in parts:
                if p["first"] > self.now:
                    continue
                if not p["told"]:
                    p["told"] = True
                    controller.first_byte(self.latency)
                n = min(p["end"] - p["pos"], int(rate * self.step))
                p["pos"] += n
                arrived += n
                p["held"] += n
                # the fetcher reads small pieces while a level above a measured one is on trial
                piece = min(self.piece, FIRST_PIECE) if self.piece and controller.trying_more else self.piece
                if not piece or p["held"] >= piece or p["pos"] >= p["end"]:
                    controller.received(p["held"], self.now, p["ticket"])
                    p["held"] = 0
            left -= arrived
            for p in [p for p in parts if p["pos"] >= p["end"]]:
                parts.remove(p)
                controller.flight(len(parts), self.now)
            controller.waited(self.step * max(0.0, 1 - arrived / self.step / (4000 * MB)))  # a fast reader
            if controller.due(self.now):
                before = controller.level
                known = sum(self.sizes[shard : shard + 2]) - cursor + sum(p["end"] - p["pos"] for p in parts + paused)
                controller.decide(self.now, known, rate, self.part_size)
                if controller.level < before:  # the parts the reader needs last pause
                    order = sorted(parts, key=lambda p: (p["shard"], p["pos"]))
                    for p in order[max(1, controller.level) :]:
                        if not p["streamed"]:
                            parts.remove(p)
                            paused.append(p)
                    paused.sort(key=lambda p: (p["shard"], p["pos"]))
                    controller.flight(len(parts), self.now)
            self.levels.append(controller.level)
        return self.now


def suffering(n, per_connection=3 * MB, share=0.5):
    """A host whose connections each carry ``per_connection`` while at most ``n`` are open; with more, every one
    slows so that all of them together carry ``share`` of what ``n`` did."""
    return lambda open_, t: per_connection if open_ <= n else per_connection * n * share / open_


def learned_against_fixed(per_connection, levels=(1, 2, 3, 4, 5, 6, 8, 12, 16), **reader):
    """(seconds with the measured level, its controller, the reader, the best fixed level, its seconds)."""
    fixed = {level: SimulatedReader(per_connection, **reader).run(Controller(16, fixed=level)) for level in levels}
    best = min(fixed, key=fixed.get)
    simulated = SimulatedReader(per_connection, **reader)
    controller = Controller(16)
    return simulated.run(controller), controller, simulated, best, fixed[best]


def test_bytes_of_a_part_sent_at_a_higher_level_are_not_this_levels():
    """Bytes of parts sent at a higher level restart the window of a lower one; parts sent at a lower level count."""
    controller = Controller(16, start=4)
    controller.first_byte(0.01)
    high = controller.ticket()
    controller.level = 1  # fewer connections were chosen; parts sent at 4 still arrive
    now = 0.0
    for _ in range(200):
        now += 0.001
        controller.received(100_000, now, high)
        controller.received(3_000, now, controller.ticket())
    assert not controller.due(now)  # nothing measured while the parts of 4 arrived
    for _ in range(100):
        now += 0.001
        controller.received(3_000, now, controller.ticket())
    assert controller.due(now)
    controller.decide(now)
    assert controller.rates[1] == pytest.approx(3e6, rel=0.05)  # what one connection carried, nothing more
    low = controller.ticket()
    controller.level = 4
    for _ in range(100):
        now += 0.001
        controller.received(3_000, now, low)
    assert controller.due(now)


@pytest.mark.parametrize("ceiling", [2, 4, 6])
@pytest.mark.parametrize("per_connection,share", [(3 * MB, 0.5), (3 * MB, 0.25), (20 * MB, 0.6)])
def test_against_a_host_that_suffers_past_n_connections_the_level_ends_near_n(ceiling, per_connection, share):
    """The read takes no more than 1.3x the best fixed level's, and the level held is near N (simulated clock)."""
    seconds, controller, simulated, best, best_seconds = learned_against_fixed(
        suffering(ceiling, per_connection, share), shards=max(2, int(60 * per_connection * ceiling) >> 26)
    )
    assert best == ceiling
    assert seconds <= 1.3 * best_seconds, (seconds, best_seconds, controller.report())
    assert abs(held(simulated.levels) - ceiling) <= 1, controller.report()  # most of the time,
    assert abs(held(simulated.levels[len(simulated.levels) // 2 :]) - ceiling) <= 1  # and at the end


def held(levels):
    """The level held for the most steps (a trial at the end of a read is only a trial)."""
    return max(set(levels), key=levels.count)


def test_against_a_host_whose_best_level_is_one_it_stays_near_one():
    """A host that suffers from a second connection: the read is close to one connection's."""
    seconds, controller, simulated, best, best_seconds = learned_against_fixed(suffering(1, 10 * MB, 0.5), shards=8)
    assert best == 1
    assert seconds <= 1.3 * best_seconds, (seconds, best_seconds, controller.report())
    assert simulated.levels.count(1) > 0.8 * len(simulated.levels) and controller.level == 1


def test_against_a_host_with_no_ceiling_it_grows_to_the_cap():
    """Every connection adds (no limit below 16): it ends at the cap and within 1.3x of 16 fixed."""
    seconds, controller, simulated, best, best_seconds = learned_against_fixed(
        lambda open_, t: 5 * MB, shards=8, levels=(4, 8, 16)
    )
    assert best == 16
    assert seconds <= 1.3 * best_seconds, (seconds, best_seconds, controller.report())
    assert controller.level == 16


def crowded(n, fast=6 * MB, slow=1 * MB):
    """A host that paces every connection to ``slow`` while more than ``n`` are open (as ``FaultProxy(crowd=n)``)."""
    return lambda open_, t: fast if open_ <= n else slow


@pytest.mark.parametrize(
    "host,best_level",
    [(crowded(3), 3), (crowded(4), 4), (crowded(5), 5), (crowded(6), 6), (lambda open_, t: 5 * MB, 16)],
)
def test_in_a_short_pass_the_search_above_a_good_level_costs_little(host, best_level):
    """A pass of a few seconds (8 shards of 22 MB, bytes handed on in pieces of 256 KB as the fetcher reads them):
    the levels tried above the one the host bears cost little (one step past it, each judged on as few windows
    as it takes to see it is slower), and more connections are still found where they keep helping."""
    seconds, controller, simulated, best, best_seconds = learned_against_fixed(
        host, levels=sorted({1, 2, 4, 8, 16, best_level}), shards=8, shard_size=22_000_000, piece=CHUNK
    )
    assert best == best_level
    assert seconds <= 1.3 * best_seconds, (seconds, best_seconds, controller.report())
    assert abs(controller.level - best_level) <= 1, controller.report()


@pytest.mark.parametrize("n", [3, 4, 6])
def test_a_trial_above_a_good_level_ends_soon_when_pieces_are_large(n):
    """The fetcher reads 1 MB pieces once it is ahead of its reader; at 1 MB/s per connection (a crowded host)
    a trial judged on such pieces lasted seconds.  While a level above a measured one is on trial it reads small
    pieces (``Controller.trying_more``), so the trial ends as soon as it is sure to be slower."""
    seconds, controller, simulated, best, best_seconds = learned_against_fixed(
        crowded(n), levels=sorted({1, 2, 4, 8, n}), shards=8, shard_size=22_000_000, piece=BIG_CHUNK
    )
    assert best == n
    assert seconds <= 1.3 * best_seconds, (seconds, best_seconds, controller.report())
    assert abs(controller.level - n) <= 1, controller.report()


def test_a_host_whose_ceiling_changes_mid_read_is_followed():
    """Suffering past 4 connections, then past 8 from 40 s on: the level follows, within 1.3x of what knowing
    both would take."""

    def host(open_, t):
        n = 4 if t < 40 else 8
        return 3 * MB if open_ <= n else 3 * MB * n * 0.5 / open_

    simulated = SimulatedReader(host, shards=12)
    controller = Controller(16)
    seconds = simulated.run(controller)
    # ideal: 4 connections (12 MB/s) for 40 s, then 8 (24 MB/s) for the rest
    ideal = 40 + (12 * (64 << 20) - 40 * 12 * MB) / (24 * MB)
    assert seconds <= 1.3 * ideal, (seconds, ideal, controller.report())
    assert abs(held(simulated.levels[: int(35 / simulated.step)]) - 4) <= 1
    assert abs(held(simulated.levels[-int(10 / simulated.step) :]) - 8) <= 1, controller.report()


# end to end: real servers; the assertions are on levels and request counts


@pytest.fixture(autouse=False)
def fresh_hosts():
    concurrency.forget()
    yield
    concurrency.forget()


def test_over_a_slow_link_the_level_grows(fresh_hosts):
    with EmulatedLink(latency=0.02, rate=2e6) as link:  # slow enough that pacing, not the CPU, sets the rate
        link.put("/b/big.tar", shard_bytes("x-", samples=40, size=100_000))
        ds = wds.WebDataset(f"{link.url}/b/big.tar", shardshuffle=False)
        assert len(list(ds)) == 40
        ((host, figures),) = ds.stats.hosts.items()
        assert figures["level"] > 1 and len(figures["rates"]) >= 2, str(figures)
        assert figures["waiting"] > 0 and figures["latency"] >= 0.02
        assert any(r[2] is not None for r in link.store.requests)  # parts: ranged GETs
        assert ds.stats.requests > 1


def test_a_store_where_every_range_costs_the_object_is_read_with_one_request_per_shard(fresh_hosts):
    server, store = http_server(range_cost=0.05)
    try:
        for i in range(4):
            store.put(f"/b/s-{i}.tar", shard_bytes(f"{i}-", samples=30, size=100_000))
        ds = wds.WebDataset(f"{server.url}/b/s-{{0..3}}.tar", shardshuffle=False)
        assert len(list(ds)) == 120
        gets = [r for r in store.requests if r[0] == "GET"]
        assert len(gets) == 4 and all(r[2] == "bytes=0-" for r in gets)  # one whole-object GET per shard
        (figures,) = ds.stats.hosts.values()
        assert figures["level"] == 1
    finally:
        server.stop()


def test_a_level_learned_too_high_comes_down_on_a_store_where_ranges_cost(fresh_hosts):
    """A level of 4 learned in another process (handed on by ``seed``), on a store where every request reads the
    whole object (each connection more slows them all): the reader compares it with fewer connections and comes
    down.  On the simulated clock: read over a real server, the verdict hung on how fast one connection was
    measured against four on a loaded machine (it stayed at 4 under load)."""
    host = "http://ranges-cost.example"
    concurrency.seed({host: {"level": 4}})
    controller = concurrency.controller_for(host, 16)
    assert controller.level == 4
    simulated = SimulatedReader(
        lambda open_, t: 40 * MB / open_ / open_, shards=12, shard_size=1_000_000, part_size=256 << 10, latency=0.02
    )
    simulated.run(controller)
    figures = controller.report()
    assert figures["level"] < 4, figures
    assert min(figures["rates"]) < 4
    assert simulated.levels[-1] < 4 and simulated.levels.count(4) < len(simulated.levels) // 4


def test_parts_reuse_kept_connections(fresh_hosts):
    server, store = http_server()
    try:
        for i in range(3):
            store.put(f"/b/s-{i}.tar", shard_bytes(f"{i}-", samples=40, size=50_000))
        ds = wds.WebDataset(f"{server.url}/b/s-{{0..2}}.tar", shardshuffle=False, part_size="256KiB", concurrency=4)
        assert len(list(ds)) == 120
        gets = [r for r in store.requests if r[0] == "GET"]
        assert len(gets) > 12
        assert store.connections <= 4 + 2  # as many as parts in flight (and the next shard's), not one per GET
    finally:
        server.stop()


def test_dataloader_workers_share_the_host_and_start_from_what_was_learned(fresh_hosts):
    torch = pytest.importorskip("torch")
    server, store = http_server()
    try:
        for i in range(4):
            store.put(f"/b/s-{i}.tar", shard_bytes(f"{i}-", samples=10, size=20_000))
        concurrency.seed({server.url: {"level": 3}})

        def seen(sample):
            sample["report"] = concurrency.report()[server.url]
            return sample

        ds = wds.WebDataset(f"{server.url}/b/s-{{0..3}}.tar", shardshuffle=False).map(seen)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        reports = [s["report"] for s in loader]
        assert len(reports) == 40
        assert {r["cap"] for r in reports} == {8}  # 16 shared by 2 workers
        assert reports[0]["level"] == 3 or min(reports[0]["rates"], default=3) <= 3  # started from the parent's
        # set by the user, the ceiling is each worker's own
        ds = wds.WebDataset(f"{server.url}/b/s-{{0..3}}.tar", shardshuffle=False, max_concurrency=12).map(seen)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        assert {s["report"]["cap"] for s in loader} == {12}
    finally:
        server.stop()


class _Counting:
    """A real HTTP server that counts the GETs it is answering at once (``peak``).  The answer to ``held``
    sends its headers and first samples, then holds the rest until a second GET arrives (or ``HOLD`` s
    pass): a request sent beyond the level while ``held`` is read is seen, however fast the reader is."""

    HOLD = 1.0

    def __init__(self, held: str) -> None:
        self.held = held
        self.open = self.peak = 0
        self.arrivals: list = []  # (path, GETs it was answering when this one came), in order
        self.lock = threading.Lock()
        self.second = threading.Event()
        counting = self

        class Handler(HTTPObjectHandler):
            store = Store()

            def do_GET(self) -> None:
                with counting.lock:
                    counting.arrivals.append((self._key(), counting.open))
                    counting.open += 1
                    counting.peak = max(counting.peak, counting.open)
                    if counting.open > 1:
                        counting.second.set()
                if self._key() == counting.held:
                    self.wfile = _HoldBody(self.wfile, counting.second, counting.HOLD)
                try:
                    super().do_GET()
                finally:
                    with counting.lock:
                        counting.open -= 1

        self.store = Handler.store
        self.server = Server(Handler)
        self.url = self.server.url


class _HoldBody:
    """A response file that, once ``after`` bytes went out (past the first samples: the next shard may be asked
    for), waits for
    ``event`` (or ``hold`` s) before it writes more."""

    def __init__(self, wfile, event: threading.Event, hold: float, after: int = FIRST_SAMPLE_BYTES + 200_000) -> None:
        self._wfile, self._event, self._hold, self._after, self._sent = wfile, event, hold, after, 0

    def write(self, data) -> int:
        if self._sent < self._after <= self._sent + len(data):
            self._event.wait(self._hold)  # an upper bound only: the test's verdict never depends on it
        self._sent += len(data)
        return self._wfile.write(data)

    def __getattr__(self, name):
        return getattr(self._wfile, name)


@pytest.fixture
def counting(fresh_hosts):
    server = _Counting("/d/a.tar")
    for name in ("a", "b", "c"):
        server.store.put(f"/d/{name}.tar", shard_bytes(name, samples=80))
    yield server
    server.server.stop()


def test_the_next_shards_first_request_waits_for_a_place_in_the_measured_level(counting):
    """With the ceiling at one connection (``max_concurrency=1``) the first request of the shard expected next is
    not sent while the current shard is read: the host never carries more connections than the ceiling (issue 41,
    item 8; below the ceiling it may go out near the end of the current shard, see the next test)."""
    fetcher = Fetcher(max_concurrency=1, prefetch=1)
    urls = [f"{counting.url}/d/{name}.tar" for name in ("a", "b", "c")]
    for i, url in enumerate(urls):
        with fetcher.open(url) as stream:
            fetcher.prefetch(urls[i + 1 :])
            assert stream.read() == counting.store.objects[url.split(counting.url, 1)[1]]
    assert counting.peak == 1


def test_at_one_connection_the_next_shard_is_asked_for_before_the_current_one_ends(counting):
    """At one connection, below the ceiling, the next shard's first request goes out while the current shard's
    request is still being answered, once what is left of it arrives within a first-byte latency at the rate it
    comes (the latency is told here as 1000 s: as soon as its first sample's bytes are in): the reader does not
    stop for the host's latency at every shard.  The server sees the next shard's GET while it holds the
    current one's body; the bytes of both are exact."""
    fetcher = Fetcher(max_concurrency=2, prefetch=1)
    urls = [f"{counting.url}/d/{name}.tar" for name in ("a", "b")]
    fetcher.controller(counting.url, fetcher.options(urls[0])).first_byte(1000.0)
    for i, url in enumerate(urls):
        with fetcher.open(url) as stream:
            fetcher.prefetch(urls[i + 1 :])
            got = bytearray()
            while True:  # in pieces, as a tar reader reads: each one is a moment to send the next request
                piece = stream.read(50_000)
                if not piece:
                    break
                got += piece
            assert bytes(got) == counting.store.objects[url.split(counting.url, 1)[1]]
    assert counting.arrivals == [("/d/a.tar", 0), ("/d/b.tar", 1)]
    assert counting.peak == 2


def test_the_next_shard_is_due_when_the_rest_of_the_current_one_arrives_within_a_first_byte():
    """The rule of the request sent ahead, on plain values: what is left, at the rate the request brought its bytes
    so far, against the first-byte latency; never before the first bytes, nor for a size not known."""
    flowing = types.SimpleNamespace(began=10.0, filled=100 << 20, done=False)  # 100 MiB in 1 s
    assert ahead_due(flowing, 10 << 20, 11.0, 0.1)  # 10 MiB left: 0.1 s
    assert not ahead_due(flowing, 11 << 20, 11.0, 0.1)
    assert ahead_due(flowing, 0, 11.0, 0.0)
    assert not ahead_due(flowing, None, 11.0, 1.0)
    assert not ahead_due(types.SimpleNamespace(began=None, filled=0, done=False), 1, 11.0, 1.0)
    assert not ahead_due(types.SimpleNamespace(began=10.0, filled=0, done=False), 1, 11.0, 1.0)


def test_a_part_counts_in_the_connection_rate_once_its_first_piece_is_in():
    """The connection rate the controller is told: a part that has brought only a shard's first header since its
    answer came says nothing of the link (it said 0.3 MB/s of one carrying 500 MB/s, and more connections then
    seemed to pay on a store where each costs a whole object); parts blocked, done or not begun do not count."""

    def part(filled, began, done=False, blocked=False):
        return types.SimpleNamespace(filled=filled, began=began, done=done, blocked=blocked)

    assert connection_rate([part(512, 9.998)], 10.0) is None
    assert connection_rate([part(512, 9.998), part(64 << 20, 9.9)], 10.0) == pytest.approx((64 << 20) / 0.1)
    assert connection_rate([part(FIRST_PIECE, 9.0), part(FIRST_PIECE, 9.5)], 10.0) == pytest.approx(
        2 * FIRST_PIECE / 1.5
    )
    gone = [part(8 << 20, 9.0, done=True), part(8 << 20, 9.0, blocked=True), part(8 << 20, None)]
    assert connection_rate(gone, 10.0) is None


def test_readers_of_one_host_share_the_level(counting):
    """Two readers (two datasets) of one host in one process share its level: while one reads at the
    level, the other's next shard waits for a place (issue 41, item 8)."""
    first, second = Fetcher(max_concurrency=1, prefetch=1), Fetcher(max_concurrency=1, prefetch=1)
    a, b = f"{counting.url}/d/a.tar", f"{counting.url}/d/b.tar"
    with first.open(a) as stream:
        second.prefetch([b])
        assert stream.read() == counting.store.objects["/d/a.tar"]
    with second.open(b) as stream:
        assert stream.read() == counting.store.objects["/d/b.tar"]
    assert counting.peak == 1


def test_two_readers_taking_turns_in_one_thread_never_wait_for_each_other(counting):
    """A part a reader is blocked on goes out even when the level is full with another reader's parts: two
    datasets of one host read alternately in one thread (as a mix of sources does) both finish."""
    first, second = Fetcher(max_concurrency=1), Fetcher(max_concurrency=1)
    a, b = counting.store.objects["/d/b.tar"], counting.store.objects["/d/c.tar"]
    with first.open(f"{counting.url}/d/b.tar") as one, second.open(f"{counting.url}/d/c.tar") as two:
        got_a, got_b = bytearray(), bytearray()
        while len(got_a) < len(a) or len(got_b) < len(b):
            got_a += one.read(50_000)
            got_b += two.read(50_000)
    assert bytes(got_a) == a and bytes(got_b) == b


def test_a_lower_ceiling_bounds_its_readers_parts_and_a_workers_share_lowers_the_level():
    """Readers of one host in one process share its level: one given ``max_concurrency=2`` after another given
    16 set the ceiling of both (the adversary's F1: the last to open a shard set it, and a dataset capped at 2 then
    held 8 connections).  The level stays for the reader that allows it; the capped reader's parts go out only
    while fewer than its ceiling are in flight.  What a forked worker inherited takes the worker's share."""
    concurrency.forget()
    try:
        controller = concurrency.controller_for("h", 16)
        controller.level = 8
        assert concurrency.controller_for("h", 2) is controller and controller.level == 8 and controller.cap == 16
        assert controller.take(0.0, cap=2) is not None and controller.take(0.0, cap=2) is not None
        assert controller.take(0.0, cap=2) is None and controller.take(0.0) is not None
        woken = []
        controller.notify(lambda: woken.append(1), cap=2)  # no room below 2: not woken
        controller.give(0.0)
        assert woken == []
        controller.forked()  # a worker: what the parent learned stays, its ceiling is the worker's share
        assert concurrency.controller_for("h", 2) is controller and controller.level == 2 and controller.cap == 2
    finally:
        concurrency.forget()


def test_a_datasets_max_concurrency_holds_beside_another_datasets_on_the_same_host(tmp_path):
    """Through a real server: a dataset with ``max_concurrency=2`` reads after another dataset of the same host
    with the default; its report says its own ceiling, and never a level above it."""
    import wds_cloud as wds
    from wds_cloud.testing.link import EmulatedLink

    with wds.ShardWriter(str(tmp_path / "s-%04d.tar"), maxcount=8) as sink:
        for i in range(32):
            sink.write({"__key__": f"k{i:04d}", "bin": bytes(200_000)})
    concurrency.forget()
    try:
        with EmulatedLink(str(tmp_path), latency=0.01, rate=20e6) as link:
            urls = f"{link.url}/s-{{0000..0003}}.tar"
            capped = wds.WebDataset(urls, shardshuffle=False, max_concurrency=2, part_size="256KB")
            other = wds.WebDataset(urls, shardshuffle=False, part_size="256KB")
            assert sum(1 for _ in other) == 32
            assert sum(1 for _ in capped) == 32
            (report,) = capped.stats.hosts.values()
            assert report["cap"] == 2 and report["level"] <= 2, report
    finally:
        concurrency.forget()


def test_a_host_that_becomes_crowded_mid_read_is_measured_again_at_once():
    """The connection-controller adversary's finding (issue 41): 10 MB/s per connection, until from 1.5 s on more
    than 2 connections are each held to 0.3 MB/s (from 0.5 s here).  The level had climbed to 8-16 and stayed there until the
    10 s re-probe, then came down a halving at a time past levels that looked worse still: the read took 2-3x as
    long as 2 connections pinned.  A rate that falls to a third of what the held level brought, while the reader
    waits, starts the search again from one connection."""

    def host(open_, t):
        return 10 * MB if t < 0.5 or open_ <= 2 else 0.3 * MB

    seconds, controller, simulated, best, best_seconds = learned_against_fixed(
        host, levels=(1, 2, 4, 8, 16), shards=8, shard_size=64 << 20, piece=CHUNK
    )
    assert best == 2
    assert seconds <= 1.6 * best_seconds, (seconds, best_seconds, controller.report())


def test_a_pinned_level_above_the_ceiling_is_refused_naming_both():
    """The adversary's finding: concurrency=8 with max_concurrency=2 ran at 8 without a word."""
    with pytest.raises(wds.ConfigError, match=r"concurrency=8 \(.*\) is above max_concurrency=2 \(.*\)"):
        wds.WebDataset("a.tar", concurrency=8, max_concurrency=2)
    wds.WebDataset("a.tar", concurrency=2, max_concurrency=2)


def test_a_read_that_times_out_says_so_and_what_to_change():
    """The adversary's finding: a read past the socket timeout was reported as "[Errno 11] Resource temporarily
    unavailable; check that the server is running"."""
    import errno

    from wds_cloud.io.httpstream import connection_error

    error = connection_error(
        "http://127.0.0.1:9/s.tar", BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"), "read from"
    )
    assert "timed out" in str(error) and "WDS_RETRY_TIMEOUT" in str(error) and "Errno" not in str(error)


def test_the_requests_a_process_has_open_stay_within_max_concurrency(fresh_hosts, monkeypatch):
    """The controller adversary counted 3 responses in flight at a server with max_concurrency=2 while the level
    rose from one connection: the request the rise cut short had been closed by the client and the server had not
    seen it yet.  What the process holds open (every place taken in the level, forced or not) never passes the
    ceiling while one dataset reads: counted here at the controller, over a paced link through the rise (the next
    shard's first request may go out one beyond the level near the end of the current shard, never beyond the
    ceiling)."""
    peak = {"now": 0, "max": 0, "forced": 0}
    take, give = Controller.take, Controller.give

    def counted_take(self, now, force=False, cap=None):
        ticket = take(self, now, force, cap)
        if ticket is not None:
            peak["now"] += 1
            peak["max"] = max(peak["max"], peak["now"])
            peak["forced"] += bool(force and self.in_flight > self.cap)
        return ticket

    def counted_give(self, now):
        peak["now"] -= 1
        give(self, now)

    monkeypatch.setattr(Controller, "take", counted_take)
    monkeypatch.setattr(Controller, "give", counted_give)
    with EmulatedLink(latency=0.02, rate=2e6) as link:
        for i in range(3):
            link.put(f"/b/s{i}.tar", shard_bytes(f"s{i}-", samples=20, size=100_000))
        urls = [f"{link.url}/b/s{i}.tar" for i in range(3)]
        n = sum(1 for _ in wds.WebDataset(urls, shardshuffle=False, max_concurrency=2))
    assert n == 60 and peak["max"] <= 2 and not peak["forced"], peak


def noisy_wan(seed, per_connection=50 * MB, knee=5.7, noise=0.5, span=0.05):
    """A distant link as the benchmark machine measures it: 30 ms first bytes (the reader's), each connection ~50 MB/s
    but sharing a ceiling (``per_connection / (1 + open / knee)``: 16 connections bring ~1.3x what 8 do), and every
    ``span`` seconds the rate times a seeded random factor in ``1 +- noise`` (a shared CPU; shard ends dip by
    themselves, as parts end)."""
    rng = random.Random(seed)
    factors = [1 + noise * (2 * rng.random() - 1) for _ in range(4000)]
    return lambda open_, t: per_connection / (1 + open_ / knee) * factors[int(t / span) % len(factors)]


def test_over_a_noisy_distant_link_the_climb_to_16_is_kept():
    """One window's rate swings +-50% here: a verdict on one window against one was a coin toss (0.48x-0.91x of 16
    over these seeds, median 0.56x, ending at 3-16).  With verdicts on several windows and a modest gain kept while
    the reader waits, 8 of 10 seeds end at 16 within 1/0.8 of it (median 0.87x; the 1/0.9 goal is not met on every
    seed: the climb from one connection costs 10-15% of this 1-second pass, and a lucky window can still stop it)."""
    near, ratios = 0, []
    for seed in range(10):
        seconds, controller, simulated, best, best_seconds = learned_against_fixed(
            noisy_wan(seed), levels=(8, 16), shards=8, shard_size=22_000_000, piece=CHUNK, step=0.002
        )
        ratios.append(round(best_seconds / seconds, 2))
        near += best == 16 and controller.level >= 12 and seconds <= best_seconds / 0.8
    assert near >= 8, ratios


def feed(controller, rate, waiting, seconds, now, in_flight=None, step=0.002, decisions=None):
    """Drive ``controller`` for ``seconds`` of simulated time from ``now`` (or until ``decisions`` were made):
    ``rate`` bytes/s arriving in pieces every ``step``, the reader blocked ``waiting`` of the time, ``in_flight``
    parts (the level when None), deciding when a window is due.  Returns the clock and the levels decided on."""
    levels = []
    end = now + seconds
    while now < end and (decisions is None or len(levels) < decisions):
        controller.flight(controller.level if in_flight is None else in_flight, now)
        now += step
        controller.received(int(rate * step), now)
        controller.waited(step * waiting)
        if controller.due(now):
            controller.decide(now)
            levels.append(controller.level)
    return now, levels


def held_at(level, rate=200 * MB):
    """A controller that holds ``level`` (its ceiling, until :meth:`Controller.limit` raises it), measured at ``rate``
    with the reader waiting, the level below slower."""
    controller = Controller(level, start=level)
    controller.first_byte(0.03)
    controller.rates[level // 2] = rate / 2
    now, _ = feed(controller, rate, 1.0, 0.5, 0.0)
    assert controller.level == level and controller.trying_more is False, controller.report()
    return controller, now


def test_one_window_that_falls_does_not_restart_the_search_two_do():
    """Over a distant link one window of a level held fell to a third at a shard's end, and the search started
    again from one connection (0.3 s of a 1 s pass at fewer).  A fall counts when the next window falls too; while
    it waits to be confirmed small pieces are read (the next window ends soon)."""
    controller, now = held_at(8)
    now, levels = feed(controller, 200 * MB, 1.0, 0.3, now, decisions=1)
    now, levels = feed(controller, 20 * MB, 1.0, 1.0, now, decisions=1)  # one window falls (a shard's end)
    assert levels == [8] and controller.trying_more and "in one window" in controller.reason, controller.report()
    now, levels = feed(controller, 200 * MB, 1.0, 0.3, now)  # the next does not: nothing changed
    assert set(levels) == {8} and not controller.trying_more
    now, levels = feed(controller, 200 * MB, 1.0, 1.0, now, decisions=1)
    now, levels = feed(controller, 20 * MB, 1.0, 1.0, now, decisions=2)  # two in a row: the host changed
    assert "measuring again from one connection" in controller.reason


def test_a_fall_the_reader_lives_through_on_bytes_fetched_ahead_is_found():
    """The crowded-mid-read host: the level held fell to a twentieth while the reader lived for a second on what
    16 connections had fetched ahead (not waiting): those windows lowered the rate the fall was judged against,
    and the fall was not seen for seconds.  A fall is judged against what the level brought while the reader
    waited, and confirmed by the next window whether the reader waits in it or not."""
    controller, now = held_at(16, 80 * MB)
    now, levels = feed(controller, 80 * MB, 1.0, 1.0, now, decisions=1)
    now, levels = feed(controller, 4 * MB, 0.0, 1.0, now)  # the reader lives on bytes fetched ahead
    assert set(levels) == {16}
    now, levels = feed(controller, 4 * MB, 1.0, 0.5, now)  # now it waits: a fall, then its confirmation
    assert 1 in levels[:3], (levels, controller.report())


def test_a_window_of_a_level_held_ends_once_it_is_sure_the_level_fell():
    """16 connections at 0.3 MB/s each took seconds to bring a window's pieces (64 of them): the window ends once
    a third of what the level brought would have brought them."""
    controller, now = held_at(16, 80 * MB)
    now, levels = feed(controller, 2 * MB, 1.0, 1.0, now, step=0.02)  # a 40 KB piece every 20 ms
    assert levels and levels[0] == 16 and 1 in levels, (levels, controller.report())


def test_a_trial_after_which_the_reader_no_longer_waits_is_kept():
    """On a shared CPU, 16 connections over a distant link brought fewer bytes per second than 8 in some windows
    (the reader's own pace, their threads taking its CPU), while the reader no longer waited: the trial did what it
    was for, and going back to 8 left the reader waiting again."""
    controller, now = held_at(8)
    controller.limit(16)
    now, levels = feed(controller, 200 * MB, 1.0, 1.0, now, decisions=1)
    assert controller.level == 16 and controller.trying_more, controller.report()
    now, levels = feed(controller, 170 * MB, 0.0, 0.5, now)
    assert controller.level == 16 and not controller.trying_more, (levels, controller.report())
    assert "not waiting" in controller.reason


def test_a_trial_whose_connections_are_never_all_used_is_judged_after_confirm_windows():
    """Shards too small to keep 16 connections busy (10 had parts to fetch): the trial was measured again window
    after window, reading small pieces, for the rest of the pass.  It is judged after CONFIRM windows."""
    controller, now = held_at(8)
    controller.limit(16)
    now, levels = feed(controller, 200 * MB, 1.0, 1.0, now, decisions=1)
    assert controller.level == 16
    now, levels = feed(controller, 260 * MB, 1.0, 1.0, now, in_flight=10)
    assert len(levels) > concurrency.CONFIRM + 1 and not controller.trying_more, (levels, controller.report())


def test_what_is_known_to_be_left_counts_the_shards_named_next_at_the_size_of_the_others():
    """Counted alone, the rest of a 22 MB shard never paid for more connections at 200 MB/s, though the reader had
    named the shards after it: they count, at the mean size of the shards whose size is known."""
    from wds_cloud.io.parallel import known_left

    def shard(size, received, state):
        return types.SimpleNamespace(size=size, state=state, left=None if size is None else size - received)

    assert known_left([]) == 0
    assert known_left([shard(None, 0, "prefetched")]) == 0  # no size known: nothing
    assert known_left([shard(22, 10, "active")]) == 12
    assert known_left([shard(22, 10, "active"), shard(None, 0, "prefetched")]) == 12 + 22
    assert known_left([shard(20, 5, "active"), shard(30, 0, "prefetched"), shard(None, 0, "prefetched")]) == 45 + 25


def test_while_the_level_stays_its_windows_leave_no_gap():
    """A window that began at the first bytes after a pause left out the gaps at shard ends (every connection waiting
    for a first byte), and rated a level by its bursts: 8 connections looked as fast as 16 over a distant link, and
    16 was refused.  While the level stays, the next window starts where the last ended."""
    controller, now = held_at(8)
    for _ in range(12):  # 80 ms of bytes, then 40 ms with none (the next shard's first bytes)
        now, _ = feed(controller, 200 * MB, 1.0, 0.08, now)
        now += 0.04
    # 200 MB/s for 80 ms of every 120: 133 MB/s, not the 200 of the bursts
    assert 120 * MB < controller.rates[8] < 150 * MB, controller.report()


def test_the_request_a_climb_from_one_cut_short_does_not_hold_the_first_window_back():
    """The last bytes of the request a climb from one connection cut short restarted the trial's window a first
    byte after them (60 ms later over a distant link, in a pass of 0.9 s): they count in no window, and the window
    goes on."""
    controller = Controller(16)
    controller.first_byte(0.03)
    now, levels = feed(controller, 45 * MB, 1.0, 1.0, 0.0, decisions=1)
    assert levels == [4], controller.report()
    decided = []
    for _ in range(100):  # 10 ms: the cut request still streams beside the new parts
        now += 0.001
        controller.received(45_000, now, Controller.CUT)
        controller.received(180_000, now, controller.ticket())
        controller.waited(0.001)
        if controller.due(now):
            decided.append(now)
            controller.decide(now)
    assert decided, controller.report()


def test_a_trial_that_looks_no_worse_reads_pieces_of_the_usual_size():
    """Small pieces cost CPU: on a shared machine a trial at 16 read in 64 KiB pieces brought less than 8 did, and was
    refused.  A trial reads small pieces in its first window (its connections start) and while it looks much
    slower, not once it looked no worse than the level below."""
    controller, now = held_at(8)
    controller.limit(16)
    now, levels = feed(controller, 200 * MB, 1.0, 1.0, now, decisions=1)
    assert controller.level == 16 and controller.trying_more  # its first window
    now, levels = feed(controller, 190 * MB, 1.0, 1.0, now, decisions=1)
    assert controller.level == 16 and not controller.trying_more, controller.report()
    now, levels = feed(controller, 60 * MB, 1.0, 0.1, now, decisions=1)  # now it looks much slower
    assert controller.level == 8 or controller.trying_more, controller.report()


def test_a_trials_short_first_window_is_no_verdict():
    """The first window of a trial at 16, 35 ms long while its connections started, brought half of what 8 did; it
    went back to 8 at once and the pass ended there.  On its first window a trial is sure to be slower only once
    the window lasted STARTS first-byte latencies."""
    controller, now = held_at(8)
    controller.limit(16)
    now, levels = feed(controller, 200 * MB, 1.0, 1.0, now, decisions=1)
    assert controller.level == 16
    now, levels = feed(controller, 90 * MB, 1.0, 1.0, now, decisions=1)  # a short first window at half the rate
    assert controller.level == 16 and "measuring again" in controller.reason, controller.report()
    now, levels = feed(controller, 90 * MB, 1.0, 1.0, now, decisions=1)  # and the second: now it is sure
    assert controller.level == 8, controller.report()


def test_a_hosts_first_window_is_short():
    """Every window at one connection costs the connections not yet tried: a host's first window (one stream) lasts
    FIRST_WINDOW or a first-byte latency, not MIN_WINDOW."""
    controller = Controller(16)
    controller.first_byte(0.01)
    now, levels = feed(controller, 45 * MB, 1.0, 1.0, 0.0, decisions=1)
    assert levels == [4] and now < concurrency.MIN_WINDOW, (now, controller.report())


def test_more_connections_pay_when_they_win_back_more_than_a_first_byte():
    """What is left had to take two first bytes longer on the current level than on the next: over a distant link
    (30 ms) 8 connections at 160 MB/s with 20 MB known to be left (the rest of a shard and the one named next) did
    not try 16, and a third of the pass was read at 8.  One first byte is what each new connection pays."""
    # at one connection (50 MB/s), 3 MB left takes 60 ms; on four, 15 ms: 45 ms won, more than one first byte
    store = SimulatedStore(paced(50 * MB, 800 * MB), latency=0.03, remaining=3 << 20)
    store.run(Controller(16), 0.5)
    assert max(store.levels) > 1
    # 1.5 MB left: 22 ms won, less than a first byte: it stays at one
    store = SimulatedStore(paced(50 * MB, 800 * MB), latency=0.03, remaining=3 << 19)
    controller = store.run(Controller(16), 0.5)
    assert set(store.levels) == {1} and "would not pay" in controller.reason


def test_the_reasons_read_as_sentences():
    """``ds.stats.hosts[...]["why"]`` said "1 connections" and "1 windows"; a reader that waited 24.9% of a window
    was "not waiting (25% of the time)" though a quarter counts as waiting; and "more connections would not pay"
    did not say that a larger ``part_size`` was the fix where parts were too short for the store's first byte."""
    controller = Controller(16)
    controller.first_byte(0.03)
    now, levels = feed(controller, 45 * MB, 1.0, 1.0, 0.0, decisions=1)
    assert "at 1 connection (" in controller.reason and "1 connections" not in controller.reason
    now, levels = feed(controller, 100 * MB, 1.0, 1.0, now, decisions=1)
    assert "1 windows" not in controller.reason, controller.reason
    held, now = held_at(4)
    now, _ = feed(held, 200 * MB, 0.249, 0.5, now)
    assert "(24% of the time)" in held.reason, held.reason
    # a 64 KiB part at 50 MB/s flows for 1.3 ms against a first byte of 30 ms
    store = SimulatedStore(paced(50 * MB, 800 * MB), latency=0.03, part_size=64 << 10)
    controller = store.run(Controller(16), 0.5)
    assert "would not pay" in controller.reason and "part_size" in controller.reason, controller.reason


def test_the_process_report_redacts_credentials_of_a_host():
    """``wds_cloud.io.concurrency.report()`` was keyed by the host as given, a URL's password and all (the
    adversary's F2); ``ds.stats.hosts`` was redacted."""
    concurrency.forget()
    try:
        concurrency.controller_for("http://alice:S3CRETPASS@127.0.0.1:9", 16)
        assert "S3CRETPASS" not in repr(concurrency.report())
    finally:
        concurrency.forget()


def test_a_host_crowded_after_the_climb_by_less_than_a_fall_is_searched_again_at_the_reprobe():
    """The adversary's F5: the level climbed to 16 at 0.75 MB/s a connection; then the host let 4 connections
    send at 2.5 MB/s and slowed every one to 0.3 MB/s past 4.  16 fell from 12 to 5 MB/s (less than to a third:
    no fall), and the re-probe's one step down (8, crowded too) looked slower, so 16 stayed for the rest of the
    read at half of what 4 would bring.  At the re-probe, a level that brings under half of what it did when it
    came to be held, the reader waiting, is searched for again from one connection."""

    def rate(level, t):
        if t < 4:
            return level * 0.75 * MB
        return level * 2.5 * MB if level <= 4 else level * 0.3 * MB

    store = SimulatedStore(rate)
    controller = store.run(Controller(16), 25.0)
    assert held(store.levels[2 * len(store.levels) // 3 :]) <= 5, controller.report()


@pytest.mark.xfail(
    strict=True,
    reason="open fault (adversary F4, present before this session): a reader blocked on a shard's first byte is not "
    "counted as waiting, so over many small shards behind a slow first byte the level stays at one connection and "
    "`why` says the reader is not waiting (40 shards at a 0.2 s first byte, prefetch=4: 8.1 s where 4 connections "
    "pinned take 2.2). A fix (counting the wait, climbing only while more shards are named than the level asks "
    "for, naming the next shards as one opens) broke the claim queue's shard order and was taken back",
)
def test_a_reader_blocked_on_a_shards_first_byte_counts_as_waiting(fresh_hosts):
    """Many small shards behind a slow first byte, prefetch=4: the reader spends its time opening shards, which
    should count as waiting for the host's bytes, and the level rise above one connection."""
    from wds_cloud.testing.faults import FaultProxy

    server, store = http_server()
    try:
        for i in range(24):
            store.put(f"/b/s-{i:02d}.tar", shard_bytes(f"{i}-", samples=2, size=1000))
        with FaultProxy(server.url, latency=0.05) as proxy:
            ds = wds.WebDataset(f"http://127.0.0.1:{proxy.port}/b/s-{{00..23}}.tar", shardshuffle=False, prefetch=4)
            assert len(list(ds)) == 48
            (figures,) = ds.stats.hosts.values()
        assert figures["level"] > 1 or max(figures["rates"]) > 1, figures
        assert figures["waiting"] >= concurrency.WAIT_SHARE and "not waiting" not in figures["why"], figures
    finally:
        server.stop()
