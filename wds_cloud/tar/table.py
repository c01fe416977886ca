"""Member tables of mapped shards, kept for the life of the process: a second pass over a shard reads no header.

A pass over a mapped shard (see :mod:`wds_cloud.io.mapped`) from its start records where each plain member lies
(its name, its header's offset, its size) as the reader checks its header.  When the pass reaches the end of the
archive, the table is kept, keyed by the identity of the file it was read from (device, inode, size, modification
and change times, as ``fstat`` gave them when the file was mapped): a file rewritten or replaced has another
identity, so a table is never used for a version of a shard it was not read from.  The next pass over the same
file takes its members from the table, in runs (what is left per member is the slice and the dict); what the
table does not hold (members the general reader read: long names, PAX records, links, a member larger than a
window) is read from the shard as before, so a table only ever saves work.

For the default key rule (:func:`~wds_cloud.tar.samples.base_plus_ext`, field names lower-cased, no renaming or
selection), a table also keeps each member's key and field name (:meth:`MemberTable.keyed`), split once when the
table is kept: a pass over an unchanged shard then does no work per member but the slice and the dict.  That part
is made in the process that keeps the table (it does not cross to another process: the main process splits the
tables its DataLoader workers hand over) and only while it fits in the bound beside the tables held.

The tables are compact (the names in one string, the offsets in arrays: about 25 bytes and the name per member;
their keyed part 16 bytes per member, a key per sample and a field name per table) and bounded: ``WDS_TABLE_CACHE`` bytes in all (default 32 MiB, the least recently used dropped first; ``0`` keeps
none).  DataLoader workers keep theirs while they live (``persistent_workers=True`` keeps them across epochs).

At the sizes users run at (10^5 shards, 10^6 members in one), every cost here is per table or per member: keeping a
table is a few lookups (no walk over the tables held), what is kept beside the tables (which this process kept and
has not handed over) has an entry per table held at most and loses it with its table, and a table being recorded
is held in the compact form as it grows (a window's entries at a time) and dropped, for the rest of its pass, as
soon as it holds more than the bound: a first pass over a shard too large for the bound takes the bound and a
window's entries, not the whole table.  When a recorded table is kept, its names are joined once more (a copy of
them for the moment it is made).
"""

from __future__ import annotations

import bisect
import collections
import os
import sys
import threading
import time
from array import array
from itertools import accumulate, islice, repeat
from operator import add, itemgetter
from typing import Any, Optional

from .. import config

__all__ = [
    "MemberTable",
    "Recorder",
    "TableCache",
    "CACHE",
    "lookup",
    "keep",
    "drop",
    "forget",
    "handed",
    "adopt",
    "held",
    "worth_recording",
]


