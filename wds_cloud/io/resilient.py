"""Read streams that survive faults: resume at the next unread byte, pinned to the version first read.

A :class:`ResumableStream` wraps a backend's streaming read.  When the
connection is reset, stalls past the read timeout, ends before the size the
first response announced, or the store answers 5xx / 429 / ``SlowDown``, it
reopens the object **at the next unread byte** with a Range request, after a
bounded exponential backoff with jitter.  The resumed request is pinned to the
version first read (``If-Match`` on the ETag, ``If-Unmodified-Since`` on the
``Last-Modified`` date of a server without ETags, the GCS generation, the Azure
ETag), and every answer's version and size are compared with the first's (a
server may ignore the condition): if the object was replaced meanwhile,
:class:`ObjectChangedError` is raised instead of splicing two versions.  The
reader above sees one continuous byte stream, so no sample is lost and none is
repeated.  Where the store names no version at all (neither an ETag nor a date),
only a change of size can be seen.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from .. import config
from ..errors import (
    CredentialsError,
    ObjectChangedError,
    ShardNotFoundError,
    TransferError,
    WdsCloudError,
    redact,
)

__all__ = ["RetryPolicy", "TransferStats", "ResumableStream", "is_transient"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How hard to try: ``attempts`` opens per fault (the first included), backoff bounds, read timeout."""

    attempts: int = 6
    backoff: float = 0.2
    max_backoff: float = 5.0
    timeout: float = 60.0

    def __post_init__(self) -> None:
        # the ranges of WDS_RETRY_BACKOFF and WDS_RETRY_TIMEOUT, whoever builds the policy: a negative backoff
        # was a raw ValueError from time.sleep on the first 503, a negative timeout was reported as a request
        # header holding a newline, an infinite one a raw OverflowError; checked here, each names its setting
        for field, bound in _POLICY_BOUNDS.items():
            config.check_setting(f"RetryPolicy {field}", getattr(self, field), bound=bound)

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Exponential backoff with full jitter, capped at ``max_backoff`` (or ``backoff`` where that is longer:
        the first delay asked for is kept)."""
        cap = max(self.max_backoff, self.backoff)
        return rng.uniform(0, min(cap, self.backoff * 2.0 ** min(attempt - 1, 64)))


_POLICY_BOUNDS = {
    "attempts": config.Bound("count", 1, 1000, "attempts"),
    "backoff": config.BOUNDS["WDS_RETRY_BACKOFF"],
    "max_backoff": config.Bound("seconds", 0, 3600, "max_backoff"),
    "timeout": config.BOUNDS["WDS_RETRY_TIMEOUT"],
}


@dataclasses.dataclass
class TransferStats:
    """Transfer figures of one stream, or summed over a dataset's streams (see ``WebDataset.stats``).

    ``streams`` counts remote shards read (each read whole by one GET, or as ranged parts), ``requests`` the
    GETs made for them (one per stream read whole, one per part; reopening after a fault counts in
    ``retries``), ``bytes``/``seconds`` what they carried and took.  Local files are not transfers: they
    count in ``local_files`` and ``local_bytes`` (what was there to read from the offset opened at).
    """

    streams: int = 0
    bytes: int = 0
    seconds: float = 0.0
    retries: int = 0
    bytes_refetched: int = 0
    time_lost: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    #: shards fetched again after the cache evicted them before their reuse (it thrashes: see docs/cache.md)
    cache_reuse_misses: int = 0
    bytes_saved: int = 0
    #: parallel ranged reads: requests made for parts (retries not counted), the sum of their times to
    #: the first byte, the bytes and seconds of their bodies, and the most parts in flight at once
    requests: int = 0
    first_byte_seconds: float = 0.0
    part_bytes: int = 0
    part_seconds: float = 0.0
    concurrency: int = 0
    #: local shard files opened, and their bytes from where they were opened
    local_files: int = 0
    local_bytes: int = 0
    #: parallel ranged reads, per host: the connections chosen and why (see :mod:`wds_cloud.io.concurrency`):
    #: ``{host: {"level", "why", "waiting", "latency", "rates", "cap", "pinned"}}``, the latest of each
    hosts: dict = dataclasses.field(default_factory=dict)

    def add(self, other: TransferStats) -> None:
        for field in dataclasses.fields(self):
            if field.name == "concurrency":
                self.concurrency = max(self.concurrency, other.concurrency)
            elif field.name == "hosts":
                self.hosts.update(other.hosts)
            else:
                setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    @property
    def rate(self) -> float:
        """Bytes per second of the transfers counted."""
        return self.bytes / self.seconds if self.seconds else 0.0

    @property
    def first_byte(self) -> float:
        """Mean seconds from a part's request to its first byte (the link's latency as seen)."""
        return self.first_byte_seconds / self.requests if self.requests else 0.0

    @property
    def connection_rate(self) -> float:
        """Mean bytes per second one connection carried while a part's body flowed."""
        return self.part_bytes / self.part_seconds if self.part_seconds else 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class StatsSink:
    """A thread-safe running total of :class:`TransferStats`."""

    def __init__(self) -> None:
        self.total = TransferStats()
        self._lock = threading.Lock()

    def add(self, stats: TransferStats) -> None:
        with self._lock:
            self.total.add(stats)

    def snapshot(self) -> TransferStats:
        with self._lock:
            return dataclasses.replace(self.total, hosts={k: dict(v) for k, v in self.total.hosts.items()})

    def __getstate__(self) -> dict:  # picklable for spawn-started workers (a lock is not)
        return {"total": self.snapshot()}

    def __setstate__(self, state: dict) -> None:
        self.total = state["total"]
        self._lock = threading.Lock()


