"""Our tar reader: regular members of a (possibly compressed) tar stream, fast.

Python's ``tarfile`` costs tens of microseconds per member; this reader parses
the 512-byte headers straight out of large chunks read from the stream and
slices payloads out of them (one copy).  It understands ustar name prefixes,
GNU long names (``L``), PAX extended headers (``path``, ``size``), skips
non-regular members, verifies every header checksum, and detects gzip, bz2,
xz and zstd compression from the first bytes of the stream.

Damage is never silent: a bad checksum, a stream that ends inside a member
or before the end-of-archive block, or a compressed stream that ends early
raise :class:`CorruptShardError` naming the URL, the byte offset (in the
uncompressed tar stream), the member when known, and what was wrong.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import zlib
from collections.abc import Callable, Iterator
from typing import IO, Any, Optional

from ..errors import CorruptShardError, ObjectChangedError, TransferError, WdsCloudError, redact
from ..io.mapped import drop, populate
from . import table as tables
from .decompress import (
    CHUNK,
    FIRST_READ,
    HEAD_SIZE,
    Prefixed,
    Readable,
    decompression_errors,
    detect_compression,
    open_decompressed,
)
from .format import (
    BLOCK,
    GNU_LONGNAME,
    MAX_META_SIZE,
    NO_DATA,
    PAX,
    PAX_GLOBAL,
    REGULAR,
    ZERO_BLOCK,
    checksum_at,
    checksum_ok,
    header_name,
    number,
    pax_records,
    pax_size,
    same_header,
)
from .table import MemberTable, Recorder

__all__ = [
    "TarMembers",
    "END",
    "sample_too_large",
    "unreadable",
    "CHUNK",
    "MAX_META_SIZE",
]

#: a member's payload is given memory as its bytes arrive, at most this much ahead of them
_PREALLOCATE = 16 << 20
#: after the end-of-archive block, at most this much of a stream is read (tar pads archives to
#: 10 KiB records); a pipe: command is read to its end, so that its exit status is known
_TRAILER_SIZE = 1 << 20
#: a pipe: command's output after the archive is read to its end, up to this much, so that its exit status
#: is known; a command that goes on past it (endless output) is stopped when the shard is closed
_PIPE_TRAILER_SIZE = 16 << 20
_END = object()


class _Drained:
    """The stream of a mapped shard: every byte is in the buffer already."""

    def read(self, size: int = -1) -> bytes:
        return b""

    def close(self) -> None:
        pass


_DRAINED = _Drained()


#: what :meth:`TarMembers.next_member` returns at the end of the archive
END = _END


def sample_too_large(url: Any, start: int, end: int, limit: int, member: Optional[str] = None) -> CorruptShardError:
    """The error for a sample that spans more than ``limit`` bytes, from byte ``start`` to ``end`` (and on)."""
    about = f" with the member {member[:200]!r}" if member is not None else ""
    return CorruptShardError(
        f"{redact(url) or '<stream>'}: the sample beginning at byte {start} grows past the limit of {limit} bytes on "
        f"one sample{about} (it runs on past byte {start + limit}): a shard whose members share one key would fill "
        "memory. "
        "Raise the limit with WDS_MAX_SAMPLE_SIZE (such as 8GiB) or WebDataset(..., max_sample_size=) if the shard "
        "is trusted; to skip such shards pass handler=warn_and_continue",
        url=url,
        offset=start,
        member=member,
        size=end - start,
        limit=limit,
    )


def unreadable(url: Any, offset: int, exc: OSError) -> TransferError:
    """Our error for an ``OSError`` a shard's source raised while read (an ``OSError`` still, with its errno):
    the URL, the byte, what failed and what to do."""
    where = redact(url) if url else "<stream>"
    code = f" ({errno.errorcode.get(exc.errno, exc.errno)})" if exc.errno else ""
    # the errno of the failure where it has one (EIO, EISDIR, ...): code that catches OSError reads it
    known = {"errno": exc.errno, "strerror": exc.strerror} if exc.errno else {}
    return TransferError(
        f"{where}: reading failed at byte {offset}: {exc.strerror or exc}{code}; the file or stream cannot be "
        "read as a shard (a special file such as /proc/self/mem, a failing disk or network file system, or a "
        "stream that broke): name a regular file or object whose bytes `cat` can read, or copy the shard to a "
        "working disk",
        url=url,
        offset=offset,
        **known,
    )


def _bytes(n: int) -> str:
    return f"{n} byte" + ("" if n == 1 else "s")


def _cut_in_data(size: int, got: int, more: str = "") -> str:
    """What a stream cut inside a member's data is: what was expected and what arrived, so a user can tell a cut download from a damaged one."""
    return f"the stream ended inside the member's data: expected {more}{_bytes(size)} of data, got {_bytes(got)}"


