"""Parallel ranged reads: a remote shard fetched as parts on several connections, the next shards ahead.

Over a distant link one connection carries tens of MB/s and every request waits for its first
byte, so one stream per shard leaves most of the link idle.  A :class:`Fetcher` (one per dataset
and process) reads a shard as byte ranges ("parts") on several connections at once and hands them
to the tar reader in order as one stream (:class:`PartedStream`):

- the first part is asked for at once (``part_size / 2`` bytes); its answer tells the size and
  version, and the rest is split into parts of at most ``part_size`` (at least as many as there are
  connections, down to 1 MiB).  A shard no longer than the first part is read with one request;
  a store that ignores ``Range`` is read as one stream after the first part, and so is every later
  shard of that host;
- every part is a :class:`~wds_cloud.io.resilient.ResumableStream` pinned to the version of the
  first part: a fault resumes that part at its next unread byte, and an object replaced between
  parts raises :class:`~wds_cloud.errors.ObjectChangedError`, never a splice;
- at most ``concurrency`` parts are in flight and at most ``concurrency x part_size`` bytes are held
  (parts wait in memory only until the reader takes them);
- ``prefetch(urls)`` names the shards that come next (the reader knows them after shuffling and
  splitting): their parts are requested with the connections the current shard leaves free, except
  the last part of each (or the second half, for a one-part shard), so a shard that is never read is
  never downloaded whole; a shard dropped from the list, or left when the reader stops, is cancelled
  and its connections closed;
- without a fixed ``concurrency``, it starts at 8 parts in flight and grows while the bytes per second
  of all parts together grow (by 5% or more over a round of as many parts), up to ``max_concurrency``.

Settings (the dataset's arguments, else the profile of the URL, else the environment):
``part_size`` (``WDS_PART_SIZE``, 8 MiB), ``concurrency`` (``WDS_CONCURRENCY``; 1 turns parts off),
``max_concurrency`` (``WDS_MAX_CONCURRENCY``, 16), ``prefetch`` (``WDS_PREFETCH``, 1 shard ahead).
Local files, pipes and backends without ranged reads are opened as before, one stream each.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import urllib.parse
from typing import Any, Mapping, Optional, Sequence

from .. import config
from ..config import Settings
from ..errors import ConfigError, TransferError, redact
from . import profiles
from .backend import read_to_end
from .open import RemoteObject, gopen, remote_object
from .registry import get_registry
from .resilient import ResumableStream, StatsSink, TransferStats

__all__ = ["TransferOptions", "Fetcher", "PartedStream", "plan_parts", "part_step"]

log = logging.getLogger("wds_cloud.parallel")

#: a part's bytes become readable in pieces of this size (the first sample does not wait for a whole part);
#: the first pieces of a part are smaller (from FIRST_PIECE, doubling), so the first bytes come sooner
CHUNK = 256 << 10
FIRST_PIECE = 64 << 10
#: a shard opened cold (not fetched ahead) asks for its other parts once this much of the first part
#: has come: the first sample arrives as fast as over one stream, not sharing the link with them
FIRST_SAMPLE_BYTES = 1 << 20
#: parts are not split finer than this to use more connections (unless ``part_size`` is smaller)
MIN_PART = 1 << 20
#: where an adaptive concurrency starts
START_CONCURRENCY = 8


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    """How one shard is fetched (see the module docstring)."""

    part_size: int = 8 << 20
    concurrency: Optional[int] = None
    max_concurrency: int = 16
    prefetch: int = 1

    @classmethod
    def resolve(cls, settings: Settings, *layers: Mapping[str, Any]) -> "TransferOptions":
        """The environment's settings, overridden by each of ``layers`` in turn (a profile, the dataset)."""
        values: dict[str, Any] = {"part_size": settings.part_size, "concurrency": settings.concurrency,
                                  "max_concurrency": settings.max_concurrency, "prefetch": settings.prefetch}
        for layer in layers:
            for key, value in layer.items():
                if value is not None:
                    values[key] = _checked(key, value)
        return cls(**values)

    @property
    def first_part(self) -> int:
        """The length of the first request (the whole of a shard no longer than it)."""
        return max(1, self.part_size // 2)

    @property
    def parallel(self) -> bool:
        return self.concurrency != 1


def _checked(key: str, value: Any) -> Any:
    if key == "part_size":
        return config.parse_positive_size(key, value)
    if key not in ("concurrency", "max_concurrency", "prefetch"):
        raise ConfigError(f"{key!r} is not a transfer setting: use part_size, concurrency, max_concurrency or prefetch")
    least = 0 if key == "prefetch" else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{key}={value!r} must be a whole number of at least {least}")
    return value


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
    __slots__ = ("obj", "index", "start", "end", "limit", "buf", "filled", "error", "done", "stream",
                 "reserved", "released")

    def __init__(self, obj: "_Object", index: int, start: int, end: int) -> None:
        self.obj = obj
        self.index = index
        self.start = start
        self.end = end
        self.limit = end - start  # bytes it may fill now (less while a one-part shard is only prefetched)
        self.buf: Optional[bytearray] = None
        self.filled = 0
        self.error: Optional[BaseException] = None
        self.done = False
        self.stream: Optional[ResumableStream] = None
        self.reserved = 0  # bytes of the window it holds
        self.released = False

    @property
    def length(self) -> int:
        return self.end - self.start


class _Object:
    """One shard being read (or expected): its parts, in order, made lazily from the plan (a server's claim of
    the object's size decides how many there are, never how much memory is taken before bytes arrive)."""

    def plan(self, step: int, count: int) -> None:
        self._step = step
        self.total = 1 + count

    def part(self, index: int) -> _Part:
        """Part ``index`` (< ``total``), made with those before it when first asked for."""
        while len(self.parts) <= index:
            i = len(self.parts)
            begin = self.parts[0].end + (i - 1) * self._step
            end = begin + self._step
            if self.size is not None:
                end = min(end, self.size)
            self.parts.append(_Part(self, i, begin, end))
        return self.parts[index]

    def __init__(self, url: str, remote: RemoteObject, options: TransferOptions, start: int, state: str) -> None:
        self.url = url
        self.remote = remote
        self.start = start
        self.options = options
        self.state = state
        self.size: Optional[int] = None
        self.version: Optional[str] = None
        self.md5: Optional[str] = None
        self.planned = False
        self.single = False  # the store ignored Range: the rest is read as one stream
        self.deferred = state == _ACTIVE  # opened cold: the other parts wait for the first sample's bytes
        self.parts = [_Part(self, 0, start, start + options.first_part)]  # made as they are needed
        self.total = 1  # parts planned, made or not
        self._step = 0
        self.dispatched = 0
        self.reading = 0  # the part its reader is at
        self.peak = 0  # the most of its parts in flight at once
        self.running = 0
        self.created = time.perf_counter()


class _Tuner:
    """Parts in flight: fixed, or grown while the aggregate bytes per second grow."""

    def __init__(self, fixed: Optional[int], cap: int) -> None:
        self.fixed = fixed is not None
        self.concurrency = fixed if fixed is not None else min(START_CONCURRENCY, cap)
        self.cap = cap
        self.frozen = self.fixed or self.concurrency >= cap
        self._best = 0.0
        self._since: Optional[float] = None
        self._bytes = 0
        self._parts = 0

    def started(self, now: float) -> None:
        if self._since is None:
            self._since = now

    def finished(self, nbytes: int, now: float) -> None:
        if self.frozen or self._since is None:
            return
        self._bytes += nbytes
        self._parts += 1
        if self._parts < self.concurrency or now <= self._since:
            return
        rate = self._bytes / (now - self._since)
        if rate > self._best * 1.05:
            self._best = rate
            self.concurrency = min(self.cap, self.concurrency + max(1, self.concurrency // 2))
            self.frozen = self.concurrency >= self.cap
            log.debug("parallel reads: %.1f MB/s, now %d parts in flight", rate / 1e6, self.concurrency)
        else:
            self.frozen = True
        self._since, self._bytes, self._parts = now, 0, 0


class Fetcher:
    """Opens shards for a dataset: parallel ranged reads for remote objects, and the next shards ahead.

    ``open(url, offset)`` returns a binary stream; ``prefetch(urls)`` names the shards that come next.
    One per dataset stage and process: a forked DataLoader worker starts with none of its parent's
    connections, and a pickled one (a spawned worker) carries only its settings.
    """

    def __init__(self, storage_options: Optional[dict] = None, retries: Optional[int] = None,
                 timeout: Optional[float] = None, stats: Optional[StatsSink] = None, **given: Any) -> None:
        self.storage_options = storage_options
        self.retries = retries
        self.timeout = timeout
        self.stats = stats if stats is not None else StatsSink()
        self.given = {key: _checked(key, value) for key, value in given.items() if value is not None}
        self._reset()
        _load_plugins()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._objects: list[_Object] = []  # the shards being read, then those expected, in order
        self._in_flight = 0
        self._window = 0
        self._tuner: Optional[_Tuner] = None
        self._single_hosts: set[str] = set()

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    def _here(self) -> None:
        if self._pid != os.getpid():  # a forked worker: the parent's threads and locks are not ours
            self._reset()

    @property
    def in_flight(self) -> int:
        """Parts being downloaded now."""
        with self._cond:
            return self._in_flight

    @property
    def held(self) -> int:
        """Bytes of part buffers held now (requested and not yet read): at most ``concurrency x part_size``."""
        with self._cond:
            return self._window

    # settings
    def options(self, url: str) -> TransferOptions:
        settings = config.current()
        return TransferOptions.resolve(settings, profiles.transfer_for(url, settings), self.given)

    @property
    def depth(self) -> int:
        """How many of the next shards are fetched ahead (``prefetch``)."""
        prefetch = self.given.get("prefetch")
        return prefetch if prefetch is not None else config.current().prefetch

    def _remote(self, url: str) -> Optional[tuple[RemoteObject, TransferOptions]]:
        """The object and its settings when ``url`` is read in parts (None: one stream, through gopen)."""
        remote = remote_object(url, storage_options=self.storage_options, retries=self.retries,
                               timeout=self.timeout)
        if remote is None or not remote.ranged or _host(remote.url) in self._single_hosts:
            return None
        options = self.options(url)
        return (remote, options) if options.parallel else None

    # opening
    def open(self, url: str, offset: int = 0) -> Any:
        """A stream of ``url`` from byte ``offset``: parts in parallel where the backend allows."""
        self._here()
        with self._cond:
            expected = [o for o in self._objects if o.state == _PREFETCHED]
            obj = next((o for o in expected if o.url == url and o.start == offset), None)
            for other in expected[:expected.index(obj)] if obj is not None else expected:
                self._cancel(other)  # the order went another way: what was fetched ahead of it is dropped
            if obj is not None:
                self._activate(obj)
        if obj is None:
            found = self._remote(url)
            if found is None:
                return gopen(url, "rb", offset=offset, storage_options=self.storage_options, retries=self.retries,
                             timeout=self.timeout, stats=self.stats)
            obj = _Object(url, *found, offset, _ACTIVE)
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
            part.limit = part.length
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
                fresh[url] = _Object(url, *found, 0, _PREFETCHED)
        with self._cond:
            for obj in list(self._objects):
                if obj.state == _PREFETCHED and obj.url not in wanted:
                    self._cancel(obj)
            current = {o.url: o for o in self._objects if o.state == _PREFETCHED}
            current.update(fresh)
            self._objects = [o for o in self._objects if o.state == _ACTIVE] + [
                current[u] for u in wanted if u in current]
            self._pump()

    def close(self) -> None:
        """Cancel every shard expected or being read here."""
        with self._cond:
            for obj in list(self._objects):
                self._cancel(obj)

    # scheduling (called with the lock held)
    def _tune(self, options: TransferOptions) -> _Tuner:
        if self._tuner is None:
            self._tuner = _Tuner(options.concurrency, options.max_concurrency)
        return self._tuner

    def _pump(self) -> None:
        """Start parts in reading order while connections and window allow."""
        for obj in self._objects:
            if obj.state == _CLOSED:
                continue
            tuner = self._tune(obj.options)
            budget = tuner.concurrency * obj.options.part_size
            while obj.dispatched < obj.total:
                if obj.dispatched and (not obj.planned or obj.deferred):
                    break
                part = obj.part(obj.dispatched)
                if obj.state == _PREFETCHED and part.index and part.index == obj.total - 1:
                    break  # an expected shard's last part waits until the shard is read
                waited_on = obj.state == _ACTIVE and obj.reading >= part.index  # its reader waits for it
                if not waited_on and (self._in_flight >= tuner.concurrency
                                      or (self._window and self._window + part.length > budget)):
                    return
                self._start(part, tuner)
            if obj.deferred:
                return  # nothing after it starts before its first sample's bytes are in

    def _start(self, part: _Part, tuner: _Tuner) -> None:
        obj = part.obj
        obj.dispatched += 1
        part.reserved = part.length
        self._window += part.reserved
        self._in_flight += 1
        obj.running += 1
        obj.peak = max(obj.peak, obj.running)
        tuner.started(time.perf_counter())
        threading.Thread(target=self._run, args=(part, tuner), daemon=True,
                         name=f"wds_cloud part {part.index} of {redact(obj.url)}").start()

    def _planned(self, obj: _Object, stream: ResumableStream) -> None:
        """The first part answered: plan the rest of the object (lock held)."""
        first = obj.parts[0]
        obj.size, obj.version, obj.md5 = stream.size, stream.version, stream.md5
        if obj.size is not None:
            first.end = max(first.start, min(first.end, obj.size))
        if not stream.ranged or obj.size is None:
            obj.single = True  # the rest, if any, as one stream (see PartedStream)
            if not stream.ranged:
                self._single_hosts.add(_host(obj.remote.url))
                log.info("%s: the server ignores Range requests; reading its shards as one stream",
                         redact(obj.url))
        else:
            tuner = self._tune(obj.options)
            obj.plan(*part_step(first.end, obj.size, obj.options.part_size, tuner.concurrency))
        self._window -= first.reserved - first.length
        first.reserved = first.length
        first.limit = first.length
        if obj.state == _PREFETCHED and obj.total == 1 and not obj.single:
            first.limit = first.length // 2  # a one-part shard expected ahead: never all of it unread
        obj.planned = True
        self._cond.notify_all()
        self._pump()

    def _run(self, part: _Part, tuner: _Tuner) -> None:
        """One part: open (pinned to the first part's version), fill its buffer piece by piece."""
        obj = part.obj
        cond = self._cond
        stream: Optional[ResumableStream] = None
        asked = time.perf_counter()
        began = asked
        try:
            if part.index:  # pinned to what the first part saw
                stream = obj.remote.stream(part.start, part.end, None, version=obj.version, size=obj.size)
            else:
                stream = obj.remote.stream(part.start, part.end, None)
            began = time.perf_counter()
            with cond:
                if obj.state == _CLOSED:  # cancelled while the request was on its way
                    return
                part.stream = stream
                if part.index == 0:
                    self._planned(obj, stream)
            buf = part.buf = bytearray(part.length)
            view = memoryview(buf)
            while part.filled < part.length:
                with cond:
                    while part.filled >= part.limit and obj.state == _PREFETCHED:
                        cond.wait()
                    if obj.state == _CLOSED:
                        return
                at = part.filled
                n = stream.readinto(view[at:min(part.length, at + min(CHUNK, max(FIRST_PIECE, at)))])
                if not n:
                    raise TransferError(f"{redact(obj.url)}: the part [{part.start}, {part.end}) ended at byte "
                                        f"{part.start + at}", url=obj.url, offset=part.start + at)
                with cond:
                    part.filled = at + n
                    cond.notify_all()
                    if obj.deferred and part.filled >= FIRST_SAMPLE_BYTES:
                        obj.deferred = False
                        self._pump()
        except BaseException as exc:
            with cond:
                if obj.state != _CLOSED:
                    part.error = exc
                    if part.index == 0 and not obj.planned:
                        obj.planned = True  # nothing to plan: the error is the answer
        finally:
            finished = time.perf_counter()
            figures = TransferStats(requests=1, first_byte_seconds=began - asked, part_bytes=part.filled,
                                    part_seconds=finished - began)
            if stream is not None:
                stream.close()
                figures.bytes, figures.retries = stream.stats.bytes, stream.stats.retries
                figures.bytes_refetched, figures.time_lost = stream.stats.bytes_refetched, stream.stats.time_lost
            self.stats.add(figures)
            with cond:
                tuner.finished(part.filled, finished)
                obj.deferred = False
                part.done = True
                part.stream = None
                self._in_flight -= 1
                obj.running -= 1
                cond.notify_all()
                self._pump()

    def _release(self, part: _Part) -> None:
        if not part.released:
            part.released = True
            self._window -= part.reserved
            part.buf = None

    def _cancel(self, obj: _Object) -> None:
        """Stop reading ``obj``: its connections close, its memory is given back (lock held)."""
        if obj.state == _CLOSED:
            return
        obj.state = _CLOSED
        if obj in self._objects:
            self._objects.remove(obj)
        for part in obj.parts[:obj.dispatched]:
            self._release(part)
            if part.stream is not None and not part.done:
                part.stream.abort()
        self._cond.notify_all()
        self._pump()


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
        self._index = 0
        self._at = 0  # within the current part
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

    def _piece(self, limit: int) -> memoryview:
        """Up to ``limit`` bytes past the read position, as a view of the buffer holding them (empty at
        the end of the object); the position advances past them."""
        obj = self._obj
        if self._tail is None:
            cond = self._fetcher._cond
            with cond:
                while True:
                    if obj.state == _CLOSED:
                        raise ValueError(f"read of a closed stream ({redact(self.url)})")
                    if self._index >= obj.total:
                        break
                    part = obj.part(self._index)
                    if part.filled > self._at:
                        n = min(limit, part.filled - self._at)
                        buf = part.buf
                        break
                    if part.error is not None:
                        raise part.error
                    if part.done and self._at >= part.length:
                        self._fetcher._release(part)
                        self._index += 1
                        obj.reading = self._index
                        self._at = 0
                        self._fetcher._pump()
                        continue
                    cond.wait()
            if self._index < obj.total:
                assert buf is not None
                piece = memoryview(buf)[self._at:self._at + n]
                self._at += n
                self.position += n
                return piece
            if not obj.single or (obj.size is not None and self.position >= obj.size):
                return memoryview(b"")
            self._tail = obj.remote.stream(self.position, None, self._fetcher.stats, version=obj.version,
                                           size=obj.size)
            self._tail.stats.streams = 0  # the rest of this shard: one more request, not one more stream
        data = self._tail.read(limit)
        self.position += len(data)
        return memoryview(data)

    def readinto(self, buffer: Any) -> int:
        """Fill ``buffer``; fewer bytes only at the end of the object."""
        view = memoryview(buffer).cast("B")
        have = 0
        while have < len(view):
            piece = self._piece(len(view) - have)
            if not len(piece):
                break
            view[have:have + len(piece)] = piece
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
            pieces.append(bytes(piece))
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
        self._fetcher.stats.add(TransferStats(streams=1, seconds=time.perf_counter() - obj.created,
                                              concurrency=obj.peak))

    def __del__(self) -> None:  # a stream dropped unclosed gives its connections and memory back
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "PartedStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<PartedStream {redact(self.url)} at {self.position}>"
