"""The members of a tar stream: our reader, fast, over a streamed or a mapped buffer.

Python's ``tarfile`` costs tens of microseconds per member; this reader parses the 512-byte headers straight out
of large chunks of the stream (or a mapping of a local file) and slices the members out of them (one copy).  It
understands ustar name prefixes, GNU long names (``L``), PAX extended headers (``path``, ``size``; global ones
too), skips members of other types, verifies every header checksum, and reads gzip, bz2, xz and zstd streams.

:class:`TarMembers` hands its members over in runs (:meth:`~TarMembers.runs`: the fast path of
:mod:`wds_cloud.tar.runs`, or one member of its general reader at a time), or one ``(name, data)`` at a time.

Damage is never silent: a bad checksum, a stream that ends inside a member or before the end-of-archive block,
or a compressed stream that ends early raise :class:`CorruptShardError` naming the URL, the byte offset (in the
uncompressed tar stream), the member when known, and what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import IO, Any, Optional, Union

from ..errors import CorruptShardError, redact
from . import buffers
from .buffers import Buffer, MappedBuffer, StreamBuffer
from .decompress import CHUNK, Prefixed, open_decompressed
from .format import (
    BLOCK,
    DIRECTORY,
    GNU_LONGNAME,
    MAX_META_SIZE,
    NO_DATA,
    PAX,
    PAX_GLOBAL,
    REGULAR,
    SHOWN,
    SHOWN_NAME,
    SOLARIS_PAX,
    ZERO_BLOCK,
    checksum_ok,
    checksum_problem,
    header_name,
    pax_records,
    pax_size,
    shown,
    size_field,
    size_problem,
    typeflag,
)
from .runs import KeyedRun, Run, Runs

__all__ = ["TarMembers", "sample_too_large"]

#: what the general reader returns at the end of the archive
_END = object()


def sample_too_large(url: Any, start: int, end: int, limit: int, member: Optional[str] = None) -> CorruptShardError:
    """The error for a sample that spans more than ``limit`` bytes, from byte ``start`` to ``end`` (and on)."""
    about = f" with the member {member[:200]!r}" if member is not None else ""
    return CorruptShardError(
        f"{redact(url) or '<stream>'}: the sample beginning at byte {start} grows past the limit of {limit} "
        f"byte{'s' * (limit != 1)} on "
        f"one sample{about} (it runs on past byte {start + limit}): a shard whose members share one key would fill "
        "memory. "
        "Raise the limit with WDS_MAX_SAMPLE_SIZE (such as 8GiB) or WebDataset(..., max_sample_size=) if the shard "
        "is trusted (where neither is set, a sample's limit is the one on a member: WDS_MAX_MEMBER_SIZE or "
        "max_member_size=; handler=warn_and_continue skips such shards)",
        url=url,
        offset=start,
        member=member,
        size=end - start,
        limit=limit,
    )


class TarMembers:
    """Iterate over ``(name, data)`` for the regular members of a tar stream, or over runs of them.

    ``select(name)`` returning False skips a member without copying it.  ``offset`` after iteration is where the
    reader stopped; ``member_offset`` is the header offset of the member last handed over and ``record_start`` the
    offset of its first header (a GNU long name or PAX header comes before the member's own); ``archive_end`` is
    the offset of the end-of-archive block once reached.  All offsets are in the (decompressed) tar stream.

    ``start`` says that ``stream`` begins at that offset of a plain tar, at a header (a resumed read: no
    compression is detected there); ``pax_global`` restores the global PAX records in force at that point.  With
    ``ranged=True`` the stream is a byte range of whole members and may end at a header boundary without the
    end-of-archive block.  With ``views=True`` members come out as read-only memoryviews (of the mapping, or of
    the bytes read), not bytes.

    Hostile headers cannot make it spin or allocate by claim: every size and record length is checked (negative,
    malformed or past its record is :class:`CorruptShardError`), a member larger than ``max_member`` bytes is
    refused before it is read, metadata records are capped at :data:`MAX_META_SIZE`, and a payload gets memory as
    its bytes arrive.  Iteration stops at the end-of-archive block; :meth:`finish` reads what follows (a bounded
    amount: a ``pipe:`` command's output to its end, unless it goes on without end).
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
        self.views = views
        self.select = select
        self.max_member = max_member
        self.chunk = chunk
        #: the shard is read through a mapping of the file (see :mod:`wds_cloud.io.mapped`), not streamed
        self.mapped = False
        self._source = stream
        self._ranged = ranged
        self._fresh = not start and not ranged  # the stream's first bytes say whether it is compressed
        self._begun = False
        self._defer = False  # large members are read when the run's reader asks (see runs)
        self._b: Buffer = StreamBuffer(url, chunk, start, views)
        self._runs = Runs(select, max_member, views)
        self.member_offset = start
        self.record_start = start
        self.archive_end: Optional[int] = None
        self._extended = False  # a long name or local PAX header began the current record
        self._record_begin = start
        self._special = False  # a long name or PAX records apply to the next header
        self._long_name: Optional[str] = None
        self._named = False  # a long name or a local PAX path names the next member
        self._pax: dict[str, str] = {}
        self._pax_global: dict[str, str] = dict(pax_global or {})
        #: the sample limit (bytes of tar stream one sample may span; None: none) and where the current
        #: sample began, which grouping sets once per sample (see :mod:`wds_cloud.tar.grouping`)
        self.max_sample: Optional[int] = None
        self.sample_start = start
        if self._pax_global:
            self._pax = dict(self._pax_global)
            self._special = True

    @property
    def offset(self) -> int:
        return self._b.offset

    @property
    def compression(self) -> Optional[str]:
        return self._b.compression

    @property
    def table(self) -> Any:
        """The member table this pass reads from (kept from an earlier pass over the same file), or None."""
        return self._runs.table

    @property
    def pax_global(self) -> dict:
        """The global PAX records in force (needed to resume a read in the middle of the archive)."""
        return dict(self._pax_global)

    def _check_sample(self) -> None:
        """The sample limit, checked as the stream is read on (before each run, and each member of the general
        reader): the bound on what one sample makes the reader hold; grouping checks it exactly, at every member."""
        if self.max_sample is not None and self.member_offset - self.sample_start > self.max_sample:
            raise sample_too_large(self.url, self.sample_start, self.member_offset, self.max_sample)

    def begin(self) -> None:
        """Map the shard where its stream offers it (a plain tar on local disk), else detect the compression;
        read the first block (done by iteration when not called)."""
        if self._begun:
            return
        self._begun = True
        b = self._b
        mapped = None if self._ranged else MappedBuffer.of(self._source, self._fresh, b)
        if mapped is not None:
            self._b = b = mapped
            self.mapped = True
            self._runs.attach(mapped.identity, mapped.pos == 0, redact(self.url))
        elif not self._fresh:
            b.stream = Prefixed(b"", self._source)
        else:
            try:
                b.stream, b.compression = open_decompressed(self._source)
            except OSError as exc:  # the first bytes could not be read at all
                damage = b.damage(exc)
                if damage is None:
                    raise
                raise damage from exc
        if self._fresh and not b.fill(BLOCK):
            got = b.end
            raise b.fail(
                "the stream is empty (not a tar archive)"
                if not got
                else f"the stream has only {got} bytes (not a tar archive)"
            )

    def runs(self, keyed: bool = False, defer: bool = False) -> Iterator[Union[Run, KeyedRun]]:
        """The members in runs, to the end of the archive: the fast path's (:class:`~.runs.Run`, and with ``keyed``
        a table's split names, :class:`~.runs.KeyedRun`, where they serve), else one member of the general reader
        at a time.  ``member_offset`` and ``record_start`` are those of the last member of the run handed over.
        With ``defer``, a member of at least :data:`~.buffers.LARGE` bytes comes as a run whose data its ``read()``
        reads (which the caller calls before it asks for the next run)."""
        if not self._begun:
            self.begin()
        self._defer = defer
        runs, b = self._runs, self._b
        while True:
            run: Any = None
            if not self._special:
                self._check_sample()
                if keyed:
                    run = runs.keyed_run(b)
                if run is None:
                    run = runs.table_run(b) if runs.table is not None else None
                    if run is None:
                        run = runs.scan(b, defer)
            if run is None:
                item = self._next_slow()
                if item is _END:
                    runs.ended()  # the table this pass recorded is kept
                    return
                if item is not None:
                    name, data = item
                    if type(data) is partial:  # a large member's data, read when the run's reader asks
                        yield Run([name], [None], [self.member_offset], 0, self.record_start, None, data)
                    else:
                        yield Run([name], [data], [self.member_offset], 0, self.record_start)
                continue
            heads = run.heads
            if heads:
                self.member_offset = self.record_start = run.base + heads[-1]
                yield run

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for run in self.runs():
            base = run.base
            for name, data, head in zip(run.names, run.datas, run.heads):  # type: ignore[union-attr]
                self.member_offset = base + head
                self.record_start = base + head if run.record is None else run.record  # type: ignore[union-attr]
                yield name, data

    def _next_slow(self) -> Any:
        """Handle one header in full generality: returns (name, data), None (nothing to hand over), or _END."""
        self._check_sample()
        b = self._b
        if b.end - b.pos < BLOCK and not b.fill(BLOCK):
            got = b.end - b.pos
            if self._ranged and not got and not self._extended:
                return _END
            if got and not b.buf[b.pos : b.end].strip(b"\0"):
                what = f"inside the end-of-archive marker: expected 1024 zero bytes, got {got} byte{'s' * (got != 1)}"
            elif got:
                what = (
                    f"inside a member's header: expected a {BLOCK}-byte header block, got {got} byte{'s' * (got != 1)}"
                )
            else:
                what = "without the tar end-of-archive marker (two 512-byte blocks of zeros)"
            raise b.fail(f"the stream ended {what} (the shard is truncated)")
        pos = b.pos
        header = b.buf[pos : pos + BLOCK]
        header_offset = b.base + pos
        if header[0] == 0 and header == ZERO_BLOCK:
            self.archive_end = header_offset
            b.pos = pos + BLOCK
            return _END
        if not self._extended:
            self._record_begin = header_offset
        if not checksum_ok(header):
            what = checksum_problem(header)
            if header_offset == 0 and b.compression is None:
                what = f"this is not a tar archive: it begins {shown(header[:SHOWN])}, not a tar header ({what})"
            raise b.fail(what, None, header_offset)
        b.pos = pos + BLOCK
        flag = typeflag(header)
        if not flag and header_name(header)[-1:] == "/":
            flag = DIRECTORY  # an old-style directory: no data of its own, as tarfile reads it
        size = self._header_size(header, header_offset)
        name = self._name(header)
        if flag in (GNU_LONGNAME, PAX, PAX_GLOBAL, SOLARIS_PAX):
            self._metadata(flag, size, name, header_offset)
            return None
        # This header consumes the pending long name and PAX records.
        self._long_name = None
        self._named = False
        self._pax = dict(self._pax_global)
        self._special = bool(self._pax)
        self._extended = False
        if flag in REGULAR:
            if self.select is not None and not self.select(name):
                b.skip(size, name, header_offset)
                return None
            if self.max_member is not None and size > self.max_member:
                raise self._too_large(name, header_offset, size)
            # read after the sample before it is handed over only where its bytes are known to be there: damage
            # in it then stops the shard before that sample, as webdataset's reader does, whatever its size
            if self._defer and size >= buffers.LARGE and self._b.holds(size):
                data: Any = partial(self._take, size, name, header_offset)
            else:
                data = self._take(size, name, header_offset)
            self.member_offset = header_offset
            self.record_start = self._record_begin
            return name, data
        if flag not in NO_DATA:  # links, devices, dirs, fifos carry no data
            b.skip(size, name, header_offset)
        return None

    def _take(self, size: int, name: str, header_offset: int) -> Any:
        """The data of the member whose header was just read."""
        b = self._b
        return b.take_view(size, name, header_offset) if self.views else b.take(size, name, header_offset)

    def _name(self, header: bytes) -> str:
        """The member name: a pending GNU long name, else a PAX ``path``, else the header's (ustar prefix joined)."""
        if self._long_name is not None:
            return self._long_name
        if "path" in self._pax:
            return self._pax["path"].rstrip("/")  # as tarfile reads a PAX path
        return header_name(header)

    def _too_large(self, name: str, header_offset: int, size: int) -> CorruptShardError:
        return CorruptShardError(
            f"{redact(self.url) or '<stream>'}: member {shown(name, SHOWN_NAME)} at byte {header_offset} is {size} "
            f"bytes, more than the limit of {self.max_member} byte{'s' * (self.max_member != 1)} on one member; raise it with "
            "WDS_MAX_MEMBER_SIZE (such as 8GiB) or WebDataset(..., max_member_size=) if the shard is "
            "trusted",
            url=self.url,
            offset=header_offset,
            member=name,
            size=size,
            limit=self.max_member,
        )

    def _header_size(self, header: bytes, header_offset: int) -> int:
        """The member size a header gives (a pending PAX ``size`` record overrides it), checked."""
        try:
            size = size_field(header)
        except ValueError:
            raise self._b.fail(size_problem(header), None, header_offset) from None
        if "size" in self._pax:
            try:
                size = pax_size(self._pax["size"])
            except ValueError as exc:
                raise self._b.fail(str(exc), None, header_offset) from None
        if size < 0:
            raise self._b.fail(size_problem(header, size), None, header_offset)
        return size

    def _metadata(self, flag: int, size: int, name: str, header_offset: int) -> None:
        """Read a GNU long name or PAX record set, which applies to the next header (global PAX: to all)."""
        b = self._b
        if size > MAX_META_SIZE:
            raise b.fail(
                f"a metadata record (type {chr(flag)!r}) claims {size} bytes, more than the "
                f"{MAX_META_SIZE} allowed for long names and PAX headers",
                None,
                header_offset,
            )
        payload = b.take(size, name, header_offset)
        # the first header of a record that names the member names it (a second long name, or a PAX path after a
        # long name or the other way round, is passed over), as tarfile reads nested metadata headers
        if flag == GNU_LONGNAME:
            if not self._named:
                self._long_name = bytes(payload).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                self._named = True
            self._special = self._extended = True
            return
        try:
            records = pax_records(bytes(payload))
        except ValueError as exc:
            raise b.fail(str(exc), None, header_offset) from None
        if flag != PAX_GLOBAL and "path" in records:
            if self._named:
                del records["path"]
            self._named = True
        if flag == PAX_GLOBAL:
            self._pax_global.update(records)
            self._pax = dict(self._pax_global)
        else:
            self._pax.update(records)
            self._extended = True
        # Records pile up over consecutive headers (a global one stays in force for the whole archive):
        # what is in force is capped like one record set, or a stream of small headers would fill memory.
        held = sum(len(k) + len(v) for k, v in self._pax.items())
        if held > MAX_META_SIZE:
            raise b.fail(
                f"the PAX records in force hold {held} bytes, more than the {MAX_META_SIZE} allowed "
                "(consecutive or global PAX headers piling up records)",
                None,
                header_offset,
            )
        self._special = bool(self._pax) or self._long_name is not None  # both apply to the next header

    def finish(self) -> None:
        """After the end-of-archive block: read what follows, a bounded amount (a ``pipe:`` command's
        output to its end, up to 16 MiB, so that it can report its exit status).  Called once the last sample
        was delivered, so a stream that trickles on after the archive never delays it."""
        if self.archive_end is not None:
            self._b.finish(self._ranged)

    def close(self) -> None:
        self._b.close()
        try:
            self._source.close()
        except Exception:
            pass
