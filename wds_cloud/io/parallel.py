"""Parallel ranged reads: a remote shard fetched as parts on several connections, the next shards ahead.

Over a distant link one connection carries tens of MB/s and every request waits for its first
byte, so one stream per shard leaves most of the link idle; on a store where a ranged request costs
more than its share, parts make things worse.  A :class:`Fetcher` (one per dataset and process)
reads each remote shard on as many connections as its host's *level* (measured by a
:class:`~wds_cloud.io.concurrency.Controller`, per host, in both directions) and hands the bytes to
the tar reader in order as one stream (:class:`PartedStream`):

- at one connection, the first request asks for the whole rest of the shard and, once the shard is
  being read, its reader reads it straight from the connection (one request per shard and no thread in
  between, as a plain stream); when more connections are chosen while it flows, it stops a little
  ahead of where it is and the rest is asked for as parts;
- at more, the first request asks for ``part_size / 2`` bytes; its answer tells the size and version,
  and the rest is split into parts of at most ``part_size`` (at least as many as the level while each
  keeps :data:`MIN_PART`, or the whole ``part_size`` where that is smaller; ``part_size`` itself is at
  least :data:`~wds_cloud.config.MIN_PART_SIZE`, 64 KiB).  A store that ignores ``Range`` is read as
  one stream, and so is every later shard of that host: its first answer to a ranged request (every
  request asks with one, from byte 0 too) is the whole object, read on as that shard's one stream, and
  no part goes to that host after it;
- every part is a :class:`~wds_cloud.io.resilient.ResumableStream` pinned to the version of the
  first part: a fault resumes that part at its next unread byte, and an object replaced between
  parts raises :class:`~wds_cloud.errors.ObjectChangedError`, never a splice;
- at most ``level`` parts of a host are in flight and at most ``level x part_size`` bytes held (parts
  wait in memory only until the reader takes them; a request for a whole shard holds at most
  ``part_size`` unread);
- ``prefetch(urls)`` names the shards that come next (the reader knows them after shuffling and
  splitting): the first request of each is sent ahead when the level has a place for it (it holds at
  most :data:`FIRST_SAMPLE_BYTES`, or half a part, until the shard is read); at one connection the next
  shard's first request also goes out once the current shard is within a first-byte latency of its end
  (one beyond the level, never beyond ``max_concurrency``), so that the reader does not wait for the
  host's latency at every shard; then
  its parts with the connections the current shard leaves free, except the last one, so a shard that is
  never read is never downloaded whole; a shard dropped from the list, or left when the reader stops,
  is cancelled and its connections closed;
- parts reuse kept-alive connections (:mod:`~wds_cloud.io.keepalive`): no new TCP or TLS handshake
  per part on the HTTP backends.

Settings (the dataset's arguments, else the profile of the URL, else the environment):
``part_size`` (``WDS_PART_SIZE``, 8 MiB), ``concurrency`` (``WDS_CONCURRENCY``; pins the level, and 1
turns parts off), ``max_concurrency`` (``WDS_MAX_CONCURRENCY``; the ceiling of the measured level, by
default 16 shared among the machine's DataLoader workers), ``prefetch`` (``WDS_PREFETCH``, 1 shard
ahead).  Local files, pipes and backends without ranged reads are opened as before, one stream each.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

from .. import config
from ..config import Settings
from ..errors import ConfigError, TransferError, redact
from . import concurrency, profiles
from .backend import read_to_end
from .concurrency import Controller
from .open import RemoteObject, gopen, remote_object
from .registry import get_registry
from .resilient import ResumableStream, StatsSink, TransferStats

__all__ = ["TransferOptions", "Fetcher", "PartedStream", "plan_parts", "part_step"]

log = logging.getLogger(__name__)

#: a part's bytes become readable in pieces of this size (the first sample does not wait for a whole part);
#: the first pieces of a part are smaller (from FIRST_PIECE, doubling), so the first bytes come sooner
CHUNK = 256 << 10
#: a filler already ahead of its reader reads in pieces of this size (fewer wake-ups)
BIG_CHUNK = 1 << 20
FIRST_PIECE = 64 << 10
#: a shard opened cold (not fetched ahead) asks for its other parts once this much of the first part
#: has come: the first sample arrives as fast as over one stream, not sharing the link with them
FIRST_SAMPLE_BYTES = 1 << 20
#: parts are not split finer than this to use more connections (unless ``part_size`` is smaller: it may be as
#: small as config.MIN_PART_SIZE, and below that only where TransferOptions are built directly, as tests do)
MIN_PART = 1 << 20


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    """How one shard is fetched (see the module docstring)."""

    part_size: int = 8 << 20
    concurrency: Optional[int] = None  # None: measured per host (see wds_cloud.io.concurrency)
    max_concurrency: Optional[int] = None  # None: the default ceiling, shared by a machine's workers
    prefetch: int = 1

    @classmethod
    def resolve(
        cls, settings: Settings, profile: Mapping[str, tuple[Any, str]], given: Mapping[str, Any]
    ) -> TransferOptions:
        """The environment's settings, overridden by the URL's ``profile`` (each key's value and the profile that
        set it, as :func:`~wds_cloud.io.profiles.transfer_for` gives them), then by the dataset's arguments
        (``given``).  Each value is held to its range naming where it was set, and a pinned ``concurrency``
        above ``max_concurrency`` is refused whatever set each (an error naming both sources)."""
        values: dict[str, Any] = {key: getattr(settings, key) for key in profiles.TRANSFER_KEYS}
        origins = {key: f"from {config.variable_for(key)}" for key in profiles.TRANSFER_KEYS}
        for key, (value, where) in profile.items():
            if value is not None:
                values[key], origins[key] = _checked(key, value, where), f"from {where}"
        for key, value in given.items():
            if value is not None:
                values[key], origins[key] = _checked(key, value), config.AS_ARGUMENT
        config.check_ceiling(values["concurrency"], values["max_concurrency"], origins)
        return cls(**values)

    @property
    def first_part(self) -> int:
        """The length of the first request (the whole of a shard no longer than it)."""
        return max(1, self.part_size // 2)

    @property
    def parallel(self) -> bool:
        return self.concurrency != 1


def _checked(key: str, value: Any, where: Optional[str] = None) -> Any:
    if key not in profiles.TRANSFER_KEYS:
        raise ConfigError(f"{key!r} is not a transfer setting: use part_size, concurrency, max_concurrency or prefetch")
    return config.check_setting(key, value, where=where)  # the range of its WDS_* variable (config.BOUNDS)


def part_step(start: int, size: int, part_size: int, concurrency: int) -> tuple[int, int]:
    """``(step, count)``: ``[start, size)`` is read after a first part in ``count`` parts of ``step`` bytes (the
    last shorter), no longer than ``part_size`` and as many as ``concurrency`` where each is still at least
    :data:`MIN_PART` (or ``part_size``).  Arithmetic only: a size claimed by a server costs no memory."""
    rest = size - start
    if rest <= 0:
        return 0, 0
    floor = min(part_size, MIN_PART)
    count = max(-(-rest // part_size), min(concurrency, -(-rest // floor)))  # whole numbers: exact for any size
    step = -(-rest // count)
    return step, -(-rest // step)


def plan_parts(start: int, size: int, part_size: int, concurrency: int) -> list[tuple[int, int]]:
    """The byte ranges of :func:`part_step` as a list (the reader makes them one at a time, as it needs them)."""
    step, count = part_step(start, size, part_size, concurrency)
    return [(start + i * step, min(size, start + (i + 1) * step)) for i in range(count)]


_PREFETCHED, _ACTIVE, _CLOSED = "prefetched", "active", "closed"


class _Part:
    """A byte range of an object, filled by one request in pieces that the reader takes in order.

    ``end`` is None for a *streamed* part: the first request of a shard read on one connection asks
    for everything from its start, and its end becomes the object's size (or where the rest is split
    into parts when more connections are chosen)."""

    __slots__ = (
        "obj",
        "index",
        "start",
        "end",
        "limit",
        "cap",
        "chunks",
        "filled",
        "taken",
        "asked_to",
        "blocked",
        "began",
        "error",
        "done",
        "stream",
        "reserved",
        "released",
        "streamed",
        "asked",
        "handoff",
        "direct",
        "ticket",
        "pause",
        "paused",
    )

    def __init__(self, obj: _Object, index: int, start: int, end: Optional[int]) -> None:
        self.obj = obj
        self.index = index
        self.start = start
        self.end = end
        self.streamed = end is None
        self.limit: Optional[int] = None  # fill no further for now (a shard only expected); None: no limit
        self.cap: Optional[int] = None  # hold at most this many unread bytes (a streamed part); None: all
        self.chunks: collections.deque[memoryview] = collections.deque()  # filled, not yet taken, in order
        self.filled = 0
        self.taken = 0
        self.asked_to = 0  # ``filled`` plus the read in progress: a split never cuts below it
        self.blocked = False  # its filler waits for the reader (memory) or for the shard to be read
        self.began: Optional[float] = None  # when its first byte came
        self.error: Optional[BaseException] = None
        self.done = False
        self.stream: Optional[ResumableStream] = None
        self.reserved = 0  # bytes of the window it holds
        self.released = False
        self.asked = 0.0  # when its request was sent
        # A shard read on one connection is read by its reader itself, as a plain stream is (no thread in
        # between): its filler hands the stream over (``handoff`` asked, ``direct`` done) once the shard is
        # being read and its first bytes have come.
        self.handoff = False
        self.direct = False
        self.ticket: Optional[int] = None  # the level it was sent at (the controller's ticket)
        # Fewer connections were chosen: its filler stops at the end of the piece it reads (``pause``), and the
        # part waits for a connection again (``paused``), to ask for the rest of its range then.
        self.pause = False
        self.paused = False

    @property
    def length(self) -> Optional[int]:
        return None if self.end is None else self.end - self.start

    def room(self) -> bool:
        """Whether its filler may read on as far as its cap goes: while it holds less than the cap unread, and once
        it waited for the reader, only when the reader has taken it down to half the cap (one wake-up per half a
        part, not per piece: a reader busy decoding is not interrupted by a filler taking the interpreter back for
        every piece).  Half of a cap of one byte is none: that filler reads on once nothing is left unread (waiting
        for fewer than none left its reader and it waiting for each other forever).  The reader wakes the filler
        on the same test."""
        if self.cap is None:
            return True
        unread = self.filled - self.taken
        return unread <= self.cap // 2 if self.blocked else unread < self.cap

    @property
    def holds(self) -> int:
        """The most bytes it can hold at once: what it reserves of the window."""
        length = self.length
        if self.cap is None:
            return length if length is not None else 0
        return self.cap if length is None else min(self.cap, length)


class _Object:
    """One shard being read (or expected): its parts, in order, made lazily from the plan (a server's claim of
    the object's size decides how many there are, never how much memory is taken before bytes arrive)."""

    def plan(self, step: int, count: int, base: int = 1) -> None:
        """Parts ``base`` onwards: ``count`` of ``step`` bytes from where part ``base - 1`` ends."""
        self._base = base
        self._step = step
        self.total = base + count

    def part(self, index: int) -> _Part:
        """Part ``index`` (< ``total``), made with those before it when first asked for."""
        while len(self.parts) <= index:
            i = len(self.parts)
            grid_start = self.parts[self._base - 1].end
            assert grid_start is not None
            begin = grid_start + (i - self._base) * self._step
            end = begin + self._step
            if self.size is not None:
                end = min(end, self.size)
            part = _Part(self, i, begin, end)
            if end - begin > self.options.part_size:
                part.cap = self.options.part_size  # a long part holds no more than a part's worth unread
            self.parts.append(part)
        return self.parts[index]

    def replan(self, level: int) -> None:
        """Plan the parts not yet asked for again, for ``level`` connections (lock held): finer when it
        grew; when it fell, coarser, and at one connection one request for all the rest."""
        done = self.dispatched
        if not self.planned or self.single or self.size is None or not 0 < done < self.total:
            return
        begin = self.parts[done - 1].end
        assert begin is not None
        step, count = self.steps(begin, level)
        if count != self.total - done:
            del self.parts[done:]
            self.plan(step, count, base=done)

    def steps(self, begin: int, level: int) -> tuple[int, int]:
        """``(step, count)`` of the parts for ``[begin, size)`` at ``level`` connections: at one, a single
        request for all of it (holding at most a part's worth unread); else :func:`part_step`."""
        assert self.size is not None
        if level == 1:
            return (self.size - begin, 1) if self.size > begin else (0, 0)
        return part_step(begin, self.size, self.options.part_size, level)

    def __init__(
        self,
        url: str,
        remote: RemoteObject,
        options: TransferOptions,
        start: int,
        state: str,
        host: str,
        controller: Controller,
    ) -> None:
        self.url = url
        self.remote = remote
        self.start = start
        self.options = options
        self.state = state
        self.host = host
        self.controller = controller
        self.size: Optional[int] = None
        self.version: Optional[str] = None
        self.md5: Optional[str] = None
        self.planned = False
        self.single = False  # the store ignored Range: the rest is read as one stream
        #: this reader's own ceiling (another reader of the host may have let the shared level climb past it)
        self.cap: Optional[int] = None
        self.deferred = state == _ACTIVE  # opened cold: the other parts wait for the first sample's bytes
        # At one connection the first request asks for the whole rest of the shard (one request, as one
        # stream would); with more, for the first half part, and the rest is planned once its answer tells
        # the size.
        streamed = controller.level == 1 and not controller.fixed
        first = _Part(self, 0, start, None if streamed else start + options.first_part)
        if streamed:
            first.cap = options.part_size
            if state == _PREFETCHED:
                first.limit = FIRST_SAMPLE_BYTES
        self.parts = [first]  # the others are made as they are needed
        self.total = 1  # parts planned, made or not
        self._step = 0
        self._base = 1
        self.dispatched = 0
        self.reading = 0  # the part its reader is at
        self.received = 0  # bytes of it arrived
        self.peak = 0  # the most of its parts in flight at once
        self.running = 0
        self.paused = 0  # parts waiting to ask for the rest of their ranges (see Fetcher._shed)
        self.created = time.perf_counter()

    @property
    def left(self) -> Optional[int]:
        """Bytes of it still to arrive (None: its size is not known yet)."""
        return None if self.size is None else max(0, self.size - self.start - self.received)


class Fetcher:
    """Opens shards for a dataset: parallel ranged reads for remote objects, and the next shards ahead.

    ``open(url, offset)`` returns a binary stream; ``prefetch(urls)`` names the shards that come next.
    One per dataset stage and process: a forked DataLoader worker starts with none of its parent's
    connections (but with what the parent learned of each host), and a pickled one (a spawned worker)
    carries its settings and what was learned.
    """

    def __init__(
        self,
        storage_options: Optional[dict] = None,
        retries: Optional[int] = None,
        timeout: Optional[float] = None,
        stats: Optional[StatsSink] = None,
        **given: Any,
    ) -> None:
        self.storage_options = storage_options
        self.retries = retries
        self.timeout = timeout
        self.stats = stats if stats is not None else StatsSink()
        self.given = {key: _checked(key, value) for key, value in given.items() if value is not None}
        config.check_ceiling(self.given.get("concurrency"), self.given.get("max_concurrency"))
        self._reset()
        _load_plugins()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._objects: list[_Object] = []  # the shards being read, then those expected, in order
        self._running = 0  # parts of this reader being downloaded (the level's count is the controller's)
        self._window: dict[str, int] = {}  # bytes reserved by parts, per host
        self._controllers: dict[tuple, Controller] = {}
        self._single_hosts: set[str] = set()

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        state["learned"] = concurrency.learned()  # a spawned worker starts from what this process knows
        return state

    def __setstate__(self, state: dict) -> None:
        concurrency.seed(state.pop("learned", {}))
        self.__dict__.update(state)
        self._reset()

    def _here(self) -> None:
        if self._pid != os.getpid():  # a forked worker: the parent's threads and locks are not ours
            self._reset()

    @property
    def in_flight(self) -> int:
        """Parts being downloaded now."""
        with self._cond:
            return self._running

    @property
    def held(self) -> int:
        """Bytes of part buffers reserved now (requested and not yet read): at most ``level x part_size`` per host."""
        with self._cond:
            return sum(self._window.values())

    # settings
    def options(self, url: str) -> TransferOptions:
        settings = config.current()
        return TransferOptions.resolve(settings, profiles.transfer_for(url, settings), self.given)

    @property
    def depth(self) -> int:
        """How many of the next shards are fetched ahead (``prefetch``)."""
        prefetch = self.given.get("prefetch")
        return prefetch if prefetch is not None else config.current().prefetch

    def controller(self, host: str, options: TransferOptions) -> Controller:
        """The level of ``host`` for these settings: pinned by ``concurrency``, else measured (and shared by
        the process's readers of that host); the ceiling is ``max_concurrency``, or this worker's share of
        the default."""
        cap = self.cap(options)
        key = (host, options.concurrency, cap)
        found = self._controllers.get(key)
        if found is None:
            found = self._controllers[key] = concurrency.controller_for(host, cap, options.concurrency)
        return found

    @staticmethod
    def cap(options: TransferOptions) -> int:
        """This reader's ceiling: ``max_concurrency``, or this worker's share of the default."""
        cap = options.max_concurrency
        if cap is None:
            cap = concurrency.worker_share(concurrency.DEFAULT_MAX_CONCURRENCY, config.current().local_world_size)
        return cap

    def _remote(self, url: str) -> Optional[tuple[RemoteObject, TransferOptions]]:
        """The object and its settings when ``url`` is read in parts (None: one stream, through gopen)."""
        remote = remote_object(url, storage_options=self.storage_options, retries=self.retries, timeout=self.timeout)
        if remote is None or not remote.ranged or _host(remote.url) in self._single_hosts:
            return None
        options = self.options(url)
        return (remote, options) if options.parallel else None

    def _object(self, url: str, remote: RemoteObject, options: TransferOptions, offset: int, state: str) -> _Object:
        host = _host(remote.url)
        obj = _Object(url, remote, options, offset, state, host, self.controller(host, options))
        obj.cap = self.cap(options)
        return obj

    # opening
    def open(self, url: str, offset: int = 0) -> Any:
        """A stream of ``url`` from byte ``offset``: parts in parallel where the backend allows."""
        self._here()
        with self._cond:
            expected = [o for o in self._objects if o.state == _PREFETCHED]
            obj = next((o for o in expected if o.url == url and o.start == offset), None)
            for other in expected[: expected.index(obj)] if obj is not None else expected:
                self._cancel(other)  # the order went another way: what was fetched ahead of it is dropped
            if obj is not None:
                self._activate(obj)
        if obj is None:
            found = self._remote(url)
            if found is None:
                return gopen(
                    url,
                    "rb",
                    offset=offset,
                    storage_options=self.storage_options,
                    retries=self.retries,
                    timeout=self.timeout,
                    stats=self.stats,
                )
            obj = self._object(url, *found, offset, _ACTIVE)
            with self._cond:
                actives = sum(1 for o in self._objects if o.state == _ACTIVE)
                self._objects.insert(actives, obj)
                self._pump()
        stream = PartedStream(obj, self)
        try:
            stream.wait_planned()
        except BaseException:
            stream.close()
            raise
        return stream

    def _activate(self, obj: _Object) -> None:
        obj.state = _ACTIVE
        self._objects.remove(obj)
        actives = sum(1 for o in self._objects if o.state == _ACTIVE)
        self._objects.insert(actives, obj)
        for part in obj.parts:
            part.limit = None
        if obj.controller.level > 1:
            self._split(obj)
        elif obj.parts[0].stream is not None:
            self._offer(obj.parts[0])
        self._pump()
        self._cond.notify_all()

    def prefetch(self, urls: Sequence[str]) -> None:
        """The shards that come next, in order: the first ``prefetch`` of them are requested ahead.

        An expected shard no longer named is cancelled; an empty list cancels them all (the reader stopped).
        A URL that cannot be opened is left for ``open`` to report.
        """
        self._here()
        wanted: list[str] = []
        for url in urls:
            if len(wanted) >= self.depth:
                break
            if url not in wanted:
                wanted.append(url)
        with self._cond:
            expected = {o.url: o for o in self._objects if o.state == _PREFETCHED}
        fresh: dict[str, _Object] = {}
        for url in wanted:
            if url in expected:
                continue
            try:
                found = self._remote(url)
            except Exception:  # a hint only: open() reports the error when the shard is reached
                continue
            if found is not None:
                fresh[url] = self._object(url, *found, 0, _PREFETCHED)
        with self._cond:
            for obj in list(self._objects):
                if obj.state == _PREFETCHED and obj.url not in wanted:
                    self._cancel(obj)
            current = {o.url: o for o in self._objects if o.state == _PREFETCHED}
            current.update(fresh)
            self._objects = [o for o in self._objects if o.state == _ACTIVE] + [
                current[u] for u in wanted if u in current
            ]
            self._pump()

    def close(self) -> None:
        """Cancel every shard expected or being read here."""
        with self._cond:
            for obj in list(self._objects):
                self._cancel(obj)

    # scheduling (called with the lock held)
    def _pump(self) -> None:
        """Start parts in reading order while each host's level and window allow: every part, the next shard's
        first request included, takes a place in the level (the controller's count, shared with the process's
        other readers of the host); only a part its reader is blocked on goes out at a full level."""
        full: set[int] = set()  # the controllers with no place left
        held_back = False  # a shard opened cold holds back the shards fetched ahead, not another one opened
        for obj in self._objects:
            controller = obj.controller
            if obj.state == _CLOSED or id(controller) in full or (held_back and obj.state != _ACTIVE):
                continue
            budget = min(controller.level, obj.cap or controller.level) * obj.options.part_size
            for part in obj.parts[obj.reading : obj.dispatched] if obj.paused else ():
                # parts paused when the level fell come first, in order
                if part.paused:
                    waited_on = obj.state == _ACTIVE and obj.reading >= part.index
                    ticket = self._take(controller, waited_on, obj.cap)
                    if ticket is None:
                        full.add(id(controller))
                        break
                    self._resume(part, ticket)
            if id(controller) in full:
                continue
            while obj.dispatched < obj.total:
                if obj.dispatched and (not obj.planned or obj.deferred):
                    break
                part = obj.part(obj.dispatched)
                if obj.state == _PREFETCHED and part.index and part.index == obj.total - 1:
                    break  # an expected shard's last part waits until the shard is read
                waited_on = obj.state == _ACTIVE and obj.reading >= part.index  # its reader waits for it
                ahead = not part.index and self._ahead(obj)
                window = self._window.get(obj.host, 0)
                if not (waited_on or ahead) and window and window + part.holds > budget:
                    full.add(id(controller))
                    break
                ticket = self._take(controller, waited_on or ahead, obj.cap)
                if ticket is None:
                    full.add(id(controller))
                    break
                self._start(part, ticket)
            if obj.deferred:
                # nothing fetched ahead starts before its first sample's bytes are in; a shard its reader opened
                # still does (a stream left unread and unclosed must not block every later open forever)
                held_back = True

    def _ahead(self, obj: _Object) -> bool:
        """Whether ``obj``, the shard expected next, sends its first request now although the level is full: at one
        connection, once the shard being read before it is within a first-byte latency of its end (what is left
        of it, at the rate its request brings, arrives sooner than an answer to a new request would), so that the
        next shard's first byte comes as the last of this one does, and the reader does not stop for the host's
        latency at every shard.  One request beyond the level, never beyond the ceiling (lock held).

        A store that takes longer to answer than to send a shard (one that copies the whole object for every
        GET) is then asked for the next shard as soon as this one flows: it prepares one answer while it sends
        the other."""
        controller = obj.controller
        if (
            obj.state != _PREFETCHED
            or obj.dispatched
            or controller.fixed
            or controller.level != 1
            or controller.latency is None
            or not controller.in_flight <= controller.level < controller.cap
        ):
            return False
        at = self._objects.index(obj)
        before = self._objects[at - 1] if at else None
        if before is None or before.state != _ACTIVE or before.controller is not controller or before.total != 1:
            return False
        return ahead_due(before.parts[0], before.left, time.perf_counter(), controller.latency)

    def _near_end(self, obj: _Object) -> None:
        """Bytes of ``obj`` came: when the shard expected after it may send its first request ahead now, send it
        (lock held; see :meth:`_ahead`)."""
        if obj.controller.level != 1 or obj.state != _ACTIVE:
            return
        at = self._objects.index(obj) + 1
        if at < len(self._objects) and not self._objects[at].dispatched and self._ahead(self._objects[at]):
            self._pump()

    def _take(self, controller: Controller, force: bool, cap: Optional[int] = None) -> Optional[int]:
        """A place in ``controller``'s level below this reader's ceiling ``cap`` (its ticket), or None: this reader
        is woken when one is free."""
        ticket = controller.take(time.perf_counter(), force, cap)
        if ticket is None:
            controller.notify(self._wake, cap)
        return ticket

    def _wake(self) -> None:
        """A place in a level came free (perhaps given back by another reader of the host): start what waits."""
        with self._cond:
            if self._pid == os.getpid():
                self._pump()

    def _start(self, part: _Part, ticket: int) -> None:
        obj = part.obj
        obj.dispatched += 1
        obj.running += 1
        obj.peak = max(obj.peak, obj.running)
        self._running += 1
        part.ticket = ticket
        part.reserved = part.holds
        self._window[obj.host] = self._window.get(obj.host, 0) + part.reserved
        self._thread(part)

    def _resume(self, part: _Part, ticket: int) -> None:
        """Send a paused part again, for the rest of its range, at the level of now (lock held)."""
        obj = part.obj
        part.paused = False
        obj.paused -= 1
        part.began = None  # its rate is measured again from its next first byte
        obj.running += 1
        self._running += 1
        part.ticket = ticket
        self._thread(part)

    def _shed(self, controller: Controller, level: int) -> None:
        """Fewer connections were chosen for ``controller``'s host: the parts in flight beyond ``level``, those
        the readers need last, pause at the end of the piece they read (their connections close) and ask for
        the rest of their ranges when the level has room again.  Otherwise parts sent at the higher level
        would go on for as long as their ranges take, and on a host that suffers from connections every other
        connection would stay slow with them (lock held; this reader's parts only: each reader sheds its own
        when it decides)."""
        excess = controller.in_flight - level
        for obj in reversed(self._objects):
            if excess <= 0:
                return
            if obj.controller is not controller or obj.state == _CLOSED:
                continue
            for part in reversed(obj.parts[: obj.dispatched]):
                if excess <= 0:
                    break
                if (
                    part.index == 0  # its answer plans the object
                    or part.end is None
                    or part.streamed
                    or part.direct
                    or part.done
                    or part.paused
                    or part.pause
                    or part.error is not None
                    or (obj.state == _ACTIVE and obj.reading >= part.index)  # its reader is at it
                ):
                    continue
                part.pause = True
                excess -= 1
        self._cond.notify_all()

    def _thread(self, part: _Part) -> None:
        obj = part.obj
        threading.Thread(
            target=self._run, args=(part,), daemon=True, name=f"wds_cloud part {part.index} of {redact(obj.url)}"
        ).start()

    def _reserve(self, part: _Part) -> None:
        """Reserve what ``part`` can hold now (its end or cap changed)."""
        holds = part.holds
        if part.reserved != holds and not part.released:
            self._window[part.obj.host] = self._window.get(part.obj.host, 0) - part.reserved + holds
            part.reserved = holds

    def _planned(self, obj: _Object, stream: ResumableStream) -> None:
        """The first part answered: plan the rest of the object (lock held)."""
        first = obj.parts[0]
        obj.size, obj.version, obj.md5 = stream.size, stream.version, stream.md5
        if not stream.ranged:
            self._ignores_range(obj)
        if not stream.ranged and stream.read_on():
            # the answer is the whole object from its start (what came before the part was dropped): the shard is
            # this one request, read to its end, never a second one for the rest
            first.streamed = True
            first.end = max(first.start, obj.size) if obj.size is not None else None
            first.cap = obj.options.part_size
            first.limit = FIRST_SAMPLE_BYTES if obj.state == _PREFETCHED else None
        elif first.streamed:
            if obj.size is not None:
                first.end = max(first.start, obj.size)  # one request for the whole rest of the shard
        else:
            if obj.size is not None:
                first.end = max(first.start, min(first.end or 0, obj.size))
            if not stream.ranged or obj.size is None or obj.host in self._single_hosts:
                obj.single = True  # the rest, if any, as one stream (see PartedStream)
            else:
                assert first.end is not None
                obj.plan(*obj.steps(first.end, obj.controller.level))
            if obj.state == _PREFETCHED and obj.total == 1 and not obj.single:
                first.limit = (first.length or 0) // 2  # a one-part shard expected ahead: never all of it unread
        self._reserve(first)
        obj.planned = True
        if obj.controller.level > 1:
            self._split(obj)
        self._cond.notify_all()
        self._pump()

    def _ignores_range(self, obj: _Object) -> None:
        """``obj``'s host answered a ranged GET with the whole object: no further part of any shard goes to it
        (each would be the whole object again, cut off after its range).  Its shards not yet opened are read as
        one stream each; the parts planned and not yet asked for, of the shards of the host being read or
        fetched ahead, are dropped, and the rest of each such shard is one stream after the parts in flight
        (lock held)."""
        if obj.host not in self._single_hosts:
            self._single_hosts.add(obj.host)
            log.info("%s: the server ignores Range requests; reading its shards as one stream", redact(obj.url))
        for other in self._objects:
            if other.host != obj.host or other.state == _CLOSED or not other.planned or other.single:
                continue
            if other.dispatched < other.total:
                del other.parts[other.dispatched :]
                other.total = other.dispatched
                other.single = True
        self._cond.notify_all()

    def _host_report(self, obj: _Object) -> dict:
        """``obj``'s host as ``ds.stats.hosts`` shows it (:func:`_report`), and whether it ignores Range requests
        (then one stream per shard, whatever the level measured before)."""
        figures = _report(obj)
        ignores = obj.host in self._single_hosts
        figures["ignores_range"] = ignores
        if ignores:
            figures["level"] = 1
            figures["why"] = (
                "the server ignores Range requests (it answered a ranged GET with the whole object): "
                "each shard is read as one stream, one GET per shard"
            )
        return figures

    def _split(self, obj: _Object) -> None:
        """More connections were chosen while ``obj`` streams on one: its request stops a little ahead of
        where it is (what it brings while the new parts wait for their first byte) and the rest is planned
        as parts (lock held)."""
        first = obj.parts[0]
        if (
            not first.streamed
            or obj.total > 1
            or first.done
            or not obj.planned
            or obj.size is None
            or obj.host in self._single_hosts
            or first.error is not None
        ):
            return
        controller = obj.controller
        if obj.state == _PREFETCHED:  # waiting at its limit: the rest is parts, fetched ahead but the last
            at = first.start + max(first.asked_to, first.filled, first.limit or 0)
        else:
            rate = 0.0
            if first.began is not None and first.filled:
                rate = first.filled / max(1e-6, time.perf_counter() - first.began)
            ahead = int(rate * (controller.latency or 0.0))
            at = first.start + max(first.asked_to, first.filled + ahead)
        at = -(-at // CHUNK) * CHUNK  # whole pieces
        if obj.size - at < MIN_PART:
            return  # too little left to be worth new requests
        first.end = at
        first.ticket = Controller.CUT  # its last bytes come while the new parts start: no level's
        self._reserve(first)
        obj.plan(*obj.steps(at, controller.level))
        log.debug("%s: %d connections chosen; parts from byte %d", redact(obj.url), controller.level, at)

    def _decide(self, obj: _Object, now: float) -> None:
        """A measuring window of ``obj``'s host ended: the controller decides; more connections split the
        shards streaming on one, fewer pause the parts in flight beyond the level (lock held)."""
        controller = obj.controller
        # what is known to be left: the shards of the host being read, and those the reader named as coming next
        # (prefetch) at the size of those whose size is known (a stream of shards is more than the one being
        # read: counted alone, the rest of a 22 MB shard never paid for more connections at 200 MB/s)
        mine = [o for o in self._objects if o.host == obj.host and o.state != _CLOSED]
        remaining = known_left(mine)
        rate = connection_rate((p for o in mine for p in o.parts[: o.dispatched]), now)
        before = controller.level
        changed = controller.decide(now, remaining, rate, obj.options.part_size)
        self.stats.add(TransferStats(hosts={redact(obj.host): self._host_report(obj)}))
        if changed is not None:
            log.debug("%s: %d -> %d connections (%s)", redact(obj.host), before, changed, controller.reason)
            for other in self._objects:
                if other.host == obj.host:
                    if changed > before:
                        self._split(other)
                    other.replan(changed)
            if changed < before:
                self._shed(controller, changed)
            self._pump()

    def _run(self, part: _Part) -> None:
        """One part: open (pinned to the first part's version), fill it piece by piece as the reader takes."""
        obj = part.obj
        controller = obj.controller
        cond = self._cond
        stream: Optional[ResumableStream] = None
        asked = time.perf_counter()
        began = asked
        try:
            if part.index:  # pinned to what the first part saw (a resumed part: from its next byte)
                stream = obj.remote.stream(part.start + part.filled, part.end, None, version=obj.version, size=obj.size)
            else:
                stream = obj.remote.stream(part.start, part.end, None)
            began = time.perf_counter()
            controller.first_byte(began - asked)
            with cond:
                if obj.state == _CLOSED:  # cancelled while the request was on its way
                    return
                part.stream = stream
                part.began = began
                if part.index == 0:
                    self._planned(obj, stream)
                    self._offer(part)
                elif not stream.ranged:  # a host that honoured the first range ignores this one
                    self._ignores_range(obj)
                    if part.index == obj.total - 1 and obj.size is not None and stream.read_on():
                        part.end, obj.single = obj.size, False  # the rest of the shard is this answer too
                        if part.length is not None and part.length > obj.options.part_size:
                            part.cap = obj.options.part_size
                        self._reserve(part)
            while True:
                with cond:
                    while True:
                        if obj.state == _CLOSED:
                            return
                        if part.handoff:  # the reader reads the rest itself
                            part.direct = True
                            cond.notify_all()
                            return
                        at, length = part.filled, part.length
                        if part.pause and (length is None or at < length):
                            if obj.state == _ACTIVE and obj.reading >= part.index:
                                part.pause = False  # its reader came to it meanwhile: it goes on
                            else:
                                return  # fewer connections: the rest of its range waits for one (see _shed)
                        if length is not None and at >= length:
                            break
                        # full: wait until the reader has taken half of what it holds (see _Part.room)
                        if (part.limit is not None and at >= part.limit) or not part.room():
                            part.blocked = True
                            cond.wait()
                            continue
                        break
                    part.blocked = False
                    if length is not None and at >= length:
                        break
                    # pieces grow from FIRST_PIECE to CHUNK, and to BIG_CHUNK while the reader has bytes to take
                    want = min(CHUNK if at - part.taken < CHUNK else BIG_CHUNK, max(FIRST_PIECE, at))
                    if controller.trying_more:
                        # a trial level is judged on pieces: small ones end it soon when it is slower (on a host
                        # that suffers from connections, a 1 MB piece at 1 MB/s held a trial for seconds)
                        want = min(want, FIRST_PIECE)
                    if length is not None:
                        want = min(want, length - at)
                    if part.limit is not None:
                        want = min(want, part.limit - at)
                    if part.cap is not None:
                        want = min(want, part.cap - (at - part.taken))
                    part.asked_to = at + want
                buf = bytearray(want)
                n = stream.readinto(buf)
                if not n:
                    if part.length is None:  # streamed to an end no header told: the object ends here
                        break
                    raise TransferError(
                        f"{redact(obj.url)}: the part [{part.start}, {part.end}) ended at byte {part.start + at}",
                        url=obj.url,
                        offset=part.start + at,
                    )
                now = time.perf_counter()
                with cond:
                    part.chunks.append(memoryview(buf) if n == want else memoryview(buf)[:n])
                    part.filled = at + n
                    obj.received += n
                    controller.received(n, now, part.ticket)
                    cond.notify_all()
                    if obj.deferred and part.filled >= FIRST_SAMPLE_BYTES:
                        obj.deferred = False
                        self._pump()
                    self._near_end(obj)
                    if controller.due(now):
                        self._decide(obj, now)
        except BaseException as exc:
            with cond:
                if obj.state != _CLOSED:
                    part.error = exc
                    if part.index == 0 and not obj.planned:
                        obj.planned = True  # nothing to plan: the error is the answer
        finally:
            part.asked = asked
            if part.began is None:
                part.began = began
            if not part.direct:
                self._finished(part, stream)

    def _finished(self, part: _Part, stream: Optional[ResumableStream]) -> None:
        """``part``'s request is over (read, failed, cancelled or cut short): its connection closes or goes back
        to the pool, its figures are counted, its place in the level is free (lock not held)."""
        obj = part.obj
        finished = time.perf_counter()
        began = part.began if part.began is not None else finished
        figures = TransferStats(
            requests=1, first_byte_seconds=began - part.asked, part_bytes=part.filled, part_seconds=finished - began
        )
        if stream is not None:
            stream.close()
            figures.bytes, figures.retries = stream.stats.bytes, stream.stats.retries
            figures.bytes_refetched, figures.time_lost = stream.stats.bytes_refetched, stream.stats.time_lost
        self.stats.add(figures)
        with self._cond:
            obj.deferred = False
            if (
                part.pause
                and part.error is None
                and obj.state != _CLOSED
                and part.end is not None
                and part.filled < part.end - part.start
            ):
                part.paused = True  # the rest of its range waits for a connection (see _shed)
                obj.paused += 1
            else:
                if part.end is None:
                    part.end = part.start + part.filled  # streamed to its end: the object's end
                part.done = True
            part.pause = False
            part.stream = None
            self._running -= 1
            obj.controller.give(finished)
            obj.running -= 1
            self._cond.notify_all()
            self._pump()

    def _offer(self, part: _Part) -> None:
        """Ask ``part``'s filler to hand its stream to the reader when the shard is read on one connection
        (lock held)."""
        obj = part.obj
        if (
            part.streamed
            and part.index == 0
            and obj.state == _ACTIVE
            and obj.total == 1
            and not part.done
            and part.limit is None
            and obj.controller.level == 1
            and not obj.controller.fixed
        ):
            part.handoff = True
            self._cond.notify_all()

    def _release(self, part: _Part) -> None:
        if not part.released:
            part.released = True
            self._window[part.obj.host] = self._window.get(part.obj.host, 0) - part.reserved
            part.chunks.clear()

    def _cancel(self, obj: _Object) -> None:
        """Stop reading ``obj``: its connections close, its memory is given back (lock held)."""
        if obj.state == _CLOSED:
            return
        obj.state = _CLOSED
        if obj in self._objects:
            self._objects.remove(obj)
        for part in obj.parts[: obj.dispatched]:
            self._release(part)
            if part.stream is not None and not part.done:
                part.stream.abort()
        self._cond.notify_all()
        self._pump()


def _report(obj: Any) -> dict:
    """The host's report (``ds.stats.hosts``) as this reader sees it: under its own ceiling."""
    report = obj.controller.report()
    cap = obj.cap
    if cap is not None and not report.get("pinned") and cap < report["cap"]:
        report["cap"] = cap
        if report["level"] > cap:
            report["level"] = cap
            report["why"] = (
                f"{cap} connections: this dataset's max_concurrency (the host's level is {obj.controller.level})"
            )
    return report


def known_left(objects: Sequence[Any]) -> int:
    """The bytes known to be left of ``objects`` (the shards of one host being read or named as coming next: each
    has ``left``, ``size`` and ``state``): what is left of those whose size is known, and a shard named ahead whose
    size is not known yet at the mean size of those (nothing when no size is known)."""
    sizes = [o.size for o in objects if o.size is not None]
    expected = sum(1 for o in objects if o.size is None and o.state == _PREFETCHED)
    return sum(o.left or 0 for o in objects) + (expected * (sum(sizes) // len(sizes)) if sizes else 0)


def ahead_due(request: Any, left: Optional[int], now: float, latency: float) -> bool:
    """Whether what is ``left`` of a shard read on one ``request`` (a part: ``began``, ``filled``, ``done``)
    arrives within ``latency`` seconds at the rate that request has brought its bytes so far (see
    :meth:`Fetcher._ahead`); False before its first bytes, or while its size is not known."""
    if left is None or request.began is None or not request.filled or request.done:
        return False
    return left * max(0.0, now - request.began) <= latency * request.filled


def connection_rate(parts: Iterable[Any], now: float) -> Optional[float]:
    """Bytes per second one connection carries while a body flows, from ``parts`` (those in flight; each with
    ``began``, ``filled``, ``done``, ``blocked``): the bytes of those flowing over the time they flowed, or None
    while none has.  A part counts once its first piece (:data:`FIRST_PIECE`) is in: the few hundred bytes a
    reader takes first (a shard's first header), over the moment since the answer came, said 0.3 MB/s for a link
    that carried 500 MB/s, and more connections then seemed to pay on a store where each costs a whole object."""
    carried = seconds = 0.0
    for p in parts:
        if p.began is not None and not p.done and not p.blocked and now > p.began and p.filled >= FIRST_PIECE:
            carried += p.filled
            seconds += now - p.began
    return carried / seconds if carried and seconds else None


def _load_plugins() -> None:
    """Load the storage plugins now, in the process that builds the dataset: DataLoader workers forked
    from it then find them loaded, instead of each importing them before its first shard.  Best effort:
    a plugin problem is reported when a shard is opened, as it would be without this."""
    try:
        get_registry(config.current())
    except Exception:
        pass


def _host(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class PartedStream:
    """The parts of one shard, in order, as one binary stream (see :class:`Fetcher`)."""

    def __init__(self, obj: _Object, fetcher: Fetcher) -> None:
        self._obj = obj
        self._fetcher = fetcher
        self._index = 0  # the part being read
        self._tail: Optional[ResumableStream] = None
        self.url = obj.url
        self.position = obj.start
        self.closed = False
        self.size: Optional[int] = None
        self.version: Optional[str] = None
        self.md5: Optional[str] = None

    def wait_planned(self) -> None:
        """Wait for the first part's answer; raise its error (a missing object, refused credentials)."""
        obj = self._obj
        first = obj.parts[0]
        with self._fetcher._cond:
            while not obj.planned:
                self._fetcher._cond.wait()
        if first.error is not None and first.filled == 0:
            raise first.error
        self.size, self.version, self.md5 = obj.size, obj.version, obj.md5

    def readable(self) -> bool:
        return True

    def _source(self, limit: int) -> tuple[Optional[memoryview], Optional[_Part], int]:
        """Where the next bytes come from: ``(piece, None, 0)``, a piece of at most ``limit`` bytes taken
        from a part (the position is not moved yet); ``(None, part, n)``, a part its reader reads itself,
        ``n`` bytes at most (0: its end is reached); ``(None, None, 0)``: no part is left."""
        obj = self._obj
        fetcher = self._fetcher
        cond = fetcher._cond
        waited: Optional[float] = None
        try:
            with cond:
                while True:
                    if obj.state == _CLOSED:
                        raise ValueError(f"read of a closed stream ({redact(self.url)})")
                    if self._index >= obj.total:
                        return None, None, 0
                    part = obj.part(self._index)
                    chunks = part.chunks
                    if chunks:
                        head = chunks[0]
                        if len(head) <= limit:
                            piece = chunks.popleft()
                        else:
                            piece, chunks[0] = head[:limit], head[limit:]
                        part.taken += len(piece)
                        if part.blocked and part.room():
                            cond.notify_all()  # its filler waits for room
                        return piece, None, 0
                    if part.error is not None:
                        raise part.error
                    if part.done:
                        fetcher._release(part)
                        self._index += 1
                        obj.reading = self._index
                        fetcher._pump()
                        continue
                    if part.direct:
                        length = part.length
                        left = limit if length is None else min(limit, length - part.taken)
                        part.asked_to = part.taken + left  # a split never cuts below this read
                        return None, part, left
                    if waited is None:
                        waited = time.perf_counter()
                    cond.wait()
        finally:
            if waited is not None:  # the reader waited for bytes: what the controller grows on
                obj.controller.waited(time.perf_counter() - waited)

    def _direct(self, part: _Part, limit: int, into: Optional[memoryview]) -> Any:
        """Read up to ``limit`` bytes of ``part`` straight from its connection (into ``into`` when given):
        the bytes (or their count); None at the end of a stream whose size no header told."""
        obj = self._obj
        stream = part.stream
        assert stream is not None
        asked = time.perf_counter()
        if into is None:
            data: Any = stream.read(limit)
            n = len(data)
        else:
            data = n = stream.readinto(into[:limit])
        now = time.perf_counter()
        controller = obj.controller
        controller.waited(now - asked)  # time in the read is time the reader waited for the link
        if not n:
            if part.length is not None:
                raise TransferError(
                    f"{redact(obj.url)}: the body ended at byte {part.start + part.taken} of {obj.size}",
                    url=obj.url,
                    offset=part.start + part.taken,
                )
            self._fetcher._finished(part, stream)
            return None
        cond = self._fetcher._cond
        with cond:
            part.filled += n
            part.taken += n
            obj.received += n
            controller.received(n, now, part.ticket)
            if obj.deferred and part.filled >= FIRST_SAMPLE_BYTES:
                obj.deferred = False  # the next shard may be asked for now
                self._fetcher._pump()
            self._fetcher._near_end(obj)
            if controller.due(now):
                self._fetcher._decide(obj, now)
        self.position += n
        return data

    def _piece(self, limit: int) -> memoryview:
        """Up to ``limit`` bytes past the read position, as a view of the piece holding them (empty at
        the end of the object); the position advances past them."""
        obj = self._obj
        while self._tail is None:
            piece, part, left = self._source(limit)
            if piece is not None:
                self.position += len(piece)
                return piece
            if part is None:
                if not obj.single or (obj.size is not None and self.position >= obj.size):
                    return memoryview(b"")
                self._tail = obj.remote.stream(
                    self.position, None, self._fetcher.stats, version=obj.version, size=obj.size
                )
                self._tail.stats.streams = 0  # the rest of this shard: one more request, not one more stream
                break
            if left <= 0:  # its end (where the rest was split into parts) is reached
                self._fetcher._finished(part, part.stream)
                continue
            data = self._direct(part, left, None)
            if data is not None:
                return memoryview(data)
        data = self._tail.read(limit)
        self.position += len(data)
        return memoryview(data)

    def readinto(self, buffer: Any) -> int:
        """Fill ``buffer``; fewer bytes only at the end of the object (a part read directly reads into it)."""
        view = memoryview(buffer).cast("B")
        have = 0
        while have < len(view):
            if self._tail is None:
                piece, part, left = self._source(len(view) - have)
                if piece is not None:
                    view[have : have + len(piece)] = piece
                    have += len(piece)
                    self.position += len(piece)
                    continue
                if part is not None:
                    if left <= 0:
                        self._fetcher._finished(part, part.stream)
                        continue
                    n = self._direct(part, left, view[have:])
                    have += n or 0
                    continue
            piece = self._piece(len(view) - have)  # the end, or the rest of a shard read as one stream
            if not len(piece):
                break
            view[have : have + len(piece)] = piece
            have += len(piece)
        return have

    def read(self, size: int = -1) -> bytes:
        """``size`` bytes (all that is left when negative); fewer only at the end (copied once from the parts)."""
        if size is None or size < 0:
            return read_to_end(self.read)
        pieces: list[bytes] = []
        want = size
        while want > 0:
            piece = self._piece(want)
            if not len(piece):
                break
            whole = piece.obj  # a read straight from the connection: its bytes as they are, not copied again
            pieces.append(whole if type(whole) is bytes and piece.nbytes == len(whole) else bytes(piece))
            want -= len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._tail is not None:
            self._tail.close()
        obj = self._obj
        with self._fetcher._cond:
            self._fetcher._cancel(obj)
            direct = [p for p in obj.parts if p.direct and not p.done]
        for part in direct:  # read by this reader: its request ends here
            self._fetcher._finished(part, part.stream)
        self._fetcher.stats.add(
            TransferStats(
                streams=1,
                seconds=time.perf_counter() - obj.created,
                concurrency=obj.peak,
                hosts={redact(obj.host): self._fetcher._host_report(obj)},
            )
        )

    def __del__(self) -> None:  # a stream dropped unclosed gives its connections and memory back
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> PartedStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<PartedStream {redact(self.url)} at {self.position}>"
