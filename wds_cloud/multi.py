"""``webdataset.multi`` kept as a module path: ``MultiLoader`` runs on our ``WebLoader``.

webdataset's ``MultiLoader`` fed samples from worker processes over ZMQ sockets.
Here it is a thin stand-in with the same constructor: the workers are torch
DataLoader workers (``WebLoader(dataset, batch_size=None, num_workers=workers)``),
so no ZMQ and no socket files are involved; ``verbose``, ``nokill`` and
``prefix`` are accepted and have nothing left to control.  Without torch the
dataset is iterated in this process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .compat import WebLoader
from .pytorch import HAVE_TORCH

__all__ = ["MultiLoader"]


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
