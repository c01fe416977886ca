"""Decompression of a shard's stream: gzip, bz2, xz and zstd, detected from its first bytes.

:func:`open_decompressed` reads the first block, names the compression from its magic bytes (a block that is a
tar header is a plain tar whatever it begins with) and wraps the stream in the decompressor it asks for.  Each
decompressor is fed whole pieces of what it asks for (:class:`_Whole`), however the source hands its bytes
over, so that what a damaged stream yields before its error, and which error, is the same for every delivery;
:func:`decompression_errors` says what a decompressor raises on damage.
"""

from __future__ import annotations

import bz2
import lzma
import sys
import zlib
from typing import IO, Any, Optional, Protocol, cast

from ..errors import MissingExtraError
from ..io.backend import WrappedStream
from .format import is_tar_header

__all__ = [
    "open_decompressed",
    "detect_compression",
    "decompression_errors",
    "Prefixed",
    "Readable",
    "COMPRESSIONS",
    "HEAD_SIZE",
    "CHUNK",
    "FIRST_READ",
]

#: what a streamed shard is read in, a chunk at a time
CHUNK = 1 << 20
#: the first reads of a stream, and each read of a compressed one: a shard's first sample over a slow link does not
#: wait for a whole chunk
FIRST_READ = 64 << 10

_MAGICS = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bz2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
)

#: the compressions a shard may have (what :func:`detect_compression` names)
COMPRESSIONS = tuple(name for _, name in _MAGICS)


#: how many first bytes :func:`detect_compression` is given where it can be: a whole tar header
HEAD_SIZE = 512


def detect_compression(head: bytes) -> Optional[str]:
    """The compression named by a stream's first bytes, or None for a plain tar.  A head of a whole block that is
    a tar header (its checksum holds) is a plain tar whatever it begins with: a first member may be named
    ``BZh...`` or begin with gzip's two magic bytes."""
    for magic, name in _MAGICS:
        if head.startswith(magic):
            return None if is_tar_header(head[:HEAD_SIZE]) else name
    return None


class Prefixed(WrappedStream):
    """A read stream that first returns ``prefix``, then the rest of ``stream``."""

    def __init__(self, prefix: bytes, stream: IO[bytes]) -> None:
        super().__init__(stream)
        self._prefix = prefix

    def read(self, size: int = -1) -> bytes:
        if self._prefix:
            if size is None or size < 0:
                data, self._prefix = self._prefix + self._stream.read(), b""
                return data
            data, self._prefix = self._prefix[:size], self._prefix[size:]
            return data
        return self._stream.read(size)

    def readinto(self, buffer) -> int:
        if not self._prefix and getattr(self._stream, "readinto", None) is not None:
            return self._stream.readinto(buffer)  # straight into the caller's buffer
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _Whole:
    """A read stream whose reads give all the bytes asked for, short only at the end of the stream."""

    def __init__(self, raw: Prefixed) -> None:
        self._raw = raw

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        if size is None or size < 0 or len(data) >= size or not data:
            return data
        parts = [data]
        have = len(data)
        while have < size:
            more = self._raw.read(size - have)
            if not more:
                break
            parts.append(more)
            have += len(more)
        return b"".join(parts)

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        have = 0
        while have < len(view):
            got = self._raw.readinto(view[have:])
            if not got:
                break
            have += got
        return have

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()


