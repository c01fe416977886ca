"""How many connections a host gets: a measured decision, per host, that goes up and down.

Parallel ranged reads help where one connection carries less than the reader can take (a distant
store, a paced link) and hurt where a ranged request costs more than its share (a store that reads
the whole object for every range, a busy self-hosted server).  A :class:`Controller` decides, for one
host, how many parts may be in flight (the *level*) from what it measures, in windows of a few
first-byte latencies:

- it starts at one connection (or at what this process already learned about the host; a level learned
  in another process is first compared with one connection); a host's first window (one stream) is shorter
  (:data:`FIRST_WINDOW`), and while the level stays each window starts where the last ended (windows that
  each began at the first bytes after a pause left out the gaps at shard ends and rated a level by its bursts);
- it adds connections only while the reader waits for bytes (a share of the window spent blocked of at
  least :data:`WAIT_SHARE`) and more connections can pay: a part flows for longer than its request waits
  for the first byte, and the bytes known to be left (of the shards being read, and of those the reader named
  as coming next, counted at the size of the others) take longer than one first byte (on a store where
  a range costs as much as the whole object, they never do);
- it climbs from one connection to 4 (2 when the reader waits less than half the time), then doubles while
  each step brought at least 0.4 of what it would in proportion, else climbs a step at a time (about a third
  more): a level is tried only once the one below it proved faster than the one below that;
- a level's rate is the bytes of its last :data:`SPAN` windows together (one window's rate swings 2-3x with
  shard ends and a shared CPU), and a trial is judged on its own windows, the first (its connections still
  starting) left out once there are more; it is kept at once when it brought :data:`GAIN` more bytes per second
  than the level below (or half of what it would bring in proportion, for a small step; :data:`MODEST` while
  the reader waits through it: a modest gain is worth keeping for a reader that waits) and not far from
  proportion, goes back at once when it is sure to be slower (below :data:`SLOWER` of the level below, on two
  of its windows, or on its first against two of the level below once it lasted :data:`STARTS` first-byte
  latencies: one window against one is a coin toss), and is otherwise measured on up to
  :data:`CONFIRM` windows before its verdict (also when too few of its connections had parts to fetch: shards
  too small to keep them busy may never use them all); a trial after whose first window the reader no longer
  waits is kept unless sure to be slower (the rate is then the reader's pace, not the connections'); a window
  at a trial level ends as soon as it is sure to be
  slower than the level below (on a host that suffers from connections, every second at it costs); a trial
  faster but far from proportion (below :data:`PROPORTION` of it) has the level halfway tried; the climb stops
  at the first level that did not pay, which is remembered (not tried again, nor the levels above it) until
  the next re-probe, and only when it was more than a step above is the step between tried;
- a level held whose rate falls below a third of what it brought while the reader waited (:data:`FELL`: the host
  became crowded or throttled), seen in a window where the reader waits and confirmed by the next (one window
  falls at a shard's end; the next may live on bytes fetched ahead), starts the search again from one
  connection (a window of a level held ends as soon as it is sure the level fell, and small pieces are read
  while a fall waits to be confirmed): on a host that slows every
  connection past N, the levels between the held one and N look worse than both, so stepping down would not
  find N;
- after :data:`REPROBE` seconds at one level it measures again: one step down (kept when the reader
  still does not wait, or gets no less), and up again while the reader waits; but where the level then brings
  under half of what it did when it came to be held, the reader waiting (a host crowded by less than a fall),
  the search starts again from one connection;
- ``concurrency=N`` pins the level: nothing is measured or changed.

What is learned about a host (the level, the rate per level, the latency) lives in this module for the
life of the process: the next shards and datasets start from it, and DataLoader workers forked later
inherit it (a spawned worker gets it with the dataset).  With N DataLoader workers (and
``LOCAL_WORLD_SIZE`` processes on the machine), each worker's ceiling is a share of the default
``max_concurrency``, so that the workers share the host instead of multiplying it; a
``max_concurrency`` the user sets is each process's own ceiling.

The level counts every part in flight to the host, from every reader of the process (:meth:`Controller.take`
and :meth:`Controller.give`): the next shard's first request waits for a place like any part.  Only a part
a reader is blocked on goes out at a full level (two readers taking turns in one thread must not wait for
each other), counted in it.

A level is judged on what arrived at it: every part carries the level it was sent at (:meth:`Controller.ticket`),
and while a part sent at a higher level still brings bytes, no window of a lower level is measured (its
connection is one more than the level; on a host that suffers from connections it slows the others too).
The bytes of the request a climb from one connection cut short (:data:`Controller.CUT`) count in no window.
A trial above a measured level is read in small pieces in its first window and while it looks much slower
(:attr:`Controller.trying_more`), so that its window can end as soon as it is sure to be slower; one that looks
no worse reads pieces of the usual size (small ones cost CPU, which on a shared machine made a good level look
slow).

Pure logic, with the clock passed in: the fetcher reports bytes, waits, first bytes and parts in flight.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any, Optional

from ..errors import redact

__all__ = [
    "Controller",
    "controller_for",
    "learned",
    "seed",
    "report",
    "forget",
    "worker_share",
    "DEFAULT_MAX_CONCURRENCY",
    "WAIT_SHARE",
    "GAIN",
    "REPROBE",
]

#: the ceiling when the user sets none, shared by a machine's DataLoader workers
DEFAULT_MAX_CONCURRENCY = 16
#: the share of a window the reader must spend waiting for bytes before more connections are tried
WAIT_SHARE = 0.25
#: how much faster a level must be than the one below it to be kept (a fraction of the lower rate)
GAIN = 0.20
#: seconds at one level before the levels around it are measured again (a link changes)
REPROBE = 10.0
#: the shortest measuring window (s); a window lasts at least one first-byte latency as well
MIN_WINDOW = 0.05
#: the shortest first window of a host (s): it measures one connection streaming a shard
FIRST_WINDOW = 0.02
#: a level counts as used when this share of its connections had parts in flight on average
USED = 0.7
#: a window holds at least this many pieces per connection (a few pieces are a burst, not a rate)
ARRIVALS = 4
#: a held level whose rate falls below 1/FELL of what it brought (the reader waiting) is searched again from one
FELL = 3.0
#: a level's rate is the bytes over its last SPAN windows together (one window's rate swings 2-3x with shard
#: ends and a shared CPU: a verdict on one is a coin toss)
SPAN = 4
#: windows a trial is measured on before a verdict that is not sure (neither much slower nor plainly faster)
CONFIRM = 3
#: a trial's first window is a verdict only once it lasted this many first-byte latencies (its connections were
#: starting in it: a window of one or two latencies is mostly their start)
STARTS = 4
#: a trial this much slower than the level below (a fraction of its rate) is sure to be slower: back at once
SLOWER = 0.67
#: a trial that brings less than this share of the rate in proportion to its connections (a fraction of
#: ``rate(below) * level / below``) is far from it: a level between the two may be as fast, and is tried
PROPORTION = 0.33
#: how much faster a doubling must be to be kept while the reader waits through it (more bytes for a reader that
#: waits are worth a modest gain; :data:`GAIN` holds where the reader did not wait)
MODEST = 0.05


class Controller:
    """The level (parts in flight) of one host, measured in windows (see the module docstring).

    Feed it with :meth:`first_byte`, :meth:`flight`, :meth:`received` and :meth:`waited`; call
    :meth:`decide` when :meth:`due` says a window is complete.  Thread-safe.
    """

    def __init__(self, cap: int, fixed: Optional[int] = None, start: int = 1) -> None:
        self.fixed = fixed is not None
        self.cap = max(1, cap)
        self.level = fixed if fixed is not None else max(1, min(start, self.cap))
        #: bytes per second of all connections together, as last measured at each level
        self.rates: dict[int, float] = {}
        #: (bytes, seconds) of the last :data:`SPAN` windows at each level, from which ``rates`` is taken
        self._spans: dict[int, list[tuple[int, float]]] = {}
        #: the rate of a level as of its last window in which the reader waited (what it brought while the reader
        #: waited: a fall is judged against it; windows in which the reader lives on bytes fetched ahead do not
        #: lower it)
        self._brought: dict[int, float] = {}
        self._tried = 0  # windows the trial now on was measured on
        #: seconds from a request to its first byte (smoothed)
        self.latency: Optional[float] = None
        #: the share of the last window the reader spent waiting for bytes
        self.waiting = 0.0
        #: why the level is what it is (shown in ``ds.stats``)
        self.reason = (
            f"pinned by concurrency={fixed}"
            if fixed is not None
            else "starting from one connection"
            if self.level == 1
            else f"starting from {_conns(self.level)}, as learned earlier in this process"
        )
        self.decisions = 0
        self._lock = threading.Lock()
        self._from: Optional[int] = None  # the level the current one is a trial from
        self._trial: Optional[str] = None  # "up" or "down" while the current level is on trial
        self._ceiling: Optional[int] = None  # the lowest level known to be no faster than one below it
        self._in_flight = 0
        self._waiters: list[Any] = []  # readers to wake when a place in the level is given back
        self._held_since: Optional[float] = None
        self._seconds = 0.0  # the length of the window being decided on
        #: what was learned came from another process (forked, or handed over): the ceiling is set anew by this
        #: process's first reader of the host
        self.inherited = False
        self._settled: Optional[float] = None  # the rate of the level held, as it came to be held
        self._fresh = False  # the window just closed was left out of the level's rate (a trial's first)
        self._fallen: Optional[tuple[int, float]] = None  # (bytes, seconds) of a window that fell, to be confirmed
        self._open_window(None, settle=0.0)

    # the window being measured
    def _open_window(self, now: Optional[float], settle: float) -> None:
        self._settle_until = (now + settle) if now is not None else None
        self._started: Optional[float] = None  # set by the first bytes after the settling time
        self._last = 0.0  # when the window's last bytes came
        self._bytes = 0
        self._arrivals = 0
        self._waited = 0.0
        self._busy = 0.0
        self._busy_at: Optional[float] = None

    def _window_length(self) -> float:
        # the first window of a host (one connection, streaming a shard) is shorter: every window there costs the
        # connections not yet tried, and a single stream's rate is steady
        return max(MIN_WINDOW if self.rates else FIRST_WINDOW, self.latency or 0.0)

    # what the fetcher reports (the clock is the caller's: time.perf_counter in use, any clock in tests)
    def first_byte(self, seconds: float) -> None:
        """A request's time to its first byte."""
        with self._lock:
            self.latency = seconds if self.latency is None else 0.7 * self.latency + 0.3 * seconds

    def flight(self, in_flight: int, now: float) -> None:
        """Parts in flight for this host are now ``in_flight``."""
        with self._lock:
            self._account(now)
            self._in_flight = in_flight

    def _account(self, now: float) -> None:
        if self._started is not None and self._busy_at is not None:
            self._busy += self._in_flight * max(0.0, now - self._busy_at)
        self._busy_at = now

    @property
    def trying_more(self) -> bool:
        """Whether the fetcher should read small pieces now: a level above a measured one is on trial and in its
        first window or looks much slower (its window may end early once it is sure to be slower, see :meth:`due`),
        or a fall seen in one window waits for the next to confirm it: either takes pieces (on a host that became
        crowded, a window of large pieces lasted seconds)."""
        if self._fallen is not None:
            return True
        if self._trial != "up":
            return False
        ref = self.rates.get(self._from or 0, 0.0)
        if not ref or self._tried == 0 or self.rates.get(self.level, 0.0) < SLOWER * ref:
            return True  # its first window (its connections starting), or it looked much slower so far
        # a trial that looked no worse reads pieces of the usual size (small ones cost CPU, which on a shared machine
        # made it slower than the level below), unless this window, once a window long, is much slower
        started = self._started
        return (
            started is not None
            and self._last - started >= self._window_length()
            and self._bytes < SLOWER * ref * (self._last - started)
        )

    #: the ticket of a request cut short when more connections were chosen (it streamed the rest of a shard on
    #: one): while a climb from one connection is on trial its last bytes are no level's (its connection is one
    #: more than the new level's parts), and counted in no window (the window goes on without them: restarted a
    #: first byte after them, the first trial window began 60 ms later on a distant link); in a climb from several
    #: they count (the trial is judged with it, as the host carries it)
    CUT = sys.maxsize

    def ticket(self) -> int:
        """What a part sent now carries, to be handed back with its bytes (:meth:`received`): the level it
        was sent at."""
        return self.level

    # the parts in flight: one count per host, shared by every reader of the process (a level is what the
    # host carries, not what each reader sends)
    @property
    def in_flight(self) -> int:
        """Parts in flight to this host now, from every reader that shares this controller."""
        return self._in_flight

    def _room(self, cap: Optional[int]) -> bool:
        """Whether a part of a reader whose own ceiling is ``cap`` may go out now (lock held)."""
        return self._in_flight < (self.level if cap is None else min(self.level, cap))

    def take(self, now: float, force: bool = False, cap: Optional[int] = None) -> Optional[int]:
        """A place in the level for a part sent now: its ticket (see :meth:`ticket`), or None when the level is
        full (then ``wake``, when given to :meth:`notify`, is called once a place is given back).  ``force``:
        a part a reader is blocked on goes out even at a full level (counted in it), so that two readers
        taking turns in one thread never wait for each other.  ``cap``: the reader's own ceiling (its
        ``max_concurrency``), where readers of one host were given different ones: its parts go out only while
        fewer than that are in flight to the host, whatever the level another reader's ceiling lets it reach."""
        with self._lock:
            if not force and not self._room(cap):
                return None
            self._account(now)
            self._in_flight += 1
            return self.level

    def give(self, now: float) -> None:
        """A part's request is over: its place in the level is free, and the readers waiting for one are told."""
        with self._lock:
            self._account(now)
            self._in_flight = max(0, self._in_flight - 1)
        self._wake()

    def notify(self, wake: Any, cap: Optional[int] = None) -> None:
        """Call ``wake()`` once a place in the level is free for a reader whose own ceiling is ``cap`` (at once if
        one is now); a bound method is held weakly (a reader dropped meanwhile is not kept alive, nor woken)."""
        ref = weakref.WeakMethod(wake) if hasattr(wake, "__self__") else (lambda: wake)
        with self._lock:
            if (ref, cap) not in self._waiters:
                self._waiters.append((ref, cap))
        self._wake()

    def _wake(self) -> None:
        """Tell the waiting readers that have room now, each in a thread of its own: no reader's lock is taken
        under another's (a reader gives a place back holding its own lock)."""
        with self._lock:
            waiting = [entry for entry in self._waiters if self._room(entry[1])]
            if not waiting:
                return
            self._waiters = [entry for entry in self._waiters if entry not in waiting]
        for ref, _ in waiting:
            wake = ref()
            if wake is not None:
                threading.Thread(target=wake, daemon=True, name="wds_cloud: the level has room").start()

    def limit(self, cap: int, reason: str = "") -> None:
        """Set the ceiling (``max_concurrency``) to ``cap``: a level above it comes down to it."""
        with self._lock:
            self.cap = max(1, cap)
            if self.level > self.cap:
                self.level = self.cap
                self.reason = reason or f"{_conns(self.cap)}: the ceiling"
            if self._ceiling is not None and self._ceiling > self.cap:
                self._ceiling = None

    def forked(self) -> None:
        """This process was forked: what was learned stays, the parent's parts in flight, waiting readers,
        lock and measuring window do not."""
        self._lock = threading.Lock()
        self._in_flight = 0
        self._waiters = []
        self.inherited = True  # this process's first reader of the host sets the ceiling (its share)
        self._open_window(None, settle=0.0)

    def received(self, nbytes: int, now: float, ticket: Optional[int] = None) -> None:
        """``nbytes`` arrived on one of the host's connections, for a part that carries ``ticket`` (from
        :meth:`ticket` when it was sent; None: a part of the current level)."""
        with self._lock:
            if ticket == Controller.CUT and not (self._trial == "up" and self._from == 1):
                ticket = None  # a cut request counts in a level of several (see CUT)
            if ticket == Controller.CUT:
                # the last bytes of a request cut short in a climb from one connection: no level's (its connection
                # is one more than the new level's parts), and not counted; the window goes on without them
                return
            if ticket is not None and ticket > self.level:
                # A part sent at a higher level is still arriving: its connection is one more than the level
                # being judged (on a host that suffers from connections, it slows the others too), so nothing
                # measured while it arrives is this level's.  The window starts again a first byte after the
                # last of its bytes.  (Parts sent at a lower level count: their connections are within it.)
                self._open_window(now, settle=self.latency or 0.0)
                return
            if self._settle_until is not None and now < self._settle_until:
                return
            if self._started is None:
                self._started = now
                self._busy_at = now
                return  # the window starts with these bytes: their transfer time is not in it
            self._bytes += nbytes
            self._arrivals += 1
            self._last = now

    def waited(self, seconds: float) -> None:
        """The reader was blocked ``seconds`` waiting for the host's bytes."""
        with self._lock:
            if self._started is not None:
                self._waited += seconds

    def due(self, now: float) -> bool:
        """Whether the current window is long enough to decide on."""
        started = self._started
        if self.fixed or started is None or now - started < self._window_length():
            return False
        need = ARRIVALS * self.level
        if self._arrivals >= need:
            return True
        # A trial above a measured level is over early once it is sure to be slower than that level: the window
        # has lasted as long as the level below would have taken to bring the pieces it needs, and it has not
        # got them (on a host that suffers from connections, every second at such a level costs).
        # So is a window of a level held once it is sure the level fell (a third of what it brought would have
        # brought the pieces by now): on a host that became crowded, 16 connections at 0.3 MB/s took seconds to
        # bring a window's pieces.
        below = self._from if self._trial == "up" else None
        if below is not None:
            rate = self.rates.get(below, 0.0)
        elif self._trial is None and self.level > 1:
            below, rate = 1, self._brought.get(self.level, self.rates.get(self.level, 0.0)) / FELL
        else:
            return False
        return (
            rate > 0
            and self._arrivals >= ARRIVALS * below
            and (now - started) * rate >= need * self._bytes / self._arrivals
        )

    # deciding
    def decide(
        self,
        now: float,
        remaining: Optional[int] = None,
        connection_rate: Optional[float] = None,
        part_size: Optional[int] = None,
    ) -> Optional[int]:
        """Close the window: the new level when it changes, else None.  ``remaining``: the bytes the
        reader has still to get from this host as far as is known (None: unknown, taken as plenty);
        ``connection_rate``: bytes/s one connection carries while a body flows (None: unknown);
        ``part_size``: the longest part a new request would ask for."""
        with self._lock:
            if not self.due(now):
                return None
            self._account(now)
            assert self._started is not None
            seconds = self._seconds = now - self._started
            rate = self._bytes / seconds
            share = min(1.0, self._waited / seconds)
            used = self._busy / seconds
            self.waiting = share
            self.decisions += 1
            level = self.level
            held = self._brought.get(level, self.rates.get(level)) if self._trial is None else None
            span = self._spans.setdefault(level, [])
            # a fall is seen while the reader waits (else the connections may only be waiting for the reader), and
            # confirmed by the next window, whether the reader waits in it or lives on what was fetched ahead
            fell = held is not None and level > 1 and rate * FELL < held
            fell = fell and (share >= WAIT_SHARE or self._fallen is not None)
            doubt = fell and self._fallen is None
            if fell and not doubt:
                assert self._fallen is not None
                # a fall is judged on its two windows together, against what the level brought
                span[:] = [self._fallen, (self._bytes, seconds)]
            elif not doubt:
                span.append((self._bytes, seconds))
                del span[:-SPAN]
            self._fallen = (self._bytes, seconds) if doubt else None
            if not doubt:
                self.rates[level] = rate = sum(b for b, _ in span) / sum(t for _, t in span)
                if share >= WAIT_SHARE:
                    self._brought[level] = rate
            if doubt:
                # one window is a coin toss (a shard's end, a busy CPU): a fall counts on two in a row, and this
                # window is no part of the level's rate unless the next one falls too
                assert held is not None
                self.reason = (
                    f"{_conns(level)} fell from {held / 1e6:.0f} to {rate / 1e6:.0f} MB/s in one window: "
                    "measuring again"
                )
                new = level
            elif fell:
                assert held is not None
                new = self._fell(level, held, rate)
            else:
                new = self._next(level, rate, share, used, remaining, now, connection_rate, part_size)
            if self._held_since is None or new != level:
                self._held_since = now
            if new != level:
                self.level = new
                # a level is judged on its windows since it was taken up this time, not those of an earlier visit
                # (a trial's connections were slowing it then, or the link has changed since)
                self._spans.pop(new, None)
                self._brought.pop(new, None)
                self._settled = None
            rose = new > level
            if new == level and not self._fresh:
                # the level stays: the next window starts now, where this one ended (windows that each began at
                # the first bytes after a pause left out the gaps of shard ends, and rated a level by its bursts)
                self._open_window(now, settle=0.0)
                self._started = self._busy_at = now
            elif new == level:
                # a trial's first window was left out (its connections were starting): the next starts with the
                # next bytes, not counting them (pieces that were coming during the window left out would
                # otherwise count in it)
                self._fresh = False
                self._open_window(now, settle=0.0)
            else:
                self._open_window(now, settle=self.latency or 0.0)
        if rose:
            self._wake()  # readers of other datasets waiting for a place may have one now
        return new if new != level else None

    def _next(
        self,
        level: int,
        rate: float,
        share: float,
        used: float,
        remaining: Optional[int],
        now: float,
        connection_rate: Optional[float],
        part_size: Optional[int],
    ) -> int:
        mb = rate / 1e6
        if self._trial == "down":  # measuring below ``_from``
            above = self._from
            assert above is not None
            self._trial = self._from = None
            if share < WAIT_SHARE:
                self.reason = f"the reader did not wait at {_conns(level)} ({mb:.0f} MB/s): fewer suffice"
                return level
            if self.rates.get(above, 0.0) >= rate * (1 + GAIN):
                self.reason = (
                    f"{_conns(above)} were faster than {level} ({self.rates[above] / 1e6:.0f} "
                    f"vs {mb:.0f} MB/s) while the reader waited {share:.0%} of the time"
                )
                return above
            self._ceiling = above
            self.reason = f"{_conns(above)} were no faster than {level} ({mb:.0f} MB/s)"
            down = max(1, level // 2)
            if (
                rate > self.rates.get(above, 0.0) * (1 + GAIN)
                and level > 1
                and self.rates.get(down, rate) * (1 + GAIN) >= rate
            ):
                # fewer were faster: the store suffers from many connections; on down (unless the level
                # below was measured slower)
                self._trial, self._from = "down", level
                self.reason += f": trying {down}"
                return down
            return level
        below = self._from if self._trial == "up" else None
        if below is not None and used < USED * level and share >= WAIT_SHARE and self._tried + 1 < CONFIRM:
            # the trial level was not used (too few parts to fetch at once): measure it again, up to CONFIRM windows
            # (shards too small to keep it busy may never use it: then it is judged on what it brought)
            self._tried += 1
            if self._tried == 1:  # its new connections were starting in the first window: judged on those after it
                self._spans[level] = []
                self._fresh = True
            self.reason = (
                f"trying {_conns(level)}: only {used:.1f} of them had parts to fetch so far, on average "
                f"(the reader waited {share:.0%} of the time)"
            )
            return level
        self._trial = self._from = None
        if below is not None:
            judged = self._verdict(level, below, rate, share)
            if judged is not None:
                return judged
        if share < WAIT_SHARE:
            # (the share rounded down: 24.9% is below the quarter that counts as waiting, and says so)
            self.reason = f"the reader is not waiting for bytes ({int(share * 100)}% of the time) at {mb:.0f} MB/s"
            return self._reprobe(level, now)
        if below is None and level > 1 and not any(k < level for k in self.rates):
            return self._reprobe(level, now)  # a level learned elsewhere: compared with fewer first
        if below is None and level > 1 and used < USED * level:
            self.reason = (
                f"the reader waits ({share:.0%} of the time), but only {used:.1f} of {_conns(level)} on average "
                "had parts to fetch"
            )
            return self._reprobe(level, now)
        # far from a limit (the reader mostly waits, and the last step scaled nearly in proportion) it
        # quadruples, else it doubles
        scaled = below is None or rate >= 0.4 * self.rates.get(below, 0.0) * level / below
        up = self._up(level, scaled and share >= 0.5)
        if up is None:
            self.reason = f"the reader waits {share:.0%} of the time at {mb:.0f} MB/s; {_conns(level)} is the " + (
                f"ceiling (max_concurrency: {DEFAULT_MAX_CONCURRENCY} by default, shared by a machine's DataLoader "
                "workers and processes)"
                if level >= self.cap
                else "best measured"
            )
            return self._reprobe(level, now)
        why_not = self._pays(level, up, rate, remaining, connection_rate, part_size)
        if why_not is not None:
            self.reason = f"the reader waits {share:.0%} of the time at {mb:.0f} MB/s, but more connections would not pay: {why_not}"
            return self._reprobe(level, now)
        self._trial, self._from = "up", level
        self.reason = f"the reader waited {share:.0%} of the time at {_conns(level)} ({mb:.0f} MB/s): trying {up}"
        return up

    def _verdict(self, level: int, below: int, rate: float, share: float) -> Optional[int]:
        """Judge a trial at ``level`` above ``below`` on the bytes of its windows together: None to keep it (the
        climb goes on from it), else the level to go to.  A verdict waits for :data:`CONFIRM` windows unless it is
        sure: much slower than ``below`` (on a host that suffers from connections every window at it costs; not
        on the first window of a climb from one connection, while the request for the rest of the shard was
        being cut into parts), or faster by the margin and nearly in proportion."""
        mb, ref = rate / 1e6, self.rates.get(below, 0.0)
        self._tried += 1
        windows = self._tried
        # more connections that only keep a busy reader from waiting, without more bytes per second, are not kept;
        # while the reader waits through the trial, a modest gain is worth keeping
        gain = min(_margin(below, level), MODEST) if share >= WAIT_SHARE else _margin(below, level)
        # the reader no longer waits (after the trial's first window, which may live on what the level below
        # fetched ahead): the rate is its own pace, not what the connections can bring (on a shared CPU it
        # fell with the threads of the new connections), and the trial did what it was for; kept unless sure
        # to be slower
        relieved = share < WAIT_SHARE and windows > 1 and rate >= SLOWER * ref
        faster = relieved or rate >= ref * (1 + gain)
        proportion = relieved or level <= below + 1 or rate >= PROPORTION * ref * level / below
        # sure to be slower: on two windows of the trial (one window against one is a coin toss), or on its first
        # against two of the level below, once it lasted long enough for its connections' start to count little in
        # it (STARTS first bytes; never in a climb from one connection, whose first window holds the cut request)
        slower = rate < SLOWER * ref and (
            windows > 1
            or (below > 1 and len(self._spans.get(below, ())) > 1 and self._seconds >= STARTS * (self.latency or 0.0))
        )
        if not (slower or (faster and proportion) or windows >= CONFIRM):
            self._trial, self._from = "up", below
            if windows == 1:  # its new connections were starting in the first window: judged on those after it
                self._spans[level] = []
                self._fresh = True
            self.reason = (
                f"trying {_conns(level)}: measuring again ({mb:.0f} MB/s over {windows} window{'s' * (windows > 1)})"
            )
            return level
        self._tried = 0
        if not faster:
            self._ceiling = level
            self.reason = f"{_conns(level)} were no faster than {below} ({mb:.0f} vs {ref / 1e6:.0f} MB/s)"
            return below
        if not proportion:
            # faster, but far from in proportion: a level between the two may be as fast
            middle = (below + level) // 2
            self._trial, self._from = "down", level
            self.reason = (
                f"{_conns(level)} were faster than {below} ({mb:.0f} vs {ref / 1e6:.0f} MB/s), "
                f"not in proportion: trying {middle}"
            )
            return middle
        return None

    def _fell(self, level: int, held: float, rate: float) -> int:
        """The rate at the level held fell to a fraction of what it brought while the reader waits: the host
        changed (crowded, throttled), and the levels between may now look worse than both ends (a host that
        slows every connection past N), so the search starts again from one connection."""
        self._trial = self._from = self._ceiling = None
        self._tried = 0
        self.rates = {}
        self._spans = {}
        self._brought = {}
        self.reason = (
            f"{_conns(level)} fell from {held / 1e6:.0f} to {rate / 1e6:.0f} MB/s while the reader waited: "
            "measuring again from one connection"
        )
        return 1

    def _up(self, level: int, far: bool = False) -> Optional[int]:
        """The next level to try above ``level``, or None.  From one connection it quadruples (``far``: the
        reader mostly waits) or doubles; above one it climbs in steps of about a third (:func:`_step`), so
        that on a host that suffers from connections the first level tried past the one it bears is only a
        step past it, and a level is tried only once the one below it proved faster than the one below that.
        A level found no faster (the ceiling, remembered until the next re-probe) is not tried again, nor is
        any level between it and ``level`` when it was only a step above: the climb stops there."""
        if level >= self.cap:
            return None
        up = min(self.cap, (4 if level == 1 else 2) * level if far else _step(level) if level > 1 else 2)
        if self._ceiling is not None and up >= self._ceiling:
            up = _step(level)  # the ceiling was a bigger jump than a step: the step below it is worth a window
        return up if self._ceiling is None or up < self._ceiling else None

    def _pays(
        self,
        level: int,
        up: int,
        rate: float,
        remaining: Optional[int],
        connection_rate: Optional[float],
        part_size: Optional[int],
    ) -> Optional[str]:
        """None where ``up`` connections can win back a new request's first byte on what is left to read (the time
        ``level`` connections take to carry it, at the rate of a flowing body, not counting waits, but no faster than
        the reader got it, must shrink by more than a first byte: what each new connection pays before it brings
        anything); else why not, in words for ``ds.stats``."""
        latency = self.latency or 0.0
        if connection_rate and part_size and part_size / connection_rate < latency:
            # a part would wait longer for its first byte than its body takes to flow
            return (
                f"a part of {part_size / (1 << 20):.3g} MiB flows for {part_size / connection_rate:.3f} s at "
                f"{connection_rate / 1e6:.0f} MB/s a connection, less than its request waits for the first byte "
                f"({latency:.3f} s); a larger part_size lets more connections pay where the store's first byte is slow"
            )
        # what the level carries: the connections' flowing rate, but no more than what the reader got from them
        # (over a distant link on a shared CPU 8 connections flowing at 50 MB/s each brought 200 MB/s: counted at
        # 400, the rest of two shards looked too short for 16 to win back their first bytes, and the climb stopped)
        carried = min(level * connection_rate, rate or level * connection_rate) if connection_rate else rate
        if remaining is None or not carried:
            return None
        left = remaining / carried
        if left * (1 - level / up) > latency:
            return None
        return (
            f"what is known to be left ({remaining / 1e6:.1f} MB) would take {left * (1 - level / up):.3f} s less on "
            f"{up}, less than a request's first byte ({latency:.3f} s)"
        )

    def _reprobe(self, level: int, now: float) -> int:
        """Hold ``level``; but after :data:`REPROBE` seconds at it (a link changes), forget the ceiling and try
        one step down; and at once when no level below it was measured (it was learned in another
        process), try one connection."""
        unmeasured = level > 1 and not any(k < level for k in self.rates)
        if self._settled is None and level in self.rates:
            self._settled = self.rates[level]  # what the level brought as it came to be held
        if not unmeasured and (self._held_since is None or now - self._held_since < REPROBE):
            return level
        settled, self._settled = self._settled, None
        rate = self.rates.get(level, 0.0)
        if level > 1 and settled and rate * 2 < settled and self.waiting >= WAIT_SHARE:
            # it brings less than half of what it did when it came to be held, and the reader waits: the host
            # changed (crowded past a few connections, where the levels between look worse than both ends, so one
            # step down would find the held level faster and come back to it; a fall of less than a third is not
            # seen at once): the search starts again from one connection
            new = self._fell(level, settled, rate)
            self.reason = (
                f"{_conns(level)} brought {rate / 1e6:.0f} MB/s after {REPROBE:.0f} s, under half of the "
                f"{settled / 1e6:.0f} MB/s they brought when chosen, while the reader waited: measuring again from "
                "one connection"
            )
            return new
        self._ceiling = None
        self.rates = {level: self.rates[level]} if level in self.rates else {}
        self._spans = {level: self._spans[level]} if level in self._spans else {}
        self._brought = {level: self._brought[level]} if level in self._brought else {}
        if level <= 1:
            return level
        self._trial, self._from = "down", level
        down = 1 if unmeasured else max(1, level // 2)
        self.reason = (
            f"{_conns(level)} were never compared with fewer here: trying {down}"
            if unmeasured
            else f"measuring again after {REPROBE:.0f} s at {_conns(level)}: trying {down}"
        )
        return down

    def report(self) -> dict:
        """The level and why, for ``ds.stats``: ``level``, ``why``, ``waiting`` (share of the last window),
        ``latency`` (s), ``rates`` (bytes/s per level measured), ``cap``."""
        with self._lock:
            return {
                "level": self.level,
                "why": self.reason,
                "waiting": round(self.waiting, 3),
                "latency": round(self.latency, 4) if self.latency is not None else None,
                "rates": {k: round(v) for k, v in sorted(self.rates.items())},
                "cap": self.cap,
                "pinned": self.fixed,
            }

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]
        state["_in_flight"], state["_waiters"] = 0, []  # parts and readers of this process only
        state["inherited"] = True
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self.__dict__.setdefault("_waiters", [])
        self.__dict__.setdefault("_fallen", None)
        self.__dict__.setdefault("_brought", {})
        self.__dict__.setdefault("_fresh", False)
        self.__dict__.setdefault("_settled", None)
        self.__dict__.setdefault("inherited", True)
        self.__dict__.setdefault("_last", 0.0)


def _conns(n: int) -> str:
    """``n`` connections, in words (one connection, not "1 connections")."""
    return "1 connection" if n == 1 else f"{n} connections"


def _step(level: int) -> int:
    """The level a climb tries above ``level`` (one connection more up to 5, then about a third more)."""
    return level + max(1, level // 3)


def _margin(below: int, level: int) -> float:
    """How much faster (a fraction of its rate) ``level`` connections must be than ``below`` to be kept:
    :data:`GAIN`, or half of what the added connections would bring in proportion when that is less (a step of
    one connection at 6 can bring a sixth at most)."""
    return min(GAIN, 0.5 * (level - below) / below)


# what this process learned, per host (module state: forked workers inherit it)
_learned: dict[str, Controller] = {}
_learned_lock = threading.Lock()
_pid = os.getpid()


def worker_share(cap: int, local_world_size: Optional[int] = None) -> int:
    """``cap`` divided among this machine's readers: the DataLoader workers of this process's parent
    and the ``local_world_size`` processes of the node (at least 1)."""
    workers = 1
    # the worker count straight from torch (already imported by a DataLoader worker), not through
    # wds_cloud.utils: io/ depends on nothing above it
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            info = torch.utils.data.get_worker_info()
        except Exception:
            info = None
        if info is not None:
            workers = max(1, int(info.num_workers))
    return max(1, cap // (workers * max(1, local_world_size or 1)))


def controller_for(host: str, cap: int, fixed: Optional[int] = None) -> Controller:
    """The controller of ``host`` in this process: a pinned one for ``fixed``, else the one learned so far
    (created at one connection), its ceiling set to ``cap``."""
    global _pid
    if fixed is not None:
        return Controller(cap, fixed=fixed)
    with _learned_lock:
        if _pid != os.getpid():  # a forked worker: keep what the parent learned, under this process's ceiling
            _pid = os.getpid()
            for old in list(_learned.values()):
                old.forked()
        controller = _learned.get(host)
        if controller is None:
            controller = _learned[host] = Controller(cap)
        elif controller.inherited:
            # learned in the parent, or handed over: this process's ceiling is its own (a worker's share)
            controller.inherited = False
            if controller.cap != cap:
                controller.limit(cap, f"{_conns(max(1, cap))}: this process's share of max_concurrency")
        elif cap > controller.cap:
            # another reader of the host allows more: the level may climb for it, while the readers with a lower
            # ceiling send their parts only below theirs (Controller.take's cap)
            controller.limit(cap)
        return controller


def learned() -> dict[str, Any]:
    """A copy of what this process learned (to hand to a worker started with spawn)."""
    with _learned_lock:
        return {host: {"level": c.level, "rates": dict(c.rates), "latency": c.latency} for host, c in _learned.items()}


def seed(table: dict[str, Any]) -> None:
    """Start from ``table`` (from :func:`learned` in another process) for hosts not yet known here."""
    if not isinstance(table, dict):
        return
    with _learned_lock:
        for host, entry in table.items():
            if host in _learned or not isinstance(entry, dict):
                continue
            level = entry.get("level")
            if not isinstance(level, int) or isinstance(level, bool) or not 1 <= level <= 1024:
                continue
            controller = Controller(DEFAULT_MAX_CONCURRENCY, start=level)
            controller.inherited = True
            latency = entry.get("latency")
            if isinstance(latency, float) and latency >= 0:
                controller.latency = latency
            _learned[host] = controller


def report() -> dict[str, dict]:
    """Each host's level and why (as in ``ds.stats``), for every host this process read from in parts."""
    with _learned_lock:
        controllers = dict(_learned)
    return {redact(host): c.report() for host, c in controllers.items()}  # no credential of a URL in a report


def forget() -> None:
    """Forget every host (tests, or a link known to have changed)."""
    with _learned_lock:
        _learned.clear()
