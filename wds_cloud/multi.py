"""``webdataset.multi`` kept as a module path: ``MultiLoader`` runs on our ``WebLoader``.

webdataset's ``MultiLoader`` fed samples from worker processes over ZMQ sockets.
Here it is a thin stand-in with the same constructor: the workers are torch
DataLoader workers (``WebLoader(dataset, batch_size=None, num_workers=workers)``),
so no ZMQ and no socket files are involved; ``verbose``, ``nokill`` and
``prefix`` are accepted and have nothing left to control.  Without torch the
dataset is iterated in this process.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

from .compat import WebLoader
from .pytorch import HAVE_TORCH

__all__ = ["MultiLoader", "EOF", "the_protocol"]

#: the pickle protocol of webdataset's ZMQ messages (kept for code that reads it; our workers send batches
#: through the DataLoader's own channel)
the_protocol = pickle.HIGHEST_PROTOCOL


class EOF:
    """webdataset's marker of a finished stream (``EOF(index=i)``): an object with the given attributes."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class MultiLoader:
    """Iterate ``dataset`` in ``workers`` processes, items as the dataset yields them."""

    def __init__(
        self, dataset: Any, workers: int = 4, verbose: bool = False, nokill: bool = False, prefix: str = "/tmp/_multi-"
    ) -> None:
        self.dataset = dataset
        self.workers = workers
        self.verbose = verbose

    def __iter__(self) -> Iterator:
        return iter(WebLoader(self.dataset, batch_size=None, num_workers=self.workers if HAVE_TORCH else 0))
