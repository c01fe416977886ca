"""Pipeline stage machinery: curried filters that stay picklable.

A stage is a callable taking an iterator and returning one.  ``pipelinefilter(f)``
turns ``f(data, *args, **kw)`` into ``f_stage(*args, **kw)`` returning such a
callable.  The returned objects are instances of :class:`RestCurried` (module
level classes, not closures) so that pipelines can be pickled for
spawn-started DataLoader workers.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, Optional

__all__ = [
    "PipelineStage",
    "PassHolder",
    "for_pipeline",
    "FilterFunction",
    "RestCurried",
    "pipelinefilter",
    "compose",
    "pipeline",
]


class PassHolder:
    """What a stateful stage declares so that it stays a recipe: which of its fields belong to a pass.

    A stage object can be put in any number of pipelines, pickled, copied and sent to a worker at any time.
    So a :class:`~wds_cloud.pipeline.DataPipeline` never runs the object it is given: it runs a copy of its own
    (:func:`for_pipeline`), and what a pass holds and what waits for the next one live in that copy, never in
    the object the user holds (two pipelines sharing a reader each read their own shards, and each one's
    ``state_dict()`` describes its own pass).

    ``PASS_FIELDS``: what a live pass holds (a cursor, a buffer, open files and mappings, the source a shuffle
    reads places from), as ``{name: value with no pass}`` (a callable is called for a fresh one).  Every copy
    and every pickle starts with no pass: a pass's state travels only through ``state_dict()``.
    ``COPIED_FIELDS``: what each copy must have a copy of its own of (shallow): what waits for the next pass (a
    loaded state, a replay), counters of its passes; a copy's loading never changes the original's.
    """

    PASS_FIELDS: ClassVar[dict] = {}
    COPIED_FIELDS: ClassVar[tuple] = ()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_pipeline_copies", None)  # (weak references: they stay in this process, with this object)
        for name, empty in self.PASS_FIELDS.items():
            if name in state:
                state[name] = empty() if callable(empty) else empty
        for name in self.COPIED_FIELDS:
            value = state.get(name)
            if value is not None:
                state[name] = copy.copy(value)
        return state

    def for_pipeline(self) -> Any:
        """This stage as one pipeline holds it: a copy with no pass (what waits for the next pass is copied)."""
        made = copy.copy(self)
        copies = self.__dict__.get("_pipeline_copies")
        if copies is None:
            copies = self.__dict__["_pipeline_copies"] = weakref.WeakSet()
        copies.add(made)
        return made

    def pipeline_copies(self) -> list:
        """The copies of this stage that pipelines of this process hold (a ``set_epoch`` on the stage the user
        holds reaches them: it is the user's word for every pipeline the stage is in)."""
        return list(self.__dict__.get("_pipeline_copies") or ())

    def __copy__(self) -> Any:
        """``copy.copy(stage)``: the same recipe, with no pass and its own copy of what waits for the next one."""
        made = type(self).__new__(type(self))
        made.__dict__.update(self.__getstate__())
        return made


def for_pipeline(stage: Any) -> Any:
    """``stage`` as a pipeline holds it: its own copy where the stage keeps pass state (:class:`PassHolder`, or
    any object with ``for_pipeline()``), else the stage itself (a function, a filter, a user's object)."""
    make = getattr(stage, "for_pipeline", None)
    return make() if callable(make) else stage


class PipelineStage:
    """Base class of stateful stages: ``run(src)`` yields the output of the stage."""

    def invoke(self, *args: Any, **kw: Any) -> Iterator:
        raise NotImplementedError

    def run(self, *args: Any) -> Iterator:
        """The stage's output; a source stage (a shard list) takes no argument, any other the iterator before it."""
        return self.invoke(*args)

    def __call__(self, src: Iterable) -> Iterator:
        return self.run(src)


class FilterFunction:
    """``f`` with its extra arguments bound; calling it on a stream runs ``f(stream, *args, **kw)``."""

    #: what resume placement is told of the stage (``False``: it drops samples at random); ``None``: not said
    passes_every_sample: Optional[bool] = None

    def __init__(self, f: Callable, *args: Any, **kw: Any) -> None:
        self.f = f
        self.args = args
        self.kw = kw

    def __call__(self, data: Iterable) -> Iterator:
        return self.f(data, *self.args, **self.kw)

    def __str__(self) -> str:
        return f"<{getattr(self.f, '__name__', self.f)} {self.args} {self.kw}>"

    __repr__ = __str__


class RestCurried:
    """The curried form of a filter: ``RestCurried(f)(*args, **kw)`` -> a :class:`FilterFunction`."""

    def __init__(self, f: Callable) -> None:
        self.f = f
        functools.update_wrapper(self, f)

    def __call__(self, *args: Any, **kw: Any) -> FilterFunction:
        return FilterFunction(self.f, *args, **kw)

    def __reduce__(self):  # pickle by reference to the underlying module-level function
        return (RestCurried, (self.f,))


def pipelinefilter(f: Callable) -> RestCurried:
    """Decorator: make ``f(data, *args, **kw)`` usable as ``stage = f_curried(*args, **kw)``."""
    return RestCurried(f)


def compose(*stages: Callable) -> Callable[[Iterable], Iterable]:
    """One stage that applies ``stages`` left to right."""
    return _Composed(stages)


class _Composed:
    def __init__(self, stages) -> None:
        self.stages = stages

    def __call__(self, data: Iterable) -> Iterable:
        for stage in self.stages:
            data = stage(data)
        return data


def pipeline(source: Any, *stages: Callable) -> Iterator:
    """Apply ``stages`` to ``source`` (an iterable, or a callable returning one)."""
    data = source() if callable(source) and not hasattr(source, "__iter__") else source
    for stage in stages:
        data = stage(data)
    return data
