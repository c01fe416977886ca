"""Backends built on an fsspec filesystem (s3fs, gcsfs, adlfs): stat, listing and writes.

The filesystem is made lazily, once per process (a forked DataLoader worker
makes its own: no client or event loop crosses a fork), with fsspec's instance
cache bypassed.  Subclasses say how to make it and how to translate its errors;
reads are each backend's own (one streaming GET per shard).
"""

from __future__ import annotations

import os
import threading
from typing import IO, Any, Iterator, Optional

from .backend import Backend, ObjectInfo, fsspec_list, require
from .uploads import FsspecUpload

__all__ = ["FsspecBackend"]


class FsspecBackend(Backend):
    """Base of the fsspec-backed backends; subclasses set ``requires``/``extra`` and implement ``make_fs``."""

    requires: tuple[str, ...] = ()
    extra: Optional[str] = None
    resumable = True

    def __init__(self, settings: Any, **storage_options: Any) -> None:
        super().__init__(settings, **storage_options)
        self._fs: Any = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def make_fs(self) -> Any:
        raise NotImplementedError

    @staticmethod
    def translate(exc: BaseException, url: str) -> BaseException:
        return exc

    def version_of(self, info: dict) -> Optional[str]:
        """The version tag in an fsspec ``info`` dict."""
        return info.get("etag")

    @property
    def fs(self) -> Any:
        require(self.scheme, self.requires, self.extra)
        with self._lock:
            if self._pid != os.getpid():
                self._fs, self._pid = None, os.getpid()
            if self._fs is None:
                try:
                    self._fs = self.make_fs()
                except Exception as exc:
                    raise self.translate(exc, f"{self.scheme}://") from exc
        return self._fs

    @staticmethod
    def path(url: str) -> str:
        """``bucket/key`` from ``scheme://bucket/key``."""
        return url.split("://", 1)[1]

    def stat(self, url: str) -> ObjectInfo:
        try:
            self.fs.invalidate_cache(self.path(url))
            info = self.fs.info(self.path(url))
        except Exception as exc:
            raise self.translate(exc, url) from exc
        return ObjectInfo(url, info.get("size"), self.version_of(info))

    def list(self, prefix: str) -> Iterator[str]:
        yield from fsspec_list(self.fs, prefix.split("://", 1)[0], prefix, self.translate)

    def open_write(self, url: str, bufsize: Optional[int] = None) -> IO[bytes]:
        try:
            f = self.fs.open(self.path(url), "wb", block_size=max(bufsize or 0, 8 << 20))
        except Exception as exc:
            raise self.translate(exc, url) from exc
        return FsspecUpload(f, url, self.translate)


