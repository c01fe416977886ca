"""``DataPipeline``: a source followed by stages, iterated as one dataset.

The first stage is called with no argument (a shard list, a dataset, a list)
and every later stage receives the iterator of the one before.  ``with_epoch``
and ``with_length`` return the pipeline itself and keep it picklable, so
spawn-started DataLoader workers receive it intact.
"""

from __future__ import annotations

import copy
import sys
from itertools import islice
from typing import Any, Callable, Iterator

from .pytorch import DataLoader, IterableDataset
from .stages import PipelineStage

__all__ = ["DataPipeline", "add_length_method"]


def add_length_method(obj: Any) -> Any:
    """Give ``obj`` (a DataPipeline with ``size`` set) a working ``len()``; returns ``obj``."""
    obj._has_length = True
    return obj


class DataPipeline(IterableDataset, PipelineStage):
    """A pipeline of stages; ``DataPipeline(source, stage1, stage2, ...)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.pipeline: list = []
        self.length = -1
        self.repetitions = 1
        self.nsamples = -1
        self.size = None
        self._has_length = False
        self.epoch = None
        for arg in args:
            if arg is None:
                continue
            if isinstance(arg, list):
                self.pipeline.extend(arg)
            else:
                self.pipeline.append(arg)

    def close(self) -> None:
        """Drop references to the stages (and what they hold open)."""
        self.pipeline = []

    def invoke(self, f: Any, *args: Any, **kwargs: Any) -> Iterator:
        if isinstance(f, PipelineStage):
            return f.run(*args, **kwargs)
        if isinstance(f, (IterableDataset, DataLoader)) and len(args) == 0:
            return iter(f)
        if isinstance(f, list):
            return iter(f)
        if callable(f):
            return f(*args, **kwargs)
        raise ValueError(f"{f!r} is not a pipeline stage: give a callable, a PipelineStage, an iterable dataset or a list")

    def iterator1(self) -> Iterator:
        """One pass through the pipeline."""
        if not self.pipeline:
            raise ValueError("this DataPipeline has no stages")
        source = self.invoke(self.pipeline[0])
        for step in self.pipeline[1:]:
            source = self.invoke(step, source)
        return source

    def iterator(self) -> Iterator:
        """``repetitions`` passes; stops early when a pass yields nothing."""
        for _ in range(self.repetitions):
            count = 0
            for sample in self.iterator1():
                yield sample
                count += 1
            if count == 0:
                break

    def __iter__(self) -> Iterator:
        if self.repetitions != 1 and self.nsamples > 0:
            return islice(self.iterator(), self.nsamples)
        return self.iterator()

    def __len__(self) -> int:
        if not self._has_length or self.size is None:
            raise TypeError("this pipeline has no length: call .with_length(n) to declare one")
        return self.size

    def stage(self, i: int) -> Any:
        return self.pipeline[i]

    def append(self, f: Callable) -> None:
        self.pipeline.append(f)

    def compose(self, *args: Callable) -> "DataPipeline":
        """A copy of this pipeline with ``args`` appended (fluent methods return new objects)."""
        result = copy.copy(self)
        result.pipeline = list(self.pipeline)
        for arg in args:
            result.append(arg)
        return result

    def with_length(self, n: int, silent: bool = False) -> "DataPipeline":
        """Declare ``len(self) == n`` (picklable, unlike webdataset's)."""
        self.size = n
        return add_length_method(self)

    def with_epoch(self, nsamples: int = -1, nbatches: int = -1) -> "DataPipeline":
        """Make each epoch exactly ``nsamples`` items, repeating the pipeline as needed."""
        self.repetitions = sys.maxsize
        self.nsamples = max(nsamples, nbatches)
        return self

    def repeat(self, nepochs: int = -1, nbatches: int = -1) -> "DataPipeline":
        """Repeat the pipeline ``nepochs`` times (forever when <= 0), stopping after ``nbatches`` items."""
        self.repetitions = nepochs if nepochs > 0 else sys.maxsize
        self.nsamples = nbatches
        return self

    def set_epoch(self, epoch: int) -> None:
        """Tell every stage that has ``set_epoch`` which epoch comes next."""
        self.epoch = epoch
        for stage in self.pipeline:
            if hasattr(stage, "set_epoch"):
                stage.set_epoch(epoch)