class MemberTable:
    """Where the plain members of one shard lie: names, header offsets and sizes, in order."""

    __slots__ = ("names", "name_starts", "heads", "sizes", "gaps", "largest", "nbytes", "_keyed", "held_as")

    def __init__(self, names: list, heads: list, sizes: list) -> None:
        # no name holds a NUL: a tar name ends at its first one
        self._made("\0".join(names), array("q", _starts(names, 0)), array("q", heads), array("q", sizes))

    @classmethod
    def _of(cls, names: str, starts: array, heads: array, sizes: array) -> MemberTable:
        """The table of names already joined and offsets already in arrays (what a :class:`Recorder` holds)."""
        table = cls.__new__(cls)
        table._made(names, starts, heads, sizes)
        return table

    def _made(self, names: str, starts: array, heads: array, sizes: array) -> None:
        self.names = names
        self.name_starts = starts
        self.heads = heads
        self.sizes = sizes
        #: the entries after which the next entry does not follow at once (a member the table does not hold)
        self.gaps = array("q", (i for i in range(len(heads) - 1) if heads[i + 1] != _end(heads[i], sizes[i])))
        self.largest = max(sizes, default=0)
        self.nbytes = sum(map(sys.getsizeof, (self.names, starts, self.heads, self.sizes, self.gaps)))
        self._keyed: Any = None  # not made yet; False: the names do not allow it (see keyed)
        #: the identity this table is held under (see keep): whether it is still held is one lookup, not a walk
        self.held_as: Any = None

    def __len__(self) -> int:
        return len(self.heads)

    def __getstate__(self) -> tuple:
        # the keyed part stays in the process that made it (a worker hands its tables over: see handed)
        return (self.names, self.name_starts, self.heads, self.sizes, self.gaps, self.largest)

    def __setstate__(self, state: tuple) -> None:
        self.names, self.name_starts, self.heads, self.sizes, self.gaps, self.largest = state
        self.nbytes = sum(map(sys.getsizeof, (self.names, self.name_starts, self.heads, self.sizes, self.gaps)))
        self._keyed = None
        self.held_as = None  # held under the identity the process that takes it keeps it under (adopt)

    def keyed(self) -> Optional[tuple[list, list]]:
        """``(keys, field names)``, one entry per member, for the default key rule with
        lower-cased field names (a key is the name up to the first dot after its last slash, the field what
        follows it): made once, on the first call, and kept with the table while it fits the bound.  None where
        a name has no key (no dot, or a dot right after its last slash), a field name is not in lower case (every
        name is its key, a dot and its field name), a name begins with ``__`` (what a metadata filter may drop),
        or the bound leaves no room: the caller reads the names instead."""
        keyed = self._keyed
        if keyed is not None:
            return keyed or None
        # made with C-level maps, not a Python loop per member: a table is split when a pass first asks (a
        # DataLoader's main process, when a worker hands the table over)
        if self.names.startswith("__") or "\0__" in self.names:
            self._keyed = False
            return None
        # what the keyed part may take at most (a key per member), asked before anything is split: no room,
        # nothing made (the reader asks once per pass)
        if not CACHE.room(len(self) * (16 + 49) + len(self.names)):
            return None
        names = self.names.split("\0") if self.heads else []
        tails = names
        if "/" in self.names:
            parts = list(map(str.rpartition, names, repeat("/")))
            tails = list(map(itemgetter(2), parts))
        split = list(map(str.partition, tails, repeat(".")))
        stems = list(map(itemgetter(0), split))
        if "" in stems or "" in map(itemgetter(1), split):  # a dot right after the last slash, or none after it
            self._keyed = False
            return None
        fields = list(map(itemgetter(2), split))
        joined = "\0".join(fields)
        if not joined.islower() and joined != joined.lower():
            self._keyed = False  # every name is its key, a dot and its field name: a resumed read checks it
            return None
        keys = stems
        if tails is not names:  # what comes before the last slash, and the slash
            keys = list(map(add, map(add, map(itemgetter(0), parts), map(itemgetter(1), parts)), stems))
        interned: dict = {}  # one string per key and per field name, however many members share it
        keys = list(map(interned.setdefault, keys, keys))
        fields = list(map(interned.setdefault, fields, fields))
        keyed = (keys, fields)
        extra = sys.getsizeof(keys) + sys.getsizeof(fields) + sum(map(sys.getsizeof, interned))
        if not CACHE.grow(self, extra):
            return None
        self._keyed = keyed
        return keyed

    def span(self, pos: int, window_end: int) -> Optional[tuple[int, int, int]]:
        """``(first entry, entry past the last, where the last ends)`` of the entries from the one whose header
        is at ``pos`` on, while each follows the last at once and ends by ``window_end``; None when no entry is
        at ``pos`` (or the first is larger than the window)."""
        heads = self.heads
        i = bisect.bisect_left(heads, pos)
        if i >= len(heads) or heads[i] != pos:
            return None
        gap = bisect.bisect_left(self.gaps, i)
        last = self.gaps[gap] if gap < len(self.gaps) else len(heads) - 1
        fits = bisect.bisect_right(heads, window_end - 512, i, last + 1) - 1
        while fits >= i and _end(heads[fits], self.sizes[fits]) > window_end:
            fits -= 1
        if fits < i:
            return None
        return i, fits + 1, _end(heads[fits], self.sizes[fits])

    def run(self, pos: int, window_end: int) -> Optional[tuple[list, list, list, int]]:
        """``(names, header offsets, sizes, where the run ends)`` of the entries :meth:`span` gives."""
        span = self.span(pos, window_end)
        if span is None:
            return None
        i, j, end = span
        starts = self.name_starts
        names = self.names[starts[i] : starts[j] - 1].split("\0")
        return names, self.heads[i:j].tolist(), self.sizes[i:j].tolist(), end

    def name(self, i: int) -> str:
        """The name of entry ``i``."""
        return self.names[self.name_starts[i] : self.name_starts[i + 1] - 1]


