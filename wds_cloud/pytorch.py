"""torch's ``IterableDataset`` and ``DataLoader`` when torch is installed, small stand-ins when not.

Torch is optional: with it, our datasets are real ``IterableDataset``s that
``torch.utils.data.DataLoader`` accepts; without it, everything still runs in
the main process, and ``DataLoader`` is a minimal batching iterator.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any, Optional

__all__ = ["IterableDataset", "DataLoader", "TorchIterableDataset", "TorchTensor", "HAVE_TORCH"]

HAVE_TORCH = importlib.util.find_spec("torch") is not None

if HAVE_TORCH:
    from torch import Tensor as TorchTensor
    from torch.utils.data import DataLoader, IterableDataset

    TorchIterableDataset = IterableDataset
else:

    class IterableDataset:  # type: ignore[no-redef]  # the stand-in when torch is absent
        """Stand-in for ``torch.utils.data.IterableDataset`` when torch is not installed."""

        def __iter__(self) -> Iterator:
            raise NotImplementedError

    TorchIterableDataset = None  # type: ignore[misc,assignment]  # no torch: nothing to subclass

    class TorchTensor:  # type: ignore[no-redef]  # the stand-in when torch is absent: nothing is one
        """Stand-in for ``torch.Tensor`` when torch is not installed (``isinstance(x, TorchTensor)`` is False)."""

    class DataLoader:  # type: ignore[no-redef]  # the stand-in when torch is absent
        """Stand-in for ``torch.utils.data.DataLoader`` without torch: iterates in this process.

        ``batch_size=None`` passes items through (through ``collate_fn`` when given,
        as torch does); an integer batches them with ``collate_fn`` (default: lists).
        ``num_workers`` is accepted and ignored.
        """

        def __init__(
            self,
            dataset: Any,
            batch_size: Optional[int] = 1,
            shuffle: bool = False,
            num_workers: int = 0,
            collate_fn: Optional[Callable] = None,
            drop_last: bool = False,
            **kw: Any,
        ) -> None:
            self.dataset = dataset
            self.batch_size = batch_size
            self.num_workers = num_workers
            self.collate_fn = collate_fn
            self.drop_last = drop_last

        def __iter__(self) -> Iterator:
            if self.batch_size is None:
                if self.collate_fn is None:
                    yield from self.dataset
                else:
                    for item in self.dataset:
                        yield self.collate_fn(item)
                return
            batch: list = []
            for item in self.dataset:
                batch.append(item)
                if len(batch) == self.batch_size:
                    yield self.collate_fn(batch) if self.collate_fn else batch
                    batch = []
            if batch and not self.drop_last:
                yield self.collate_fn(batch) if self.collate_fn else batch
