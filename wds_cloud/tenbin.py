"""``tenbin``: webdataset's binary format for lists of numpy arrays (``.ten`` files and fields).

A buffer is a sequence of chunks, each ``b"~TenBin~"``, a little-endian int64
byte count, and the bytes padded with zeros to a multiple of 64.  Each array
is two chunks: a header of int64 words (dtype code and an info label as
8-byte ASCII, the number of dimensions, the dimensions) and the raw data.

Every numpy numeric dtype and ``bool`` is supported (webdataset's table
misspells ``uint32`` and so cannot encode it).
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterable, Sequence
from typing import IO, Any, Optional

import numpy as np

__all__ = ["encode_buffer", "decode_buffer", "read", "write", "save", "load", "encode_list", "decode_list", "MAGIC"]

MAGIC = b"~TenBin~"
_LEN = struct.Struct("<q")
_CODES = {
    "float16": "f2",
    "float32": "f4",
    "float64": "f8",
    "int8": "i1",
    "int16": "i2",
    "int32": "i4",
    "int64": "i8",
    "uint8": "u1",
    "uint16": "u2",
    "uint32": "u4",
    "uint64": "u8",
    "bool": "b1",
    "complex64": "c8",
    "complex128": "c16",
}
_DTYPES = {code: np.dtype(name) for name, code in _CODES.items()}


def _word(text: str) -> bytes:
    raw = text.encode("ascii")
    if len(raw) > 8:
        raise ValueError(f"tenbin labels are at most 8 ASCII characters, got {text!r}")
    return raw.ljust(8, b"\0")


def _unword(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("ascii")


def _roundup(n: int, k: int = 64) -> int:
    return (n + k - 1) // k * k


def _header(a: np.ndarray, info: str) -> bytes:
    name = a.dtype.name
    if name not in _CODES:
        raise ValueError(f"tenbin cannot encode dtype {name}; supported: {', '.join(sorted(_CODES))}")
    if a.ndim >= 10:
        raise ValueError(f"tenbin arrays have at most 9 dimensions, got {a.ndim}")
    dims = np.array([a.ndim, *a.shape], dtype="<i8").tobytes()
    return _word(_CODES[name]) + _word(info) + dims


def encode_list(arrays: Sequence[np.ndarray], infos: Optional[Sequence[str]] = None) -> list[bytes]:
    """Header and data chunks (unframed) for each array."""
    infos = list(infos) if infos is not None else [""]
    if len(infos) not in (1, len(arrays)):
        raise ValueError(f"{len(infos)} infos for {len(arrays)} arrays")
    chunks: list[bytes] = []
    for i, a in enumerate(arrays):
        a = np.ascontiguousarray(a)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        chunks += [_header(a, infos[i % len(infos)]), a.tobytes()]
    return chunks


def decode_list(chunks: Sequence[bytes], infos: bool = False) -> Any:
    """Arrays from alternating header and data chunks (and their infos when ``infos=True``)."""
    arrays, labels = [], []
    for header, data in zip(chunks[::2], chunks[1::2]):
        code = _unword(bytes(header[:8]))
        if code not in _DTYPES:
            raise ValueError(f"tenbin header names unknown dtype code {code!r}")
        ndim = _LEN.unpack_from(header, 16)[0]
        shape = tuple(np.frombuffer(header, dtype="<i8", count=ndim, offset=24).tolist())
        arrays.append(np.frombuffer(data, dtype=_DTYPES[code], count=int(np.prod(shape))).reshape(shape))
        labels.append(_unword(bytes(header[8:16])))
    return (arrays, labels) if infos is True else arrays


def _frame(chunks: Iterable[bytes]) -> bytearray:
    chunks = list(chunks)
    out = bytearray(sum(16 + _roundup(len(c)) for c in chunks))
    pos = 0
    for c in chunks:
        out[pos : pos + 8] = MAGIC
        _LEN.pack_into(out, pos + 8, len(c))
        out[pos + 16 : pos + 16 + len(c)] = c
        pos += 16 + _roundup(len(c))
    return out


def _unframe(buf: Any) -> list:
    view = memoryview(buf).cast("B")
    chunks, pos = [], 0
    while pos < len(view):
        if bytes(view[pos : pos + 8]) != MAGIC:
            raise ValueError(f"tenbin: no chunk magic at byte {pos} (not a tenbin buffer, or damaged)")
        n = _LEN.unpack_from(view, pos + 8)[0]
        if n < 0 or pos + 16 + n > len(view):
            raise ValueError(f"tenbin: chunk at byte {pos} claims {n} bytes, the buffer has {len(view) - pos - 16}")
        chunks.append(view[pos + 16 : pos + 16 + n])
        pos += 16 + _roundup(n)
    return chunks


def encode_buffer(arrays: Sequence[np.ndarray], infos: Optional[Sequence[str]] = None) -> bytearray:
    """One buffer holding ``arrays``."""
    if not isinstance(arrays, (list, tuple)):
        raise ValueError("encode_buffer takes a list of arrays")
    return _frame(encode_list(arrays, infos))


def decode_buffer(buf: Any, infos: bool = False) -> Any:
    """The arrays of a buffer made by :func:`encode_buffer`."""
    return decode_list(_unframe(buf), infos=infos)


def _write_chunk(stream: IO[bytes], data: bytes) -> None:
    stream.write(MAGIC)
    stream.write(_LEN.pack(len(data)))
    stream.write(data)
    stream.write(b"\0" * (_roundup(len(data)) - len(data)))


def _read_chunk(stream: IO[bytes]) -> Optional[bytes]:
    magic = stream.read(8)
    if not magic:
        return None
    if magic != MAGIC:
        raise ValueError("tenbin: chunk magic does not match (not a tenbin stream, or damaged)")
    n = _LEN.unpack(stream.read(8))[0]
    data = stream.read(n)
    if len(data) != n:
        raise ValueError(f"tenbin: stream ended inside a chunk ({len(data)} of {n} bytes)")
    stream.read(_roundup(n) - n)
    return data


def write(stream: IO[bytes], arrays: Sequence[np.ndarray], infos: Optional[Sequence[str]] = None) -> None:
    """Write ``arrays`` to a binary stream."""
    for chunk in encode_list(arrays, infos):
        _write_chunk(stream, chunk)


def read(stream: IO[bytes], n: int = sys.maxsize, infos: bool = False) -> Any:
    """Read up to ``n`` arrays from a binary stream."""
    chunks: list = []
    for _ in range(n):
        header = _read_chunk(stream)
        if header is None:
            break
        data = _read_chunk(stream)
        if data is None:
            raise ValueError("tenbin: stream ended after an array header")
        chunks += [header, data]
    return decode_list(chunks, infos=infos)


def save(fname: str, *arrays: np.ndarray, infos: Optional[Sequence[str]] = None, nocheck: bool = False) -> None:
    """Save arrays to a ``.ten`` file."""
    if not nocheck and not fname.endswith(".ten"):
        raise ValueError(f"{fname!r}: tenbin files end in .ten (pass nocheck=True to use another name)")
    with open(fname, "wb") as stream:
        write(stream, arrays, infos=infos)


def load(fname: str, infos: bool = False, nocheck: bool = False) -> Any:
    """Load the arrays of a ``.ten`` file."""
    if not nocheck and not fname.endswith(".ten"):
        raise ValueError(f"{fname!r}: tenbin files end in .ten (pass nocheck=True to use another name)")
    with open(fname, "rb") as stream:
        return read(stream, infos=infos)