def _end(head: int, size: int) -> int:
    return head + 512 + ((size + 511) & ~511)


def _starts(names: list, at: int) -> Any:
    """Where each name after the first of ``names`` begins, and where a name after the last would, in the names
    joined with a NUL after each, the first at ``at``: ``at`` itself first unless the caller drops it."""
    return accumulate(map(add, map(len, names), repeat(1)), initial=at)


class Recorder:
    """The table of a pass, kept (:func:`keep`) only if the pass reaches the end.

    The reader appends each member's name, header offset and size to the three lists (the per-member cost of
    recording is three appends) and calls :meth:`flush` between windows; a flush moves the entries into the form
    the table keeps (the names joined, the offsets and sizes in arrays: about 25 bytes and the name a member,
    where the lists take about 120).  A recorder whose table could not be kept says so as soon as it holds more
    than the bound (``WDS_TABLE_CACHE``, read when it is made) and the reader drops it: a first pass over a
    shard of 10^6 members takes no more memory for its table than the bound and a window's entries."""

    __slots__ = ("names", "heads", "sizes", "_chunks", "_starts", "_heads", "_sizes", "_limit", "_name_bytes")

    #: the entries a flush moves at the least (a flush of fewer keeps them in the lists: a chunk per flush costs
    #: a string's overhead, and a shard of PAX members would flush one entry at a time)
    FLUSH = 1024

    def __init__(self, limit: Optional[int] = None) -> None:
        self.names: list = []
        self.heads: list = []
        self.sizes: list = []
        self._chunks: list = []  # the names recorded so far, a flush's joined with NULs in each
        self._starts = array("q", [0])
        self._heads = array("q")
        self._sizes = array("q")
        self._limit = config.current().table_cache if limit is None else limit
        self._name_bytes = 0  # what the chunks take

    def __len__(self) -> int:
        return len(self._heads) + len(self.heads)

    @property
    def nbytes(self) -> int:
        """The memory the recorded entries take, the lists' entries counted as the arrays will hold them."""
        pending = len(self.heads)
        arrays = sum(map(sys.getsizeof, (self._starts, self._heads, self._sizes)))
        return self._name_bytes + arrays + pending * 24 + sum(map(len, self.names)) + pending

    def flush(self, least: int = FLUSH) -> bool:
        """Move the entries in the lists to the compact form (if there are ``least`` of them); False when what the
        recorder holds could not be kept: more than the bound lets one table take (the caller drops it)."""
        names = self.names
        if len(names) < least:
            return True
        if names:
            self._starts.extend(islice(_starts(names, self._starts[-1]), 1, None))
            chunk = "\0".join(names)
            self._chunks.append(chunk)
            self._name_bytes += sys.getsizeof(chunk)
            self._heads.extend(self.heads)
            self._sizes.extend(self.sizes)
            names.clear()
            self.heads.clear()
            self.sizes.clear()
        held = self._name_bytes + sum(map(sys.getsizeof, (self._starts, self._heads, self._sizes)))
        return held <= self._limit

    def table(self) -> Optional[MemberTable]:
        """The table recorded (what the lists hold flushed first), or None if it could not be kept (see flush)."""
        if not self.flush(0):
            return None
        chunks, self._chunks = self._chunks, []
        names = "\0".join(chunks)  # the chunks end where the next begins: one NUL between two, as in a chunk
        del chunks
        # the arrays as long as they are (extended a flush at a time, they hold room for more): a table takes the
        # bytes it took when made at once, so that as many fit the bound
        starts, self._starts = _exact(self._starts), array("q")
        heads, self._heads = _exact(self._heads), array("q")
        sizes, self._sizes = _exact(self._sizes), array("q")
        return MemberTable._of(names, starts, heads, sizes)


