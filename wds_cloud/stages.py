"""Pipeline stage machinery: curried filters that stay picklable.

A stage is a callable taking an iterator and returning one.  ``pipelinefilter(f)``
turns ``f(data, *args, **kw)`` into ``f_stage(*args, **kw)`` returning such a
callable.  The returned objects are instances of :class:`RestCurried` (module
level classes, not closures) so that pipelines can be pickled for
spawn-started DataLoader workers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["PipelineStage", "FilterFunction", "RestCurried", "pipelinefilter", "compose", "pipeline"]


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
