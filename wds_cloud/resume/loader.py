"""How a ``WebLoader`` knows where each DataLoader worker stands.

Worker processes cannot be asked for their state; instead each item carries
it.  The loader's collate function (:class:`StateCollate`) runs in the worker
right after the dataset yielded the item (or the last item of a batch), so the
dataset's state taken there is exactly the state to resume after that item; it
travels with the item, tagged (:data:`TAG`).  Only the changes to a shuffle
buffer travel (a journal): the main process only notes them (:func:`note`),
and :func:`resolve` replays them when a state is asked for.  :class:`Ended`
makes each worker send an :class:`EndMark` when it has
finished.  In the main process :class:`Untag` strips the tags, keeps each
worker's latest state, and after a resume gives items out in the worker order
the interrupted run was due to follow.

The same tag carries the worker's transfer statistics (what its dataset's ``stats`` gained since it last
sent them): with its first item, then at most once every :data:`STATS_EVERY` seconds, and with its last;
:class:`Untag` adds them up (``WebLoader.stats``).
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

from ..io.resilient import TransferStats
from ..pytorch import IterableDataset
from ..stages import PipelineStage
from .protocol import transport_state
from .shuffle import apply_journal, buffer_locations
from .views import default_collate, view_keeping, views_pickle_as_bytes

__all__ = [
    "EndMark",
    "Unavailable",
    "TAG",
    "seal",
    "tagged",
    "Ended",
    "StateCollate",
    "StatsSender",
    "StatsCollate",
    "Unstats",
    "Stats",
    "default_collate",
    "Untag",
    "note",
    "resolve",
    "jsonable",
    "transfer_stats",
    "since",
    "STATS_EVERY",
]

#: seconds between two sendings of a worker's transfer statistics (they also go with its first and last item)
STATS_EVERY = 1.0


def transfer_stats(dataset: Any) -> Optional[TransferStats]:
    """The transfer statistics of ``dataset`` in this process (a mix's: its sources' summed), or None."""
    try:
        stats = dataset.stats
    except Exception:  # no statistics (a plain DataPipeline), or a user's property that failed: none to send
        return None
    if isinstance(stats, TransferStats):
        return stats
    if isinstance(stats, dict) and isinstance(stats.get("sources"), dict):  # a MixedDataset's
        total = TransferStats()
        for source in stats["sources"].values():
            if isinstance(source, dict) and isinstance(source.get("transfer"), TransferStats):
                total.add(source["transfer"])
        return total
    return None


def since(current: TransferStats, before: Optional[TransferStats]) -> TransferStats:
    """What ``current`` gained since ``before`` (counts and times subtracted; the most parts in flight and the
    per-host choices are the latest)."""
    if before is None:
        return current
    gained = {}
    for field in dataclasses.fields(current):
        now = getattr(current, field.name)
        if field.name not in ("concurrency", "hosts"):
            now = now - getattr(before, field.name)
        gained[field.name] = now
    return TransferStats(**gained)


def jsonable(value: Any) -> Any:
    """A copy of a resolved worker state that later batches cannot change (tuples are JSON arrays as they are)."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


def note(state: Any, mirrors: dict, key: tuple) -> None:
    """Record the shuffle-buffer changes a worker state carries (cheap: per batch, nothing is replayed).

    ``mirrors[key + (stage path)]`` is ``[pass id, buffer, journals not yet applied]``; a state
    carrying a whole buffer starts it afresh (the worker sends one at the start of a pass and
    again once the journals since the last one outgrow about eight buffers, which bounds what waits here).
    """
    if not isinstance(state, dict) or "stages" not in state:
        return
    for i, _, stage in state["stages"]:
        if not isinstance(stage, dict):
            continue
        where = key + (i,)
        if "run" in stage:
            if "buffer" in stage:
                mirrors[where] = [stage["run"], stage["buffer"], []]
            else:
                mirror = mirrors.get(where)
                if mirror is None or mirror[0] != stage["run"]:  # cannot happen: a pass sends its buffer first
                    raise RuntimeError("a worker sent a shuffle journal without the buffer it applies to")
                mirror[2].append(stage["journal"])
        elif "stages" in stage:
            note(stage, mirrors, where)


def resolve(state: Any, mirrors: dict, key: tuple) -> Any:
    """A worker's full state from the last delta it sent: the noted journals replayed onto the buffers."""
    if not isinstance(state, dict) or "stages" not in state:
        return state
    stages = []
    for i, kind, stage in state["stages"]:
        where = key + (i,)
        if isinstance(stage, dict) and "run" in stage:
            mirror = mirrors[where]
            if not isinstance(mirror[1], list):
                mirror[1] = buffer_locations(mirror[1])
            for journal in mirror[2]:
                apply_journal(mirror[1], journal)
            mirror[2].clear()
            stage = {k: v for k, v in stage.items() if k not in ("run", "journal")}
            stage["buffer"] = list(mirror[1])
        elif isinstance(stage, dict) and "stages" in stage:
            stage = resolve(stage, mirrors, where)
        stages.append([i, kind, stage])
    return dict(state, stages=stages)


