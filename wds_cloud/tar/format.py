"""The tar format: every fact of a header, read and written, stated once.

A tar stream is a sequence of 512-byte blocks: each member is a header block, then its data padded to a whole
block; two zero blocks end the archive.  A header holds fixed-width fields (name, size, checksum, type,
ustar magic and name prefix); a GNU long name (type ``L``) or PAX records (``x``, or ``g`` for the whole
archive) before a header give it a longer name or a larger size.

Two readers of a header, each stated once: :func:`plain_header`, the fast path's whole check of a plain member
(the usual spellings of its fields, read where they stand), and the general reader's (:func:`number`,
``tarfile``'s rule for a numeric field, and :func:`checksum_ok`), which takes every header the fast check leaves
to it.  Where the fast check reads a value, it is the general reader's.  The writer (:mod:`wds_cloud.tar.write`) writes with
:func:`octal`, :func:`padded` and :func:`pax_record`.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Optional

from ..errors import SampleError

__all__ = [
    "BLOCK",
    "RECORD",
    "ZERO_BLOCK",
    "END_OF_ARCHIVE",
    "MAX_USTAR_SIZE",
    "MAX_META_SIZE",
    "PLAIN",
    "REGULAR",
    "NO_DATA",
    "GNU_LONGNAME",
    "GNU_LONGLINK",
    "PAX",
    "PAX_GLOBAL",
    "SOLARIS_PAX",
    "DIRECTORY",
    "number",
    "octal",
    "padded",
    "padded_size",
    "size_field",
    "typeflag",
    "checksum_at",
    "sum_matches",
    "checksum_ok",
    "SHOWN",
    "SHOWN_NAME",
    "shown",
    "checksum_problem",
    "size_problem",
    "plain_header",
    "plain_headers",
    "header_name",
    "is_tar_header",
    "plain_member",
    "same_header",
    "pax_records",
    "pax_record",
    "check_header_numbers",
]

BLOCK = 512
#: tar pads an archive to whole records of this size
RECORD = 10240
ZERO_BLOCK = bytes(BLOCK)
END_OF_ARCHIVE = bytes(2 * BLOCK)
#: the largest size ustar's twelve octal digits hold (a larger member needs a PAX ``size`` record)
MAX_USTAR_SIZE = 8**11 - 1
#: the largest metadata record read (a GNU long name, a PAX header): real ones are a few hundred bytes
MAX_META_SIZE = 1 << 20

#: the type flags of a plain regular member, which the fast path takes: ``b"0"`` and ``b"\0"``
PLAIN = (48, 0)
#: regular members: plain, and ``b"7"`` (a contiguous file)
REGULAR = (48, 0, 55)
#: links, devices, directories and fifos: ``b"1"`` to ``b"6"``, no data of their own
NO_DATA = (49, 50, 51, 52, 53, 54)
GNU_LONGNAME, GNU_LONGLINK, PAX, PAX_GLOBAL = 76, 75, 120, 103  # L K x g
#: an old GNU sparse member (``S``): not read (its data is a map of holes), skipped as other types are
GNU_SPARSE = 83
#: Solaris' extended header (``X``), read as a local PAX header, as ``tarfile`` reads it
SOLARIS_PAX = 88
#: a directory (``5``): an old-style regular member (type ``\0``) whose name ends with ``/`` is one, as for tarfile
DIRECTORY = 53

# where the fields lie in a header
_SIZE, _SIZE_END = 124, 136
_CHECKSUM, _CHECKSUM_END = 148, 156
_TYPE = 156
_MAGIC = 257
_PREFIX, _PREFIX_END = 345, 500


def padded_size(size: int) -> int:
    """The bytes a member's data takes in the stream: ``size`` rounded up to a whole block."""
    return (size + 511) & ~511


def number(field: bytes) -> int:
    """A numeric header field read as ``tarfile`` reads it: octal text up to the first NUL (all of it when there is
    none), white space around it stripped, or GNU base-256 for very large values; may be negative.  ValueError when
    it is neither."""
    if field and field[0] in (0x80, 0xFF):  # the two lead bytes tarfile takes (another is not a number)
        value = int.from_bytes(field[1:], "big")
        return value - (1 << (8 * len(field) - 8)) if field[0] == 0xFF else value
    # stripped as a str, as tarfile strips it (\x1c-\x1f count as white space there, not in bytes.strip)
    text = field.split(b"\0", 1)[0].decode("ascii", "strict").strip()
    return int(text, 8) if text else 0


def size_field(buf: Any, pos: int = 0) -> int:
    """The size field of the header at ``pos``, read by :func:`number` (the general reader's rule; a pending PAX
    ``size`` record overrides it, see :func:`pax_size`)."""
    return number(buf[pos + _SIZE : pos + _SIZE_END])


