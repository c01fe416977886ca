"""The bytes a tar reader parses: a streamed buffer, and a mapped one, behind one small protocol.

A member source (:class:`~wds_cloud.tar.members.TarMembers`) reads headers and slices members out of ``buf``
from ``pos`` on (``base`` is the tar-stream offset of ``buf[0]``, ``end`` where its bytes end), and asks the
buffer for more only between runs of members, never per member:

- :meth:`StreamBuffer.window` says where the fast path may read to (a chunk, or a window of a mapped shard),
  for a mapping, giving back the pages behind and mapping those ahead;
- :meth:`~StreamBuffer.fill` makes ``need`` bytes available at ``pos`` (the general reader, at a header);
- :meth:`~StreamBuffer.take` and :meth:`~StreamBuffer.skip` hand over or pass a member's data and padding.

:class:`StreamBuffer` reads a (decompressed) stream into one reused buffer, a chunk at a time; members are copied
out of it as ``bytes`` (with views, the bytes read are kept and joined instead, since views point into them).
:class:`MappedBuffer` takes a mapping of a plain tar on local disk as its buffer (see :mod:`wds_cloud.io.mapped`):
every byte is there, a window at a time; a large member is read with one ``pread`` into its own ``bytes`` (one
copy, no page-table work for the mapping), or handed out as a view of the mapping with ``zero_copy``.

Damage is never silent: a stream that ends inside a member, or a decompressor that reports damage, raises
:class:`CorruptShardError` naming the URL, the offset and the member; a source that fails raises
:class:`TransferError` (an ``OSError``, with its errno).
"""

from __future__ import annotations

import errno
import io
import mmap
import os
from typing import IO, Any, Optional, Protocol

from ..errors import CorruptShardError, ObjectChangedError, TransferError, WdsCloudError, redact
from ..io.mapped import drop, populate
from .decompress import FIRST_READ, HEAD_SIZE, decompression_errors, detect_compression
from .format import BLOCK, SHOWN_NAME, padded_size, shown, size_field

__all__ = ["Buffer", "StreamBuffer", "MappedBuffer", "unreadable", "LARGE"]

#: a member's payload is given memory as its bytes arrive, at most this much ahead of them
_PREALLOCATE = 16 << 20
#: after the end-of-archive block, at most this much of a stream is read (tar pads archives to
#: 10 KiB records); a pipe: command is read to its end, so that its exit status is known
_TRAILER_SIZE = 1 << 20
#: a pipe: command's output after the archive is read to its end, up to this much, so that its exit status
#: is known; a command that goes on past it (endless output) is stopped when the shard is closed
_PIPE_TRAILER_SIZE = 16 << 20
#: a member of a mapped shard at least this large is read with ``pread`` into its own bytes, not sliced out of the
#: mapping: the kernel then copies it once from the page cache, with no page-table entry to fill and clear for each
#: of its pages (the slice's cost, which grows with the member)
LARGE = 256 << 10


class Buffer(Protocol):
    """What a member source reads through: ``buf[pos:end]`` holds the bytes not yet used, ``buf[0]`` is at
    ``base`` in the tar stream; asked for more once per chunk or window, never per member."""

    url: str
    chunk: int
    views: bool
    compression: Optional[str]
    buf: Any
    pos: int
    end: int
    base: int
    stream: Any

    @property
    def offset(self) -> int: ...

    def window(self, pos: int) -> int: ...

    def fill(self, need: int) -> bool: ...

    def take(self, size: int, name: str, header_offset: int) -> Any: ...

    def holds(self, size: int) -> bool: ...

    def skip(self, size: int, name: str, header_offset: int) -> None: ...

    def take_view(self, size: int, name: str, header_offset: int) -> memoryview: ...

    def fail(self, what: str, member: Optional[str] = None, offset: Optional[int] = None) -> CorruptShardError: ...

    def damage(self, exc: BaseException) -> Optional[WdsCloudError]: ...

    def finish(self, ranged: bool) -> None: ...

    def close(self) -> None: ...


class _Drained:
    """The stream of a mapped shard: every byte is in the buffer already."""

    def read(self, size: int = -1) -> bytes:
        return b""

    def close(self) -> None:
        pass


_DRAINED = _Drained()


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


