"""Small helpers shared across the library, at webdataset's ``utils`` module path.

``enforce_security`` is a module-level flag read at call time: set
``wds_cloud.utils.enforce_security = True`` to forbid ``pipe:`` URLs and unsafe
decoders in this process (``WDS_SECURE=1`` does the same from the environment).
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import itertools
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
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


#: the most names one brace spec may expand to (``braceexpand`` builds a range's values before yielding the
#: first, so a spec is counted from its groups, without expanding, and refused beyond this)
MAX_BRACE_NAMES = 1_000_000

_INT_RANGE = re.compile(r"^([-+]?\d+)\.\.([-+]?\d+)(?:\.\.([-+]?\d+))?$")
_CHAR_RANGE = re.compile(r"^(\w)\.\.(\w)(?:\.\.([-+]?\d+))?$")


def _unescaped(text: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
    """``(index, character, depth)`` of the characters of ``text`` from ``start`` that a backslash does not escape,
    with the brace depth after each."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        depth += 1 if c == "{" else -1 if c == "}" else 0
        yield i, c, depth
        i += 1


def _closing(spec: str, start: int) -> int:
    """The index of the ``}`` matching the ``{`` at ``start``, or -1 (then the brace is literal)."""
    return next((i for i, c, depth in _unescaped(spec, start) if c == "}" and depth == 0), -1)


def _split_top(content: str) -> list[str]:
    """``content`` split at the commas outside nested braces."""
    cuts = [i for i, c, depth in _unescaped(content) if c == "," and depth == 0]
    return [content[a + 1 : b] for a, b in zip([-1] + cuts, cuts + [len(content)])]


def _range_size(first: int, last: int, step: str | None) -> int:
    stride = abs(int(step)) if step else 1
    return abs(last - first) // (stride or 1) + 1


def count_braces(spec: str) -> int:
    """How many names ``spec`` expands to (an upper bound where a group is literal text)."""
    total, after = 1, 0
    for i, c, _ in _unescaped(spec):
        if c != "{" or i < after:
            continue
        end = _closing(spec, i)
        if end < 0:
            continue
        content, after = spec[i + 1 : end], end + 1
        parts = _split_top(content)
        number, letter = _INT_RANGE.match(content), _CHAR_RANGE.match(content)
        if len(parts) > 1:
            total *= sum(count_braces(part) for part in parts)
        elif number:
            total *= _range_size(int(number.group(1)), int(number.group(2)), number.group(3))
        elif letter:
            total *= _range_size(ord(letter.group(1)), ord(letter.group(2)), letter.group(3))
        else:
            total *= count_braces(content)
    return total


def expand_braces(
    spec: str, limit: int = MAX_BRACE_NAMES, refuse: Callable[[int], Exception] | None = None
) -> Iterator[str]:
    """The names ``spec`` expands to; more than ``limit`` raises ``refuse(n)`` (by default a ConfigError naming the
    pattern: a spec of the user's)."""
    if "{" in spec:
        n = count_braces(spec)
        if n > limit:
            if refuse is not None:
                raise refuse(n)
            from .errors import ConfigError

            raise ConfigError(
                f"the pattern {spec[:80]!r} expands to {n:,} names, more than {limit:,}: check its brace range"
            )
    return braceexpand.braceexpand(spec)
