"""Stream filters: shuffling, selecting, mapping, renaming, tupling, batching, decoding.

Each ``_name(data, ...)`` is a generator over a stream of samples; the public
``name(...)`` is its curried stage (see :mod:`wds_cloud.stages`).  Every filter
that calls user code takes ``handler=`` (see :mod:`wds_cloud.handlers`).
"""

from __future__ import annotations

import fnmatch
from array import array
import io
import itertools
import logging
import random
import re
import sys
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

from .handlers import reraise_exception
from .stages import FilterFunction, PipelineStage, RestCurried, compose, pipeline, pipelinefilter
from .utils import make_seed

__all__ = [
    "FilterFunction", "RestCurried", "PipelineStage", "pipelinefilter", "compose", "pipeline", "getfirst",
    "transform_with", "identity", "info", "shuffle", "Shuffle", "detshuffle", "select", "log_keys", "decode", "map",
    "rename", "associate", "map_dict", "to_tuple", "map_tuple", "unlisted", "unbatched", "rsample", "slice",
    "extract_keys", "rename_keys", "xdecode", "batched", "default_collation_fn", "default_decoders",
    "find_decoder", "Cached", "LMDBCached", "reraise_exception",
]

log = logging.getLogger("wds_cloud.filters")


def identity(x: Any) -> Any:
    return x


def getfirst(a: dict, keys: Any, default: Any = None, missing_is_error: bool = True) -> Any:
    """The value of the first of ``keys`` (a list, or a string of alternatives joined by ``;``) in ``a``."""
    if isinstance(keys, str):
        keys = keys.split(";")
    for k in keys:
        if k in a:
            return a[k]
    if missing_is_error:
        raise ValueError(f"none of the fields {list(keys)} is in sample {a.get('__key__')!r} "
                         f"(fields present: {sorted(k for k in a if not k.startswith('__'))})")
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


def _info(data: Iterable, fmt: Optional[str] = None, n: int = 3, every: int = -1, width: int = 50,
          stream: Any = None, name: str = "") -> Iterator:
    """Pass samples through, printing a short description of the first ``n`` and then every ``every``-th."""
    stream = stream or sys.stderr
    for i, sample in enumerate(data):
        if i < n or (every > 0 and (i + 1) % every == 0):
            if fmt is None:
                print("---", name, file=stream)
                for k, v in (sample.items() if isinstance(sample, dict) else enumerate(sample)):
                    print(k, repr(v)[:width], file=stream)
            else:
                print(fmt.format(**sample), file=stream)
        yield sample


info = pipelinefilter(_info)


def _shuffle(data: Iterable, bufsize: int = 1000, initial: int = 100, rng: Optional[random.Random] = None,
             handler: Any = None, seed: Optional[int] = None) -> Iterator:
    """Shuffle through a buffer of ``bufsize`` samples, starting once ``initial`` are buffered."""
    return Shuffle(bufsize, initial, rng=rng, seed=seed).run(data)


class _ShuffleRun:
    """The live part of one pass of a :class:`Shuffle`: its buffer, where each buffered sample came from, its RNG."""

    __slots__ = ("buf", "locs", "urls", "counts", "rng", "tracked", "journal", "run_id", "journaled", "urls_list")

    def __init__(self, rng: Any) -> None:
        self.buf: list = []
        self.locs: list = []  # (shard ref, first block, blocks) of each buffered sample, in buffer order
        self.urls: dict = {}  # shard ref -> (url, compressed), for the refs in the buffer
        self.counts: dict = {}  # shard ref -> buffered samples from it
        self.rng = rng
        self.tracked = False
        self.journal: Optional[list] = None  # buffer changes since the last delta (see Shuffle._fast_state)
        self.run_id = id(self)
        self.journaled = 0  # journal entries sent since the whole buffer was last sent
        self.urls_list: Optional[list] = None  # ``urls`` as the state lists them, kept while unchanged