class _Zlib:
    """Streaming gzip (multi-member) decompression with zlib, without GzipFile's overhead.  The compressed stream is
    read ``FIRST_READ`` bytes at a time (whole pieces, see :class:`_Whole`): the first sample of a shard over a
    slow link waits for that much, not for a chunk."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._pending = b""
        self._eof = False
        self._truncated = False  # the input ended early; what came before it was returned first
        self._held = b""  # output the decompressor gave at once when the input ended early, not yet read
        self._flushed = False

    def read(self, size: int) -> bytes:
        out: list[bytes] = []
        need = size
        if self._truncated:  # (only once what the flush gave is read: it is set when nothing is held)
            raise EOFError("the gzip stream ended before its end-of-stream marker")
        while need > 0 and not self._eof:
            if self._held:  # what a flush at the end of a cut stream gave, beyond what was asked then
                take = self._held[:need]
                self._held = self._held[need:]
                out.append(take)
                need -= len(take)
                continue
            if self._d.eof:
                rest = self._d.unused_data
                if not rest:
                    rest = self._raw.read(FIRST_READ)
                    if not rest:
                        self._eof = True
                        break
                self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                self._pending = rest
            if not self._pending:
                self._pending = self._d.unconsumed_tail or self._raw.read(FIRST_READ)
                if not self._pending:
                    if not self._d.eof:
                        # the input ended early: what the decompressor still holds comes out first, whatever
                        # sizes were asked for before (the same bytes, then the same error, for any reader)
                        held = b"" if self._flushed else self._d.flush()
                        self._flushed = True
                        if held:
                            self._held = held
                            continue
                        if out:  # deliver what was decompressed; the next read raises
                            self._truncated = True
                            break
                        raise EOFError("the gzip stream ended before its end-of-stream marker")
                    self._eof = True
                    break
            data = self._d.decompress(self._pending, need)
            self._pending = self._d.unconsumed_tail
            if data:
                out.append(data)
                need -= len(data)
        return b"".join(out)

    def readinto(self, buffer) -> int:
        data = self.read(min(len(buffer), CHUNK))  # bounded: the bytes are held twice until copied
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._raw.close()


class _Read1:
    """A bz2/xz file whose ``read`` returns what one step decompressed, so bytes before a cut are not lost."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def read(self, size: int) -> bytes:
        return self._f.read1(size)

    def readinto(self, buffer) -> int:
        data = self._f.read1(min(len(buffer), CHUNK))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._f.close()


class Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...

    def close(self) -> None: ...


def open_decompressed(stream: IO[bytes], head_size: int = HEAD_SIZE) -> tuple[Readable, Optional[str]]:
    """Wrap ``stream`` in the decompressor its magic bytes ask for (read until they are all there: a pipe or a
    network stream may give fewer bytes than asked)."""
    head = stream.read(head_size)
    while len(head) < head_size:
        more = stream.read(head_size - len(head))
        if not more:
            break
        head += more
    kind = detect_compression(head)
    raw = Prefixed(head, stream)
    if kind is None:
        return raw, None
    # a decompressor is given whole pieces of what it asks for, however the source hands its bytes over: what a
    # damaged stream yields before its error (and which error) is the same for every delivery
    whole = _Whole(raw)
    if kind == "gzip":
        return _Zlib(whole), kind
    if kind == "bz2":
        return _Read1(bz2.BZ2File(cast(IO[bytes], whole))), kind  # _Whole reads as a file does
    if kind == "xz":
        return _Read1(lzma.LZMAFile(cast(IO[bytes], whole))), kind
    try:
        import zstandard
    except ImportError:
        raise MissingExtraError(
            "this shard is zstd-compressed and reading it needs the zstandard module: "
            "pip install zstandard (or pip install 'wds_cloud[all]' (in a clone: pip install -e '.[all]'))"
        ) from None
    return (
        zstandard.ZstdDecompressor().stream_reader(cast(IO[bytes], whole), read_across_frames=True, closefd=True),
        kind,
    )


def decompression_errors() -> tuple[type[BaseException], ...]:
    """What a decompressor raises on damage: zstandard's error only once that module is loaded (a zstd shard was
    opened; a reader of plain shards never imports it: a DataLoader worker would, each epoch)."""
    errors: list[type[BaseException]] = [EOFError, zlib.error, lzma.LZMAError]
    zstandard = sys.modules.get("zstandard")
    if zstandard is not None:
        errors.append(zstandard.ZstdError)
    return tuple(errors)
