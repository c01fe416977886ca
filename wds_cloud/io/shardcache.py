"""A shard cache shared by every process on a machine: stream while filling, one download per shard, bounded.

For an entry named ``N`` (see :func:`wds_cloud.io.urls.url_to_cache_name`) the cache directory holds:

``N``
    the complete shard, published by an atomic rename once its size (and the store's MD5, when
    the store gave one) checked out.  Readers hold a shared ``flock`` on it while they read.
``N.meta``
    JSON written by us: the URL (redacted), size, version, the store's MD5, our CRC-32 (``verify=True``) and the
    modification time of ``N`` when it was published.  Only files with a ``.meta`` are ever evicted.
``N.part``
    the shard while it is being filled.  Another process that wants ``N`` meanwhile reads the
    bytes that have arrived and waits for the rest: the shard is downloaded once.
``N.lock``
    held (``flock``, exclusive) by the one process filling ``N``.  The kernel drops it when that
    process dies, so a killed fill never blocks anyone: the next process that wants ``N`` takes
    over and resumes the download at the end of ``N.part`` (pinned to the same version).

A hit checks the entry's size and modification time against ``N.meta``: an entry written to since
it was published is fetched again (with ``verify=True`` every entry carries a CRC-32, every hit is
checked against it, and a modified entry whose bytes still match is kept).  Eviction is
least-recently-used by last access (a clock: an entry read since it was queued gets a second chance), resists a
loop over more shards than the cache holds (see :meth:`ShardCache.make_room`),
never takes an entry another reader holds nor a fill in progress (each fill's end evicts again: once the fills
that ran at once ended, the cache is within its bound), and never deletes a file that has no ``.meta`` of ours.
A bounded cache keeps what eviction needs in ``.evict.ledger`` (see :mod:`wds_cloud.io.cacheledger`), so
that a miss costs the same whether the cache holds ten entries or a hundred thousand.  Locks are ``flock`` locks: the cache directory must be on a
local filesystem (not NFS).  POSIX only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import json
import logging
import os
import queue
import stat
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, Optional

from ..errors import ConfigError, ObjectChangedError, TransferError, redact
from .backend import read_to_end
from .cacheledger import SAFE, Held, Ledger, Planted, open_lock, open_regular, remove_planted, view_of
from .mapped import map_file
from .resilient import StatsSink, TransferStats
from .urls import url_to_cache_name

__all__ = ["ShardCache", "CachedShard"]

log = logging.getLogger(__name__)

#: the share of a bounded cache always left to new entries (on probation): a loop over more shards than the cache
#: holds keeps the rest (protected) for the next epoch, and shards fetched moments ago stay for the node's other readers
PROBATION_SHARE = 8
#: reuse misses of one process (shards evicted, then fetched again before they were reused) before it warns
THRASH_WARN = 4
POLL_MIN, POLL_MAX = 0.002, 0.05  # how often a reader waiting for a filler looks again (seconds)
BUFFER, BUFFERS = 1 << 20, 32  # a fill hands its bytes to the writer thread through 32 MB of reused buffers


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
MAX_META = 1 << 16  # a record of ours is a few hundred bytes; anything larger is not one


def _read_meta(path: str) -> Optional[dict]:
    """The record ``N.meta`` of the entry ``path``, or None: absent, a link, too large, or not a JSON object."""
    try:
        fd = open_regular(path + ".meta", os.O_RDONLY)
    except OSError:  # absent, or a link, a FIFO, a folder: no record of ours
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_META + 1)
        meta = json.loads(data) if len(data) <= MAX_META else None
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _meta_size(meta: dict) -> int:
    """The size a record claims, or 0 when it claims none (a stream of unknown length) or nonsense."""
    size = meta.get("size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else 0


def _as_recorded(meta: dict, st: os.stat_result) -> bool:
    """Whether the file ``st`` is the one its record ``meta`` describes: its size, and its modification time
    where the record has one (a record written before it was kept is checked by size alone)."""
    if meta.get("size") is not None and st.st_size != meta.get("size"):
        return False
    mtime = meta.get("mtime_ns")
    return mtime is None or st.st_mtime_ns == mtime


def _look(path: str, meta: dict) -> tuple[bool, Optional[os.stat_result]]:
    """(whether the record ``meta`` says the entry is complete, the file that stands for it then: ``N``, or
    ``N.part`` for a fill; None when absent)."""
    complete = bool(meta.get("complete"))
    try:
        return complete, os.stat(path if complete else path + ".part", follow_symlinks=False)
    except FileNotFoundError:
        return complete, None


def _scan(directory: str) -> list[tuple[str, int, int]]:
    """Every entry of the directory, fills included, as (name, size, last access): one walk, one read per record.

    Only the ledger's rebuild walks: when it is absent (a cache an older version filled), or damaged.
    """
    found = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        prefix = root[len(directory) + 1 :] + "/" if root != directory else ""  # no relpath per entry: the walk is long
        for name in names:
            if not name.endswith(".meta"):
                continue
            path = os.path.join(root, name[:-5])
            meta = _read_meta(path)
            if meta is None:
                continue
            try:
                st = os.stat(path if meta.get("complete") else path + ".part", follow_symlinks=False)
            except FileNotFoundError:
                if meta.get("complete"):
                    continue
                st = None  # a fill that is about to write: counted at its announced size, looked at first
            size = max(st.st_size if st else 0, _meta_size(meta))
            found.append((prefix + name[:-5], size, st.st_atime_ns if st else 0))
    return found


def _create(path: str, mode: int = 0o644, flags: int = os.O_WRONLY) -> int:
    """A new file at ``path``, never through a link planted there (one in the way is removed, not followed)."""
    for _ in range(3):
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL | SAFE, mode)
        except FileExistsError:
            remove_planted(path)  # unlinking a symlink leaves what it points to alone
    raise OSError(errno.EEXIST, f"{path} keeps being re-created by someone else")


def _write_meta(path: str, meta: dict) -> None:
    temp = f"{path}.meta.{os.getpid()}.{threading.get_ident()}.tmp"
    with os.fdopen(_create(temp), "w") as f:
        json.dump(meta, f)
    try:
        os.replace(temp, path + ".meta")
    except OSError:  # a folder planted as the record: removed when empty, else the entry is not cached (Planted)
        try:
            remove_planted(path + ".meta")
            os.replace(temp, path + ".meta")
        except BaseException:
            _unlink(temp)
            raise


def _regular_and_ours(st: os.stat_result) -> bool:
    """A regular file this user owns: the only kind of file in the cache directory trusted as ours."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def _try_lock(path: str, mode: int = fcntl.LOCK_EX):
    """The open lock file ``path`` with ``mode`` taken without waiting, or None when someone holds it.

    Whatever else is planted at ``path`` (a link, a FIFO, an empty folder) is removed, never followed nor blocked
    on (:class:`Planted` when it cannot be); the lock counts only while ``path`` is still the file locked (another
    process may remove a stale lock file while holding it).
    """
    for _ in range(5):
        fd = open_lock(path)
        f = os.fdopen(fd, "ab")
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        try:
            still = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            still = False
        if still:
            return f
        f.close()  # removed or replaced while we locked it: lock the file that is there now
    return None


