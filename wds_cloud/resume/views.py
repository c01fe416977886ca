"""Views in batches: a ``memoryview`` (``WebDataset(zero_copy=True)``) at any depth of a batch, kept a view by
the loader's collation and made ``bytes`` where it must be pickled.

torch's ``default_convert`` and ``default_collate`` read a ``memoryview`` as a sequence of numbers (a list of
ints per field, a tensor of them once batched), and a view cannot be pickled.  Every walk over a batch on its
way from a dataset to a training step (the collate functions here, the packer in
:mod:`wds_cloud.loader.transport`) takes a view as one leaf, as it takes ``bytes``, inside dicts, lists and
tuples of any depth.  Each walk is bounded: finding views (:func:`holds_views`) takes each container once, a
level at a time, at any depth; rebuilding a batch around views nested more than :data:`MAX_DEPTH` containers
deep (or in a batch that holds itself) is refused with :class:`~wds_cloud.errors.MalformedDataError` naming
where, never a ``RecursionError`` or a walk without end.  A batch without views is torch's to take as deep as
it takes it.

Everything here that a DataLoader worker receives (:class:`KeepingViews`) is a module-level class with named
fields, so it pickles for ``spawn`` and ``forkserver`` workers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any, Optional, overload

from ..errors import MalformedDataError

__all__ = [
    "MAX_DEPTH",
    "KeepingViews",
    "keeping_views",
    "default_collate",
    "view_keeping",
    "holds_views",
    "as_bytes",
    "views_pickle_as_bytes",
]

#: how many containers (dicts, lists, tuples) deep the walks that rebuild a batch around its views go; views nested
#: deeper, or in a batch that holds itself, are refused (a sample's fields rarely nest more than a few levels)
MAX_DEPTH = 100

#: what torch's ``default_convert`` gives back as it is, and a view, which stays one leaf
_LEAVES = frozenset((bytes, str, int, float, bool, type(None), memoryview))
_CONTAINERS = (dict, list, tuple)
_SEQUENCES = frozenset((list, tuple))
_EXACT = frozenset((dict, list, tuple))
_DICT = frozenset((dict,))


class _TooDeep(Exception):
    """Raised at the depth limit; each level it passes adds its key, so the error names the whole path."""

    def __init__(self) -> None:
        super().__init__()
        self.path: list = []


def _refused(path: list) -> MalformedDataError:
    """The error for a batch nested past :data:`MAX_DEPTH`; ``path``: the keys from the batch down, as far as known."""
    shown = "".join(f"[{key!r}]" for key in path[:6]) + ("..." if len(path) > 6 else "")
    return MalformedDataError(
        f"a batch nests dicts, lists or tuples more than {MAX_DEPTH} deep (or holds itself), at batch{shown}: "
        "the loader rebuilds a batch around the memoryviews of WebDataset(zero_copy=True), and collates it, only "
        "that deep; make the sample flatter (or encode its deep part, e.g. as JSON bytes)",
        field="batch",
    )


def _nested(kinds: set) -> bool:
    """Whether items of these types may hold more items (a container, or a subclass of one)."""
    if not _EXACT.isdisjoint(kinds):
        return True
    return not _LEAVES.issuperset(kinds) and any(issubclass(kind, _CONTAINERS) for kind in kinds)


def _items(level: Iterable, kinds: set) -> list:
    """The items of every container in ``level`` (of ``kinds``; a dict's values), in one list."""
    if _SEQUENCES.issuperset(kinds):
        return list(chain.from_iterable(level))
    if kinds == _DICT:
        return list(chain.from_iterable(map(dict.values, level)))
    out: list = []
    for container in level:
        out.extend(container.values() if isinstance(container, dict) else container)
    return out


def holds_views(value: Any) -> bool:
    """Whether ``value`` is a view or holds one, at any depth of dicts, lists and tuples (and their subclasses).

    The walk goes a level at a time, each level's types found in one C-level pass, and takes each container
    once (one held twice, or holding itself, is not walked again): its work is linear in the batch's size at
    any depth, with no recursion."""
    if type(value) is memoryview:
        return True
    if not isinstance(value, _CONTAINERS):
        return False
    items = list(value.values()) if isinstance(value, dict) else value
    seen = {id(value)}
    while True:  # a level at a time, not a call per container: any depth is safe here
        kinds = set(map(type, items))
        if memoryview in kinds:
            return True
        if not _nested(kinds):  # the usual flat sample ends here, at once
            return False
        if kinds.issubset(_EXACT):
            level = items
        else:
            level = [x for x in items if isinstance(x, _CONTAINERS)]
            kinds = set(map(type, level))
        ids = set(map(id, level))
        if len(ids) < len(level) or not seen.isdisjoint(ids):  # a container held twice or holding itself: once
            fresh = {}
            for container in level:
                if id(container) not in seen:
                    seen.add(id(container))
                    fresh[id(container)] = container
            level = list(fresh.values())
            if not level:
                return False
        else:
            seen |= ids
        items = _items(level, kinds)


def _deep_path(value: Any) -> list:
    """The keys from ``value`` down to a container :data:`MAX_DEPTH` levels deep (for the error's message)."""
    path: list = []
    longest: list = []
    seen = {id(value)}
    stack = [iter(_pairs(value))] if isinstance(value, _CONTAINERS) else []
    while stack and len(path) < MAX_DEPTH:
        for key, item in stack[-1]:
            if isinstance(item, _CONTAINERS) and id(item) not in seen:  # each container once: a cycle ends here
                seen.add(id(item))
                path.append(key)
                stack.append(iter(_pairs(item)))
                if len(path) > len(longest):
                    longest = list(path)
                break
        else:
            stack.pop()
            if path:
                path.pop()
    return longest


def _pairs(value: Any) -> Iterable:
    """(key, item) pairs of a container (a dict, list or tuple, or a subclass of one)."""
    return value.items() if isinstance(value, dict) else enumerate(value)


def as_bytes(value: Any) -> Any:
    """``value`` with every view in it, at any depth, made ``bytes`` (a view cannot be pickled); containers keep
    their types, and one that holds no view is given back as it is (no copy)."""
    if not holds_views(value):
        return value
    try:
        return _as_bytes(value, 0, {})
    except _TooDeep as error:
        raise _refused(error.path[::-1]) from None


def _as_bytes(value: Any, depth: int, made: dict) -> Any:
    """``value`` with its views made bytes; ``made``: id -> the new container, so one held twice is made once."""
    if type(value) is memoryview:
        return value.tobytes()
    if not isinstance(value, _CONTAINERS):
        return value
    kinds = set(map(type, value.values() if isinstance(value, dict) else value))
    if memoryview not in kinds and not _nested(kinds):
        return value
    if id(value) in made:
        return made[id(value)]
    if depth >= MAX_DEPTH:  # views this deep, or a batch that holds itself
        raise _TooDeep()
    out, changed, key = {}, False, None
    try:
        for key, item in _pairs(value):
            new = out[key] = _as_bytes(item, depth + 1, made)
            changed = changed or new is not item
    except _TooDeep as error:
        error.path.append(key)
        raise
    new = _rebuilt(value, out) if changed else value
    made[id(value)] = new
    return new


def _rebuilt(value: Any, items: dict) -> Any:
    """A container of ``value``'s type with ``items`` (key or index -> item) in place of its own."""
    kind = type(value)
    if kind is dict:
        return items
    if kind is list:
        return list(items.values())
    if kind is tuple:
        return tuple(items.values())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return kind(*items.values())
    try:  # a subclass: a copy with the new items, as torch's walks make one (it may hold more than its items)
        if isinstance(value, dict):
            mapping = copy.copy(value)
            mapping.update(items)
            return mapping
        if isinstance(value, list):
            sequence = copy.copy(value)
            sequence[:] = list(items.values())
            return sequence
        return kind(items.values())
    except TypeError:
        return dict(items) if isinstance(value, dict) else list(items.values())


class KeepingViews:
    """``collate`` (torch's ``default_convert`` when ``per_item``, for a loader with ``batch_size=None``; its
    ``default_collate`` otherwise) with every view, at any depth, left a view, to be packed or made ``bytes``
    by the transport: torch reads a ``memoryview`` as a sequence of ints.  A field of views becomes a list of
    them, as one of ``bytes`` does; everything else is what ``collate`` makes of it.  ``to_bytes``: every
    view made ``bytes`` instead (what a loader without workers hands over), in the same walk.

    A module-level class with named fields: it pickles, for ``spawn`` and ``forkserver`` workers.
    """

    __slots__ = ("collate", "per_item", "to_bytes")

    def __init__(self, collate: Callable[[Any], Any], per_item: bool, to_bytes: bool = False) -> None:
        self.collate = collate
        self.per_item = per_item
        self.to_bytes = to_bytes

    def __call__(self, data: Any) -> Any:
        try:
            if self.per_item:
                return _convert(data, self.collate, 0, self.to_bytes)
            by_type = _by_type(self.collate)
            if by_type is not None:  # torch's own walk, told that a view is one leaf: no walk of ours
                out = by_type[0](data, collate_fn_map={**by_type[1], memoryview: _views_column})
            elif not holds_views(data):  # another collate function: as it is, unless the batch holds a view
                return self.collate(data)
            else:
                out = _collate(data, self.collate, 0)
        except _TooDeep as error:
            raise _refused(error.path[::-1]) from None
        except RecursionError:  # torch's own walk (a batch that holds itself): bounded by Python, named here
            raise _refused(_deep_path(data)) from None
        return as_bytes(out) if self.to_bytes else out

    def __reduce__(self) -> tuple:
        return (KeepingViews, (self.collate, self.per_item, self.to_bytes))

    def __repr__(self) -> str:
        name = getattr(self.collate, "__name__", self.collate)
        return f"KeepingViews({name!r}, per_item={self.per_item}, to_bytes={self.to_bytes})"


def _convert(value: Any, convert: Callable[[Any], Any], depth: int, to_bytes: bool) -> Any:
    """torch's ``default_convert`` of ``value`` (given as ``convert``), with views left as they are (made
    ``bytes`` where ``to_bytes``).

    dicts, lists and tuples are walked here as torch walks them (a tuple becomes a list, a list is copied);
    a column of plain items is copied in one step; anything else (arrays, tensors, other types) goes to
    ``convert``, unless it is a subclass of a container that holds a view."""
    kind = type(value)
    if kind in _LEAVES:
        return value.tobytes() if to_bytes and kind is memoryview else value
    if kind is list or kind is tuple:
        # a column of plain items: what torch makes of it (a list), without its walk over every item
        if not to_bytes:
            if _LEAVES.issuperset(map(type, value)):
                return list(value)
        else:
            kinds = set(map(type, value))
            if _LEAVES.issuperset(kinds):
                return (
                    [v.tobytes() if type(v) is memoryview else v for v in value] if memoryview in kinds else list(value)
                )
        pairs: Iterable = enumerate(value)
    elif kind is dict:
        pairs = value.items()
    elif isinstance(value, _CONTAINERS) and holds_views(value):
        pairs = _pairs(value)
    else:
        return convert(value)
    if depth >= MAX_DEPTH:
        if not holds_views(value):  # as deep as torch's own walk takes it (a RecursionError is named above)
            return convert(value)
        raise _TooDeep()
    out, key = {}, None
    try:
        for key, item in pairs:
            out[key] = _convert(item, convert, depth + 1, to_bytes)
    except _TooDeep as error:
        error.path.append(key)
        raise
    if kind is dict:
        return out
    if kind is list or kind is tuple or (isinstance(value, tuple) and not hasattr(value, "_fields")):
        return list(out.values())  # torch makes a list of a tuple (of a plain tuple's subclass too)
    return _rebuilt(value, out)


def _collate(batch: Any, collate: Callable[[Any], Any], depth: int) -> Any:
    """torch's ``default_collate`` of ``batch`` (a list of samples that holds a view somewhere), with every
    column of views a list of them: the samples are taken apart as torch takes them (by the first one's
    type), and a column that holds no view is torch's to collate."""
    if depth and not holds_views(batch):
        return collate(batch)
    elem = batch[0] if isinstance(batch, (list, tuple)) and batch else None
    if type(elem) is memoryview or type(elem) in (bytes, str):  # a column of views (or of bytes, with views)
        return batch  # as torch gives a column of bytes: as it came
    if depth >= MAX_DEPTH:
        raise _TooDeep()
    key = None
    try:
        if isinstance(elem, dict):
            out = {}
            for key in elem:
                out[key] = _collate([sample[key] for sample in batch], collate, depth + 1)
            return out if type(elem) is dict else _rebuilt(elem, out)
        if isinstance(elem, (list, tuple)):
            if any(len(sample) != len(elem) for sample in batch):
                raise RuntimeError("each element in list of batch should be of equal size")  # torch's own words
            columns = []
            for key, column in enumerate(zip(*batch)):  # noqa: B007  (the error names the key)
                columns.append(_collate(column, collate, depth + 1))
            return type(elem)(*columns) if hasattr(elem, "_fields") else columns
    except _TooDeep as error:
        error.path.append(key)
        raise
    return collate(batch)


def _views_column(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """A column of views, collated as one of ``bytes`` is: as it came (a list, or a tuple of a transposed batch)."""
    return batch


def _by_type(collate: Callable[[Any], Any]) -> Optional[tuple]:
    """torch's ``(collate, default_collate_fn_map)`` where ``collate`` is its ``default_collate`` (whose walk takes
    a table of functions by type, the documented way to extend it), else None."""
    global _table
    if _table is None:
        try:
            from torch.utils.data import default_collate as torch_collate
            from torch.utils.data._utils.collate import collate as walk
            from torch.utils.data._utils.collate import default_collate_fn_map
        except ImportError:  # a torch without the table: our own walk, behind a scan for views
            _table = ()
        else:
            _table = (torch_collate, walk, default_collate_fn_map)
    if _table and collate is _table[0]:
        # the table as it is now, each batch: entries a program added to torch's table (as torch's docs show) count
        return _table[1], _table[2]
    return None


_table: Optional[tuple] = None  # torch's (default_collate, collate, default_collate_fn_map), found on first use


def keeping_views(collate: Callable[[Any], Any], per_item: bool) -> KeepingViews:
    """``collate`` (torch's ``default_convert`` or ``default_collate``) that leaves views as they are (see
    :class:`KeepingViews`)."""
    return KeepingViews(collate, per_item)


def default_collate(per_item: bool, to_bytes: bool = False) -> Callable[[Any], Any]:
    """What a DataLoader collates with when given no ``collate_fn``: torch's ``default_convert`` for items
    (``batch_size=None``), ``default_collate`` for batches, each keeping views (``to_bytes``: making them
    ``bytes``); without torch, nothing."""
    kept = _torch_collate()
    if not kept:
        return _unchanged
    return kept[(0 if per_item else 1) + (2 if to_bytes else 0)]


@overload
def view_keeping(collate: None) -> None: ...


@overload
def view_keeping(collate: Callable[[Any], Any]) -> Callable[[Any], Any]: ...


def view_keeping(collate: Optional[Callable[[Any], Any]]) -> Optional[Callable[[Any], Any]]:
    """``collate``, or its view-keeping version where it is torch's own ``default_convert`` or
    ``default_collate`` (as a program passes them, and as the docs suggest for ``PackingCollate``): what those
    make of a batch without views stays exactly theirs."""
    kept = _torch_collate()
    if kept and collate is not None and not isinstance(collate, KeepingViews):
        for wrapper in kept[:2]:
            if collate is wrapper.collate:
                return wrapper
    return collate


def _unchanged(data: Any) -> Any:
    return data


#: torch's default_convert and default_collate, keeping views, then making them bytes; found on first use
_found: Optional[tuple] = None


def _torch_collate() -> tuple:
    global _found
    if _found is None:
        try:
            from torch.utils.data import default_collate as collate
            from torch.utils.data import default_convert
        except ImportError:
            _found = ()
        else:
            _found = (
                KeepingViews(default_convert, True),
                KeepingViews(collate, False),
                KeepingViews(default_convert, True, to_bytes=True),
                KeepingViews(collate, False, to_bytes=True),
            )
    return _found


_VIEWS_AS_BYTES = [False]


def _view_as_bytes(view: memoryview) -> tuple:
    return (bytes, (view.tobytes(),))


def views_pickle_as_bytes() -> None:
    """In a DataLoader worker: make a view that reaches the pickling of what the worker sends (one where no walk
    looks: in a set, a dict's key, an object of the user's) cross as ``bytes``, as the views the walks find do.
    Otherwise it cannot be pickled, and torch's worker, failing in its queue's thread, leaves the main process
    waiting for ever.  Registered on multiprocessing's pickler (the one worker queues use) once per process,
    where the loader's collation runs in a worker, so it costs one check per batch."""
    if _VIEWS_AS_BYTES[0]:
        return
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.register(memoryview, _view_as_bytes)
    _VIEWS_AS_BYTES[0] = True
