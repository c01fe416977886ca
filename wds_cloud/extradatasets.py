"""Small datasets: a mock, fixed-length epochs, declared lengths, repetition."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

from . import utils
from .pytorch import IterableDataset
from .stages import PipelineStage

__all__ = ["MockDataset", "repeatedly", "with_epoch", "with_length"]


class MockDataset(IterableDataset):
    """``length`` copies of ``sample``."""

    def __init__(self, sample: Any, length: int) -> None:
        self.sample = sample
        self.length = length

    def __iter__(self) -> Iterator:
        for _ in range(self.length):
            yield self.sample

    def __len__(self) -> int:
        return self.length


class repeatedly(IterableDataset, PipelineStage):
    """Iterate over ``source`` repeatedly, bounded by epochs, batches or a length."""

    def __init__(
        self, source: Any, nepochs: Optional[int] = None, nbatches: Optional[int] = None, length: Optional[int] = None
    ) -> None:
        self.source = source
        self.nepochs = nepochs
        self.nbatches = nbatches
        self.length = length

    def invoke(self, source: Any) -> Iterator:
        return utils.repeatedly(source, nepochs=self.nepochs, nbatches=self.nbatches)

    def __iter__(self) -> Iterator:
        return self.invoke(self.source)

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("repeatedly(..., length=None) has no length")
        return self.length


class with_epoch(IterableDataset):
    """Epochs of exactly ``length`` items from one continuing iterator over ``dataset``.

    The iterator restarts when ``dataset`` is exhausted.  Picklable (it holds no
    iterator until iterated), so spawn-started workers can receive it.
    """

    def __init__(self, dataset: Any, length: int) -> None:
        super().__init__()
        self.dataset = dataset
        self.length = length
        self.source: Optional[Iterator] = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["source"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def invoke(self, dataset: Any) -> Iterator:
        if self.source is None:
            self.source = iter(dataset)
        for _ in range(self.length):
            try:
                sample = next(self.source)
            except StopIteration:
                self.source = iter(dataset)
                try:
                    sample = next(self.source)
                except StopIteration:
                    return
            yield sample

    def __iter__(self) -> Iterator:
        return self.invoke(self.dataset)

    def __len__(self) -> int:
        return self.length


class with_length(IterableDataset):
    """``dataset`` with ``len()`` declared as ``length`` (picklable)."""

    def __init__(self, dataset: Any, length: int) -> None:
        super().__init__()
        self.dataset = dataset
        self.length = length

    def __iter__(self) -> Iterator:
        return iter(self.dataset)

    def __len__(self) -> int:
        return self.length
