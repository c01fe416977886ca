"""``WebDataset``: samples from shards named by URLs; ``MixedDataset``: several sources mixed by a spec.

``WebDataset`` honours all of its arguments, including those webdataset 1.0.2 accepts and then ignores
(``repeat=``, ``url_to_name=``), and takes our own for keys, storage, transfers and safety, which feed one
:class:`~wds_cloud.dataset.options.ReadOptions`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, Union

from .. import cache, config, filters, shardlists, tariterators, utils
from ..errors import ConfigError, redact
from ..handlers import reraise_exception
from ..index.formats import ShardIndex, group_members
from ..index.sidecar import write_index as write_sidecar
from ..io.manifest import load_manifest
from ..io.profiles import named_profile
from ..io.resilient import StatsSink, TransferStats
from ..mixing.sources import MixSource
from ..mixing.spec import is_mix_spec, load_spec
from ..pipeline import DataPipeline
from ..resume.arguments import as_count, as_seed, as_size, is_flag
from ..resume.state import expect
from ..resume.streams import Streams
from ..stages import PassHolder, PipelineStage
from ..tar.shardreader import TarSamples
from .fluid import FluidInterface
from .options import ReadOptions

__all__ = ["WebDataset", "MixedDataset", "from_spec", "check_empty", "CheckEmpty"]

log = logging.getLogger(__name__)


class CheckEmpty(PassHolder, PipelineStage):
    """:func:`check_empty` as a resumable stage: a resumed pass that yields nothing is not an error."""

    #: every sample it is given comes out, unchanged and in order (a state's sample counts see through it)
    passes_every_sample = True
    PASS_FIELDS = {"_seen": lambda: [False]}

    def __init__(self) -> None:
        self._seen = [False]
        self._resume_seen = False

    def run(self, src: Iterable) -> Iterator:
        seen = self._seen = [self._resume_seen]
        self._resume_seen = False
        for sample in src:
            seen[0] = True
            yield sample
            sample = None  # (not held while the next is made, see DataPipeline._run)
        if not seen[0]:
            next(check_empty(()))

    def state_dict(self) -> dict:
        return {"seen": self._seen[0] or self._resume_seen}

    def next_pass_state(self) -> dict:
        return {"seen": self._resume_seen}

    def load_state_dict(self, state: dict) -> None:
        expect(state, "empty check", dict, seen=bool)
        self._resume_seen = state["seen"]

    def on_elastic_resume(self) -> None:
        """An elastic resume's share may be empty (the epoch was nearly done): that is not an empty dataset."""
        self._resume_seen = True


def check_empty(source: Iterable) -> Iterator:
    """Pass samples through; raise a ValueError with the likely causes if there were none."""
    count = 0
    for sample in source:
        yield sample
        count += 1
    if count == 0:
        raise ValueError(
            "the dataset produced no samples: its shards may be empty, or this worker got none "
            "(fewer shards than nodes x workers); check the shard spec, use fewer workers, "
            "or pass empty_check=False if empty workers are expected"
        )


def _read_spec(urls: Any, storage_options: Optional[dict]) -> Optional[Any]:
    """The parsed content of ``urls`` when it names a .yaml/.yml/.json spec file (read here, once: what decides
    the dataset's class is what the dataset then uses), else None."""
    if shardlists.is_spec_file(urls):
        return shardlists.read_spec_file(urls, storage_options)
    return None


