"""torch's DataLoader, whose iterators label a batch for the profiler only while a profiler runs.

torch's DataLoader iterator wraps the making of every batch in ``torch.autograd.profiler.record_function``,
profiler or not: entering and leaving it calls two TorchScript operators, about a fifth of the main process's
CPU per batch in ``bench/bench_peers.py``'s DataLoader rows (64 JPEGs a batch, 2 workers).  :class:`TorchLoader`
is that DataLoader (a subclass, made with the same arguments), whose iterators take the label only while
``torch.autograd._profiler_enabled()`` says a profiler is recording (asked at every batch, so a profiler started
mid-pass sees the batches from then on); everything else a batch's ``next()`` does is torch's own.  A callback
registered with the RecordFunction API outside a profiler does not see these batches.
"""

from __future__ import annotations

from typing import Any

from ..pytorch import HAVE_TORCH, DataLoader
from . import unframe

__all__ = ["TorchLoader"]


if HAVE_TORCH:
    import torch
    from torch.utils.data import dataloader as _torch_dataloader

    _profiling = torch.autograd._profiler_enabled

    class _Unlabelled:
        """``__next__`` of a torch DataLoader iterator, the profiler's label taken only while one records."""

        def __next__(self: Any) -> Any:
            # torch's own next() while a profiler records, before its first batch (it resets itself there), and
            # where len() was asked of the loader (it warns when more batches come than the length said)
            if _profiling() or self._sampler_iter is None or self._IterableDataset_len_called is not None:
                return super().__next__()  # type: ignore[misc]  # (torch's iterator, after this mixin)
            data = self._next_data()
            self._num_yielded += 1  # (its own count, as torch's next() keeps it)
            return data

    # named as torch's iterators: the profiler labels a batch with its iterator's class name
    class _SingleProcessDataLoaderIter(_Unlabelled, _torch_dataloader._SingleProcessDataLoaderIter):
        pass

    class _MultiProcessingDataLoaderIter(_Unlabelled, _torch_dataloader._MultiProcessingDataLoaderIter):
        def _shutdown_workers(self) -> None:
            # the shared memory of workers that have exited goes with them, here too: persistent workers exit
            # when their loader goes, long after any pass ended (their rings stayed mapped until another ran)
            try:
                super()._shutdown_workers()
            finally:
                unframe.forget_exited()

    class TorchLoader(DataLoader):
        """torch's ``DataLoader``, its iterators :mod:`unlabelled <wds_cloud.loader.torchloader>` while no
        profiler runs."""

        def _get_iterator(self) -> Any:
            if self.num_workers == 0:
                return _SingleProcessDataLoaderIter(self)
            self.check_worker_number_rationality()
            return _MultiProcessingDataLoaderIter(self)

else:
    TorchLoader = DataLoader  # type: ignore[misc,assignment]  # without torch: the stand-in
