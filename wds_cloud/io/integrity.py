"""Checking a shard against its manifest entry while it is read (see :mod:`wds_cloud.manifest`)."""

from __future__ import annotations

import hashlib
from typing import Any, Optional

from ..errors import IntegrityError, redact
from .backend import WrappedStream

__all__ = ["Hashing", "Verifying", "mismatch"]


def mismatch(url: str, what: str, expected: Any, actual: Any) -> IntegrityError:
    return IntegrityError(
        f"{redact(url)}: the shard does not match the manifest: {what} {actual!r}, the manifest "
        f"says {expected!r}; the shard is damaged or was replaced: fetch or write it again, or "
        "update the manifest",
        url=url,
        expected=expected,
        actual=actual,
    )


class Hashing(WrappedStream):
    """A read stream that counts every byte read through it (``count``) and feeds it to ``hashes``."""

    def __init__(self, stream: Any, *hashes: Any) -> None:
        super().__init__(stream)
        self.hashes = hashes
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        for digest in self.hashes:
            digest.update(data)
        self.count += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        """Read (and count, and hash) what is left."""
        while self.read(1 << 20):
            pass


class Verifying(Hashing):
    """A read stream hashed as it is read; :meth:`verify` (after the last sample) checks it against ``entry``."""

    def __init__(self, stream: Any, url: str, entry: dict) -> None:
        super().__init__(stream, hashlib.sha256())
        self.url = url
        self.entry = entry

    def verify(self, samples: Optional[int] = None) -> None:
        """Read what the tar reader left (end blocks), then compare size, samples and SHA-256."""
        self.drain()
        expected = self.entry
        if "size" in expected and self.count != expected["size"]:
            raise mismatch(self.url, "size", expected["size"], self.count)
        if samples is not None and "samples" in expected and samples != expected["samples"]:
            raise mismatch(self.url, "samples", expected["samples"], samples)
        digest = self.hashes[0].hexdigest()
        if "sha256" in expected and digest != expected["sha256"]:
            raise mismatch(self.url, "sha256", expected["sha256"], digest)
