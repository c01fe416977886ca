"""Backends built on an fsspec filesystem (s3fs, gcsfs, adlfs): stat, listing and writes.

The filesystem is made lazily, once per process (a forked DataLoader worker
makes its own: no client or event loop crosses a fork), with fsspec's instance
cache bypassed.  Subclasses say how to make it and how to translate its errors;
reads are each backend's own (one streaming GET per shard).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any, Optional

from ..errors import MissingExtraError, ShardNotFoundError, WdsCloudError, redact
from .backend import Backend, InStream, ObjectInfo, OutStream, fsspec_list, require
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

    def path(self, url: str) -> str:
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

    def open_write(self, url: str, bufsize: Optional[int] = None) -> OutStream:
        try:
            f = self.fs.open(self.path(url), "wb", block_size=max(bufsize or 0, 8 << 20))
        except Exception as exc:
            raise self.translate(exc, url) from exc
        return FsspecUpload(f, url, self.translate)


def fsspec_protocols() -> dict:
    """The protocols fsspec knows (built in, or registered with it): name -> (class path, fsspec's install hint)."""
    from fsspec.registry import known_implementations, registry

    found = {name: (spec.get("class", ""), spec.get("err")) for name, spec in known_implementations.items()}
    for name, cls in registry.items():
        found[name] = (f"{cls.__module__}.{cls.__qualname__}", None)
    return found


class FsspecFallbackBackend(FsspecBackend):
    """Any protocol fsspec knows and no plugin claims (``hf://``, ``sftp://``, ``memory://``, ...).

    Reads open the fsspec file (``storage_options`` go to the filesystem) and seek to the
    offset; no retry layer or version pinning is added, as the protocol's own driver decides
    what a fault means.  A protocol whose driver is not installed fails at open time with
    fsspec's own install hint.
    """

    resumable = False

    def __init__(self, settings: Any, *, protocol: str, hint: Optional[str] = None, **storage_options: Any) -> None:
        super().__init__(settings, **storage_options)
        self.scheme = protocol
        self.hint = hint

    def make_fs(self) -> Any:
        import fsspec

        try:
            return fsspec.filesystem(self.scheme, skip_instance_cache=True, **self.storage_options)
        except ImportError as exc:
            raise MissingExtraError(
                f"{self.scheme}:// is served through fsspec, whose driver is not installed: {self.hint or exc}"
            ) from exc

    @staticmethod
    def translate(exc: BaseException, url: str) -> BaseException:
        if isinstance(exc, WdsCloudError):
            return exc
        if isinstance(exc, FileNotFoundError):
            return ShardNotFoundError(f"{redact(url)}: no such object (through fsspec); check the URL", url=url)
        return exc

    def path(self, url: str) -> str:
        """The path fsspec's filesystem uses for ``url`` (its protocol stripped, as it does)."""
        return self.fs._strip_protocol(url)

    def open_read(self, url: str, offset: int = 0, bufsize: Optional[int] = None, **kw: Any) -> InStream:
        try:
            f = self.fs.open(self.path(url), "rb")
            if offset:
                f.seek(offset)
        except Exception as exc:
            raise self.translate(exc, url) from exc
        return f

    def list(self, prefix: str) -> Iterator[str]:
        fs = self.fs
        path = self.path(prefix)
        folder = path if path.endswith("/") else path.rsplit("/", 1)[0] if "/" in path else path
        try:
            names = fs.find(folder.rstrip("/") or "/")
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self.translate(exc, prefix) from exc
        for name in sorted(names):
            if name.startswith(path):
                yield fs.unstrip_protocol(name)
