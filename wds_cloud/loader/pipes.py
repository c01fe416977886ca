"""Wide result pipes for DataLoader workers: a batch of about 1 MiB crosses in four writes, not sixteen.

A DataLoader worker sends each batch it pickled through a pipe, and a Linux pipe holds 64 KiB: a 1 MiB batch
(64 JPEGs) goes across in sixteen pieces, the worker and the main process taking turns for each, which on a
machine with few cores costs more than the bytes (bench/README.md, ``bench_peers.py``'s DataLoader row).
:func:`context` gives the multiprocessing context :class:`~wds_cloud.WebLoader` hands its DataLoader when the
program gave none: it is the program's default context (the start method it set, as torch would use it) whose
queues, once a worker process first puts into one, ask the kernel for a pipe of :data:`PIPE_BYTES`
(``F_SETPIPE_SZ``).  Only the queue that workers put into (the results) is widened, so a loader iterator with
workers takes one pipe of 64 pages of the user's allowance (``/proc/sys/fs/pipe-user-pages-soft``, 16384 pages
by default; a plain pipe takes 16) while it lives; below :data:`ALLOWANCE_FLOOR` pages none is widened (past the
allowance the kernel would give every new pipe of the user 2 pages).  Where the kernel refuses (an older kernel,
another system) the pipe stays as it was: nothing else changes.  Its queues also receive each message straight
into one buffer, where ``multiprocessing``'s connections read it in pieces copied into a growing buffer; a
message of up to :data:`KEPT_BYTES` goes into a buffer each receiving thread keeps for its next one (a fresh
1 MiB buffer per batch cost the main process its allocation, zero-filling and page faults every time).
"""

from __future__ import annotations

import array
import math
import multiprocessing
import multiprocessing.context
import multiprocessing.queues
import os
import select
import struct
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

__all__ = ["PIPE_BYTES", "ALLOWANCE_FLOOR", "KEPT_BYTES", "DIRECT_BYTES", "allowance", "context", "widen", "WideQueue"]

#: the size asked for a worker result pipe (64 pages): a 1 MiB batch crosses in four writes, not sixteen, which
#: measured as fast as one (bench/README.md), while a loader takes a quarter of what a 1 MiB pipe would of the
#: user's allowance
PIPE_BYTES = 256 << 10

#: the per-user allowance of pipe pages (``pipe-user-pages-soft``) below which no pipe is widened: past the
#: allowance, the kernel gives every new pipe of the user 2 pages instead of 16, so widening must leave it room
#: (the default, 16384 pages, holds 256 wide pipes)
ALLOWANCE_FLOOR = 4096

#: the largest message read into the buffer a receiving thread keeps between messages (a larger one gets a
#: buffer of its own, freed with it): what a kept buffer may hold on to
KEPT_BYTES = 4 << 20

#: the largest message the process that made a queue writes itself (see WideQueue._put_now): an index
DIRECT_BYTES = 1024
_PAGE = 4096  # what a small write may take of a pipe, at most

_ALLOWANCE = "/proc/sys/fs/pipe-user-pages-soft"

try:
    import fcntl
    import termios

    _SETPIPE = getattr(fcntl, "F_SETPIPE_SZ", None)
except ImportError:  # not a POSIX system
    fcntl = None  # type: ignore[assignment]
    termios = None  # type: ignore[assignment]
    _SETPIPE = None


