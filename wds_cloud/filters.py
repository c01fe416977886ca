"""Stream filters: shuffling, selecting, mapping, renaming, tupling, batching, decoding.

Each ``_name(data, ...)`` is a generator over a stream of samples; the public
``name(...)`` is its curried stage (see :mod:`wds_cloud.stages`).  Every filter
that calls user code takes ``handler=`` (see :mod:`wds_cloud.handlers`).
"""

from __future__ import annotations

import builtins
import fnmatch
import functools
import inspect
import io
import itertools
import logging
import pickle
import random
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import numpy as np

from . import autodecode as ad
from .autodecode import Decoder, refuse_if_unsafe
from .errors import ConfigError, MissingExtraError, SampleError, SecurityError
from .handlers import reraise_exception
from .io.security import is_secure
from .pytorch import TorchTensor
from .resume.arguments import as_count, as_real, as_seed
from .resume.shuffle import Shuffle
from .stages import FilterFunction, PassHolder, PipelineStage, RestCurried, compose, pipeline, pipelinefilter

__all__ = [
    "TorchTensor",
    "FilterFunction",
    "RestCurried",
    "PipelineStage",
    "pipelinefilter",
    "compose",
    "pipeline",
    "getfirst",
    "transform_with",
    "identity",
    "info",
    "shuffle",
    "Shuffle",
    "detshuffle",
    "select",
    "log_keys",
    "decode",
    "map",
    "rename",
    "associate",
    "map_dict",
    "to_tuple",
    "map_tuple",
    "unlisted",
    "unbatched",
    "rsample",
    "slice",
    "extract_keys",
    "rename_keys",
    "xdecode",
    "batched",
    "default_collation_fn",
    "default_decoders",
    "find_decoder",
    "Cached",
    "LMDBCached",
    "reraise_exception",
]

log = logging.getLogger(__name__)


class _Normalised(RestCurried):
    """A curried filter whose numeric arguments are normalised (numpy numbers made plain, nonsense refused with
    ConfigError naming the argument) when the stage is built, not when the first sample comes: an error raised
    there names the argument where it was written, not a sample far down the stream."""

    def __init__(self, f: Callable, normalise: dict) -> None:
        super().__init__(f)
        self.normalise = normalise

    def __call__(self, *args: Any, **kw: Any) -> FilterFunction:
        try:
            bound = inspect.signature(self.f).bind_partial(None, *args, **kw)  # None: the data, given later
        except TypeError as exc:
            raise TypeError(f"{self.f.__name__.lstrip('_')}(): {exc}") from None
        params = inspect.signature(self.f).parameters
        for name, check in self.normalise.items():
            if name not in bound.arguments:
                continue
            # None only where the stage itself takes None (its default): otherwise batched(None) would be built
            # and raise a raw TypeError on the first sample
            if bound.arguments[name] is None and name in params and params[name].default is None:
                continue
            bound.arguments[name] = check(name, bound.arguments[name])
        return FilterFunction(self.f, *bound.args[1:], **bound.kwargs)

    def __reduce__(self):
        return (_Normalised, (self.f, self.normalise))


def _slice_bounds(name: str, values: tuple) -> tuple:
    return tuple(
        None if v is None else as_count(f"slice {name}", v, least=1 if i == 2 else 0) for i, v in enumerate(values)
    )


def identity(x: Any) -> Any:
    return x


def _alternatives(spec: Any, what: str) -> list:
    """The field names one argument stands for, in webdataset's shapes: a string of alternatives joined by ``;``
    (``"jpg;png"``), or a list or tuple of them (``["webp", "png", "jpg"]``, as CLIP_benchmark passes)."""
    if isinstance(spec, str):
        return spec.split(";")
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(k, str) for k in spec):
        return list(spec)
    raise TypeError(
        f"{what} is {spec!r}: give a field name, alternatives joined by ';' (\"jpg;png\"), or a non-empty list "
        'of names (["jpg", "png"])'
    )


def parse_field_spec(fields: Any) -> list:
    """A list of fields, each a list of alternatives: from ``"jpg;png cls"`` or ``["jpg;png", ["webp", "png"]]``."""
    if isinstance(fields, str):
        fields = fields.split()
    return [_alternatives(f, f"field {i}") for i, f in enumerate(fields)]


def getfirst(a: dict, keys: Any, default: Any = None, missing_is_error: bool = True) -> Any:
    """The value of the first of ``keys`` (a list, or a string of alternatives joined by ``;``) in ``a``."""
    if isinstance(keys, str):
        keys = keys.split(";")
    for k in keys:
        if k in a:
            return a[k]
    if missing_is_error:
        raise ValueError(
            f"none of the fields {list(keys)} is in sample {a.get('__key__')!r} "
            f"(fields present: {sorted(k for k in a if not k.startswith('__'))})"
        )
    return default