def cut_in_data(size: int, got: int, more: str = "") -> str:
    """What a stream cut inside a member's data is: what was expected and what arrived, so a user can tell a cut
    download from a damaged one."""
    return f"the stream ended inside the member's data: expected {more}{_bytes(size)} of data, got {_bytes(got)}"


def cut_in_padding(size: int, got: int) -> str:
    """What a stream cut inside the zeros after a member's (whole) data is."""
    return (
        f"the stream ended inside the padding after the member's {_bytes(size)} of data: expected "
        f"{_bytes((-size) % BLOCK)} of zeros to the next {BLOCK}-byte block, got {_bytes(got)}"
    )


class StreamBuffer:
    """A tar stream read a chunk at a time into one reused buffer (see the module's docstring).

    The first ``chunk`` bytes of a read come ``FIRST_READ``
    bytes at a time (or what a member needs): the first sample of a shard does not wait for a whole chunk over a
    slow link.
    """

    mapping: Any = None

    def __init__(self, url: str, chunk: int, start: int, views: bool) -> None:
        self.url = url
        self.chunk = chunk
        self.views = views
        self.compression: Optional[str] = None
        self.stream: Any = None  # the (decompressed) stream; set when the shard is begun
        self.buf: Any = b""  # bytes read, the reused read buffer, or the mapping
        self.pos = 0
        self.end = 0  # where the bytes in buf end (the reused buffer is larger than what it holds)
        self.base = start  # tar-stream offset of buf[0]
        self._small_until = start + chunk
        #: the buffer a streamed shard is read into, reused from chunk to chunk (members are sliced out of it as
        #: bytes, so nothing points into it); None until the first read, and with views (which do point into it)
        self._store: Any = None
        self._failure: Optional[CorruptShardError] = None  # a stream error held until the bytes before it are used

    @property
    def offset(self) -> int:
        return self.base + self.pos

    def fail(self, what: str, member: Optional[str] = None, offset: Optional[int] = None) -> CorruptShardError:
        """The error for damage at ``offset`` (default: the read position), in ``member`` when known."""
        offset = self.offset if offset is None else offset
        where = f"at byte {offset}" + (" of the decompressed stream" if self.compression else "")
        about = f", member {shown(member, SHOWN_NAME)}" if member else ""  # a hostile long name is 1 MiB
        return CorruptShardError(
            f"{redact(self.url) or '<stream>'}: corrupt tar {where}{about}: {what}. "
            "Re-create or re-download the shard (handler=warn_and_continue skips damaged shards)",
            url=self.url,
            offset=offset,
            member=member,
        )

    def damage(self, exc: BaseException) -> Optional[WdsCloudError]:
        """Our error for a read's error ``exc``: the shard's corruption (a decompressor's report), or an
        ``OSError`` of the source (a file failing with EIO at byte 0, /proc/self/mem, a dying disk, a user's
        stream) with the URL and offset; None: raised as it is."""
        if isinstance(exc, decompression_errors()):
            return self.fail(f"the {self.compression} stream is damaged or ended early ({exc})")
        if isinstance(exc, OSError) and "Invalid data stream" in str(exc):  # bz2 reports corruption so
            return self.fail(f"the {self.compression} stream is damaged ({exc})")
        if isinstance(exc, OSError) and not isinstance(exc, WdsCloudError):
            return unreadable(self.url, self.offset, exc)
        return None

    def read(self, size: int) -> bytes:
        try:
            return self.stream.read(size)
        except Exception as exc:
            damage = self.damage(exc)
            if damage is None:
                raise
            raise damage from exc

    def _read_into(self, view: memoryview) -> int:
        """Read into ``view`` (straight from the stream where it reads into a buffer): how many bytes came."""
        readinto = getattr(self.stream, "readinto", None)
        if readinto is None:
            data = self.read(len(view))
            view[: len(data)] = data
            return len(data)
        try:
            return readinto(view) or 0
        except Exception as exc:
            damage = self.damage(exc)
            if damage is None:
                raise
            raise damage from exc

    def window(self, pos: int) -> int:
        """Where the fast path may read to from ``pos``: the bytes read (a streamed shard)."""
        return self.end

    def fill(self, need: int, exact: bool = False) -> bool:
        """Make ``need`` bytes available at ``pos``; False if the stream ends first.  With ``exact``, no more than
        ``need`` is read (not a chunk ahead).

        A damaged or cut compressed stream raises only once the bytes decompressed before
        the damage are used up, so the complete samples before it are still delivered.
        """
        have = self.end - self.pos
        if have >= need:
            return True  # already there (a mapped shard, or what the last read brought)
        store = self._reading_buffer(need)
        if store is None:
            return self._fill_joined(need, have, exact)
        # the bytes not yet used go to the front of the read buffer, and the stream is read in after them: the
        # buffer is reused, nothing is joined (the members are copied out of it once, as bytes)
        if have and self.buf is store:
            store.move(0, self.pos, have)
        elif have:
            store[0:have] = self.buf[self.pos : self.end]
        self.base += self.pos
        self.buf, self.pos, self.end = store, 0, have
        failure = None
        view = memoryview(store)
        try:
            while have < need:
                if self._failure is not None:
                    failure = self._failure
                    break
                step = 0 if exact else self.chunk if self.base + have >= self._small_until else FIRST_READ
                try:
                    got = self._read_into(view[have : have + min(max(step, need - have), len(store) - have)])
                except CorruptShardError as exc:
                    self._failure = exc
                    continue
                if not got:
                    break
                have += got
                self.end = have
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
            if self.views or self.mapping is not None:
                return None
            store = self._store = mmap.mmap(-1, 2 * max(self.chunk, FIRST_READ) + 2 * BLOCK)
        return store if need <= len(store) - max(self.chunk, FIRST_READ) else None

    def _fill_joined(self, need: int, have: int, exact: bool = False) -> bool:
        """:meth:`fill` by joining the bytes not yet used with those read after them (views, or a large need)."""
        parts = [self.buf[self.pos : self.end]] if have else []
        failure = None
        while have < need:
            if self._failure is not None:
                failure = self._failure
                break
            try:
                step = 0 if exact else self.chunk if self.base + self.pos + have >= self._small_until else FIRST_READ
                data = self.read(max(step, need - have))
            except CorruptShardError as exc:
                self._failure = exc
                continue
            if not data:
                break
            parts.append(data)
            have += len(data)
        self.base += self.pos
        self.buf = parts[0] if len(parts) == 1 else b"".join(parts) if parts else b""
        self.pos, self.end = 0, len(self.buf)
        if failure is not None and have < need:
            raise failure
        return have >= need

    def holds(self, size: int) -> bool:
        """Whether the next ``size`` bytes (and their padding) are all here, known without reading: a mapped
        file's are; a stream's only when the chunk read holds them."""
        return self.end - self.pos >= padded_size(size)

    def take(self, size: int, name: str, header_offset: int) -> Any:
        """The next ``size`` bytes (a member's data), then skip its padding."""
        buf, pos = self.buf, self.pos
        padded = padded_size(size)
        if self.end - pos >= padded:
            self.pos = pos + padded
            return buf[pos : pos + size]
        if size > self.chunk and self.end - pos < size:  # large member: the rest goes straight into the payload
            # (a member whose data is all here already, as a first read larger than a small chunk brings, is not)
            head = buf[pos : self.end]
            data = self._read_payload(head, size, name, header_offset)
            self.base += self.end + size - len(head)
            self.pos = self.end = 0
            # only the padding and the next header are read now: when the next member is large too, none of its
            # data is read ahead into the chunk buffer, to be copied out of it again (it all goes straight into its
            # own payload)
            pad = padded - size
            self.fill(pad + BLOCK, exact=True)
            if self.end < pad:
                raise self.fail(cut_in_padding(size, self.end - self.pos), name, header_offset)
            self.pos = pad
            return data
        if not self.fill(padded):
            got = self.end - self.pos
            if got >= size:  # the data is whole: the cut is in the zero bytes that pad it to a 512-byte block
                raise self.fail(cut_in_padding(size, got - size), name, header_offset)
            raise self.fail(cut_in_data(size, got), name, header_offset)
        data = self.buf[self.pos : self.pos + size]
        self.pos += padded
        return data

    def _read_payload(self, head: bytes, size: int, name: str, header_offset: int) -> bytes:
        """``head`` plus the rest of a ``size``-byte payload read from the stream, as one bytes object.

        The bytes are read into the final object's own buffer (``BytesIO.getbuffer``;
        ``getvalue`` then hands that buffer over without copying), so a large payload is
        copied once, from the stream.  The buffer grows as the bytes arrive (by doubling,
        from at most 16 MiB), so a header claiming gigabytes in a short stream costs
        little memory before the stream's real end is found.
        """
        readinto = getattr(self.stream, "readinto", None)
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
                        raise self.fail(
                            f"the {self.compression} stream is damaged or ended early ({exc})", name, header_offset
                        ) from exc
                    except OSError as exc:
                        damage = self.damage(exc)
                        if damage is None:
                            raise
                        raise damage from exc
                    if not n:
                        raise self.fail(cut_in_data(size, have), name, header_offset)
                    have += n
            finally:
                view.release()
            if have >= size:
                return out.getvalue()
            capacity = min(size, capacity * 2)

    def _read_exact(self, size: int, name: str, header_offset: int) -> bytes:
        parts, have = [], 0
        while have < size:
            data = self.read(size - have)
            if not data:
                raise self.fail(cut_in_data(size, have, "a further "), name, header_offset)
            parts.append(data)
            have += len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def skip(self, size: int, name: str, header_offset: int) -> None:
        """Pass a member's data and padding without keeping them."""
        padded = padded_size(size)
        while padded > 0:
            available = self.end - self.pos
            if available >= padded:
                self.pos += padded
                return
            padded -= available
            self.base += self.end
            self.pos = self.end = 0
            if not self.fill(min(padded, self.chunk)):
                arrived = padded_size(size) - padded + self.end - self.pos
                cut = cut_in_padding(size, arrived - size) if arrived >= size else cut_in_data(size, arrived)
                raise self.fail(cut, name, header_offset)

    def take_view(self, size: int, name: str, header_offset: int) -> memoryview:
        """:meth:`take`, as a read-only view."""
        return memoryview(self.take(size, name, header_offset)).toreadonly()

    def finish(self, ranged: bool) -> None:
        """After the end-of-archive block: read what follows, a bounded amount (a ``pipe:`` command's output to its
        end, up to 16 MiB, so that it can report its exit status)."""
        if ranged or self.stream is None:
            return
        left = _PIPE_TRAILER_SIZE if self.url[:5].lower() == "pipe:" else _TRAILER_SIZE
        while left > 0:
            data = self.read(min(self.chunk, left))
            if not data:
                return
            left -= len(data)

    def close(self) -> None:
        if self.stream is not None:
            try:
                self.stream.close()
            except Exception:
                pass


