"""The fluent API: ``WebDataset(url).shuffle(1000).decode("rgb").to_tuple("png", "json")``.

Every fluent method returns a new pipeline.  ``WebDataset`` honours all of its
arguments, including those webdataset 1.0.2 accepts and then ignores
(``repeat=``, ``url_to_name=``), and takes a few of its own: ``keys=`` (how
member names split into key and field), ``storage_options=`` (passed to the
storage backend).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Union

from . import autodecode, config, filters, shardlists, transport, utils
from .errors import ConfigError, NotResumableError, StateMismatchError, redact
from .handlers import reraise_exception
from .io import opener as cache
from .io.profiles import named_profile
from .io.resilient import StatsSink, TransferStats
from .mixing import MixSource
from .pipeline import DataPipeline
from .pytorch import HAVE_TORCH, DataLoader
from .resume import loader as loaderstate
from .resume.protocol import Resumable, is_buffering
from .resume.elastic import LOADER_FORMAT, check_merged, is_merged, items_share
from .resume.merge import merge_states
from .resume.streams import Streams
from .resume.state import check_same, check_seal, expect, inexact_state, is_inexact, restart_from, seal
from .spec import is_mix_spec, load_spec
from .stages import PipelineStage
from .tar.shardreader import TarSamples

__all__ = ["FluidInterface", "WebDataset", "FluidWrapper", "WebLoader", "check_empty", "CheckEmpty", "MixedDataset",
           "from_spec"]

log = logging.getLogger("wds_cloud.compat")


class FluidInterface:
    """Fluent methods shared by ``WebDataset``, ``FluidWrapper`` and ``WebLoader``."""

    if TYPE_CHECKING:  # provided by DataPipeline, which every class using this mixin also is
        def compose(self, *stages: Callable) -> Any: ...

    def batched(self, batchsize: int, collation_fn: Optional[Callable] = filters.default_collation_fn,
                partial: bool = True) -> Any:
        return self.compose(filters.batched(batchsize, collation_fn=collation_fn, partial=partial))

    def unbatched(self) -> Any:
        return self.compose(filters.unbatched())

    def listed(self, batchsize: int, partial: bool = True) -> Any:
        return self.compose(filters.batched(batchsize, collation_fn=None, partial=partial))

    def unlisted(self) -> Any:
        return self.compose(filters.unlisted())

    def log_keys(self, logfile: Optional[str] = None) -> Any:
        return self.compose(filters.log_keys(logfile))

    def shuffle(self, size: int, **kw: Any) -> Any:
        """A sample shuffle of ``size`` samples.  In a dataset given a seed (``WebDataset(url, seed=S)``,
        ``WDS_SEED``, or a spec's ``seed:``), a shuffle given neither ``seed`` nor ``rng`` is seeded from it and
        from the epoch, so the same ``S`` gives the same order (webdataset seeds it from the clock)."""
        if size < 1:
            return self
        base = getattr(self, "sample_seed", None)
        if base is not None and kw.get("seed") is None and kw.get("rng") is None:
            number = sum(isinstance(stage, filters.Shuffle) for stage in getattr(self, "pipeline", ()))
            return self.compose(filters.Shuffle(size, kw.get("initial", 100), handler=kw.get("handler"),
                                                seed=utils.make_seed(base, "sample shuffle", number),
                                                epoch_seeded=True))
        return self.compose(filters.shuffle(size, **kw))

    def map(self, f: Callable, handler: Callable = reraise_exception) -> Any:
        return self.compose(filters.map(f, handler=handler))

    def decode(self, *args: Any, pre: Optional[list] = None, post: Optional[list] = None, only: Any = None,
               partial: bool = False, handler: Callable = reraise_exception, allow_pickle: Optional[bool] = None) -> Any:
        """Decode fields by extension; string arguments are image specs (``"rgb8"``, ``"torchrgb"``, ``"pil"``)."""
        handlers = [autodecode.ImageHandler(x) if isinstance(x, str) else x for x in args]
        decoder = autodecode.Decoder(handlers, pre=pre, post=post, only=only, partial=partial,
                                     allow_pickle=allow_pickle)
        return self.map(decoder, handler=handler)

    def map_dict(self, handler: Callable = reraise_exception, **kw: Callable) -> Any:
        return self.compose(filters.map_dict(handler=handler, **kw))

    def select(self, predicate: Callable, **kw: Any) -> Any:
        return self.compose(filters.select(predicate, **kw))

    def to_tuple(self, *args: str, **kw: Any) -> Any:
        return self.compose(filters.to_tuple(*args, **kw))

    def map_tuple(self, *args: Optional[Callable], handler: Callable = reraise_exception) -> Any:
        return self.compose(filters.map_tuple(*args, handler=handler))

    def slice(self, *args: Any) -> Any:
        return self.compose(filters.slice(*args))

    def rename(self, **kw: Any) -> Any:
        return self.compose(filters.rename(**kw))

    def rsample(self, p: float = 0.5) -> Any:
        return self.compose(filters.rsample(p))

    def rename_keys(self, *args: Any, **kw: Any) -> Any:
        return self.compose(filters.rename_keys(*args, **kw))

    def extract_keys(self, *args: Any, **kw: Any) -> Any:
        return self.compose(filters.extract_keys(*args, **kw))

    def xdecode(self, *args: Any, **kw: Any) -> Any:
        return self.compose(filters.xdecode(*args, **kw))

    def mcached(self) -> Any:
        return self.compose(filters.Cached())

    def lmdb_cached(self, *args: Any, **kw: Any) -> Any:
        return self.compose(filters.LMDBCached(*args, **kw))


class CheckEmpty(PipelineStage):
    """:func:`check_empty` as a resumable stage: a resumed pass that yields nothing is not an error."""

    def __init__(self) -> None:
        self._seen = [False]
        self._resume_seen = False

    def run(self, src: Iterable) -> Iterator:
        seen = self._seen = [self._resume_seen]
        self._resume_seen = False
        for sample in src:
            seen[0] = True
            yield sample
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


def _names_mix_spec(urls: Any, storage_options: Optional[dict]) -> bool:
    """Whether ``urls`` is one of our dataset specs (a dict, or a .yaml/.yml/.json file holding one)."""
    if isinstance(urls, dict):
        return is_mix_spec(urls)
    if isinstance(urls, str) and re.search(r"\.(ya?ml|json)$", urls):
        return is_mix_spec(shardlists.read_spec_file(urls, storage_options))
    return False


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
    given each :class:`~wds_cloud.index.ShardIndex` instead.
    """

    def __new__(cls, urls: Any = None, *args: Any, **kwargs: Any) -> "WebDataset":
        # A dataset spec of ours (version + sources, a dict or a .yaml/.json file) is a mix of sources:
        # a MixedDataset (a WebDataset subclass), which Python then initializes with the same arguments.
        if cls is WebDataset and _names_mix_spec(urls, kwargs.get("storage_options")):
            return super().__new__(MixedDataset)
        return super().__new__(cls)

    def __init__(self, urls: Any, handler: Callable = reraise_exception, mode: Optional[str] = None,
                 resampled: bool = False, repeat: bool = False, shardshuffle: Union[int, bool, None] = None,
                 cache_size: Any = -1, cache_dir: Optional[str] = None,
                 url_to_name: Callable[[str], str] = cache.url_to_cache_name, detshuffle: bool = False,
                 nodesplitter: Optional[Callable] = shardlists.single_node_only,
                 workersplitter: Optional[Callable] = shardlists.split_by_worker,
                 select_files: Optional[Callable] = None, rename_files: Optional[Callable] = None,
                 empty_check: bool = True, verbose: bool = False, seed: Optional[int] = None,
                 keys: Union[str, Callable, None] = None, storage_options: Optional[dict] = None,
                 retries: Optional[int] = None, timeout: Optional[float] = None,
                 equal_work: Union[int, str, None] = None, max_member_size: Union[int, str, None] = None,
                 part_size: Union[int, str, None] = None, concurrency: Optional[int] = None,
                 max_concurrency: Optional[int] = None, prefetch: Optional[int] = None, manifest: Any = None,
                 write_index: Union[bool, Callable[[Any], None]] = False,
                 max_sample_size: Union[int, str, None] = None, streams: Optional[int] = None) -> None:
        super().__init__()
        settings = config.current()
        max_member_size = config.parse_positive_size("max_member_size", max_member_size)
        max_sample_size = config.parse_positive_size("max_sample_size", max_sample_size)
        if resampled:
            mode = "resampled"
        if shardshuffle is True:
            shardshuffle = 100
        if isinstance(seed, str):
            seed = config.Settings.from_environ({"WDS_SEED": seed}).seed
        # Without a seed every node must still agree on the order, so the default is fixed.
        self.seed = seed if seed is not None else (settings.seed if settings.seed is not None else 0)
        #: what seeds the sample shuffles chained on this dataset: the seed the user gave, or None (fresh seeds)
        self.sample_seed: Optional[int] = self.seed if seed is not None or settings.seed is not None else None
        self.verbose = verbose
        self.storage_options = storage_options
        if cache_dir is None:
            cache_dir = settings.cache_dir
        if settings.cache_size is not None and cache_size in (-1, None):
            cache_size = settings.cache_size
        cache_size = config.parse_size("cache_size", cache_size) if cache_size not in (None, -1) else -1

        self._shards = self._url_source(urls, mode, bool(shardshuffle))
        self.append(self._shards)
        if streams is not None and not isinstance(self._shards, shardlists.SimpleShardList):
            raise ConfigError(f"streams={streams!r} needs a fixed list of shards (not resampled=True, a webdataset "
                              "'datasets:' YAML or a directory): the streams cut each epoch's order of the list")
        if streams is None:
            if nodesplitter is not None:
                self.append(nodesplitter)
            if workersplitter:
                self.append(workersplitter)
        if verbose:
            self.append(filters.map(_log_shard))
        self._stats = StatsSink()
        if manifest is not None:
            from .manifest import load_manifest

            manifest = load_manifest(manifest, storage_options=storage_options)
        transfer = {"part_size": part_size, "concurrency": concurrency, "max_concurrency": max_concurrency,
                    "prefetch": prefetch}
        opener: Union[cache.StreamingOpen, cache.FileCache]
        if cache_dir is None or cache_size == 0:
            opener = cache.StreamingOpen(handler=handler, storage_options=storage_options, retries=retries,
                                         timeout=timeout, stats=self._stats, transfer=transfer, manifest=manifest)
        else:
            opener = cache.FileCache(cache_dir, url_to_name=url_to_name, cache_size=cache_size, handler=handler,
                                     verbose=verbose, storage_options=storage_options, retries=retries,
                                     timeout=timeout, stats=self._stats, transfer=transfer, manifest=manifest)
        self.equal_work = _check_equal_work(equal_work)
        self._counts: Optional[list] = None
        if self.equal_work in ("min", "max"):
            if not isinstance(self._shards, shardlists.SimpleShardList):
                raise ConfigError(f"equal_work={equal_work!r} needs a fixed shard list (not resampled, a YAML mix "
                                 "or a directory): give equal_work=N samples per worker instead")
            self._counts = _shard_counts(urls, self._shards.urls)
            self._nodesplitter = nodesplitter
        self._reader = TarSamples(handler=handler, select_files=select_files, rename_files=rename_files, keys=keys,
                                  opener=opener, limit=self._equal_limit if self.equal_work is not None else None,
                                  max_member_size=max_member_size, max_sample_size=max_sample_size,
                                  index_sink=_index_sink(write_index, storage_options))
        self._streams: Optional[Streams] = None
        if streams is not None:
            self._streams = Streams(streams, [self._reader], DataPipeline,
                                    self._stream_limit if self.equal_work is not None else None)
            self.append(self._streams)
        else:
            self.append(self._reader)
        if empty_check:
            self.append(CheckEmpty())
        if repeat:
            self.repeat()

    def _url_source(self, urls: Any, mode: Optional[str], shuffle: bool) -> Any:
        if isinstance(urls, dict) or (isinstance(urls, str) and re.search(r"\.ya?ml$", urls)):
            return shardlists.MultiShardSample(urls)
        if isinstance(urls, str) and urls.endswith("/") and not urls.endswith("://"):
            return shardlists.DirectoryShardList(urls)
        if mode == "resampled":
            return shardlists.ResampledShards(urls, seed=self.seed, deterministic=True)
        if isinstance(urls, str) or isinstance(urls, (list, tuple)) or hasattr(urls, "__iter__"):
            source = urls if isinstance(urls, str) else list(urls)
            return shardlists.SimpleShardList(source, seed=self.seed if shuffle else None)
        raise ConfigError(f"cannot read shards from {type(urls).__name__}: give a spec string, a list of URLs, "
                         "a .json/.yaml dataset spec, or a directory ending in /")

    def compose(self, *args: Callable) -> Any:
        """A copy with ``args`` appended; with ``streams=``, appended inside every stream (each stream has its own
        shuffle buffer and stages, see :mod:`wds_cloud.resume.streams`)."""
        streams = self.__dict__.get("_streams")
        if streams is None:
            return super().compose(*args)
        result = super().compose()
        extended = streams.extended(args)
        result.__dict__["_streams"] = extended
        result.pipeline = [extended if stage is streams else stage for stage in result.pipeline]
        return result

    def _stream_limit(self, stream: int) -> Callable[[], int]:
        """The ``equal_work`` limit of one stream's reader: with ``streams=``, every stream yields as many."""
        def limit() -> int:
            if isinstance(self.equal_work, int):
                return self.equal_work
            assert self._streams is not None
            streams = self._streams.count
            shards = self._shards
            counts = self._counts or []
            totals = [sum(counts[i] for i in slot) for slot in
                      shardlists.slot_shards(len(shards.urls), shards.seed, shards.epoch, 1, streams)]
            if min(totals) == 0:
                raise ValueError(f"equal_work={self.equal_work!r}: stream {totals.index(0)} of {streams} gets no samples "
                                 f"this epoch ({len(shards.urls)} shards); use fewer streams")
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
                "use at least as many shards as ranks x workers, or fewer workers")
        return min(totals) if self.equal_work == "min" else max(totals)

    def shard_counts(self) -> Optional[dict]:
        """Samples per shard index (``equal_work="min"``/``"max"`` read them from the index), else None."""
        return dict(enumerate(self._counts)) if self._counts is not None else None

    @property
    def stats(self) -> TransferStats:
        """Transfer figures of the remote reads this process made for the dataset (a snapshot).

        ``streams`` (remote shards read), ``requests`` (the GETs made for them: one per shard read as one
        stream, one per part), ``bytes``, ``seconds``, ``retries``, ``bytes_refetched``, ``time_lost``,
        the cache's ``cache_hits``, ``cache_misses``, ``cache_evictions``, ``bytes_saved``, of parallel
        ranged reads ``first_byte`` (mean seconds to a part's first byte), ``connection_rate`` (mean bytes/s
        of one connection), ``concurrency`` (most parts in flight), ``hosts`` (per host: the ``level`` of
        connections chosen and ``why``, the reader's ``waiting`` share, ``latency``, ``rates`` per level),
        and of local files (not transfers) ``local_files`` and ``local_bytes``.  Each DataLoader worker
        process counts its own reads.
        """
        return self._stats.snapshot()

    def __enter__(self) -> "WebDataset":
        return self

    def __exit__(self, *args: Any) -> None:
        self.close()


