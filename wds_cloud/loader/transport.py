"""Batches from DataLoader workers to the main process through shared memory.

torch moves tensors between processes through shared memory (only a handle crosses the pipe), but
every ``bytes`` object (an encoded JPEG, a text) is pickled and written through the worker's pipe.
:func:`pack_batch`, run in the worker after collation, copies every list of byte strings in a batch into
one shared buffer (a Linux ``memfd``; torch's shared memory elsewhere) and presents each list as a
:class:`PackedBytes`: the buffer as a ``uint8`` tensor plus the offsets of the items.  The buffer crosses
to the main process as one file descriptor per batch, which is mapped there and closed at once (a kept
batch holds no open file).  In the main process a ``PackedBytes`` is a sequence of the items: indexing
and iterating give ``bytes`` (a copy), so code written for lists keeps working; :meth:`PackedBytes.view`
gives a zero-copy ``memoryview``, :meth:`PackedBytes.tensor` a ``uint8`` tensor view, and ``data`` /
``offsets`` hand the whole batch to a GPU decoder in one copy.

``WebLoader(pack_bytes=None)``, the default, packs a batch whose byte strings add up to
:data:`AUTO_MIN_BYTES` (1 MiB) or more: below about that, a shared segment per batch costs more than
pickling the batch (the figures are in bench/README.md, ``bench_gpu.py``).  ``pack_bytes=True`` packs every batch holding byte strings,
``False`` none.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional, Union, overload

from ..errors import MalformedDataError
from ..io.datafile import shown

__all__ = ["PackedBytes", "pack_batch", "PackingCollate", "AUTO_MIN_BYTES", "as_bytes", "BytesCollate"]

#: lists of byte strings shorter than this stay lists (packing two items saves nothing)
MIN_ITEMS = 2

#: ``pack_bytes=None`` (the default) packs a batch whose byte strings add up to at least this many bytes:
#: below it, handing a shared-memory segment to the main process costs more than pickling the bytes
AUTO_MIN_BYTES = 1024 * 1024


#: id(buffer) -> (a weak reference to the buffer, its pinned copy): the columns of a batch, which share one
#: buffer, pin it once; an entry goes when its buffer does
_PINNED: dict[int, tuple[weakref.ref, Any]] = {}


def _pinned(data: Any) -> Any:
    """The pinned copy of ``data`` (a tensor), made on first use and shared by every column over it."""
    key = id(data)
    entry = _PINNED.get(key)
    if entry is not None and entry[0]() is data:
        return entry[1]
    pinned = data.pin_memory()
    _PINNED[key] = (weakref.ref(data), pinned)
    weakref.finalize(data, _PINNED.pop, key, None)
    return pinned


class PackedBytes(Sequence):
    """A batch's byte strings in one ``uint8`` tensor ``data`` (in shared memory): item ``i`` is
    ``data[offsets[i]:offsets[i + 1]]``.  The columns of one batch share one ``data``; ``offsets`` (a list
    of ``len + 1`` ints) travels pickled with the batch.

    ``PackedBytes(items)`` packs a sequence of bytes-like objects (so code that rebuilds a sequence as
    ``type(seq)(new_items)`` keeps working); ``PackedBytes(data, offsets)`` wraps a buffer.
    """

    __slots__ = ("data", "offsets", "_memory", "_segment")

    def __init__(self, data: Any = (), offsets: Optional[list] = None) -> None:
        segment = None
        if offsets is None:
            data, offsets = _pack_into_one([list(data)], shared=False)[0]
        else:
            if isinstance(data, _Segment):  # packed in a worker, about to be sent
                segment, data = data, data.tensor
            elif isinstance(data, (bytes, bytearray, memoryview)):  # a buffer of bytes: as a uint8 tensor (a copy)
                data = _unpickle_tensor(bytes(data))
            _check_offsets(offsets, data)
        self.data = data
        self.offsets = offsets
        self._memory: Optional[memoryview] = None
        self._segment = segment

    @classmethod
    def pack(cls, items: Iterable) -> PackedBytes:
        """Pack ``items`` (bytes-like) into one tensor (in this process's memory)."""
        return cls(items)

    def __reduce__(self) -> Any:
        if self._segment is not None:
            # packed in a worker: the segment travels as a file descriptor, once per batch (the batch's
            # columns hold the same segment object, and pickle's memo sends it once)
            return (PackedBytes, (self._segment, self.offsets))
        # anywhere else (received, pinned, built here): this column's bytes, by value
        start, offsets = self.offsets[0], self.offsets
        return (_unpickle, (self._buffer()[start : offsets[-1]].tobytes(), [o - start for o in offsets]))

    def _buffer(self) -> memoryview:
        memory = self._memory
        if memory is None:
            memory = self._memory = memoryview(self.data.numpy()).toreadonly()
        return memory

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[bytes, list]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.view(index).tobytes()

    def __iter__(self) -> Iterator[bytes]:
        memory, offsets = self._buffer(), self.offsets
        for i in range(len(offsets) - 1):
            yield memory[offsets[i] : offsets[i + 1]].tobytes()

    def view(self, index: int) -> memoryview:
        """Item ``index`` as a read-only ``memoryview`` of the shared buffer (no copy)."""
        offsets = self.offsets
        n = len(offsets) - 1
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"item {index} of a batch of {n}")
        return self._buffer()[offsets[index] : offsets[index + 1]]

    def views(self) -> list:
        """Every item as a zero-copy ``memoryview``."""
        memory, offsets = self._buffer(), self.offsets
        return [memory[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]

    def tensor(self, index: int) -> Any:
        """Item ``index`` as a ``uint8`` tensor view (what ``torchvision.io.decode_jpeg`` takes)."""
        offsets = self.offsets
        return self.data[offsets[index] : offsets[index + 1]]

    def tensors(self) -> list:
        """Every item as a ``uint8`` tensor view."""
        data, offsets = self.data, self.offsets
        return [data[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]

    def pin_memory(self, device: Any = None) -> PackedBytes:
        """Pinned (page-locked) for a fast, asynchronous copy to a GPU (DataLoader's ``pin_memory=True``).

        The columns of a batch share one buffer, and it is pinned once: the first column's pinned copy
        is kept on the buffer for the others."""
        return PackedBytes(_pinned(self.data), self.offsets)

    def tolist(self) -> list:
        return list(self)

    def copy(self) -> list:
        """The items as a new ``list`` (what ``list.copy`` gives code written for lists)."""
        return list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PackedBytes, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a sequence compared by value, like a list

    def __add__(self, other: Any) -> list:
        return self.tolist() + list(other)

    def __radd__(self, other: Any) -> list:
        return list(other) + self.tolist()

    def __repr__(self) -> str:
        return f"<PackedBytes: {len(self)} items, {self.offsets[-1] - self.offsets[0]} bytes>"


def _check_offsets(offsets: Any, data: Any) -> None:
    """Offsets that slice ``data`` into items: a list of ints from 0 (or more), never decreasing, the last
    inside the buffer.  A wrong one is an error, never a silently short or shifted item."""
    length = int(data.numel()) if hasattr(data, "numel") else len(data)
    if (
        not isinstance(offsets, list)
        or not offsets
        or not all(type(at) is int for at in offsets)
        or offsets[0] < 0
        or offsets[-1] > length
        or any(map(int.__gt__, offsets, offsets[1:]))
    ):
        raise MalformedDataError(
            f"PackedBytes offsets {shown(offsets)} do not slice a buffer of {length} bytes: they "
            "must be a non-empty list of ints from 0 that never decrease and end inside it",
            field="offsets",
        )


def _unpickle(data: bytes, offsets: list) -> PackedBytes:
    return PackedBytes(_unpickle_tensor(data), offsets)


def _unpickle_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class _Segment:
    """Memory for one batch's bytes that another process can map: a Linux ``memfd``, sent by file descriptor
    (``multiprocessing``'s ``DupFd``, as torch sends its tensors).  The receiver maps it and closes the
    descriptor at once, so a batch kept alive holds no open file (torch's own shared tensors each keep one,
    and a program holding ~1,000 batches then fails with "Too many open files")."""

    __slots__ = ("fd", "tensor")

    def __init__(self, size: int) -> None:
        _register_reducer()
        self.fd = -1
        fd = os.memfd_create("wds_cloud-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.tensor = _map(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the mapping stays valid while ``tensor`` lives

    def __reduce__(self) -> Any:
        # pickled for keeps (plain pickle): by value; between processes see _register_reducer
        return (_unpickle_tensor, (self.tensor.numpy().tobytes(),))


def _send_segment(segment: _Segment) -> Any:
    """How ``multiprocessing`` (a DataLoader's queues) pickles a :class:`_Segment`: by file descriptor."""
    from multiprocessing.reduction import DupFd

    return (_attach, (DupFd(segment.fd), segment.tensor.numel()))


_registered = False


def _register_reducer() -> None:
    global _registered
    if not _registered:
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler.register(_Segment, _send_segment)
        _registered = True


def _attach(handle: Any, size: int) -> Any:
    """A received :class:`_Segment`: its memory mapped here as a ``uint8`` tensor, the descriptor closed."""
    fd = handle.detach()
    try:
        return _map(fd, size)
    finally:
        os.close(fd)


def _map(fd: int, size: int) -> Any:
    """The memory of ``fd`` as a ``uint8`` tensor that holds no descriptor (``mmap.mmap`` would keep a copy)."""
    import torch

    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)


_MEMFD = hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _pack_into_one(columns: list, shared: bool) -> list:
    """``columns`` (lists of bytes-like items) copied into one ``uint8`` buffer: ``(data, offsets)`` per
    column, all with the same ``data``.  ``shared``: in memory another process can map (a :class:`_Segment`
    where Linux has ``memfd``, else torch's shared memory)."""
    import torch

    spans, end = [], 0
    for items in columns:
        offsets = [end]
        for item in items:
            end += _nbytes(item)
            offsets.append(end)
        spans.append(offsets)
    global _MEMFD
    data: Any = None
    if shared and end and _MEMFD:
        try:
            data = _Segment(end)
            array = memoryview(data.tensor.numpy())
        except (OSError, RuntimeError):  # no memfd here after all (a sandbox): torch's shared memory from now on
            _MEMFD, data = False, None
    if data is None:
        data = torch.empty(end, dtype=torch.uint8)
        if shared:  # torch would otherwise copy it into shared memory when the batch is sent
            data.share_memory_()
        array = memoryview(data.numpy())
    if end:
        for items, offsets in zip(columns, spans):
            for item, start, stop in zip(items, offsets, offsets[1:]):
                # a view of a mapped shard goes straight from the page cache into the shared buffer
                array[start:stop] = item if type(item) is bytes else memoryview(item).cast("B")
    return [(data, offsets) for offsets in spans]


_BYTE_TYPES = frozenset((bytes, bytearray, memoryview))


def _byte_size(value: Any) -> int:
    """How many bytes the list of byte strings ``value`` holds; -1 where it is not one (or too short).  A list of
    views (``WebDataset(zero_copy=True)``) is one however short: a view cannot be pickled."""
    if type(value) is not list or not value or not _BYTE_TYPES.issuperset(map(type, value)):
        return -1
    if len(value) < MIN_ITEMS and type(value[0]) is not memoryview:
        return -1
    return sum(map(_nbytes, value))


def _nbytes(item: Any) -> int:
    return item.nbytes if type(item) is memoryview else len(item)


def _holds_views(columns: list) -> bool:
    return any(type(item) is memoryview for column in columns for item in column)


def _unviewed(value: Any) -> Any:
    """``value`` with a view that is not in a packed column made ``bytes`` (a view cannot be pickled): a
    single sample's fields, or a field of a batch that is not a list of byte strings."""
    if type(value) is memoryview:
        return value.tobytes()
    if type(value) is dict:
        return (
            {k: _unviewed(v) for k, v in value.items()} if any(type(v) is memoryview for v in value.values()) else value
        )
    if type(value) in (tuple, list) and any(type(v) is memoryview for v in value):
        out = [_unviewed(v) for v in value]
        return tuple(out) if type(value) is tuple else out
    return value


def pack_batch(batch: Any, min_bytes: int = 0) -> Any:
    """``batch`` with every list of byte strings (a column of a tuple or list, a value of a dict, or the
    batch itself) packed into a :class:`PackedBytes`, all in one shared-memory buffer; anything else as it
    is.  Nothing is packed when the byte strings add up to fewer than ``min_bytes``: the views in such a batch
    (``WebDataset(zero_copy=True)``) are made ``bytes``, which pickle."""
    keys: list
    batch = _unviewed(batch) if type(batch) is not list else batch
    whole = _byte_size(batch)
    if whole >= 0:
        keys, total = [None], whole
        columns = [batch]
    elif type(batch) is dict:
        named = {k: _byte_size(v) for k, v in batch.items()}
        keys = [k for k, n in named.items() if n >= 0]
        total = sum(named[k] for k in keys)
        columns = [batch[k] for k in keys]
    elif type(batch) in (tuple, list):
        sizes = [_byte_size(c) for c in batch]
        keys = [i for i, n in enumerate(sizes) if n >= 0]
        total = sum(sizes[i] for i in keys)
        columns = [batch[i] for i in keys]
    else:
        return batch
    if not columns:
        return batch
    if total < min_bytes:  # views too: below the threshold a shared segment costs more than the bytes it saves
        return as_bytes(batch) if _holds_views(columns) else batch
    packed = [PackedBytes(data, offsets) for data, offsets in _pack_into_one(columns, shared=True)]
    if keys == [None]:
        return packed[0]
    if isinstance(batch, dict):
        return {**batch, **dict(zip(keys, packed))}
    out = list(batch)
    for i, column in zip(keys, packed):
        out[i] = column
    return tuple(out) if isinstance(batch, tuple) else out


def as_bytes(batch: Any) -> Any:
    """``batch`` with every view in it (a field, a column's item, a dict's value) made ``bytes``: what a worker
    sends when batches are not packed (``WebLoader(pack_bytes=False)``), since a view cannot be pickled."""
    kind = type(batch)
    if kind is memoryview:
        return batch.tobytes()
    if kind is dict:
        return {k: as_bytes(v) for k, v in batch.items()}
    if kind is list or kind is tuple:
        if not any(type(v) in (memoryview, list, tuple, dict) for v in batch):
            return batch
        out = [as_bytes(v) for v in batch]
        return tuple(out) if kind is tuple else out
    return batch


class BytesCollate:
    """A DataLoader ``collate_fn``: ``inner``'s result with its views made ``bytes`` (see :func:`as_bytes`)."""

    def __init__(self, inner: Callable) -> None:
        self.inner = inner

    def __call__(self, data: Any) -> Any:
        return as_bytes(self.inner(data))


class PackingCollate:
    """A DataLoader ``collate_fn``: ``inner``'s result packed by :func:`pack_batch` when in a worker process.

    For torch's own ``DataLoader``: ``DataLoader(ds.batched(256), batch_size=None, num_workers=8,
    collate_fn=wds.transport.PackingCollate())`` (``inner`` defaults to torch's ``default_convert``, what a
    loader with ``batch_size=None`` uses; give ``torch.utils.data.default_collate`` when the loader batches).
    """

    def __init__(self, inner: Optional[Callable] = None, min_bytes: int = 0) -> None:
        if inner is None:
            from ..resume.loader import default_collate

            inner = default_collate(per_item=True)  # torch's default_convert
        self.inner: Callable = inner
        self.min_bytes = min_bytes

    def __call__(self, data: Any) -> Any:
        from torch.utils.data import get_worker_info

        out = self.inner(data)
        return pack_batch(out, self.min_bytes) if get_worker_info() is not None else out