def typeflag(header: Any, pos: int = 0) -> int:
    """The type flag of the header at ``pos`` (a byte: see :data:`REGULAR`, :data:`NO_DATA` and the metadata
    types)."""
    return header[pos + _TYPE]


def checksum_at(buf: Any, pos: int) -> int:
    """The stored checksum of the header at ``pos``, up to its first NUL as ``tarfile`` reads it (its usual
    spelling, six digits and a NUL, read at once); ValueError where it is not a number."""
    if buf[pos + 154] == 0:
        return int(buf[pos + _CHECKSUM : pos + 154], 8)
    nul = buf.find(b"\0", pos + _CHECKSUM, pos + _CHECKSUM_END)
    return int(buf[pos + _CHECKSUM : nul if nul >= 0 else pos + _CHECKSUM_END], 8)


def sum_matches(view: Any, pos: int, stored: int) -> bool:
    """Whether ``stored`` is the unsigned sum of the header at ``pos`` (the checksum field counted as spaces).

    adler32's first half is 1 + the byte sum modulo 65521, computed in C; the true sum is below 2 * 65521, so the
    stored value is one of two: exact for a header summing below 65521 (any with fewer than a dozen bytes over
    127), and for a crafted one a checksum 65521 off is taken, by every read path alike (a checksum is not a
    signature)."""
    total = (
        (zlib.adler32(view[pos + _TYPE : pos + BLOCK], zlib.adler32(view[pos : pos + _CHECKSUM])) & 0xFFFF) - 1
    ) % 65521
    return stored == total + 256 or stored == total + 65777


def checksum_ok(header: bytes) -> bool:
    """Whether a header's checksum holds, read as ``tarfile`` reads it: the unsigned sum, or the signed one some
    old writers used."""
    try:
        stored = number(header[_CHECKSUM:_CHECKSUM_END])
    except ValueError:
        return False
    if sum_matches(memoryview(header), 0, stored):
        return True
    signed = sum(b - 256 if b > 127 else b for b in header[:_CHECKSUM]) + sum(
        b - 256 if b > 127 else b for b in header[_TYPE:BLOCK]
    )
    return stored == signed + 256


#: the most bytes of a header field an error message shows (a hostile header's, escaped: see :func:`shown`)
SHOWN = 40
#: the most characters of a member name an error message shows (real names run longer than a field's bytes)
SHOWN_NAME = 200


def shown(raw: Any, limit: int = SHOWN) -> str:
    """Bytes of a header (or a name) for an error message: their ``repr``, which escapes every control byte and
    character (a hostile header cannot move a terminal's cursor), cut to ``limit`` bytes or characters."""
    raw = raw if isinstance(raw, str) else bytes(raw)
    if len(raw) <= limit:
        return repr(raw)
    return f"{raw[:limit]!r}... ({len(raw)} {'characters' if isinstance(raw, str) else 'bytes'})"


def checksum_problem(header: bytes) -> str:
    """What is wrong with a header whose checksum does not hold (:func:`checksum_ok` False): the checksum field's
    bytes, the value they store, and the value they should store (the sum of the header's bytes)."""
    field = header[_CHECKSUM:_CHECKSUM_END]
    total = sum(header[:_CHECKSUM]) + 8 * 32 + sum(header[_TYPE:BLOCK])
    expected = f"its bytes sum to {total} (octal {total:06o}, the checksum field counted as eight spaces)"
    try:
        stored = number(field)
    except ValueError:
        return (
            f"the header checksum does not match: the checksum field {shown(field)} is not an octal number, {expected}"
        )
    return (
        f"the header checksum does not match: the header stores {stored} (octal {stored:06o}, the field "
        f"{shown(field)}), {expected}"
    )


def size_problem(header: bytes, size: Optional[int] = None) -> str:
    """What is wrong with a header's size field: the bytes found, and what a size field holds.  ``size`` is the
    negative value the field read as; None: :func:`number` does not read it."""
    field = shown(header[_SIZE:_SIZE_END])
    if size is not None:
        return f"the header gives a negative size ({size}, the size field {field}): expected 0 or more"
    return (
        f"the size field {field} is not an octal number (expected octal digits ended by a NUL or a space, as tar "
        "writes b'00000001750\\x00' for 1000 bytes, or GNU base-256)"
    )


#: the fields the fast path reads from a header, in one call: the name, the size's first eleven digits and the
#: byte after them, the checksum's six digits and the two bytes after them, the type flag and the prefix's first byte
_PLAIN_FIELDS = struct.Struct("100s24x11sB12x6sBBB188xB")
#: what the usual spellings of a size (eleven octal digits) and of a checksum (six digits, as ``due`` in
#: plain_headers) read as, for those met so far (a shard of small samples repeats a few sizes, and checksums fall in a
#: narrow range): a dict lookup instead of parsing the number; each holds at most _KNOWN spellings (parsed as usual
#: past that: the memory is bounded whatever the shards)
_KNOWN_SIZES: dict = {}
_KNOWN_SUMS: dict = {}
_KNOWN = 4096


