"""Writing tar members fast and reproducibly, optionally compressed.

Headers are ustar, built from a template: only the name, size and checksum
change per member.  A name that does not fit ustar's 100+155 bytes, or a size of
8 GiB or more, gets a PAX extended header (``format="pax"``, the default) or a GNU
long-name member (``format="gnu"``); ``format="ustar"`` refuses them.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from typing import IO, Any, Optional, Protocol, Union

from ..errors import ConfigError, MissingExtraError, SampleError
from .format import BLOCK, END_OF_ARCHIVE, MAX_USTAR_SIZE, RECORD, check_header_numbers, octal, padded, pax_record

__all__ = ["MemberWriter", "Compressor", "compression_for", "END_OF_ARCHIVE", "RECORD"]

_FORMATS = {"ustar", "gnu", "pax"}


class ByteSink(Protocol):
    """Where members are written: a binary file, or a :class:`Compressor` over one."""

    def write(self, data: bytes, /) -> int: ...


class MemberWriter:
    """Writes regular-file members to a binary stream, with one header template."""

    def __init__(
        self,
        stream: ByteSink,
        *,
        mtime: int = 0,
        mode: int = 0o444,
        uid: int = 0,
        gid: int = 0,
        user: str = "bigdata",
        group: str = "bigdata",
        format: Optional[str] = None,
    ) -> None:
        if format is None:
            format = "pax"
        elif not isinstance(format, str):
            format = {0: "ustar", 1: "gnu", 2: "pax"}.get(format, format)  # tarfile's constants
        if format not in _FORMATS:
            raise ConfigError(f"format must be 'ustar', 'gnu' or 'pax', not {format!r}")
        check_header_numbers(mode=mode, uid=uid, gid=gid, mtime=mtime)
        self.format = format
        self.stream = stream
        self._write = stream.write
        # Header template: name(100) mode(8) uid(8) gid(8) size(12) mtime(12) chksum(8) type(1) link(100)
        # magic(6) version(2) uname(32) gname(32) devmajor(8) devminor(8) prefix(155) pad(12)
        self._mid = octal(mode, 8) + octal(uid, 8) + octal(gid, 8)
        self._after_size = octal(int(mtime), 12)
        self._tail = (
            b"0"
            + bytes(100)
            + b"ustar\x0000"
            + padded(user.encode(), 32)
            + padded(group.encode(), 32)
            + octal(0, 8)
            + octal(0, 8)
        )
        # Every header byte but name, size, checksum and prefix is fixed: sum it once.
        self._fixed_sum = sum(self._mid) + sum(self._after_size) + sum(self._tail) + 8 * 32

    def _header(self, name: bytes, size: int, typeflag: bytes = b"0", prefix: bytes = b"") -> bytes:
        size_field = octal(size, 12)
        tail = self._tail if typeflag == b"0" else typeflag + self._tail[1:]
        checksum = self._fixed_sum + sum(name) + sum(size_field) + sum(prefix) + (typeflag[0] - 48)
        return b"".join(
            (
                name.ljust(100, b"\0"),
                self._mid,
                size_field,
                self._after_size,
                b"%06o\0 " % checksum,
                tail,
                prefix.ljust(155, b"\0"),
                bytes(12),
            )
        )

    def _split(self, name: bytes) -> Optional[tuple[bytes, bytes]]:
        """ustar name/prefix split of a long name, or None when it cannot fit."""
        if len(name) <= 100:
            return name, b""
        if len(name) > 256:
            return None
        cut = name.find(b"/", len(name) - 101)
        while cut != -1 and cut <= 155:
            if len(name) - cut - 1 <= 100 and cut > 0:
                return name[cut + 1 :], name[:cut]
            cut = name.find(b"/", cut + 1)
        return None

    def add(self, name: str, data: Union[bytes, bytearray, memoryview]) -> int:
        """Write one member; returns the bytes written (headers, data and padding).

        ``name`` is written as UTF-8, its escaped bytes (U+DC80-U+DCFF, as the reader gives names that are not
        UTF-8, a latin-1 ``caf\\xe9.txt``) as the bytes they stand for: a name read is written back byte for byte.
        """
        raw = name.encode("utf-8", "surrogateescape")
        size = len(data)
        written = 0
        prefix = b""
        split = self._split(raw) if size <= MAX_USTAR_SIZE else None
        if split is None or size > MAX_USTAR_SIZE:
            written += self._extended(name, raw, size)
            short = raw[:100]
        else:
            short, prefix = split
        header = self._header(short, size if size <= MAX_USTAR_SIZE else 0, prefix=prefix)
        padding = -size % BLOCK
        write = self._write
        write(header)
        write(data)  # type: ignore[arg-type]  # a bytes-like object: the stream takes any buffer
        if padding:
            write(bytes(padding))
        return written + BLOCK + size + padding

    def _extended(self, name: str, raw: bytes, size: int) -> int:
        if self.format == "ustar":
            raise SampleError(
                f"the member name {name!r} ({len(raw)} bytes) does not fit a ustar header "
                "(100 bytes, or 255 split at a '/'); use format='pax' or 'gnu', or a shorter key"
            )
        if self.format == "gnu":
            if size > MAX_USTAR_SIZE:
                raise SampleError(f"member {name!r} is {size} bytes, too large for format='gnu' here; use format='pax'")
            payload = raw + b"\0"
            header = self._header(b"././@LongLink", len(payload), b"L")
        else:
            records = b""
            if len(raw) > 100:
                if not _is_utf8(raw):
                    # PAX values are UTF-8 unless this record, first, says they are bytes as they stand (as tarfile
                    # and GNU tar write and read a name that is not UTF-8)
                    records += pax_record(b"hdrcharset", b"BINARY")
                records += pax_record(b"path", raw)
            if size > MAX_USTAR_SIZE:
                records += pax_record(b"size", str(size).encode())
            payload = records
            header = self._header(b"PaxHeader/" + raw[-80:].replace(b"/", b"_"), len(payload), b"x")
        padding = -len(payload) % BLOCK
        self._write(header)
        self._write(payload)
        if padding:
            self._write(bytes(padding))
        return BLOCK + len(payload) + padding

    def finish(self, written: int) -> int:
        """Write the end-of-archive blocks, padded to a whole 10 KiB record like tar does."""
        total = written + len(END_OF_ARCHIVE)
        padding = -total % RECORD
        self._write(END_OF_ARCHIVE + bytes(padding))
        return len(END_OF_ARCHIVE) + padding


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def compression_for(name: str) -> Optional[str]:
    """The compression a file name asks for: .tgz/.tar.gz, .tar.bz2, .tar.xz, .tar.zst."""
    lowered = name.lower()
    for suffixes, kind in (
        ((".tgz", ".tar.gz", ".gz"), "gz"),
        ((".tar.bz2", ".tbz2", ".bz2"), "bz2"),
        ((".tar.xz", ".txz", ".xz"), "xz"),
        ((".tar.zst", ".tzst", ".zst"), "zstd"),
    ):
        if lowered.endswith(suffixes):
            return kind
    return None


class _Compressing(Protocol):
    def compress(self, data: bytes, /) -> bytes: ...

    def flush(self) -> bytes: ...


class Compressor:
    """A write stream that compresses into ``raw``; counts the compressed bytes written."""

    def __init__(self, raw: IO[bytes], kind: str, level: Optional[int] = None) -> None:
        self.raw = raw
        self.kind = kind
        self.compressed = 0
        self._c: _Compressing
        if kind in ("gz", "gzip"):
            self._c = zlib.compressobj(6 if level is None else level, zlib.DEFLATED, 31)  # gzip, mtime 0
        elif kind == "bz2":
            self._c = bz2.BZ2Compressor(9 if level is None else level)
        elif kind == "xz":
            self._c = lzma.LZMACompressor(preset=6 if level is None else level)
        elif kind in ("zst", "zstd"):
            try:
                import zstandard
            except ImportError:
                raise MissingExtraError("writing .tar.zst needs zstandard: pip install zstandard") from None
            self._c = zstandard.ZstdCompressor(level=3 if level is None else level).compressobj()
        else:
            raise ConfigError(f"unknown compression {kind!r}: use 'gz', 'bz2', 'xz' or 'zstd'")
        self._pending: list[bytes] = []
        self._pending_size = 0

    def write(self, data: Any) -> int:
        # Small writes are gathered: calling the compressor per tar header costs more than the copy.
        self._pending.append(data)
        self._pending_size += len(data)
        if self._pending_size >= 1 << 16:
            self._push()
        return len(data)

    def _push(self) -> None:
        if self._pending:
            out = self._c.compress(b"".join(self._pending))
            self._pending, self._pending_size = [], 0
            if out:
                self.raw.write(out)
                self.compressed += len(out)

    def tell(self) -> int:
        return self.compressed

    def finish(self) -> None:
        """Write the end of the compressed stream; ``raw`` stays open."""
        self._push()
        out = self._c.flush()
        if out:
            self.raw.write(out)
            self.compressed += len(out)

    def close(self) -> None:
        self.finish()
        self.raw.close()

    def abort(self) -> None:
        abort = getattr(self.raw, "abort", None)
        if abort is not None:
            abort()
        else:
            self.raw.close()
