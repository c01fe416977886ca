"""Shard lists: from a spec like ``data-{000..099}.tar::extra-{0..9}.tar`` to ``{"url": ...}`` items.

Also the splitters that give each node and DataLoader worker its share of the
shards, and resampling (shards drawn with replacement, forever).
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import functools
import hashlib
import logging
import numbers
import os
import random
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, Optional, Union

from . import config, utils
from .errors import ConfigError, MalformedDataError, redact
from .io import datafile
from .io.descriptions import ShardRows, read_json_spec
from .io.security import UntrustedURL, resolve, resolve_base
from .pytorch import IterableDataset
from .resume.elastic import shard_order
from .resume.state import check_same, expect
from .stages import PassHolder, PipelineStage, pipelinefilter
from .utils import is_iterable, obsolete

__all__ = [
    "IterableDataset",
    "is_iterable",
    "obsolete",
    "envlookup",
    "default_rng",
    "MSSource",
    "check_pid_is_running",
    "get_pid_from_filename",
    "without_last_extension",
    "envsubst",
    "expand_urls",
    "expand_source",
    "SimpleShardList",
    "ResampledShards",
    "ResampledShardList",
    "MultiShardSample",
    "DirectoryShardList",
    "split_by_node",
    "split_by_worker",
    "single_node_only",
    "non_empty",
    "resampled",
    "resampled_",
    "shardspec",
    "Share",
    "cleanup_files_without_processes",
    "shard_order",
    "index_counts",
    "slot_shards",
    "read_spec_file",
]

log = logging.getLogger(__name__)

_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def envsubst(s: str, settings: Optional[config.Settings] = None) -> str:
    """Replace ``${NAME}`` (and ``$NAME``) with the value of ``WDS_NAME``; unknown names stay as written."""
    if "$" not in s:
        return s
    values = dict((settings or config.current()).template_vars)

    def replace(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return values.get(name, m.group(0))

    return _VAR.sub(replace, s)


def envlookup(m: re.Match, settings: Optional[config.Settings] = None) -> str:
    """The value of ``WDS_<name>`` for a match whose first group is the name (webdataset's helper of
    :func:`envsubst`); a name that is not set is refused naming the variable."""
    values = dict((settings or config.current()).template_vars)
    if m.group(1) not in values:
        raise ConfigError(f"WDS_{m.group(1)} is not set; set it, or write the URL without ${{{m.group(1)}}}")
    return values[m.group(1)]


#: the most shard URLs one spec read from data may expand to (a brace range is a claim too)
MAX_DATA_URLS = 1_000_000


def _too_many_given(spec: str, n: int) -> Exception:
    return ConfigError(
        f"the shard spec {redact(spec)[:80]!r} expands to {n:,} URLs, more than {utils.MAX_BRACE_NAMES:,}: "
        "check its brace range, or split the dataset into smaller specs"
    )


def _too_many_read(spec: str, limit: int, where: str, n: int) -> Exception:
    return MalformedDataError(
        f"{redact(where) or '<spec>'}: the shard spec {redact(spec)[:80]!r} names {n:,} URLs, more than {limit:,}; "
        "split the dataset into smaller specs",
        field="urls",
    )


def expand_urls(urls: Union[str, Iterable[str]], limit: Optional[int] = None, where: str = "") -> list[str]:
    """Expand ``::``-joined specs, ``${NAME}`` and brace ranges into a list of URLs.

    ``limit``: the most URLs accepted (a spec read from data: its ranges are expanded no further than that,
    and more is a :class:`~wds_cloud.errors.MalformedDataError` naming ``where``).
    """
    if isinstance(urls, str):
        result: list[str] = []
        for spec in urls.split("::"):
            spec = envsubst(spec)
            if limit is None:  # a spec of the user's: bounded too (a range's names are built before the first)
                result.extend(
                    utils.expand_braces(
                        spec,
                        refuse=functools.partial(_too_many_given, spec),
                    )
                )
                continue
            result.extend(
                islice(
                    utils.expand_braces(
                        spec,
                        limit,
                        refuse=functools.partial(_too_many_read, spec, limit, where),
                    ),
                    limit + 1 - len(result),
                )
            )
            if len(result) > limit:
                raise MalformedDataError(
                    f"{redact(where) or '<spec>'}: the shard spec {spec[:80]!r} names more than "
                    f"{limit} URLs; split the dataset into smaller specs",
                    field="urls",
                )
        return result
    out: list[str] = []
    for url in urls:
        more = (
            expand_urls(url, limit, where)
            if isinstance(url, str) and ("{" in url or "::" in url or "$" in url)
            else [url]
        )
        out.extend(more)
        if limit is not None and len(out) > limit:
            raise MalformedDataError(
                f"{redact(where) or '<spec>'}: the spec names more than {limit} URLs; split the "
                "dataset into smaller specs",
                field="urls",
            )
    return out


#: the names of dataset spec files (a wids description, one document or one shard a line; a YAML spec), gzipped or not
_SPEC_FILE = re.compile(r"\.(json|jsonl|ya?ml)(\.gz)?$")


def is_spec_file(source: Any) -> bool:
    """Whether ``source`` names a dataset spec file rather than shards: the one rule, for every reader."""
    return isinstance(source, str) and _SPEC_FILE.search(source) is not None


def expand_source(source: Any, max_urls: int = int(1e9)) -> list[str]:
    """The URLs a dataset source names: a spec string, a list of URLs, or a ``.json``/``.yaml`` spec file."""
    if isinstance(source, (list, tuple)):
        return expand_urls(list(source))[:max_urls]
    if isinstance(source, str):
        if is_spec_file(source):
            return _spec_file_urls(source)[:max_urls]
        return expand_urls(source)[:max_urls]
    if isinstance(source, dict):
        return _spec_urls(source, "")[:max_urls]
    raise TypeError(f"cannot expand a shard source of type {type(source).__name__}: give a spec string or a list")


def _spec_file_urls(url: str) -> list[str]:
    """Read a dataset description (wids-style JSON index, or YAML) and return its shard URLs.

    The URLs come from data, so any ``pipe:`` among them is untrusted.
    """
    return _spec_urls(read_spec_file(url), url)


def read_spec_file(url: str, storage_options: Optional[dict] = None, fmt: Optional[str] = None) -> Any:
    """The parsed content of a ``.yaml``/``.yml``/``.json`` file at ``url`` (any URL), read as data: bounded in
    size and depth, a :class:`~wds_cloud.errors.MalformedDataError` naming the file when it is not one.  The
    one reader of dataset spec files: ``WebDataset`` reads a spec once and hands the content on.  A wids
    description of one shard a line (:mod:`wds_cloud.io.descriptions`) is its header's fields, ``"shardlist"``
    read as a stream when iterated."""
    if (fmt or ("yaml" if re.search(r"\.ya?ml(\.gz)?$", url) else "json")) == "yaml":
        return datafile.load(url, "dataset spec", storage_options, fmt="yaml")
    return read_json_spec(url, storage_options)


def index_counts(source: Any) -> Optional[dict]:
    """``{url: nsamples}`` from a wids-style JSON index (a path or URL ending in ``.json``, or its dict), else None.

    Only an index whose every entry gives ``nsamples`` counts; URLs are resolved as
    :func:`expand_source` resolves them.
    """
    if isinstance(source, str) and source.endswith((".json", ".jsonl")):
        spec = read_json_spec(source, None, "dataset description")
        where = source
    elif isinstance(source, dict):
        spec, where = source, ""
    else:
        return None
    entries = spec.get("shardlist") if isinstance(spec, dict) else None
    if isinstance(entries, ShardRows):  # one shard a line, every row checked: one pass over the file
        base = resolve_base(spec["base"], where) if spec.get("base") is not None else None
        return {str(resolve(row["url"], where, base=base)): row["nsamples"] for row in entries}
    if (
        not isinstance(entries, list)
        or not entries
        or not all(isinstance(e, dict) and datafile.is_count(e.get("nsamples")) for e in entries)
    ):
        return None
    urls = _spec_urls({k: v for k, v in spec.items() if k in ("shardlist", "base")}, where)
    return {str(url): entry["nsamples"] for url, entry in zip(urls, entries)}


def _spec_urls(spec: Any, where: str) -> list[str]:
    """The shard URLs a parsed spec file names, each resolved by :func:`~wds_cloud.io.security.resolve` (relative
    to the file, untrusted, never out of its folder); ``where`` empty: a dict the program gave (trusted)."""
    shown = redact(where) if where else "<dict>"
    base: Optional[str] = None
    if isinstance(spec, dict) and "shardlist" in spec:  # wids index
        entries = spec["shardlist"]
        datafile.need(isinstance(entries, (list, ShardRows)), shown, "'shardlist'", "must be a list of shards")
        urls: list = []
        for i, e in enumerate(entries):
            u = e.get("url") if isinstance(e, dict) else e
            datafile.need(isinstance(u, str) and bool(u), shown, f"shardlist[{i}].url", "must be a URL or path")
            urls.append(u)
        if where and spec.get("base") is not None:
            base = resolve_base(spec["base"], where)
    elif isinstance(spec, dict) and "datasets" in spec:  # webdataset YAML spec
        urls = []
        datafile.need(isinstance(spec["datasets"], list), shown, "'datasets'", "must be a list")
        for i, ds in enumerate(spec["datasets"]):
            datafile.need(isinstance(ds, dict), shown, f"datasets[{i}]", "must be a mapping with 'shards'")
            buckets = ds.get("buckets", "")
            prefix = buckets[0] if isinstance(buckets, list) and buckets else buckets
            shards = ds.get("shards", [])
            shards = [shards] if isinstance(shards, str) else shards
            datafile.need(
                isinstance(prefix, str) and isinstance(shards, list) and all(isinstance(x, str) for x in shards),
                shown,
                f"datasets[{i}]",
                "needs 'shards' (strings) and 'buckets' (a string or a list of them)",
            )
            if where and prefix:  # a bucket is a base: resolved in one place, never a command
                folder = resolve_base(prefix, where, "buckets")
                for spec_text in shards:
                    urls.extend(resolve(u, where, base=folder) for u in expand_urls(spec_text, MAX_DATA_URLS, where))
                continue
            for spec_text in shards:
                urls.extend(
                    expand_urls(
                        prefix.rstrip("/") + "/" + spec_text if prefix else spec_text,
                        MAX_DATA_URLS if where else None,
                        where,
                    )
                )
    elif isinstance(spec, list):
        urls = list(spec)
    else:
        raise MalformedDataError(
            f"{shown}: not a dataset spec: expected a 'shardlist' (wids JSON) or 'datasets' (YAML)", url=where or None
        )
    if not where:
        return [str(u) if not isinstance(u, str) else u for u in urls]
    return [u if isinstance(u, UntrustedURL) else resolve(u, where, base=base) for u in urls]


def slot_shards(n: int, seed: Optional[int], epoch: int, world_size: int, num_workers: int) -> list[Sequence[int]]:
    """The shard indices each (rank, worker) slot reads in an epoch, slot ``rank * num_workers + worker``.

    What ``split_by_node`` then ``split_by_worker`` give out of the (seed, epoch) order
    (the listed order when ``seed`` is None); each a view of the order, computed as it is read.
    """
    order: Sequence[int] = shard_order(n, seed, epoch) if seed is not None else range(n)
    return [order[rank::world_size][worker::num_workers] for rank in range(world_size) for worker in range(num_workers)]


def shard_sequence(urls: Any, max_urls: Optional[int] = None) -> Sequence[str]:
    """The URLs a shard list's source names, as a sequence that costs little per URL in every process holding
    it: a brace spec's names computed when asked (:class:`~wds_cloud.utils.BraceNames`), a list of URLs
    packed into one buffer (:class:`~wds_cloud.utils.PackedStrings`); URLs of a spec file, which carry
    where they came from (:class:`~wds_cloud.io.security.UntrustedURL`), stay a list.  At most ``max_urls``."""
    if isinstance(urls, str) and not is_spec_file(urls):
        parts = [
            utils.expand_braces(envsubst(spec), refuse=functools.partial(_too_many_given, spec))
            for spec in urls.split("::")
        ]
        listed: Sequence[str] = parts[0] if len(parts) == 1 else utils.Chained(parts)
    else:
        given = expand_source(urls) if not isinstance(urls, list) else expand_urls(urls)
        listed = utils.PackedStrings(given) if all(type(u) is str for u in given) else given
    if max_urls is not None and len(listed) > max_urls:
        log.warning(
            "the shard source names %d URLs; max_urls=%d keeps the first %d: give a larger max_urls to draw from all",
            len(listed),
            max_urls,
            max_urls,
        )
        return listed[:max_urls]
    return listed


def _urls_digest(urls: Sequence[str]) -> str:
    """The SHA-256 of the URLs joined by newlines (a state's ``urls_sha256``), hashed a chunk at a time."""
    if isinstance(urls, utils.PackedStrings) and urls.plain:
        return hashlib.sha256(urls.data).hexdigest()[:16]
    digest = hashlib.sha256()
    names, separator = iter(urls), b""
    while chunk := list(islice(names, 4096)):
        digest.update(separator + "\n".join(chunk).encode("utf-8", "surrogateescape"))
        separator = b"\n"
    return digest.hexdigest()[:16]


class Share:
    """The shard items of one rank and worker's share of an epoch after an elastic resume: ``split_by_node``
    and ``split_by_worker`` pass them on whole (they were split already, see :mod:`wds_cloud.resume.elastic`)."""

    __slots__ = ("_items",)

    def __init__(self, items: Iterator[dict]) -> None:
        self._items = items

    def __iter__(self) -> Share:
        return self

    def __next__(self) -> dict:
        return next(self._items)


class _EpochClock:
    """Counts the passes of torch ``DataLoader``s over a dataset, across their worker processes.

    A ``DataLoader`` without persistent workers starts each epoch with fresh copies of the
    dataset as the main process holds it, so a counter kept in the copies never moves: every
    epoch would read the shards in the same order and every worker the same subset.  This
    clock is one shared 64-bit word made in the main process (inherited by forked workers,
    passed to spawned ones) holding a hash of the loader's base seed for the last pass and
    that pass's epoch.  The workers of a new pass (a new base seed) all compute the same new
    word from the old one, so they agree without a lock (a lock made for "fork" could not go
    to "spawn" workers), and a single aligned word is written whole.
    """

    def __init__(self) -> None:
        try:
            import multiprocessing  # here, not at the top: it can fail to import in sandboxes without shm

            self._shared: Any = multiprocessing.RawValue("q", 0)  # (seed hash << 32) | (epoch + 1)
        except Exception:  # no shared memory here (some sandboxes): set_epoch() still works
            self._shared = None

    def __getstate__(self) -> dict:
        from multiprocessing import context  # (see __init__)

        # Shared memory travels only to a process being started; any other pickle leaves it out.
        return {"shared": self._shared if context.get_spawning_popen() is not None else None}

    def __setstate__(self, state: dict) -> None:
        self._shared = state["shared"]

    def worker_epoch(self, local: int, explicit: Optional[int]) -> Optional[int]:
        """The epoch of this pass in a DataLoader worker (None outside one, or without shared memory)."""
        torch = sys.modules.get("torch")
        if self._shared is None or torch is None:
            return None
        info = torch.utils.data.get_worker_info()
        if info is None:
            return None
        base = info.seed - info.id  # the same for every worker of one pass, new for each pass
        tag = ((base ^ (base >> 31)) & 0x7FFFFFFF) or 1
        word = self._shared.value
        if explicit is not None:
            epoch = explicit
        elif word >> 32 == tag:  # another worker of this pass got here first
            return (word & 0xFFFFFFFF) - 1
        else:
            epoch = max((word & 0xFFFFFFFF) - 1, local) + 1
        self._shared.value = (tag << 32) | (epoch + 1)
        return epoch


class _Epochs(PassHolder):
    """Epoch bookkeeping of shard lists: ``set_epoch(n)`` fixes the next pass, else each pass advances.

    In DataLoader workers started afresh for every epoch, the pass count comes from an
    :class:`_EpochClock` shared with the main process, so the epoch advances there too.
    A pipeline holds a copy of its own (see :class:`~wds_cloud.stages.PassHolder`): its epochs count its own
    passes, and an elastic resume's share waits in it.
    """

    PASS_FIELDS = {"_current": None, "_ran": None}
    COPIED_FIELDS = ("_assigned",)
    #: the shard order of a pass is kept, not where the pass stands (the reader keeps that: see
    #: wds_cloud.resume.protocol)
    keeps_place = False

    epoch = -1
    _epoch_set = False
    urls: Sequence  # of the shard list using these epochs
    seed: Any

    def set_epoch(self, epoch: int) -> None:
        self._fix_epoch(epoch)
        for made in self.pipeline_copies():
            made.set_epoch(epoch)

    def _fix_epoch(self, epoch: int) -> None:
        """The epoch of the next pass (of this copy only: a state loaded or a share assigned is its own)."""
        self.epoch = epoch
        self._epoch_set = True

    def _start_clock(self) -> None:
        self._clock = _EpochClock()
        self._run_pid = os.getpid()

    def _next_epoch(self) -> int:
        explicit = self.epoch if self._epoch_set else None
        clock = self.__dict__.get("_clock")
        fresh_copy = self.__dict__.get("_run_pid") != os.getpid()  # first pass in this (worker) process
        self._run_pid = os.getpid()
        shared = clock.worker_epoch(self.epoch, explicit) if clock is not None and fresh_copy else None
        if explicit is None:
            self.epoch = shared if shared is not None else self.epoch + 1
        self._epoch_set = False
        self._ran = self.epoch  # what this pass's states record, whatever set_epoch() says for the next one
        return self.epoch

    def _last_epoch(self) -> int:
        """The epoch of the most recent pass (before any: the epoch set for the first)."""
        ran = self.__dict__.get("_ran")
        return ran if ran is not None else self.epoch

    def _config(self) -> dict:
        key = (len(self.urls), self.seed)
        cached = self.__dict__.get("_config_cache")
        if cached is None or cached[0] != key:  # hashing every URL on every state_dict() would cost
            digest = _urls_digest(self.urls)
            cached = self._config_cache = (
                key,
                {"shards": len(self.urls), "urls_sha256": digest, "seed": self.seed, "kind": type(self).__name__},
            )
        return dict(cached[1])

    def shard_urls(self) -> dict:
        """The shard URLs by text: those a state's buffered samples may name (see
        :func:`~wds_cloud.resume.wiring.shard_urls`)."""
        return {str(u): u for u in self.urls}

    def state_dict(self) -> dict:
        """The epoch of the most recent pass (the order of the shards follows from it) and, after an elastic
        resume, this rank and worker's share of that epoch (``"assigned"``)."""
        state = {"epoch": self._last_epoch(), "config": self._config()}
        record = self._share_record()
        if record is not None:
            state["assigned"] = record
        return state

    def _share_record(self) -> Optional[dict]:
        pending = self.__dict__.get("_assigned")
        if pending is not None:
            return pending[0]
        current = self.__dict__.get("_current")
        return current if current is not None and current.get("epoch") == self._last_epoch() else None

    def transport_state(self) -> dict:
        """:meth:`state_dict`, made once per epoch (a loader asks for it with every batch; it is not changed)."""
        cached = self.__dict__.get("_fast_cache")
        key = (self._last_epoch(), id(self._share_record()))
        if cached is None or cached[0] != key:
            cached = self._fast_cache = (key, self.state_dict())
        return cached[1]

    def assign(self, record: dict, items: list) -> None:
        """Make the next pass yield ``items`` (this rank and worker's share of epoch ``record["epoch"]`` after an
        elastic resume, see :mod:`wds_cloud.resume.elastic`) instead of its split of the epoch's order; the
        splitters pass them on whole."""
        self._assigned = (record, items)
        self._fix_epoch(record["epoch"])

    def _take_share(self) -> Optional[tuple]:
        """The share assigned for this pass (recorded for its states), or None: a pass of the whole order."""
        assigned = self.__dict__.get("_assigned")
        self.__dict__["_assigned"] = None
        self._current = assigned[0] if assigned is not None else None
        return assigned

    def next_pass_state(self) -> dict:
        return {"epoch": self.epoch if self._epoch_set else self.epoch + 1, "config": self._config()}

    def load_state_dict(self, state: dict) -> None:
        expect(state, "shard list", dict, epoch=(int, lambda v: v >= -1), config=dict)
        check_same("shard list", state.get("config") or {}, self._config())
        # -1: taken before any pass, so the pass it starts is the first (epoch 0), whatever passes this list ran
        self._fix_epoch(max(state["epoch"], 0))


class SimpleShardList(_Epochs, PipelineStage):
    """The URLs of a spec, in order, or shuffled per epoch when ``seed`` is given."""

    def __init__(self, urls: Any, seed: Optional[int] = None) -> None:
        self.urls = shard_sequence(urls)
        if not self.urls:
            raise ValueError(f"the shard spec {urls!r} names no shards")
        self.seed = seed
        self._start_clock()

    def __len__(self) -> int:
        return len(self.urls)

    def run(self) -> Iterator[dict]:
        assigned = self._take_share()
        if assigned is not None:
            return Share(self._shared_pass(assigned[1]))
        return self._pass()

    def _shared_pass(self, items: list) -> Iterator[dict]:
        self._next_epoch()
        yield from items

    def _pass(self) -> ShardPass:
        return ShardPass(self.urls, self._order, range(len(self.urls)))

    def _order(self) -> Sequence[int]:
        """The order of the pass that begins (called when its first shard is asked for)."""
        self._next_epoch()
        if self.seed is None:
            return range(len(self.urls))
        if config.current().show_seed:
            log.info("shard order of %d shards seeded with %d (epoch %d)", len(self.urls), self.seed, self.epoch)
        return shard_order(len(self.urls), self.seed, self.epoch)

    def __iter__(self) -> Iterator[dict]:
        return self.run()

    def __call__(self, src: Any = None) -> Iterator[dict]:
        return self.run()


class ShardPass:
    """One pass of a :class:`SimpleShardList`: ``{"url": ...}`` of the URLs at ``positions`` of the pass's order
    (``begin()`` gives it when the first is asked for: the epoch advances then, as a generator's would).

    :meth:`split` is how ``split_by_node`` and ``split_by_worker`` take their share: a stride over the
    positions, decided when the pass begins (as a generator asks who it runs in at its first item), so a
    worker of 4,096 x 8 walks its own 1/32,768 of the order, not all of it.
    """

    __slots__ = ("_urls", "_begin", "_order", "_positions", "_given", "_splits")

    def __init__(
        self,
        urls: Sequence[str],
        begin: Callable[[], Sequence[int]],
        positions: range,
        splits: tuple = (),
    ) -> None:
        self._urls = urls
        self._begin = begin
        self._order: Optional[Sequence[int]] = None  # (None until the pass begins)
        self._positions = positions
        self._given = 0
        self._splits = splits  # functions giving (first, step) of the share, asked when the pass begins

    def __iter__(self) -> ShardPass:
        return self

    def __next__(self) -> dict:
        order = self._order
        if order is None:
            order = self._order = self._begin()
            for share in self._splits:
                first, step = share()
                self._positions = self._positions[first::step]
        if self._given >= len(self._positions):
            raise StopIteration
        position = self._positions[self._given]
        self._given += 1
        return {"url": self._urls[order[position]]}

    @property
    def begun(self) -> bool:
        return self._order is not None

    def split(self, share: Callable[[], tuple[int, int]]) -> ShardPass:
        """The pass of every ``step``-th item from the ``first``-th, ``(first, step) = share()`` asked when it begins
        (what ``islice(self, first, None, step)`` gives); for a pass not begun (see :attr:`begun`)."""
        if self.begun:
            raise ValueError("a shard pass is split before its first item; islice() a pass under way")
        rest = ShardPass(self._urls, self._begin, self._positions, self._splits + (share,))
        self._positions = range(0)  # this pass is the share's now
        return rest


def split_by_node(src: Iterable, group: Any = None) -> Iterator:
    """Every ``world_size``-th item starting at ``rank`` (torch.distributed, or RANK/WORLD_SIZE)."""
    if isinstance(src, Share):
        return src  # an elastic resume's share: split already
    if isinstance(src, ShardPass) and not src.begun:
        return src.split(functools.partial(_node_share, group))
    return _split_by_node(src, group)


def _node_share(group: Any) -> tuple[int, int]:
    rank, world_size, _, _ = utils.pytorch_worker_info(group=group)
    return (rank, world_size) if world_size > 1 else (0, 1)


def _worker_share() -> tuple[int, int]:
    _, _, worker, num_workers = utils.pytorch_worker_info()
    return (worker, num_workers) if num_workers > 1 else (0, 1)


def _split_by_node(src: Iterable, group: Any) -> Iterator:
    rank, world_size, _, _ = utils.pytorch_worker_info(group=group)
    if world_size > 1:
        yield from islice(src, rank, None, world_size)
    else:
        yield from src


def single_node_only(src: Iterable, group: Any = None) -> Iterator:
    """Pass items through, refusing to run on more than one node."""
    checked = _single_node_only(src, group)
    return Share(checked) if isinstance(src, Share) else checked


def _single_node_only(src: Iterable, group: Any) -> Iterator:
    rank, world_size, _, _ = utils.pytorch_worker_info(group=group)
    if world_size > 1:
        raise ValueError(
            f"this dataset uses single_node_only but runs on {world_size} nodes (rank {rank}); "
            "pass nodesplitter=wds.split_by_node to give each node its own shards"
        )
    yield from src


def split_by_worker(src: Iterable) -> Iterator:
    """Every ``num_workers``-th item starting at this DataLoader worker's id."""
    if isinstance(src, Share):
        return src
    if isinstance(src, ShardPass) and not src.begun:
        return src.split(_worker_share)
    return _split_by_worker(src)


def _split_by_worker(src: Iterable) -> Iterator:
    _, _, worker, num_workers = utils.pytorch_worker_info()
    if num_workers > 1:
        yield from islice(src, worker, None, num_workers)
    else:
        yield from src


def non_empty(src: Iterable) -> Iterator:
    """Pass items through; raise if there were none."""
    count = 0
    for item in src:
        yield item
        count += 1
    if count == 0:
        raise ValueError("no samples or shards were produced (fewer shards than nodes x workers?)")


class ResampledShards(_Epochs, PipelineStage):
    """Shard URLs drawn with replacement, ``nshards`` per pass (forever by default).

    The seed of a pass combines ``worker_seed()`` (by default
    :func:`utils.pytorch_worker_seed`, different for every rank and DataLoader
    worker), the epoch (``epoch``: -1 before the first pass, one more each pass)
    and ``seed`` (or ``WDS_SEED`` when ``seed`` is left at 0).  With
    ``deterministic=True`` that is the whole seed, so a run can be repeated;
    otherwise fresh entropy is mixed in, as in webdataset.
    """

    def __init__(
        self,
        urls: Any,
        nshards: int = sys.maxsize,
        seed: Optional[int] = 0,
        worker_seed: Optional[Callable[[], int]] = None,
        deterministic: bool = False,
        max_urls: int = int(1e6),
        empty_check: bool = True,
    ) -> None:
        self.urls = shard_sequence(urls, max_urls if not isinstance(urls, list) else None)
        if empty_check and not self.urls:
            raise ValueError(f"the shard spec {urls!r} names no shards")
        self.nshards = nshards
        self.seed = seed
        self.worker_seed = utils.pytorch_worker_seed if worker_seed is None else worker_seed
        self.deterministic = deterministic
        self._start_clock()

    def _pass_seed(self) -> int:
        seed = self.seed
        if not seed:
            seed = config.current().seed or 0
        parts = [self.worker_seed(), self.epoch, seed]
        if not self.deterministic and not config.current().seed:
            parts += [os.getpid(), time.time_ns(), int.from_bytes(os.urandom(4), "little")]
        return utils.make_seed(*parts)

    def run(self) -> Iterator[dict]:
        assigned = self._take_share()
        if assigned is not None:  # the partly read shards of an elastic resume, then draws of this share's own
            return Share(self._pass(assigned[1], salt="elastic"))
        return self._pass([])

    def _pass(self, first: list, salt: Optional[str] = None) -> Iterator[dict]:
        self._next_epoch()
        seed = self._pass_seed() if salt is None else utils.make_seed(self._pass_seed(), salt)
        if config.current().show_seed:
            log.info("resampled shards seeded with %d (epoch %d)", seed, self.epoch)
        rng = random.Random(seed)
        yield from first
        for _ in range(self.nshards - len(first)):
            yield {"url": rng.choice(self.urls)}

    def __iter__(self) -> Iterator[dict]:
        return self.run()

    def __call__(self, src: Any = None) -> Iterator[dict]:
        return self.run()


ResampledShardList = ResampledShards

#: the shard lists that can be given an elastic resume's share (see :meth:`_Epochs.assign`)
SHARE_LISTS = (SimpleShardList, ResampledShards)


def resampled_(src: Iterable, n: int = sys.maxsize) -> Iterator:
    """Collect the items of ``src``, then yield ``n`` of them drawn with replacement (a fresh seed each call)."""
    items = list(src)
    if not items:
        return
    rng = random.Random(int.from_bytes(os.urandom(8), "little"))
    for _ in range(n):
        yield rng.choice(items)


#: the curried stage: ``DataPipeline(SimpleShardList(urls), resampled(27))`` gives 27 shards a pass
resampled = pipelinefilter(resampled_)


#: the fields of one entry of webdataset's ``datasets:`` list (``perepoch`` is ours)
_MSS_FIELDS = ("name", "shards", "buckets", "resample", "choose", "perepoch")


class MultiShardSample(_Epochs, PipelineStage):
    """Shards from webdataset's YAML/dict description mixing several datasets (``datasets:``, each with
    ``shards``, optional ``buckets``, and at most one of ``resample``/``choose``/``perepoch``).

    Per pass (an epoch), as webdataset 1.0.2: ``resample: N`` draws N of the source's shards with
    replacement, ``choose: N`` (or our ``perepoch: N``) N different ones, without replacement, and otherwise
    every shard once; then all the sources' shards are shuffled together. The draws are a function of
    ``seed`` (default ``WDS_SEED``, else 0) and the epoch, so a state resumes exactly (webdataset draws
    from an unseeded generator until ``set_epoch``). Iterating it yields ``{"url": ...}`` items.
    """

    def __init__(self, fname: Any, *, parsed: Any = None, seed: Optional[int] = None) -> None:
        """``fname``: the YAML file's path or URL, or the description's dict; ``parsed``: the file's content
        when the caller has read it already (with :func:`read_spec_file`), so the file is read once."""
        from_file = not isinstance(fname, dict)
        where = os.fspath(fname) if from_file else ""
        spec = fname if not from_file else parsed if parsed is not None else read_spec_file(where, fmt="yaml")
        shown = redact(where) if from_file else "<dict>"
        datafile.need(
            isinstance(spec, dict) and isinstance(spec.get("datasets"), list),
            shown,
            "'datasets'",
            "must be a list of datasets (each with 'shards')",
        )
        self.sources = []
        prefix = spec.get("prefix", "")
        for i, ds in enumerate(spec["datasets"]):
            datafile.need(isinstance(ds, dict) and "shards" in ds, shown, f"datasets[{i}]", "needs 'shards'")
            unknown = sorted(str(k) for k in ds if k not in _MSS_FIELDS)
            datafile.need(
                not unknown,
                shown,
                f"datasets[{i}]",
                f"has unknown field(s) {', '.join(map(repr, unknown[:5]))} (known: {', '.join(_MSS_FIELDS)})",
            )
            buckets = ds.get("buckets", prefix)
            buckets = buckets[0] if isinstance(buckets, list) and buckets else buckets
            datafile.need(
                isinstance(buckets, str) and isinstance(ds["shards"], (str, list)),
                shown,
                f"datasets[{i}]",
                "needs 'shards' (a spec or list) and 'buckets' (a string)",
            )
            urls = expand_urls(ds["shards"], MAX_DATA_URLS if from_file else None, where)
            if from_file:  # a spec file is data: its URLs are resolved in one place, untrusted
                folder = resolve_base(buckets, where) if buckets else None
                urls = [resolve(u, where, base=folder) for u in urls]
            else:
                urls = [os.path.join(buckets, u) if buckets else u for u in urls]
            counts = {key: _draw_count(ds, key, shown, i, MAX_DATA_URLS if from_file else None) for key in _DRAWS}
            given = [key for key, n in counts.items() if n > 0]
            datafile.need(
                len(given) <= 1,
                shown,
                f"datasets[{i}]",
                f"gives {' and '.join(map(repr, given))}",
                "give one: 'resample' draws with replacement, 'choose' or 'perepoch' without",
            )
            for key in ("choose", "perepoch"):
                datafile.need(
                    counts[key] <= len(urls),
                    shown,
                    f"datasets[{i}].{key}",
                    f"is {counts[key]}, more than the {len(urls)} shard(s) of the source (drawn without replacement)",
                    "give at most that many, or 'resample' to draw with replacement",
                )
            self.sources.append({"name": ds.get("name", ""), "urls": urls, **counts})
        self.urls = [u for source in self.sources for u in source["urls"]]  # (the state's config checks them)
        self.seed = seed if seed is not None else (config.current().seed or 0)
        self._start_clock()

    def _config(self) -> dict:
        cfg = super()._config()
        cfg["draws"] = [[source[key] for key in _DRAWS] for source in self.sources]
        return cfg

    def get_shards_for_epoch(self) -> list[str]:
        """The shard URLs of the current epoch (``set_epoch``, or the pass under way), in the order read."""
        rng = random.Random(utils.make_seed(self.seed, self.epoch, "MultiShardSample"))
        result: list[str] = []
        for source in self.sources:
            urls = source["urls"]
            if source["resample"] > 0:
                result.extend(rng.choices(urls, k=source["resample"]))
            elif source["choose"] > 0 or source["perepoch"] > 0:
                result.extend(rng.sample(urls, max(source["choose"], source["perepoch"])))
            else:
                result.extend(urls)
        rng.shuffle(result)
        return result

    def run(self) -> Iterator[dict]:
        self._next_epoch()
        return self._pass(self.get_shards_for_epoch())

    @staticmethod
    def _pass(urls: list[str]) -> Iterator[dict]:
        for url in urls:
            yield {"url": url}

    def __iter__(self) -> Iterator[dict]:
        return self.run()

    def __call__(self, src: Any = None) -> Iterator[dict]:
        return self.run()


#: the per-pass draw counts of a ``datasets:`` entry (<= 0 or absent: every shard once)
_DRAWS = ("resample", "choose", "perepoch")


def _draw_count(ds: dict, key: str, shown: str, i: int, limit: Optional[int]) -> int:
    value = ds.get(key, -1)
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    datafile.need(ok, shown, f"datasets[{i}].{key}", f"must be a whole number of shards, not {value!r}")
    count = int(value)
    if limit is not None:
        datafile.need(
            count <= limit, shown, f"datasets[{i}].{key}", f"is {count}: a spec file may draw at most {limit} shards"
        )
    return count


_CLAIM = re.compile(r"^(?P<file>.*)\._(?P<pid>\d+)_$")
_RECYCLE_MODES = ("resample", "unlink", "keep")


def _recycle(claimed: str, mode: str) -> None:
    """Return a claimed file ``<file>._<pid>_``: ``resample`` renames it back, ``keep`` to ``<file>._done_``
    (``<file>._done_.N`` when that is taken), ``unlink`` deletes it.  A name is never taken over: when ``<file>``
    exists again (a producer wrote a new one meanwhile), both files are left as they are, with a warning."""
    match = _CLAIM.match(claimed)
    if match is None:  # not a name claim_next() made: nothing to give back
        return
    original = match.group("file")
    try:
        if mode == "unlink":
            os.unlink(claimed)
        elif mode == "keep":
            done, n = original + "._done_", 0
            while not _rename_unless_taken(claimed, done):
                n += 1
                done = f"{original}._done_.{n}"
        elif not _rename_unless_taken(claimed, original):
            warnings.warn(
                f"DirectoryShardList: {claimed!r} cannot get its name back: {original!r} exists (a file written "
                "there since it was claimed); both are left as they are: look at them and rename or remove one",
                UserWarning,
                stacklevel=2,
            )
    except FileNotFoundError:  # another process recycled it already
        pass


def _rename_unless_taken(source: str, target: str) -> bool:
    """Rename ``source`` to ``target`` unless ``target`` exists (False then; nothing changed).  A hard link then
    an unlink of the old name, which fails on an existing target where a rename would replace it; on a file
    system without hard links, a look at the target before the rename (the claim's owner alone renames it)."""
    try:
        os.link(source, target, follow_symlinks=False)
    except FileExistsError:
        return False
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOTSUP):
            raise
        if os.path.lexists(target):
            return False
        os.rename(source, target)
        return True
    os.unlink(source)
    return True