def _index_sink(write_index: Any, storage_options: Optional[dict]) -> Optional[Callable[[Any], None]]:
    if not write_index:
        return None
    if callable(write_index):
        return write_index

    def write(index: Any) -> None:
        from .index import write_index as write_sidecar

        write_sidecar(index, storage_options=storage_options)

    return write


def _check_equal_work(value: Any) -> Union[int, str, None]:
    if value is None or value is False:
        return None
    if value in ("min", "max"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ConfigError(f"equal_work={value!r}: give 'min' (every worker yields as many samples as the smallest "
                     "share, the rest are dropped), 'max' (as many as the largest share; short ones repeat their "
                     "shards from the first), or a number of samples per worker and epoch")


def _shard_counts(source: Any, urls: list) -> list:
    counts = shardlists.index_counts(source)
    if counts is None or any(url not in counts for url in urls):
        raise ValueError(
            "equal_work='min' or 'max' needs the number of samples in every shard: read the shards from a "
            "JSON index whose entries give 'nsamples' (the wids format: {\"shardlist\": [{\"url\": ..., "
            "\"nsamples\": ...}, ...]}), or give equal_work=N samples per worker and epoch")
    return [counts[url] for url in urls]


def _log_shard(sample: dict) -> dict:
    log.info("opening shard %s", redact(sample.get("url")))
    return sample


class FluidWrapper(DataPipeline, FluidInterface):
    """Give any iterable the fluent methods: ``FluidWrapper(dataset).batched(16)``."""

    def __init__(self, initial: Any) -> None:
        super().__init__()
        self.append(initial)


class WebLoader(DataPipeline, FluidInterface):
    """A ``DataLoader`` (torch's, or our stand-in without torch) with the fluent methods.

    Each pass sets the dataset's epoch (0, 1, 2, ... unless ``set_epoch`` chose one), so
    re-started workers get a new shard order every epoch.  When the dataset is resumable
    (a ``WebDataset`` or ``DataPipeline``), ``state_dict()`` is where every worker stands
    at the last item this loader yielded, and ``load_state_dict`` makes the next pass
    continue from there, in the same worker order.

    ``pack_bytes``: lists of byte strings batched in workers travel in one shared-memory tensor per
    batch (:class:`wds_cloud.transport.PackedBytes`, a sequence of ``bytes``) instead of being pickled
    through the workers' pipes.  ``None`` (the default) packs a batch whose byte strings add up to
    ``transport.AUTO_MIN_BYTES`` (1 MiB) or more, where that is faster; ``True`` packs every batch with
    byte strings; ``False`` never (every column stays a ``list``).  See ``docs/gpu.md``.
    ``device="cuda"``: every batch's tensors are copied there from pinned memory (``pin_memory`` is
    then on) with ``non_blocking=True`` on a side stream (:func:`wds_cloud.gpu.to_device`).
    """

    def __init__(self, *given: Any, pack_bytes: Optional[bool] = None, device: Any = None, **kw: Any) -> None:
        args = list(given)
        dataset = args[0] if args else kw.get("dataset")
        self._dataset = dataset
        self._untag = None
        num_workers = kw.get("num_workers", 0) if len(args) < 6 else args[5]
        if device is not None and str(device).startswith("cuda") and "pin_memory" not in kw:
            kw["pin_memory"] = True
        # byte strings batched in workers travel as shared-memory tensors (wds_cloud.transport)
        pack: Optional[Callable[[Any], Any]] = None
        min_bytes = transport.AUTO_MIN_BYTES if pack_bytes is None else 0
        if pack_bytes is not False and num_workers and HAVE_TORCH:
            pack = functools.partial(transport.pack_batch, min_bytes=min_bytes)
        # Why state_dict() cannot work here (None: it can).  Decided from the stages alone; a
        # pipeline that cannot be resumed is iterated exactly as torch's DataLoader would.
        self._blocker = _resume_blocker(dataset, args, kw)
        if self._blocker is None:
            batch_size = args[1] if len(args) > 1 else kw.get("batch_size", 1)
            ended = loaderstate.Ended(dataset)
            if args:
                args[0] = ended
            else:
                kw["dataset"] = ended
            if len(args) > 6:  # DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, workers, collate_fn)
                args[6] = loaderstate.StateCollate(args[6], batch_size is None, ended, pack)
            else:
                kw["collate_fn"] = loaderstate.StateCollate(kw.get("collate_fn"), batch_size is None, ended, pack)
            self._untag = loaderstate.Untag(num_workers or 0)
            self._untag.dataset = dataset
        elif pack is not None:
            batch_size = args[1] if len(args) > 1 else kw.get("batch_size", 1)
            index = 6 if len(args) > 6 else None
            inner = (args[6] if index else kw.get("collate_fn")) or loaderstate.default_collate(batch_size is None)
            if index:
                args[6] = transport.PackingCollate(inner, min_bytes)
            else:
                kw["collate_fn"] = transport.PackingCollate(inner, min_bytes)
        super().__init__(DataLoader(*args, **kw))
        if self._untag is not None:
            self.append(self._untag)
        if device is not None:
            from .gpu import ToDevice

            self.append(ToDevice(device))
        self._auto_epoch = 0  # the epoch of the next pass
        self._pass_epoch = 0  # the epoch of the current (or loaded) pass

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._auto_epoch = epoch
        if self._dataset is not None and hasattr(self._dataset, "set_epoch"):
            self._dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator:
        dataset = self._dataset
        resuming = self._blocker is None and dataset is not None and dataset.has_worker_states
        # A resumed pass continues its epoch; so does a pass whose iterator was never advanced (Lightning
        # calls iter() once only to check that the loader is iterable): an epoch is used by reading it.
        unread = not self._progress[2] and self._resume_progress is None
        epoch = self._pass_epoch if resuming or unread else self._auto_epoch
        if dataset is not None and hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)  # before the workers start: each pass a new order
        if resuming and dataset is not None and self._resumed_pass_is_over():
            # the saved pass had yielded all its items (with_epoch): it resumes as an empty pass,
            # which starts no worker, so nothing would take the worker states; the next pass is fresh
            dataset.set_worker_states(None)
            resuming = False
        if not resuming and self._untag is not None:
            self._untag.resume(0, set(), {})  # a new pass: no worker has delivered anything yet
        self._pass_epoch, self._auto_epoch = epoch, epoch + 1
        return super().__iter__()

    def state_dict(self, strict: bool = False, gather: bool = False) -> dict:
        """Every worker's dataset state at the last item yielded, and which worker comes next: plain JSON.

        Lightning calls this with every checkpoint: a loader that cannot be resumed exactly (see
        :meth:`resume_blocker`) never raises here but gives an inexact state holding the epoch, which
        :meth:`load_state_dict` turns into a restart of that epoch; ``strict=True`` raises
        :class:`~wds_cloud.errors.NotResumableError` instead.

        ``gather=True``: the states of every rank, gathered over ``torch.distributed`` (a collective: every
        rank calls it at the same step) and merged (:func:`wds_cloud.merge_states`): every rank gets the same
        state, which a loader of any number of ranks and workers can load.
        """
        if gather:
            try:
                own = self._own_state(True)
            except StateMismatchError as exc:  # still gathered: the other ranks must not wait in the collective
                own = {"format": "wds_cloud.unavailable", "reason": str(exc)[:2000]}
            states = gather_states(own)
            failed = [(rank, s.get("reason")) for rank, s in enumerate(states) if s.get("format") == "wds_cloud.unavailable"]
            if failed:
                raise NotResumableError(f"state_dict(gather=True): rank {failed[0][0]} could not take its state "
                                        f"({failed[0][1]})" + (f"; and {len(failed) - 1} more rank(s)"
                                                               if len(failed) > 1 else ""))
            return merge_states(states)
        return self._own_state(strict)

    def _own_state(self, strict: bool) -> dict:
        # The pass has ended when its iterator said so (Lightning's fetcher asks one item ahead, so it
        # has at the checkpoint after an epoch's last batch) or, with a declared length, when that many
        # items were yielded (where Lightning ends a sized epoch): the state then starts the next epoch.
        progress = self._progress
        ended = self._resume_progress is None and (
            progress[3] or (self._has_length and self.size is not None and progress[1] >= self.size > 0))
        if ended and self._untag is not None:
            rank, world_size = _rank()
            return seal({"format": LOADER_FORMAT, "num_workers": self._untag.num_workers, "next": 0, "exhausted": [],
                         "epoch": self._auto_epoch, "workers": [], "progress": [0, 0], "rank": rank,
                         "world_size": world_size})
        try:
            return seal(self._exact_state())
        except StateMismatchError as exc:  # NotResumableError, or a shuffle after the workers holding items
            if strict:
                raise exc if isinstance(exc, NotResumableError) else NotResumableError(
                    f"this WebLoader cannot save a resumable state now: {exc}") from exc
            return seal(inexact_state(LOADER_FORMAT, str(exc), epoch=self._auto_epoch if ended else self._pass_epoch))

    def resume_blocker(self) -> Optional[str]:
        """Why this loader's states cannot be resumed exactly (None: they can, at batch boundaries)."""
        return None if self._untag is not None else self._blocker

    def _exact_state(self) -> dict:
        if self._untag is None:
            raise NotResumableError(f"this WebLoader cannot save a resumable state: {self._blocker}")
        for stage in self.pipeline[2:]:
            if is_buffering(stage):
                stage.state_dict()  # raises if its buffer holds items, which cannot be fetched again
        untag = self._untag
        next_worker, exhausted, states = untag.current()
        for worker, state in states.items():
            if isinstance(state, loaderstate.Unavailable):
                raise NotResumableError(f"this WebLoader cannot save a resumable state: DataLoader worker "
                                        f"{worker} could not take its dataset's state: {state.reason}")
            if is_inexact(state):
                raise NotResumableError(f"this WebLoader cannot save a resumable state: DataLoader worker "
                                        f"{worker}: {state['inexact']}")
        rank, world_size = _rank()
        return {"format": LOADER_FORMAT, "num_workers": untag.num_workers, "next": next_worker,
                "exhausted": sorted(exhausted), "epoch": self._pass_epoch,
                "workers": [[w, loaderstate.jsonable(s)] for w, s in sorted(states.items())],
                "progress": self._current_progress(), "rank": rank, "world_size": world_size}

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass continue where ``state`` (from :meth:`state_dict`) stood.

        An inexact state (see :meth:`state_dict`) is logged and makes the next pass begin its
        epoch again.
        """
        if is_merged(state):
            self._load_merged(state)
            return
        if not isinstance(state, dict) or state.get("format") != LOADER_FORMAT:
            raise StateMismatchError("not a WebLoader state: pass the dict that WebLoader.state_dict() returned "
                                     "(or merge_states() of every rank's)", field="format")
        if is_inexact(state):
            check_seal(state, "WebLoader")
            restart_from(state, "WebLoader")
            epoch = state.get("epoch", 0)
            self._pass_epoch = self._auto_epoch = epoch if type(epoch) is int and epoch >= 0 else 0
            self._resume_progress = None
            return
        if self._untag is None:
            raise NotResumableError(f"this WebLoader cannot load a state: {self._blocker}")
        expect(state, "WebLoader", dict, num_workers=(int, lambda n: n >= 0), next=(int, lambda n: n >= 0),
               exhausted=(list, lambda v: all(type(w) is int and w >= 0 for w in v)),
               workers=(list, lambda v: all(isinstance(e, (list, tuple)) and len(e) == 2 and type(e[0]) is int
                                            and e[0] >= 0 and isinstance(e[1], dict) for e in v)),
               epoch=(int, lambda n: n >= 0, True),
               progress=(list, lambda v: len(v) == 2 and all(type(x) is int and x >= 0 for x in v), True))
        check_same("WebLoader", {"num_workers": state["num_workers"]}, {"num_workers": self._untag.num_workers})
        workers = {w: s for w, s in state["workers"]}
        slots = max(self._untag.num_workers, 1)  # no workers: the main process is worker 0
        if any(w >= slots for w in workers) or state["next"] > slots:
            raise StateMismatchError("the saved WebLoader state names a worker this loader does not have: the state "
                                     "was changed; load the state that state_dict() returned", field="workers")
        check_seal(state, "WebLoader")  # after the fields, so that a changed one is named
        self._untag.resume(state["next"], set(state["exhausted"]), workers)
        dataset = self._dataset
        assert dataset is not None  # a loader without a dataset has a resume blocker
        dataset.set_worker_states(dict(workers))
        self._pass_epoch = state.get("epoch", 0)
        self._auto_epoch = self._pass_epoch + 1
        self._resume_progress = list(state.get("progress") or (0, 0))

    def _load_merged(self, state: dict) -> None:
        """Continue the epoch of a merged state with this rank's share, each worker taking its own."""
        if self._untag is None:
            raise NotResumableError(f"this WebLoader cannot load a state: {self._blocker}")
        dataset = self._dataset
        assert dataset is not None  # a loader without a dataset has a resume blocker
        check_merged(state)
        dataset.check_level(state["pipeline"])
        # each worker's share, computed here: it stays that worker's state until the worker delivers, so a state
        # taken before then (on this shape, or merged again) still holds it
        rank, world_size = _rank()
        workers = max(1, self._untag.num_workers)
        starts = {w: dataset.elastic_start(state, rank, world_size, w, workers) for w in range(workers)}
        self._untag.resume(0, set(), starts)
        dataset.set_worker_states(dict(starts))
        self._pass_epoch = state["epoch"]
        self._auto_epoch = self._pass_epoch + 1
        loader = state.get("loader")
        passes = loader["pass"] if loader else 0
        if loader and self.repetitions != 1 and self.nsamples > 0:  # with_epoch on the loader: the items left
            rank, world_size = _rank()
            left = items_share(loader["items"], loader["ranks"], self.nsamples, rank, world_size)
            self._resume_progress = [passes, max(0, self.nsamples - left)]
        else:
            self._resume_progress = [passes, 0]