def transform_with(sample: Any, transformers: Optional[list]) -> Any:
    """Apply ``transformers[i]`` to ``sample[i]`` (None leaves an element alone)."""
    if transformers is None or len(transformers) == 0:
        return sample
    result = list(sample)
    if len(transformers) > len(result):
        raise ValueError(f"{len(transformers)} transformers for a sample of {len(result)} elements")
    for i, f in enumerate(transformers):
        if f is not None:
            result[i] = f(sample[i])
    return tuple(result) if isinstance(sample, tuple) else result


def _info(
    data: Iterable,
    fmt: Optional[str] = None,
    n: int = 3,
    every: int = -1,
    width: int = 50,
    stream: Any = None,
    name: str = "",
) -> Iterator:
    """Pass samples through, printing a short description of the first ``n`` and then every ``every``-th.

    Yields every sample unchanged.  For example ``wds.DataPipeline(wds.SimpleShardList(url),
    wds.tarfile_to_samples(), wds.info(n=2))`` describes the first two samples on standard error.

    :param fmt: a ``str.format`` template filled from the sample's fields; None prints every field, each value
        cut to ``width`` characters.
    :param n: how many samples to describe first.
    :param every: then describe every ``every``-th sample (-1: no more).
    :param width: the characters shown of each value.
    :param stream: where to print (default: ``sys.stderr``).
    :param name: a label printed before each description.
    """
    stream = stream or sys.stderr
    for i, sample in enumerate(data):
        if i < n or (every > 0 and (i + 1) % every == 0):
            if fmt is None:
                print("---", name, file=stream)
                for k, v in sample.items() if isinstance(sample, dict) else enumerate(sample):
                    print(k, repr(v)[:width], file=stream)
            else:
                print(fmt.format(**sample), file=stream)
        yield sample


info = pipelinefilter(_info)


def _shuffle(
    data: Iterable,
    bufsize: int = 1000,
    initial: int = 100,
    rng: Optional[random.Random] = None,
    seed: Optional[int] = None,
    handler: Any = None,
) -> Iterator:
    """Shuffle through a buffer of ``bufsize`` samples, starting once ``initial`` are buffered."""
    return Shuffle(bufsize, initial, rng=rng, seed=seed).run(data)


def shuffle(
    bufsize: int = 1000,
    initial: int = 100,
    rng: Optional[random.Random] = None,
    seed: Optional[int] = None,
    handler: Any = None,
) -> Shuffle:
    """The shuffle stage: a buffer of ``bufsize`` samples, output starting once ``initial`` are in (the arguments in
    webdataset's order: ``shuffle(1000, 100, None, 5)`` is seed 5)."""
    return Shuffle(bufsize, initial, rng=rng, handler=handler, seed=seed)


class detshuffle(Shuffle):
    """Deterministic shuffle: the order is a function of (seed, epoch); the epoch advances each run.

    Unlike webdataset, a seed given as text (``WDS_SEED``) is accepted.
    """

    def __init__(self, bufsize: int = 1000, initial: int = 100, seed: Any = 0, epoch: int = -1) -> None:
        super().__init__(bufsize, initial, seed=seed, epoch_seeded=True, epoch=epoch)


def _select(data: Iterable, predicate: Callable) -> Iterator:
    """Keep the samples for which ``predicate(sample)`` is true.

    Yields the samples kept, unchanged.  For example ``ds.select(lambda s: s["cls"] < 10)``, or as a stage
    ``wds.select(lambda s: "jpg" in s)``.

    :param predicate: a function of a sample; a true result keeps it.
    """
    for sample in data:
        if predicate(sample):
            yield sample


select = pipelinefilter(_select)


def _log_keys(data: Iterable, logfile: Optional[str] = None) -> Iterator:
    """Append each sample's ``__url__`` and ``__key__`` to ``logfile`` (or the debug log).

    Yields every sample unchanged.  For example ``ds.log_keys("keys.tsv")`` records which samples a run saw.

    :param logfile: the file to append a line per sample to; None logs the lines at DEBUG level to the
        ``wds_cloud.filters`` logger.
    """
    out = open(logfile, "a") if logfile else None
    try:
        for sample in data:
            line = f"{sample.get('__url__')}\t{sample.get('__key__')}"
            if out:
                print(line, file=out, flush=True)
            else:
                log.debug("%s", line)
            yield sample
    finally:
        if out:
            out.close()


log_keys = pipelinefilter(_log_keys)


def _decode(data: Iterable, *args: Any, handler: Callable = reraise_exception, **kw: Any) -> Iterator:
    """Decode each sample's fields with a :class:`Decoder` built from ``args``.

    Yields each sample with its fields decoded.  For example ``wds.decode("rgb8")`` (numpy images),
    ``wds.decode(wds.imagehandler("torchrgb"))``; the fluent ``ds.decode("pil")`` does the same.

    :param args: the handlers of the :class:`Decoder` (an image spec such as ``"rgb8"``, a handler function of
        ``(key, data)``), or one ``Decoder`` ready made.
    :param handler: called with the exception when a sample cannot be decoded: true skips the sample, false
        stops (default: raise it).
    :param kw: the rest of ``Decoder``'s arguments (``pre``, ``post``, ``only``, ``partial``, ``allow_pickle``).
    """
    decoder = Decoder(list(args), **kw) if not (len(args) == 1 and isinstance(args[0], Decoder)) else args[0]
    for sample in data:
        try:
            decoded = decoder(sample)
        except Exception as exn:
            if handler(exn):
                continue
            break
        yield decoded