class WebDataset(DataPipeline, FluidInterface):
    """Samples from WebDataset shards named by ``urls`` (a spec string, a list, a JSON/YAML spec, a directory/).

    ``shardshuffle``: shuffle the shard order each epoch (a number or True); the
    order is a function of (``seed``, epoch) and identical on every node and
    worker, so splitting gives each a disjoint share.  It is always deterministic,
    so ``detshuffle=`` changes nothing (accepted for compatibility).  ``resampled=True`` draws
    shards with replacement forever.  ``cache_dir``/``cache_size`` stream remote
    shards through a local cache.  ``handler`` decides what a damaged shard does.
    ``max_member_size`` (bytes, or a size such as ``"256MB"``; default ``WDS_MAX_MEMBER_SIZE``,
    else 2 GiB) refuses larger members before reading them; ``max_sample_size`` (default
    ``WDS_MAX_SAMPLE_SIZE``, else the member limit) refuses a sample spanning more of its tar stream.
    Remote shards are read as parallel ranged parts: ``part_size`` (bytes or ``"8MB"``),
    ``concurrency`` (parts in flight; None grows it while that helps, up to ``max_concurrency``;
    1 reads one stream per shard) and ``prefetch`` (how many of the next shards are requested
    ahead); defaults from ``WDS_PART_SIZE``, ``WDS_CONCURRENCY``, ``WDS_MAX_CONCURRENCY``,
    ``WDS_PREFETCH`` and the URL's profile (see :mod:`wds_cloud.io.parallel`).
    ``manifest`` (a path/URL of a manifest, its dict, or a :class:`~wds_cloud.manifest.Manifest`)
    checks every shard while it is read: :class:`~wds_cloud.errors.IntegrityError` after the last
    sample of a shard that does not match, or for a shard the manifest does not list (unless it
    allows missing ones).  ``write_index=True`` writes the member index of every shard read whole
    beside it (``SHARD.index.json``, for random access) as a by-product of the pass; a callable is
    given each :class:`~wds_cloud.index.ShardIndex` instead.  ``options``: a
    :class:`~wds_cloud.dataset.options.ReadOptions` holding the transfer and safety settings above at once
    (``storage_options``, ``retries``, ``timeout``, ``part_size``, ``concurrency``, ``max_concurrency``,
    ``prefetch``, ``max_member_size``, ``max_sample_size``, ``manifest``); the keywords feed it, and
    ``dataset.options`` is what the dataset uses.

    The other parameters:

    - ``seed``: seeds the shard shuffle (default ``WDS_SEED``, else 0: the same order on every node); given (or
      with ``WDS_SEED``), it also seeds the sample shuffles chained on the dataset (``.shuffle(n)``), which
      otherwise draw fresh seeds.
    - ``keys``: how a member name splits into the sample key and the field: None (the key is the path up to
      the first dot of the file name, ``a/b.seg.png`` is ``a/b`` and ``seg.png``), ``"last_dot"`` (up to the
      last dot), or a function of the name returning ``(key, field)``.
    - ``select_files``: a function of a member name (after ``rename_files``) returning whether to keep it;
      members it refuses are skipped without being read.  ``rename_files``: a function giving each member
      name its new name before the members are grouped into samples.
    - ``equal_work``: every DataLoader worker of every rank yields the same number of samples per epoch:
      ``"min"`` (as many as the smallest share; the rest are dropped), ``"max"`` (as many as the largest; short
      shares read their shards again), both needing the shards' sample counts from a JSON index, or a number
      ``N`` of samples per worker.  None: each worker yields what its shards hold.
    - ``streams``: cuts each epoch's shard order into that many virtual streams, so that the order of samples
      does not depend on the number of ranks and workers (which must divide it); stages chained after
      go inside every stream.  Needs a fixed shard list.
    - ``resampled=True`` (or ``mode="resampled"``, the same) draws shards with replacement, forever; other
      ``mode`` values change nothing.  ``repeat=True`` repeats the dataset (``.repeat()``).
    - ``cache_dir``: the shard cache's directory (default ``WDS_CACHE``; None: no cache).  ``cache_size``: its
      bound, bytes or a size such as ``"200GB"``; ``-1`` (the default) takes ``WDS_CACHE_SIZE``, else leaves
      the directory unbounded; ``0`` reads without the cache.  ``url_to_name`` names a URL's cache entry.
    - ``nodesplitter`` shares the shards out between ranks (the default refuses to run on more than one:
      pass ``wds.split_by_node``), ``workersplitter`` between a rank's DataLoader workers (default: worker
      ``i`` of ``n`` takes shards ``i``, ``i + n``, ...).
    - ``empty_check`` (default True): a pass that yields no sample at all raises ``ValueError`` naming the
      likely causes (no shards for this worker, a wrong spec); False lets it end empty.
    - ``verbose``: logs every shard as it is opened (INFO, URLs redacted) and, with a cache, what it does
      (as ``WDS_VERBOSE_CACHE=1``).

    Plain tar shards on local disk (and complete in the shard cache) are read through a memory mapping:
    each member is sliced out of the page cache as ``bytes`` (one copy).  ``zero_copy=True`` hands out
    read-only ``memoryview`` objects instead (into the mapping, or into the bytes a streamed shard brought): no
    copy at all, and the mapping lives as long as any view of it.  A view is not ``bytes``: call
    ``bytes(view)`` before ``.decode()``, ``json.loads`` or pickling; through ``WebLoader`` workers, batches
    of views travel in shared memory (one copy, from the page cache) and single samples as ``bytes``.

    ``urls="folder/"`` (a path ending in ``/``) is webdataset's directory queue
    (:class:`~wds_cloud.shardlists.DirectoryShardList`), and it changes the folder: each shard is renamed to
    ``<shard>._<pid>_`` while it is read and back after, over and over until the program stops (it warns once,
    naming the folder).  Every stop short of a kill gives the names back.  To read a folder's shards as they
    are, name them: ``"folder/shard-{0000..0099}.tar"`` or ``sorted(glob.glob("folder/*.tar"))``.

    In the main process, ``state_dict()`` of a dataset handed to torch ``DataLoader`` worker processes (which
    iterate copies of it) raises :class:`~wds_cloud.errors.NotResumableError`: take states from a
    :class:`~wds_cloud.loader.webloader.WebLoader` or torchdata's ``StatefulDataLoader`` instead.
    """

    def __new__(cls, urls: Any = None, *args: Any, **kwargs: Any) -> WebDataset:
        # A dataset spec of ours (version + sources, a dict or a .yaml/.json file) is a mix of sources:
        # a MixedDataset (a WebDataset subclass), which Python then initializes with the same arguments.
        given = kwargs.get("options")
        options = kwargs.get("storage_options") or (given.storage_options if given is not None else None)
        urls = plain_urls(urls)
        parsed = _read_spec(urls, options) if cls is WebDataset else None
        mix = is_mix_spec(parsed if parsed is not None else urls) if cls is WebDataset else False
        made = super().__new__(MixedDataset if mix else cls)
        made.__dict__["_parsed_spec"] = parsed
        return made

    def __init__(
        self,
        urls: Any,
        handler: Callable = reraise_exception,
        mode: Optional[str] = None,
        resampled: bool = False,
        repeat: bool = False,
        shardshuffle: Union[int, bool, None] = None,
        cache_size: Any = -1,
        cache_dir: Optional[str] = None,
        url_to_name: Callable[[str], str] = cache.url_to_cache_name,
        detshuffle: bool = False,
        nodesplitter: Optional[Callable] = shardlists.single_node_only,
        workersplitter: Optional[Callable] = shardlists.split_by_worker,
        select_files: Optional[Callable] = None,
        rename_files: Optional[Callable] = None,
        empty_check: bool = True,
        verbose: bool = False,
        seed: Optional[int] = None,
        keys: Union[str, Callable, None] = None,
        storage_options: Optional[dict] = None,
        retries: Optional[int] = None,
        timeout: Optional[float] = None,
        equal_work: Union[int, str, None] = None,
        max_member_size: Union[int, str, None] = None,
        part_size: Union[int, str, None] = None,
        concurrency: Optional[int] = None,
        max_concurrency: Optional[int] = None,
        prefetch: Optional[int] = None,
        manifest: Any = None,
        write_index: Union[bool, Callable[[Any], None]] = False,
        max_sample_size: Union[int, str, None] = None,
        streams: Optional[int] = None,
        options: Optional[ReadOptions] = None,
        zero_copy: bool = False,
    ) -> None:
        super().__init__()
        settings = config.current()
        urls = plain_urls(urls)
        # every number that reaches a stage's state is made plain here (numpy's, 1e3), or refused naming the
        # argument: a state is JSON, and state_dict() must never fail for a dataset that was built
        if isinstance(seed, str):
            seed = config.Settings.from_environ({"WDS_SEED": seed}).seed
        seed = as_seed("seed", seed)
        if shardshuffle is not None and not isinstance(shardshuffle, bool):
            shardshuffle = as_count("shardshuffle", shardshuffle) if not is_flag(shardshuffle) else bool(shardshuffle)
        if streams is not None:
            streams = as_count("streams", streams, least=1)
        # our transfer and safety keywords feed one ReadOptions (options= gives them as one object)
        read = (options or ReadOptions()).with_keywords(
            storage_options=storage_options,
            retries=retries,
            timeout=timeout,
            part_size=part_size,
            concurrency=concurrency,
            max_concurrency=max_concurrency,
            prefetch=prefetch,
            max_member_size=max_member_size,
            max_sample_size=max_sample_size,
            manifest=manifest,
        )
        self.options = read
        storage_options = read.storage_options
        if resampled:
            mode = "resampled"
        if shardshuffle is True:
            shardshuffle = 100
        # Without a seed every node must still agree on the order, so the default is fixed.
        self.seed = seed if seed is not None else (settings.seed if settings.seed is not None else 0)
        if seed is None:
            # webdataset draws its default seed from the global random here (even with WDS_SEED set): the draw is
            # made too, unused, so that a script's later draws from random (a RandomMix's picks, its own
            # augmentations) are the ones they are under webdataset
            random.randint(0, 1000000)
        #: what seeds the sample shuffles chained on this dataset: the seed the user gave, or None (fresh seeds)
        self.sample_seed: Optional[int] = self.seed if seed is not None or settings.seed is not None else None
        self.verbose = verbose
        self.storage_options = storage_options
        if cache_dir is None:
            cache_dir = settings.cache_dir
        if settings.cache_size is not None and cache_size in (-1, None):
            cache_size = settings.cache_size
        cache_size = as_size("cache_size", cache_size, least=-1)
        cache_size = config.parse_size("cache_size", cache_size) if cache_size not in (None, -1) else -1

        self.append(self._url_source(urls, mode, bool(shardshuffle)))
        self._shards = self.pipeline[-1]  # the pipeline's own copy (see wds_cloud.stages.PassHolder)
        if streams is not None and not isinstance(self._shards, shardlists.SimpleShardList):
            raise ConfigError(
                f"streams={streams!r} needs a fixed list of shards (not resampled=True, a webdataset "
                "'datasets:' YAML or a directory): the streams cut each epoch's order of the list"
            )
        if streams is None:
            if nodesplitter is not None:
                self.append(nodesplitter)
            if workersplitter:
                self.append(workersplitter)
        if verbose:
            self.append(filters.map(_log_shard))
        self._stats = StatsSink()
        manifest = load_manifest(read.manifest, storage_options=storage_options) if read.manifest is not None else None
        transfer = read.transfer
        opener: Union[cache.StreamingOpen, cache.FileCache]
        if cache_dir is None or cache_size == 0:
            opener = cache.StreamingOpen(
                handler=handler,
                storage_options=storage_options,
                retries=read.retries,
                timeout=read.timeout,
                stats=self._stats,
                transfer=transfer,
                manifest=manifest,
            )
        else:
            opener = cache.FileCache(
                cache_dir,
                url_to_name=url_to_name,
                cache_size=cache_size,
                handler=handler,
                verbose=verbose,
                storage_options=storage_options,
                retries=read.retries,
                timeout=read.timeout,
                stats=self._stats,
                transfer=transfer,
                manifest=manifest,
            )
        self.equal_work = _check_equal_work(equal_work)
        self._counts: Optional[list] = None
        if self.equal_work in ("min", "max"):
            if not isinstance(self._shards, shardlists.SimpleShardList):
                raise ConfigError(
                    f"equal_work={equal_work!r} needs a fixed shard list (not resampled, a YAML mix "
                    "or a directory): give equal_work=N samples per worker instead"
                )
            self._counts = _shard_counts(urls, self._shards.urls)
            self._nodesplitter = nodesplitter
        self._reader = TarSamples(
            handler=handler,
            select_files=select_files,
            rename_files=rename_files,
            keys=keys,
            opener=opener,
            limit=self._equal_limit if self.equal_work is not None else None,
            max_member_size=config.parse_positive_size("max_member_size", read.max_member_size),
            max_sample_size=config.parse_positive_size("max_sample_size", read.max_sample_size),
            index_sink=_index_sink(write_index, storage_options),
            # what webdataset 1.0.2's WebDataset would call of what user code replaced (tar_file_iterator,
            # valid_sample; compat.group_by_keys, compat.tar_file_expander), looked up when each pass begins
            replaced=tariterators.replaced_for_webdataset,
            zero_copy=_flag("zero_copy", zero_copy),
        )
        self._streams: Optional[Streams] = None
        if streams is not None:
            self.append(
                Streams(
                    streams, [self._reader], DataPipeline, self._stream_limit if self.equal_work is not None else None
                )
            )
            self._streams = self.pipeline[-1]
        else:
            self.append(self._reader)
            self._reader = self.pipeline[-1]
        if empty_check:
            self.append(CheckEmpty())
        if repeat:
            self.repeat()

    def _url_source(self, urls: Any, mode: Optional[str], shuffle: bool) -> Any:
        if isinstance(urls, dict) or (isinstance(urls, str) and re.search(r"\.ya?ml$", urls)):
            return shardlists.MultiShardSample(urls, parsed=self.__dict__.get("_parsed_spec"), seed=self.seed)
        if isinstance(urls, str) and urls.endswith("/") and not urls.endswith("://"):
            return shardlists.DirectoryShardList(urls)
        if mode == "resampled":
            return shardlists.ResampledShards(urls, seed=self.seed, deterministic=True)
        if isinstance(urls, str) or isinstance(urls, (list, tuple)) or hasattr(urls, "__iter__"):
            source = urls if isinstance(urls, str) else plain_urls(list(urls))
            if not isinstance(source, str):
                for number, url in enumerate(source):
                    if not isinstance(url, (str, dict)):
                        raise ConfigError(
                            f"urls[{number}] is {type(url).__name__} {redact(repr(url))[:80]}: each URL is text "
                            "(a str, or a pathlib.Path)"
                        )
            return shardlists.SimpleShardList(source, seed=self.seed if shuffle else None)
        raise ConfigError(
            f"cannot read shards from {type(urls).__name__}: give a spec string, a list of URLs, "
            "a .json/.yaml dataset spec, or a directory ending in /"
        )

    def compose(self, *args: Callable) -> Any:
        """A copy with ``args`` appended; with ``streams=``, appended inside every stream (each stream has its own
        shuffle buffer and stages, see :mod:`wds_cloud.resume.streams`)."""
        if self.__dict__.get("_streams") is None:
            return super().compose(*args)
        result = super().compose()
        streams = result.__dict__["_streams"]  # the copy's own
        extended = streams.extended(args)
        result.__dict__["_streams"] = extended
        result.pipeline = [extended if stage is streams else stage for stage in result.pipeline]
        return result

    def _stages_copied(self, copies: dict) -> None:
        # the copy's reader (or streams) counts equal_work against the copy's shard list, whose epoch is its own
        super()._stages_copied(copies)
        if self.__dict__.get("equal_work") is None:  # (a MixedDataset has none)
            return
        if self._streams is not None:
            self._streams.limit_for = self._stream_limit
        elif self._reader is not None:
            self._reader.set_limit(self._equal_limit)

    def _stream_limit(self, stream: int) -> Callable[[], int]:
        """The ``equal_work`` limit of one stream's reader: with ``streams=``, every stream yields as many."""

        def limit() -> int:
            if isinstance(self.equal_work, int):
                return self.equal_work
            assert self._streams is not None
            streams = self._streams.count
            shards = self._shards
            counts = self._counts or []
            totals = [
                sum(counts[i] for i in slot)
                for slot in shardlists.slot_shards(len(shards.urls), shards.seed, shards.epoch, 1, streams)
            ]
            if min(totals) == 0:
                raise ValueError(
                    f"equal_work={self.equal_work!r}: stream {totals.index(0)} of {streams} gets no samples "
                    f"this epoch ({len(shards.urls)} shards); use fewer streams"
                )
            return min(totals) if self.equal_work == "min" else max(totals)

        return limit

    def _equal_limit(self) -> int:
        """The samples every DataLoader worker of every rank yields this epoch (``equal_work``)."""
        if isinstance(self.equal_work, int):
            return self.equal_work
        rank, world_size, worker, num_workers = utils.pytorch_worker_info()
        if self._nodesplitter is shardlists.single_node_only or self._nodesplitter is None:
            world_size = 1
        shards = self._shards
        slots = shardlists.slot_shards(len(shards.urls), shards.seed, shards.epoch, world_size, num_workers)
        counts = self._counts or []  # set whenever equal_work is "min" or "max", the only callers
        totals = [sum(counts[i] for i in slot) for slot in slots]
        if min(totals) == 0:
            empty = totals.index(0)
            raise ValueError(
                f"equal_work={self.equal_work!r}: rank {empty // num_workers} worker {empty % num_workers} gets no "
                f"samples this epoch ({len(shards.urls)} shards for {world_size} ranks x {num_workers} workers); "
                "use at least as many shards as ranks x workers, or fewer workers"
            )
        return min(totals) if self.equal_work == "min" else max(totals)

    def shard_counts(self) -> Optional[dict]:
        """Samples per shard index (``equal_work="min"``/``"max"`` read them from the index), else None."""
        return dict(enumerate(self._counts)) if self._counts is not None else None

    @property
    def stats(self) -> TransferStats:
        """Transfer figures of the remote reads this process made for the dataset (a snapshot).

        ``streams`` (remote shards read), ``requests`` (the GETs made for them: one per shard read as one
        stream, one per part), ``bytes``, ``seconds``, ``retries``, ``bytes_refetched``, ``time_lost``,
        the cache's ``cache_hits``, ``cache_misses``, ``cache_evictions``, ``cache_reuse_misses`` (shards
        fetched again after the cache evicted them before their reuse: it is too small), ``bytes_saved``, of parallel
        ranged reads ``first_byte`` (mean seconds to a part's first byte), ``connection_rate`` (mean bytes/s
        of one connection), ``concurrency`` (most parts in flight), ``hosts`` (per host: the ``level`` of
        connections chosen and ``why``, the reader's ``waiting`` share, ``latency``, ``rates`` per level),
        and of local files (not transfers) ``local_files`` and ``local_bytes``.  Each DataLoader worker
        process counts its own reads.
        """
        return self._stats.snapshot()

    def __enter__(self) -> WebDataset:
        return self

    def __exit__(self, *args: Any) -> None:
        self.close()


