"""The ledger of a size-bounded shard cache: what it holds and how big, without reading every entry.

Every process of a node that fills a bounded cache directory appends to one file there,
``.evict.ledger``, while it holds the directory's ``.evict.lock``::

    wds-cloud cache ledger 1
    + SIZE SEEN NAME        an entry (or a fill) of SIZE bytes, in the queue since SEEN (ns)
    - NAME                  that entry is gone; before the ``+`` of a name not held, it marks the entry protected

``NAME`` is the entry's path relative to the directory, percent-encoded.  Each process keeps a view
(the total of the sizes and two clock queues of the entries, least recently queued first: the entries on
probation, and the protected ones, see :meth:`ShardCache.make_room <wds_cloud.io.shardcache.ShardCache.make_room>`;
and a bounded record of the entries that left a moment ago, to tell a shard fetched again before it was reused) and,
when it
takes the lock, reads only the records added since it last looked: a miss costs constant work in
the number of entries held, amortized.  The file is compacted (rewritten from the view) when its dead
records outnumber its live ones, and rebuilt by one walk of the directory when it is absent, not a
file of ours, or not a ledger, and again by each process once it has recorded more fills than its last walk
found entries (:data:`REWALK_MIN` at least): a ledger that omits entries (truncated, forged) would otherwise let
the directory stay over its bound for good; this way a walk costs constant work per miss, amortized.

The ledger is a hint: whoever acts on a record checks the entry's own files first (a process may
die between removing an entry and recording it).  It is also data anyone able to write into the
directory may have forged: a line is at most 8 KiB, a name is a plain relative path inside the
directory, a number is a number, and any other line is ignored (counted as dead, so compaction
drops it).  A torn last line, left by a process killed while it appended, is closed with a newline
by the next writer and so read as one ignored line.

A protected entry is written as ``- NAME`` followed by its ``+`` record: a version that knows no protection reads
the pair as "remove what is not held, then add it", the same entry on probation, so ledgers stay readable both ways.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Optional
from urllib.parse import quote, unquote

__all__ = ["Ghost", "Held", "Ledger", "Planted", "open_lock", "open_regular", "plain_name", "view_of"]

log = logging.getLogger(__name__)

HEADER = b"wds-cloud cache ledger 1\n"
LEDGER, GUARD = ".evict.ledger", ".evict.lock"
MAX_LINE = 8192  # a record longer than this is not one of ours
MAX_NAME = 4096  # PATH_MAX: no entry of ours has a longer name
MAX_SIZE = 1 << 62  # bytes: a size beyond any disk is a forged one
MAX_ENTRIES = 1 << 20  # 10x the largest cache we design for; a ledger listing more is rebuilt from the directory
MIN_COMPACT = 1024  # dead records tolerated before compaction, whatever the live count
#: the entries that left a moment ago are remembered (by a hash of their name) up to this many times the entries
#: held, plus GHOST_MIN: a shard fetched again within that many evictions of its own was evicted before its reuse
GHOST_FACTOR, GHOST_MIN = 2, 64
#: a process walks the directory again once it recorded more fills than this and than the entries its last walk
#: found: a ledger that omits entries (truncated, or forged) bounds nothing, and this brings the directory back to
#: its bound with a walk's cost spread over as many misses as the walk visits entries (constant per miss, amortized)
REWALK_MIN = 1024
CHUNK = 1 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: every open of a file in the cache directory: never through a link, never blocking (a FIFO planted there would
#: block an open forever), never inherited by a child process
SAFE = _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)

#: what a walk of the directory gives for each entry: (name, size, last access in ns)
Scan = Callable[[], Iterable[tuple[str, int, int]]]


@dataclass
class Held:
    """One entry in a process's view: its size, when it was queued (an access since earns it a second chance from
    the clock), and the bytes the node had filled before it (see :attr:`Ledger.filled`)."""

    size: int
    seen_ns: int
    filled: int = 0


@dataclass
class Ghost:
    """An entry that left the cache a moment ago: its last access known then, the bytes the node had filled
    before its own fill (what was filled since is the reuse distance of a shard fetched again), and its size."""

    seen_ns: int
    filled: int
    size: int = 0


class Planted(OSError):
    """Something planted in the cache directory where the cache keeps a file of its own, that it cannot replace (a
    folder with files in it, a file it may not remove): the cache is not used for that entry, the shard is read."""


def open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open(path, flags)`` that never follows a link and never blocks: the descriptor of a regular file, or
    OSError (ELOOP: a link; EISDIR: a folder; EINVAL: something else, a FIFO or a device; ENXIO: a FIFO)."""
    fd = os.open(path, flags | SAFE, mode)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    return fd


