"""What a storage backend provides: the contract every plugin's backend follows.

A backend object is made by the factory a plugin registers, one per
(scheme, storage options) pair, and is shared by all opens in a process.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Protocol

from ..config import Settings
from ..errors import MissingExtraError

__all__ = [
    "Backend",
    "ReadStream",
    "WrappedStream",
    "InStream",
    "OutStream",
    "ObjectInfo",
    "missing_modules",
    "require",
    "fsspec_list",
    "read_to_end",
    "skip",
]


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """What ``stat`` tells: the size in bytes and, where the store has one, a version tag."""

    url: str
    size: Optional[int]
    version: Optional[str] = None


def read_to_end(read: Callable[[int], bytes], piece: int = 1 << 20) -> bytes:
    """Everything ``read(n)`` still returns, for streams whose ``read(-1)`` reads in pieces."""
    parts: list[bytes] = []
    while True:
        chunk = read(piece)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)


def skip(read: Callable[[int], bytes], n: int, piece: int = 1 << 20) -> int:
    """Read and drop ``n`` bytes with ``read(k)`` (for streams that cannot seek); returns how many there were."""
    left = n
    while left > 0:
        chunk = read(min(left, piece))
        if not chunk:
            break
        left -= len(chunk)
    return n - left


def missing_modules(modules: Sequence[str]) -> list[str]:
    """The names in ``modules`` that cannot be imported here."""
    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def require(scheme: str, modules: Sequence[str], extra: Optional[str]) -> None:
    """Raise :class:`MissingExtraError` with the install line if a module is missing."""
    missing = missing_modules(modules)
    if missing:
        hint = (
            f"pip install 'wds_cloud[{extra}]' (in a clone: pip install -e '.[{extra}]')"
            if extra
            else f"pip install {' '.join(missing)}"
        )
        raise MissingExtraError(f"{scheme}:// needs {', '.join(missing)}: {hint}")


class InStream(Protocol):
    """What ``Backend.open_read`` returns: a binary stream (a file object, or a stream of ours)."""

    def read(self, size: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


class OutStream(Protocol):
    """What ``Backend.open_write`` returns: ``close()`` publishes, ``abort()`` (where present) discards."""

    def write(self, data: bytes, /) -> int: ...

    def close(self) -> None: ...


class ReadStream:
    """Base for backends' read streams: subclasses implement ``read``; this adds the rest."""

    closed = False

    def read(self, size: int = -1) -> bytes:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def __enter__(self) -> ReadStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.closed = True


class WrappedStream:
    """Base of read streams that wrap another (``_stream``): closing, ``closed`` and ``with`` pass through."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._stream.close()

    @property
    def closed(self) -> bool:
        return getattr(self._stream, "closed", False)

    def fileno(self) -> int:
        """The descriptor of the file underneath (``io.UnsupportedOperation`` when there is none)."""
        fileno = getattr(self._stream, "fileno", None)
        if fileno is None:
            raise io.UnsupportedOperation("this stream has no file descriptor")
        return fileno()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Backend:
    """Base class for backends.  Subclasses override what their store supports.

    ``open_read`` returns a binary file object streaming from ``offset`` (with ``size``
    and ``version`` attributes where known; ``version=`` pins a resumed read to the
    version first read, and a changed object then raises ObjectChangedError);
    ``open_write`` returns one whose ``close()`` publishes the object and whose
    ``abort()`` (or leaving a ``with`` block by an exception) discards it;
    ``stat`` returns an :class:`ObjectInfo`; ``list`` yields the URLs under a prefix.
    """

    scheme = ""
    #: reads are wrapped in a ResumableStream (resume at the next byte, pinned to the version)
    resumable = False
    #: ``open_read`` takes ``length=`` and then asks the store for no more than that many bytes
    ranged_reads = False

    def __init__(self, settings: Settings, **storage_options: Any) -> None:
        self.settings = settings
        self.storage_options = storage_options

    def open_read(
        self,
        url: str,
        offset: int = 0,
        bufsize: Optional[int] = None,
        *,
        version: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> InStream:
        raise NotImplementedError(f"{self.scheme}: backend cannot read")

    def open_write(self, url: str, bufsize: Optional[int] = None) -> OutStream:
        raise NotImplementedError(f"{self.scheme}: backend cannot write")

    def stat(self, url: str) -> ObjectInfo:
        raise NotImplementedError(f"{self.scheme}: backend cannot stat")

    def list(self, prefix: str) -> Iterator[str]:
        raise NotImplementedError(f"{self.scheme}: backend cannot list")

    def __repr__(self) -> str:  # never show storage options: they may hold credentials
        return f"<{type(self).__name__} scheme={self.scheme!r}>"


def fsspec_list(fs: Any, scheme: str, prefix: str, translate: Callable) -> Iterator[str]:
    """The object URLs under ``prefix`` (a folder, or the start of names), through an fsspec filesystem."""
    path = prefix.split("://", 1)[1]
    folder = path if path.endswith("/") else path.rsplit("/", 1)[0] + "/" if "/" in path else path
    try:
        fs.invalidate_cache()
        names = fs.find(folder.rstrip("/"))
    except FileNotFoundError:
        return
    except Exception as exc:
        raise translate(exc, prefix) from exc
    for name in sorted(names):
        if name.startswith(path):
            yield f"{scheme}://{name}"
