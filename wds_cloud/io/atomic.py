"""A local file that appears under its final name only when it is complete.

Data goes to a hidden temporary file beside the target; ``close()`` renames it
into place atomically, ``abort()`` (or an exception leaving a ``with`` block, or
the object being dropped unclosed) deletes it.  Used by the ``file`` backend
for writes and by the shard cache.
"""

from __future__ import annotations

import errno
import io
import os
import uuid
import weakref
from typing import cast

from ..errors import redact
from .publishing import Publishing

__all__ = ["AtomicFile", "temp_name_for"]


def temp_name_for(path: str) -> str:
    """A unique hidden name in ``path``'s directory (same filesystem, so rename is atomic)."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")


def _discard(path: str, fd_holder: list) -> None:
    for f in fd_holder:
        try:
            f.close()
        except OSError:
            pass
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class AtomicFile(Publishing):
    """Binary writer that publishes ``path`` on ``close()`` and never a partial file."""

    def __init__(self, path: str, bufsize: int = 1 << 20, *, fsync: bool = False) -> None:
        self.final_path = os.fspath(path)
        self.name = self.final_path
        parent = os.path.dirname(self.final_path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.temp_path = temp_name_for(self.final_path)
        # buffered (buffering > 0): a BufferedWriter, whose raw file tells what reached the disk
        self._file = cast(io.BufferedWriter, open(self.temp_path, "xb", buffering=max(bufsize, io.DEFAULT_BUFFER_SIZE)))
        self._fsync = fsync
        self.closed = False
        self._finalizer = weakref.finalize(self, _discard, self.temp_path, [self._file])

    def write(self, data) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            raise self._fail(exc) from exc

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as exc:
            raise self._fail(exc) from exc

    def tell(self) -> int:
        return self._file.tell()

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def _fail(self, exc: OSError) -> OSError:
        """Abort, and turn a full disk into a message that says what happened."""
        written = self._file.raw.tell() if not self._file.closed else None
        if exc.errno == errno.ENOSPC:
            return OSError(
                errno.ENOSPC,
                f"{redact(self.final_path)}: the disk is full (after {written} bytes were written); "
                "free space or write elsewhere. The partial file was removed and nothing was published",
            )
        return exc

    def _discard(self) -> None:
        """Remove the temporary file; the final name is never touched."""
        self._finalizer.detach()
        _discard(self.temp_path, [self._file])

    def _publish(self) -> None:
        """Flush, and move the finished file to its final name."""
        try:
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())
            self._file.close()
        except OSError as exc:
            raise self._fail(exc) from exc
        self._finalizer.detach()
        os.replace(self.temp_path, self.final_path)

    def __repr__(self) -> str:
        return f"<AtomicFile {self.final_path!r} closed={self.closed}>"