#: what each recycling mode does to a file read to its end, as the directory queue's warning says it
_RECYCLE_SAYS = {
    "resample": "renamed back",
    "keep": "renamed to '<file>._done_'",
    "unlink": "DELETED",
}

#: the claims this process's directory queues hold now (one per live iterator): given back at exit, where no
#: iterator's own clean-up ran (an interpreter exiting, a DataLoader worker process ending)
_HELD_CLAIMS: dict = {}
_exit_hooked: list = []  # the process ids whose exit gives the held claims back


def _hold_claim(claimed: str) -> None:
    _HELD_CLAIMS[claimed] = None
    if os.getpid() not in _exit_hooked:
        _exit_hooked.append(os.getpid())
        atexit.register(_give_back_all)
        import multiprocessing.util

        # a multiprocessing child (a DataLoader worker) ends with os._exit: atexit does not run there, these do
        multiprocessing.util.Finalize(None, _give_back_all, exitpriority=0)


def _give_back(claimed: str) -> None:
    """Give a claim of this process its file's name back (nothing recycled)."""
    _HELD_CLAIMS.pop(claimed, None)
    if claimed.endswith(f"._{os.getpid()}_"):  # never another process's claim
        _recycle(claimed, "resample")


def _give_back_all() -> None:
    for claimed in list(_HELD_CLAIMS):
        try:
            _give_back(claimed)
        except OSError:  # at exit: nothing to report to, and the clean-up of a later run recycles it
            pass