def _inside(directory: str, name: str) -> bool:
    """Whether every folder on the way to ``name`` is a real folder: a link among them could lead outside."""
    parts = name.split("/")[:-1]
    at = directory
    for part in parts:
        at = os.path.join(at, part)
        try:
            if not stat.S_ISDIR(os.stat(at, follow_symlinks=False).st_mode):
                return False
        except OSError:
            return False
    return True


_WARNED: set[str] = set()  # the directories whose planted files were reported (once a process)


def _warn_planted(directory: str, exc: OSError) -> None:
    if directory not in _WARNED:
        _WARNED.add(directory)
        log.warning("cache: %s; until then the shards it blocks are read uncached", exc.strerror or exc)


def _human(size: int, up: bool = False) -> str:
    """A byte count as a size setting reads it (``12.5GB``), rounded up when ``up``: it is a bound to set."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            tenths = -(-size * 10 // scale) if up else round(size * 10 / scale)
            return f"{tenths / 10:g}{unit}"
    return f"{size}B" if size != 1 else "1 byte"


def _unlink(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _crc_of(f: Any) -> int:
    crc = 0
    f.seek(0)
    while True:
        data = f.read(1 << 22)
        if not data:
            return crc
        crc = zlib.crc32(data, crc)


class _Sink:
    """Writes the bytes of a fill to ``N.part`` and hashes them, in a thread of its own.

    The reader hands each piece over and goes on; a write that fails (a full disk) abandons the
    cache entry, never the read.  Bytes already on disk before ``start`` are hashed first.
    """

    def __init__(self, part: str, start: int, want_md5: bool, want_crc: bool, private: bool = False) -> None:
        self.part = part
        self.error: Optional[BaseException] = None
        self.crc: Optional[int] = 0 if want_crc else None
        self.md5 = hashlib.md5() if want_md5 else None
        self._queue: queue.Queue[Optional[tuple]] = queue.Queue()
        # Reused 1 MB buffers: the bytes handed over are copied once into memory that is already mapped.
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._buffers = 0  # made so far, on demand (a small shard needs few)
        # never world-readable when the URL carried a credential (the umask applies on top)
        mode = 0o600 if private else 0o644
        if start:  # resuming a part file: only one this user made, a regular file, never through a link
            fd = open_regular(part, os.O_RDWR)
            st = os.fstat(fd)
            if not _regular_and_ours(st) or st.st_size < start:
                os.close(fd)
                raise OSError(errno.EINVAL, f"{part} is not a part file this cache made")
        else:
            fd = _create(part, mode, os.O_RDWR)
        self._file = os.fdopen(fd, "r+b", buffering=0)
        self._file.truncate(start)
        self._start = start
        self._thread = threading.Thread(target=self._run, name="wds-cache-fill", daemon=True)
        self._thread.start()

    def _hash(self, data: Any) -> None:
        if self.crc is not None:
            self.crc = zlib.crc32(data, self.crc)
        if self.md5 is not None:
            self.md5.update(data)

    def _run(self) -> None:
        try:
            left = self._start if (self.crc is not None or self.md5 is not None) else 0
            self._file.seek(0)
            while left > 0:
                data = self._file.read(min(left, 1 << 22))
                if not data:
                    raise OSError(errno.EIO, f"{self.part} is shorter than it was a moment ago")
                self._hash(data)
                left -= len(data)
            self._file.seek(self._start)
        except BaseException as exc:
            self.error = exc
        while True:
            item = self._queue.get()
            if item is None:
                return
            buffer, length = item
            try:
                if self.error is None:
                    view = memoryview(buffer)[:length]
                    self._hash(view)
                    while len(view):
                        view = view[self._file.write(view) :]
            except BaseException as exc:  # a full disk, a quota: the fill is abandoned, reading goes on
                self.error = exc
            finally:
                self._free.put(buffer)

    def put(self, data: Any) -> None:
        """Queue a copy of ``data`` (waits for a free buffer when the writer is behind)."""
        view = memoryview(data).cast("B")
        while len(view) and self.error is None:
            try:
                buffer = self._free.get_nowait()
            except queue.Empty:
                if self._buffers < BUFFERS:
                    self._buffers += 1
                    buffer = bytearray(BUFFER)
                else:
                    buffer = self._free.get()
            n = min(len(view), BUFFER)
            buffer[:n] = view[:n]
            self._queue.put((buffer, n))
            view = view[n:]

    def finish(self) -> None:
        """Write everything queued and close the part file."""
        self._queue.put(None)
        self._thread.join()
        self._file.close()


class ShardCache:
    """The cache directory and its rules (see the module docstring); picklable, so workers share it."""

    def __init__(
        self,
        directory: str,
        size_limit: Optional[int] = None,
        *,
        url_to_name: Optional[Callable[[str], str]] = None,
        stats: Optional[StatsSink] = None,
        verify: bool = False,
    ) -> None:

        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.size_limit = size_limit if size_limit and size_limit > 0 else None
        self.url_to_name = url_to_name or url_to_cache_name
        self.stats = stats if stats is not None else StatsSink()
        self.verify = verify
        self._foreign_warned = False  # a file not matching its record is said once per cache, then only logged

    def path_for(self, url: str) -> str:
        """The entry path for ``url``; a name that would leave the cache directory is refused."""
        name = self.url_to_name(url)
        path = os.path.normpath(os.path.join(self.directory, name))
        if not path.startswith(self.directory + os.sep) or os.path.basename(path).startswith("."):
            raise ConfigError(
                f"url_to_name({redact(url)!r}) gave {name!r}, which is not a plain name inside the "
                f"cache directory {self.directory}"
            )
        return path

    def _count(self, **fields: Any) -> None:
        self.stats.add(TransferStats(**fields))

    # opening
    def open(self, url: str, opener: Callable[[int], Any]) -> Any:
        """A read stream for ``url``: the cached copy, the fill in progress, or a new fill.

        ``opener(offset)`` opens the remote object at a byte offset (a resumable stream with
        ``size``, ``version`` and, when the store gives one, ``md5``).  Something planted in the directory that
        the cache cannot replace (a folder with files in it as a lock or the ledger) costs the cache, not the read:
        the shard is read uncached, with one warning per directory naming the path and the fix.
        """
        try:
            return self._open_cached(url, opener)
        except Planted as exc:
            _warn_planted(self.directory, exc)
            self._count(cache_misses=1)
            return opener(0)

    def _open_cached(self, url: str, opener: Callable[[int], Any]) -> Any:
        path = self.path_for(url)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        poll = POLL_MIN
        while True:
            hit = self._open_entry(path)
            if hit is not None:
                self._count(cache_hits=1, bytes_saved=os.fstat(hit.fileno()).st_size)
                return hit
            lock = _try_lock(path + ".lock")
            if lock is not None:
                hit = self._open_entry(path)  # published a moment ago?
                if hit is not None:
                    lock.close()
                    self._count(cache_hits=1, bytes_saved=os.fstat(hit.fileno()).st_size)
                    return hit
                _unlink(path)  # absent or damaged; we hold the fill lock
                self._count(cache_misses=1)
                return CachedShard(self, url, path, opener, lock=lock)
            follower = CachedShard.follow(self, url, path, opener)
            if follower is not None:
                self._count(cache_hits=1)
                return follower
            time.sleep(poll)  # the filler has not started writing yet
            poll = min(poll * 2, POLL_MAX)

    def _open_entry(self, path: str) -> Optional[Any]:
        """The complete entry, opened and held against eviction, or None (absent, or found damaged).

        Only a regular file is an entry: a link or anything else planted under an entry's name
        is removed (the link, not what it points to) and the shard fetched again.
        """
        try:
            fd = os.open(path, os.O_RDONLY | SAFE)  # a FIFO planted here opens at once, and is found not a file
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            self._discard(path, "it is a symbolic link, not a file this cache made")
            return None
        f = _Entry(fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            f.close()
            self._discard(path, "it is not a regular file")
            return None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            st = os.fstat(f.fileno())
            meta = _read_meta(path)
            if st.st_nlink == 0 or meta is None or not meta.get("complete"):
                f.close()
                if st.st_nlink:
                    self._discard(path, "it has no record of being complete")
                return None
            if st.st_size != meta["size"]:
                f.close()
                self._discard(path, f"it holds {st.st_size} bytes, not {meta['size']}")
                return None
            if st.st_mtime_ns != meta["mtime_ns"] or self.verify:
                crc = meta.get("crc32")
                if crc is None or _crc_of(f) != crc:  # written to since it was stored, and nothing vouches for it
                    f.close()
                    self._discard(
                        path, "it was modified after it was stored" if crc is None else "its checksum does not match"
                    )
                    return None
                meta["mtime_ns"] = st.st_mtime_ns
                _write_meta(path, meta)
            os.utime(f.fileno(), ns=(time.time_ns(), st.st_mtime_ns))  # last access, for LRU
            f.seek(0)
            f.size = st.st_size
            return f
        except BaseException:
            f.close()
            raise

    def _discard(self, path: str, why: str) -> None:
        log.warning("cache entry %s was changed or damaged since it was stored (%s); fetching it again", path, why)
        lock = _try_lock(path + ".lock")
        if lock is not None:
            # Forgotten before the fill lock is let go (its file last: a new lock file is a new lock): a fill of the
            # same name begins only after, so the ledger's "-" of this entry never follows, and drops, its "+".
            try:
                remove_planted(path)  # a file, or what was planted: a FIFO, an empty folder (Planted: a full one)
                _unlink(path + ".meta")
                self.forget(path)
            finally:
                _unlink(path + ".lock")
                lock.close()
        return None

    # size bound
    def _view(self) -> Ledger:
        return view_of(self.directory, functools.partial(_scan, self.directory))

    def _name(self, path: str) -> str:
        return os.path.relpath(path, self.directory)

    def make_room(self, keep: str, size: Optional[int] = None) -> None:
        """Record the fill of ``keep`` (``size`` bytes, or what its record says), then evict entries until the
        cache, fills in progress included, fits the limit: those on probation first, least recently used first,
        then the protected ones.

        A new entry is on probation, unless it left the cache a moment ago (the ghost remembers it): it was evicted
        before its reuse, the cache thrashes, and it is protected, up to all but a :data:`PROBATION_SHARE` of the
        limit.  A loop over W shards through a cache of C < W so keeps about C of them from one epoch to the next,
        where least-recently-used evicts each just before it is read again (0 hits); a protected entry gives way
        to a newcomer only when it was not read for twice as long as the newcomer's reuse took (the shards read
        changed).  A cache that fits never evicts, and one that evicts without such reuse behaves as it did.

        Constant work in the entries held, amortized: the ledger gives the totals and the queues; only the entries
        the clock's hand passes are looked at (each evicted once, or passed once per access since it was queued).
        """
        if self.size_limit is None:
            return
        if size is None:
            meta = _read_meta(keep)
            size = _meta_size(meta) if meta is not None else 0
        name = self._name(keep)
        reuse = None
        with self._view().locked() as ledger:
            ghost = ledger.recall(name)
            protect = False
            if ghost is not None:  # evicted, and fetched again before it was reused
                reuse = ledger.filled - ghost.filled  # bytes the node filled since this shard's last fill
                protect = self._admit(ledger, size, ghost.seen_ns)
            ledger.add(name, size, protect=protect)
            self._shrink(ledger, name)
        if reuse is not None:
            self._count(cache_reuse_misses=1)
            self._warn_thrashing(ledger, reuse)

    def settle(self, keep: str) -> None:
        """Evict until the cache fits again, now that the fill of ``keep`` ended (published, or stopped early).

        A pass cannot evict a fill in progress: fills that run at once may leave a pass over the bound, and nothing
        else would bring the directory back within it once they all ended.  The pass after each fill does, so at
        rest the cache fits (but for one entry larger than the whole bound: the last one read is kept).  One look
        at the ledger's totals when it fits; constant work in the entries held, amortized, as for a miss.
        """
        if self.size_limit is None:
            return
        try:
            with self._view().locked() as ledger:
                self._shrink(ledger, self._name(keep))
        except Planted as exc:  # the ledger's lock or file cannot be used: the next miss tries again
            _warn_planted(self.directory, exc)
        except OSError as exc:  # the shard was read, and stays read: the next miss applies the bound
            log.warning("cache: could not apply the bound of %s after a fill (%s)", self.directory, exc)

    def _shrink(self, ledger: Ledger, name: str) -> None:
        """Evict entries until the ledger's total fits the limit, never ``name`` (the entry just filled)."""
        assert self.size_limit is not None
        # each entry under the hand twice at most (a second chance, then eviction), those on probation first
        probation = 2 * len(ledger.entries)
        for _ in range(2 * len(ledger)):
            if ledger.total <= self.size_limit:
                break
            probation -= 1
            if probation >= 0 and ledger.entries:
                candidate, held = ledger.front()
            elif ledger.protected:
                candidate, held = ledger.front(protected=True)
            else:
                break
            if candidate == name:
                ledger.requeue(candidate, held.seen_ns)
            else:
                self._visit(ledger, candidate, held)

    def _admit(self, ledger: Ledger, size: int, last_ns: int) -> bool:
        """Whether an entry fetched again ``size`` bytes, last read at ``last_ns`` before it was evicted, is
        protected: there is room among the protected, or protected entries unread for twice as long as its reuse
        took give it theirs."""
        assert self.size_limit is not None
        room = self.size_limit - self.size_limit // PROBATION_SHARE
        now = time.time_ns()
        stale = now - 2 * max(0, now - last_ns)
        for _ in range(len(ledger.protected)):
            if ledger.protected_total + size <= room:
                break
            name, held = ledger.front(protected=True)
            if not self._visit(ledger, name, held, stale_ns=stale):
                return False
        return ledger.protected_total + size <= room

    def _visit(self, ledger: Ledger, name: str, held: Held, stale_ns: Optional[int] = None) -> bool:
        """The clock's hand on ``name``: evict it, give it a second chance, or forget it (not an entry of ours);
        False only when it was last read at or after ``stale_ns`` (then it is left as it is).

        The ledger is only a hint here: the entry's own files decide, judged while this holds the entry's fill
        lock.  A fill publishes (its record says complete, then ``N.part`` becomes ``N``) and lets go of that lock
        without taking the ledger's: files looked at without it may be a moment old, and acting on them lost a fill
        published meanwhile (its record removed as an abandoned fill's, or its entry forgotten as missing: on disk,
        uncounted, never evicted).  With the lock held no fill of the entry begins, resumes or publishes.
        """
        path = os.path.join(self.directory, name)
        meta = _read_meta(path) if _inside(self.directory, name) else None
        if meta is None:  # gone, or never ours: forgotten, never deleted (nor a lock file made for it)
            ledger.remove(name)
            return True
        try:
            lock = _try_lock(path + ".lock")
        except Planted:  # nobody can fill or publish the entry while that stays there
            return self._judge(ledger, name, path, meta, held, stale_ns, locked=False)
        if lock is None:  # a fill in progress (or publishing): counted already, evicted once it is abandoned
            ledger.requeue(name, time.time_ns())
            return True
        with lock:
            try:
                return self._judge(ledger, name, path, meta, held, stale_ns, locked=True)
            finally:
                _unlink(path + ".lock")  # entries leave no lock files behind

    def _judge(
        self, ledger: Ledger, name: str, path: str, meta: dict, held: Held, stale_ns: Optional[int], *, locked: bool
    ) -> bool:
        """:meth:`_visit`'s verdict on ``name``, whose record ``meta`` was read just before its fill lock was taken
        (``locked``; or there is none to take)."""
        complete, st = _look(path, meta)
        if not (complete and st is not None and _as_recorded(meta, st)):
            # Not the complete entry that record describes: the record may be older than the lock (a fill published,
            # or the entry was discarded and filled anew, meanwhile) and is read again, now that it stays as it is.
            # A complete entry as recorded, the usual case, costs one read of its record, as before the lock.
            now = _read_meta(path)
            if now is None:  # discarded as damaged a moment ago
                ledger.remove(name)
                return True
            meta = now
            complete, st = _look(path, meta)
        if not complete and not locked:  # an abandoned fill: left for whoever wants that entry (it reads it uncached)
            ledger.requeue(name, time.time_ns())
            return True
        if complete and (st is None or not stat.S_ISREG(st.st_mode)):
            ledger.remove(name)  # a record without its entry
            return True
        if complete and st is not None and not _as_recorded(meta, st):
            ledger.remove(name)  # not the file this cache wrote: forgotten, never deleted
            self._warn_foreign(path, meta, st)
            return True
        if complete and st is not None and st.st_atime_ns > held.seen_ns:
            ledger.requeue(name, st.st_atime_ns)  # read since it was queued
            return True
        if stale_ns is not None and held.seen_ns >= stale_ns:
            return False
        if self._evict(path, complete):
            ledger.remove(name)
        else:  # a reader holds it
            ledger.requeue(name, time.time_ns())
        return True

    def _warn_foreign(self, path: str, meta: dict, st: os.stat_result) -> None:
        """Say (once per cache, then at debug level) that an entry's file is not the one its record describes."""
        text = (
            "cache: %s is not the file this cache wrote (%d bytes, modified at %d ns; its record %s says %r bytes, "
            "%r ns): left in place and no longer counted; delete it (and its .meta) if it is not yours"
        )
        args = (path, st.st_size, st.st_mtime_ns, path + ".meta", meta.get("size"), meta.get("mtime_ns"))
        if self._foreign_warned:
            log.debug(text, *args)
            return
        self._foreign_warned = True
        log.warning(text, *args)

    def _warn_thrashing(self, ledger: Ledger, reuse: int) -> None:
        """Say once per process that the cache thrashes, with the figures and the fix."""
        ledger.reuse_misses += 1
        ledger.reuse_most = max(ledger.reuse_most, reuse)
        # the bytes filled between two fills count a shard fetched again as often as it was: the distinct shards
        # read lately (those held, and those the ghost remembers) are what a cache must hold to keep them all
        ledger.working_most = max(ledger.working_most, ledger.total + ledger.ghost_total)
        if ledger.thrash_warned or ledger.reuse_misses < THRASH_WARN:
            return
        ledger.thrash_warned = True
        seen = self.stats.snapshot()
        opened = seen.cache_hits + seen.cache_misses
        limit = self.size_limit or 0
        wanted = min(ledger.reuse_most, ledger.working_most)  # never more than was read between two reads
        log.warning(
            "cache: %s thrashes: %d shards were evicted and then fetched again before they were reused, because "
            "the shards read in one epoch do not fit in cache_size %s: the distinct shards read lately take up to %s "
            "(their working set, at least), and hits are %d of %d opens (%.0f%%) so far. The cache now "
            "keeps about %s of them from one epoch to the next; to keep them all, set WDS_CACHE_SIZE (or "
            "cache_size=) to at least %s, or read without a cache (WDS_CACHE_SIZE=0, or no cache_dir)",
            self.directory,
            ledger.reuse_misses,
            _human(limit),
            _human(wanted),
            seen.cache_hits,
            opened,
            100.0 * seen.cache_hits / opened if opened else 0.0,
            _human(limit - limit // PROBATION_SHARE),
            _human(max(wanted, limit + 1), up=True),
        )

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) a bounded cache holds by its ledger, fills in progress included; (0, 0) when unbounded."""
        if self.size_limit is None:
            return 0, 0
        with self._view().locked() as ledger:
            return len(ledger), ledger.total

    def forget(self, path: str) -> None:
        """Record that the entry ``path`` was removed other than by eviction (found damaged, or a failed fill).

        The caller holds the entry's fill lock (and removed its files under it): a new fill of that name, recorded
        after, is never the record forgotten.  A ledger that cannot be used costs nothing but the record (the
        ledger is a hint: a pass forgets a name whose files are gone).
        """
        if self.size_limit is not None:
            try:
                with self._view().locked() as ledger:
                    ledger.remove(self._name(path))
            except Planted as exc:  # the ledger's lock or file cannot be used: nothing to record it in
                _warn_planted(self.directory, exc)
            except OSError as exc:  # the entry is gone either way; the read goes on
                log.warning("cache: could not record that %s left %s (%s)", path, self.directory, exc)

    def _evict(self, path: str, complete: bool) -> bool:
        """Remove the entry, or the abandoned fill, at ``path`` (its fill lock held): False when a reader holds it."""
        if complete:  # an entry someone reads holds a shared lock on it
            try:
                f = os.fdopen(open_regular(path, os.O_RDONLY), "rb")
            except OSError:  # gone, or a link, FIFO or folder planted in its place (never followed nor opened)
                return False
            with f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                _unlink(path, path + ".meta")
        else:  # an abandoned fill (nobody else holds its lock)
            _unlink(path + ".part", path + ".meta")
        self._count(cache_evictions=1)
        log.info("cache: evicted %s", path)
        return True


class CachedShard:
    """The read stream of a shard being filled into the cache, by this process or another one.

    A filler reads what is already in ``N.part`` (when it resumes), then the remote object,
    handing every byte to a :class:`_Sink`; at the end it checks and publishes the entry.  A
    follower reads ``N.part`` as it grows and waits at its end while the filler lives; when the
    filler is gone before the end, the follower takes over the fill where it stopped.
    """

    def __init__(
        self, cache: ShardCache, url: str, path: str, opener: Callable[[int], Any], *, lock: Any = None
    ) -> None:
        self.cache = cache
        self.url = url
        self.path = path
        self._opener = opener
        self.position = 0
        self.size: Optional[int] = None
        self.closed = False
        self._lock = None
        self._remote = None
        self._sink: Optional[_Sink] = None
        self._file: Any = None
        self._local_end = 0
        self._meta: Optional[dict] = None
        self._complete = False  # following a file that is now published whole
        self._announced = False
        self._poll = POLL_MIN
        if lock is not None:
            self._fill_holding(lock)

    @classmethod
    def follow(cls, cache: ShardCache, url: str, path: str, opener: Callable[[int], Any]) -> Optional[CachedShard]:
        """Follow the fill another process is doing, or None when it has not begun writing."""
        meta = _read_meta(path)
        if meta is None or meta.get("complete"):
            return None
        try:
            f = os.fdopen(open_regular(path + ".part", os.O_RDONLY), "rb")
        except OSError:  # not begun yet (or a link or FIFO planted: the filler's own replaces it)
            return None
        self = cls(cache, url, path, opener)
        self._file, self.size = f, meta.get("size")
        self._meta = meta
        return self

    # filling
    def _fill_holding(self, lock: Any) -> None:
        """Start filling with the fill ``lock`` held; on failure let go of everything, the lock included."""
        try:
            self._start_fill(lock)
        except BaseException:
            self._lock = lock
            self._stop()  # the writer thread, the remote and the lock, all let go
            self._release()
            lock.close()
            raise

    def _start_fill(self, lock: Any) -> None:
        """Begin (or resume, or take over) the fill; we hold ``N.lock``."""
        self._lock = lock
        part = self.path + ".part"
        meta = _read_meta(self.path)
        start = 0
        if meta is not None and not meta.get("complete") and meta.get("size"):
            try:
                st = os.stat(part, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and _regular_and_ours(st):
                start = st.st_size
            elif st is not None:  # a link, a FIFO, a folder or a stranger's file: never resumed from, removed
                remove_planted(part)
        remote = self._opener(start)
        version, size = getattr(remote, "version", None), getattr(remote, "size", None)
        if start and meta is not None and (str(version) != str(meta.get("version")) or size != meta.get("size")):
            remote.close()  # the object changed since the interrupted fill: start again
            if self.position:
                self.close()
                raise ObjectChangedError(
                    f"{redact(self.url)}: the object changed while another process was caching it (at byte "
                    f"{self.position}); two versions are never spliced: read it again",
                    url=self.url,
                    offset=self.position,
                )
            _unlink(part)
            start, remote = 0, self._opener(0)
            version, size = getattr(remote, "version", None), getattr(remote, "size", None)
        if not start:
            meta = {
                "url": redact(self.url),
                "size": size,
                "version": version,
                "md5": getattr(remote, "md5", None),
                "complete": False,
            }
            _write_meta(self.path, meta)
        self._meta = meta
        self.size = size
        self._announced = bool(size)  # the size the bound counted from the start
        self._remote = remote
        self._local_end = start
        self._sink = _Sink(
            part,
            start,
            want_md5=bool(meta and meta.get("md5")),
            want_crc=self.cache.verify,
            private=redact(self.url) != str(self.url),
        )
        if start > self.position:  # the bytes up to ``start`` are read from the part file first
            if self._file is None:
                self._file = os.fdopen(open_regular(part, os.O_RDONLY), "rb")
            self._file.seek(self.position)
        elif self._file is not None:
            self._file.close()
            self._file = None
        self.cache.make_room(keep=self.path, size=self.size or 0)

    def _publish(self) -> None:
        stored = False
        sink, self._sink = self._sink, None
        meta = self._meta
        if sink is None or meta is None:  # cannot happen: only a fill that began publishes
            raise RuntimeError("the cache entry was published before it began")
        sink.finish()
        try:
            if sink.error is not None:
                raise sink.error
            expected = meta.get("md5")
            if expected and sink.md5 is not None and sink.md5.hexdigest() != expected:
                _unlink(self.path + ".part", self.path + ".meta")
                self.cache.forget(self.path)
                raise TransferError(
                    f"{redact(self.url)}: the {self.size} bytes received do not match the store's MD5 "
                    f"{expected}; the cache entry was not kept: read the shard again",
                    url=self.url,
                )
            part = self.path + ".part"
            st = os.stat(part)
            meta["size"] = self.size
            if st.st_size != self.size:
                raise OSError(errno.EIO, f"{part} holds {st.st_size} bytes, not {self.size}")
            if not self._announced:
                # A stream of unknown length: the bound learns its size now (and is applied), before the entry is
                # published, so that a ledger that cannot be used (Planted) costs the entry whole, below; failing
                # after the rename left a published shard whose record the handler removed: uncounted, never evicted.
                self.cache.make_room(keep=self.path, size=self.size)
            meta = dict(meta, complete=True, crc32=sink.crc, mtime_ns=st.st_mtime_ns)
            _write_meta(self.path, meta)
            os.replace(part, self.path)
            log.debug("cache: stored %s as %s", redact(self.url), self.path)
            stored = True
        except TransferError:
            raise
        except OSError as exc:
            # A full disk or a failed write costs the cache entry, never the read.
            log.warning(
                "cache: could not store %s in %s (%s); reading it from the store again next time",
                redact(self.url),
                self.cache.directory,
                exc,
            )
            _unlink(self.path + ".part", self.path + ".meta")
            self.cache.forget(self.path)
        finally:
            # read to its end: the connection and its place in the host's level go back now, not at close()
            # (a reader that never closes must not hold them while it opens the next shard)
            if self._remote is not None:
                self._remote.close()
            self._release()
        if stored and self._announced:
            self.cache.settle(self.path)  # the fill ended: fills in progress that a pass could not evict are done

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # following
    def _wait_or_take_over(self) -> None:
        lock = _try_lock(self.path + ".lock")
        if lock is None:  # the filler is alive: wait for more bytes
            time.sleep(self._poll)
            self._poll = min(self._poll * 2, POLL_MAX)
            return
        self._poll = POLL_MIN
        ino = os.fstat(self._file.fileno()).st_ino

        def ours(candidate: str) -> bool:
            try:
                return os.stat(candidate).st_ino == ino
            except FileNotFoundError:
                return False

        if ours(self.path):  # published meanwhile: the file we read is complete
            lock.close()
            self._complete = True
            return
        if not ours(self.path + ".part"):
            lock.close()
            raise ObjectChangedError(
                f"{redact(self.url)}: the cache entry being read was replaced (the object changed); read it again",
                url=self.url,
                offset=self.position,
            )
        log.info("cache: the process filling %s stopped at byte %d; taking over", self.path, self.position)
        self._fill_holding(lock)

    # reading
    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while True:
            want = view if self.size is None else view[: max(0, self.size - self.position)]
            if not len(want):
                if self._sink is not None:
                    self._publish()
                return 0
            if self._remote is None:  # following
                n = self._file.readinto(want)
                if n or self._complete:
                    self.position += n
                    return n
                self._wait_or_take_over()
                continue
            if self.position < self._local_end:  # resuming: the bytes already in the part file
                n = self._file.readinto(want[: self._local_end - self.position])
                if not n:
                    raise TransferError(
                        f"{redact(self.url)}: {self.path}.part shrank while it was read",
                        url=self.url,
                        offset=self.position,
                    )
                self.position += n
                return n
            n = self._remote.readinto(want)
            if n:
                self._sink.put(want[:n])
                self.position += n
                if self.size is not None and self.position >= self.size:
                    self._publish()
                return n
            if self.size is None:  # a stream of unknown length (a pipe) ends here
                self.size = self.position
                self._publish()
            return 0

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return read_to_end(self.read)
        buffer = bytearray(size)
        n = self.readinto(buffer)
        return bytes(memoryview(buffer)[:n])

    def close(self) -> None:
        if self._stop():
            self.cache.settle(self.path)  # the fill ended: fills in progress that a pass could not evict are done

    def _stop(self) -> bool:
        """Let go of everything; True when that stopped a fill early."""
        if self.closed:
            return False
        self.closed = True
        sink, self._sink = self._sink, None
        try:
            if sink is not None:  # stopped early: what arrived stays in N.part, to be resumed
                sink.finish()
            for stream in (self._remote, self._file):
                if stream is not None:
                    stream.close()
        finally:
            self._release()
            if self.size is not None and self._remote is None:
                self.cache._count(bytes_saved=self.position)
        return sink is not None

    def __del__(self) -> None:
        # no eviction pass from a finalizer: it may run while this very thread holds the ledger's lock
        with contextlib.suppress(Exception):
            self._stop()

    def __enter__(self) -> CachedShard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Entry(io.BufferedReader):
    """A complete cache entry open for reading (held against eviction by its shared lock): once checked, its
    ``size`` is known and the tar reader may map it (see :mod:`wds_cloud.io.mapped`)."""

    def __init__(self, fd: int) -> None:
        super().__init__(io.FileIO(fd, "rb", closefd=True))
        self.size: Optional[int] = None  # set once the entry was found complete

    def mapping(self) -> Optional[tuple[Any, int, tuple]]:
        """A read-only mapping of the entry, this stream's position in it and the file's identity, or None (read
        it as a stream)."""
        if self.size is None:
            return None
        return map_file(self.fileno(), self.size, self.tell())