decode = pipelinefilter(_decode)


def _map(data: Iterable, f: Callable, handler: Callable = reraise_exception) -> Iterator:
    """``f(sample)`` for each sample; None drops the sample; a dict result keeps ``__key__``.

    Yields ``f(sample)`` for each sample, skipping None.  For example ``ds.map(lambda s: {**s, "n": len(s["txt"])})``
    or ``wds.map(preprocess)``.

    :param f: a function of a sample returning the new sample, or None to drop it.
    :param handler: called with the exception ``f`` raised: true skips the sample, false stops (default: raise
        it).
    """
    for sample in data:
        try:
            result = f(sample)
        except Exception as exn:
            if handler(exn):
                continue
            break
        if result is None:
            continue
        if isinstance(sample, dict) and isinstance(result, dict) and "__key__" in sample:
            result["__key__"] = sample["__key__"]
        yield result


map = pipelinefilter(_map)


def _rename(data: Iterable, handler: Callable = reraise_exception, keep: bool = True, **kw: Any) -> Iterator:
    """Rename fields: ``rename(image="jpg;png")`` (or ``image=["jpg", "png"]``) takes the first of jpg/png as
    ``image``.  As webdataset's: with ``keep`` every field named as an alternative goes and the others stay;
    without it the sample holds the renamed fields only.

    Yields each sample with its fields renamed.  For example ``ds.rename(image="jpg;png", label="cls")``.

    :param handler: called with the exception when a sample has none of a name's alternatives: true skips the
        sample, false stops (default: raise it).
    :param keep: keep the other fields, ``__key__`` and ``__url__`` included (False: the sample holds the
        renamed fields only).
    :param kw: ``new=old``: the new name of a field, and the old name or its alternatives.
    """
    names = {new: _alternatives(old, f"rename({new}=...)") for new, old in kw.items()}
    replaced = {k for alternatives in names.values() for k in alternatives}
    for sample in data:
        try:
            renamed = {}
            for new, alternatives in names.items():
                for alternative in alternatives:
                    if alternative in sample:
                        renamed[new] = sample[alternative]
                        break
                else:
                    raise ValueError(
                        f"rename: sample {sample.get('__key__')!r} has none of {kw[new]!r} "
                        f"(fields: {sorted(k for k in sample if not k.startswith('__'))})"
                    )
            if keep:
                result = {k: v for k, v in sample.items() if k not in replaced}
                result.update(renamed)
            else:
                result = renamed
        except Exception as exn:
            if handler(exn):
                continue
            break
        yield result


rename = pipelinefilter(_rename)


def _associate(data: Iterable, associator: Any, **kw: Any) -> Iterator:
    """Merge extra fields into each sample: from a dict keyed by ``__key__``, or ``associator(key)``.

    Yields each sample with the extra fields merged in.  For example ``wds.associate({"000001": {"cls": 3}})``.

    :param associator: a dict from a sample's ``__key__`` to a dict of fields, or a function of the key
        returning such a dict (or None: nothing to add).
    """
    for sample in data:
        extra = associator(sample["__key__"]) if callable(associator) else associator.get(sample["__key__"])
        if extra:
            sample.update(extra)
        yield sample


associate = pipelinefilter(_associate)


def _map_dict(data: Iterable, handler: Callable = reraise_exception, **kw: Callable) -> Iterator:
    """Apply ``kw[field]`` to each named field.

    Yields each sample with the named fields replaced by the function's result; other fields stay.  For example
    ``ds.map_dict(jpg=preprocess, cls=int)``.

    :param handler: called with the exception a function raised: true skips the sample, false stops (default:
        raise it).
    :param kw: ``field=function``: the function applied to that field's value.
    """
    for k, f in kw.items():
        if not callable(f):
            raise TypeError(f"map_dict({k}=...) is {f!r}: give a function of the field's value")
    for sample in data:
        try:
            for k, f in kw.items():
                sample[k] = f(sample[k])
        except Exception as exn:
            if handler(exn):
                continue
            break
        yield sample


map_dict = pipelinefilter(_map_dict)