class Shuffle(PipelineStage):
    """Shuffle through a buffer of ``bufsize`` samples, starting once ``initial`` are buffered.

    Resumable: when a shard reader feeds it (``source``, wired by ``DataPipeline``),
    the state records the RNG (:class:`~wds_cloud.resume.CountedRandom`: two integers)
    and, for each buffered sample, the shard and byte range it came from; a
    resumed pass gets the same samples back from the reader and puts them in
    the same buffer positions.  ``rng`` (a ``random.Random``) is honoured;
    its state is then saved whole.  Without ``seed`` or ``rng`` each pass draws
    a fresh seed.  ``epoch_seeded=True`` (``detshuffle``) seeds each pass from
    (``seed``, epoch).
    """

    def __init__(self, bufsize: int = 1000, initial: int = 100, rng: Optional[random.Random] = None,
                 handler: Any = None, seed: Any = None, epoch_seeded: bool = False, epoch: int = -1) -> None:
        self.bufsize = bufsize
        self.initial = min(initial, bufsize)
        self.rng = rng
        self.seed = int(seed) if isinstance(seed, str) and seed.strip().lstrip("-").isdigit() else seed
        self.epoch_seeded = epoch_seeded
        self.epoch = epoch
        self.source: Any = None  # the TarSamples reader feeding this shuffle (set by DataPipeline)
        self._live: Optional[_ShuffleRun] = None
        self._resume: Optional[dict] = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch - 1  # run() advances before use

    def _make_rng(self) -> Any:
        from .resume import CountedRandom

        if self.rng is not None:
            return self.rng
        if self.epoch_seeded:
            return CountedRandom(make_seed(self.seed, self.epoch))
        return CountedRandom(self.seed)

    def run(self, src: Iterable) -> Iterator:
        resume, self._resume = self._resume, None
        if resume is not None and "epoch" in resume:
            self.epoch = resume["epoch"]
        elif self.epoch_seeded:
            self.epoch += 1
        live = _ShuffleRun(self._make_rng())
        self._live = live
        return self._shuffle(src, live, resume)

    def _shuffle(self, src: Iterable, live: _ShuffleRun, resume: Optional[dict]) -> Iterator:
        buf, locs, urls, counts = live.buf, live.locs, live.urls, live.counts
        cursor = getattr(self.source, "cursor", None)
        live.tracked = cursor is not None
        rng = live.rng
        randbelow = getattr(rng, "randbelow", None) or (lambda n: rng.randint(0, n - 1))
        bufsize, initial = self.bufsize, self.initial

        def add(sample: Any) -> None:
            buf.append(sample)
            if cursor is not None:
                ref = cursor.shard
                if ref in counts:
                    counts[ref] += 1
                else:
                    counts[ref] = 1
                    urls[ref] = (cursor.url, cursor.compressed)
                where = cursor.where
                start = where[0]
                loc = (ref, start >> 9, (where[1] - start) >> 9)  # tar offsets are in 512-byte blocks
                locs.append(loc)
                if live.journal is not None:
                    live.journal.append(loc)

        def pick() -> Any:
            k = randbelow(len(buf))
            buf[k], buf[-1] = buf[-1], buf[k]
            if cursor is not None:
                locs[k], locs[-1] = locs[-1], locs[k]
                ref = locs.pop()[0]
                counts[ref] -= 1
                if not counts[ref]:
                    del counts[ref], urls[ref]
                if live.journal is not None:
                    live.journal.append((~k,))
            return buf.pop()

        it = iter(src)
        if resume is not None:
            from .resume import StateMismatchError

            for _ in range(len(resume.get("buffer") or ())):
                try:
                    add(next(it))
                except StopIteration:
                    raise StateMismatchError("the shuffle buffer could not be refilled on resume: the stages "
                                             "between the shard reader and the shuffle dropped samples") from None
            if "rng" in resume:
                if isinstance(rng, random.Random):
                    version, internal, gauss = resume["rng"]
                    rng.setstate((version, tuple(internal), gauss))
                else:
                    rng.setstate(resume["rng"])
        for sample in it:
            add(sample)
            if len(buf) < bufsize:
                try:
                    add(next(it))  # grow the buffer while consuming
                except StopIteration:
                    pass
            if len(buf) >= initial:
                yield pick()
        while buf:
            yield pick()

    def _config(self) -> dict:
        return {"bufsize": self.bufsize, "initial": self.initial}

    def state_dict(self) -> dict:
        """The RNG and, for each buffered sample, ``[shard ref, first block, blocks]``: plain JSON.

        Positions are in 512-byte tar blocks (``"block": 512``); ``"urls"`` maps shard refs to URLs.
        """
        if self._resume is not None:  # loaded, not yet iterated: still that state
            return dict(self._resume)
        live = self._live
        if live is None:
            return {"fresh": True, "config": self._config()}
        state = self._head(live)
        state["urls"] = [list(entry) for entry in state["urls"]]  # the live list is shared with _fast_state
        state["buffer"] = list(live.locs)  # tuples: JSON arrays
        return state

    def _head(self, live: _ShuffleRun) -> dict:
        if live.buf and not live.tracked:
            from .errors import StateMismatchError

            raise StateMismatchError(
                "this shuffle is not fed by a shard reader of the same pipeline, so the samples in its buffer "
                "cannot be fetched again on resume; shuffle inside the dataset (WebDataset(...).shuffle(n)), "
                "or take the state where the buffer is empty")
        rng = live.rng.getstate()
        urls = live.urls
        cached = live.urls_list
        if cached is None or len(cached) != len(urls) or any(entry[0] not in urls for entry in cached):
            from .resume import shown_url, url_id

            # redacted, with a hash to match them by: no credential ever reaches a checkpoint
            cached = live.urls_list = [[ref, shown_url(url), compressed, url_id(url)]
                                       for ref, (url, compressed) in urls.items()]
        state = {"config": self._config(), "rng": list(rng) if not isinstance(rng, list) else rng,
                 "urls": cached, "block": 512}
        if self.epoch_seeded:
            state["epoch"] = self.epoch
        return state

    def _fast_state(self) -> dict:
        """The state as a delta, for a loader that sends one with every batch (see ``compat.WebLoader``).

        The first call of a pass sends the whole buffer (``"buffer"``) and starts a journal;
        later calls send only the journal (``"journal"``: the changes since, in order), which
        :func:`apply_journal` replays onto the previous buffer.  Both are flat integer arrays
        (``array("q")``), which cost a copy of their bytes to pickle where lists of tuples
        cost a call per element: a locations is its three integers, a pick of buffer index
        ``k`` is ``~k`` (negative).
        """
        if self._resume is not None or self._live is None:
            return self.state_dict()
        live = self._live
        state = self._head(live)
        state["run"] = live.run_id
        journal = live.journal
        if journal is None or live.journaled + len(journal) > 8 * len(live.locs) + 1024:
            # the whole buffer again once the journals would outgrow it: what the loader keeps stays bounded
            state["buffer"] = array("q", itertools.chain.from_iterable(live.locs))
            live.journaled = 0
        else:
            # flattened in C: a location is its three integers, a pick of index k the one integer ~k
            state["journal"] = array("q", itertools.chain.from_iterable(journal))
            live.journaled += len(journal)
        live.journal = []
        return state

    def _next_pass_state(self) -> dict:
        if self._resume is not None:
            return dict(self._resume)
        state = {"fresh": True, "config": self._config()}
        if self.epoch_seeded:
            state["epoch"] = self.epoch + 1
        return state

    def load_state_dict(self, state: dict) -> None:
        from .resume import StateMismatchError, check_same, expect

        expect(state, "shuffle", dict, config=dict)
        check_same("shuffle", state.get("config") or {}, self._config())
        if not state.get("fresh"):
            expect(state, "shuffle", dict, rng=list, urls=list, block=(int, lambda v: v == 512, True),
                   buffer=(list, lambda v: len(v) <= self.bufsize), epoch=(int, None, True))
            refs = set()
            for entry in state["urls"]:
                if not (isinstance(entry, list) and len(entry) in (3, 4) and type(entry[0]) is int
                        and isinstance(entry[1], str) and (len(entry) == 3 or isinstance(entry[3], str))):
                    raise StateMismatchError(f"the saved shuffle state's 'urls' holds {entry!r:.80}, which no "
                                             "state_dict() gives: the state was changed", field="urls")
                refs.add(entry[0])
            for entry in state["buffer"]:
                if not (isinstance(entry, (list, tuple)) and len(entry) == 3
                        and all(type(v) is int and v >= 0 for v in entry) and entry[0] in refs and entry[2] > 0):
                    raise StateMismatchError(f"the saved shuffle state's 'buffer' holds {entry!r:.80}, which no "
                                             "state_dict() gives: the state was changed", field="buffer")
        self._resume = None if state.get("fresh") else state
        if state.get("fresh") and "epoch" in state:
            self.epoch = state["epoch"] - 1  # run() advances before use

    def replay_locations(self, state: dict) -> list:
        """``(url, start, end, compressed, ref)`` of the buffered samples of ``state``, in buffer order."""
        if state.get("fresh"):
            return []
        from .resume import StateURL

        urls = {entry[0]: (StateURL(entry[1], entry[3] if len(entry) > 3 else None), entry[2])
                for entry in state.get("urls") or ()}
        block = state.get("block", 512)
        out = []
        for ref, first, blocks in state.get("buffer") or ():
            url, compressed = urls[ref]
            out.append((url, first * block, (first + blocks) * block, bool(compressed), ref))
        return out


