"""How a ``WebLoader`` knows where each DataLoader worker stands.

Worker processes cannot be asked for their state; instead each item carries
it.  The loader's collate function (:class:`StateCollate`) runs in the worker
right after the dataset yielded the item (or the last item of a batch), so the
dataset's state taken there is exactly the state to resume after that item; it
travels with the item as a :class:`Tagged`.  Only the changes to a shuffle
buffer travel (a journal): the main process only notes them (:func:`note`),
and :func:`resolve` replays them when a state is asked for.  :class:`Ended` makes each worker send an :class:`EndMark` when it has
finished.  In the main process :class:`Untag` strips the tags, keeps each
worker's latest state, and after a resume gives items out in the worker order
the interrupted run was due to follow.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

from .pytorch import IterableDataset
from .stages import PipelineStage

__all__ = ["EndMark", "Unavailable", "Sealed", "Tagged", "Ended", "StateCollate", "Untag", "note", "resolve", "jsonable"]


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
    again whenever its journal has grown longer than the buffer, which bounds what waits here).
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
    from .filters import apply_journal, buffer_locations

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


class Sealed:
    """A worker state pickled in the worker, opened in the main process only when a state is asked for.

    Most states are never looked at (one travels with every batch); sealing them costs the worker
    one plain pickle and the main process nothing until ``state_dict()``.  ``whole`` says that it
    holds every shuffle buffer whole, so the states sealed before it are no longer needed.
    """

    __slots__ = ("blob", "whole")

    def __init__(self, blob: bytes, whole: bool) -> None:
        self.blob, self.whole = blob, whole

    def __reduce__(self):
        return (Sealed, (self.blob, self.whole))

    @classmethod
    def of(cls, state: Any) -> "Sealed":
        import pickle

        whole = not (isinstance(state, dict) and any(
            isinstance(stage, dict) and "journal" in stage for _, _, stage in state.get("stages", ())))
        return cls(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL), whole)

    def open(self) -> Any:
        import pickle

        return pickle.loads(self.blob)


class Tagged:
    """A loader item with the worker that made it and that worker's dataset state just after it."""

    __slots__ = ("item", "worker", "state", "end")

    def __init__(self, item: Any, worker: int, state: Any, end: bool) -> None:
        self.item, self.worker, self.state, self.end = item, worker, state, end

    def __reduce__(self):
        return (Tagged, (self.item, self.worker, self.state, self.end))


class Ended(IterableDataset):
    """The dataset followed by one :class:`EndMark`, so the loader learns when a worker has finished."""

    def __init__(self, dataset: Any) -> None:
        super().__init__()
        self.dataset = dataset

    def __iter__(self) -> Iterator:
        yield from self.dataset
        yield EndMark()

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class StateCollate:
    """The loader's collate function, run in the worker: tags each item with the worker's state after it.

    It runs right after the worker's dataset yielded the last item of the batch (or the
    item, with ``batch_size=None``), so ``state_dict()`` there is exactly the state to
    resume after it.
    """

    def __init__(self, collate: Optional[Callable], per_item: bool, ended: Ended) -> None:
        self.collate = collate
        self.per_item = per_item
        self.ended = ended

    def _default(self, data: Any) -> Any:
        try:
            from torch.utils.data import default_collate, default_convert
        except ImportError:
            return data
        return default_convert(data) if self.per_item else default_collate(data)

    def __call__(self, data: Any) -> Tagged:
        worker, ended = 0, self.ended
        try:
            from torch.utils.data import get_worker_info
        except ImportError:
            info = None
        else:
            info = get_worker_info()
        if info is not None:
            worker = info.id
            if isinstance(info.dataset, Ended):
                ended = info.dataset  # the copy this worker iterates (spawned workers unpickle it separately)
        dataset = ended.dataset
        try:
            fast = getattr(dataset, "_fast_state", None)
            state = fast() if fast is not None else dataset.state_dict()
        except Exception as exn:  # never from iteration: state_dict() raises it, if it is ever asked for
            state = Unavailable(f"{type(exn).__name__}: {exn}")
        if info is not None:
            state = Sealed.of(state)
        if self.per_item:
            if isinstance(data, EndMark):
                return Tagged(None, worker, state, True)
            return Tagged(self.collate(data) if self.collate else self._default(data), worker, state, False)
        items = [x for x in data if not isinstance(x, EndMark)]
        end = len(items) != len(data)
        if not items:
            return Tagged(None, worker, state, True)
        return Tagged(self.collate(items) if self.collate else self._default(items), worker, state, end)


class Untag(PipelineStage):
    """Main-process stage after the loader: strip the tags, keep each worker's latest state.

    After a resume the loader starts its round-robin at worker 0, but the saved run was
    due to continue at worker ``next``: items are held (at most one per worker) and given
    out in the saved order, so the sequence is the one the uninterrupted run would have made.
    """

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.next: Optional[int] = 0
        self.exhausted: set = set()
        self.states: dict = {}
        self._pending: Optional[tuple] = None
        self.dataset: Any = None
        self._mirrors: dict = {}  # (worker, stage path) -> [pass id, shuffle buffer, journals to apply]
        self._sealed: dict = {}  # worker -> the Sealed states since its last whole one, oldest first

    def resume(self, next_worker: Optional[int], exhausted: set, states: dict) -> None:
        self._pending = (next_worker, exhausted, states)

    def current(self) -> tuple:
        """(next worker, exhausted workers, states): a loaded state until a pass has begun with it."""
        if self._pending is not None:
            return self._pending
        for worker, chain in self._sealed.items():  # open what the workers sent, in order
            for sealed in chain:
                state = sealed.open()
                note(state, self._mirrors, (worker,))
                self.states[worker] = state
            chain.clear()
        states = {w: resolve(s, self._mirrors, (w,)) for w, s in self.states.items()}
        return self.next, self.exhausted, states

    def _keep(self, worker: int, state: Any) -> None:
        """Keep the latest state of ``worker`` (sealed ones wait, unopened, until a state is asked for)."""
        if isinstance(state, Sealed):
            chain = self._sealed.setdefault(worker, [])
            if state.whole:
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

    def _after(self, worker: int, n: int) -> Optional[int]:
        for step in range(1, n + 1):
            candidate = (worker + step) % n
            if candidate not in self.exhausted:
                return candidate
        return None

    def _reorder(self, src: Iterable, n: int) -> Iterator:
        from collections import deque

        queues = [deque() for _ in range(n)]
        for tagged in src:
            if self.dataset is not None:
                self.dataset._worker_states = None  # the workers have their states now
            if not isinstance(tagged, Tagged):
                yield tagged
                continue
            queues[tagged.worker].append(tagged)
            while self.next is not None and queues[self.next]:
                worker = self.next
                t = queues[worker].popleft()
                self._keep(worker, t.state)
                if t.end:
                    self.exhausted.add(worker)
                self.next = self._after(worker, n)
                if not (t.end and t.item is None):
                    yield t.item
        for queue in queues:  # the loader ended: anything still held goes out in worker order
            while queue:
                t = queue.popleft()
                self._keep(t.worker, t.state)
                if not (t.end and t.item is None):
                    yield t.item
