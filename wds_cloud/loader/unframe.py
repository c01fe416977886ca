"""The main process's side of :mod:`~wds_cloud.loader.frames`: a batch a worker framed, made anew here.

A framed batch unpickles through :func:`from_ring` (or :func:`from_segment`, :func:`from_body`): the worker's
ring is mapped the first time its descriptor arrives and kept while the worker lives; each buffer the worker left
out of the pickle is copied out of the ring into the type it was (a column of byte strings in one ``struct``
call); then how far this process has taken is written into the ring's header, for the worker to reuse it.  The
rings of workers that have exited are dropped as a ``WebLoader`` pass ends or begins, and as a new ring arrives
(:func:`forget_exited`).

This process makes every batch's buffers anew, and frees the last batch's: with glibc's first thresholds, the
free memory at the top of its heap goes back to the kernel once it passes 128 KiB, so each batch faulted its pages
in again (a third of the main process's time went to the kernel).  :func:`keep_freed_heap`, called as a loader
with workers is made, moves glibc's thresholds where glibc itself moves them after a large block is freed
(allocations under :data:`HEAP_BYTES` come from the heap, which keeps up to twice that free): it allocates and
frees one such block, untouched.

The wire format both sides share is here: the ring's header (:data:`HEADER` bytes) and the kinds of a left-out
buffer (the first field of its persistent id).
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import pickle
import struct
import sys
import threading
from typing import Any, Optional

__all__ = ["HEAP_BYTES", "keep_freed_heap", "forget_exited"]

#: see :func:`keep_freed_heap`: glibc serves allocations under this from its heap and keeps twice this free there
HEAP_BYTES = 8 << 20

#: the ring's header: how far the main process has taken (a little-endian u64 at 0), whether it has mapped
#: the ring (a u64 at 8, written once), then padding to a cache line
HEADER = 64
U64 = struct.Struct("<Q")

# what a left-out buffer is made as in the main process (the first field of its persistent id)
KIND_BYTES, KIND_BYTEARRAY, KIND_ARRAY, KIND_TENSOR, KIND_LIST, KIND_TUPLE, KIND_SMALL_TENSOR = 0, 1, 2, 3, 4, 5, 6


_heap_kept = [False]


def keep_freed_heap() -> None:
    """Once per process, where the C library is glibc: raise its thresholds as freeing a block of
    :data:`HEAP_BYTES` does (see the module's docstring); workers forked later inherit them.  Nothing anywhere
    else, and never an error."""
    if _heap_kept[0]:
        return
    _heap_kept[0] = True
    try:
        if not sys.platform.startswith("linux") or not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return
        libc = ctypes.CDLL(None)
        malloc, free = libc.malloc, libc.free
        malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        free.restype, free.argtypes = None, [ctypes.c_void_p]
        free(malloc(HEAP_BYTES))  # mapped (over the first threshold), freed untouched: glibc raises its thresholds
    except (OSError, ValueError, AttributeError):
        pass


class _Mapped:
    """The main process's mapping of a worker's ring."""

    __slots__ = ("map", "memory", "pid", "size")

    def __init__(self, fd: int, size: int, pid: int) -> None:
        self.map = mmap.mmap(fd, HEADER + size)
        self.memory = memoryview(self.map)
        self.pid = pid
        self.size = size
        U64.pack_into(self.map, 8, 1)  # mapped: the worker stops sending its descriptor

    def close(self) -> None:
        try:
            self.memory.release()
            self.map.close()
        except BufferError:  # a batch being made from it still holds a view: the mapping goes with the view
            pass


RINGS: dict = {}  # token -> _Mapped
_rings_lock = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (not ours to signal: it exists)
        return True
    return True


def _register(token: bytes, pid: int, handle: Any, size: int, retired: Optional[bytes]) -> _Mapped:
    with _rings_lock:
        fd = handle.detach()
        try:
            ring = RINGS.get(token)
            if ring is None:
                ring = RINGS[token] = _Mapped(fd, size, pid)
        finally:
            os.close(fd)
        if retired is not None and retired in RINGS:  # the ring this one replaced
            RINGS.pop(retired).close()
        _forget_exited()
        return ring


def forget_exited() -> None:
    """Drop the rings of workers that have exited (a loader's pass calls it as it ends, and as it begins)."""
    with _rings_lock:
        _forget_exited()


def _forget_exited() -> None:
    for token in [t for t, r in RINGS.items() if not _alive(r.pid)]:
        RINGS.pop(token).close()


def from_ring(
    body: bytes, token: bytes, pid: int, handle: Any, size: int, start: int, stop: int, retired: Optional[bytes]
) -> Any:
    """The batch a worker framed in its ring, made anew here; the ring's region freed for the worker."""
    ring = RINGS.get(token)
    if handle is not None:
        ring = _register(token, pid, handle, size, retired)
    elif retired is not None:
        with _rings_lock:
            old = RINGS.pop(retired, None)
        if old is not None:
            old.close()
    if ring is None:
        raise RuntimeError(
            f"a batch from DataLoader worker process {pid} refers to shared memory this process never received "
            "(its first batch was lost); pass pack_bytes=False to WebLoader to send batches through the pipe"
        )
    at = HEADER + start % size
    try:
        return Unpickler(body, ring.memory[at : at + stop - start]).load()
    finally:
        U64.pack_into(ring.map, 0, stop)


def from_body(body: bytes) -> Any:
    """A batch with nothing in shared memory (its small tensors are in the pickle)."""
    return Unpickler(body, memoryview(b"")).load()


def from_segment(body: bytes, handle: Any, size: int) -> Any:
    fd = handle.detach()
    try:
        with mmap.mmap(fd, size) as memory:
            region = memoryview(memory)
            try:
                return Unpickler(body, region).load()
            finally:
                region.release()
    finally:
        os.close(fd)


class Unpickler(pickle.Unpickler):
    """Unpickles a framed batch, each left-out buffer copied out of ``region`` into the type it was."""

    def __init__(self, body: bytes, region: memoryview) -> None:
        super().__init__(io.BytesIO(body))
        self.region = region
        self.made: dict = {}
        self.small: dict = {}  # id of a small tensor's pid -> (the pid, the tensor): one tensor met twice is one

    def persistent_load(self, pid: Any) -> Any:
        kind, start, stop = pid[0], pid[1], pid[2]
        if kind == KIND_SMALL_TENSOR:
            # the pickler memoizes the pid of a tensor met again (the same tuple comes back): the same tensor
            hit = self.small.get(id(pid))
            if hit is not None and hit[0] is pid:
                return hit[1]
            small = _tensor(start, stop, pid[3])
            self.small[id(pid)] = (pid, small)
            return small
        made = self.made.get(start)
        if made is not None:
            return made
        if not 0 <= start < stop <= len(self.region):
            raise pickle.UnpicklingError(f"a framed buffer at {start}:{stop} lies outside its {len(self.region)} bytes")
        if kind == KIND_LIST or kind == KIND_TUPLE:
            try:
                if struct.calcsize(pid[3]) != stop - start:
                    raise struct.error(f"its layout holds {struct.calcsize(pid[3])} bytes")
                items = struct.unpack_from(pid[3], self.region, start)
            except (struct.error, TypeError) as error:
                raise pickle.UnpicklingError(f"a framed column at {start}:{stop} does not fit: {error}") from None
            out: Any = list(items) if kind == KIND_LIST else items
            self.made[start] = out
            return out
        data = self.region[start:stop]
        if kind == KIND_BYTES:
            out = data.tobytes()
        elif kind == KIND_BYTEARRAY:
            out = bytearray(data)
        elif kind == KIND_ARRAY:
            import numpy

            out = numpy.frombuffer(bytearray(data), dtype=pid[3]).reshape(pid[4])
        elif kind == KIND_TENSOR:
            out = _tensor(data, pid[3], pid[4])
        else:
            raise pickle.UnpicklingError(f"a framed buffer of unknown kind {kind!r}")
        self.made[start] = out
        return out


def _tensor(data: Any, dtype: Any, shape: tuple) -> Any:
    """A tensor of ``dtype`` and ``shape`` holding a copy of ``data``."""
    import torch

    if not len(data):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