def _to_tuple(
    data: Iterable,
    *args: str,
    handler: Callable = reraise_exception,
    missing_is_error: bool = True,
    none_is_error: Optional[bool] = None,
) -> Iterator:
    """Turn dict samples into tuples of the named fields (``"jpg;png cls"``, ``"jpg;png", "cls"``, or a list of
    alternatives per field: ``["webp", "png", "jpg"], "cls"``, webdataset's ``getfirst`` shapes).

    Yields a tuple per sample, its elements in the order of the fields named.  For example
    ``ds.to_tuple("jpg;png", "cls")`` gives ``(image, label)`` pairs.

    :param args: one argument per element: a field name, alternatives (the first the sample holds is taken);
        or a single string of space-separated fields.
    :param handler: called with the exception when a sample lacks a field: true skips the sample, false stops
        (default: raise it).
    :param missing_is_error: a sample lacking a field is an error (False: None in its place).
    :param none_is_error: a field whose value is None is an error (default: as ``missing_is_error``).
    """
    if none_is_error is None:
        none_is_error = missing_is_error
    if len(args) == 1 and isinstance(args[0], str) and " " in args[0]:
        args = tuple(args[0].split())
    fields = [_alternatives(a, f"to_tuple's argument {i}") for i, a in enumerate(args)]
    for sample in data:
        try:
            result = tuple(getfirst(sample, f, missing_is_error=missing_is_error) for f in fields)
            if none_is_error and any(x is None for x in result):
                raise ValueError(f"to_tuple{args}: a field of sample {sample.get('__key__')!r} is None")
        except Exception as exn:
            if handler(exn):
                continue
            break
        yield result


to_tuple = pipelinefilter(_to_tuple)


def _map_tuple(data: Iterable, *args: Optional[Callable], handler: Callable = reraise_exception) -> Iterator:
    """Apply ``args[i]`` to element i of each tuple (or list) sample, giving a tuple; None leaves an element as
    it is, and functions beyond the sample's length are not called (webdataset's ``map_tuple``).

    Yields each tuple sample with element ``i`` replaced by ``args[i](element)``.  For example
    ``ds.to_tuple("jpg", "cls").map_tuple(preprocess, int)``.

    :param args: a function per element, or None to leave that element alone.
    :param handler: called with the exception a function raised: true skips the sample, false stops (default:
        raise it).
    """
    for i, f in enumerate(args):
        if f is not None and not callable(f):
            raise TypeError(f"map_tuple's argument {i} is {f!r}: give a function, or None to keep that element")
    for sample in data:
        try:
            elements = list(sample)
            for i, f in enumerate(args[: len(elements)]):
                if f is not None:
                    elements[i] = f(elements[i])
            result = tuple(elements)
        except Exception as exn:
            if handler(exn):
                continue
            break
        yield result


map_tuple = pipelinefilter(_map_tuple)


def _unlisted(data: Iterable) -> Iterator:
    """Flatten a stream of lists.

    Yields the items of each list, one by one: the inverse of ``listed``.  For example ``ds.listed(8).unlisted()``
    gives the samples back.
    """
    for batch in data:
        if not isinstance(batch, list):
            raise TypeError(f"unlisted expects lists, got {type(batch).__name__}")
        yield from batch


def _unbatched(data: Iterable) -> Iterator:
    """Split batches (tuples/lists of columns, or dicts of columns) back into samples.

    Yields one sample per row of each batch: the inverse of ``batched``.  For example ``ds.batched(64).unbatched()``
    gives the samples back (numpy or torch columns give their rows).
    """
    for batch in data:
        if isinstance(batch, dict):
            columns = {k: v for k, v in batch.items()}
            n = len(next(iter(columns.values()))) if columns else 0
            for i in range(n):
                yield {k: v[i] for k, v in columns.items()}
            continue
        if not isinstance(batch, (tuple, list)) or len(batch) == 0:
            raise TypeError(f"unbatched expects a non-empty tuple/list of columns, got {type(batch).__name__}")
        for i in range(len(batch[0])):
            yield tuple(column[i] for column in batch)


class _SplitStage(PassHolder, FilterFunction):
    """A stage that splits each item into several (``unbatched``, ``unlisted``) and knows how many of the item
    in hand it has still to give: a state taken between them would resume after the whole item (the stages
    before it are past it) and lose the rest, so the pipeline asks :meth:`holding` and gives no exact state
    then (a state at an item's end is exact)."""

    PASS_FIELDS = {"_left": None}

    def __call__(self, data: Iterable) -> Iterator:
        left = self._left = [0]
        return self._split(data, left)

    def _split(self, data: Iterable, left: list) -> Iterator:
        f, args, kw = self.f, self.args, self.kw
        for item in data:
            parts = list(f((item,), *args, **kw))
            left[0] = len(parts)
            for part in parts:
                left[0] -= 1
                yield part

    def holding(self) -> Optional[str]:
        """Why no state can be exact now (items of a split item are still to come), or None."""
        left = self.__dict__.get("_left")
        if not left or left[0] <= 0:
            return None
        return (
            f"was stopped inside an item it splits ({left[0]} of its parts not yet given out), which no state can "
            "give back (the stages before it are past that item): take states when an item is used up (after a "
            "multiple of the batch size), or leave the batched()/unbatched() pair out"
        )


class _Splitting(RestCurried):
    """The curried form of a splitting filter: its stages are :class:`_SplitStage`\\ s."""

    def __call__(self, *args: Any, **kw: Any) -> _SplitStage:
        return _SplitStage(self.f, *args, **kw)

    def __reduce__(self):  # pickle by reference to the underlying module-level function
        return (_Splitting, (self.f,))


unbatched = _Splitting(_unbatched)
unlisted = _Splitting(_unlisted)