def _forget_claims_in_child() -> None:
    # a forked child holds no claim of its parent's (their names carry the parent's process id)
    _HELD_CLAIMS.clear()
    _exit_hooked.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_claims_in_child)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but belongs to someone else
        return True
    return True


def cleanup_files_without_processes(path: str, mode: str = "resample") -> list[str]:
    """Recycle (by ``mode``) the files in ``path`` claimed by processes that no longer exist; returns them."""
    recycled: list[str] = []
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return recycled
    for name in names:
        m = _CLAIM.match(name)
        if m is None or _pid_alive(int(m.group("pid"))):
            continue
        claimed = os.path.join(path, name)
        _recycle(claimed, mode)
        recycled.append(claimed)
    return recycled


class DirectoryShardList(PipelineStage):
    """Shards taken from a directory that others fill, one claimed file at a time (a work queue).

    Each step lists the files matching ``pattern``; none: stop when ``poll`` is None, else wait
    ``poll`` seconds and look again, until ``timeout`` seconds have passed.  One file is picked
    (``select="random"``, or ``"oldest"`` by modification time), claimed by renaming it to
    ``<file>._<pid>_`` (a file another process claimed first is passed over) and yielded as
    ``{"url": ...}``.  When the next item is asked for, the previous claim is recycled by
    ``mode`` (``"unlink"`` deletes the file, ``"keep"`` renames it to ``<file>._done_``,
    ``"resample"`` renames it back), or by what ``fate(path)`` returns when given; then the
    claims of processes that are gone are recycled (:func:`cleanup_files_without_processes`).
    **It changes the folder**: each file is renamed while it is read, and with ``mode="unlink"`` deleted after;
    ``WebDataset("folder/")`` uses this with ``mode="resample"`` and so loops over the folder until stopped.
    Building one warns once, naming the folder.  To read a folder's shards without renaming anything, name
    them: a brace spec (``"folder/shard-{0000..0099}.tar"``) or a list (``sorted(glob.glob("folder/*.tar"))``).

    An iterator that stops before the folder is empty (its consumer broke out of its loop, raised, closed it
    or dropped it, a ``KeyboardInterrupt``, a DataLoader worker shut down, the interpreter exited, a SIGTERM
    whose handler exits) gives its last claim its name back, unrecycled (with ``mode="unlink"`` a shard not
    read to its end is never deleted).  A killed process (SIGKILL, a SIGTERM without a handler) leaves its
    claim; a later run recycles it once that process is gone.
    """

    def __init__(
        self,
        path: str,
        pattern: str = "*.{tar,tgz,tar.tgz}",
        poll: Optional[float] = 1,
        timeout: float = 1e12,
        mode: str = "resample",
        select: str = "random",
        fate: Optional[Callable[[str], str]] = None,
    ) -> None:
        if mode not in _RECYCLE_MODES:
            raise ConfigError(f"DirectoryShardList: mode={mode!r}; use one of {', '.join(_RECYCLE_MODES)}")
        if select not in ("random", "oldest"):
            raise ConfigError(f"DirectoryShardList: select={select!r}; use 'random' or 'oldest'")
        self.path = path
        self.pattern = pattern
        self.poll = poll
        self.timeout = timeout
        self.mode = mode
        self.select = select
        self.fate = fate
        warnings.warn(
            f"DirectoryShardList({str(path)!r}): the folder is read as a work queue: each file matching "
            f"{pattern!r} is renamed to '<file>._<pid>_' while it is read, then "
            + _RECYCLE_SAYS.get(mode, "recycled")
            + (", over and over until the program stops" if mode == "resample" else "")
            + "; the names come back when iteration stops, but a killed run leaves files renamed. To read the "
            "shards of a folder without renaming them, name them: a brace spec ('folder/shard-{0000..0099}.tar') "
            "or a list (sorted(glob.glob('folder/*.tar')))",
            UserWarning,
            stacklevel=2,
        )

    def _files(self) -> list[str]:
        return sorted(utils.glob_with_braces(os.path.join(self.path, self.pattern)))

    def _pick(self, files: list[str]) -> str:
        if self.select == "oldest":

            def mtime(f: str) -> float:
                try:
                    return os.stat(f).st_mtime
                except FileNotFoundError:
                    return float("inf")

            return min(files, key=mtime)
        return random.choice(files)

    def recycle(self, claimed: str) -> None:
        """Give back a file this list claimed, as ``fate`` or ``mode`` says."""
        mode = self.fate(claimed) if self.fate is not None else self.mode
        if mode not in _RECYCLE_MODES:
            raise ConfigError(f"DirectoryShardList: fate returned {mode!r}; return one of {', '.join(_RECYCLE_MODES)}")
        _recycle(claimed, mode)

    def cleanup_files_without_processes(self) -> list[str]:
        """Recycle the claims in this directory whose process is gone."""
        return cleanup_files_without_processes(self.path, self.mode)

    def run(self) -> Iterator[dict]:
        started = time.monotonic()
        last: Optional[str] = None  # this iterator's claim: recycled when the next item is asked for
        try:
            while True:
                if last is not None:
                    self.recycle(last)
                    _HELD_CLAIMS.pop(last, None)
                    last = None
                self.cleanup_files_without_processes()
                files = self._files()
                if not files:
                    if self.poll is None or time.monotonic() - started >= self.timeout:
                        return
                    time.sleep(self.poll)  # waiting for a producer; not a synchronisation between our own parts
                    continue
                chosen = self._pick(files)
                claimed = f"{chosen}._{os.getpid()}_"
                if os.path.lexists(claimed):  # left by an earlier process of our number: never replaced
                    raise FileExistsError(
                        errno.EEXIST,
                        f"DirectoryShardList: cannot claim {chosen!r}: {claimed!r} exists already (left by an "
                        f"earlier process numbered {os.getpid()} as this one); rename it back or remove it",
                        claimed,
                    )
                try:
                    os.rename(chosen, claimed)  # atomic: of processes claiming one file, one wins
                except FileNotFoundError:  # claimed by another process between listing and renaming
                    continue
                last = claimed
                _hold_claim(claimed)
                yield {"url": claimed}
        finally:  # stopped early (break, error, close, garbage collection): the claim gets its name back
            if last is not None:
                _give_back(last)

    def __iter__(self) -> Iterator[dict]:
        return self.run()

    def __call__(self, src: Any = None) -> Iterator[dict]:
        return self.run()


