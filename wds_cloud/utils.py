"""Small helpers shared across the library, at webdataset's ``utils`` module path.

``enforce_security`` is a module-level flag read at call time: set
``wds_cloud.utils.enforce_security = True`` to forbid ``pipe:`` URLs and unsafe
decoders in this process (``WDS_SECURE=1`` does the same from the environment).
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import fnmatch
import functools
import glob
import itertools
import operator
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional

import braceexpand

from . import config
from .stages import PipelineStage

__all__ = [
    "PipelineStage",
    "guess_batchsize",
    "compute_sample_weights",
    "lookup_sym",
    "enforce_security",  # noqa: F822 (a property of this module, see _Module)
    "pytorch_worker_info",
    "pytorch_worker_seed",
    "make_seed",
    "is_iterable",
    "identity",
    "obsolete",
    "ObsoleteException",
    "deprecated",
    "glob_with_braces",
    "fnmatch_with_braces",
    "repeatedly",
    "repeatedly0",
    "guard_no_torch",
]


class _Module(types.ModuleType):
    """This module, with ``enforce_security`` as a switch kept in :data:`wds_cloud.config.switches` (the io
    layer reads it there): ``wds_cloud.utils.enforce_security = True`` works as in webdataset."""

    @property
    def enforce_security(self) -> bool:
        return bool(config.switches.enforce_security)

    @enforce_security.setter
    def enforce_security(self, value: bool) -> None:
        config.switches.enforce_security = value


sys.modules[__name__].__class__ = _Module


class ObsoleteException(Exception):
    """Raised by functions marked :func:`obsolete`."""


def identity(x: Any) -> Any:
    return x


def is_iterable(obj: Any) -> bool:
    """True for iterables other than strings and bytes."""
    if isinstance(obj, (str, bytes, bytearray)):
        return False
    try:
        iter(obj)
    except TypeError:
        return False
    return True


def deprecated(arg: Any = None, *, reason: str = "") -> Any:
    """Mark a function deprecated: each call warns with ``DeprecationWarning``."""

    def wrap(f: Callable) -> Callable:
        message = f"{f.__name__} is deprecated" + (f": {reason}" if reason else "")

        @functools.wraps(f)
        def wrapper(*args: Any, **kw: Any) -> Any:
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return f(*args, **kw)

        return wrapper

    if callable(arg):
        return wrap(arg)
    if isinstance(arg, str):
        reason = arg
    return wrap


def obsolete(arg: Any = None, *, reason: str = "") -> Any:
    """Mark a function obsolete: calling it raises :class:`ObsoleteException`."""

    def wrap(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(*args: Any, **kw: Any) -> Any:
            raise ObsoleteException(f"{f.__name__} is obsolete" + (f": {reason}" if reason else ""))

        return wrapper

    if callable(arg):
        return wrap(arg)
    if isinstance(arg, str):
        reason = arg
    return wrap


def torch_distributed(group: Any = None) -> tuple[int, int]:
    """(rank, world size) from torch.distributed when a process group is up, else (0, 1); never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0, 1
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        if group is not None:
            return dist.get_rank(group), dist.get_world_size(group)
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def torch_distributed_module() -> Any:
    """``torch.distributed`` when a process group is initialized here, else None; never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


_inherited: Optional[tuple[int, int]] = None


def inherit_distributed(rank: int, world_size: int) -> None:
    """Record the (rank, world size) of the process that started this one (a spawned DataLoader worker)."""
    global _inherited
    _inherited = (rank, world_size)


def pytorch_worker_info(group: Any = None) -> tuple[int, int, int, int]:
    """(rank, world_size, worker, num_workers) of this process.

    Rank and world size come from ``torch.distributed`` when a process group is
    initialized (``group`` picks one other than the default), else from the
    ``RANK``/``WORLD_SIZE`` variables that ``torchrun`` sets (``LOCAL_RANK``
    stands in for ``RANK`` when only it is set, as on a single node); a
    DataLoader worker started with "spawn" has no process group and uses the
    rank its parent had when it pickled the dataset.  The worker comes from the
    DataLoader worker running this code.
    """
    settings = config.current()
    rank, world_size = torch_distributed(group)
    if world_size == 1 and _inherited is not None and group is None:
        rank, world_size = _inherited
    if world_size == 1 and settings.world_size is not None:
        env_rank = settings.rank if settings.rank is not None else settings.local_rank
        if env_rank is not None:
            rank, world_size = env_rank, settings.world_size
    worker, num_workers = 0, 1
    torch = sys.modules.get("torch")
    if torch is not None:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            worker, num_workers = info.id, info.num_workers
    return rank, world_size, worker, num_workers


def pytorch_worker_seed(group: Any = None) -> int:
    """A seed that differs across ranks and DataLoader workers."""
    rank, world_size, worker, num_workers = pytorch_worker_info(group)
    return rank * 1000 + worker


def make_seed(*args: Any) -> int:
    """A 31-bit seed from any hashable values (stable across processes for ints and strings)."""
    seed = 0
    for arg in args:
        seed = (seed * 31 + (arg if isinstance(arg, int) else _stable_hash(str(arg)))) & 0x7FFFFFFF
    return seed


def _stable_hash(text: str) -> int:
    h = 0
    for byte in text.encode("utf-8"):
        h = (h * 131 + byte) & 0x7FFFFFFF
    return h


def repeatedly0(loader: Iterable, nepochs: int = sys.maxsize, nbatches: int = sys.maxsize) -> Iterator:
    """Iterate over ``loader`` for up to ``nepochs`` passes and ``nbatches`` items in all."""
    for _ in range(nepochs):
        yield from itertools.islice(loader, nbatches)


def repeatedly(
    source: Iterable, nepochs: Any = None, nbatches: Any = None, nsamples: Any = None, batchsize: Callable = len
) -> Iterator:
    """Iterate over ``source`` again and again until a bound (epochs, batches or samples) is met."""
    epoch = 0
    batches = 0
    samples = 0
    while nepochs is None or epoch < nepochs:
        produced = False
        for item in source:
            produced = True
            yield item
            batches += 1
            if nbatches is not None and batches >= nbatches:
                return
            if nsamples is not None:
                samples += batchsize(item)
                if samples >= nsamples:
                    return
        epoch += 1
        if not produced:
            return


def glob_with_braces(pattern: str) -> list[str]:
    """``glob`` after brace expansion."""
    return [p for expanded in expand_braces(pattern) for p in glob.glob(expanded)]


def fnmatch_with_braces(filename: str, pattern: str) -> bool:
    """``fnmatch`` against any brace expansion of ``pattern``."""
    return any(fnmatch.fnmatch(filename, p) for p in expand_braces(pattern))


def guard_no_torch() -> None:
    """Used in tests: fail when torch was imported although nothing asked for it."""
    if "torch" in sys.modules:
        raise AssertionError("torch was imported")


def guess_batchsize(batch: Any) -> int:
    """The batch size of a collated batch (a tuple or list of columns): the length of its first column."""
    return len(batch[0])


def compute_sample_weights(n_w_pairs: Iterable[tuple]) -> Any:
    """For ``(count, weight)`` pairs, each source's ``count * weight`` relative to the largest (a numpy array
    whose largest value is 1), as webdataset computes mixing probabilities."""
    import numpy as np

    pairs = list(n_w_pairs)
    weighted = np.array([n for n, _ in pairs]) * np.array([w for _, w in pairs])
    return weighted / np.amax(weighted)


def lookup_sym(sym: str, modules: Iterable[str]) -> Any:
    """The first non-``None`` attribute ``sym`` of the named modules (``"torch"``, or relative to this package,
    ``".filters"``), or ``None``."""
    import importlib

    for name in modules:
        found = getattr(importlib.import_module(name, package="wds_cloud"), sym, None)
        if found is not None:
            return found
    return None


#: the most names one brace spec may expand to: a spec is expanded lazily (:class:`BraceNames` computes its i-th
#: name from the counts of its groups), so this bounds a typo (``{0..99999999999}``), not memory; a spec read
#: from data is bounded by its reader's own, smaller ``limit``
MAX_BRACE_NAMES = 1_000_000_000

# braceexpand's grammar, kept to the character: its ranges (a step's sign is ignored; ``\d`` is any digit
# ``int`` reads), its alphabet of letters, and its rule for escapes (removed from the whole name at the end)
_INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")
_CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")
_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_ESCAPE = re.compile(r"\\(.)")
#: braceexpand's error for unbalanced braces (a ValueError), raised as it raises it
_UNBALANCED: type[ValueError] = braceexpand.UnbalancedBracesError  # type: ignore[attr-defined]


def position(i: Any, size: int, what: str = "item") -> int:
    """``i`` as an index of a sequence of ``size`` (a negative one from the end), as a list takes it: a
    ``TypeError`` for what is not an integer (``2.0``), an ``IndexError`` naming the index given."""
    try:
        at = operator.index(i)
    except TypeError:
        raise TypeError(f"indices must be integers or slices, not {type(i).__name__}") from None
    if at < 0:
        at += size
    if not 0 <= at < size:
        raise IndexError(f"{what} {operator.index(i)} out of range: there are {size:,}")
    return at


class ComputedSequence(Sequence):
    """A sequence whose items are computed or unpacked when asked: equal to any sequence of the same items, as a
    list is (never to a str or bytes), and unhashable as a list."""

    __slots__ = ()

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, (Sequence, range)) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class SequenceView(ComputedSequence):
    """The items of ``base`` at ``positions`` (a ``range``), computed when asked: a slice of a lazy sequence
    (``urls[rank::world]``) that holds two references, not the items."""

    __slots__ = ("base", "positions")

    def __init__(self, base: Sequence, positions: range) -> None:
        self.base = base
        self.positions = positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return SequenceView(self.base, self.positions[i])
        return self.base[self.positions[i]]

    def __iter__(self) -> Iterator:
        base = self.base
        for p in self.positions:
            yield base[p]

    def __repr__(self) -> str:
        return f"<a view of {len(self):,} items of {len(self.base):,}>"


class PackedStrings(ComputedSequence):
    """A list of strings kept as one ``"\\n"``-joined UTF-8 buffer and an array of where each ends: about a string's
    own bytes plus 9, where a Python list of them costs some 50 bytes more a string, and copied into every
    DataLoader worker (pickled under spawn as two buffers; under fork no page of it is written again)."""

    __slots__ = ("data", "ends", "plain", "lines")

    def __init__(self, strings: Sequence[str]) -> None:
        joined = "\n".join(strings)
        try:
            self.data, self.plain = joined.encode("utf-8"), True
        except UnicodeEncodeError:  # lone surrogates (names decoded with surrogateescape): kept as they are
            self.data, self.plain = joined.encode("utf-8", "surrogatepass"), False
        #: no string holds a newline: the buffer splits at them
        self.lines = joined.count("\n") == len(strings) - 1
        if joined.isascii():
            lengths: Iterable[int] = (len(text) + 1 for text in strings)
        else:
            lengths = (len(text.encode("utf-8", "surrogatepass")) + 1 for text in strings)
        self.ends = array.array("q", itertools.accumulate(lengths))  # where each string ends, plus one

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return SequenceView(self, range(len(self.ends))[i])
        i = position(i, len(self.ends))
        end = self.ends[i] - 1
        start = self.ends[i - 1] if i % len(self.ends) else 0
        return self.data[start:end].decode("utf-8", "surrogatepass")

    def __iter__(self) -> Iterator[str]:
        ends, count = self.ends, len(self.ends)
        if not self.lines:
            yield from (self[i] for i in range(count))
            return
        for lo in range(0, count, _CHUNK):  # a chunk decoded at a time: never the whole buffer as one str
            hi = min(count, lo + _CHUNK)
            start = ends[lo - 1] if lo else 0
            yield from self.data[start : ends[hi - 1] - 1].decode("utf-8", "surrogatepass").split("\n")

    def __repr__(self) -> str:
        return f"<{len(self)} packed strings>"


class Chained(ComputedSequence):
    """The items of several sequences one after another (``a::b`` shard specs), each computed by its own."""

    __slots__ = ("parts", "starts", "size")

    def __init__(self, parts: Sequence[Sequence]) -> None:
        self.parts = tuple(parts)
        self.starts = tuple(itertools.accumulate((len(part) for part in self.parts), initial=0))
        self.size = self.starts[-1]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return SequenceView(self, range(self.size)[i])
        i = position(i, self.size)
        k = bisect.bisect_right(self.starts, i) - 1
        return self.parts[k][i - self.starts[k]]

    def __iter__(self) -> Iterator:
        for part in self.parts:
            yield from part


@dataclasses.dataclass(frozen=True)
class _Group:
    """One part of a brace pattern, as braceexpand parses it: ``kind`` is ``"text"`` (``value``: the string),
    ``"ints"`` (``value``: a range; ``width``: the zero padding), ``"chars"`` (``value``: the letters),
    ``"all"`` (every combination of ``parts``, the last varying fastest) or ``"any"`` (the names of each of
    ``parts`` in turn); ``size``: how many names it gives."""

    kind: str
    size: int
    value: Any = None
    width: int = 0
    parts: tuple = ()
    starts: tuple = ()  # "any": where each part's names begin

    def name(self, i: int) -> str:
        """The i-th name (0 <= i < size), computed from the counts: mixed radix over "all", offsets over "any"."""
        kind = self.kind
        if kind == "text":
            return self.value
        if kind == "ints":
            return "%0*d" % (self.width, self.value[i])
        if kind == "chars":
            return self.value[i]
        if kind == "any":
            k = bisect.bisect_right(self.starts, i) - 1
            return self.parts[k].name(i - self.starts[k])
        names = []
        for part in reversed(self.parts):
            i, digit = divmod(i, part.size)
            names.append(part.name(digit))
        name = "".join(reversed(names))
        # braceexpand removes escapes from the names of every pattern, nested ones too (so those lose two)
        return _ESCAPE.sub(r"\1", name) if "\\" in name else name

    def names(self, lo: int, hi: int) -> list:
        """Names ``lo`` to ``hi``, as :meth:`name` gives them; a range's in one comprehension where only one part
        of a pattern varies (``data-{000000..999999}.tar``: the common shard spec)."""
        kind = self.kind
        if kind == "ints":
            width = self.width
            return ["%0*d" % (width, v) for v in self.value[lo:hi]]
        if kind == "chars":
            return list(self.value[lo:hi])
        varying = [k for k, part in enumerate(self.parts) if part.size != 1] if kind == "all" else []
        if len(varying) != 1:
            return [self.name(i) for i in range(lo, hi)]
        k = varying[0]
        head = "".join(part.name(0) for part in self.parts[:k])
        tail = "".join(part.name(0) for part in self.parts[k + 1 :])
        out = [head + name + tail for name in self.parts[k].names(lo, hi)]
        return [_ESCAPE.sub(r"\1", name) if "\\" in name else name for name in out]


def _all(parts: list) -> _Group:
    size = 1
    for part in parts:
        size *= part.size
    return _Group("all", size, parts=tuple(parts))


def _text(text: str) -> _Group:
    return _Group("text", 1, text)


def _ints(first: str, last: str, step: Optional[str]) -> _Group:
    width = (
        max(len(first), len(last))
        if any(s.startswith(("0", "-0")) for s in (first, last) if s not in ("0", "-0"))
        else 0
    )
    stride = (int(step) or 1) if step else 1
    a, b = int(first), int(last)
    values = range(a, b + 1, stride) if a < b else range(a, b - 1, -stride)
    size = max(0, (abs(values.stop - values.start) + stride - 1) // stride)  # len() stops at sys.maxsize
    return _Group("ints", size, values, width)


def _chars(first: str, last: str, step: Optional[str]) -> _Group:
    stride = (int(step) or 1) if step else 1
    a, b = _ALPHABET.index(first), _ALPHABET.index(last)
    letters = _ALPHABET[a : b + 1 : stride] if a < b else _ALPHABET[a : (b or -len(_ALPHABET)) - 1 : -stride]
    return _Group("chars", len(letters), letters)


def _parse_pattern(pattern: str) -> _Group:
    """braceexpand's ``parse_pattern``: literal text and groups, every combination of them."""
    start = pos = depth = 0
    items: list = []
    while pos < len(pattern):
        c = pattern[pos]
        if c == "\\":
            pos += 2
            continue
        if c == "{":
            if depth == 0 and pos > start:
                items.append(_text(pattern[start:pos]))
                start = pos
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                expr = pattern[start + 1 : pos]
                item = _parse_expression(expr)
                items.extend([_text("{"), _parse_pattern(expr), _text("}")] if item is None else [item])
                start = pos + 1
        pos += 1
    if depth != 0:
        raise _UNBALANCED(f"Unbalanced braces: '{pattern}'")
    if start < pos:
        items.append(_text(pattern[start:]))
    return _all(items)