def apply_journal(buffer: list, journal: Any) -> list:
    """Replay a :meth:`Shuffle._fast_state` journal onto ``buffer`` (a list of location tuples, in place)."""
    out = buffer
    i, n = 0, len(journal)
    while i < n:
        op = journal[i]
        if op < 0:
            k = ~op
            out[k] = out[-1]
            out.pop()
            i += 1
        else:
            out.append((op, journal[i + 1], journal[i + 2]))
            i += 3
    return out


def buffer_locations(flat: Any) -> list:
    """The location tuples of a buffer sent flat (``array("q")`` of three integers each)."""
    if not isinstance(flat, array):
        return list(flat)
    return list(zip(flat[0::3], flat[1::3], flat[2::3]))


def shuffle(bufsize: int = 1000, initial: int = 100, rng: Optional[random.Random] = None, handler: Any = None,
            seed: Optional[int] = None) -> Shuffle:
    """The shuffle stage: a buffer of ``bufsize`` samples, output starting once ``initial`` are in."""
    return Shuffle(bufsize, initial, rng=rng, handler=handler, seed=seed)


class detshuffle(Shuffle):
    """Deterministic shuffle: the order is a function of (seed, epoch); the epoch advances each run.

    Unlike webdataset, a seed given as text (``WDS_SEED``) is accepted.
    """

    def __init__(self, bufsize: int = 1000, initial: int = 100, seed: Any = 0, epoch: int = -1) -> None:
        super().__init__(bufsize, initial, seed=seed, epoch_seeded=True, epoch=epoch)