def _rank() -> tuple[int, int]:
    rank, world_size, _, _ = utils.pytorch_worker_info()
    return rank, world_size


def gather_states(state: dict) -> list:
    """``state`` of every rank, gathered over ``torch.distributed`` (every rank must call this at the same step);
    ``[state]`` alone on one process."""
    rank, world_size = _rank()
    if world_size == 1:
        return [state]
    dist = utils.torch_distributed_module()
    if dist is None:
        raise ConfigError(f"state_dict(gather=True) on rank {rank} of {world_size}: gathering the ranks' states needs "
                          "an initialized torch.distributed process group (torch.distributed.init_process_group); "
                          "without one, save each rank's state_dict() and merge them with wds.merge_states(states)")
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, state)
    return gathered


def _resume_blocker(dataset: Any, args: list, kw: dict) -> Optional[str]:
    """Why a WebLoader over ``dataset`` cannot save states (None: it can), known before iterating."""
    if not isinstance(dataset, Resumable):
        return (f"its dataset ({type(dataset).__name__}) has no state_dict/load_state_dict; give it a "
                "WebDataset or DataPipeline")
    if kw.get("sampler") or kw.get("batch_sampler") or any(a is not None for a in args[3:5]):
        return "it was given a sampler; a resumable WebLoader takes its items in the dataset's own order"
    if not isinstance(dataset, DataPipeline):
        return (f"its dataset ({type(dataset).__name__}) cannot take a state per DataLoader worker; give it a "
                "WebDataset or DataPipeline")
    return dataset.resume_blocker()