def shardspec(spec: Any) -> PipelineStage:
    """A shard list for ``spec``: a YAML file -> :class:`MultiShardSample`, else :class:`SimpleShardList`."""
    if isinstance(spec, str) and re.search(r"\.ya?ml$", spec) and os.path.exists(spec):
        return MultiShardSample(spec)
    return SimpleShardList(spec)


# webdataset 1.0.2's other names at this path (its MultiShardSample and DirectoryShardList helpers)

#: a shared random generator (webdataset's module-level one; our shard lists seed their own)
default_rng = random.Random()


@dataclasses.dataclass
class MSSource:
    """One source of a multi-shard spec: its ``name``, ``urls``, how many to draw ``perepoch`` (-1: all) and
    whether to ``resample``."""

    name: str = ""
    perepoch: int = -1
    resample: bool = False
    urls: list = dataclasses.field(default_factory=list)


def check_pid_is_running(pid: int) -> bool:
    """Whether a process with this id exists (signal 0 reaches it)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def without_last_extension(fname: str) -> str:
    """``fname`` without its last ``.extension``."""
    head, dot, tail = fname.rpartition(".")
    return head if dot and "/" not in tail else fname


def get_pid_from_filename(fname: str) -> Optional[int]:
    """The process id of a file claimed the way webdataset's ``DirectoryShardList`` names it (``name._PID_``),
    or ``None``."""
    m = re.fullmatch(r"(.*)\._(\d+)_", fname, flags=re.DOTALL)
    return int(m.group(2)) if m else None