def _select(data: Iterable, predicate: Callable) -> Iterator:
    """Keep the samples for which ``predicate(sample)`` is true."""
    for sample in data:
        if predicate(sample):
            yield sample


select = pipelinefilter(_select)


def _log_keys(data: Iterable, logfile: Optional[str] = None) -> Iterator:
    """Append each sample's ``__url__`` and ``__key__`` to ``logfile`` (or the debug log)."""
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
    """Decode each sample's fields with a :class:`Decoder` built from ``args``."""
    from .autodecode import Decoder

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
    """``f(sample)`` for each sample; None drops the sample; a dict result keeps ``__key__``."""
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


def _rename(data: Iterable, handler: Callable = reraise_exception, keep: bool = True, **kw: str) -> Iterator:
    """Rename fields: ``rename(image="jpg;png")`` takes the first of jpg/png as ``image``."""
    for sample in data:
        try:
            used = set()
            result = {}
            for new, old in kw.items():
                for alternative in old.split(";"):
                    if alternative in sample:
                        result[new] = sample[alternative]
                        used.add(alternative)
                        break
                else:
                    raise ValueError(f"rename: sample {sample.get('__key__')!r} has none of {old!r} "
                                     f"(fields: {sorted(k for k in sample if not k.startswith('__'))})")
            for k, v in sample.items():
                if k.startswith("__") or (keep and k not in used and k not in result):
                    result.setdefault(k, v)
        except Exception as exn:
            if handler(exn):
                continue
            break
        yield result


rename = pipelinefilter(_rename)


def _associate(data: Iterable, associator: Any, **kw: Any) -> Iterator:
    """Merge extra fields into each sample: from a dict keyed by ``__key__``, or ``associator(key)``."""
    for sample in data:
        extra = associator(sample["__key__"]) if callable(associator) else associator.get(sample["__key__"])
        if extra:
            sample.update(extra)
        yield sample


