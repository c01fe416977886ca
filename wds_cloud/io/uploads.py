"""Uploads that publish an object only when closed without error.

``FsspecUpload`` wraps an fsspec write file (s3fs, gcsfs, adlfs): ``close()``
commits, ``abort()`` (or an exception in a ``with`` block, or dropping it
unclosed) discards it, aborting a multipart upload where one was started.
``SpooledPut`` buffers to a temporary file and sends one HTTP ``PUT`` on close.
"""

from __future__ import annotations

import tempfile
import weakref
from collections.abc import Callable
from typing import Any, Optional

from ..errors import redact
from .publishing import Publishing

__all__ = ["FsspecUpload", "SpooledPut"]


def _discard(f: Any) -> None:
    try:
        f.discard()
    except Exception:
        pass
    try:
        f.closed = True  # fsspec files commit in __del__ unless marked closed
    except Exception:
        pass


class FsspecUpload(Publishing):
    """A write stream over an fsspec file that never publishes a partial object."""

    def __init__(self, f: Any, url: str, translate: Optional[Callable[[BaseException, str], BaseException]] = None):
        self._f = f
        self.url = url
        self.name = url
        self.closed = False
        self._translate = translate
        self._finalizer = weakref.finalize(self, _discard, f)

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except Exception as exc:
            self.abort()
            raise self._error(exc) from exc

    def _error(self, exc: BaseException) -> BaseException:
        return self._translate(exc, self.url) if self._translate else exc

    def flush(self) -> None:
        pass  # fsspec's flush may upload a part; parts are sent as the buffer fills

    def tell(self) -> int:
        return self._f.tell()

    def _publish(self) -> None:
        self._finalizer.detach()
        try:
            self._f.close()
        except Exception as exc:
            raise self._error(exc) from exc

    def _discard(self) -> None:
        self._finalizer.detach()
        _discard(self._f)

    def __repr__(self) -> str:
        return f"<FsspecUpload {redact(self.url)!r} closed={self.closed}>"


class SpooledPut(Publishing):
    """Buffers the object (in memory, then a temporary file) and PUTs it on close."""

    def __init__(self, url: str, send: Callable[[Any, int], None], spool: int = 16 << 20) -> None:
        self.url = url
        self.name = url
        self._send = send
        self._buf = tempfile.SpooledTemporaryFile(max_size=spool)
        self.closed = False

    def write(self, data: Any) -> int:
        return self._buf.write(data)

    def tell(self) -> int:
        return self._buf.tell()

    def flush(self) -> None:
        pass

    def _publish(self) -> None:
        try:
            size = self._buf.tell()
            self._buf.seek(0)
            self._send(self._buf, size)
        finally:
            self._buf.close()

    def _discard(self) -> None:
        self._buf.close()