def _rsample(data: Iterable, p: float = 0.5, seed: Optional[int] = None) -> Iterator:
    """Keep each sample with probability ``p``.  Without ``seed`` the draws come from Python's global ``random``, as
    webdataset's do, so a ``worker_init_fn`` (or a script) that seeds ``random`` makes the selection repeatable.

    Yields the samples kept, unchanged.  For example ``ds.rsample(0.1)`` keeps about one sample in ten.

    :param p: the probability of keeping a sample, from 0 to 1.
    :param seed: the seed of its random generator (None: a fresh one each pass).
    """
    rng: Any = random if seed is None else random.Random(seed)
    for sample in data:
        if rng.random() < p:
            yield sample


def _probability(name: str, value: Any) -> float:
    p = as_real(name, value)
    if p > 1:
        raise ConfigError(f"{name}={value!r} is not a probability: give a number from 0 to 1")
    return p


_rsample_unseeded = _Normalised(_rsample, {"p": _probability, "seed": as_seed})


class RSample(PassHolder, PipelineStage):
    """:func:`rsample` with a seed, as a resumable stage: its draws come from a counted generator
    (:class:`~wds_cloud.resume.rng.CountedRandom`), and its state is how many it has made in the pass, so a
    resumed pass keeps the samples the uninterrupted one would have.  Every pass draws the same sequence."""

    PASS_FIELDS = {"_rng": None}
    keeps_place = False  # (its source keeps the place)

    def __init__(self, p: float, seed: int) -> None:
        self.p = p
        self.seed = seed
        self._rng: Any = None
        self._resume = 0

    def run(self, src: Iterable) -> Iterator:
        from .resume.rng import CountedRandom

        rng = self._rng = CountedRandom(self.seed, self._resume)
        self._resume = 0
        p, draw = self.p, rng.random
        for sample in src:
            if draw() < p:
                yield sample

    def state_dict(self) -> dict:
        return {"draws": self._rng.count if self._rng is not None else self._resume}

    def next_pass_state(self) -> dict:
        return {"draws": self._resume}

    def load_state_dict(self, state: dict) -> None:
        from .resume.rng import MAX_COUNT
        from .resume.state import expect, refuse_unknown

        expect(state, "rsample", dict, draws=(int, lambda v: type(v) is int and 0 <= v < MAX_COUNT))
        refuse_unknown(state, ("draws",), "rsample")
        self._resume = state["draws"]

    def __repr__(self) -> str:
        return f"rsample({self.p}, seed={self.seed})"


def rsample(p: float = 0.5, seed: Optional[int] = None) -> Any:
    """Keep each sample with probability ``p`` (see :func:`_rsample`).  With a ``seed`` it is a resumable stage
    (:class:`RSample`: a resumed pass keeps what the uninterrupted one would); without, its draws come from Python's
    global ``random``, as webdataset's do, and a resumed pass draws afresh."""
    p = _probability("p", p)
    seed = as_seed("seed", seed)
    if seed is None:
        stage = _rsample_unseeded(p)
        stage.passes_every_sample = False  # its draws differ on replay: never between a reader and a shuffle
        return stage
    return RSample(p, seed)


def _slice(data: Iterable, *args: Any) -> Iterator:
    """``itertools.islice(data, *args)``: webdataset's function (the stage is :func:`slice`)."""
    return itertools.islice(data, *args)


class Slice(PassHolder, PipelineStage):
    """``itertools.islice`` as a resumable stage: it yields the samples ``islice(samples, start, stop, step)``
    gives, and its state is how many samples it has been given in the pass (a resumed pass goes on counting
    from there, so ``slice(500)`` stops after the 500th sample of the pass, not 500 samples after the resume)."""

    PASS_FIELDS = {"_seen": lambda: [0]}
    COPIED_FIELDS = ()
    #: the count it keeps is of its source's samples: the source keeps where the pass stands
    keeps_place = False

    def __init__(self, *args: Any) -> None:
        bounds = builtins.slice(*args)  # islice's spellings: (stop) or (start, stop[, step])
        start, stop, step = _slice_bounds("args", (bounds.start, bounds.stop, bounds.step))
        self.start, self.stop, self.step = start or 0, stop, step or 1
        self._seen = [0]
        self._resume = 0

    def run(self, src: Iterable) -> Iterator:
        start, stop, step = self.start, self.stop, self.step
        seen = self._seen = [self._resume]
        self._resume = 0
        n = seen[0]
        if stop is not None and n >= stop:
            return
        for sample in src:
            i = n
            n = seen[0] = i + 1
            if i >= start and (i - start) % step == 0:
                yield sample
            if stop is not None and n >= stop:  # as islice: no sample past the stop is taken from the source
                return

    def state_dict(self) -> dict:
        return {"seen": self._seen[0]}

    def next_pass_state(self) -> dict:
        return {"seen": self._resume}

    def load_state_dict(self, state: dict) -> None:
        from .resume.rng import MAX_COUNT
        from .resume.state import expect, refuse_unknown

        expect(state, "slice", dict, seen=(int, lambda v: type(v) is int and 0 <= v < MAX_COUNT))
        refuse_unknown(state, ("seen",), "slice")
        self._resume = state["seen"]

    def __repr__(self) -> str:
        return f"slice({self.start}, {self.stop}, {self.step})"


