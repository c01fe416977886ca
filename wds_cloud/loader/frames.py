"""Batches from DataLoader workers to the main process as a small pickle plus one region of shared memory.

A DataLoader worker pickles each batch and writes it through a pipe, so the main process reads every byte of
every image out of the pipe and then copies it again into the ``bytes`` it unpickles: on a node with many cores
that main process is the ceiling of a rank.  :func:`frame`, run in the worker on each batch, pickles the batch
with every large buffer left out (``bytes`` and ``bytearray`` of :data:`MIN_ITEM_BYTES` or more, views of
mapped shards, C-contiguous numpy arrays, small CPU tensors), at any depth of whatever structure the user's
collation built, and copies those buffers into a ring of shared memory the worker keeps (a Linux ``memfd``,
mapped by both processes; its descriptor crosses once).  Only the small pickle crosses the pipe.  The main
process unpickles it, making each buffer anew from the ring as the type it was (``bytes`` stays ``bytes``, a
``bytearray`` a ``bytearray``, an array an array of its dtype and shape, a view ``bytes``, as a view always
crosses), then writes into the ring's header how far it has taken, so the worker reuses the ring without
waiting for anything.

A pipeline whose batches hold nothing large pays for the examination (a call per object pickled) only now and
then: after :data:`PLAIN_STREAK` such batches in a row, the next :data:`PLAIN_SKIP` are sent as they are.

Where the ring is full (the main process is behind) it grows to twice its size, up to :data:`MAX_RING_BYTES`;
past that, a batch gets a segment of its own.  Where there is no ``memfd`` (not Linux) :func:`frame` gives the
batch back as it is and the batch is pickled as torch pickles it.

What a main process keeps: one mapped ring per worker that has sent a batch, dropped when a worker's ring is
replaced by a larger one, and once the worker has exited: as a ``WebLoader`` pass ends or begins, or a new ring
arrives (:func:`forget_exited`).

The main process's side (mapping rings, making the buffers anew, forgetting exited workers, keeping its freed
heap) is :mod:`~wds_cloud.loader.unframe`.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import secrets
import sys
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

from ..resume.views import as_bytes, view_keeping, views_pickle_as_bytes
from .unframe import (
    HEADER,
    KIND_ARRAY,
    KIND_BYTEARRAY,
    KIND_BYTES,
    KIND_LIST,
    KIND_SMALL_TENSOR,
    KIND_TENSOR,
    KIND_TUPLE,
    U64,
    from_body,
    from_ring,
    from_segment,
)

__all__ = [
    "MIN_ITEM_BYTES",
    "RING_BYTES",
    "MAX_RING_BYTES",
    "MAX_TENSOR_BYTES",
    "PLAIN_STREAK",
    "PLAIN_SKIP",
    "frame",
    "FramingCollate",
]

#: a buffer this large or larger crosses in the ring; a smaller one is pickled with the batch (a region of
#: the ring costs a call on each side, which a few hundred bytes in the pickle do not)
MIN_ITEM_BYTES = 512

#: the first ring of a worker holds at least this many bytes, and four of its first batch (rounded up to a power
#: of two): about what a worker has in flight, so a ring costs a few batches of memory
RING_BYTES = 1 << 20

#: a ring grows no larger: a batch that does not fit one this size crosses in a segment of its own
MAX_RING_BYTES = 1 << 30

#: a CPU tensor this large or larger is left to torch, which moves it into shared memory of its own and sends
#: a handle (a copy into the ring and out again would cost more)
MAX_TENSOR_BYTES = 1 << 20

#: after this many batches in a row with nothing to leave out, :func:`frame` sends the next :data:`PLAIN_SKIP`
#: as they are (pickled by torch, unexamined), then examines one again: a pipeline of tiny samples pays for the
#: examination (a call per object of the batch) on one batch in 64
PLAIN_STREAK = 4
PLAIN_SKIP = 63

_MEMFD = hasattr(os, "memfd_create") and sys.platform.startswith("linux")


class _Ring:
    """A worker's ring: shared memory written at a running count ``end`` (a position is ``end % size``), which
    the main process frees by writing how far it has copied out (``taken``)."""

    def __init__(self, size: int) -> None:
        fd = os.memfd_create("wds_cloud-frames", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, HEADER + size)
            self.map = mmap.mmap(fd, HEADER + size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size = size
        self.token = secrets.token_bytes(8)
        self.pid = os.getpid()
        self.end = 0
        self.memory = memoryview(self.map)

    def mapped(self) -> bool:
        """Whether the main process has the ring (until then, each batch carries its descriptor)."""
        return U64.unpack_from(self.map, 8)[0] == 1

    def taken(self) -> int:
        """How far the main process has copied out (a running count)."""
        return U64.unpack_from(self.map, 0)[0]

    def reserve(self, n: int) -> Optional[int]:
        """A running position of ``n`` contiguous free bytes, or None where the ring has not that much free."""
        size = self.size
        taken = self.taken()
        at = self.end % size
        pad = size - at if at + n > size else 0  # a region never wraps: the tail is skipped
        if self.end + pad + n - taken > size:
            return None
        start = self.end + pad
        self.end = start + n
        return start

    def close(self) -> None:
        self.memory.release()
        self.map.close()
        os.close(self.fd)


_lock = threading.Lock()
_ring: Optional[_Ring] = None  # this worker's ring (a process that forks one of its own starts afresh)
_retired: list = []  # rings replaced by a larger one, kept until the main process has taken what they hold


def _reserve(n: int) -> Optional[tuple]:
    """(ring, running position, the token of the ring it replaced) for ``n`` bytes, or None: a segment of its
    own."""
    global _ring
    with _lock:
        ring = _ring
        if ring is not None and ring.pid != os.getpid():  # forked from a worker: the ring is its parent's
            ring = _ring = None
            _retired.clear()
        for old in [r for r in _retired if r.taken() >= r.end]:
            _retired.remove(old)
            old.close()
        if ring is not None:
            start = ring.reserve(n)
            if start is not None:
                return ring, start, None
        size = max(RING_BYTES, 4 * n, 2 * ring.size if ring is not None else 0)
        if size > MAX_RING_BYTES:
            if 4 * n > MAX_RING_BYTES:
                return None
            size = MAX_RING_BYTES
        if ring is not None and ring.size >= size:
            return None  # the largest ring is full: the main process is far behind
        new = _Ring(1 << (size - 1).bit_length())
        start = new.reserve(n)
        assert start is not None
        _ring = new
        if ring is None:
            return new, start, None
        _retired.append(ring)
        return new, start, ring.token


class _Pickler(ForkingPickler):
    """multiprocessing's pickler (torch's reductions included) at protocol 5, leaving large buffers out: each
    gets a persistent id ``(kind, start, stop, ...)`` in the frame, and is copied there after the dump."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        super().__init__(self.out, 5)
        self.dispatch_table[memoryview] = _view_as_bytes  # a small view crosses as bytes, as a large one does
        self.parts: list = []  # (start, a bytes-like object of the part's bytes)
        self.size = 0
        self.seen: dict = {}  # id -> persistent id: an object held twice is one object in the main process
        # tensors' storages (by address): those taken into the frame, those left to torch, and those that must be
        # left to torch (two tensors of the batch share them: torch sends what they share as shared)
        self.taken: set = set()
        self.left: set = set()
        self.excluded: set = set()
        self.array: Any = None
        self.tensor: Any = None
        self.pids = 0  # how many persistent ids the last batch's pickle holds
        self.plain = 0  # how many batches in a row had nothing to leave out
        self.skip = 0  # how many batches to come are sent as they are, unexamined

    def pickle(self, batch: Any) -> bytes:
        """The pickle of ``batch``, its large buffers left out (``parts``, ``size``); one pickler serves every
        batch of a process (making one copies multiprocessing's table of reductions, torch's among them)."""
        self.excluded.clear()
        numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")  # (either may be imported by now)
        self.array = numpy.ndarray if numpy is not None else None
        self.tensor = torch.Tensor if torch is not None else None
        while True:
            self.parts, self.size, self.seen, self.pids = [], 0, {}, 0
            self.taken.clear()
            self.left.clear()
            self.clear_memo()
            out = self.out
            out.seek(0)
            out.truncate()
            try:
                self.dump(batch)
                break
            except _SharedStorage as shared:  # again, leaving that storage's tensors to torch
                self.excluded.add(shared.address)
            except BaseException:  # (what the batch holds is not kept until the next batch)
                self.clear_memo()
                self.parts, self.seen = [], {}
                raise
        body = out.getvalue()
        self.seen = {}  # (nothing of the batch is kept past its pickling but what ``parts`` holds)
        return body

    def persistent_id(self, obj: Any) -> Any:
        pid = self._leave_out(obj)
        if pid is not None:
            self.pids += 1
        return pid

    def _leave_out(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is list or kind is tuple:  # a column of byte strings: made in the main process in one call
            if len(obj) < 2 or not all(type(item) is bytes and len(item) >= MIN_ITEM_BYTES for item in obj):
                return None
            return self._column(obj, KIND_LIST if kind is list else KIND_TUPLE)
        if kind is bytes or kind is bytearray:
            n = len(obj)
            if n < MIN_ITEM_BYTES:
                return None
            return self._add(obj, obj, n, (KIND_BYTES if kind is bytes else KIND_BYTEARRAY,))
        if kind is memoryview:
            if obj.nbytes < MIN_ITEM_BYTES or not obj.c_contiguous:
                return None  # (pickled as bytes: see _view_as_bytes)
            return self._add(
                obj, obj.cast("B") if obj.format != "B" or obj.ndim != 1 else obj, obj.nbytes, (KIND_BYTES,)
            )
        if kind is self.array:
            if obj.nbytes < MIN_ITEM_BYTES or obj.dtype.hasobject or not obj.flags.c_contiguous:
                return None
            return self._add(obj, obj.reshape(-1).view("u1"), obj.nbytes, (KIND_ARRAY, obj.dtype, obj.shape))
        if kind is self.tensor:
            return self._tensor(obj)
        return None

    def _tensor(self, obj: Any) -> Any:
        known = self.seen.get(id(obj))
        if known is not None:
            return known
        if obj.layout is not _strided() or obj.is_nested:  # sparse, nested: no bytes of their own; torch pickles them
            return None
        n = obj.nbytes
        storage = obj.untyped_storage().data_ptr() if n else None  # (empty tensors share no bytes)
        if storage is not None and storage in self.taken:
            # another tensor of the batch holds this storage, and its bytes were taken: torch must send both (it
            # may move the storage into shared memory as it pickles this one, freeing what was taken from)
            raise _SharedStorage(storage)
        if (
            storage in self.left
            or storage in self.excluded
            or n >= MAX_TENSOR_BYTES
            or obj.device.type != "cpu"
            or obj.layout is not _strided()
            or obj.requires_grad
            or obj.is_quantized
            or obj.is_shared()
            or obj.is_conj()
            or obj.is_neg()
            or any(getattr(obj, "names", ()))  # (named tensors, where torch still has them)
            or not obj.is_contiguous()
            or obj.untyped_storage().nbytes() != n  # a view of a larger storage: torch keeps what it shares
        ):
            if storage is not None:
                self.left.add(storage)
            return None
        if storage is not None:
            self.taken.add(storage)
        data = memoryview(obj.detach().view(-1).view(_uint8()).numpy())
        if n < MIN_ITEM_BYTES:  # in the pickle, where torch would give it shared memory of its own
            pid = self.seen[id(obj)] = (KIND_SMALL_TENSOR, data.tobytes(), obj.dtype, tuple(obj.shape))
            return pid
        return self._add(obj, data, n, (KIND_TENSOR, obj.dtype, tuple(obj.shape)))

    def _column(self, obj: Any, kind: int) -> tuple:
        known = self.seen.get(id(obj))
        if known is not None:
            return known
        start = at = self.size
        for item in obj:
            self.parts.append((at, item))
            at += len(item)
        self.size = at
        layout = "".join([f"{len(item)}s" for item in obj])  # struct's: the items' bytes, one after another
        pid = self.seen[id(obj)] = (kind, start, at, layout)
        return pid

    def _add(self, obj: Any, data: Any, n: int, kind: tuple) -> tuple:
        known = self.seen.get(id(obj))
        if known is not None:
            return known
        start = self.size
        self.size = start + n
        self.parts.append((start, data))
        pid = self.seen[id(obj)] = (kind[0], start, start + n, *kind[1:])
        return pid


class _SharedStorage(Exception):
    """Raised within a dump: the storage at ``address`` is held by two tensors, one already taken."""

    def __init__(self, address: int) -> None:
        super().__init__(address)
        self.address = address


def _view_as_bytes(view: memoryview) -> tuple:
    return (bytes, (view.tobytes(),))


def _strided() -> Any:
    import torch

    return torch.strided


def _uint8() -> Any:
    import torch

    return torch.uint8


class _Framed:
    """A batch as it crosses: the pickle of its structure and where its buffers lie.  Pickled (by the worker's
    queue), it carries the ring's descriptor until the main process has mapped the ring."""

    __slots__ = ("body", "ring", "start", "stop", "retired", "segment")

    def __init__(self, body: bytes, ring: Optional[_Ring], start: int, stop: int, retired: Optional[bytes]) -> None:
        self.body, self.ring, self.start, self.stop, self.retired = body, ring, start, stop, retired
        self.segment: Optional[int] = None  # a descriptor of a segment of its own (no ring)

    def __reduce__(self) -> Any:
        from multiprocessing.reduction import DupFd

        ring = self.ring
        if ring is None:
            fd, self.segment = self.segment, None
            assert fd is not None, "a framed batch is sent once"
            try:
                return (from_segment, (self.body, DupFd(fd), self.stop))
            finally:
                os.close(fd)  # (DupFd keeps a duplicate until the main process has it)
        handle = None if ring.mapped() else DupFd(ring.fd)
        return (from_ring, (self.body, ring.token, ring.pid, handle, ring.size, self.start, self.stop, self.retired))

    def __del__(self) -> None:
        if self.segment is not None:
            os.close(self.segment)


def frame(batch: Any) -> Any:
    """In a DataLoader worker: ``batch`` as it will cross to the main process (an object that unpickles as the
    batch), its large buffers copied into shared memory now (a view of a shard is copied while the shard is
    certainly mapped); ``batch`` itself where there is no ``memfd``."""
    if not _MEMFD:
        return batch
    pickler = _pickler()
    if pickler.skip:  # the batches before had nothing to leave out: this one is pickled as torch pickles it
        pickler.skip -= 1
        views_pickle_as_bytes()
        return batch
    body = pickler.pickle(batch)
    n, parts = pickler.size, pickler.parts
    pickler.parts = []
    if not n:  # nothing large: the pickle made is what crosses
        pickler.plain += 1
        if pickler.plain >= PLAIN_STREAK:
            pickler.skip = PLAIN_SKIP
        return _Pickled(body, pickler.pids > 0)
    pickler.plain = 0
    try:
        place = _reserve(n)
        if place is None:
            return _segment(body, parts, n)
    except OSError:  # memfd refused (a sandbox, no memory): the batch is pickled whole
        return batch
    ring, start, retired = place
    at = HEADER + start % ring.size
    memory = ring.memory
    for offset, data in parts:
        memory[at + offset : at + offset + len(data)] = data
    return _Framed(body, ring, start, start + n, retired)


_picklers = threading.local()


def _pickler() -> _Pickler:
    """This thread's pickler (a process forked from one that framed makes its own: the ring is not shared)."""
    pickler = getattr(_picklers, "pickler", None)
    if pickler is None or _picklers.pid != os.getpid():
        pickler = _picklers.pickler = _Pickler()
        _picklers.pid = os.getpid()
    return pickler


class _Pickled:
    """A batch with no buffer to leave out, as it crosses: the pickle :func:`frame` made of it (``inline``: it
    holds small tensors, made by :class:`Unpickler`)."""

    __slots__ = ("body", "inline")

    def __init__(self, body: bytes, inline: bool) -> None:
        self.body, self.inline = body, inline

    def __reduce__(self) -> Any:
        return (from_body if self.inline else pickle.loads, (self.body,))


def _segment(body: bytes, parts: list, n: int) -> _Framed:
    fd = os.memfd_create("wds_cloud-batch", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, n)
        with mmap.mmap(fd, n) as memory:
            for offset, data in parts:
                memory[offset : offset + len(data)] = data
    except BaseException:
        os.close(fd)
        raise
    framed = _Framed(body, None, 0, n, None)
    framed.segment = fd
    return framed


class FramingCollate:
    """A DataLoader ``collate_fn``: ``inner``'s result, in a worker process, framed (:func:`frame`); in the main
    process, its views made ``bytes``."""

    def __init__(self, inner: Any) -> None:
        self.inner = view_keeping(inner)

    def __call__(self, data: Any) -> Any:
        from torch.utils.data import get_worker_info

        out = self.inner(data)
        if get_worker_info() is None:
            return as_bytes(out)
        views_pickle_as_bytes()
        return frame(out)