_PERMANENT = (ShardNotFoundError, CredentialsError, ObjectChangedError)

#: the most one read asks of the network: a buffered read that fails part-way reports nothing of
#: what it received, so progress is recorded (and at most this much refetched after a fault) in pieces of this size
PIECE = 1 << 20


def is_transient(exc: BaseException) -> bool:
    """True for faults worth a retry: connection trouble, timeouts, truncation, 5xx, 429/SlowDown."""
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, TransferError):
        status = getattr(exc, "status", None)
        return status is None or status >= 500 or status in (408, 429)
    if isinstance(exc, WdsCloudError):
        return False
    return isinstance(exc, (ConnectionError, socket.timeout, TimeoutError, OSError))


class ResumableStream:
    """A read stream over ``opener(offset, version, end)`` that recovers from faults (see the module docstring)."""

    def __init__(
        self,
        opener: Callable[..., Any],
        url: str,
        offset: int = 0,
        policy: Optional[RetryPolicy] = None,
        sink: Optional[StatsSink] = None,
        rng: Optional[random.Random] = None,
        end: Optional[int] = None,
        *,
        version: Optional[str] = None,
        size: Optional[int] = None,
    ) -> None:
        self.url = url
        self.policy = policy or RetryPolicy()
        self.stats = TransferStats(streams=1, requests=1)  # one GET (a part's figures are taken apart)
        self._opener = opener
        self._sink = sink
        self._rng = rng or random.Random()
        self._start = time.perf_counter()
        self.position = offset
        self.end = end  # a ranged read stops here
        self._failures = 0  # consecutive faults without a byte of progress
        self.closed = False
        self.aborted = False
        #: pinned by the caller (a part of an object whose first part was read): the version and size to expect
        self.version: Optional[str] = version
        self.size: Optional[int] = size
        self._pinned = version is not None or size is not None
        self.md5: Optional[str] = None  # the store's MD5 of the whole object (hex), when it gave one
        #: False when the store ignored a Range request and sent the object from its start
        self.ranged = True
        self._stream = self._open(first=True)

    # opening
    def _open(self, first: bool = False) -> Any:
        attempt = 0
        started = time.perf_counter()
        while True:
            attempt += 1
            try:
                stream = self._opener(self.position, self.version, self.end)
            except BaseException as exc:
                if self._is_version_change(exc) and (self._pinned or not first):
                    raise self._changed(self._refused(exc)) from exc
                if first and not is_transient(exc):
                    raise
                if not is_transient(exc) or attempt >= self.policy.attempts:
                    raise self._exhausted(exc, attempt) if is_transient(exc) else exc
                self._backoff(attempt, exc)
                self.stats.time_lost += time.perf_counter() - started
                started = time.perf_counter()
                continue
            if first and not self._pinned:
                self.version = getattr(stream, "version", None) or getattr(stream, "etag", None)
                self.size = getattr(stream, "size", None)
                self.md5 = getattr(stream, "md5", None)
            else:
                self._check_version(stream)
            if first:
                self.ranged = getattr(stream, "ranged", None) is not False
            return stream

    def _check_version(self, stream: Any) -> None:
        """Guard for stores that ignore the pinning condition: the version or size served must not change."""
        served = getattr(stream, "version", None) or getattr(stream, "etag", None)
        size = getattr(stream, "size", None)
        # A store that ignores the condition and gives no version cannot show it served the pinned one: an
        # answer without a version where one was pinned is a change, never a match.
        what = None
        if self.version and served != self.version:
            what = (
                f"the server now sends no version where the first answer said {self.version!r:.80}"
                if not served
                else f"its version was {self.version!r:.80}, the server now says {served!r:.80}"
            )
        elif size is not None and self.size is not None and size != self.size:
            what = f"it was {self.size} bytes, the server now says {size}"
        if what is not None:
            try:
                stream.close()
            finally:
                raise self._changed(what)

    def _is_version_change(self, exc: BaseException) -> bool:
        return isinstance(exc, ObjectChangedError) or getattr(exc, "status", None) == 412

    def _refused(self, exc: BaseException) -> str:
        """What a store's refusal of the pinned version says changed."""
        if getattr(exc, "status", None) == 412:
            return f"the server refused the version first read, {self.version!r:.80} (HTTP 412 Precondition Failed)"
        return f"the store no longer serves the version first read, {self.version!r:.80}"

    def _changed(self, what: str) -> ObjectChangedError:
        """The object was replaced while it was read; ``what`` says what changed."""
        return ObjectChangedError(
            f"{redact(self.url)}: the object changed while it was being read ({what}; at byte {self.position} "
            f"of {self.size}); two versions are never spliced: read it again",
            url=self.url,
            offset=self.position,
        )

    def read_on(self) -> bool:
        """Read on past ``end`` to the end of the object, in the response this stream has: for a store that ignored
        Range and is sending the whole object anyway (the rest then costs no request).  False where the stream
        cannot (a store that honoured the range: its answer ends where it was asked to)."""
        read_on = getattr(self._stream, "read_on", None)
        if read_on is None or not read_on():
            return False
        self.end = None  # a resumed request asks for the rest of the object too
        return True

    def _exhausted(self, exc: BaseException, attempts: int) -> TransferError:
        return TransferError(
            f"{redact(self.url)}: giving up at byte {self.position}"
            f"{f' of {self.size}' if self.size is not None else ''} after {attempts} attempts; "
            f"last cause: {type(exc).__name__}: {exc}. "
            + (
                "The host name does not resolve: check the URL's host (and this machine's DNS)"
                if _unresolved(exc)
                else "Raise WDS_RETRIES or WDS_RETRY_TIMEOUT if the store is only slow"
            ),
            url=self.url,
            offset=self.position,
            attempts=attempts,
            cause=exc,
        )

    def _backoff(self, attempt: int, exc: BaseException) -> None:
        # A connection lost after data flowed is retried at once; repeated failures, and a store that
        # asks to slow down (429, 503, SlowDown), back off exponentially with jitter.
        throttled = getattr(exc, "status", None) in (429, 503)
        delay = 0.0 if attempt == 1 and not throttled else self.policy.delay(attempt, self._rng)
        self.stats.retries += 1
        log.warning(
            "%s: %s at byte %d; attempt %d of %d, retrying in %.2f s",
            redact(self.url),
            f"{type(exc).__name__}: {exc}",
            self.position,
            attempt,
            self.policy.attempts,
            delay,
        )
        time.sleep(delay)

    def _recover(self, exc: BaseException) -> None:
        """Reopen at the next unread byte; raises when the fault is permanent or attempts run out."""
        started = time.perf_counter()
        try:
            self._stream.close()
        except Exception:
            pass
        # Attempts count the faults since the last byte of progress, so a fault that recurs at the
        # same offset (a truncated object, a dead store) ends within the bounds.
        self._failures += 1
        while True:
            if self._failures >= self.policy.attempts:
                raise self._exhausted(exc, self._failures) from exc
            self._backoff(self._failures, exc)
            try:
                stream = self._opener(self.position, self.version, self.end)
                self._check_version(stream)
                self._stream = stream
                self.stats.bytes_refetched += getattr(stream, "skipped", 0)
                break
            except BaseException as again:
                if self._is_version_change(again):
                    raise self._changed(self._refused(again)) from again
                if not is_transient(again):
                    raise
                self._failures += 1
                exc = again
        self.stats.time_lost += time.perf_counter() - started
        log.info("%s: resumed at byte %d after %s", redact(self.url), self.position, type(exc).__name__)

    # reading
    def readable(self) -> bool:
        return True

    def _short(self) -> Optional[TransferError]:
        limit = self.size if self.end is None or self.size is None else min(self.size, self.end)
        if limit is not None and self.position < limit:
            return TransferError(
                f"{redact(self.url)}: the body ended at byte {self.position} of {self.size}",
                url=self.url,
                offset=self.position,
            )
        return None

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all that is left when negative); short only at the end of the object."""
        if size is None or size < 0:
            size = 1 << 62
        if self.end is not None:
            size = max(0, min(size, self.end - self.position))
        parts, want = [], size
        piece = size if getattr(self._stream, "partial_reads", False) else PIECE
        while want > 0:
            ask = min(want, piece)  # bounded pieces: a failed buffered read loses at most one piece
            chunk = self._attempt(lambda: self._stream.read(ask), ask, len)  # noqa: B023 (called in this iteration)
            if not chunk:
                break
            parts.append(chunk)
            want -= len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, buffer) -> int:
        """Fill ``buffer``; fewer bytes only at the end of the object."""
        if getattr(self._stream, "readinto", None) is None:
            data = self.read(len(buffer))
            memoryview(buffer).cast("B")[: len(data)] = data
            return len(data)
        view = memoryview(buffer).cast("B")
        if self.end is not None:
            view = view[: max(0, self.end - self.position)]
        have = 0
        step = len(view) if getattr(self._stream, "partial_reads", False) else PIECE
        while have < len(view):
            piece = view[have : have + step]
            n = self._attempt(lambda: self._stream.readinto(piece), len(piece), int)  # noqa: B023 (called here)
            if not n:
                break
            have += n
        return have

    def _attempt(self, step: Callable[[], Any], asked: int, count: Callable[[Any], int]) -> Any:
        """Run one read ``step``, recovering from faults until it succeeds; count what it returned."""
        while True:
            try:
                result = step()
                if not count(result) and asked:
                    short = self._short()
                    if short is not None:
                        raise short
            except BaseException as exc:
                if self.aborted:
                    raise TransferError(
                        f"{redact(self.url)}: the read was cancelled", url=self.url, offset=self.position, status=499
                    ) from None  # 499: client closed
                if self._is_version_change(exc):
                    raise self._changed(self._refused(exc)) from exc
                if not is_transient(exc):
                    raise
                if not getattr(self._stream, "partial_reads", False):
                    # a buffered read that failed part-way received up to ``asked`` bytes it cannot report
                    self.stats.bytes_refetched += asked
                self._recover(exc)
                continue
            n = count(result)
            if n:
                self._failures = 0
            self.position += n
            self.stats.bytes += n
            return result

    def abort(self) -> None:
        """Cancel from another thread: a read blocked on the network returns, and no retry follows."""
        self.aborted = True
        abort = getattr(self._stream, "abort", None)
        if abort is not None:
            try:
                abort()
            except OSError:
                pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._stream.close()
        finally:
            self.stats.seconds = time.perf_counter() - self._start
            log.debug("%s: %s", redact(self.url), self.stats)
            if self._sink is not None:
                self._sink.add(self.stats)

    def __enter__(self) -> ResumableStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: what the resolvers of Linux, macOS and curl say of a name that does not resolve
_UNRESOLVED = ("name or service not known", "nodename nor servname", "name resolution", "could not resolve host")


def _unresolved(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it, a few links down) is a host name that did not resolve."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, socket.gaierror) or any(words in str(exc).lower() for words in _UNRESOLVED):
            return True
        exc = getattr(exc, "os_error", None) or exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return False