def plain_headers(
    buf: Any, pos: int, end: int, max_member: int, names: list, heads: list, sizes: list, one: bool = False
) -> int:
    """The plain members whose headers and padded data lie in ``buf[pos:end]``, one after another from ``pos``:
    each one's name, header offset and size appended to ``names``, ``heads`` and ``sizes``, until a header the
    fast path may not take (see :func:`plain_header`) or a member past ``end``; returns where it stopped.  With
    ``one``, the header at ``pos`` alone is read, wherever its data lies.

    Its check is :func:`plain_header`'s, written out in one loop (it runs per member of a shard of tiny samples):
    each header's fields come out of one ``struct`` call, and its checksum is one C pass over the block
    (:func:`sum_matches`'s rule, the checksum field's own bytes taken back out of the sum)."""
    unpack = _PLAIN_FIELDS.unpack_from
    known, known_sums = _KNOWN_SIZES, _KNOWN_SUMS
    view = memoryview(buf)
    try:
        while pos + 512 <= end:
            raw, digits, after, sum_digits, sum_end, sum_pad, flag, prefix = unpack(buf, pos)
            if flag not in PLAIN or prefix:
                break
            try:
                if after == 0 or after == 32:
                    size = known.get(digits, -1)
                    if size < 0:
                        size = int(digits, 8)
                        if len(known) < _KNOWN:
                            known[digits] = size
                else:
                    size = int(buf[pos + _SIZE : pos + _SIZE_END], 8)
                # ``due``: the stored checksum less 255, plus the checksum field's own bytes (taken back out of the
                # block's sum below); -1 where the stored value is out of range
                if sum_end == 0:  # the usual spelling: six digits and a NUL
                    due = known_sums.get(sum_digits)
                    if due is None:
                        stored = int(sum_digits, 8)
                        due = stored - 255 + sum(sum_digits) if 0 <= stored - 256 < 131042 else -1
                        if len(known_sums) < _KNOWN:
                            known_sums[sum_digits] = due
                    if due < 0:
                        break
                    due += sum_pad
                else:
                    stored = checksum_at(buf, pos)
                    if not 0 <= stored - 256 < 131042:
                        break
                    due = stored - 255 + sum(buf[pos + _CHECKSUM : pos + _CHECKSUM_END])
            except ValueError:
                break
            nxt = pos + 512 + ((size + 511) & ~511)
            # the sum of the block with its checksum field counted as spaces, modulo 65521 as adler32's first half
            # gives it (see sum_matches): the stored value is taken at that sum, or 65521 above it
            if (
                not 0 <= size <= max_member
                or (due - (zlib.adler32(view[pos : pos + 512]) & 0xFFFF)) % 65521
                or (nxt > end and not one)
            ):
                break
            name = raw.partition(b"\0")[0].decode("utf-8", "surrogateescape")
            if not flag and name[-1:] == "/":
                break  # an old-style directory (see DIRECTORY)
            names.append(name)
            heads.append(pos)
            sizes.append(size)
            pos = nxt
            if one:
                break
    finally:
        view.release()
    return pos


def plain_header(buf: Any, view: Any, pos: int, max_member: int) -> Optional[tuple[str, int]]:
    """``(name, size)`` of the member whose header is at ``pos`` when the fast path may take it: a plain regular
    member (type ``0``) of at most ``max_member`` bytes, its size and checksum in their usual spellings,
    the checksum right, no name prefix; else None (the general reader takes it, and says what is wrong
    with it).  ``view`` is a memoryview of ``buf``.

    The size is read in its usual spellings, the twelve digits or eleven when a NUL or a space ends them: where
    that reads a value it is :func:`number`'s (tests check every byte at the end), and where it cannot, the
    general reader asks :func:`number`.  The checksum's usual spelling (six digits and a NUL) is read here, any
    other by :func:`checksum_at`.  The fast path reads whole runs of headers with :func:`plain_headers`, this
    check written out in one loop."""
    names: list = []
    sizes: list = []
    if plain_headers(buf, pos, pos + 512, max_member, names, [], sizes, True) == pos:
        return None
    return names[0], sizes[0]


def header_name(header: bytes) -> str:
    """A header's own name: the name field, joined to the prefix field when there is one (as ``tarfile`` joins
    it, whatever the header's magic: GNU's long-name and sparse headers, which keep other data there, never
    name a member themselves)."""
    end = header.find(0, 0, 100)
    raw = header[:end] if end >= 0 else header[:100]
    if header[_PREFIX] != 0 and header[_TYPE] not in (GNU_LONGNAME, GNU_LONGLINK, GNU_SPARSE):
        pend = header.find(0, _PREFIX, _PREFIX_END)
        raw = header[_PREFIX : pend if pend >= 0 else _PREFIX_END] + b"/" + raw
    return raw.decode("utf-8", "surrogateescape")


