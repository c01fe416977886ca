"""Runs of members: the fast path of a member source, and the member tables it records and reads.

A member source hands its members to grouping in runs (:class:`Run`): every plain member lying wholly in the
buffer's current window, read in one tight pass over their headers (:meth:`Runs.scan`, each header checked by
:func:`~wds_cloud.tar.format.plain_headers`), or taken from the member table an earlier pass over the same file
kept (:meth:`Runs.table_run`: no header read, the first and last checked against the file).  Under the default
key rule a table's names come split into keys and field names already (:class:`KeyedRun`, from
:meth:`Runs.keyed_run`), and what is left per member is the slice and the dict.  Whatever a run does not take
(long names, PAX records, other types of member, a member larger than the window, damage) the general reader of
:class:`~wds_cloud.tar.members.TarMembers` reads, one member at a time.

A pass over a mapped shard from its start records the members :meth:`Runs.scan` reads (:class:`~.table.Recorder`);
at the end of the archive the table is kept (:meth:`Runs.ended`, see :mod:`wds_cloud.tar.table`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

from . import buffers
from . import table as tables
from .format import plain_headers, same_header
from .table import MemberTable, Recorder

__all__ = ["Run", "KeyedRun", "Runs"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Run:
    """Members in stream order: ``names``, ``datas`` (bytes, or views) and ``heads`` (where each header lies,
    from ``base``, the tar-stream offset of the buffer they were read from).  ``record`` is where the first
    member's record begins when a long name or PAX header comes before its own (a member of the general reader),
    else None.  ``items`` gives ``(name, data, head)`` triples instead of the lists (member dicts grouped as they
    come).  ``read``, for a large member of the general reader (one member, ``datas`` ``[None]``), reads its data:
    called once, before the next run is asked for, so that the sample before it can be handed over first (one
    large buffer fewer alive while it is read); given only where the buffer holds all its bytes (a mapped file)."""

    names: list
    datas: list
    heads: list
    base: int
    record: Optional[int] = None
    items: Any = None
    read: Optional[Callable[[], Any]] = None


@dataclass(slots=True)
class KeyedRun:
    """Members of a member table with their keys and field names split already (the default key rule): each
    member's data is ``source[head + 512 : head + 512 + size]``, ``base`` the offset of ``source[0]``."""

    keys: list
    fields: list
    heads: Any  # sequences of ints: slices of the table's arrays
    sizes: Any
    source: Any
    base: int


