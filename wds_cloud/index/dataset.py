"""Random access to samples in shards anywhere: a map-style dataset and samplers that keep locality.

:class:`ShardListDataset` takes the shape and arguments of ``wids.ShardListDataset`` (so code written
for ``wids`` runs through ``wds_cloud.wids``), but a sample is one bounded ranged read of its fields
(adjacent fields in one request) through the same backends, retries, version checks and statistics as
streaming, guided by each shard's member index (:mod:`wds_cloud.index`): the sidecar written by
``wds-cloud index``, or one built by reading the shard once on first use.  ``cache_dir=`` keeps whole
shards locally instead (the cheaper choice when most of each shard is read).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import os
import random
import threading
import urllib.parse
import warnings
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Union

from .. import config
from ..errors import ConfigError, CorruptIndexError, MalformedDataError, ObjectChangedError, RandomAccessError, redact
from ..io.descriptions import read_description
from ..io.open import gopen, rewrite_url
from ..io.resilient import StatsSink, TransferStats
from ..io.security import resolve, resolve_base
from ..io.shardcache import ShardCache
from ..io.urls import is_local
from ..shardlists import expand_urls as _expand
from ..tar.buffers import unreadable
from ..tar.decompress import open_decompressed
from .formats import ShardIndex, iter_wids, parse_wids
from .held import IndexCache, ShardTable
from .sidecar import check_fresh, index_of, read_range

__all__ = [
    "ShardListDataset",
    "ShardListSampler",
    "ShardedSampler",
    "ChunkedSampler",
    "DistributedChunkedSampler",
    "IndexedTarSamples",
    "default_decoder",
]

try:  # torch is optional: without it the dataset and samplers are plain Python classes
    from torch.utils.data import Dataset as _Dataset
    from torch.utils.data import Sampler as _Sampler
except ImportError:  # pragma: no cover - exercised without torch
    _Dataset = object  # type: ignore[assignment,misc]
    _Sampler = object  # type: ignore[assignment,misc]


def _resolve(base: Optional[str], url: str) -> str:
    if base is None or "://" in url or url.startswith("/") or url.startswith("pipe:"):
        return url
    return (
        urllib.parse.urljoin(base if base.endswith("/") else base + "/", url)
        if "://" in base
        else os.path.join(base, url)
    )


def _is_description(name: str) -> bool:
    return name.endswith((".json", ".json.gz", ".jsonl", ".jsonl.gz"))


def default_decoder(sample: dict, format: str = "PIL") -> dict:
    """Decode a wids-shaped sample (fields keyed ``.ext``): images to PIL (or numpy), ``.txt``/``.cls``/
    ``.json`` and the other basic types as the streaming decoder does."""
    from ..autodecode import Decoder, imagehandler

    spec = {"pil": "pil", "numpy": "rgb8"}.get(str(format).lower())
    if spec is None:
        raise ConfigError(f"unknown decoding format {format!r}: use 'PIL' or 'numpy'")
    plain = {(k[1:] if k.startswith(".") else k): v for k, v in sample.items()}
    decoded = Decoder([imagehandler(spec)])(plain)
    return {("." + k if not k.startswith("__") else k): v for k, v in decoded.items()}


def _transformations(spec: Any) -> list[Callable]:
    items = spec if isinstance(spec, list) else [spec]
    out: list[Callable] = []
    for item in items:
        if item is None:
            continue
        if isinstance(item, str):
            fmt = item
            out.append(functools.partial(default_decoder, format=fmt))  # (a partial pickles, for workers)
        elif callable(item):
            out.append(item)
        else:
            raise ConfigError(f"a transformation must be a callable, 'PIL' or 'numpy', not {item!r}")
    return out


class ShardListDataset(_Dataset):
    """Samples of a list of shards, by index (see the module docstring).

    ``shards``: a ``wids`` dataset description (a URL or path of its JSON, or the dict), a list of
    ``{"url": ..., "nsamples": ...}``, or shard URLs / a brace spec (indexed on first use).  A sample
    is ``{"__key__", ".ext": bytes, ..., "__index__", "__shard__", "__shardindex__", "__dataset__"}``
    after ``transformations`` (``"PIL"``, the default, decodes as wids does; ``[]`` keeps bytes).
    ``compressed``: what a compressed shard does: ``"error"`` (a :class:`RandomAccessError` naming
    the fix) or ``"load"`` (it is read and decompressed whole once, then served from memory).
    ``manifest``: a manifest (see :mod:`wds_cloud.manifest`) every indexed shard must match.
    """

    def __init__(
        self,
        shards: Any,
        *,
        cache_size: int = int(1e12),
        cache_dir: Optional[str] = None,
        lru_size: int = 10,
        dataset_name: Optional[str] = None,
        localname: Any = None,
        transformations: Any = "PIL",
        keep: bool = False,
        base: Optional[str] = None,
        options: Optional[dict] = None,
        storage_options: Optional[dict] = None,
        compressed: str = "error",
        manifest: Any = None,
        retries: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> None:
        if compressed not in ("error", "load"):
            raise ConfigError(
                f"compressed={compressed!r}: use 'error' (refuse random access to compressed shards) "
                "or 'load' (decompress each such shard whole, once)"
            )
        self.storage_options = storage_options
        self.retries, self.timeout = retries, timeout
        self.compressed = compressed
        self.spec: dict = dict(options or {})
        where = ""
        rows: Iterator[dict]
        if isinstance(shards, str) and _is_description(shards):
            where = shards  # a description read from a file is data: its URLs are resolved against it, untrusted
            spec = read_description(shards, storage_options)
            rows = iter_wids(spec, shards)  # one row at a time: a description of one shard a line is streamed
            # what stays is the description's own fields; its shards live compactly in self.shards
            self.spec = dict({k: v for k, v in spec.items() if k not in ("shardlist", "datasets")}, **(options or {}))
        elif isinstance(shards, dict):
            self.spec = dict(shards, **(options or {}))
            rows = iter(parse_wids(self.spec))
        elif isinstance(shards, str):
            rows = ({"url": u} for u in _expand(shards))
        else:
            rows = (s if isinstance(s, dict) else {"url": os.fspath(s)} for s in shards)
        self.shards = ShardTable()
        if where:
            folder = (
                resolve_base(base, where)
                if base
                else (resolve_base(spec["base"], where) if spec.get("base") is not None else None)
            )
            bases: dict[str, str] = {}
            for s in rows:
                own = s.get("base")
                if own is not None and own not in bases:
                    bases[own] = resolve_base(own, where, "datasets[].base")
                self.shards.append(s, resolve(s["url"], where, base=bases.get(own, folder) if own else folder))
            if not self.shards:
                raise MalformedDataError(f"{redact(where)}: the dataset description lists no shards", field="shardlist")
            base = folder
        else:
            base = base or self.spec.get("base")
            for s in rows:
                self.shards.append(s, _resolve(s.get("base", base), s["url"]))
        if not self.shards:
            raise ConfigError("ShardListDataset was given no shards")
        self.base = base
        self.dataset_name = dataset_name or self.spec.get("name")
        self.transformations = _transformations(transformations)
        self.manifest = manifest
        self.cache_dir = cache_dir
        self.cache_size = cache_size
        self.lru_size = lru_size
        self._stats = StatsSink()
        self.index_cache = config.current().index_cache  # WDS_INDEX_CACHE, read when the dataset is made
        self._indexes = IndexCache(self.index_cache)
        self._loaded: dict[int, bytes] = {}  # decompressed shards (compressed="load"), a few at a time
        self._held: dict[int, list] = {}  # local shards held open: [descriptor, (mtime, size) last checked]
        self._lock = threading.Lock()
        self._streamed: set[int] = set()  # shards that are not local files
        self._cum: Optional[array] = None
        if self.shards.all_counted():
            self._set_lengths(self.shards.counts["nsamples"])
            self._warn_of_empty_shards()

    def __getstate__(self) -> dict:  # a spawned DataLoader worker starts without the decompressed shards
        state = dict(self.__dict__)
        state["_loaded"] = {}
        state["_held"] = {}  # descriptors stay in the process that opened them
        state["_indexes"] = IndexCache(self.index_cache)  # a worker loads what it reads, within its own bound
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # lengths
    def _set_lengths(self, lengths: Sequence[int]) -> None:
        # 8 bytes a shard each (10^7 shards: 160 MB as lists of ints, 160 MB less as arrays)
        self.lengths = array("q", lengths)
        try:
            self._cum = array("q", itertools.accumulate(self.lengths))
        except OverflowError:
            raise MalformedDataError(
                "the shards' sample counts ('nsamples') add up to more than 2^63 samples; write the description again",
                field="nsamples",
            ) from None

    def _warn_of_empty_shards(self) -> None:
        """Say once per dataset when the description lists shards with no samples: they are never opened, so
        a count of 0 written by mistake would hide a shard's samples without a word."""
        empty = self.lengths.count(0)
        if empty:
            first = self.lengths.index(0)
            warnings.warn(
                f"the dataset description lists {empty} of {len(self.lengths)} shards with 'nsamples': 0 (the "
                f"first: {redact(self.shards.url(first))}); they are never read. If they hold samples, write the "
                "description again (wds-cloud index --format wids, or wids' own tool)",
                stacklevel=3,
            )

    def _ensure_lengths(self) -> array:
        if self._cum is None:
            self._set_lengths([len(self._index(i)) for i in range(len(self.shards))])
        assert self._cum is not None
        return self._cum

    def __len__(self) -> int:
        cum = self._ensure_lengths()
        return cum[-1] if cum else 0

    @property
    def stats(self) -> TransferStats:
        """Transfer figures of the reads this process made for the dataset."""
        return self._stats.snapshot()

    def add_transform(self, transform: Callable) -> ShardListDataset:
        self.transformations.append(transform)
        return self

    # indexes
    def _index(self, shard: int) -> ShardIndex:
        index = self._indexes.get(shard)
        if index is not None:
            return index
        url = self.shards.url(shard)
        index = index_of(url, self.storage_options)
        expected = self.shards.nsamples(shard)
        if expected is not None and expected != len(index):
            raise CorruptIndexError(
                f"{redact(url)}: the dataset description says {expected} samples ('nsamples'), "
                f"the shard's index {len(index)}; write the description (or the index) again",
                url=url,
                field="nsamples",
            )
        if self.manifest is not None:
            from ..io.manifest import check_index

            check_index(self.manifest, index)
        self._indexes.put(shard, index)
        return index

    def check_range(self, lo: int, hi: int) -> None:
        """Confirm the sample counts of the shards holding samples ``[lo, hi)`` against their indexes (a
        description's ``nsamples`` is a claim): a :class:`~wds_cloud.errors.CorruptIndexError` when one differs.
        The samplers ask before they list a large range."""
        cum = self._ensure_lengths()
        if hi <= lo or not cum:
            return
        first = bisect.bisect_right(cum, lo)
        last = bisect.bisect_right(cum, hi - 1)
        for shard in range(first, min(last, len(cum) - 1) + 1):
            self._index(shard)

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard, index within the shard)`` of sample ``index``."""
        cum = self._ensure_lengths()
        if index < 0:
            index += cum[-1]
        if not 0 <= index < cum[-1]:
            raise IndexError(f"sample {index} of a dataset of {cum[-1]} samples")
        shard = bisect.bisect_right(cum, index)
        return shard, index - (cum[shard - 1] if shard else 0)

    # reading
    def _bytes(self, shard: int, index: ShardIndex, start: int, end: int) -> bytes:
        url = index.url
        if index.compression is not None:
            return self._from_loaded(shard, index)[start:end]
        if self.cache_dir is not None:
            return self._from_cache(url, index, start, end)
        if shard not in self._streamed:
            with self._lock:  # a descriptor is never closed (by an eviction) while another thread reads it
                held = self._held.get(shard) or self._hold(shard, url, index)
                if held is not None:  # a local file: one fstat against the index, then one pread
                    st = os.fstat(held[0])
                    if (st.st_mtime_ns, st.st_size) != held[1]:
                        check_fresh(index, url, stat=st)
                        held[1] = (st.st_mtime_ns, st.st_size)
                    try:
                        data = os.pread(held[0], end - start, start)
                    except OSError as exc:
                        raise unreadable(url, start, exc) from exc
        if shard in self._streamed:
            return read_range(
                index,
                url,
                start,
                end,
                storage_options=self.storage_options,
                retries=self.retries,
                timeout=self.timeout,
                stats=self._stats,
            )
        if len(data) != end - start:
            raise ObjectChangedError(
                f"{redact(url)}: bytes {start}-{end} asked for, {len(data)} received: the shard "
                "is shorter than its index says; index it again",
                url=url,
                offset=start,
            )
        return data

    def _hold(self, shard: int, url: str, index: ShardIndex) -> Optional[list]:
        """Keep a local shard open (as ``gopen`` opens it: rewrites and the security policy apply) and check it
        against its index; None for a shard that is not a local file (it is read by ranged requests).

        A held file is read with ``pread``: a shard replaced later (a new file under the name) is still the
        file that was checked, so no byte of another version is returned; one changed in place is noticed by
        the ``fstat`` before each read.  At most ``lru_size`` are held."""
        if not is_local(rewrite_url(url)):
            self._streamed.add(shard)
            return None
        stream = gopen(url, "rb", storage_options=self.storage_options)
        try:
            fd = os.dup(stream.fileno())
        except (AttributeError, OSError, ValueError):
            self._streamed.add(shard)  # stdin, or a plugin's stream over a local path: read as before
            return None
        finally:
            stream.close()
        try:
            st = os.fstat(fd)
            check_fresh(index, url, stat=st)
        except BaseException:
            os.close(fd)
            raise
        while len(self._held) >= max(1, self.lru_size):
            os.close(self._held.pop(next(iter(self._held)))[0])
        held = self._held[shard] = [fd, (st.st_mtime_ns, st.st_size)]
        return held

    def _release(self) -> None:
        held, self._held = getattr(self, "_held", {}), {}
        for fd, _ in held.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self._release()

    def _from_cache(self, url: str, index: ShardIndex, start: int, end: int) -> bytes:
        cache = ShardCache(self.cache_dir or "", self.cache_size, stats=self._stats)
        path = cache.path_for(url)
        if not os.path.exists(path):

            def opener(offset: int) -> Any:
                return gopen(
                    url,
                    "rb",
                    offset=offset,
                    storage_options=self.storage_options,
                    retries=self.retries,
                    timeout=self.timeout,
                    stats=self._stats,
                )

            with cache.open(url, opener) as stream:  # fills the entry (one download across processes)
                while stream.read(1 << 20):
                    pass
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if index.size is not None and size != index.size:
                raise ObjectChangedError(
                    f"{redact(url)}: the cached shard has {size} bytes, its index says "
                    f"{index.size}: the shard changed since it was indexed; index it again "
                    "with `wds-cloud index` (and clear the cache entry)",
                    url=url,
                )
            f.seek(start)
            return f.read(end - start)

    def _from_loaded(self, shard: int, index: ShardIndex) -> bytes:
        if self.compressed == "error":
            raise RandomAccessError(
                f"{redact(index.url)}: a {index.compression}-compressed shard cannot be read at random (its "
                "samples are reached only by decompressing from the start); pass compressed='load' to decompress "
                "each such shard whole once, or reshard without compression: `wds-cloud reshard SRC DST "
                "--compress none`",
                url=index.url,
            )
        data = self._loaded.get(shard)
        if data is None:
            with gopen(index.url, "rb", storage_options=self.storage_options, stats=self._stats) as stream:
                plain, _ = open_decompressed(stream)
                chunks = []
                while True:
                    chunk = plain.read(1 << 20)
                    if not chunk:
                        break
                    chunks.append(chunk)
            data = b"".join(chunks)
            while len(self._loaded) >= max(1, min(self.lru_size, 4)):
                self._loaded.pop(next(iter(self._loaded)))
            self._loaded[shard] = data
        return data

    def __getitem__(self, index: int) -> dict:
        shard, inner = self.locate(int(index))
        shard_index = self._index(shard)
        entry = shard_index.samples[inner]
        start, end = entry.start, entry.end
        data = self._bytes(shard, shard_index, start, end)
        sample: dict = {"__key__": entry.key}
        for ext, offset, size, _ in entry.fields:
            sample["." + ext] = data[offset - start : offset - start + size]
        sample["__dataset__"] = self.shards.extra(shard, "dataset") or self.dataset_name
        sample["__index__"] = int(index)
        sample["__shard__"] = self.shards.url(shard)
        sample["__shardindex__"] = inner
        for transform in self.transformations:
            sample = transform(sample)
        return sample

    def get_stats(self) -> tuple[int, int]:
        """``(requests, 0)``: wids reports (cache accesses, misses); every read here is a request."""
        return self.stats.streams, 0

    def close(self) -> None:
        self._loaded.clear()
        self._release()

    def __repr__(self) -> str:
        return f"<ShardListDataset {len(self.shards)} shards>"


class IndexedTarSamples:
    """The samples of one shard by index (``wids.IndexedTarSamples``'s shape: ``{"__key__", ".ext": bytes}``)."""

    def __init__(
        self,
        *,
        path: Optional[str] = None,
        stream: Any = None,
        md5sum: Optional[str] = None,
        expected_size: Optional[int] = None,
        use_mmap: bool = True,
        index_file: Any = None,
    ) -> None:
        if path is None:
            raise ConfigError(
                "IndexedTarSamples needs path= (a local path or any URL); a stream is read through "
                "ShardListDataset([url])"
            )
        self.path = path
        self._dataset = ShardListDataset([path], transformations=[])
        if expected_size is not None and len(self) != expected_size:
            raise ConfigError(f"{redact(path)}: expected {expected_size} samples, the shard has {len(self)}")

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> dict:
        sample = self._dataset[index]
        return {k: v for k, v in sample.items() if k == "__key__" or k.startswith(".")}

    def close(self) -> None:
        self._dataset.close()


# samplers
def _ranges(lengths: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in lengths:
        out.append((start, start + n))
        start += n
    return out


#: a sampler lists the indexes of a range longer than this only after the dataset confirmed the range's
#: counts against the shards' indexes (a description may claim any count; memory follows only real ones)
CONFIRM_ABOVE = 1 << 16
#: the most ranges (chunks) a sampler lists before the whole dataset's counts are confirmed
CONFIRM_RANGES_ABOVE = 1 << 20


def _confirmer(dataset: Any) -> Callable[[int, int], None]:
    check = getattr(dataset, "check_range", None)
    return check if callable(check) else _unchecked


def _unchecked(lo: int, hi: int) -> None:
    """A range a sampler was given counts for (module level: a sampler pickles)."""


def _in_ranges(
    ranges: Sequence[tuple[int, int]],
    rng: random.Random,
    shuffle_items: bool,
    shuffle_ranges: bool,
    confirm: Callable[[int, int], None] = _unchecked,
) -> Iterator[int]:
    order = list(range(len(ranges)))
    if shuffle_ranges:
        rng.shuffle(order)
    for i in order:
        if ranges[i][1] - ranges[i][0] > CONFIRM_ABOVE:
            confirm(*ranges[i])
        items = list(range(*ranges[i]))
        if shuffle_items:
            rng.shuffle(items)
        yield from items


def _epoch_rng(seed: int, epoch: int) -> random.Random:
    return random.Random(seed + 1289738273 * epoch)  # the (seed, epoch) mixing wids uses: the same orders


class ShardListSampler(_Sampler):
    """Shards in a shuffled order, the samples of each shuffled (the first epoch keeps the shard order
    unless ``shufflefirst``); deterministic per (``seed``, epoch); the epoch advances each pass."""

    def __init__(
        self, dataset: Any, *, lengths: Optional[Sequence[int]] = None, seed: int = 0, shufflefirst: bool = False
    ) -> None:
        self.ranges = _ranges(
            list(lengths)
            if lengths is not None
            else list(dataset.lengths if hasattr(dataset, "lengths") else [len(dataset)])
        )
        if lengths is None and hasattr(dataset, "_ensure_lengths"):
            dataset._ensure_lengths()
            self.ranges = _ranges(dataset.lengths)
        self.seed, self.shufflefirst, self.epoch = seed, shufflefirst, 0
        self.confirm = _confirmer(dataset) if lengths is None else _unchecked

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        rng = _epoch_rng(self.seed, self.epoch)
        yield from _in_ranges(self.ranges, rng, True, self.shufflefirst or self.epoch > 0, self.confirm)
        self.epoch += 1

    def __len__(self) -> int:
        return self.ranges[-1][1] if self.ranges else 0


ShardedSampler = ShardListSampler


class ChunkedSampler(_Sampler):
    """Indexes in chunks of ``chunksize``: the chunks in a shuffled order, each chunk shuffled, so reads
    stay local; ``num_samples`` is a count or a ``(lo, hi)`` range (one rank's share)."""

    def __init__(
        self,
        dataset: Any,
        *,
        dslength_per_replica: int = -1,
        num_samples: Union[int, tuple[int, int], None] = None,
        chunksize: int = 2000,
        seed: int = 0,
        shuffle: bool = True,
        shufflefirst: bool = False,
    ) -> None:
        if isinstance(num_samples, int):
            lo, hi = 0, num_samples
        elif num_samples is None:
            lo, hi = 0, len(dataset)
        else:
            lo, hi = num_samples
        if chunksize < 1:
            raise ConfigError("ChunkedSampler needs chunksize >= 1")
        self.dslength_per_replica = dslength_per_replica if dslength_per_replica > 0 else hi - lo
        self.confirm = _confirmer(dataset)
        if (hi - lo) // chunksize > CONFIRM_RANGES_ABOVE:
            self.confirm(lo, hi)
        self.ranges = [(i, min(i + chunksize, hi)) for i in range(lo, hi, chunksize)]
        self.seed, self.shuffle, self.shufflefirst, self.epoch = seed, shuffle, shufflefirst, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        rng = _epoch_rng(self.seed, self.epoch)
        yield from _in_ranges(
            self.ranges, rng, self.shuffle, self.shuffle and (self.shufflefirst or self.epoch > 0), self.confirm
        )
        self.epoch += 1

    def __len__(self) -> int:
        return self.dslength_per_replica


def DistributedChunkedSampler(
    dataset: Any,
    *,
    num_replicas: Optional[int] = None,
    num_samples: Optional[int] = None,
    rank: Optional[int] = None,
    shuffle: bool = True,
    shufflefirst: bool = False,
    seed: int = 0,
    drop_last: Optional[bool] = None,
    chunksize: int = 1000000,
) -> ChunkedSampler:
    """A :class:`ChunkedSampler` over this rank's contiguous share of the dataset (rank and world size from
    ``torch.distributed`` when it is initialized, else ``RANK``/``WORLD_SIZE``, else one process)."""
    if drop_last is not None:
        warnings.warn("DistributedChunkedSampler ignores drop_last: every rank gets its contiguous share", stacklevel=2)
    settings = config.current()
    if num_replicas is None or rank is None:
        try:
            import torch.distributed as dist

            initialized = dist.is_available() and dist.is_initialized()
        except ImportError:
            initialized = False
        if initialized:
            num_replicas = num_replicas or dist.get_world_size()
            rank = rank if rank is not None else dist.get_rank()
        else:
            num_replicas = num_replicas or settings.world_size or 1
            rank = rank if rank is not None else (settings.rank or 0)
    if not 0 <= rank < num_replicas:
        raise ConfigError(f"rank {rank} is not one of the {num_replicas} replicas")
    total = num_samples or len(dataset)
    per = math.ceil(total / num_replicas)
    lo, hi = rank * per, min((rank + 1) * per, total)
    return ChunkedSampler(
        dataset,
        dslength_per_replica=math.ceil(len(dataset) / num_replicas),
        num_samples=(lo, hi),
        chunksize=chunksize,
        seed=seed,
        shuffle=shuffle,
        shufflefirst=shufflefirst,
    )
