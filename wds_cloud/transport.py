"""Batches from DataLoader workers to the main process through shared memory.

torch moves tensors between processes through shared memory (only a handle crosses the pipe), but
every ``bytes`` object (an encoded JPEG, a text) is pickled and written through the worker's pipe.
:func:`pack_batch`, run in the worker after collation, turns each list of byte strings in a batch into
one :class:`PackedBytes`: a contiguous ``uint8`` tensor plus the offsets of its items, which then
travel as two tensors.  In the main process a ``PackedBytes`` is a sequence of the items: indexing
and iterating give ``bytes`` (a copy out of shared memory), so code written for lists keeps working;
:meth:`PackedBytes.view` gives a zero-copy ``memoryview`` and :meth:`PackedBytes.tensor` a ``uint8``
tensor view, and ``data``/``offsets`` hand the whole batch to a GPU decoder in one copy.

``WebLoader(..., pack_bytes=True)`` turns it on.  It is off by default: on a 2-core machine with 2
workers, batches of 256 JPEGs handed on whole (to a GPU decoder) moved 1.45x faster packed (61k vs 42k
samples/s, bench/bench_gpu.py), batches of 64 at parity, and where the main process takes every item
out as ``bytes`` packing ran at 70% of pickling (22k vs 31k).  The case it is for (the main process
unpickling for 8-15 workers) could not be measured on that machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Union, overload

__all__ = ["PackedBytes", "pack_batch", "PackingCollate"]

#: lists of byte strings shorter than this stay lists (packing two items saves nothing)
MIN_ITEMS = 2


class PackedBytes(Sequence):
    """A batch's byte strings as one ``uint8`` tensor ``data`` (in shared memory) and ``offsets`` (a list of
    ``len + 1`` ints, pickled with the batch): item ``i`` is ``data[offsets[i]:offsets[i + 1]]``."""

    __slots__ = ("data", "offsets")

    def __init__(self, data: Any, offsets: list) -> None:
        self.data = data
        self.offsets = offsets

    @classmethod
    def pack(cls, items: Sequence) -> "PackedBytes":
        """Pack ``items`` (bytes-like) into one tensor: one copy, into memory torch can share."""
        import torch

        offsets = [0]
        for item in items:
            offsets.append(offsets[-1] + len(item))
        # allocated in shared memory at once: torch would otherwise copy it there when the batch is sent
        data = torch.empty(offsets[-1], dtype=torch.uint8).share_memory_()
        if offsets[-1]:
            array = data.numpy()
            for item, start, end in zip(items, offsets, offsets[1:]):
                array[start:end] = memoryview(item).cast("B")
        return cls(data, offsets)

    def _spans(self) -> list:
        return self.offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[bytes, list]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return bytes(self.view(index))

    def view(self, index: int) -> memoryview:
        """Item ``index`` as a read-only ``memoryview`` of the shared buffer (no copy)."""
        spans = self._spans()
        n = len(spans) - 1
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"item {index} of a batch of {n}")
        return memoryview(self.data.numpy())[spans[index]:spans[index + 1]].toreadonly()

    def views(self) -> list:
        """Every item as a zero-copy ``memoryview``."""
        return [self.view(i) for i in range(len(self))]

    def tensor(self, index: int) -> Any:
        """Item ``index`` as a ``uint8`` tensor view (what ``torchvision.io.decode_jpeg`` takes)."""
        spans = self._spans()
        return self.data[spans[index]:spans[index + 1]]

    def pin_memory(self, device: Any = None) -> "PackedBytes":
        """Pinned (page-locked) for a fast, asynchronous copy to a GPU (DataLoader's ``pin_memory=True``)."""
        return PackedBytes(self.data.pin_memory(), self.offsets)

    def tolist(self) -> list:
        return [bytes(v) for v in self.views()]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PackedBytes, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __add__(self, other: Any) -> list:
        return self.tolist() + list(other)

    def __repr__(self) -> str:
        return f"<PackedBytes: {len(self)} items, {self.offsets[-1]} bytes>"


def _is_bytes_list(value: Any) -> bool:
    return (isinstance(value, list) and len(value) >= MIN_ITEMS
            and all(isinstance(item, (bytes, bytearray)) for item in value))


def pack_batch(batch: Any) -> Any:
    """``batch`` with every list of byte strings (a column of a tuple, a value of a dict, or the batch
    itself) packed into a :class:`PackedBytes`; anything else as it is."""
    if _is_bytes_list(batch):
        return PackedBytes.pack(batch)
    if isinstance(batch, tuple) and not hasattr(batch, "_fields"):
        return tuple(PackedBytes.pack(c) if _is_bytes_list(c) else c for c in batch)
    if isinstance(batch, list):
        return [PackedBytes.pack(c) if _is_bytes_list(c) else c for c in batch]
    if isinstance(batch, dict):
        return {k: PackedBytes.pack(v) if _is_bytes_list(v) else v for k, v in batch.items()}
    return batch


class PackingCollate:
    """A DataLoader ``collate_fn``: ``inner``'s result packed by :func:`pack_batch` when in a worker process."""

    def __init__(self, inner: Callable) -> None:
        self.inner = inner

    def __call__(self, data: Any) -> Any:
        from torch.utils.data import get_worker_info

        out = self.inner(data)
        return pack_batch(out) if get_worker_info() is not None else out