class Runs:
    """The fast path of one member source over its buffer (a :class:`~.buffers.StreamBuffer`): the runs, the
    member table it reads from and the one it records."""

    def __init__(self, select: Optional[Callable[[str], bool]], max_member: Optional[int], views: bool) -> None:
        self.select = select
        #: a filter that only drops __meta__ members is asked only about names that begin as they do
        self.meta_only = bool(getattr(select, "meta_only", False))
        self.max_member = max_member if max_member is not None else 1 << 62
        self.views = views
        #: the member table of this version of the file, kept from an earlier pass (see wds_cloud.tar.table)
        self.table: Optional[MemberTable] = None
        self._identity: Any = None
        self._recorder: Optional[Recorder] = None  # this pass's table, while it reads from the start
        self._unkeyed = False  # the table has no split names for this pass (see keyed_run)
        self._view: Optional[memoryview] = None  # with views: the view of the mapping a table's members come from

    def attach(self, identity: Any, at_start: bool, url: str = "") -> None:
        """A mapped file of ``identity``: its table, if one is kept (and no member in it is over the limit); else,
        for a pass from the start, record one."""
        self._identity = identity
        table = tables.lookup(identity)
        if table is not None and table.largest <= self.max_member:
            self.table = table
        elif at_start and tables.worth_recording(identity):
            self._recorder = Recorder()
        elif at_start and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "%s: no member table is recorded this pass (tables are off, or the file changed in the last %s s)",
                url,
                tables.SETTLED,
            )

    def scan(self, b: Any, defer: bool = False) -> Optional[Run]:
        """The plain members from ``b.pos`` that lie wholly in the window ``b.window`` gives, the read position
        moved past them; the members the filter drops are left out (and move no offset).  With ``defer``, a plain
        member larger than the window whose bytes the buffer holds (a mapped file's) comes alone, as a run whose
        ``read()`` reads its data (see :class:`Run`).  None where the member at the position is neither (the
        general reader reads it)."""
        buf, pos, base = b.buf, b.pos, b.base
        names: list = []
        heads: list = []
        sizes: list = []
        end = plain_headers(buf, pos, b.window(pos), self.max_member, names, heads, sizes)
        if end == pos:
            if not defer or self.views:
                return None
            end = plain_headers(buf, pos, min(pos + 512, b.end), self.max_member, names, heads, sizes, True)
            if end == pos or sizes[0] < buffers.LARGE or end > b.end:
                return None
            b.pos = pos + 512  # the header is read; the data stays unread until the run's read() is called
            read: Optional[Callable[[], Any]] = partial(b.take, sizes[0], names[0], base + pos)
        else:
            b.pos = end
            read = None
        recorder = self._recorder
        if recorder is not None:
            recorder.names += names
            recorder.heads += heads
            recorder.sizes += sizes
            if not recorder.flush():  # larger than the bound: no more is recorded this pass
                self._recorder = None
        if self.select is not None:
            names, heads, sizes = self._selected(names, heads, sizes)
        if read is not None:
            if not names:  # the filter drops it: its data is never read
                b.pos = end
                return Run(names, [], heads, base)
            return Run(names, [None], heads, base, None, None, read)
        if self.views:
            with memoryview(buf) as view:  # the views handed out stay valid (each holds the buffer)
                datas = [view[head + 512 : head + 512 + size] for head, size in zip(heads, sizes)]
        else:
            datas = [buf[head + 512 : head + 512 + size] for head, size in zip(heads, sizes)]
        return Run(names, datas, heads, base)

    def _selected(self, names: list, heads: list, sizes: list) -> tuple:
        """The members of a run the filter keeps (``select``, or the metadata rule): names, heads and sizes."""
        select, meta_only = self.select, self.meta_only
        if meta_only:
            joined = "\0".join(names)  # one C pass: a run without __meta__-like names is kept whole
            if joined[:2] != "__" and "\0__" not in joined:
                return names, heads, sizes
        keep = [i for i, name in enumerate(names) if (meta_only and name[:2] != "__") or select(name)]  # type: ignore[misc]
        if len(keep) == len(names):
            return names, heads, sizes
        return [names[i] for i in keep], [heads[i] for i in keep], [sizes[i] for i in keep]

    def table_run(self, b: Any) -> Optional[Run]:
        """The next run from the member table (see :meth:`scan`); None where the table has no entry at the
        position, or the file is not what the table was made of (the table is then dropped)."""
        if self.table is None or b.buf is not b.mapping:
            return None
        pos = b.pos
        run = self.table.run(pos, b.window(pos))
        if run is None:
            return None
        names, heads, sizes, end = run
        if not self._matches(b.buf, heads[0], names[0], sizes[0], heads[-1], names[-1], sizes[-1]):
            return None
        b.pos = end
        if self.select is not None:
            names, heads, sizes = self._selected(names, heads, sizes)
        source = self._source(b.buf)
        datas = [source[head + 512 : head + 512 + size] for head, size in zip(heads, sizes)]
        return Run(names, datas, heads, b.base)

    def keyed_run(self, b: Any) -> Optional[KeyedRun]:
        """The next run from the member table with each member's key and field split out (the default key rule,
        field names lower-cased: :meth:`MemberTable.keyed`).  None where :meth:`table_run` or :meth:`scan` must
        be asked instead: no table, a table whose names need the rule run on them, a filter other than the
        metadata one, or no run at the position."""
        table = self.table
        if table is None or self._unkeyed or b.buf is not b.mapping or (self.select is not None and not self.meta_only):
            return None
        keyed = table.keyed()
        if keyed is None:
            self._unkeyed = True  # asked once per pass (no room now, or names the rule cannot split)
            return None
        pos = b.pos
        span = table.span(pos, b.window(pos))
        if span is None:
            return None
        i, j, end = span
        heads, sizes = table.heads, table.sizes
        if not self._matches(b.buf, heads[i], table.name(i), sizes[i], heads[j - 1], table.name(j - 1), sizes[j - 1]):
            return None
        b.pos = end
        keys, fields = keyed
        source = self._source(b.buf)
        return KeyedRun(keys[i:j], fields[i:j], heads[i:j], sizes[i:j], source, b.base)

    def _source(self, buf: Any) -> Any:
        """What a table's members are sliced out of: the mapping, or with views one memoryview of it, made once
        per pass (not once per run)."""
        if not self.views:
            return buf
        view = self._view
        if view is None or view.obj is not buf:
            view = self._view = memoryview(buf)
        return view

    def _matches(self, buf: Any, *entries: Any) -> bool:
        """Whether the first and last entries of a run, ``(head, name, size)`` each, are the file's headers; if not,
        the file is not what the table was made of (rewritten in place within its clock's tick): the table is
        dropped and the shard read header by header."""
        if same_header(buf, entries[0], entries[1], entries[2]) and same_header(
            buf, entries[3], entries[4], entries[5]
        ):
            return True
        tables.drop(self._identity)
        self.table = None
        return False

    def ended(self) -> None:
        """The end of the archive was reached: the table this pass recorded is kept (see wds_cloud.tar.table)."""
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            tables.keep(self._identity, recorder)