def _index_sink(write_index: Any, storage_options: Optional[dict]) -> Optional[Callable[[dict], None]]:
    """What the shard reader calls for every shard read whole with ``write_index=``: build its index, then give
    it to the user's callable or write it beside the shard."""
    if not write_index:
        return None
    return _IndexSink(write_index, storage_options)


@dataclasses.dataclass(frozen=True)
class _IndexSink:
    """The reader's ``index_sink`` for ``write_index=`` (a class, not a closure: a dataset pickles for workers)."""

    write_index: Any
    storage_options: Optional[dict]

    def __call__(self, read: dict) -> None:
        index = ShardIndex(
            read["url"],
            group_members(read["members"]),
            size=read["size"],
            version=read["version"],
            compression=read["compression"],
        )
        if callable(self.write_index):
            self.write_index(index)
        else:
            write_sidecar(index, storage_options=self.storage_options)


def plain_urls(urls: Any) -> Any:
    """``urls`` with paths (``pathlib.Path``, any ``os.PathLike``, a path as ``bytes`` as ``open()`` takes one)
    as text, in a list or tuple too."""
    if isinstance(urls, (os.PathLike, bytes, bytearray)):
        return os.fsdecode(bytes(urls) if isinstance(urls, bytearray) else urls)
    if isinstance(urls, (list, tuple)) and any(isinstance(u, (os.PathLike, bytes, bytearray)) for u in urls):
        return [plain_urls(u) if isinstance(u, (os.PathLike, bytes, bytearray)) else u for u in urls]
    return urls