def slice(*args: Any) -> Slice:
    """``itertools.islice`` as a stage (resumable: see :class:`Slice`).

    Yields the samples ``itertools.islice(samples, *args)`` gives.  For example ``ds.slice(100)`` (the first 100),
    ``ds.slice(10, None, 2)`` (every second from the tenth).

    :param args: ``stop``, or ``start, stop`` and an optional ``step``, as ``islice`` takes them.
    """
    if not 1 <= len(args) <= 3:
        raise TypeError(f"slice(): expected 1 to 3 arguments (stop, or start, stop[, step]), got {len(args)}")
    return Slice(*args)


def _extract_keys(
    source: Iterable, *patterns: Any, duplicate_is_error: bool = True, ignore_missing: bool = False
) -> Iterator:
    """A tuple per sample: for each pattern, the value of the field it matches.

    A pattern is a ``;``-separated string of glob alternatives, or a list/tuple of them; an
    alternative matches a key itself or ``"." + key`` (so ``"*.jpg"`` and ``"jpg"`` both match
    ``jpg``).  Every key is a candidate, ``__key__`` and ``__url__`` included.  No match is a
    ``ValueError`` unless ``ignore_missing`` (then the pattern is left out of the tuple); several
    matches are one when ``duplicate_is_error``, else the first in the sample's order wins.

    For example ``ds.extract_keys("*.jpg;*.png", "cls")`` gives ``(image, label)`` tuples.

    :param patterns: one pattern per element of the tuple.
    :param duplicate_is_error: several matching keys are an error (False: the first wins).
    :param ignore_missing: a pattern no key matches is left out of the tuple (False: an error).
    """
    alternatives = [p.split(";") if isinstance(p, str) else list(p) for p in patterns]
    for sample in source:
        result = []
        for pattern, alts in zip(patterns, alternatives):
            matches = [
                v
                for k, v in sample.items()
                if any(fnmatch.fnmatchcase(k, alt) or fnmatch.fnmatchcase("." + k, alt) for alt in alts)
            ]
            if not matches:
                if ignore_missing:
                    continue
                raise ValueError(
                    f"extract_keys: no key of sample {sample.get('__key__')!r} matches {pattern!r} "
                    f"(keys: {list(sample)}); pass ignore_missing=True to leave it out"
                )
            if len(matches) > 1 and duplicate_is_error:
                raise ValueError(
                    f"extract_keys: {len(matches)} keys of sample {sample.get('__key__')!r} match "
                    f"{pattern!r}; pass duplicate_is_error=False to take the first"
                )
            result.append(matches[0])
        yield tuple(result)


extract_keys = pipelinefilter(_extract_keys)


def _rename_keys(
    source: Iterable,
    *args: tuple,
    keep_unselected: bool = False,
    must_match: bool = True,
    duplicate_is_error: bool = True,
    **kw: str,
) -> Iterator:
    """Rename fields by glob pattern: ``rename_keys(image="*.jpg", ("label", "*.cls"))``.

    Yields each sample with the matching fields renamed (``__`` fields stay).

    :param args: ``(new, pattern)`` pairs.
    :param keep_unselected: keep the fields no pattern matches (False: drop them).
    :param must_match: a pattern no field matches is an error.
    :param duplicate_is_error: two fields renamed to one name are an error.
    :param kw: ``new=pattern`` pairs (a glob over the lower-cased field name).
    """
    renamings = list(args) + [(new, pattern) for new, pattern in kw.items()]
    for sample in source:
        new_sample = {}
        matched = {k: False for k, _ in renamings}
        for path, value in sample.items():
            if path.startswith("__"):
                new_sample[path] = value
                continue
            for new, pattern in renamings:
                if fnmatch.fnmatch(path.lower(), pattern):
                    if new in new_sample and duplicate_is_error:
                        raise ValueError(
                            f"rename_keys: {path!r} and another field both become {new!r} "
                            f"in sample {sample.get('__key__')!r}"
                        )
                    new_sample[new] = value
                    matched[new] = True
                    break
            else:
                if keep_unselected:
                    new_sample[path] = value
        if must_match and not all(matched.values()):
            missing = [k for k, v in matched.items() if not v]
            raise ValueError(
                f"rename_keys: no field of sample {sample.get('__key__')!r} for {missing} "
                f"(fields: {sorted(k for k in sample if not k.startswith('__'))})"
            )
        yield new_sample


rename_keys = pipelinefilter(_rename_keys)


def _read(data: Any) -> bytes:
    """The bytes of ``data``: a stream (as ``xdecode`` passes it) is read, bytes-like values are taken as they are."""
    read = getattr(data, "read", None)
    return read() if read is not None else bytes(data)


