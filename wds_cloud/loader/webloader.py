"""``WebLoader``: a DataLoader with the fluent methods and exact, resumable states.

Each DataLoader worker attaches its pipeline state to the batches it delivers (through channels user code
never sees), so ``state_dict()`` answers at any step; batches may travel through shared memory
(:mod:`~wds_cloud.loader.transport`) and be copied to a device (:mod:`~wds_cloud.loader.gpu`).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Optional

from .. import utils
from ..dataset.fluid import FluidInterface
from ..errors import ConfigError, NotResumableError, StateMismatchError
from ..filters import default_collation_fn
from ..io.resilient import TransferStats
from ..pipeline import DataPipeline
from ..pytorch import HAVE_TORCH, IterableDataset
from ..resume import loader as loaderstate
from ..resume.elastic import LOADER_FORMAT, check_merged, is_merged, items_share
from ..resume.merge import merge_states
from ..resume.protocol import Resumable, is_buffering, is_resumable
from ..resume.state import RESHAPE_FIX, check_same, check_seal, expect, inexact_state, is_inexact, restart_from, seal
from ..resume.views import KeepingViews, default_collate, view_keeping
from ..resume.wiring import stage_name
from ..tar import table as tables
from . import frames, pipes, transport, unframe
from .torchloader import TorchLoader

__all__ = ["WebLoader", "gather_states", "gather_merged", "merge_gathered"]


class WebLoader(DataPipeline, FluidInterface):
    """A ``DataLoader`` (torch's, or our stand-in without torch) with the fluent methods.

    Each pass sets the dataset's epoch (0, 1, 2, ... unless ``set_epoch`` chose one), so
    re-started workers get a new shard order every epoch.  When the dataset is resumable
    (a ``WebDataset`` or ``DataPipeline``), ``state_dict()`` is where every worker stands
    at the last item this loader yielded, and ``load_state_dict`` makes the next pass
    continue from there, in the same worker order.

    Parameters are torch's ``DataLoader``'s, passed to it as given (``dataset``, ``batch_size``, ``shuffle``,
    ``sampler``, ``batch_sampler``, ``num_workers``, ``collate_fn``, ``pin_memory``, ``drop_last``,
    ``timeout``, ``worker_init_fn``, ``multiprocessing_context``, ``generator``, ``prefetch_factor``,
    ``persistent_workers``, ``pin_memory_device``; any other keyword, such as ``in_order``, goes to it as
    well), and two of ours:

    ``pack_bytes``: how batches cross from the workers.  ``None`` (the default): the large buffers of a
    batch, at any depth of whatever the collation built (``bytes``, ``bytearray``, numpy arrays, small CPU
    tensors), cross in shared memory and come out as the types they were; only the rest is pickled
    through the pipe (:mod:`wds_cloud.loader.frames`).  ``True``: every list of byte strings becomes a
    :class:`wds_cloud.transport.PackedBytes` (one shared buffer per batch, for a GPU decoder: see
    ``docs/gpu.md``).  ``False``: the whole batch is pickled through the pipe, as torch does.
    ``device="cuda"``: every batch's tensors are copied there from pinned memory (``pin_memory`` is
    then on) with ``non_blocking=True`` on a side stream (:func:`wds_cloud.loader.gpu.to_device`).

    A sampler, or a dataset that is not a ``WebDataset`` or ``DataPipeline``, makes the loader iterate as
    torch's would, without resumable states (:meth:`resume_blocker` says why).  :attr:`stats` sums the
    transfer statistics of the workers' datasets.
    """

    def __init__(
        self,
        dataset: Any = None,
        batch_size: Optional[int] = 1,
        shuffle: Optional[bool] = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Optional[Callable[[Any], Any]] = None,
        pin_memory: Optional[bool] = None,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Optional[Callable[[int], None]] = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        pack_bytes: Optional[bool] = None,
        device: Any = None,
        **kw: Any,
    ) -> None:
        if pack_bytes is not None and type(pack_bytes) is not bool:
            raise ConfigError(
                f"WebLoader(pack_bytes={pack_bytes!r}): expected None (the default: large buffers through shared "
                "memory, as the types they are), True (columns of byte strings as PackedBytes) or False (every "
                "batch pickled through the pipe)"
            )
        if not HAVE_TORCH and batch_size is not None and collate_fn is None:
            collate_fn = _columns  # as torch's default collation would, for the batches batched() makes
        self._dataset = dataset
        self._untag = None
        self._collate: Optional[loaderstate.StatsSender] = None  # what sends the workers' statistics, if any
        self._unstats: Optional[loaderstate.Unstats] = None
        self._workers = bool(num_workers) and HAVE_TORCH
        self._frames = False  # whether batches cross through wds_cloud.loader.frames
        if pin_memory is None:  # on where batches go to a CUDA device (pinned memory makes that copy async)
            pin_memory = device is not None and str(device).startswith("cuda")
        if num_workers and HAVE_TORCH and multiprocessing_context is None:
            # a batch crosses the workers' result pipe in one write (wds_cloud.loader.pipes); a context the
            # program gave is used as it is
            multiprocessing_context = pipes.context()
        # how a batch crosses from a worker: its buffers in shared memory, as the types they are
        # (wds_cloud.loader.frames); or its byte strings as shared-memory tensors (wds_cloud.transport)
        pack: Optional[Callable[[Any], Any]] = None
        if num_workers and HAVE_TORCH:
            if pack_bytes is None:
                pack = frames.frame
                unframe.keep_freed_heap()  # (before the workers fork: they inherit it)
                self._frames = True
            elif pack_bytes:
                pack = transport.pack_batch
            else:  # pickled through the pipe: views (zero_copy=True) cross as bytes, never unpicklable
                pack = transport.as_bytes
        if not num_workers and HAVE_TORCH:
            # in this process torch's default collation (and its pin_memory walk) would read a view as numbers:
            # views, at any depth, are handed over as bytes, as workers hand them over
            given_fn = view_keeping(collate_fn)
            if given_fn is None:
                collate_fn = default_collate(batch_size is None, to_bytes=True)
            elif isinstance(given_fn, KeepingViews):  # torch's own, given: views made bytes in the same walk
                collate_fn = KeepingViews(given_fn.collate, given_fn.per_item, to_bytes=True)
            else:
                collate_fn = transport.BytesCollate(given_fn)
        _warn_if_every_worker_reads_every_shard(dataset, num_workers)
        # Why state_dict() cannot work here (None: it can).  Decided from the stages alone; a
        # pipeline that cannot be resumed is iterated exactly as torch's DataLoader would.
        self._blocker = _resume_blocker(dataset, sampler, batch_sampler)
        given = dataset
        whole = batch_size if drop_last and batch_size else None  # (see Ended)
        if self._blocker is None:
            ended = loaderstate.Ended(dataset, whole)
            given = ended
            collate_fn = self._collate = loaderstate.StateCollate(
                collate_fn, batch_size is None, ended, pack, tables.handed
            )
            # the member tables a worker kept go to the main process as it ends: the next epoch's workers start
            # with them (see wds_cloud.tar.table)
            self._untag = loaderstate.Untag(num_workers or 0, welcome=tables.adopt)
            self._untag.dataset = dataset
        elif pack is not None:
            inner = collate_fn or loaderstate.default_collate(batch_size is None)
            if pack_bytes is None:
                collate_fn = frames.FramingCollate(inner)
            else:
                collate_fn = transport.PackingCollate(inner) if pack_bytes else transport.BytesCollate(inner)
            if isinstance(dataset, IterableDataset) and loaderstate.transfer_stats(dataset) is not None:
                # no states to carry, but the workers' statistics: they ride with an item now and then
                ended = loaderstate.Ended(dataset, whole)
                given = ended
                collate_fn = self._collate = loaderstate.StatsCollate(collate_fn, batch_size is None, ended)
                self._unstats = loaderstate.Unstats()
        loader_args = dict(
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )
        super().__init__(TorchLoader(given, **loader_args, **kw))
        if self._untag is not None:
            self.append(self._untag)
        if self._unstats is not None:
            self.append(self._unstats)
        if device is not None:
            from .gpu import ToDevice

            self.append(ToDevice(device))
        self._auto_epoch = 0  # the epoch of the next pass
        self._pass_epoch = 0  # the epoch of the current (or loaded) pass

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._auto_epoch = epoch
        if self._dataset is not None and hasattr(self._dataset, "set_epoch"):
            self._dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator:
        dataset = self._dataset
        resuming = self._blocker is None and dataset is not None and dataset.has_worker_states
        # A resumed pass continues its epoch; so does a pass whose iterator was never advanced (Lightning
        # calls iter() once only to check that the loader is iterable): an epoch is used by reading it.
        unread = not self._progress[2] and self._resume_progress is None
        epoch = self._pass_epoch if resuming or unread else self._auto_epoch
        if dataset is not None and hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)  # before the workers start: each pass a new order
        if resuming and dataset is not None and self._resumed_pass_is_over():
            # the saved pass had yielded all its items (with_epoch): it resumes as an empty pass,
            # which starts no worker, so nothing would take the worker states; the next pass is fresh
            dataset.set_worker_states(None)
            resuming = False
        if not resuming and self._untag is not None:
            self._untag.resume(0, set(), {})  # a new pass: no worker has delivered anything yet
        self._pass_epoch, self._auto_epoch = epoch, epoch + 1
        if self._workers:
            _imported_for_workers()
            if self._collate is not None:  # what workers started now inherit: they send what they add to it
                self._collate.stats_sent = loaderstate.transfer_stats(dataset)
        if self._frames:  # the shared memory of this pass's workers goes with them (and any before's)
            unframe.forget_exited()
            return _forgetting_exited(super().__iter__())
        return super().__iter__()

    @property
    def stats(self) -> Optional[TransferStats]:
        """The transfer statistics of the loader's dataset (see ``WebDataset.stats``), summed over this process
        and every DataLoader worker, cumulative over the loader's passes (as a dataset's are over its process's
        life); None for a dataset that keeps none.

        Each worker sends what its copy of the dataset added with its first batch, then at most once a second,
        and with its last batch of a pass (riding with the batches, unseen by your code), so mid-pass the
        figures may lag the workers by up to a second; after a pass they are complete (with ``drop_last=True``,
        but for the reads of a worker's last, dropped, partial batch).  A mix
        (``WebDataset("train.yaml")``) gives its sources' figures summed.  A loader that cannot take resumable
        states (see :meth:`resume_blocker`) counts its workers' reads the same way.
        """
        own = loaderstate.transfer_stats(self._dataset)
        channel = self._untag if self._untag is not None else self._unstats
        if own is None or channel is None or not self._workers:
            return own
        total = TransferStats()
        total.add(own)
        total.add(channel.transfer)
        return total

    def state_dict(self, strict: bool = False, gather: bool = False) -> dict:
        """Every worker's dataset state at the last item yielded, and which worker comes next: plain JSON.

        Lightning calls this with every checkpoint: a loader that cannot be resumed exactly (see
        :meth:`resume_blocker`) never raises here but gives an inexact state holding the epoch, which
        :meth:`load_state_dict` turns into a restart of that epoch; ``strict=True`` raises
        :class:`~wds_cloud.errors.NotResumableError` instead.

        ``gather=True``: the states of every rank, gathered over ``torch.distributed`` (a collective: every
        rank calls it at the same step) and merged (:func:`wds_cloud.merge_states`): every rank gets the same
        state, which a loader of any number of ranks and workers can load.  The states go to rank 0, which
        merges them once and sends the merged state to every rank (:func:`gather_merged`).
        """
        if gather:
            try:
                own = self._own_state(True)
            except StateMismatchError as exc:  # still gathered: the other ranks must not wait in the collective
                own = {"format": UNAVAILABLE, "reason": str(exc)[:2000]}
            return gather_merged(own)
        return self._own_state(strict)

    def _own_state(self, strict: bool) -> dict:
        # The pass has ended when its iterator said so (Lightning's fetcher asks one item ahead, so it
        # has at the checkpoint after an epoch's last batch) or, with a declared length, when that many
        # items were yielded (where Lightning ends a sized epoch): the state then starts the next epoch.
        # So has it when every worker has handed over its last item (the loop stopped at the last batch, before the
        # iterator could say it had ended): a state of the rest would be of no worker at all.
        progress = self._progress
        untag = self._untag
        ended = self._resume_progress is None and (
            progress[3]
            or (self._has_length and self.size is not None and progress[1] >= self.size > 0)
            or (untag is not None and untag.finished())
        )
        if ended and self._untag is not None:
            rank, world_size = _rank()
            return seal(
                {
                    "format": LOADER_FORMAT,
                    "num_workers": self._untag.num_workers,
                    "next": 0,
                    "exhausted": [],
                    "epoch": self._auto_epoch,
                    "workers": [],
                    "progress": [0, 0],
                    "rank": rank,
                    "world_size": world_size,
                }
            )
        try:
            return seal(self._exact_state())
        except StateMismatchError as exc:  # NotResumableError, or a shuffle after the workers holding items
            if strict:
                raise (
                    exc
                    if isinstance(exc, NotResumableError)
                    else NotResumableError(f"this WebLoader cannot save a resumable state now: {exc}")
                ) from exc
            return seal(inexact_state(LOADER_FORMAT, str(exc), epoch=self._auto_epoch if ended else self._pass_epoch))

    def resume_blocker(self) -> Optional[str]:
        """Why this loader's states cannot be resumed exactly (None: they can, at batch boundaries)."""
        if self._untag is None:
            return self._blocker
        for stage in self.pipeline[2:]:
            if is_buffering(stage):
                return (
                    f"a {type(stage).__name__} stage appended to the WebLoader buffers items after the workers, "
                    "which no state can fetch again: a state taken while it holds items restarts the pass; "
                    "shuffle in the dataset (before the loader) instead"
                )
            if is_resumable(stage):  # its count (a slice's, a seeded rsample's) is in no state a loader takes
                return (
                    f"a {stage_name(stage)} stage appended to the WebLoader keeps a state of its own, which a "
                    "WebLoader's state (its workers') does not hold: resumed, it would start counting again; "
                    "put it in the dataset (before the loader) instead"
                )
        return None

    def _exact_state(self) -> dict:
        if self._untag is None:
            raise NotResumableError(f"this WebLoader cannot save a resumable state: {self._blocker}")
        after = list(enumerate(self.pipeline[2:], 2))
        for _, stage in after:  # first: a shuffle after the workers is what to fix, whatever else holds items
            if is_buffering(stage):
                stage.state_dict()  # raises if its buffer holds items, which cannot be fetched again
            elif is_resumable(stage):
                raise NotResumableError(f"this WebLoader cannot save a resumable state: {self.resume_blocker()}")
        for i, stage in after:
            held = stage.holding() if callable(getattr(stage, "holding", None)) else None
            if held is not None:  # an unbatched() after the workers, inside a batch: its parts would be lost
                raise NotResumableError(
                    f"this WebLoader cannot save a resumable state now: stage {i} ({stage_name(stage)}) {held}"
                )
        untag = self._untag
        next_worker, exhausted, states = untag.current()
        for worker, state in states.items():
            if isinstance(state, loaderstate.Unavailable):
                raise NotResumableError(
                    f"this WebLoader cannot save a resumable state: DataLoader worker "
                    f"{worker} could not take its dataset's state: {state.reason}"
                )
            if is_inexact(state):
                raise NotResumableError(
                    f"this WebLoader cannot save a resumable state: DataLoader worker {worker}: {state['inexact']}"
                )
        rank, world_size = _rank()
        return {
            "format": LOADER_FORMAT,
            "num_workers": untag.num_workers,
            "next": next_worker,
            "exhausted": sorted(exhausted),
            "epoch": self._pass_epoch,
            "workers": [[w, loaderstate.jsonable(s)] for w, s in sorted(states.items())],
            "progress": self._current_progress(),
            "rank": rank,
            "world_size": world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass continue where ``state`` (from :meth:`state_dict`) stood.

        An inexact state (see :meth:`state_dict`) is logged and makes the next pass begin its
        epoch again.
        """
        if is_merged(state):
            self._load_merged(state)
            return
        if not isinstance(state, dict) or state.get("format") != LOADER_FORMAT:
            raise StateMismatchError(
                "not a WebLoader state: pass the dict that WebLoader.state_dict() returned "
                "(or merge_states() of every rank's)",
                field="format",
            )
        if is_inexact(state):
            check_seal(state, "WebLoader")
            restart_from(state, "WebLoader")
            epoch = state.get("epoch", 0)
            self._pass_epoch = self._auto_epoch = epoch if type(epoch) is int and epoch >= 0 else 0
            self._resume_progress = None
            return
        if self._untag is None:
            raise NotResumableError(f"this WebLoader cannot load a state: {self._blocker}")
        state = self._pass_over(state)
        expect(
            state,
            "WebLoader",
            dict,
            num_workers=(int, lambda n: n >= 0),
            next=(int, lambda n: n >= 0),
            exhausted=(list, lambda v: all(type(w) is int and w >= 0 for w in v)),
            workers=(
                list,
                lambda v: all(
                    isinstance(e, (list, tuple))
                    and len(e) == 2
                    and type(e[0]) is int
                    and e[0] >= 0
                    and isinstance(e[1], dict)
                    for e in v
                ),
            ),
            epoch=(int, lambda n: n >= 0, True),
            progress=(list, lambda v: len(v) == 2 and all(type(x) is int and x >= 0 for x in v), True),
        )
        check_same(
            "WebLoader",
            {"num_workers": state["num_workers"]},
            {"num_workers": self._untag.num_workers},
            f"It was taken with num_workers={state['num_workers']}: build the loader with that many workers. "
            + RESHAPE_FIX,
        )
        workers = {w: s for w, s in state["workers"]}
        slots = max(self._untag.num_workers, 1)  # no workers: the main process is worker 0
        if any(w >= slots for w in workers) or state["next"] > slots:
            raise StateMismatchError(
                "the saved WebLoader state names a worker this loader does not have: the state "
                "was changed; load the state that state_dict() returned",
                field="workers",
            )
        check_seal(state, "WebLoader")  # after the fields, so that a changed one is named
        dataset = self._dataset
        assert dataset is not None  # a loader without a dataset has a resume blocker
        if callable(getattr(dataset, "check_stages_of", None)):  # another pipeline's state: refused here, not in
            for worker_state in workers.values():  # a worker at the first item
                dataset.check_stages_of(worker_state)
        self._untag.resume(state["next"], set(state["exhausted"]), workers)
        dataset.set_worker_states(dict(workers))
        self._pass_epoch = state.get("epoch", 0)
        self._auto_epoch = self._pass_epoch + 1
        self._resume_progress = list(state.get("progress") or (0, 0))

    def _pass_over(self, state: dict) -> dict:
        """A state taken after every worker handed over its last item, by a version that saved it as it stood
        (no worker next, every one exhausted; its loading was refused): the state of the pass ended, which starts
        the next epoch (as :meth:`state_dict` now gives it).  Any other state as it is."""
        exhausted, workers = state.get("exhausted"), state.get("num_workers")
        if state.get("next") is not None or type(workers) is not int or not isinstance(exhausted, list):
            return state
        if set(exhausted) != set(range(max(1, workers))):
            return state
        check_seal(state, "WebLoader")  # only a state as state_dict() gave it
        epoch = state.get("epoch", 0)
        epoch = epoch + 1 if type(epoch) is int and epoch >= 0 else 0
        return seal(dict(state, next=0, exhausted=[], workers=[], epoch=epoch, progress=[0, 0]))

    def _load_merged(self, state: dict) -> None:
        """Continue the epoch of a merged state with this rank's share, each worker taking its own."""
        if self._untag is None:
            raise NotResumableError(f"this WebLoader cannot load a state: {self._blocker}")
        dataset = self._dataset
        assert dataset is not None  # a loader without a dataset has a resume blocker
        check_merged(state)
        dataset.check_level(state["pipeline"])
        # each worker's share, computed here: it stays that worker's state until the worker delivers, so a state
        # taken before then (on this shape, or merged again) still holds it
        rank, world_size = _rank()
        workers = max(1, self._untag.num_workers)
        starts = {w: dataset.elastic_start(state, rank, world_size, w, workers) for w in range(workers)}
        self._untag.resume(0, set(), starts)
        dataset.set_worker_states(dict(starts))
        self._pass_epoch = state["epoch"]
        self._auto_epoch = self._pass_epoch + 1
        loader = state.get("loader")
        passes = loader["pass"] if loader else 0
        if loader and self.repetitions != 1 and self.nsamples > 0:  # with_epoch on the loader: the items left
            rank, world_size = _rank()
            left = items_share(loader["items"], loader["ranks"], self.nsamples, rank, world_size)
            self._resume_progress = [passes, max(0, self.nsamples - left)]
        else:
            self._resume_progress = [passes, 0]


def _imported_for_workers() -> None:
    """What torch's worker loop imports as each worker starts, imported once in this process before it forks
    them: the loop seeds numpy's global generator, and ``numpy.random`` took 10 ms to import in every worker of
    every epoch (a sixth of a short epoch with two workers, on two cores)."""
    if "numpy" in sys.modules and "numpy.random" not in sys.modules:
        try:
            import numpy.random  # noqa: F401
        except (Exception, SystemExit):  # a broken numpy: the workers meet it as they do without this
            pass


def _rank() -> tuple[int, int]:
    rank, world_size, _, _ = utils.pytorch_worker_info()
    return rank, world_size


#: the format of what a rank that could not take its state sends in its place, so that no rank waits for it
UNAVAILABLE = "wds_cloud.unavailable"


def merge_gathered(states: list) -> dict:
    """The merged state of every rank's state (as :func:`gather_merged` collects them); NotResumableError naming
    the rank that could not take its own."""
    failed = [(rank, s.get("reason")) for rank, s in enumerate(states) if s.get("format") == UNAVAILABLE]
    if failed:
        raise NotResumableError(
            f"state_dict(gather=True): rank {failed[0][0]} could not take its state "
            f"({failed[0][1]})" + (f"; and {len(failed) - 1} more rank(s)" if len(failed) > 1 else "")
        )
    return merge_states(states)


def gather_merged(state: dict, dist: Any = None) -> dict:
    """The merged state of ``state`` of every rank (every rank must call this at the same step), the same on every
    rank: the states are gathered to rank 0 (``gather_object``), merged there once, and the merged state (or why
    it could not be made, raised then on every rank) is sent to every rank (``broadcast_object_list``): the merge,
    the whole job's work, is done once, not on every rank.  ``dist``: ``torch.distributed`` (its default group), or what stands for it (a test's ranks)."""
    if dist is None:
        rank, world_size = _rank()
        if world_size == 1:
            return merge_gathered([state])
        dist = _distributed(rank, world_size)
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered: Optional[list] = [None] * world_size if rank == 0 else None
    dist.gather_object(state, gathered, dst=0)
    answer: list = [None]
    failure: Optional[BaseException] = None
    if rank == 0:
        assert gathered is not None
        try:
            answer[0] = {"merged": merge_gathered(gathered)}
        except Exception as exc:  # told to every rank, so that none waits in the broadcast for ever
            failure = exc
            answer[0] = {"error": type(exc).__name__, "message": str(exc), "field": getattr(exc, "field", None)}
    dist.broadcast_object_list(answer, src=0)
    if failure is not None:
        raise failure
    told = answer[0]
    if not isinstance(told, dict) or "merged" not in told:
        told = told if isinstance(told, dict) else {}
        kind = told.get("error")
        message = f"state_dict(gather=True): rank 0 could not merge the states: {told.get('message')}"
        if kind == "NotResumableError":
            raise NotResumableError(str(told.get("message")))
        if kind == "StateMismatchError":
            raise StateMismatchError(message, field=told.get("field"))
        raise RuntimeError(f"{message} ({kind})")
    return told["merged"]


def _distributed(rank: int, world_size: int) -> Any:
    """``torch.distributed`` with its process group, or ConfigError with the fix."""
    dist = utils.torch_distributed_module()
    if dist is None:
        raise ConfigError(
            f"state_dict(gather=True) on rank {rank} of {world_size}: gathering the ranks' states needs "
            "an initialized torch.distributed process group (torch.distributed.init_process_group); "
            "without one, save each rank's state_dict() and merge them with wds.merge_states(states)"
        )
    return dist


def gather_states(state: dict) -> list:
    """``state`` of every rank, gathered over ``torch.distributed`` (every rank must call this at the same step);
    ``[state]`` alone on one process."""
    rank, world_size = _rank()
    if world_size == 1:
        return [state]
    dist = _distributed(rank, world_size)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, state)
    return gathered


def _resume_blocker(dataset: Any, sampler: Any, batch_sampler: Any) -> Optional[str]:
    """Why a WebLoader over ``dataset`` cannot save states (None: it can), known before iterating."""
    if not isinstance(dataset, Resumable):
        return (
            f"its dataset ({type(dataset).__name__}) has no state_dict/load_state_dict; give it a "
            "WebDataset or DataPipeline"
        )
    if sampler is not None or batch_sampler is not None:
        return "it was given a sampler; a resumable WebLoader takes its items in the dataset's own order"
    if not isinstance(dataset, DataPipeline):
        return (
            f"its dataset ({type(dataset).__name__}) cannot take a state per DataLoader worker; give it a "
            "WebDataset or DataPipeline"
        )
    return dataset.resume_blocker()


# mixed datasets: a spec of several sources (``WebDataset("train.yaml")``)


def _warn_if_every_worker_reads_every_shard(dataset: Any, num_workers: Optional[int]) -> None:
    """A DataPipeline over a fixed shard list with no ``split_by_worker`` gives every DataLoader worker every
    shard, so each sample comes once per worker (as under webdataset): said once, when the loader is built."""
    if not num_workers or num_workers < 2 or not callable(getattr(dataset, "shard_split", None)):
        return
    if dataset.shard_split() in ("none", "nodes"):
        warnings.warn(
            f"every one of the {num_workers} DataLoader workers reads every shard of this pipeline, so each sample "
            "comes once per worker: put wds.split_by_worker after the shard list (DataPipeline(SimpleShardList("
            "urls), wds.split_by_worker, wds.tarfile_to_samples(), ...)); WebDataset does so itself",
            UserWarning,
            stacklevel=3,
        )


def _columns(batch: list) -> Any:
    """A batch without torch: the columns ``batched()`` makes of tuples, lists and dicts (numbers as numpy arrays,
    arrays stacked, the rest lists), any other items as the list they came in."""
    if batch and isinstance(batch[0], (tuple, list, dict)):
        return default_collation_fn(batch)
    return batch


def _forgetting_exited(batches: Iterator) -> Iterator:
    """``batches``, then the shared memory of workers that have exited dropped (see ``unframe.forget_exited``)."""
    try:
        yield from batches
    finally:
        unframe.forget_exited()
