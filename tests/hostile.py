"""Builders of hostile and broken tar streams (headers with valid checksums), for the reader's tests and fuzzing."""

from __future__ import annotations

import io
import random
import tarfile
import threading
import tracemalloc
from collections.abc import Callable
from typing import Optional


def header(
    name: bytes,
    size: Optional[int] = None,
    *,
    size_field: Optional[bytes] = None,
    typeflag: bytes = b"0",
    ustar: bool = True,
) -> bytes:
    """A 512-byte header whose checksum is right, whatever its fields say."""
    h = bytearray(512)
    h[0 : min(len(name), 100)] = name[:100]
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    if size_field is None:
        if size is not None and size >= 8**11:
            size_field = b"\x80" + size.to_bytes(11, "big")  # GNU base-256
        else:
            size_field = b"%011o\0" % (size or 0)
    h[124:136] = size_field.ljust(12, b"\0")[:12]
    h[136:148] = b"00000000000\0"
    h[156:157] = typeflag
    if ustar:
        h[257:263] = b"ustar\0"
        h[263:265] = b"00"
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def member(name: str, data: bytes, typeflag: bytes = b"0") -> bytes:
    return header(name.encode(), len(data), typeflag=typeflag) + padded(data)


def pax(records: bytes, typeflag: bytes = b"x") -> bytes:
    """A PAX extended header holding ``records`` as they are (lengths included, right or wrong)."""
    return header(b"././@PaxHeader", len(records), typeflag=typeflag) + padded(records)


def pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode() + body


END = bytes(1024)


def tar_of(samples: list[tuple[str, dict]], fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Zeros(io.RawIOBase):
    """``n`` zero bytes as a stream, without holding them."""

    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        k = min(len(buffer), self.left)
        buffer[:k] = bytes(k)
        self.left -= k
        return k


def bounded(run: Callable[[], object], seconds: float = 120.0) -> dict:
    """Run ``run()`` in a thread; returns {"value"| "error", "peak"} (peak Python memory, bytes).

    The thread join's limit is a safety net against a hang (a correct read takes milliseconds
    even on a loaded machine), so a regression fails the test instead of stalling the suite.
    """
    out: dict = {}

    def target() -> None:
        tracemalloc.start()
        try:
            out["value"] = run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
        finally:
            out["peak"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the reader did not finish: it hangs on this input"
    return out


def _is_header(block: bytes) -> bool:
    try:
        return block != bytes(512) and tarfile.calc_chksums(block)[0] == int(block[148:154], 8)
    except ValueError:
        return False


def mutate_header(data: bytes, rng: random.Random) -> bytes:
    """One header of ``data`` with a field changed and its checksum made right again."""
    offsets = [o for o in range(0, len(data) - 511, 512) if _is_header(data[o : o + 512])]
    if not offsets:
        return data
    o = rng.choice(offsets)
    h = bytearray(data[o : o + 512])
    choice = rng.randrange(6)
    if choice == 0:  # size: any text of 12 bytes, digits, signs, junk, or base-256
        h[124:136] = rng.choice(
            [
                b"-0000001000\0",
                b"77777777777\0",
                b"000000002000",
                b"\x80" + bytes(10) + b"\x07",
                b"\xff" * 12,
                b"12abc\0\0\0\0\0\0\0",
                bytes(rng.randrange(256) for _ in range(12)),
            ]
        )
    elif choice == 1:
        h[156] = rng.choice(b"0123456LKxgS\0A")
    elif choice == 2:
        h[0:100] = bytes(rng.randrange(256) for _ in range(100))
    elif choice == 3:
        h[345:500] = bytes(rng.randrange(32, 127) for _ in range(155))
    elif choice == 4:
        k = rng.randrange(512)
        h[k] = rng.randrange(256)
    else:
        h[124:136] = b"%011o\0" % rng.randrange(0, 1 << 33)
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return data[:o] + bytes(h) + data[o + 512 :]


def insert_pax(data: bytes, rng: random.Random) -> bytes:
    """A PAX header with random (often wrong) records inserted before a member."""
    records = rng.choice(
        [
            b"0 path=x\n",
            b"-7 path=x\n",
            b"999999 path=x\n",
            b"5 a\n",
            b"12 size=-10\n",
            b"14 size=12abc\n",
            pax_record("size", str(rng.randrange(1 << 34))),
            pax_record("path", "x" * rng.randrange(300)),
            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 60))),
        ]
    )
    offsets = list(range(0, max(512, len(data) - 1024), 512))
    o = rng.choice(offsets)
    return data[:o] + pax(records, rng.choice([b"x", b"g"])) + data[o:]


def damage(data: bytes, rng: random.Random) -> tuple[bytes, bool]:
    """``data`` cut at a random point (half the time) or with one bit flipped; returns (data, cut)."""
    if rng.random() < 0.5:
        return data[: rng.randrange(len(data))], True
    k = rng.randrange(len(data))
    return data[:k] + bytes([data[k] ^ (1 << rng.randrange(8))]) + data[k + 1 :], False


#: values a mutated structured file (index, description, manifest, spec, state) may hold where another was
HOSTILE_VALUES = [
    None,
    True,
    False,
    -1,
    0,
    1,
    513,
    10**12,
    10**30,
    -(10**30),
    1.5,
    1e308,
    -0.0,
    "",
    "x",
    "pipe:touch X",
    "../../etc/passwd",
    "/etc/passwd",
    "file:///etc/passwd",
    "a\nb",
    [],
    {},
    [1, 2],
    {"a": 1},
    [[[[[]]]]],
    "x" * 10_000,
]


def json_paths(value, here=()):
    """Every path (a tuple of keys and indexes) into a parsed JSON value, the root's ``()`` first."""
    yield here
    if isinstance(value, dict):
        for k, v in value.items():
            yield from json_paths(v, here + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from json_paths(v, here + (i,))


def mutate_json(doc, rng: random.Random):
    """A copy of ``doc`` with one to three values replaced by hostile ones, keys dropped or numbers nudged."""
    import copy

    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in json_paths(doc) if p]
        if not paths:
            return copy.deepcopy(rng.choice(HOSTILE_VALUES))
        path = rng.choice(paths)
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        last, kind = path[-1], rng.choice(["replace", "drop", "nudge"])
        if kind == "drop" and isinstance(parent, dict):
            del parent[last]
        elif kind == "nudge" and type(parent[last]) is int:
            parent[last] += rng.choice([-1, 1, 511, 512, -512, 10**9])
        else:
            parent[last] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
    return doc


def mutate_text(text: bytes, rng: random.Random) -> bytes:
    """``text`` cut, with bytes flipped, or wrapped in deep nesting."""
    kind = rng.choice(["cut", "flip", "nest"])
    if kind == "cut" and text:
        return text[: rng.randrange(len(text))]
    if kind == "flip" and text:
        data = bytearray(text)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    depth = rng.choice([100, 10_000, 200_000])
    return b"[" * depth + text + b"]" * depth