def _exact(values: array) -> array:
    """``values``, or a copy without room for more (one array at a time: the copy of one is all that is made)."""
    exact = array(values.typecode, values)
    return exact if sys.getsizeof(exact) < sys.getsizeof(values) else values


#: a file modified or changed less than this many seconds ago keeps no table: on a file system whose clock has a
#: coarse tick (a second, two on FAT), a rewrite in place of the same size within the tick of the write would leave
#: its identity (times included) as it was.  The change time counts too: a writer may set the modification time
#: back (``cp -p``, ``rsync -t``, ``touch -d``), never the change time
SETTLED = 5.0


class TableCache:
    """The member tables one process keeps, least recently used first, within ``WDS_TABLE_CACHE`` bytes.

    One per process (:data:`CACHE`; the module's functions are its methods): ``tables`` maps a file's identity to
    its table, ``nbytes`` is what they take, ``kept_by`` maps each table this process kept itself and has not
    handed over to the process that kept it.  One lock guards the three; a forked child (a DataLoader worker)
    starts with a fresh lock and hands over only what it keeps itself.
    """

    def __init__(self) -> None:
        self.tables: collections.OrderedDict = collections.OrderedDict()
        self.nbytes = 0
        #: identity -> the process that kept the table (a DataLoader worker hands its own to the main process): an
        #: entry for each table this process kept and holds still, not yet handed over (one goes when its table goes)
        self.kept_by: dict = {}
        self._lock = threading.Lock()

    def after_fork_in_child(self) -> None:
        """A forked process hands over only what it keeps itself, and starts with a lock no thread of the parent
        holds."""
        self._lock = threading.Lock()
        self.kept_by.clear()

    def held(self) -> tuple[int, int]:
        """``(tables, bytes)``: how many member tables this process keeps, and the memory they take."""
        with self._lock:
            return len(self.tables), self.nbytes

    def lookup(self, identity: Any) -> Optional[MemberTable]:
        """The table kept for the file of ``identity``, or None."""
        if identity is None:
            return None
        with self._lock:
            table = self.tables.get(identity)
            if table is not None:
                self.tables.move_to_end(identity)
            return table

    @staticmethod
    def worth_recording(identity: Any) -> bool:
        """Whether a pass over the file of ``identity`` may keep its table: tables kept at all, and the file not
        modified or changed in the last :data:`SETTLED` seconds (asked when the file is mapped, so that a pass whose
        table would not be kept records nothing)."""
        return (
            identity is not None
            and bool(config.current().table_cache)
            and time.time() - max(identity[3:5]) / 1e9 >= SETTLED
        )

    def keep(self, identity: Any, recorder: Recorder) -> None:
        """Keep the table ``recorder`` made of the file of ``identity``, within the bound (``WDS_TABLE_CACHE``); not
        for a file modified in the last :data:`SETTLED` seconds (see there)."""
        limit = config.current().table_cache
        if not len(recorder) or not self.worth_recording(identity):
            return
        table = recorder.table()
        if table is None or table.nbytes > limit:
            return
        with self._lock:
            old = self.tables.pop(identity, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self.tables[identity] = table
            table.held_as = identity
            self.kept_by[identity] = os.getpid()
            self.nbytes += table.nbytes
            self._shed(limit)
        # its names are split once, now (about 0.3 us a member): the next pass does no work per member but the slice
        table.keyed()

    def handed(self) -> dict:
        """The tables this process kept since it last handed them over (a DataLoader worker ending its pass hands
        them to the main process, whose next workers start with them: see :meth:`adopt`)."""
        me = os.getpid()
        with self._lock:
            # every entry is of a table held and this process's (a forked one starts with none): O(tables handed)
            tables = self.tables
            mine = {
                identity: tables[identity] for identity, pid in self.kept_by.items() if pid == me and identity in tables
            }
            self.kept_by.clear()
            return mine

    def adopt(self, tables: Any) -> None:
        """Keep the tables a worker handed over (:meth:`handed`), within the bound; anything else is ignored."""
        if not isinstance(tables, dict):
            return
        limit = config.current().table_cache
        taken: list[MemberTable] = []
        with self._lock:
            for identity, table in tables.items():
                if not isinstance(table, MemberTable) or not isinstance(identity, tuple) or identity in self.tables:
                    continue
                self.tables[identity] = table
                table.held_as = identity
                self.nbytes += table.nbytes
                taken.append(table)
            self._shed(limit)
        # the keyed parts are made here, once: the next workers are forked with them (a worker would make them again
        # each epoch, before its first batch); not for a table dropped already to make room for the others
        for table in taken:
            if self._is_held(table):
                table.keyed()

    def _is_held(self, table: MemberTable) -> bool:
        """Whether ``table`` is held still: one lookup under the identity it was kept under, not a walk."""
        return self.tables.get(table.held_as) is table

    def _shed(self, limit: int) -> None:
        """Drop the least recently used tables (with what is kept beside them) until those held fit ``limit``; the
        caller holds the lock."""
        while self.nbytes > limit and self.tables:
            identity, dropped = self.tables.popitem(last=False)
            self.nbytes -= dropped.nbytes
            self.kept_by.pop(identity, None)

    def room(self, extra: int) -> bool:
        """Whether ``extra`` more bytes fit the bound beside the tables held (none is dropped for them)."""
        with self._lock:
            return self.nbytes + extra <= config.current().table_cache

    def grow(self, table: MemberTable, extra: int) -> bool:
        """Count ``extra`` more bytes of ``table`` (its keyed part) if they fit the bound; a table no longer held
        (dropped meanwhile) counts nothing, and is used by the pass that has it."""
        with self._lock:
            if not self._is_held(table):
                return True
            if self.nbytes + extra > config.current().table_cache:
                return False
            table.nbytes += extra
            self.nbytes += extra
            return True

    def drop(self, identity: Any) -> None:
        """Drop the table of the file of ``identity`` (found not to match it)."""
        with self._lock:
            table = self.tables.pop(identity, None)
            self.kept_by.pop(identity, None)
            if table is not None:
                self.nbytes -= table.nbytes

    def forget(self) -> None:
        """Drop every table (tests, or to give the memory back)."""
        with self._lock:
            self.tables.clear()
            self.kept_by.clear()
            self.nbytes = 0

    def __reduce__(self) -> tuple:
        # the process's cache is not data to send: what unpickles it is the receiving process's own
        return (_the_cache, ())


#: this process's tables
CACHE = TableCache()


def _the_cache() -> TableCache:
    return CACHE


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=CACHE.after_fork_in_child)