class WideQueue(multiprocessing.queues.Queue):
    """A ``multiprocessing`` queue whose pipe is widened to :data:`PIPE_BYTES` the first time a process other
    than the one that made it puts into it (a worker sending results).  As a subclass, it reaches the pipe of
    its own base class."""

    def __init__(self, maxsize: int = 0, *, ctx: Any) -> None:
        super().__init__(maxsize, ctx=ctx)
        self._made_in = os.getpid()
        self._widened = False

    def __getstate__(self) -> Any:
        return (super().__getstate__(), self._made_in)

    def __setstate__(self, state: Any) -> None:
        base, self._made_in = state
        super().__setstate__(base)
        self._widened = False

    def _reset(self, after_fork: bool = False) -> None:
        # the base class's own hook: messages are then received by _recv_whole (see there)
        super()._reset(after_fork)  # type: ignore[misc]
        self._recv_bytes = self._recv_whole
        self._poll = self._poll_kept
        self._kept = threading.local()  # each receiving thread's buffer (see _recv_whole) and poll object

    def _recv_whole(self) -> Any:
        """One message of the pipe (``multiprocessing``'s framing: a 4-byte big-endian length, -1 then an 8-byte
        one for 2 GiB and more), read straight into one buffer: the connection's own receive reads it in pieces
        it copies into a growing buffer, a copy of every batch more in the main process.  A message of up to
        :data:`KEPT_BYTES` is read into the buffer this thread keeps (the queue unpickles what it is given
        before its thread can ask for the next message, unless an object being unpickled asks, which :meth:`get`
        sees; and unpickled objects hold no reference to it)."""
        fd = self._reader.fileno()  # type: ignore[attr-defined]  # (as in put)
        (size,) = struct.unpack("!i", _read_exactly(fd, 4))
        if size == -1:
            (size,) = struct.unpack("!Q", _read_exactly(fd, 8))
        if size < 0:
            return b""  # as multiprocessing reads a negative length: nothing, which unpickles as EOFError
        kept = self._kept
        if size > KEPT_BYTES or getattr(kept, "depth", 1) > 1:  # (a get within the unpickling of another)
            return _read_exactly(fd, size)
        buffer = getattr(kept, "buffer", None)
        if buffer is None or len(buffer) < size:  # the next power of two: batches of about one size share it
            buffer = kept.buffer = bytearray(1 << (max(size, 1 << 16) - 1).bit_length())
        return _read_exactly(fd, size, buffer)

    def _poll_kept(self, timeout: Optional[float] = 0.0) -> bool:
        """Whether a message (or the end of the pipe) is there within ``timeout`` seconds (None: wait), as the
        connection's ``poll`` says it, with one ``poll`` object each receiving thread keeps: the connection's
        makes a selector, registers the pipe and closes it again for every batch."""
        kept = self._kept
        poller = getattr(kept, "poller", None)
        if poller is None:
            poller = kept.poller = select.poll()
            poller.register(self._reader.fileno(), select.POLLIN)  # type: ignore[attr-defined]  # (as in put)
        return bool(poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000))))

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        # how deep this thread is in gets: one asked while another's message is unpickled (by an object's
        # __reduce__) reads into a buffer of its own, not the kept one under that unpickling
        kept = self._kept
        kept.depth = getattr(kept, "depth", 0) + 1
        try:
            return super().get(block, timeout)
        finally:
            kept.depth -= 1

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        if os.getpid() == self._made_in:
            if self._thread is None and self._put_now(obj, block, timeout):  # type: ignore[attr-defined]
                return
        elif not self._widened:
            self._widened = True
            widen(self._writer.fileno())  # type: ignore[attr-defined]  # (its base class's pipe, not in the stubs)
        super().put(obj, block, timeout)

    def _put_now(self, obj: Any, block: bool, timeout: Optional[float]) -> bool:
        """In the process that made the queue (the main process, putting the next index for a worker), a small
        message is written by the caller, where the pipe has room for it: ``multiprocessing`` hands every
        message to a feeder thread, whose waking cost the main process more than the write.  False (nothing
        done) for a large message, a pipe without room, or a closed queue: the feeder thread takes it, and every
        message after it (none is written ahead of one the thread still holds)."""
        if self._closed:  # type: ignore[attr-defined]
            return False
        data = ForkingPickler.dumps(obj)
        if len(data) > DIRECT_BYTES:
            return False
        fd = self._writer.fileno()  # type: ignore[attr-defined]  # (as in put)
        # never waits for the lock: a worker may hold it for the whole of a large message into a pipe nobody reads
        # any more (torch's shutdown puts into the result queue so): the feeder thread waits for it instead
        lock = self._wlock  # type: ignore[attr-defined]
        if lock is None or not lock.acquire(False):
            return False
        try:
            if self._room() < len(data) + 4 + _PAGE:
                return False
            if not self._sem.acquire(False):  # type: ignore[attr-defined]  # (as multiprocessing's put counts)
                return False  # full: put() waits as it does (or raises queue.Full)
            os.write(fd, struct.pack("!i", len(data)) + bytes(data))  # at most a page into a pipe with room: at once
        finally:
            lock.release()
        return True

    def _room(self) -> int:
        """The bytes the queue's pipe can take now (its :meth:`capacity` less what it holds), 0 where that cannot
        be asked."""
        size = self.capacity()
        if size is None:
            return 0
        held = array.array("i", [0])
        try:
            fcntl.ioctl(self._reader.fileno(), termios.FIONREAD, held)  # type: ignore[attr-defined]  # (as in put)
        except OSError:
            return 0
        return size - held[0]

    def capacity(self) -> Optional[int]:
        """How many bytes the queue's pipe holds (``F_GETPIPE_SZ``), None where that cannot be asked."""
        getpipe = getattr(fcntl, "F_GETPIPE_SZ", None) if fcntl is not None else None
        if getpipe is None:
            return None
        try:
            return fcntl.fcntl(self._reader.fileno(), getpipe)  # type: ignore[attr-defined]  # (as in put)
        except OSError:
            return None