def is_tar_header(block: bytes) -> bool:
    """Whether ``block`` is a whole tar header whose checksum holds."""
    return len(block) >= BLOCK and checksum_ok(bytes(block[:BLOCK]))


def plain_member(header: bytes) -> Optional[tuple[str, int]]:
    """``(name, size)`` when ``header`` is a plain regular member's (checksum right, type ``0``, no long
    name or PAX record before it is needed); None for anything else, which the general reader handles."""
    if len(header) != BLOCK:
        return None
    found = plain_header(header, memoryview(header), 0, 1 << 62)
    if found is not None or header[_TYPE] not in PLAIN:
        return found
    try:  # the spellings the fast check leaves to the general reader (base-256, a NUL inside the digits)
        size = number(header[_SIZE:_SIZE_END])
    except ValueError:
        return None
    if size < 0 or not checksum_ok(header):
        return None
    return header_name(header), size


def same_header(buf: Any, head: int, name: str, size: int) -> bool:
    """Whether the header at ``head`` is still a plain member's named ``name`` of ``size`` bytes (a member table's
    entry, checked at the two ends of each run: the type, the name and the size, read by :func:`size_field`)."""
    encoded = name.encode("utf-8", "surrogateescape")
    if buf[head + _TYPE] not in PLAIN or buf[head : head + len(encoded)] != encoded:
        return False
    if len(encoded) < 100 and buf[head + len(encoded)] != 0:
        return False
    try:
        return size_field(buf, head) == size
    except ValueError:
        return False


def pax_records(payload: bytes) -> dict[str, str]:
    """PAX records ``"<length> <key>=<value>\\n"``; each length must cover its whole record (ValueError saying
    which is not)."""
    records: dict[str, str] = {}
    pos = 0
    end = len(payload)
    while pos < end:
        if payload[pos] == 0:  # NUL padding after the last record
            break
        space = payload.find(b" ", pos, min(end, pos + 21))
        digits = payload[pos:space] if space > pos else b""
        if not digits.isdigit():
            raise ValueError(
                f"a PAX header record at byte {pos} of the header has no valid length: it begins "
                f"{shown(payload[pos : pos + 21])}, expected decimal digits and a space"
            )
        length = int(digits)
        if length <= space - pos + 1 or pos + length > end or payload[pos + length - 1] != 10:
            raise ValueError(
                f"a PAX header record at byte {pos} of the header claims a length of {length}, "
                "which does not end at its newline inside the header"
            )
        key, equals, value = payload[space + 1 : pos + length - 1].partition(b"=")
        if not equals:
            raise ValueError(
                f"a PAX header record at byte {pos} of the header has no '=': it is "
                f"{shown(payload[pos : pos + length])}, expected <length> <key>=<value> and a newline"
            )
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def pax_size(text: str) -> int:
    """A PAX ``size`` record's value: decimal digits only (ValueError for anything else).  Stricter than
    ``tarfile``, which takes what Python's ``int()`` takes (spaces around, ``_`` between digits): no writer
    spells a size so, and a reader of hostile input refuses what it need not guess at."""
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"the PAX size record {text[:40]!r} is not a non-negative decimal number")
    return int(text)


def padded(value: bytes, width: int) -> bytes:
    """A text field of ``width`` bytes: ``value`` cut to fit, NULs after it."""
    return value[:width].ljust(width, b"\0")


def octal(value: int, width: int) -> bytes:
    """A numeric field of ``width`` bytes: octal digits and a NUL (what :func:`number` reads back)."""
    return b"%0*o\0" % (width - 1, value)


def pax_record(key: bytes, value: bytes) -> bytes:
    """One PAX record, its length counting its own digits (what :func:`pax_records` reads back)."""
    body = b" " + key + b"=" + value + b"\n"
    length = len(body) + 1
    while len(str(length).encode()) + len(body) != length:
        length = len(str(length).encode()) + len(body)
    return str(length).encode() + body


def check_header_numbers(**values: Any) -> None:
    """Refuse ``mode``/``uid``/``gid``/``mtime`` values that ustar's fixed-width octal fields cannot hold
    (they would make a header that tarfile rejects)."""
    tops = {"mode": 0o7777777, "uid": 8**7 - 1, "gid": 8**7 - 1, "mtime": 8**11 - 1}
    for what, value in values.items():
        top = tops[what]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= int(value) <= top:
            raise SampleError(
                f"{what}={value!r} does not fit a tar header: give a whole number from 0 to {top}"
                + (" (mtime: seconds since 1970, before the year 2242)" if what == "mtime" else "")
            )