associate = pipelinefilter(_associate)


def _map_dict(data: Iterable, handler: Callable = reraise_exception, **kw: Callable) -> Iterator:
    """Apply ``kw[field]`` to each named field."""
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


def _to_tuple(data: Iterable, *args: str, handler: Callable = reraise_exception, missing_is_error: bool = True,
              none_is_error: Optional[bool] = None) -> Iterator:
    """Turn dict samples into tuples of the named fields (``"jpg;png cls"`` or ``"jpg;png", "cls"``)."""
    if none_is_error is None:
        none_is_error = missing_is_error
    if len(args) == 1 and isinstance(args[0], str) and " " in args[0]:
        args = tuple(args[0].split())
    fields = [a.split(";") for a in args]
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
    """Apply ``args[i]`` to element i of each tuple sample."""
    for sample in data:
        try:
            result = transform_with(sample, list(args))
        except Exception as exn:
            if handler(exn):
                continue
            break
        yield result


map_tuple = pipelinefilter(_map_tuple)


def _unlisted(data: Iterable) -> Iterator:
    """Flatten a stream of lists."""
    for batch in data:
        if not isinstance(batch, list):
            raise TypeError(f"unlisted expects lists, got {type(batch).__name__}")
        yield from batch


unlisted = pipelinefilter(_unlisted)


def _unbatched(data: Iterable) -> Iterator:
    """Split batches (tuples/lists of columns, or dicts of columns) back into samples."""
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


unbatched = pipelinefilter(_unbatched)


def _rsample(data: Iterable, p: float = 0.5, seed: Optional[int] = None) -> Iterator:
    """Keep each sample with probability ``p``."""
    rng = random.Random(seed)
    for sample in data:
        if rng.random() < p:
            yield sample


rsample = pipelinefilter(_rsample)


def _slice(data: Iterable, *args: Any) -> Iterator:
    """``itertools.islice`` as a stage."""
    return itertools.islice(data, *args)


slice = pipelinefilter(_slice)


def _extract_keys(source: Iterable, *patterns: Any, duplicate_is_error: bool = True,
                  ignore_missing: bool = False) -> Iterator:
    """A tuple per sample: for each pattern, the value of the field it matches.

    A pattern is a ``;``-separated string of glob alternatives, or a list/tuple of them; an
    alternative matches a key itself or ``"." + key`` (so ``"*.jpg"`` and ``"jpg"`` both match
    ``jpg``).  Every key is a candidate, ``__key__`` and ``__url__`` included.  No match is a
    ``ValueError`` unless ``ignore_missing`` (then the pattern is left out of the tuple); several
    matches are one when ``duplicate_is_error``, else the first in the sample's order wins.
    """
    alternatives = [p.split(";") if isinstance(p, str) else list(p) for p in patterns]
    for sample in source:
        result = []
        for pattern, alts in zip(patterns, alternatives):
            matches = [v for k, v in sample.items()
                       if any(fnmatch.fnmatchcase(k, alt) or fnmatch.fnmatchcase("." + k, alt) for alt in alts)]
            if not matches:
                if ignore_missing:
                    continue
                raise ValueError(f"extract_keys: no key of sample {sample.get('__key__')!r} matches {pattern!r} "
                                 f"(keys: {list(sample)}); pass ignore_missing=True to leave it out")
            if len(matches) > 1 and duplicate_is_error:
                raise ValueError(f"extract_keys: {len(matches)} keys of sample {sample.get('__key__')!r} match "
                                 f"{pattern!r}; pass duplicate_is_error=False to take the first")
            result.append(matches[0])
        yield tuple(result)


extract_keys = pipelinefilter(_extract_keys)