def _read_exactly(fd: int, size: int, into: Optional[bytearray] = None) -> Any:
    """``size`` bytes of ``fd``: a new ``bytearray``, or a ``memoryview`` of the first ``size`` bytes of ``into``;
    EOFError where it ends before the first of them, OSError after some (as ``multiprocessing``'s connections
    say it, for a length and for the bytes it announces alike)."""
    # a length claims what it likes: memory is taken as the bytes arrive (doubling, from KEPT_BYTES), never all
    # of a claim before any of it came
    out = bytearray(min(size, KEPT_BYTES)) if into is None else into
    got = 0
    while got < size:
        if got == len(out):
            out.extend(bytes(min(len(out), size - len(out))))
        view = memoryview(out)
        try:
            n = os.readv(fd, [view[got : min(size, len(out))]])
        finally:
            view.release()
        if not n:
            if not got:
                raise EOFError
            raise OSError("got end of file during message")
        got += n
    return out if into is None else memoryview(into)[:size]


def allowance() -> int:
    """The per-user allowance of pipe pages (0: none), as the kernel says (16384 where it cannot be read)."""
    try:
        with open(_ALLOWANCE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 16384


def widen(fd: int, size: Optional[int] = None) -> bool:
    """Ask for a pipe of ``size`` bytes (:data:`PIPE_BYTES`) behind ``fd``; False where the kernel or the system
    says no, or the user's pipe allowance is too small to spare it (see :data:`ALLOWANCE_FLOOR`)."""
    if _SETPIPE is None or fcntl is None:
        return False
    pages = allowance()
    if 0 < pages < ALLOWANCE_FLOOR:
        return False
    size = PIPE_BYTES if size is None else size
    try:
        fcntl.fcntl(fd, _SETPIPE, size)
    except (OSError, ValueError):  # EPERM past the per-user allowance, EBUSY, not a pipe, a closed one: as it was
        return False
    return True


class _WideContext(multiprocessing.context.BaseContext):
    """The program's default multiprocessing context, resolved when used (``multiprocessing.set_start_method``
    after the loader was made still counts), with :class:`WideQueue` queues."""

    Process = multiprocessing.Process  # the default context's: started with the program's start method

    def get_context(self, method: Optional[str] = None) -> Any:
        return multiprocessing.get_context(method)

    def get_start_method(self, allow_none: bool = False) -> Any:
        return multiprocessing.get_start_method(allow_none)

    def Queue(self, maxsize: int = 0) -> Any:  # noqa: N802 (multiprocessing's name)
        return WideQueue(maxsize, ctx=self.get_context())

    def __reduce__(self) -> Any:
        return (context, ())


_CONTEXT: Optional[_WideContext] = None


def context() -> Optional[Any]:
    """The context for a DataLoader's workers, or None where pipes cannot be widened here (not Linux)."""
    global _CONTEXT
    if _SETPIPE is None:
        return None
    if _CONTEXT is None:
        _CONTEXT = _WideContext()
    return _CONTEXT