class EndMark:
    """The item a worker yields after its last one (a picklable marker)."""

    __slots__ = ()


class Unavailable:
    """Stands for a worker state that could not be taken; ``WebLoader.state_dict()`` raises with ``reason``.

    Taking a state never interrupts iteration: the error waits until a state is asked for.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __reduce__(self):
        return (Unavailable, (self.reason,))


#: first element of a tagged loader item: ``[TAG, item, worker, state, whole, end, stats]`` (``stats``: the
#: worker's transfer statistics gained since it last sent them, or None; what a worker hands over as it ends
#: follows its last item).  A plain list of
#: builtins pickles with no class to look up (a per-batch cost), and torch's pin_memory keeps its shape
#: while pinning the item inside.  ``state`` is pickled bytes when it crossed from a worker process
#: (``whole`` then says whether it holds every shuffle buffer whole), else the state itself (``whole`` None).
TAG = "\0wds_cloud.loaderstate.tag"


def seal(state: Any) -> tuple[bytes, bool]:
    """A worker state pickled in the worker, to be opened in the main process only when a state is asked for.

    Most states are never looked at (one travels with every batch); sealing them costs the worker
    one plain pickle and the main process nothing until ``state_dict()``.  ``whole``: the state holds
    every shuffle buffer whole, so the states sealed before it are no longer needed.
    """
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL), not _has_journal(state)


def _has_journal(state: Any) -> bool:
    """Whether a shuffle stage of ``state`` (nested pipelines included) sent changes rather than its buffer."""
    if not isinstance(state, dict):
        return False
    return any(
        isinstance(stage, dict) and ("journal" in stage or _has_journal(stage))
        for _, _, stage in state.get("stages", ())
    )


def tagged(x: Any) -> bool:
    return type(x) is list and 7 <= len(x) <= 8 and x[0] == TAG


class Ended(IterableDataset):
    """The dataset followed by one :class:`EndMark`, so the loader learns when a worker has finished.

    ``whole``: the loader batches ``whole`` items at a time and drops a last short batch (torch's ``drop_last``):
    the mark is then never one item of a batch, which torch would count (a batch of ``whole - 1`` items and the
    mark was delivered, short, as if full; a mark alone in a short batch was dropped, and the loader never learned
    that the worker had ended).  Items go on in whole batches, the short rest is dropped here, and the end travels
    as a batch of ``whole`` marks.
    """

    def __init__(self, dataset: Any, whole: Optional[int] = None) -> None:
        super().__init__()
        self.dataset = dataset
        self.whole = whole

    def __iter__(self) -> Iterator:
        whole = self.whole
        if not whole:
            yield from self.dataset
            yield EndMark()
            return
        group: list = []
        for item in self.dataset:
            group.append(item)
            if len(group) == whole:
                batch, group = group, []
                yield from batch
        del group  # the short rest: dropped, as torch drops it
        mark = EndMark()
        for _ in range(whole):
            yield mark

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class StatsSender:
    """What a collate function run in DataLoader workers needs to send its worker's transfer statistics."""

    def __init__(self) -> None:
        #: the worker's dataset statistics when it last sent them; the loader sets the main process's before it
        #: starts workers, which inherit them with their copy of the dataset
        self.stats_sent: Optional[TransferStats] = None
        self._stats_due = 0.0  # when a worker sends its statistics next (monotonic seconds)

    def _stats(self, dataset: Any, end: bool) -> Optional[TransferStats]:
        """The statistics a worker sends with this item: with its first and last, and every STATS_EVERY seconds."""
        now = time.monotonic()
        if now < self._stats_due and not end:
            return None
        self._stats_due = now + STATS_EVERY
        current = transfer_stats(dataset)
        if current is None:
            return None
        gained, self.stats_sent = since(current, self.stats_sent), current
        return gained


class Stats:
    """An item of a loader that takes no states with the worker's statistics (``end``: the worker's last; ``item``
    None: nothing to yield).  A class of its own, not a list of a known shape: an item of the user's data can
    never be taken for it (a list that began with the tag was, and was dropped)."""

    __slots__ = ("item", "stats", "end")

    def __init__(self, item: Any, stats: Optional[TransferStats], end: bool) -> None:
        self.item, self.stats, self.end = item, stats, end

    def __reduce__(self) -> Any:
        return (Stats, (self.item, self.stats, self.end))

    def pin_memory(self, device: Any = None) -> Stats:
        """torch's pin_memory thread pins the item inside (it calls this on an object that has it)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return Stats(pin_memory(self.item, device), self.stats, self.end)


class StatsCollate(StatsSender):
    """The collate function of a loader that takes no states, run in the worker: its ``collate``, and now and then
    (see :class:`StatsSender`) the worker's statistics with the item; other items travel as they are."""

    def __init__(self, collate: Callable[[Any], Any], per_item: bool, ended: Ended) -> None:
        super().__init__()
        self.collate = view_keeping(collate)
        self.per_item = per_item
        self.ended = ended

    def __call__(self, data: Any) -> Any:
        info = _worker_info()
        ended = info.dataset if info is not None and isinstance(info.dataset, Ended) else self.ended
        if self.per_item:
            if isinstance(data, EndMark):
                return Stats(None, self._stats(ended.dataset, True), True)
            end, stats, out = False, self._stats(ended.dataset, False), self.collate(data)
        else:
            items = [x for x in data if not isinstance(x, EndMark)]
            end = len(items) != len(data)
            stats = self._stats(ended.dataset, end)
            if not items:
                return Stats(None, stats, True)
            out = self.collate(items)
        return out if stats is None and not end else Stats(out, stats, end)


class Unstats(PipelineStage):
    """Main-process stage after a loader that takes no states: adds up the statistics its workers sent, and
    gives their items out as they came."""

    def __init__(self) -> None:
        #: the transfer statistics the workers sent, summed over every pass of this loader
        self.transfer = TransferStats()

    def run(self, src: Iterable) -> Iterator:
        for x in src:
            if type(x) is Stats:
                if x.stats is not None:
                    self.transfer.add(x.stats)
                if x.end and x.item is None:
                    continue
                yield x.item
            else:
                yield x


class StateCollate(StatsSender):
    """The loader's collate function, run in the worker: tags each item with the worker's state after it.

    It runs right after the worker's dataset yielded the last item of the batch (or the
    item, with ``batch_size=None``), so ``state_dict()`` there is exactly the state to
    resume after it.
    """

    def __init__(
        self,
        collate: Optional[Callable],
        per_item: bool,
        ended: Ended,
        pack: Optional[Callable[[Any], Any]] = None,
        farewell: Optional[Callable[[], Any]] = None,
    ) -> None:
        super().__init__()
        # torch's own collate functions, given as collate_fn, keep views (zero_copy=True) as ours do
        self.collate = view_keeping(collate)
        self.per_item = per_item
        self.ended = ended
        self.pack = pack  # run on each batch in a worker (wds_cloud.transport.pack_batch), or None
        #: called in a worker as it ends its pass: what it hands the main process (``Untag(welcome=)`` takes it)
        self.farewell = farewell

    def _last(self, tagged: list, info: Any) -> list:
        """A worker's last item, with what it hands the main process (see ``farewell``)."""
        if info is not None and self.farewell is not None:
            try:
                tagged.append(self.farewell())
            except Exception:  # never from iteration: what a worker learned is only a saving
                pass
        return tagged

    def _default(self, data: Any) -> Any:
        return default_collate(self.per_item)(data)

    def __call__(self, data: Any) -> list:
        worker, ended = 0, self.ended
        info = _worker_info()
        if info is not None:
            worker = info.id
            if isinstance(info.dataset, Ended):
                ended = info.dataset  # the copy this worker iterates (spawned workers unpickle it separately)
        dataset = ended.dataset
        try:
            state = transport_state(dataset)
        except Exception as exn:  # never from iteration: state_dict() raises it, if it is ever asked for
            state = Unavailable(f"{type(exn).__name__}: {exn}")
        whole = None
        if info is not None:
            state, whole = seal(state)
        pack = self.pack if info is not None else None
        if self.per_item:
            if isinstance(data, EndMark):
                stats = self._stats(dataset, True) if info is not None else None
                return self._last([TAG, None, worker, state, whole, True, stats], info)
            stats = self._stats(dataset, False) if info is not None else None
            out = self.collate(data) if self.collate else self._default(data)
            return [TAG, pack(out) if pack is not None else out, worker, state, whole, False, stats]
        items = [x for x in data if not isinstance(x, EndMark)]
        end = len(items) != len(data)
        stats = self._stats(dataset, end) if info is not None else None
        if not items:
            return self._last([TAG, None, worker, state, whole, True, stats], info)
        out = self.collate(items) if self.collate else self._default(items)
        tagged = [TAG, pack(out) if pack is not None else out, worker, state, whole, end, stats]
        return self._last(tagged, info) if end else tagged


def _worker_info() -> Any:
    global _get_worker_info
    if _get_worker_info is None:
        try:
            from torch.utils.data import get_worker_info
        except ImportError:
            get_worker_info = _no_workers
        _get_worker_info = get_worker_info
    info = _get_worker_info()
    if info is not None:  # the loader's collation runs here, in a worker: what it sends pickles views as bytes
        views_pickle_as_bytes()
    return info


def _no_workers() -> None:
    return None


_get_worker_info: Optional[Callable[[], Any]] = None


class Untag(PipelineStage):
    """Main-process stage after the loader: strip the tags, keep each worker's latest state.

    After a resume the loader starts its round-robin at worker 0, but the saved run was
    due to continue at worker ``next``: items are held (at most one per worker) and given
    out in the saved order, so the sequence is the one the uninterrupted run would have made.
    """

    def __init__(self, num_workers: int, welcome: Optional[Callable[[Any], None]] = None) -> None:
        self.num_workers = num_workers
        #: given what a worker handed over as it ended its pass (``StateCollate(farewell=)``)
        self.welcome = welcome
        self.next: Optional[int] = 0
        self.exhausted: set = set()
        self.states: dict = {}
        self._pending: Optional[tuple] = None
        self.dataset: Any = None
        self._mirrors: dict = {}  # (worker, stage path) -> [pass id, shuffle buffer, journals to apply]
        self._sealed: dict = {}  # worker -> the sealed states since its last whole one, oldest first
        #: the transfer statistics the workers sent, summed over every pass of this loader
        self.transfer = TransferStats()

    def finished(self) -> bool:
        """Whether every worker of the pass under way has handed over its last item (none is next)."""
        return self._pending is None and self.next is None and len(self.exhausted) >= max(1, self.num_workers)

    def resume(self, next_worker: Optional[int], exhausted: set, states: dict) -> None:
        self._pending = (next_worker, exhausted, states)

    def current(self) -> tuple:
        """(next worker, exhausted workers, states): a loaded state until a pass has begun with it."""
        if self._pending is not None:
            return self._pending
        for worker, chain in self._sealed.items():  # open what the workers sent, in order
            for blob in chain:
                state = pickle.loads(blob)
                note(state, self._mirrors, (worker,))
                self.states[worker] = state
            chain.clear()
        states = {w: resolve(s, self._mirrors, (w,)) for w, s in self.states.items()}
        return self.next, self.exhausted, states

    def _keep(self, worker: int, state: Any, whole: Optional[bool]) -> None:
        """Keep the latest state of ``worker`` (sealed ones wait, unopened, until a state is asked for)."""
        if whole is not None:
            chain = self._sealed.setdefault(worker, [])
            if whole:
                chain.clear()
            chain.append(state)
            return
        self._sealed.pop(worker, None)
        self.states[worker] = state
        note(state, self._mirrors, (worker,))

    def run(self, src: Iterable) -> Iterator:
        nxt, exhausted, states = self._pending or (0, set(), {})
        self._pending = None
        self.next, self.exhausted, self.states = nxt, set(exhausted), dict(states)
        self._mirrors, self._sealed = {}, {}
        return self._reorder(src, max(1, self.num_workers))

    def _welcome(self, parting: list) -> None:
        if parting and self.welcome is not None:
            try:
                self.welcome(parting[0])
            except Exception:  # what a worker learned is only a saving: never an error of the pass
                pass

    def _after(self, worker: int, n: int) -> Optional[int]:
        for step in range(1, n + 1):
            candidate = (worker + step) % n
            if candidate not in self.exhausted:
                return candidate
        return None

    def _reorder(self, src: Iterable, n: int) -> Iterator:
        queues: list[deque] = [deque() for _ in range(n)]
        for t in src:
            if self.dataset is not None:
                self.dataset.set_worker_states(None)  # the workers have their states now
            if not tagged(t):
                yield t
                continue
            queues[t[2]].append(t)
            while self.next is not None and queues[self.next]:
                worker = self.next
                _, item, _, state, whole, end, stats, *parting = queues[worker].popleft()
                if stats is not None:
                    self.transfer.add(stats)
                self._keep(worker, state, whole)
                self._welcome(parting)
                if end:
                    self.exhausted.add(worker)
                self.next = self._after(worker, n)
                if not (end and item is None):
                    yield item
        for queue in queues:  # the loader ended: anything still held goes out in worker order
            while queue:
                _, item, worker, state, whole, end, stats, *parting = queue.popleft()
                if stats is not None:
                    self.transfer.add(stats)
                self._keep(worker, state, whole)
                self._welcome(parting)
                if not (end and item is None):
                    yield item