class _Bytes:
    """A bytes decoder made to accept a stream too (``inner`` is the bytes decoder, for the pickle check)."""

    __slots__ = ("inner",)

    def __init__(self, inner: Callable) -> None:
        self.inner = inner

    def __call__(self, data: Any) -> Any:
        return self.inner(_read(data))

    def __reduce__(self):
        return (_Bytes, (self.inner,))


def _bgr8(data: bytes) -> Any:
    return ad.imagehandler("rgb8")("png", data)[..., ::-1]


def _default_decoders() -> list:
    """xdecode's defaults, from the one decoding table (``autodecode.decoders``) and the image extensions."""
    table: list[tuple[str, Callable]] = [
        ("*.bgr8.png *.bgr8.jpg *.bgr8.jpeg", _bgr8),
        (" ".join(f"*.{ext}" for ext in ad.IMAGE_EXTENSIONS), ad.imagehandler("rgb8").decode_any),
    ]
    by_decoder: dict[Callable, list[str]] = {}
    for ext, fn in ad.decoders.items():
        by_decoder.setdefault(fn, []).append(f"*.{ext}")
    table += [(" ".join(patterns), fn) for fn, patterns in by_decoder.items()]
    return [(patterns, _Bytes(fn)) for patterns, fn in table]


class _LazyDecoders(list):
    """``default_decoders`` built on first use, so importing filters does not import autodecode."""

    def _load(self) -> None:
        if not list.__len__(self):
            self.extend(_default_decoders())

    def __iter__(self):
        self._load()
        return list.__iter__(self)

    def __len__(self) -> int:
        self._load()
        return list.__len__(self)

    def __getitem__(self, i):
        self._load()
        return list.__getitem__(self, i)


default_decoders = _LazyDecoders()


def find_decoder(decoders: Iterable, path: str) -> Optional[Callable]:
    """The decoder of the first ``(patterns, fn)`` whose space-separated glob patterns match ``path``."""
    fname = re.sub(r".*/", "", path)
    if fname.startswith("__"):
        return lambda x: x
    for patterns, fun in decoders:
        for pattern in patterns.split():
            if fnmatch.fnmatch(fname.lower(), pattern) or fnmatch.fnmatch("." + fname.lower(), pattern):
                return fun
    return None


def _xdecode(
    source: Iterable, *args: tuple, must_decode: bool = True, defaults: Any = default_decoders, **kw: Callable
) -> Iterator:
    """Decode fields by glob pattern: ``xdecode(("*.jpg", fn), png=fn2)``; honours WDS_SECURE and pickle rules.

    A decoder receives a stream (bytes values wrapped in ``io.BytesIO``); a value that is not
    bytes is passed as it is.  Keyword decoders come first, then the positional pairs, later
    ones before earlier ones, then ``defaults``.  ``must_decode`` makes a field without a
    decoder an error.

    Yields each sample with its fields decoded.  For example ``ds.xdecode(png=my_png_reader)``.

    :param args: ``(patterns, decoder)`` pairs, the patterns space-separated globs over the field name.
    :param must_decode: a field without a decoder is an error (False: it is left as it is).
    :param defaults: the decoders tried last (default: ``default_decoders``; None: none).
    :param kw: ``extension=decoder`` pairs, tried first.
    """
    decoders = [(f"*.{k}", v) for k, v in kw.items()] + list(reversed(args)) + list(defaults or [])
    for sample in source:
        result = {}
        for path, data in sample.items():
            if path.startswith("__"):
                result[path] = data
                continue
            decoder = find_decoder(decoders, "x." + path if "." not in path else path)
            if decoder is False:
                result[path] = data
                continue
            if decoder is None:
                if must_decode:
                    raise ValueError(
                        f"xdecode: no decoder for field {path!r} of sample {sample.get('__key__')!r}; "
                        "pass one, or must_decode=False"
                    )
                result[path] = data
                continue
            refuse_if_unsafe(path, getattr(decoder, "inner", decoder), sample)
            result[path] = decoder(io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data)
        yield result


xdecode = pipelinefilter(_xdecode)


def default_collation_fn(samples: list, combine_tensors: bool = True, combine_scalars: bool = True) -> Any:
    """Turn a list of samples into a batch of columns: a tuple of them for tuples or lists, a dict for dicts.

    Numbers become numpy arrays, numpy arrays are stacked, tensors are stacked
    with torch, everything else stays a list.
    """
    if not samples:
        return samples
    first = samples[0]
    if isinstance(first, dict):
        keys = first.keys()
        for i, sample in enumerate(samples):
            if not (isinstance(sample, dict) and sample.keys() == keys):
                _unlike(samples, i)
        return {k: _collate_column([s[k] for s in samples], combine_tensors, combine_scalars) for k in keys}
    if not isinstance(first, (list, tuple)):
        raise TypeError(f"default_collation_fn batches tuples, lists or dicts, not {type(first).__name__}")
    width = len(first)
    for i, sample in enumerate(samples):
        if not (isinstance(sample, (list, tuple)) and len(sample) == width):
            _unlike(samples, i)
    columns = list(zip(*samples))
    return tuple(_collate_column(list(c), combine_tensors, combine_scalars) for c in columns)