def _parse_expression(expr: str) -> Optional[_Group]:
    number = _INT_RANGE.match(expr)
    if number:
        return _ints(*number.groups())
    letter = _CHAR_RANGE.match(expr)
    if letter:
        return _chars(*letter.groups())
    start = pos = depth = 0
    items: list = []
    while pos < len(expr):
        c = expr[pos]
        if c == "\\":
            pos += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(_parse_pattern(expr[start:pos]))
            start = pos + 1
        pos += 1
    if depth != 0 or not items:
        return None  # not a list of alternatives: the braces are text
    items.append(_parse_pattern(expr[start:]))
    starts = tuple(itertools.accumulate((part.size for part in items[:-1]), initial=0))
    return _Group("any", sum(part.size for part in items), parts=tuple(items), starts=starts)


class BraceNames(ComputedSequence):
    """The names a brace pattern expands to, exactly those ``braceexpand`` gives and in its order, computed one
    by one: ``names[i]`` in time proportional to the pattern's groups, ``len()`` from their counts, slices
    as views.  Holds the parsed pattern only: 10^7 shard names cost what their pattern costs."""

    __slots__ = ("pattern", "size", "_root")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._root = _parse_pattern(pattern)
        self.size = self._root.size  # (len() cannot say more than sys.maxsize)

    def __reduce__(self) -> tuple:  # the pattern is the whole state: parsed again where it is unpickled
        return (BraceNames, (self.pattern,))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return SequenceView(self, range(self.size)[i])
        return self._root.name(position(i, self.size, f"name of {self.pattern[:80]!r}"))

    def __iter__(self) -> Iterator[str]:
        root, size = self._root, self.size
        for lo in range(0, size, _CHUNK):
            yield from root.names(lo, min(size, lo + _CHUNK))

    def __repr__(self) -> str:
        return f"BraceNames({self.pattern!r}: {self.size:,} names)"


#: names made at a time when a pattern is iterated
_CHUNK = 4096


def count_braces(spec: str) -> int:
    """How many names ``spec`` expands to."""
    return BraceNames(spec).size


def expand_braces(
    spec: str, limit: int = MAX_BRACE_NAMES, refuse: Callable[[int], Exception] | None = None
) -> BraceNames:
    """The names ``spec`` expands to, as a lazy sequence; more than ``limit`` raises ``refuse(n)`` (by default a
    ConfigError naming the pattern: a spec of the user's)."""
    names = BraceNames(spec)
    if names.size > limit:
        if refuse is not None:
            raise refuse(names.size)
        from .errors import ConfigError

        raise ConfigError(
            f"the pattern {spec[:80]!r} expands to {names.size:,} names, more than {limit:,}: check its brace range"
        )
    return names