def _cut_in_padding(size: int, got: int) -> str:
    """What a stream cut inside the zeros after a member's (whole) data is."""
    return (
        f"the stream ended inside the padding after the member's {_bytes(size)} of data: expected "
        f"{_bytes((-size) % BLOCK)} of zeros to the next {BLOCK}-byte block, got {_bytes(got)}"
    )


class TarMembers:
    """Iterate over ``(name, data)`` for the regular members of a tar stream.

    ``select(name)`` returning False skips a member without copying it.
    ``offset`` after iteration is where the reader stopped; ``member_offset``
    is the header offset of the member last yielded and ``record_start`` the
    offset of its first header (a GNU long name or PAX header comes before the
    member's own); ``archive_end`` is the offset of the end-of-archive block once
    reached.  All offsets are in the (decompressed) tar stream.

    ``start`` says that ``stream`` begins at that offset of a plain tar, at a
    header (a resumed read: no compression is detected there); ``pax_global``
    restores the global PAX records in force at that point.  With
    ``ranged=True`` the stream is a byte range of whole members and may end
    at a header boundary without the end-of-archive block.

    Hostile headers cannot make it spin or allocate by claim: every size and
    record length is checked (negative, malformed or past its record is
    :class:`CorruptShardError`), a member larger than ``max_member`` bytes is
    refused before it is read, metadata records are capped at
    :data:`MAX_META_SIZE`, and a payload gets memory as its bytes arrive.
    Iteration stops at the end-of-archive block; :meth:`finish` reads what
    follows (a bounded amount: a ``pipe:`` command's output to its end, unless it goes on without end).
    """

    def __init__(
        self,
        stream: IO[bytes],
        url: str = "",
        select: Optional[Callable[[str], bool]] = None,
        chunk: int = CHUNK,
        *,
        start: int = 0,
        pax_global: Optional[dict] = None,
        ranged: bool = False,
        max_member: Optional[int] = None,
        views: bool = False,
    ) -> None:
        self.url = url
        #: members come out as read-only memoryviews (of the mapping, or of the bytes read), not bytes
        self.views = views
        #: the shard is read through a mapping of the file (see :mod:`wds_cloud.io.mapped`), not streamed
        self.mapped = False
        self._mapping: Any = None
        self._dropped = 0  # the mapping's pages before this offset were given back
        self._populated = 0  # the mapping's pages from the last window's start to this offset were mapped
        self._begun = False
        #: the member table of this version of the file, kept from an earlier pass (see wds_cloud.tar.table)
        self.table: Optional[MemberTable] = None
        self._identity: Any = None
        self._recorder: Optional[Recorder] = None  # this pass's table, while it reads from the start
        self._unkeyed = False  # the table has no split names for this pass (see keyed_run)
        self.max_member = max_member
        self.chunk = chunk
        #: small members are read ``FIRST_READ`` bytes at a time (or what the member needs) over the first
        #: ``chunk`` bytes of a read, then ``chunk`` at a time: the first sample of a shard does not wait
        #: for a whole chunk to arrive over a slow link
        self._small_until = start + chunk
        self.select = select
        self.compression: Optional[str] = None
        self._source = stream
        self._stream: Optional[Readable] = None if not start and not ranged else Prefixed(b"", stream)
        self._ranged = ranged
        self._buf: Any = b""  # bytes read, the reused read buffer (_store), or the mapping of a mapped shard
        self._end = 0  # where the bytes in _buf end (the read buffer is larger than what it holds)
        #: the buffer a streamed shard is read into, reused from chunk to chunk (members are sliced out of it as
        #: bytes, so nothing points into it); None until the first read, and with views (which do point into it)
        self._store: Any = None
        self._pos = 0
        self._base = start  # tar-stream offset of _buf[0]
        self.member_offset = start
        self.record_start = start
        self.archive_end: Optional[int] = None
        self._extended = False  # a long name or local PAX header began the current record
        self._record_begin = start
        self._failure: Optional[CorruptShardError] = None  # a stream error held until the bytes before it are used
        self._special = False  # a long name or PAX records apply to the next header
        self._long_name: Optional[str] = None
        self._pax: dict[str, str] = {}
        self._pax_global: dict[str, str] = dict(pax_global or {})
        #: the sample limit (bytes of tar stream one sample may span; None: none) and where the current
        #: sample began, which the grouping loop sets once per sample (see :func:`~.samples.shard_samples`)
        self.max_sample: Optional[int] = None
        self.sample_start = start
        if self._pax_global:
            self._pax = dict(self._pax_global)
            self._special = True

    @property
    def offset(self) -> int:
        return self._base + self._pos

    def _fail(self, what: str, member: Optional[str] = None, offset: Optional[int] = None) -> CorruptShardError:
        offset = self.offset if offset is None else offset
        where = f"at byte {offset}" + (" of the decompressed stream" if self.compression else "")
        about = f", member {member!r}" if member else ""
        return CorruptShardError(
            f"{redact(self.url) or '<stream>'}: corrupt tar {where}{about}: {what}. "
            "Re-create or re-download the shard; to skip damaged shards pass handler=warn_and_continue",
            url=self.url,
            offset=offset,
            member=member,
        )

    def _read(self, size: int) -> bytes:
        try:
            return self._stream.read(size)  # type: ignore[union-attr]  # only after begin(): per chunk, no check
        except Exception as exc:
            damage = self._damage(exc)
            if damage is None:
                raise
            raise damage from exc

    def _read_into(self, view: memoryview) -> int:
        """Read into ``view`` (straight from the stream where it reads into a buffer): how many bytes came."""
        readinto = getattr(self._stream, "readinto", None)
        if readinto is None:
            data = self._read(len(view))
            view[: len(data)] = data
            return len(data)
        try:
            return readinto(view) or 0
        except Exception as exc:
            damage = self._damage(exc)
            if damage is None:
                raise
            raise damage from exc

    def _damage(self, exc: Exception) -> Optional[WdsCloudError]:
        """Our error for a read's error ``exc``: the shard's corruption (a decompressor's report), or an
        ``OSError`` of the source (a file failing with EIO at byte 0, /proc/self/mem, a dying disk, a user's
        stream) with the URL and offset; None: raised as it is."""
        if isinstance(exc, decompression_errors()):
            return self._fail(f"the {self.compression} stream is damaged or ended early ({exc})")
        if isinstance(exc, OSError) and "Invalid data stream" in str(exc):  # bz2 reports corruption so
            return self._fail(f"the {self.compression} stream is damaged ({exc})")
        if isinstance(exc, OSError) and not isinstance(exc, WdsCloudError):
            return unreadable(self.url, self.offset, exc)
        return None

    def _check_sample(self) -> None:
        """The sample limit, checked as the stream is read on (every MiB or large member): the bound on what one
        sample makes the reader hold; the grouping loops check it exactly, at every member."""
        if self.max_sample is not None and self.member_offset - self.sample_start > self.max_sample:
            raise sample_too_large(self.url, self.sample_start, self.member_offset, self.max_sample)

    def _fill(self, need: int) -> bool:
        """Make ``need`` bytes available at ``_pos``; False if the stream ends first.

        A damaged or cut compressed stream raises only once the bytes decompressed before
        the damage are used up, so the complete samples before it are still delivered.
        """
        self._check_sample()
        have = self._end - self._pos
        if have >= need:
            return True  # already there (a mapped shard, or what the last read brought)
        store = self._reading_buffer(need)
        if store is None:
            return self._fill_joined(need, have)
        # the bytes not yet used go to the front of the read buffer, and the stream is read in after them: the
        # buffer is reused, nothing is joined (the members are copied out of it once, as bytes)
        if have and self._buf is store:
            store.move(0, self._pos, have)
        elif have:
            store[0:have] = self._buf[self._pos : self._end]
        self._base += self._pos
        self._buf, self._pos, self._end = store, 0, have
        failure = None
        view = memoryview(store)
        try:
            while have < need:
                if self._failure is not None:
                    failure = self._failure
                    break
                step = self.chunk if self._base + have >= self._small_until else FIRST_READ
                try:
                    got = self._read_into(view[have : have + min(max(step, need - have), len(store) - have)])
                except CorruptShardError as exc:
                    self._failure = exc
                    continue
                if not got:
                    break
                have += got
                self._end = have
        finally:
            view.release()
        if failure is not None and have < need:
            raise failure
        return have >= need

    def _reading_buffer(self, need: int) -> Any:
        """The reused read buffer (made on first use: room for a chunk and a read after it), or None where a
        streamed read keeps joining what it reads: members handed out as views point into what was read, and a
        need larger than the buffer."""
        store = self._store
        if store is None:
            if self.views or self.mapped:
                return None
            store = self._store = mmap.mmap(-1, 2 * max(self.chunk, FIRST_READ) + 2 * BLOCK)
        return store if need <= len(store) - max(self.chunk, FIRST_READ) else None

    def _fill_joined(self, need: int, have: int) -> bool:
        """:meth:`_fill` by joining the bytes not yet used with those read after them (views, or a large need)."""
        parts = [self._buf[self._pos : self._end]] if have else []
        failure = None
        while have < need:
            if self._failure is not None:
                failure = self._failure
                break
            try:
                step = self.chunk if self._base + self._pos + have >= self._small_until else FIRST_READ
                data = self._read(max(step, need - have))
            except CorruptShardError as exc:
                self._failure = exc
                continue
            if not data:
                break
            parts.append(data)
            have += len(data)
        self._base += self._pos
        self._buf = parts[0] if len(parts) == 1 else b"".join(parts) if parts else b""
        self._pos, self._end = 0, len(self._buf)
        if failure is not None and have < need:
            raise failure
        return have >= need

    def _take(self, size: int, name: str, header_offset: int) -> bytes:
        """The next ``size`` bytes (a member's payload), then skip its padding."""
        buf, pos = self._buf, self._pos
        padded = size + (-size) % 512
        if self._end - pos >= padded:
            self._pos = pos + padded
            return buf[pos : pos + size]
        if buf is self._mapping and self._mapping is not None:  # the whole file is here: it ends before the member
            got = self._end - pos
            if got >= size:
                raise self._fail(_cut_in_padding(size, got - size), name, header_offset)
            raise self._fail(_cut_in_data(size, got), name, header_offset)
        if size > self.chunk and self._end - pos < size:  # large member: the rest goes straight into the payload
            # (a member whose data is all here already, as a first read larger than a small chunk brings, is not)
            head = buf[pos : self._end]
            data = self._read_payload(head, size, name, header_offset)
            self._base += self._end + size - len(head)
            self._pos = self._end = 0
            pad = (-size) % 512
            if pad:
                if not self._fill(pad):
                    raise self._fail(_cut_in_padding(size, self._end - self._pos), name, header_offset)
                self._pos = pad
            return data
        if not self._fill(padded):
            got = self._end - self._pos
            if got >= size:  # the data is whole: the cut is in the zero bytes that pad it to a 512-byte block
                raise self._fail(_cut_in_padding(size, got - size), name, header_offset)
            raise self._fail(_cut_in_data(size, got), name, header_offset)
        data = self._buf[self._pos : self._pos + size]
        self._pos += padded
        return data

    def _read_payload(self, head: bytes, size: int, name: str, header_offset: int) -> bytes:
        """``head`` plus the rest of a ``size``-byte payload read from the stream, as one bytes object.

        The bytes are read into the final object's own buffer (``BytesIO.getbuffer``;
        ``getvalue`` then hands that buffer over without copying), so a large payload is
        copied once, from the stream.  The buffer grows as the bytes arrive (by doubling,
        from at most 16 MiB), so a header claiming gigabytes in a short stream costs
        little memory before the stream's real end is found.
        """
        readinto = getattr(self._stream, "readinto", None)
        if readinto is None:
            return head + self._read_exact(size - len(head), name, header_offset)
        out = io.BytesIO()
        have = len(head)
        capacity = min(size, max(have, _PREALLOCATE))
        while True:
            out.seek(capacity - 1)
            out.write(b"\0")
            view = out.getbuffer()
            try:
                if head:
                    view[: len(head)] = head
                    head = b""
                while have < capacity:
                    try:
                        n = readinto(view[have:capacity])
                    except decompression_errors() as exc:
                        raise self._fail(
                            f"the {self.compression} stream is damaged or ended early ({exc})", name, header_offset
                        ) from exc
                    except OSError as exc:
                        damage = self._damage(exc)
                        if damage is None:
                            raise
                        raise damage from exc
                    if not n:
                        raise self._fail(_cut_in_data(size, have), name, header_offset)
                    have += n
            finally:
                view.release()
            if have >= size:
                return out.getvalue()
            capacity = min(size, capacity * 2)

    def _read_exact(self, size: int, name: str, header_offset: int) -> bytes:
        parts, have = [], 0
        while have < size:
            data = self._read(size - have)
            if not data:
                raise self._fail(_cut_in_data(size, have, "a further "), name, header_offset)
            parts.append(data)
            have += len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _skip(self, size: int, name: str, header_offset: int) -> None:
        padded = size + (-size) % 512
        while padded > 0:
            available = self._end - self._pos
            if available >= padded:
                self._pos += padded
                return
            padded -= available
            self._base += self._end
            self._pos = self._end = 0
            if not self._fill(min(padded, self.chunk)):
                arrived = size + (-size) % 512 - padded + self._end - self._pos
                cut = _cut_in_padding(size, arrived - size) if arrived >= size else _cut_in_data(size, arrived)
                raise self._fail(cut, name, header_offset)

    @property
    def pax_global(self) -> dict:
        """The global PAX records in force (needed to resume a read in the middle of the archive)."""
        return dict(self._pax_global)

    def begin(self) -> None:
        """Map the shard where its stream offers it (a plain tar on local disk), else detect the compression;
        read the first block (done by iteration when not called)."""
        if self._begun:
            return
        self._begun = True
        fresh = self._stream is None
        if not self._ranged and self._map(fresh):
            pass
        elif fresh:
            try:
                self._stream, self.compression = open_decompressed(self._source)
            except OSError as exc:  # the first bytes could not be read at all
                damage = self._damage(exc)
                if damage is None:
                    raise
                raise damage from exc
        if fresh:
            if not self._fill(512):
                got = self._end
                raise self._fail(
                    "the stream is empty (not a tar archive)"
                    if not got
                    else f"the stream has only {got} bytes (not a tar archive)"
                )

    def _map(self, fresh: bool) -> bool:
        """Take the mapping the source stream offers as the buffer (True), unless it holds a compressed
        stream (then it is read as one); a resumed read (not ``fresh``) is of a plain tar."""
        mapping = getattr(self._source, "mapping", None)
        found = mapping() if mapping is not None else None
        if found is None:
            return False
        buf, at, identity = found
        if fresh and detect_compression(buf[at : at + HEAD_SIZE]) is not None:
            buf.close()
            return False
        self._identity = identity
        table = tables.lookup(identity)
        if table is not None and table.largest <= (self.max_member if self.max_member is not None else 1 << 62):
            self.table = table
        elif at == 0 and tables.worth_recording(identity):
            self._recorder = Recorder()
        self._mapping = buf
        self._buf, self._base, self._pos, self._end = buf, self._base - at, at, len(buf)
        self._dropped = self._populated = at
        self._stream = _DRAINED  # every byte is in the buffer: a read past it finds the end
        self.mapped = True
        return True

    def _window(self, pos: int) -> int:
        """Where the fast path stops in a mapped shard (a window of ``chunk`` bytes past ``pos``): the sample
        limit is checked once per window, the pages read before the last window are given back, and those of
        the window not mapped for the one before are mapped."""
        self._check_sample()
        window = self.chunk
        end = pos + window
        if self._buf is self._mapping:
            self._check_size()
            if pos - self._dropped >= 8 * window:
                drop(self._mapping, self._dropped, pos - window)
                self._dropped = pos - window
            if end > self._populated:
                populate(self._mapping, max(pos, self._populated), end)
                self._populated = end
        return min(self._end, end)

    def _check_size(self) -> None:
        """A mapped file cut short in place since it was opened would stop the reader with SIGBUS on its first
        page past the new end: its size is checked before each window is read (a cut between two checks still
        can; shards must not be rewritten in place while read, see wds_cloud.io.mapped)."""
        try:
            size = os.fstat(self._source.fileno()).st_size
        except (AttributeError, OSError, ValueError):
            return
        if size < len(self._buf):
            raise ObjectChangedError(
                f"{redact(self.url) or '<stream>'}: the file was cut short while it was read (it had "
                f"{len(self._buf)} bytes when opened, {size} now, at byte {self.offset}); a shard must not be "
                "rewritten in place while it is read: write a new file and rename it over the old one",
                url=self.url,
                offset=self.offset,
            )

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        if not self._begun:
            self.begin()
        select = self.select
        adler32 = zlib.adler32
        max_member = self.max_member if self.max_member is not None else 1 << 62
        views = self.views
        # a filter that only drops __meta__ members is asked only about names that begin as they do
        meta_only = getattr(select, "meta_only", False)
        while True:
            # this pass's table, compacted between windows (and dropped once it outgrows the bound: see Recorder)
            recorder = self._recorder
            if recorder is not None and not recorder.flush():
                recorder = self._recorder = None
            # Fast path: plain ustar/GNU headers of regular members lying wholly in the buffer.
            buf, pos, base = self._buf, self._pos, self._base
            mv = memoryview(buf)
            end = self._window(pos) if self.mapped else self._end
            if self._special:
                end = 0  # a long name or PAX records apply to the next header: the slow path reads it
            first = pos
            straddles = False  # a plain member runs past the window's end (not the buffer's)
            while pos + 512 <= end:
                try:
                    # the size: all twelve digits unless the last is a NUL or a space, as tarfile reads it (another
                    # byte there makes int() refuse: the general reader says what is wrong); the checksum up to its
                    # first NUL (see _checksum_field)
                    size = int(buf[pos + 124 : pos + (136 if buf[pos + 135] not in (0, 32) else 135)], 8)
                    stored = int(buf[pos + 148 : pos + 154], 8) if buf[pos + 154] == 0 else checksum_at(buf, pos)
                except ValueError:
                    break
                if not 0 <= size <= max_member:
                    break  # the slow path says what is wrong
                r = ((adler32(mv[pos + 156 : pos + 512], adler32(mv[pos : pos + 148])) & 0xFFFF) - 1) % 65521 + 256
                if (
                    (stored != r and stored != r + 65521)
                    or buf[pos + 156] not in (48, 0)
                    or (buf[pos + 345] and buf[pos + 257 : pos + 262] == b"ustar")
                ):
                    break
                start = pos + 512
                nxt = start + ((size + 511) & ~511)
                if nxt > end:
                    straddles = pos > first and end < self._end
                    break
                name_end = buf.find(b"\0", pos, pos + 100)
                name = buf[pos : name_end if name_end >= 0 else pos + 100].decode("utf-8", "surrogateescape")
                header_pos = pos
                pos = self._pos = nxt
                if recorder is not None:
                    recorder.names.append(name)
                    recorder.heads.append(header_pos)
                    recorder.sizes.append(size)
                if select is not None and (not meta_only or name[:2] == "__") and not select(name):
                    continue
                self.member_offset = self.record_start = base + header_pos
                yield name, mv[start : start + size] if views else buf[start : start + size]
            else:  # the next header runs past the window's end
                straddles = pos > first and end < self._end
            mv.release()
            self._pos = pos
            if straddles:  # a mapped shard: the next window starts at its header (and the table records it)
                continue
            item = self._next_slow()
            if item is _END:
                self._ended()
                return
            if item is not None:
                yield item

    def plain_run(self) -> Optional[tuple[list, list, list]]:
        """The next run of plain members of a mapped shard, read in one tight pass over their headers: ``(names,
        header positions in the buffer, sizes)``, each header checked as the fast path checks it, the members the
        filter drops left out; the read position moves past them.  None where the next header needs the general
        reader (:meth:`next_member`): not mapped, a long name or PAX record pending, another type of member, a
        ustar prefix, an unusual size or checksum field, a member past the window, the end blocks, damage.

        A run spans at most one window (``chunk`` bytes, or one member): the sample limit is checked and the
        pages behind are given back between runs, as the fast path does."""
        if not self.mapped or self._special or self._buf is not self._mapping:
            return None
        if self.table is not None:
            return self._table_run()
        buf, pos = self._buf, self._pos
        end = self._window(pos)
        max_member = self.max_member if self.max_member is not None else 1 << 62
        find = buf.find
        view = memoryview(buf)
        adler32 = zlib.adler32
        names: list = []
        heads: list = []
        sizes: list = []
        # the header checks of __iter__'s fast path, inlined as there (a call per member would cost it)
        try:
            while pos + 512 <= end:
                try:  # the size and checksum fields read as __iter__ reads them (see there)
                    size = int(buf[pos + 124 : pos + (136 if buf[pos + 135] not in (0, 32) else 135)], 8)
                    stored = int(buf[pos + 148 : pos + 154], 8) if buf[pos + 154] == 0 else checksum_at(buf, pos)
                except ValueError:
                    break
                if not 0 <= size <= max_member:
                    break
                total = ((adler32(view[pos + 156 : pos + 512], adler32(view[pos : pos + 148])) & 0xFFFF) - 1) % 65521
                if (
                    (stored != total + 256 and stored != total + 65777)
                    or buf[pos + 156] not in (48, 0)
                    or (buf[pos + 345] and buf[pos + 257 : pos + 262] == b"ustar")
                ):
                    break
                nxt = pos + 512 + ((size + 511) & ~511)
                if nxt > end:
                    break
                name_end = find(b"\0", pos, pos + 100)
                names.append(buf[pos : name_end if name_end >= 0 else pos + 100].decode("utf-8", "surrogateescape"))
                heads.append(pos)
                sizes.append(size)
                pos = nxt
        finally:
            view.release()
        if not heads:
            return None
        self._pos = pos
        recorder = self._recorder
        if recorder is not None:
            recorder.names += names
            recorder.heads += heads
            recorder.sizes += sizes
            if not recorder.flush():  # a table larger than the bound: nothing more is recorded for this pass
                self._recorder = None
        return self._taken(names, heads, sizes)

    def _table_run(self) -> Optional[tuple[list, list, list]]:
        """The next run from the member table (see :meth:`plain_run`)."""
        assert self.table is not None
        pos = self._pos
        run = self.table.run(pos, self._window(pos))
        if run is None:
            return None
        names, heads, sizes, end = run
        if not (
            same_header(self._buf, heads[0], names[0], sizes[0])
            and same_header(self._buf, heads[-1], names[-1], sizes[-1])
        ):
            # the file is not what the table was made of (rewritten in place within its clock's tick): the
            # table is dropped and the shard read header by header
            tables.drop(self._identity)
            self.table = None
            return None
        self._pos = end
        return self._taken(names, heads, sizes)

    def keyed_run(self) -> Optional[tuple[list, list, Any, Any]]:
        """The next run from the member table with each member's key and field already split out (the default
        key rule, field names lower-cased: :meth:`MemberTable.keyed`): ``(keys, field names, header positions in
        the buffer, sizes)``.  None where :meth:`plain_run` must be asked instead: no table, a table
        whose names need the rule run on them, a filter other than the metadata one, or no run at the position."""
        table = self.table
        if table is None or self._special or self._buf is not self._mapping:
            return None
        select = self.select
        if self._unkeyed or (select is not None and not getattr(select, "meta_only", False)):
            return None
        keyed = table.keyed()
        if keyed is None:
            self._unkeyed = True  # asked once per pass (no room now, or names the rule cannot split)
            return None
        pos = self._pos
        span = table.span(pos, self._window(pos))
        if span is None:
            return None
        i, j, end = span
        heads, sizes = table.heads, table.sizes
        if not (
            same_header(self._buf, heads[i], table.name(i), sizes[i])
            and same_header(self._buf, heads[j - 1], table.name(j - 1), sizes[j - 1])
        ):
            tables.drop(self._identity)  # as in _table_run
            self.table = None
            return None
        self._pos = end
        self.member_offset = self.record_start = self._base + heads[j - 1]
        keys, fields = keyed
        return keys[i:j], fields[i:j], heads[i:j], sizes[i:j]

    def _taken(self, names: list, heads: list, sizes: list) -> tuple[list, list, list]:
        """A run taken: the members the filter keeps, and the offsets of the last of them (a member the filter
        drops moves no offset, as in the member-by-member read: the sample limit never counts it)."""
        select = self.select
        if select is not None:
            meta_only = getattr(select, "meta_only", False)
            keep = [i for i, name in enumerate(names) if (meta_only and name[:2] != "__") or select(name)]
            if len(keep) < len(names):
                names, heads, sizes = [names[i] for i in keep], [heads[i] for i in keep], [sizes[i] for i in keep]
        if heads:
            self.member_offset = self.record_start = self._base + heads[-1]
        return names, heads, sizes

    def next_member(self) -> Any:
        """The next member through the general reader: ``(name, data)``, None (nothing to yield: metadata, a
        member of another type, one the filter drops), or :data:`END` at the end of the archive."""
        item = self._next_slow()
        if item is _END:
            self._ended()
        return item

    def _ended(self) -> None:
        """The end of the archive was reached: the table this pass recorded is kept (see wds_cloud.tar.table)."""
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            tables.keep(self._identity, recorder)

    @property
    def buffer(self) -> Any:
        """What the read position indexes (the mapping of a mapped shard)."""
        return self._buf

    @property
    def base(self) -> int:
        """The tar-stream offset of the buffer's first byte."""
        return self._base

    def _next_slow(self):
        """Handle one header in full generality: returns (name, data), None (nothing to yield), or _END."""
        if self._end - self._pos < 512 and not self._fill(512):
            got = self._end - self._pos
            if self._ranged and not got and not self._extended:
                return _END
            if got and not self._buf[self._pos : self._end].strip(b"\0"):
                what = f"inside the end-of-archive marker: expected 1024 zero bytes, got {_bytes(got)}"
            elif got:
                what = f"inside a member's header: expected a {BLOCK}-byte header block, got {_bytes(got)}"
            else:
                what = "without the tar end-of-archive marker (two 512-byte blocks of zeros)"
            raise self._fail(f"the stream ended {what} (the shard is truncated)")
        pos = self._pos
        header = self._buf[pos : pos + 512]
        header_offset = self._base + pos
        if header[0] == 0 and header == ZERO_BLOCK:
            self.archive_end = header_offset
            self._pos = pos + 512
            return _END
        if not self._extended:
            self._record_begin = header_offset
        if not checksum_ok(header):
            hint = (
                "this is not a tar archive"
                if header_offset == 0 and self.compression is None
                else "the header checksum does not match"
            )
            raise self._fail(hint, None, header_offset)
        self._pos = pos + 512
        typeflag = header[156]
        size = self._header_size(header, header_offset)
        name = self._header_name(header)
        if typeflag in (GNU_LONGNAME, PAX, PAX_GLOBAL):
            self._metadata(typeflag, size, name, header_offset)
            return None
        # This header consumes the pending long name and PAX records.
        self._long_name = None
        self._pax = dict(self._pax_global)
        self._special = bool(self._pax)
        self._extended = False
        if typeflag in REGULAR:
            if self.select is not None and not self.select(name):
                self._skip(size, name, header_offset)
                return None
            if self.max_member is not None and size > self.max_member:
                raise CorruptShardError(
                    f"{redact(self.url) or '<stream>'}: member {name!r} at byte {header_offset} is {size} bytes, "
                    f"more than the limit of {self.max_member} bytes on one member; raise it with "
                    "WDS_MAX_MEMBER_SIZE (such as 8GiB) or WebDataset(..., max_member_size=) if the shard is "
                    "trusted",
                    url=self.url,
                    offset=header_offset,
                    member=name,
                    size=size,
                    limit=self.max_member,
                )
            data = self._take(size, name, header_offset)
            self.member_offset = header_offset
            self.record_start = self._record_begin
            return name, self._view(data, size) if self.views else data
        if typeflag not in NO_DATA:  # links, devices, dirs, fifos carry no data
            self._skip(size, name, header_offset)
        return None

    def _view(self, data: bytes, size: int) -> memoryview:
        """A member just taken (``size`` bytes ending where its padding begins), as a read-only view: of the
        mapping itself when it came from there (no copy), else of ``data``."""
        if self._buf is self._mapping and self._mapping is not None:
            begin = self._pos - (size + (-size) % 512)
            return memoryview(self._mapping)[begin : begin + size]
        return memoryview(data).toreadonly()

    def _header_size(self, header: bytes, header_offset: int) -> int:
        """The member size a header gives (a pending PAX ``size`` record overrides it), checked."""
        try:
            size = number(header[124:136])
        except ValueError:
            raise self._fail("the size field is not a number", None, header_offset) from None
        if "size" in self._pax:
            try:
                size = pax_size(self._pax["size"])
            except ValueError as exc:
                raise self._fail(str(exc), None, header_offset) from None
        if size < 0:
            raise self._fail(f"the header gives a negative size ({size})", None, header_offset)
        return size

    def _header_name(self, header: bytes) -> str:
        """The member name: a pending GNU long name, else a PAX ``path``, else the header's (ustar prefix joined)."""
        if self._long_name is not None:
            return self._long_name
        if "path" in self._pax:
            return self._pax["path"]
        return header_name(header)

    def _metadata(self, typeflag: int, size: int, name: str, header_offset: int) -> None:
        """Read a GNU long name or PAX record set, which applies to the next header (global PAX: to all)."""
        if size > MAX_META_SIZE:
            raise self._fail(
                f"a metadata record (type {chr(typeflag)!r}) claims {size} bytes, more than the "
                f"{MAX_META_SIZE} allowed for long names and PAX headers",
                None,
                header_offset,
            )
        if typeflag == GNU_LONGNAME:
            self._long_name = (
                self._take(size, name, header_offset).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            )
            self._special = self._extended = True
            return
        records = self._parse_pax(self._take(size, name, header_offset), header_offset)
        if typeflag == PAX_GLOBAL:
            self._pax_global.update(records)
            self._pax = dict(self._pax_global)
        else:
            self._pax.update(records)
            self._extended = True
        # Records pile up over consecutive headers (a global one stays in force for the whole archive):
        # what is in force is capped like one record set, or a stream of small headers would fill memory.
        held = sum(len(k) + len(v) for k, v in self._pax.items())
        if held > MAX_META_SIZE:
            raise self._fail(
                f"the PAX records in force hold {held} bytes, more than the {MAX_META_SIZE} allowed "
                "(consecutive or global PAX headers piling up records)",
                None,
                header_offset,
            )
        self._special = bool(self._pax)

    def _parse_pax(self, payload: bytes, header_offset: int) -> dict[str, str]:
        try:
            return pax_records(payload)
        except ValueError as exc:
            raise self._fail(str(exc), None, header_offset) from None

    def finish(self) -> None:
        """After the end-of-archive block: read what follows, a bounded amount (a ``pipe:`` command's
        output to its end, up to 16 MiB, so that it can report its exit status).  Called once the last sample
        was delivered, so a stream that trickles on after the archive never delays it."""
        if self.archive_end is None or self._ranged or self._stream is None:
            return
        left = _PIPE_TRAILER_SIZE if self.url[:5].lower() == "pipe:" else _TRAILER_SIZE
        while left > 0:
            data = self._read(min(self.chunk, left))
            if not data:
                return
            left -= len(data)

    def close(self) -> None:
        if self._mapping is not None:
            mapping, self._mapping, self._buf, self._end = self._mapping, None, b"", 0
            try:
                mapping.close()
            except BufferError:
                pass  # views of it live on (zero_copy): it is unmapped when the last of them is gone
        for stream in (self._stream, self._source):
            if stream is not None:
                try:
                    stream.close()
                except Exception:
                    pass