def _unlike(samples: list, i: int) -> None:
    """Refuse a batch whose sample ``i`` has other fields (or another length) than its first, as webdataset
    refuses it ("keys don't match"), naming both and the fix."""

    def fields(sample: Any) -> str:
        if isinstance(sample, dict):
            key = sample.get("__key__")
            return f"{sorted(str(k) for k in sample)}" + (f" (key {key!r})" if isinstance(key, str) else "")
        if isinstance(sample, (list, tuple)):
            return f"{len(sample)} values"
        return type(sample).__name__

    raise SampleError(
        f"batched: sample {i} of the batch has {fields(samples[i])}, the first has {fields(samples[0])}; the "
        "samples of a batch need the same fields: pick them first (to_tuple(...), or rename/map_dict), or give "
        "batched() a collation_fn of your own"
    )


def _collate_column(column: list, combine_tensors: bool, combine_scalars: bool) -> Any:
    first = column[0]
    if isinstance(first, (int, float)):  # bools too, as webdataset's combine_values
        return np.array(column) if combine_scalars else column
    if isinstance(first, np.ndarray):
        return np.stack(column) if combine_tensors else column
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(first, torch.Tensor):
        return torch.stack(column) if combine_tensors else column
    return column


def _batched(
    data: Iterable, batchsize: int = 20, collation_fn: Optional[Callable] = default_collation_fn, partial: bool = True
) -> Iterator:
    """Group samples into batches of ``batchsize``; ``partial=False`` drops a short last batch.

    Yields a batch per ``batchsize`` samples: what ``collation_fn`` makes of the list (by default a tuple of
    columns for tuple samples, a dict of columns for dict samples; numbers and arrays stacked).  For example
    ``ds.to_tuple("jpg", "cls").batched(64)`` gives ``(images, labels)`` with 64 rows each.

    :param batchsize: the samples per batch (a positive count).
    :param collation_fn: turns the list of samples into the batch (None: the list itself, as ``listed`` does).
    :param partial: yield the last, shorter batch (False: drop it).
    """
    batch: list = []
    for sample in data:
        batch.append(sample)
        if len(batch) >= batchsize:
            yield collation_fn(batch) if collation_fn is not None else batch
            batch = []
    if batch and partial:
        yield collation_fn(batch) if collation_fn is not None else batch


batched = _Normalised(_batched, {"batchsize": functools.partial(as_count, least=1)})


class Cached(PassHolder, PipelineStage):
    """Keep the samples of the first pass in memory and replay them on later passes (of the pipeline it is in:
    each pipeline has a copy of its own, see :class:`~wds_cloud.stages.PassHolder`, so one ``Cached()`` put into
    a training and a validation pipeline never gives one the other's samples)."""

    COPIED_FIELDS = ("cached",)
    #: a later pass replays the cache whatever a loaded state says, and a pass resumed mid-way would cache only
    #: its rest: a state of a pipeline with this stage is inexact (refused with strict=True), never wrong
    resumable = False

    def __init__(self) -> None:
        self.cached: Optional[list] = None

    def run(self, source: Iterable) -> Iterator:
        if self.cached is not None:
            yield from self.cached
            return
        collected = []
        for sample in source:
            collected.append(sample)
            yield sample
        self.cached = collected


class LMDBCached(PipelineStage):
    """Cache the samples of the first pass in an LMDB file (needs the ``lmdb`` module).

    Samples are stored with ``pickler`` (default: :mod:`pickle`), so constructing
    this stage is an explicit opt-in to unpickling that file; it is refused under
    ``WDS_SECURE=1``.
    """

    def __init__(self, fname: str, map_size: float = 1e12, pickler: Any = None, chunksize: int = 500) -> None:
        if is_secure():
            raise SecurityError("LMDBCached stores samples with pickle and is refused under WDS_SECURE=1")
        try:
            import lmdb
        except ImportError:
            raise MissingExtraError("LMDBCached needs the lmdb module: pip install lmdb") from None

        self.db = lmdb.open(fname, readonly=False, map_size=int(map_size))
        self.pickler = pickler or pickle
        self.chunksize = chunksize

    def is_complete(self) -> bool:
        with self.db.begin(write=False) as txn:
            return txn.get(b"_") is not None

    def add_samples(self, samples: Iterable) -> Iterator:
        txn = self.db.begin(write=True)
        for i, sample in enumerate(samples):
            txn.put(f"{i:012d}".encode(), self.pickler.dumps(sample))  # padded: cursor order is sample order
            yield sample
            if (i + 1) % self.chunksize == 0:
                txn.commit()
                txn = self.db.begin(write=True)
        txn.put(b"_", b"1")
        txn.commit()

    def run(self, samples: Iterable) -> Iterator:
        if self.is_complete():
            with self.db.begin(write=False) as txn:
                for key, value in txn.cursor():
                    if key != b"_":
                        yield self.pickler.loads(value)
        else:
            yield from self.add_samples(samples)