def remove_planted(path: str) -> None:
    """Remove what is planted at ``path`` (a link, a FIFO, a device node, an empty folder: never what a link points
    to); :class:`Planted` when it cannot be removed."""
    try:
        os.unlink(path)
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.EISDIR, errno.EPERM):  # Linux says EISDIR for a folder, POSIX EPERM
            raise Planted(exc.errno, f"{path} cannot be removed ({exc.strerror}): remove it from the cache directory")
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise Planted(
            exc.errno,
            f"{path} is a folder (or a file the cache may not remove) where the cache keeps a file of its own: "
            "remove it from the cache directory",
        ) from None


def open_lock(path: str) -> int:
    """The lock file ``path`` opened for ``flock`` (made when absent); a link, FIFO, device node or empty folder
    planted there is removed (never followed, never blocked on) and the file made anew; :class:`Planted` when what
    is there cannot be removed."""
    for _ in range(5):
        try:
            return open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        except FileNotFoundError:
            raise  # the directory itself is gone
        except OSError:
            remove_planted(path)
    raise Planted(errno.EEXIST, f"{path} keeps being replaced by something that is not a lock file")


def plain_name(name: str) -> bool:
    """A relative path that stays inside the directory and names no hidden file: the only names recorded."""
    if not name or len(name) > MAX_NAME or "\0" in name or "\n" in name or name.startswith("/"):
        return False
    return all(part and part not in (".", "..") and not part.startswith(".") for part in name.split("/"))


def _regular_and_ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def _record(name: str, size: Optional[int] = None, seen_ns: int = 0) -> bytes:
    quoted = quote(name, safe="/").encode("ascii")
    return b"- %s\n" % quoted if size is None else b"+ %d %d %s\n" % (size, seen_ns, quoted)


def _number(field: bytes) -> Optional[int]:
    if not field.isdigit() or len(field) > 19:
        return None
    value = int(field)
    return value if value <= MAX_SIZE else None