def _check_equal_work(value: Any) -> Union[int, str, None]:
    if value is None or value is False:
        return None
    if isinstance(value, str) and value in ("min", "max"):
        return value
    if not is_flag(value) and not isinstance(value, str):
        try:
            return as_count("equal_work", value, least=1)
        except ConfigError:
            pass
    raise ConfigError(
        f"equal_work={value!r}: give 'min' (every worker yields as many samples as the smallest "
        "share, the rest are dropped), 'max' (as many as the largest share; short ones repeat their "
        "shards from the first), or a number of samples per worker and epoch"
    )


def _shard_counts(source: Any, urls: Iterable) -> list:
    counts = shardlists.index_counts(source)
    if counts is None or any(url not in counts for url in urls):
        raise ValueError(
            "equal_work='min' or 'max' needs the number of samples in every shard: read the shards from a "
            'JSON index whose entries give \'nsamples\' (the wids format: {"shardlist": [{"url": ..., '
            '"nsamples": ...}, ...]}), or give equal_work=N samples per worker and epoch'
        )
    return [counts[url] for url in urls]


def _log_shard(sample: dict) -> dict:
    log.info("opening shard %s", redact(sample.get("url")))
    return sample


def _source_options(source: Any, storage_options: Optional[dict]) -> Optional[dict]:
    """A source's storage options: its named profile, then its own options, then the dataset's."""
    options: dict = {}
    if source.profile:
        options.update(named_profile(source.profile, config.current()))
    options.update(source.storage_options or {})
    options.update(storage_options or {})
    return options or None


