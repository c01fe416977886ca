"""Which pipelines of this process were handed to torch DataLoader worker processes.

``torch.utils.data.DataLoader(dataset, num_workers=2)`` iterates copies of ``dataset`` in its worker processes
(forked, or unpickled by spawn/forkserver): the object in the main process reads nothing, so its
``state_dict()`` would describe a pass that never ran, and resuming from it repeats what the workers delivered.
A pipeline's ``state_dict()`` asks :func:`handed` and refuses (naming the loaders that take exact states) when
its pipeline was handed over and no pass ran in this process since (:func:`ran_here`, when a pass starts).

The hand-off is seen where it happens, in the main process, through no channel user code sees: a fork
(``os.register_at_fork``) or a pickling of a pipeline's resume side (spawn and forkserver pickle the dataset as
they start a worker) made while a DataLoader iterator is starting its workers, found on the stack.  Nothing is
done per sample or per pass but one look-up in an empty set when a pass starts.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Optional

__all__ = ["handed", "ran_here", "note_pickled", "refusal", "mark", "starting_workers"]

#: the pipelines of this process handed to DataLoader worker processes, with no pass run here since
_HANDED: weakref.WeakSet = weakref.WeakSet()

#: how deep a dataset is searched for the pipelines it wraps (a loader's wrapper, a pipeline in a pipeline, a
#: user's dataset holding ours): bounded, as the search runs on a user's object graph
_DEPTH = 6

#: the torch modules whose iterators start DataLoader workers: torch's own, and torchdata's StatefulDataLoader
_LOADER_FILES = ("dataloader.py", "stateful_dataloader.py")


def handed(pipeline: Any) -> bool:
    """Whether ``pipeline`` was handed to DataLoader worker processes and ran no pass in this process since."""
    return bool(_HANDED) and pipeline in _HANDED


def ran_here(pipeline: Any) -> None:
    """A pass of ``pipeline`` starts in this process: a state taken now describes it."""
    if _HANDED:
        _HANDED.discard(pipeline)


def refusal(pipeline: Any) -> str:
    """Why the state of a handed-over pipeline is refused, and what to use instead."""
    return (
        f"this {type(pipeline).__name__} was handed to torch DataLoader worker processes, which iterate "
        "copies of it: the one in this process has read nothing since, so its state_dict() cannot say where "
        "the workers stand (resuming from it would repeat what they delivered). Take states from the loader: "
        "wrap the dataset in wds.WebLoader(dataset, batch_size=..., num_workers=...) and call "
        "loader.state_dict(), or use torchdata's StatefulDataLoader(dataset, ...) and its state_dict(); "
        "or iterate in this process (num_workers=0)"
    )


def mark(dataset: Any) -> None:
    """Note ``dataset``, and the pipelines it wraps, as handed to DataLoader worker processes."""
    seen: set = set()
    todo: list = [(dataset, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > _DEPTH:
            continue
        seen.add(id(obj))
        stages = getattr(obj, "pipeline", None) if callable(getattr(obj, "state_dict", None)) else None
        if isinstance(stages, list):
            try:
                _HANDED.add(obj)
            except TypeError:  # not weakly referable: a user's class with __slots__; nothing to refuse later
                pass
            todo.extend((stage, depth + 1) for stage in stages if _dataset_like(stage))
        held = getattr(obj, "__dict__", None)
        if isinstance(held, dict):  # a wrapper's dataset (a loader's, a user's): its attributes, not their contents
            todo.extend((value, depth + 1) for value in held.values() if _dataset_like(value))


def _dataset_like(value: Any) -> bool:
    """Whether ``value`` may be or hold a pipeline: an iterable object with attributes (not a class, a module, a
    container or a text)."""
    return hasattr(type(value), "__iter__") and hasattr(value, "__dict__") and not isinstance(value, type)


def starting_workers() -> bool:
    """Whether a DataLoader iterator on this thread's stack is starting its worker processes (a pickle made now
    goes to a worker)."""
    try:
        return _starting_loader() is not None
    except Exception:  # a stack this cannot read: not a worker start, as far as anything here is concerned
        return False


def _starting_loader() -> Optional[Any]:
    """The DataLoader iterator on this thread's stack that is starting its worker processes, if any."""
    frame: Any = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_LOADER_FILES) and "self" in code.co_varnames:
            owner = frame.f_locals.get("self")
            if getattr(owner, "_num_workers", 0) and hasattr(owner, "_dataset"):
                return owner
        frame = frame.f_back
    return None


def _before_fork() -> None:
    try:
        loader = _starting_loader()
        if loader is not None:
            mark(loader._dataset)  # torch's iterator names its dataset so; torchdata's, copied from it, too
    except Exception:  # a fork must never fail for this: without the mark, state_dict() behaves as before
        pass


def note_pickled() -> None:
    """A pipeline's resume side is being pickled: when a DataLoader iterator is starting spawn or forkserver
    workers, its dataset is handed to them."""
    _before_fork()


def _after_fork_in_child() -> None:
    # the child is the worker: its copies iterate here, so their states are exact
    _HANDED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
