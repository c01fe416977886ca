"""Open a URL for reading or writing: rewrite, then registry, then backend.

``gopen(url, mode="rb", bufsize=...)`` keeps webdataset's signature.  Openers
assigned into :data:`gopen_schemes` (``gopen_schemes["foo"] = fn``) are called as
``fn(url, mode, bufsize)`` and take precedence over the registry, as they did
upstream; every other scheme is served by the plugin registry.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
from collections.abc import Callable, Iterator, MutableMapping
from typing import IO, Any, Optional, cast

from .. import config
from ..config import Settings
from ..errors import ConfigError, SecurityError, UnknownSchemeError, WdsCloudError, redact
from . import profiles
from .backend import InStream, WrappedStream
from .pipes import Pipe
from .registry import get_registry
from .resilient import ResumableStream, RetryPolicy
from .security import UntrustedURL, check_pipe, is_secure, untrusted
from .urls import is_local, split_scheme

__all__ = [
    "gopen",
    "gopen_schemes",
    "rewrite_url",
    "reader",
    "gopen_file",
    "gopen_pipe",
    "gopen_curl",
    "gopen_error",
    "Pipe",
    "open_backend",
    "RemoteObject",
    "remote_object",
    "exists",
    "check_schemes",
]

log = logging.getLogger(__name__)

_READ_MODES = {"rb", "r"}
_WRITE_MODES = {"wb", "w"}


def rewrite_url(url: str, settings: Optional[Settings] = None) -> str:
    """Apply ``WDS_REWRITE``/``GOPEN_REWRITE`` prefix rules, then the plugins' rewrite hook.

    The first matching rule wins (``WDS_REWRITE`` rules are tried before
    ``GOPEN_REWRITE`` ones).  A rewrite that produces a ``pipe:`` URL from
    something else yields an untrusted URL, which runs only with
    ``WDS_ALLOW_UNTRUSTED_PIPES=1``.
    """
    settings = settings or config.current()
    if settings.rewrites and is_secure(settings):
        raise SecurityError(
            f"refusing to rewrite {redact(url)!r}: rewriting URLs from GOPEN_REWRITE/WDS_REWRITE is not allowed "
            "while WDS_SECURE=1 (or utils.enforce_security) is set (webdataset: rewrite_url: unsafe_gopen is "
            "False, cannot rewrite URLs using environment variables); unset the rewrite rules or security",
            url=url,
        )
    original = url
    for prefix, replacement in settings.rewrites:
        if url.startswith(prefix):
            url = replacement + url[len(prefix) :]
            break
    else:
        hooked = get_registry(settings).rewrite(url)
        if hooked is not None:
            url = hooked
    if url != original:
        log.debug("rewrote %s -> %s", redact(original), redact(url))
        if isinstance(original, UntrustedURL) or (
            split_scheme(url)[0] == "pipe" and split_scheme(original)[0] != "pipe"
        ):
            url = untrusted(url)  # data stays data, and a rule that makes a command is not the program's own
    return url


def _annotate(exc: BaseException, given: str, rewritten: str) -> None:
    """Add the URL the user gave to an error raised for its rewritten form."""
    note = f"(the URL given was {redact(given)!r}, rewritten to {redact(rewritten)!r})"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    elif isinstance(exc, WdsCloudError) and exc.args:
        exc.args = (f"{exc.args[0]} {note}",) + exc.args[1:]


def open_backend(url: str, settings: Optional[Settings] = None, storage_options: Optional[dict] = None):
    """The backend object that serves ``url`` (no rewriting).

    A plugin may route the URL to another scheme's backend (``wds_cloud_route_url``: the
    ``ais`` plugin sends the schemes named in ``USE_AIS_FOR`` through an AIStore gateway);
    otherwise storage options come from the matching profiles of the profiles file, then
    from ``storage_options``.
    """
    settings = settings or config.current()
    scheme = split_scheme(url)[0] or "file"
    registry = get_registry(settings)
    routed = registry.route(url, scheme)
    if routed is not None and routed != scheme:
        return registry.backend(routed, url, settings)
    options = (
        profiles.options_for(url, settings, storage_options)
        if scheme not in ("file", "pipe")
        else (storage_options or {})
    )
    return registry.backend(scheme, url, settings, **options)


def check_schemes(urls: list[str], settings: Optional[Settings] = None) -> None:
    """:class:`UnknownSchemeError` naming the first of ``urls`` whose scheme no backend serves (after rewriting,
    as :func:`gopen` would open it), without opening anything: a job checks its sources and destination so
    before it claims the destination or starts a cluster: a typo fails at once, not after the claim or the cluster."""
    settings = settings or config.current()
    registry = get_registry(settings)
    seen: set = set()
    for given in urls:
        url = rewrite_url(given, settings)
        scheme = split_scheme(url)[0] or "file"
        if scheme in seen or scheme in ("file", "pipe") or assigned_opener(url) is not None:
            continue
        routed = registry.route(url, scheme)
        try:
            registry.claim(routed or scheme, url)
        except UnknownSchemeError as exc:
            if url != given:
                _annotate(exc, given, url)
            raise
        seen.add(scheme)


def exists(url: str, storage_options: Optional[dict] = None) -> bool:
    """Whether the object at ``url`` exists (published whole: writes appear under their name only when
    complete); False also for a backend that cannot stat (``pipe:``)."""
    try:
        open_backend(url, storage_options=storage_options).stat(url)
        return True
    except (FileNotFoundError, NotImplementedError):
        return False


def gopen(
    url: Any,
    mode: str = "rb",
    bufsize: int = 8192,
    *,
    offset: int = 0,
    length: Optional[int] = None,
    storage_options: Optional[dict] = None,
    settings: Optional[Settings] = None,
    retries: Optional[int] = None,
    timeout: Optional[float] = None,
    stats: Any = None,
    **kw: Any,
) -> IO[bytes]:
    """Open ``url`` as a binary stream; ``mode`` is ``"rb"`` or ``"wb"``.

    ``offset`` starts a read at that byte and ``length`` ends it after that many
    bytes (a ranged read: stores that support it send no more); ``storage_options`` go to the backend
    (fsspec-style: credentials, endpoint, ...).  Remote reads resume after faults
    at the next unread byte (``retries`` attempts per fault, ``timeout`` seconds
    of silence count as a stall; defaults from ``WDS_RETRIES``/``WDS_RETRY_TIMEOUT``),
    and add their transfer figures to ``stats`` (a :class:`~wds_cloud.io.resilient.StatsSink`).
    A stream opened for writing publishes its object only when closed without error.
    """
    url = os.fspath(url) if not isinstance(url, str) else url
    if mode not in _READ_MODES | _WRITE_MODES:
        raise ConfigError(f"gopen mode must be 'rb' or 'wb', not {mode!r}")
    settings = settings or config.current()
    if settings.verbose:
        log.info("gopen %s %s", redact(url), mode)
    given = url
    url = rewrite_url(url, settings)
    try:
        legacy = assigned_opener(url)
        if legacy is not None:
            stream = legacy(url, mode, bufsize, **kw)
            if mode in _READ_MODES and (offset or length is not None):
                # an opener assigned in gopen_schemes reads from the start: the range is taken here
                return cast(IO[bytes], _ranged(stream, offset, length))
            return stream
        if is_local(url) and is_secure(settings):
            raise SecurityError(
                f"refusing to open the local file {redact(url)!r}: local paths and file: URLs are not allowed "
                "while WDS_SECURE=1 (or utils.enforce_security) is set (webdataset: gopen: unsafe_gopen is "
                "False, cannot open local files); read shards from a storage URL such as s3:// or https://",
                url=url,
            )
        backend = open_backend(url, settings, storage_options)
        # the streams below are binary file objects by duck typing (read/readinto/write/close/with)
        if mode not in _READ_MODES:
            return cast(IO[bytes], backend.open_write(url, bufsize=bufsize))
        if not backend.resumable:
            stream = backend.open_read(url, offset=offset, bufsize=bufsize)
            return cast(IO[bytes], stream if length is None else Bounded(stream, length))
        remote = RemoteObject(url, backend, _policy(settings, retries, timeout), bufsize)
        return cast(IO[bytes], remote.stream(offset, offset + length if length is not None else None, stats))
    except Exception as exc:
        if url != given:
            _annotate(exc, given, url)
        raise


def _policy(settings: Settings, retries: Optional[int], timeout: Optional[float]) -> RetryPolicy:
    # the keywords get the ranges of WDS_RETRIES and WDS_RETRY_TIMEOUT, named as the caller wrote them
    return RetryPolicy(
        attempts=max(1, config.check_setting("retries", retries, settings.retries)),
        backoff=settings.retry_backoff,
        timeout=config.check_setting("timeout", timeout, settings.retry_timeout),
    )


@dataclasses.dataclass(frozen=True)
class RemoteObject:
    """An object a resumable backend serves: its bytes from any offset, each read pinned to a version."""

    url: str  #: as rewritten
    backend: Any
    policy: RetryPolicy
    bufsize: int = 8192

    @property
    def ranged(self) -> bool:
        """Whether a read can end before the object does (the backend sends no more than asked)."""
        return bool(getattr(self.backend, "ranged_reads", False))

    def open_at(self, at: int, version: Optional[str], end: Optional[int] = None) -> InStream:
        """One request for the bytes from ``at`` (to ``end`` where the backend can stop there)."""
        if end is not None and self.ranged:
            return self.backend.open_read(
                self.url, offset=at, bufsize=self.bufsize, version=version, timeout=self.policy.timeout, length=end - at
            )
        return self.backend.open_read(
            self.url, offset=at, bufsize=self.bufsize, version=version, timeout=self.policy.timeout
        )

    def stream(
        self,
        offset: int = 0,
        end: Optional[int] = None,
        sink: Any = None,
        *,
        version: Optional[str] = None,
        size: Optional[int] = None,
    ) -> ResumableStream:
        """A :class:`ResumableStream` over ``[offset, end)``; ``version``/``size`` pin it to a version read before."""

        def opener(at: int, pinned: Optional[str], until: Optional[int]) -> InStream:
            return self.open_at(at, pinned, until)

        return ResumableStream(opener, self.url, offset, self.policy, sink, end=end, version=version, size=size)


def remote_object(
    url: Any,
    settings: Optional[Settings] = None,
    storage_options: Optional[dict] = None,
    retries: Optional[int] = None,
    timeout: Optional[float] = None,
) -> Optional[RemoteObject]:
    """``url`` as a :class:`RemoteObject` when a resumable backend serves it, else None (a local file, a
    pipe, an opener assigned in :data:`gopen_schemes`): what parallel ranged reads can split."""
    url = os.fspath(url) if not isinstance(url, str) else url
    if is_local(url):
        return None
    settings = settings or config.current()
    given = url
    url = rewrite_url(url, settings)
    try:
        if assigned_opener(url) is not None or is_local(url):
            return None
        backend = open_backend(url, settings, storage_options)
        if not backend.resumable:
            return None
        return RemoteObject(url, backend, _policy(settings, retries, timeout))
    except Exception as exc:
        if url != given:
            _annotate(exc, given, url)
        raise


class Bounded(WrappedStream):
    """At most ``length`` bytes of ``stream`` (a ranged read over a backend that streams to the end)."""

    def __init__(self, stream: InStream, length: int) -> None:
        super().__init__(stream)
        self._left = length

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > self._left:
            size = self._left
        data = self._stream.read(size) if size else b""
        self._left -= len(data)
        return data

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")[: self._left]
        if not len(view):
            return 0
        readinto = getattr(self._stream, "readinto", None)
        if readinto is None:
            data = self._stream.read(len(view))
            n = len(data)
            view[:n] = data
        else:
            n = readinto(view)
        self._left -= n
        return n


def _ranged(stream: Any, offset: int, length: Optional[int]) -> Any:
    """``stream`` from byte ``offset`` (sought where it can seek, else read past), at most ``length`` bytes."""
    if offset:
        seekable = getattr(stream, "seekable", None)
        if seekable is not None and seekable():
            stream.seek(offset, os.SEEK_CUR)
        else:
            left = offset
            while left:
                skipped = stream.read(min(left, 1 << 20))
                if not skipped:
                    break  # shorter than the offset: the reader finds nothing there and says so
                left -= len(skipped)
    return stream if length is None else Bounded(stream, length)


def reader(url: Any, **kw: Any) -> IO[bytes]:
    """Open ``url`` for reading (``gopen(url, "rb", ...)``)."""
    return gopen(url, "rb", **kw)


def _via_registry(scheme: str) -> Callable[..., IO[bytes]]:
    def opener(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> IO[bytes]:
        settings = config.current()
        backend = get_registry(settings).backend(scheme, url, settings)
        if mode in _READ_MODES:
            return cast(IO[bytes], backend.open_read(url, offset=kw.get("offset", 0), bufsize=bufsize))
        return cast(IO[bytes], backend.open_write(url, bufsize=bufsize))

    opener.__name__ = f"gopen_{scheme}"
    opener.__doc__ = f"Open a {scheme}: URL through the registered backend."
    return opener


def gopen_file(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> IO[bytes]:
    """Open a local path or ``file:`` URL."""
    return _via_registry("file")(url, mode, bufsize, **kw)


def gopen_pipe(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> IO[bytes]:
    """Open a ``pipe:`` URL (subject to ``WDS_SECURE``)."""
    return _via_registry("pipe")(url, mode, bufsize, **kw)


def gopen_curl(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> IO[bytes]:
    """Read or upload ``url`` with the ``curl`` command, as webdataset did.

    Prefer the ``http`` backend: a URL with credentials in it would be visible
    on curl's command line.
    """
    check_pipe("pipe:curl", config.current())
    quoted = shlex.quote(url)
    if mode in _READ_MODES:
        return cast(IO[bytes], Pipe(f"curl --fail -sS -L {quoted}", "rb", bufsize, url=url))
    return cast(IO[bytes], Pipe(f"curl --fail -sS -L -T - {quoted}", "wb", bufsize, url=url))


def gopen_error(url: str, *args: Any, **kw: Any) -> IO[bytes]:
    """An opener that always fails: assign it to a scheme to forbid that scheme."""
    raise UnknownSchemeError(f"{redact(url)}: this scheme is disabled (gopen_schemes maps it to gopen_error)", url=url)


_user_openers: dict[str, Callable[..., IO[bytes]]] = {}


def assigned_opener(url: str) -> Optional[Callable[..., IO[bytes]]]:
    """The opener user code assigned in :data:`gopen_schemes` for ``url``'s scheme, or None.

    webdataset reads ``x://...`` as the scheme ``x`` (urlparse), where a bare one-letter prefix is a drive letter
    here; so a one-letter scheme is one only once user code assigned it (``gopen_schemes["x"] = fn``)."""
    if not _user_openers:
        return None
    scheme = split_scheme(url)[0]
    if scheme is None and len(url) > 2 and url[1] == ":" and url[0].isascii() and url[0].isalpha():
        scheme = url[0].lower()  # "x:..." : webdataset's urlparse reads a scheme; here it is one only if assigned
        if scheme not in _user_openers:
            return None
    if scheme is None:
        return None  # a local path: webdataset opens those itself too, never through gopen_schemes
    opener = _user_openers.get(scheme)
    if opener is None and "__default__" in _user_openers and scheme not in get_registry(config.current()).schemes():
        # webdataset's "__default__": the opener of a scheme nothing else claims (its own default refuses)
        opener = _user_openers["__default__"]
    return opener


class _SchemeTable(MutableMapping):
    """``gopen_schemes``: the registry's schemes as a dict of ``fn(url, mode, bufsize)`` openers.

    Assigning installs an opener that wins over the registry for that scheme;
    deleting removes such an assignment (registered backends cannot be deleted).
    ``"__default__"`` is, as in webdataset, the opener of URLs whose scheme nothing else claims (unassigned:
    :func:`gopen_error`); local paths never go through the table.
    """

    def _registered(self) -> list[str]:
        return get_registry(config.current()).schemes()

    def __getitem__(self, scheme: str) -> Callable[..., IO[bytes]]:
        if scheme in _user_openers:
            return _user_openers[scheme]
        if scheme == "__default__":
            return gopen_error  # as webdataset: a scheme nothing claims is refused unless one is assigned here
        if scheme in self._registered():
            return _via_registry(scheme)
        raise KeyError(scheme)

    def __setitem__(self, scheme: str, opener: Callable[..., IO[bytes]]) -> None:
        if not callable(opener):
            raise TypeError(f"gopen_schemes[{scheme!r}] must be a callable fn(url, mode, bufsize)")
        if scheme == "__default__" and opener is gopen_error:  # the default put back: the registry's own messages
            _user_openers.pop(scheme, None)
            return
        _user_openers[scheme] = opener

    def __delitem__(self, scheme: str) -> None:
        if scheme not in _user_openers:
            raise KeyError(
                f"{scheme!r} was not assigned in gopen_schemes; registered backends stay "
                "(disable a plugin with WDS_DISABLE_PLUGINS)"
            )
        del _user_openers[scheme]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set(self._registered()) | set(_user_openers) | {"__default__"}))

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __repr__(self) -> str:
        return f"gopen_schemes({list(self)})"


gopen_schemes = _SchemeTable()