# the module's functions: the cache's methods, as functions (a stage or loader that holds one pickles by name)
def held() -> tuple[int, int]:
    """``(tables, bytes)``: how many member tables this process keeps, and the memory they take."""
    return CACHE.held()


def lookup(identity: Any) -> Optional[MemberTable]:
    """The table kept for the file of ``identity``, or None."""
    return CACHE.lookup(identity)


def worth_recording(identity: Any) -> bool:
    """Whether a pass over the file of ``identity`` may keep its table (see :meth:`TableCache.worth_recording`)."""
    return CACHE.worth_recording(identity)


def keep(identity: Any, recorder: Recorder) -> None:
    """Keep the table ``recorder`` made of the file of ``identity``, within the bound."""
    CACHE.keep(identity, recorder)


def handed() -> dict:
    """The tables this process kept since it last handed them over (see :meth:`TableCache.handed`)."""
    return CACHE.handed()


def adopt(tables: Any) -> None:
    """Keep the tables a worker handed over, within the bound; anything else is ignored."""
    CACHE.adopt(tables)


def drop(identity: Any) -> None:
    """Drop the table of the file of ``identity`` (found not to match it)."""
    CACHE.drop(identity)


def forget() -> None:
    """Drop every table (tests, or to give the memory back)."""
    CACHE.forget()
