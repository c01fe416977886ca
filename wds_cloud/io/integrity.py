"""Checking a shard against its manifest entry while it is read (see :mod:`wds_cloud.manifest`)."""

from __future__ import annotations

import hashlib
from typing import Any, Optional

from ..errors import IntegrityError, redact
from .backend import WrappedStream

__all__ = ["Verifying", "mismatch"]


def mismatch(url: str, what: str, expected: Any, actual: Any) -> IntegrityError:
    return IntegrityError(f"{redact(url)}: the shard does not match the manifest: {what} {actual!r}, the manifest "
                          f"says {expected!r}; the shard is damaged or was replaced: fetch or write it again, or "
                          "update the manifest", url=url, expected=expected, actual=actual)


class Verifying(WrappedStream):
    """A read stream that hashes and counts every byte; :meth:`verify` (after the last sample) checks it."""

    def __init__(self, stream: Any, url: str, entry: dict) -> None:
        super().__init__(stream)
        self.url = url
        self.entry = entry
        self._hash = hashlib.sha256()
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._hash.update(data)
        self.count += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[:len(data)] = data
        return len(data)

    def verify(self, samples: Optional[int] = None) -> None:
        """Read what the tar reader left (end blocks), then compare size, samples and SHA-256."""
        while self.read(1 << 20):
            pass
        expected = self.entry
        if "size" in expected and self.count != expected["size"]:
            raise mismatch(self.url, "size", expected["size"], self.count)
        if samples is not None and "samples" in expected and samples != expected["samples"]:
            raise mismatch(self.url, "samples", expected["samples"], samples)
        digest = self._hash.hexdigest()
        if "sha256" in expected and digest != expected["sha256"]:
            raise mismatch(self.url, "sha256", expected["sha256"], digest)