class MixedDataset(WebDataset):
    """Samples of several sources mixed by weight, from a spec (``WebDataset("train.yaml")``,
    :func:`wds_cloud.from_spec`); chain stages on it as on any WebDataset.

    ``seed=`` applies where the spec has none (then ``WDS_SEED``, then 0).  The other keyword arguments
    of WebDataset (handler, cache_dir, timeout, ...) apply to every source; ``storage_options=``
    over each source's own.  ``stats`` reports samples, bytes and share per source.
    """

    def __init__(
        self,
        urls: Any,
        handler: Any = reraise_exception,
        seed: Optional[int] = None,
        storage_options: Optional[dict] = None,
        nodesplitter: Any = shardlists.split_by_node,
        **kwargs: Any,
    ) -> None:
        DataPipeline.__init__(self)
        given = kwargs.pop("options", None) or ReadOptions()
        storage_options = given.with_keywords(storage_options=storage_options).storage_options
        # every source reads with these options, over its own storage options from the spec
        kwargs["options"] = dataclasses.replace(given, storage_options=None)
        spec = load_spec(plain_urls(urls), storage_options, parsed=self.__dict__.get("_parsed_spec"))
        seed = as_seed("seed", seed)
        settings = config.current()
        base_seed = (
            spec.seed
            if spec.seed is not None
            else (seed if seed is not None else (settings.seed if settings.seed is not None else 0))
        )
        self.seed = base_seed
        self.sample_seed = (
            base_seed if (spec.seed is not None or seed is not None or settings.seed is not None) else None
        )
        self.spec = spec
        self.storage_options = storage_options
        kwargs.pop("shardshuffle", None)  # per source, in the spec
        kwargs.pop("resampled", None)
        if kwargs.get("streams") is not None:
            raise ConfigError(
                "streams= is not available for a mix of sources (each source draws per rank and "
                "worker); a mix resumes on another shape through wds.merge_states() instead"
            )
        datasets = []
        for number, source in enumerate(spec.sources):
            ds = WebDataset(
                list(source.urls),
                handler=handler,
                resampled=source.resampled,
                shardshuffle=source.shardshuffle and not source.resampled,
                seed=utils.make_seed(base_seed, number, source.name),
                nodesplitter=nodesplitter,
                storage_options=_source_options(source, storage_options),
                **kwargs,
            )
            if source.shuffle:
                ds = ds.shuffle(source.shuffle, seed=utils.make_seed(base_seed, "shuffle", source.name))
            datasets.append(ds)
        self.append(
            MixSource(
                [s.name for s in spec.sources],
                datasets,
                [s.weight for s in spec.sources],
                [s.resampled for s in spec.sources],
                base_seed,
                spec.samples_per_epoch,
            )
        )
        self._mix = self.pipeline[-1]  # the pipeline's own copy (see wds_cloud.stages.PassHolder)

    @property
    def sources(self) -> list:
        """The dataset of each source, in the spec's order (those this pipeline's mix draws from)."""
        return self._mix.datasets

    @property
    def stats(self) -> Any:
        """Per source: samples, payload bytes, share and target share drawn in this process (each
        DataLoader worker counts its own; every sample also names its source in ``__source__``), and
        each source's transfer figures under ``"transfer"``."""
        snap = self._mix.stats.snapshot()
        for name, ds in zip(self._mix.names, self.sources):
            snap["sources"][name]["transfer"] = ds.stats
        return snap

    def close(self) -> None:
        for ds in self.sources:
            ds.close()
        super().close()

    def __repr__(self) -> str:
        return f"<MixedDataset {self.spec.where}: {', '.join(s.name for s in self.spec.sources)}>"


def from_spec(spec: Any, **kwargs: Any) -> MixedDataset:
    """A mixed dataset from a spec: a dict (trusted, as code), or the URL/path of a YAML/JSON file (data).

    ``kwargs`` are WebDataset's (``handler``, ``seed``, ``cache_dir``, ``storage_options``, ...).
    """
    return MixedDataset(spec, **kwargs)


def _flag(name: str, value: Any) -> bool:
    """A switch given as True or False (numpy's booleans too), or our error naming it."""
    if is_flag(value):
        return bool(value)
    raise ConfigError(f"{name}={value!r:.80}: give True or False")