def _rename_keys(source: Iterable, *args: tuple, keep_unselected: bool = False, must_match: bool = True,
                 duplicate_is_error: bool = True, **kw: str) -> Iterator:
    """Rename fields by glob pattern: ``rename_keys(image="*.jpg", ("label", "*.cls"))``."""
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
                        raise ValueError(f"rename_keys: {path!r} and another field both become {new!r} "
                                         f"in sample {sample.get('__key__')!r}")
                    new_sample[new] = value
                    matched[new] = True
                    break
            else:
                if keep_unselected:
                    new_sample[path] = value
        if must_match and not all(matched.values()):
            missing = [k for k, v in matched.items() if not v]
            raise ValueError(f"rename_keys: no field of sample {sample.get('__key__')!r} for {missing} "
                             f"(fields: {sorted(k for k in sample if not k.startswith('__'))})")
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


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _int(data: bytes) -> int:
    return int(data)


def _bgr8(data: bytes) -> Any:
    from . import autodecode as ad

    return ad.imagehandler("rgb8")("png", data)[..., ::-1]


def _default_decoders() -> list:
    from . import autodecode as ad

    return [(patterns, _Bytes(fn)) for patterns, fn in (
        ("*.bgr8.png *.bgr8.jpg *.bgr8.jpeg", _bgr8),
        ("*.jpg *.jpeg *.png *.ppm *.pgm *.pbm *.pnm *.tif *.tiff *.webp *.bmp", ad.imagehandler("rgb8").decode_any),
        ("*.txt *.text *.transcript", _text),
        ("*.cls *.cls2 *.class *.count *.index *.inx *.id", _int),
        ("*.json *.jsn", ad.json_loads),
        ("*.npy", ad.npy_loads),
        ("*.npz", ad.npz_loads),
        ("*.ten *.tb", ad.tenbin_loads),
        ("*.mp *.msgpack *.msg", ad.msgpack_loads),
        ("*.cbor", ad.cbor_loads),
        ("*.pyd *.pickle *.pkl", ad.unpickle_loads),
        ("*.pth", ad.torch_loads),
    )]


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


def _xdecode(source: Iterable, *args: tuple, must_decode: bool = True, defaults: Any = default_decoders,
             **kw: Callable) -> Iterator:
    """Decode fields by glob pattern: ``xdecode(("*.jpg", fn), png=fn2)``; honours WDS_SECURE and pickle rules.

    A decoder receives a stream (bytes values wrapped in ``io.BytesIO``); a value that is not
    bytes is passed as it is.  Keyword decoders come first, then the positional pairs, later
    ones before earlier ones, then ``defaults``.  ``must_decode`` makes a field without a
    decoder an error.
    """
    from .autodecode import refuse_if_unsafe

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
                    raise ValueError(f"xdecode: no decoder for field {path!r} of sample {sample.get('__key__')!r}; "
                                     "pass one, or must_decode=False")
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
        return {k: _collate_column([s[k] for s in samples], combine_tensors, combine_scalars) for k in keys}
    if not isinstance(first, (list, tuple)):
        raise TypeError(f"default_collation_fn batches tuples, lists or dicts, not {type(first).__name__}")
    columns = list(zip(*samples))
    return tuple(_collate_column(list(c), combine_tensors, combine_scalars) for c in columns)


def _collate_column(column: list, combine_tensors: bool, combine_scalars: bool) -> Any:
    first = column[0]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return np.array(column) if combine_scalars else column
    if isinstance(first, np.ndarray):
        return np.stack(column) if combine_tensors else column
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(first, torch.Tensor):
        return torch.stack(column) if combine_tensors else column
    return column


def _batched(data: Iterable, batchsize: int = 20, collation_fn: Optional[Callable] = default_collation_fn,
             partial: bool = True) -> Iterator:
    """Group samples into batches of ``batchsize``; ``partial=False`` drops a short last batch."""
    batch: list = []
    for sample in data:
        batch.append(sample)
        if len(batch) >= batchsize:
            yield collation_fn(batch) if collation_fn is not None else batch
            batch = []
    if batch and partial:
        yield collation_fn(batch) if collation_fn is not None else batch


batched = pipelinefilter(_batched)


class Cached(PipelineStage):
    """Keep the samples of the first pass in memory and replay them on later passes."""

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
        from .autodecode import _security_enforced
        from .errors import MissingExtraError, SecurityError

        if _security_enforced():
            raise SecurityError("LMDBCached stores samples with pickle and is refused under WDS_SECURE=1")
        try:
            import lmdb
        except ImportError:
            raise MissingExtraError("LMDBCached needs the lmdb module: pip install lmdb") from None
        import pickle

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