class MappedBuffer(StreamBuffer):
    """A plain tar on local disk, read through a mapping of the whole file (see the module's docstring)."""

    def __init__(self, source: IO[bytes], found: tuple, streamed: Buffer) -> None:
        super().__init__(streamed.url, streamed.chunk, streamed.base, streamed.views)
        mapping, at, identity = found
        #: what identifies this version of the file (its member table is kept under it)
        self.identity = identity
        self.mapping = mapping
        self._source = source
        self.buf, self.base, self.pos, self.end = mapping, streamed.base - at, at, len(mapping)
        self._dropped = self._populated = at  # pages given back before, and mapped up to, these offsets
        self._asked = self._answered = -1  # the position window() was last asked at, and its answer
        self.stream = _DRAINED  # every byte is in the buffer: a read past it finds the end

    @classmethod
    def of(cls, source: IO[bytes], fresh: bool, streamed: Buffer) -> Optional[MappedBuffer]:
        """The mapping ``source`` offers as a buffer, or None: it offers none, or it holds a compressed stream (a
        resumed read, not ``fresh``, is of a plain tar)."""
        mapping = getattr(source, "mapping", None)
        found = mapping() if mapping is not None else None
        if found is None:
            return None
        buf, at, _ = found
        if fresh and detect_compression(buf[at : at + HEAD_SIZE]) is not None:
            buf.close()
            return None
        return cls(source, found, streamed)

    def window(self, pos: int) -> int:
        """Where the fast path stops (a window of ``chunk`` bytes past ``pos``): the pages read before the last
        window are given back, and those of the window not mapped for the one before are mapped, unless the member
        at ``pos`` is larger than the window (read with one ``pread``).  Asked again at the same position (the
        member table's runs, then the scan), it answers at once.

        Pages are given back every 8 windows read, or where none were mapped for a window since (large members
        one after another: only the pages their headers were read from) every 64: a ``madvise`` per 8 MB member
        cost more than the headers' pages it gave back."""
        if pos == self._asked:
            return self._answered
        window = self.chunk
        end = pos + window
        if self.buf is self.mapping:
            self._check_size()
            behind = pos - self._dropped
            if behind >= 8 * window and (self._populated > self._dropped or behind >= 64 * window):
                drop(self.mapping, self._dropped, pos - window)
                self._dropped = pos - window
            if end > self._populated and self._fits(pos, end):
                populate(self.mapping, max(pos, self._populated), end)
                self._populated = end
        self._asked, self._answered = pos, min(self.end, end)
        return self._answered

    def _fits(self, pos: int, end: int) -> bool:
        """Whether the member whose header is at ``pos`` may end by ``end`` (no: it is read by the general reader,
        and the window's pages are not mapped for it)."""
        if self.views or pos + BLOCK > self.end:
            return True
        try:
            return pos + BLOCK + size_field(self.buf, pos) <= end
        except ValueError:
            return True

    def _check_size(self) -> None:
        """A mapped file cut short in place since it was opened would stop the reader with SIGBUS on its first
        page past the new end: its size is checked before each window is read (a cut between two checks still
        can; shards must not be rewritten in place while read, see wds_cloud.io.mapped)."""
        try:
            size = os.fstat(self._source.fileno()).st_size
        except (AttributeError, OSError, ValueError):
            return
        if size < len(self.buf):
            raise ObjectChangedError(
                f"{redact(self.url) or '<stream>'}: the file was cut short while it was read (it had "
                f"{len(self.buf)} bytes when opened, {size} now, at byte {self.offset}); a shard must not be "
                "rewritten in place while it is read: write a new file and rename it over the old one",
                url=self.url,
                offset=self.offset,
            )

    def take(self, size: int, name: str, header_offset: int) -> Any:
        """The next ``size`` bytes; a large member is read with one ``pread`` (see :data:`LARGE`)."""
        if self.buf is not self.mapping:
            return super().take(size, name, header_offset)
        pos = self._claim(size, name, header_offset)
        if size >= LARGE:
            data = self._pread(size, pos, name, header_offset)
            if data is not None:
                return data
        return self.buf[pos : pos + size]

    def take_view(self, size: int, name: str, header_offset: int) -> memoryview:
        """The next ``size`` bytes as a read-only view of the mapping itself (no copy).  A member larger than the
        window is first checked to lie within the file as it is now: its pages are read only as the view is, and
        a file cut short in place since it was mapped would stop the program there with SIGBUS."""
        if self.buf is not self.mapping:
            return super().take_view(size, name, header_offset)
        pos = self._claim(size, name, header_offset)
        if size > self.chunk:
            self._check_size()
        return memoryview(self.mapping)[pos : pos + size]

    def _claim(self, size: int, name: str, header_offset: int) -> int:
        """Where the next ``size`` bytes begin, the position moved past them and their padding (an error where the
        file ends before them)."""
        pos = self.pos
        padded = padded_size(size)
        got = self.end - pos
        if got < padded:  # the whole file is here: it ends before the member
            if got >= size:
                raise self.fail(cut_in_padding(size, got - size), name, header_offset)
            raise self.fail(cut_in_data(size, got), name, header_offset)
        self.pos = pos + padded
        return pos

    def _pread(self, size: int, pos: int, name: str, header_offset: int) -> Optional[bytes]:
        """``size`` bytes of the file at ``pos`` read into a new bytes object, or None where the source has no
        descriptor to read."""
        try:
            fd = self._source.fileno()
        except (AttributeError, OSError, ValueError):
            return None
        try:
            data = os.pread(fd, size, pos)
        except OSError as exc:
            raise unreadable(self.url, self.base + pos, exc) from exc
        if len(data) < size:  # the file was cut short since it was mapped
            self._check_size()
            raise self.fail(cut_in_data(size, len(data)), name, header_offset)
        return data

    def close(self) -> None:
        mapping, self.mapping, self.buf, self.end = self.mapping, None, b"", 0
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # views of it live on (zero_copy): it is unmapped when the last of them is gone