class Ledger:
    """A process's view of the ledger of ``directory``; read and changed only inside :meth:`locked`."""

    def __init__(self, directory: str, scan: Scan) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LEDGER)
        self._scan = scan
        self.entries: OrderedDict[str, Held] = OrderedDict()  # on probation, the clock's queue: its hand at the front
        #: entries fetched again after they were evicted before their reuse, kept before those on probation (a loop
        #: over more shards than the cache holds would otherwise evict each one just before it is read again)
        self.protected: OrderedDict[str, Held] = OrderedDict()
        self.protected_total = 0
        self.total = 0  # bytes of both queues
        #: entries that left a moment ago, by the hash of their name, oldest first; bounded by GHOST_FACTOR x entries
        self.ghost: OrderedDict[int, Ghost] = OrderedDict()
        #: bytes of the entries the ghost remembers: with :attr:`total`, the distinct shards read lately (each once,
        #: however often it was fetched again), which is what a cache must hold to keep them all
        self.ghost_total = 0
        #: bytes of the fills this view saw recorded (a node-wide clock in bytes; what a process read at its start or
        #: again after a compaction is not counted)
        self.filled = 0
        self.reuse_misses = 0  # fills of this process that the ghost remembered (the warning counts them)
        self.reuse_most = 0  # the most bytes the node filled between two fills of one shard, among those
        self.working_most = 0  # the most bytes of distinct shards held and remembered by the ghost, at such a fill
        self.thrash_warned = False
        self._marked: Optional[str] = None  # the name a "- NAME" not held marked protected, for the next record
        self._counting = True
        self.rebuilds = 0  # walks of the directory by this process (tests count them)
        self._identity: Optional[tuple[int, int]] = None  # (device, inode) of the file the view was read from
        self._offset = 0  # bytes of it read (or written) so far
        self._records = 0  # record lines in it, live or dead
        self._pending: list[bytes] = []  # what this process recorded inside the lock, appended when it lets go
        self._warned = False
        self._added = 0  # fills this process recorded since its last walk
        self._walked = 0  # entries its last walk found

    def __len__(self) -> int:
        return len(self.entries) + len(self.protected)

    # the lock
    @contextlib.contextmanager
    def locked(self) -> Iterator[Ledger]:
        """Hold the directory's lock, with the view brought up to date; what was recorded is appended on the way out.

        The lock file is opened anew each time: a lock inherited through ``fork`` would be shared.
        """
        fd = open_lock(os.path.join(self.directory, GUARD))
        with os.fdopen(fd, "ab") as guard:
            fcntl.flock(guard.fileno(), fcntl.LOCK_EX)
            self._pending = []
            self._sync()
            if self._added > max(self._walked, REWALK_MIN):
                self._rebuild(f"{self._added} fills recorded since this process last walked it: checked")
            try:
                yield self
            finally:
                self._append()

    # changes, inside the lock
    def add(self, name: str, size: int, seen_ns: Optional[int] = None, *, protect: bool = False) -> None:
        """Record ``name`` as held with ``size`` bytes (again, when it was: its size is replaced, its queue kept), at
        its queue's end: the protected one when ``protect`` (and it was not held)."""
        if not plain_name(name):
            return  # such a name is never an entry of ours (path_for refuses it)
        seen = time.time_ns() if seen_ns is None else seen_ns
        self._added += 1
        if protect and not self.holds(name):
            self._pending.append(_record(name))  # the mark: a "-" of a name not held
            self._marked = name
        self._apply_add(name, size, seen)
        self._pending.append(_record(name, size, seen))

    def holds(self, name: str) -> bool:
        return name in self.entries or name in self.protected

    def recall(self, name: str) -> Optional[Ghost]:
        """What the ghost remembers of ``name``, forgotten as it is told (None when it is held, or long gone)."""
        if self.holds(name):
            return None
        return self._unghost(hash(name))

    def _unghost(self, key: int) -> Optional[Ghost]:
        """Forget the ghost of the name hashed ``key`` (its bytes leave :attr:`ghost_total`), and tell it."""
        gone = self.ghost.pop(key, None)
        if gone is not None:
            self.ghost_total -= gone.size
        return gone

    def remove(self, name: str) -> None:
        """Record that ``name`` is gone."""
        if self._apply_remove(name):
            self._pending.append(_record(name))

    def requeue(self, name: str, seen_ns: int) -> None:
        """Move ``name`` to the end of its queue in this process's view (its second chance); nothing is recorded."""
        queue = self.protected if name in self.protected else self.entries
        held = queue.get(name)
        if held is not None:
            held.seen_ns = seen_ns
            queue.move_to_end(name)

    def front(self, protected: bool = False) -> tuple[str, Held]:
        """The entry under the clock's hand, on probation or among the protected."""
        return next(iter((self.protected if protected else self.entries).items()))

    def _apply_add(self, name: str, size: int, seen_ns: int) -> None:
        """Add (or re-add) ``name``: a held entry keeps its queue, a new one is protected when just marked so."""
        marked, self._marked = self._marked == name, None
        self._unghost(hash(name))  # fetched again: no longer one that left
        old = self.entries.pop(name, None)
        protect = False
        if old is None:
            old = self.protected.pop(name, None)
            protect = old is not None or marked
            if old is not None:
                self.protected_total -= old.size
        held = Held(size, seen_ns, self.filled if old is None else old.filled)
        if old is not None:
            self.total -= old.size
        elif self._counting:
            self.filled += size
        if protect:
            self.protected[name] = held
            self.protected_total += size
        else:
            self.entries[name] = held
        self.total += size

    def _apply_remove(self, name: str) -> bool:
        """Remove ``name`` and remember it in the ghost; False when it was not held (a mark, see the module doc)."""
        self._marked = None
        old = self.entries.pop(name, None)
        if old is None:
            old = self.protected.pop(name, None)
            if old is None:
                return False
            self.protected_total -= old.size
        self.total -= old.size
        self._unghost(hash(name))  # a hash seen before: its old ghost's bytes go with it
        self.ghost[hash(name)] = Ghost(old.seen_ns, old.filled, old.size)
        self.ghost_total += old.size
        while len(self.ghost) > GHOST_FACTOR * len(self) + GHOST_MIN:  # each pop pays for one push: O(1) amortized
            self.ghost_total -= self.ghost.popitem(last=False)[1].size
        return True

    # reading
    def _sync(self) -> None:
        """Read the records added since this process last looked, or rebuild the ledger when it cannot be trusted."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return self._rebuild("it is absent")
        if not _regular_and_ours(st):
            remove_planted(self.path)  # a link, a FIFO, a stranger's file, an empty folder: removed, never followed
            return self._rebuild("it was not a file this cache wrote")
        if (st.st_dev, st.st_ino) != self._identity or st.st_size < self._offset:
            self._reset()  # compacted or rebuilt by another process: read it whole, once
        if st.st_size == self._offset:
            return None
        try:
            fd = open_regular(self.path, os.O_RDONLY)
        except OSError:
            return self._rebuild("it could not be opened")
        with os.fdopen(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not _regular_and_ours(st):
                return self._rebuild("it was not a file this cache wrote")
            self._identity = (st.st_dev, st.st_ino)
            why = self._read(f)
        return self._rebuild(why) if why else None

    def _reset(self) -> None:
        """Forget the entries (they are read again); the ghost and the fill counter are history, and stay."""
        self.entries.clear()
        self.protected.clear()
        self.total = self.protected_total = self._offset = self._records = 0
        self._identity = None
        self._marked = None

    def _read(self, f) -> Optional[str]:
        """Apply the lines from ``self._offset`` on; a reason to rebuild, or None."""
        f.seek(self._offset)
        self._counting = self._offset != 0  # what is read from the start was filled before this view looked
        try:
            return self._read_lines(f)
        finally:
            self._counting = True

    def _read_lines(self, f) -> Optional[str]:
        if self._offset == 0:
            if f.read(len(HEADER)) != HEADER:
                return "it does not begin as a ledger of this version"
            self._offset = len(HEADER)
        rest, skipping = b"", False  # ``rest`` begins at ``self._offset``
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            rest += chunk
            start = 0
            while True:
                end = rest.find(b"\n", start)
                if end < 0:
                    break
                self._records += 1
                if skipping or not self._apply_line(rest[start:end]):
                    self._ignored()
                skipping = False
                self._offset += end + 1 - start
                start = end + 1
            if len(self) > MAX_ENTRIES:  # checked as it is read: memory stays bounded
                return f"it lists more than {MAX_ENTRIES} entries"
            rest = rest[start:]
            if len(rest) > MAX_LINE:  # not a record of ours: skip to the next newline
                self._offset += len(rest)
                rest, skipping = b"", True
        # what is left is a torn line (a writer killed mid-append): never trusted; the next writer closes it
        return None

    def _apply_line(self, line: bytes) -> bool:
        """Apply one record; False when it is not a valid one."""
        marked, self._marked = self._marked, None  # a mark holds for the very next line only
        fields = line.split(b" ", 3)
        try:
            name = unquote(fields[-1].decode("ascii"), errors="strict")
        except (UnicodeDecodeError, ValueError):
            return False
        if not plain_name(name):
            return False
        if fields[0] == b"+" and len(fields) == 4:
            size, seen = _number(fields[1]), _number(fields[2])
            if size is None or seen is None:
                return False
            self._marked = marked
            self._apply_add(name, size, seen)
            return True
        if fields[0] == b"-" and len(fields) == 2:
            if not self._apply_remove(name):
                self._marked = name  # a "-" of a name not held marks the "+" that follows as protected
            return True
        return False

    def _ignored(self) -> None:
        self._marked = None
        if not self._warned:
            self._warned = True
            log.warning("cache: %s holds lines that are not records of this cache; they are ignored", self.path)

    # writing
    def _append(self) -> None:
        """Append what was recorded (closing a torn last line first), then compact when the dead outnumber the live.

        A record that cannot be appended (a full disk) leaves the ledger behind the directory: it is removed,
        so that every process rebuilds it rather than trust it.
        """
        pending, self._pending = self._pending, []
        if pending and self._identity is not None:
            try:
                self._write_records(pending)
            except OSError as exc:
                log.warning("cache: could not append to %s (%s); it will be rebuilt", self.path, exc)
                self._drop()
                return
        if self._identity is not None and self._records - len(self.entries) > max(len(self.entries), MIN_COMPACT):
            self._write_whole()

    def _write_records(self, pending: list[bytes]) -> None:
        fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND)
        with os.fdopen(fd, "ab", buffering=0) as f:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self._identity or not _regular_and_ours(st):
                raise OSError(errno.ESTALE, "replaced while it was locked")
            # A partial line nobody will finish: a NUL makes it invalid whatever it was cut from.
            torn = st.st_size > self._offset
            data = (b"\0\n" if torn else b"") + b"".join(pending)
            if f.write(data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
            self._records += len(pending) + torn
            self._offset = st.st_size + len(data)

    def _drop(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self._identity = None

    def _rebuild(self, why: str) -> None:
        """One walk of the directory, the entries queued by last access (oldest first), written as a new ledger."""
        log.info("cache: rebuilding the ledger of %s (%s)", self.directory, why)
        self.rebuilds += 1
        self._reset()
        found = sorted(
            ((atime, name, size) for name, size, atime in self._scan() if plain_name(name)), key=lambda x: x[0]
        )
        self._counting = False  # found, not filled
        try:
            for atime, name, size in found:
                self._apply_add(name, size, atime)
        finally:
            self._counting = True
        self._added, self._walked = 0, len(found)
        self._sweep_temps()
        self._write_whole()

    def _sweep_temps(self) -> None:
        """Remove the ``.evict.ledger.PID.tmp`` a compaction killed midway left (its process is gone)."""
        prefix = LEDGER + "."
        with contextlib.suppress(OSError), os.scandir(self.directory) as found:
            for item in found:
                if not (item.name.startswith(prefix) and item.name.endswith(".tmp")):
                    continue
                pid = item.name[len(prefix) : -4]
                if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(item.path)

    def _write_whole(self) -> None:
        """Write the view as the ledger (compaction, or after a rebuild), replacing the file atomically.

        When it cannot be written (a full disk) the view is still right for this process; the next one to take the
        lock walks the directory again.
        """
        temp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(HEADER)
                batch: list[bytes] = []
                for protected, queue in ((False, self.entries), (True, self.protected)):
                    for name, held in queue.items():
                        if protected:
                            batch.append(_record(name))  # the mark (see the module docstring)
                        batch.append(_record(name, held.size, held.seen_ns))
                        if len(batch) >= 4096:
                            f.write(b"".join(batch))
                            batch = []
                f.write(b"".join(batch))
                f.flush()
                st = os.fstat(f.fileno())
            os.replace(temp, self.path)
        except OSError as exc:
            log.warning("cache: could not write %s (%s); it will be rebuilt", self.path, exc)
            with contextlib.suppress(OSError):
                os.unlink(temp)
            self._drop()
            return
        self._identity = (st.st_dev, st.st_ino)
        self._offset = st.st_size
        self._records = len(self) + len(self.protected)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


_VIEWS: dict[str, Ledger] = {}
_VIEWS_LOCK = threading.Lock()


def view_of(directory: str, scan: Scan) -> Ledger:
    """This process's view of the ledger of ``directory``, one for all the caches opened on it.

    A cache object made per read (or per worker) would otherwise read the whole ledger again each time.  A
    child made by ``fork`` keeps the view: it is exact up to the offset it was read to, and the child reads on
    from there.
    """
    with _VIEWS_LOCK:
        ledger = _VIEWS.get(directory)
        if ledger is None:
            ledger = _VIEWS[directory] = Ledger(directory, scan)
        return ledger