# mixed datasets: a spec of several sources (``WebDataset("train.yaml")``)
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

    def __init__(self, urls: Any, handler: Any = reraise_exception, seed: Optional[int] = None,
                 storage_options: Optional[dict] = None, nodesplitter: Any = shardlists.split_by_node,
                 **kwargs: Any) -> None:
        DataPipeline.__init__(self)
        spec = load_spec(urls, storage_options)
        settings = config.current()
        base_seed = spec.seed if spec.seed is not None else (
            seed if seed is not None else (settings.seed if settings.seed is not None else 0))
        self.seed = base_seed
        self.sample_seed = base_seed if (spec.seed is not None or seed is not None or settings.seed is not None) \
            else None
        self.spec = spec
        self.storage_options = storage_options
        kwargs.pop("shardshuffle", None)  # per source, in the spec
        kwargs.pop("resampled", None)
        if kwargs.get("streams") is not None:
            raise ConfigError("streams= is not available for a mix of sources (each source draws per rank and "
                              "worker); a mix resumes on another shape through wds.merge_states() instead")
        datasets = []
        for number, source in enumerate(spec.sources):
            ds = WebDataset(list(source.urls), handler=handler, resampled=source.resampled,
                            shardshuffle=source.shardshuffle and not source.resampled,
                            seed=utils.make_seed(base_seed, number, source.name), nodesplitter=nodesplitter,
                            storage_options=_source_options(source, storage_options), **kwargs)
            if source.shuffle:
                ds = ds.shuffle(source.shuffle, seed=utils.make_seed(base_seed, "shuffle", source.name))
            datasets.append(ds)
        self.sources = datasets
        self._mix = MixSource([s.name for s in spec.sources], datasets, [s.weight for s in spec.sources],
                              [s.resampled for s in spec.sources], base_seed, spec.samples_per_epoch)
        self.append(self._mix)

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
