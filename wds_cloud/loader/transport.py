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

``WebLoader(pack_bytes=True)`` packs every batch holding byte strings (the default, ``None``, sends batches
through :mod:`~wds_cloud.loader.frames`, which keeps the columns' types; ``False`` pickles them whole).
Given as ``min_bytes`` to :func:`pack_batch` or :class:`PackingCollate`, :data:`AUTO_MIN_BYTES` (1 MiB) packs
only a batch whose byte strings add up to that or more: below about that, a shared segment per batch costs
more than pickling the batch (the figures are in docs/gpu.md).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional, Union, overload

from ..errors import MalformedDataError
from ..io.datafile import shown
from ..resume.views import as_bytes, default_collate, view_keeping, views_pickle_as_bytes

__all__ = ["PackedBytes", "pack_batch", "PackingCollate", "AUTO_MIN_BYTES", "as_bytes", "BytesCollate"]

#: lists of byte strings shorter than this stay lists: 1, so that a column's type does not hang on its length (a
#: last batch of one sample came as a list, the others as PackedBytes: the adversary's finding)
MIN_ITEMS = 1

#: a ``min_bytes`` that packs only a batch whose byte strings add up to at least this many bytes: below it,
#: handing a shared-memory segment to the main process costs more than pickling the bytes
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
#: what a field of a batch that is not a column to pack may be, holding no view: nothing to walk
_PLAIN = frozenset((bytes, bytearray, str, int, float, bool, type(None)))


def _column_size(value: list, kinds: set) -> int:
    """How many bytes the list of byte strings ``value`` (its items of ``kinds``) holds; -1 where it is not one (or
    too short).  A list of views (``WebDataset(zero_copy=True)``) is one however short: a view cannot be pickled."""
    if not value or not _BYTE_TYPES.issuperset(kinds):
        return -1
    if memoryview not in kinds:
        return sum(map(len, value)) if len(value) >= MIN_ITEMS else -1
    return sum(map(_nbytes, value))


def _nbytes(item: Any) -> int:
    return item.nbytes if type(item) is memoryview else len(item)


_CONTAINERS = (dict, list, tuple)


def _may_hold_views(kinds: set) -> bool:
    """Whether items of these types may be or hold a view (a view, or a container: :func:`as_bytes` looks)."""
    return memoryview in kinds or any(issubclass(k, _CONTAINERS) for k in kinds if k not in _PLAIN)


def pack_batch(batch: Any, min_bytes: int = 0) -> Any:
    """``batch`` with every list of byte strings (a column of a tuple or list, a value of a dict, or the
    batch itself) packed into a :class:`PackedBytes`, all in one shared-memory buffer; anything else as it
    is, but for views (``WebDataset(zero_copy=True)``), which cannot be pickled: every view that is not in a
    packed column, at any depth, is made ``bytes``.  Nothing is packed when the byte strings add up to fewer
    than ``min_bytes``."""
    kind = type(batch)
    if kind is dict:
        fields: Any = batch.values()
    elif kind is list or kind is tuple:
        fields = batch
    else:
        return as_bytes(batch)
    kinds = set(map(type, fields))
    if kind is list:
        whole = _column_size(batch, kinds)
        if whole >= 0:  # the batch is one column
            if whole < min_bytes:
                return [v.tobytes() if type(v) is memoryview else v for v in batch] if memoryview in kinds else batch
            return PackedBytes(*_pack_into_one([batch], shared=True)[0])
    if list not in kinds:  # no column (a sample's fields, or a batch of samples): only views to make bytes
        return as_bytes(batch) if _may_hold_views(kinds) else batch
    # one pass over each field's items: the columns to pack, and whether anything else may hold a view
    columns: dict = {}
    total, viewed = 0, False
    for key, value in batch.items() if kind is dict else enumerate(batch):
        if type(value) is list:
            items = set(map(type, value))
            size = _column_size(value, items)
            if size >= 0:
                columns[key] = value
                total += size
                viewed = viewed or memoryview in items
                continue
            viewed = viewed or _may_hold_views(items)
        else:
            viewed = viewed or type(value) is memoryview or isinstance(value, _CONTAINERS)
    if not columns or total < min_bytes:  # below the threshold a shared segment costs more than it saves
        return as_bytes(batch) if viewed else batch
    done = dict(zip(columns, (PackedBytes(*c) for c in _pack_into_one(list(columns.values()), shared=True))))
    # the fields not packed keep no view: one at any depth would fail the batch's pickling
    if kind is dict:
        return {k: done[k] if k in done else as_bytes(v) for k, v in batch.items()}
    out = [done[i] if i in done else as_bytes(v) for i, v in enumerate(batch)]
    return tuple(out) if kind is tuple else out


class BytesCollate:
    """A DataLoader ``collate_fn``: ``inner``'s result with its views, at any depth, made ``bytes`` (see
    :func:`as_bytes`).  torch's own ``default_convert`` and ``default_collate`` as ``inner`` keep views, to
    be made ``bytes`` here, never read as numbers."""

    def __init__(self, inner: Callable) -> None:
        self.inner: Callable = view_keeping(inner)

    def __call__(self, data: Any) -> Any:
        return as_bytes(self.inner(data))


class PackingCollate:
    """A DataLoader ``collate_fn``: ``inner``'s result packed by :func:`pack_batch` when in a worker process (in
    the main process, its views made ``bytes``).

    For torch's own ``DataLoader``: ``DataLoader(ds.batched(256), batch_size=None, num_workers=8,
    collate_fn=wds.transport.PackingCollate())`` (``inner`` defaults to torch's ``default_convert``, what a
    loader with ``batch_size=None`` uses; give ``torch.utils.data.default_collate`` when the loader batches).
    """

    def __init__(self, inner: Optional[Callable] = None, min_bytes: int = 0) -> None:
        # torch's default_convert (the default) or default_collate, given here, keep views at any depth, to be
        # packed or made bytes; a module-level class with named fields, so spawn and forkserver workers get it
        self.inner: Callable = default_collate(per_item=True) if inner is None else view_keeping(inner)
        self.min_bytes = min_bytes

    def __call__(self, data: Any) -> Any:
        from torch.utils.data import get_worker_info

        out = self.inner(data)
        # without workers nothing crosses, but views are handed over as bytes all the same (what a worker hands
        # over, and what torch's pin_memory walk would otherwise read as numbers)
        if get_worker_info() is None:
            return as_bytes(out)
        views_pickle_as_bytes()
        return pack_batch(out, self.min_bytes)
