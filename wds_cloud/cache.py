"""Opening shards, directly or through the local shard cache (``webdataset.cache``'s module path).

``StreamingOpen`` opens each shard URL with ``gopen``.  ``FileCache`` is the
pipeline stage of the shard cache (:mod:`wds_cloud.io.shardcache`): stream while
filling, one download per shard across processes, bounded by LRU eviction.
Local files are read in place, never copied, unless asked.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

from . import config
from .errors import ConfigError, redact
from .handlers import reraise_exception
from .io.atomic import AtomicFile
from .io.backend import skip
from .io.integrity import Verifying
from .io.open import Bounded, gopen
from .io.parallel import Fetcher
from .io.resilient import StatsSink, TransferStats
from .io.shardcache import ShardCache
from .io.urls import is_local, local_path, pipe_cleaner, url_to_cache_name
from .resume.arguments import as_size
from .stages import PipelineStage
from .utils import obsolete

__all__ = [
    "FileCache",
    "StreamingOpen",
    "url_to_cache_name",
    "download",
    "check_tar_format",
    "pipe_cleaner",
    "LRUCleanup",
    "cached_url_opener",
    "islocal",
    "magic_filetype",
    "obsolete",
    "default_cache_dir",  # noqa: F822 (read from the settings when asked, see __getattr__)
    "default_cache_size",  # noqa: F822
    "verbose_cache",  # noqa: F822
]

log = logging.getLogger(__name__)

_MAGIC_OK = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")


def check_tar_format(fname: str) -> bool:
    """True if ``fname`` starts like a tar file (plain, gzip, bz2, xz or zstd); needs no ``file`` command."""
    with open(fname, "rb") as f:
        head = f.read(512)
    if head.startswith(_MAGIC_OK):
        return True
    return len(head) == 512 and (head[257:262] == b"ustar" or head == bytes(512) or _plausible_v7(head))


def _plausible_v7(head: bytes) -> bool:
    try:
        stored = int(head[148:154].strip(b"\0 ") or b"0", 8)
    except ValueError:
        return False
    return stored == sum(head[:148]) + 256 + sum(head[156:])


def download(url: str, dest: str, chunk_size: int = 1 << 20, verbose: bool = False) -> str:
    """Copy ``url`` to the local file ``dest`` (atomically); returns ``dest``."""
    with gopen(url) as stream, AtomicFile(dest) as out:
        while True:
            data = stream.read(chunk_size)
            if not data:
                break
            out.write(data)
    if verbose:
        log.info("downloaded %s to %s", redact(url), dest)
    return dest


class LRUCleanup:
    """Delete the least recently used files of ``cache_dir`` until it holds at most ``cache_size`` bytes."""

    def __init__(
        self,
        cache_dir: Optional[str] = None,
        cache_size: int = int(1e12),
        keyfn: Callable[[str], float] = os.path.getatime,
        verbose: bool = False,
        interval: float = 30,
    ) -> None:
        self.cache_dir = cache_dir
        self.cache_size = cache_size
        self.keyfn = keyfn
        self.verbose = verbose
        self.interval = interval
        self.last_run = 0.0

    def set_cache_dir(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir

    def cleanup(self, protect: Iterable[str] = ()) -> None:
        if self.cache_dir is None or (self.interval and time.time() - self.last_run < self.interval):
            return
        self.last_run = time.time()
        protect = {os.path.abspath(p) for p in protect}
        files = []
        for root, _, names in os.walk(self.cache_dir):
            for name in names:
                if name.endswith(".partial") or name.startswith("."):
                    continue
                path = os.path.join(root, name)
                try:
                    files.append((self.keyfn(path), os.path.getsize(path), path))
                except OSError:
                    continue
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.cache_size:
                break
            if os.path.abspath(path) in protect:
                continue
            try:
                os.unlink(path)
                total -= size
                if self.verbose:
                    log.info("cache: evicted %s", path)
            except OSError:
                pass

    def __call__(self, *args: Any, **kw: Any) -> None:
        self.cleanup(*args, **kw)


class StreamingOpen(PipelineStage):
    """Open each ``{"url": ...}``, adding ``stream`` (and ``local_path`` for local files).

    Remote shards are read as parallel ranged parts, and the shards named by ``prefetch(urls)``
    are requested ahead (:mod:`wds_cloud.io.parallel`; ``transfer`` holds ``part_size``,
    ``concurrency``, ``max_concurrency``, ``prefetch``); the rest goes through ``gopen``.
    """

    def __init__(
        self,
        handler: Callable = reraise_exception,
        storage_options: Optional[dict] = None,
        retries: Optional[int] = None,
        timeout: Optional[float] = None,
        stats: Any = None,
        transfer: Optional[dict] = None,
        manifest: Any = None,
    ) -> None:
        self.handler = handler
        self.storage_options = storage_options
        self.retries = retries
        self.timeout = timeout
        self.stats = stats if stats is not None else StatsSink()
        self.fetcher = Fetcher(storage_options, retries, timeout, self.stats, **(transfer or {}))
        #: shards are checked against it while they are read (see wds_cloud.manifest)
        self.manifest = manifest

    def prefetch(self, urls: Iterable[str]) -> None:
        """The shards that come next, in order (an empty list: none; what was fetched ahead is cancelled)."""
        self.fetcher.prefetch(list(urls))

    @property
    def prefetch_depth(self) -> int:
        return self.fetcher.depth

    def local_path(self, url: str) -> Optional[str]:
        """The ``local_path`` :meth:`open` reports for ``url`` (the file itself, for a local one)."""
        return _local_path(url)

    def open(self, url: str, offset: int = 0) -> dict:
        """``{"stream": ..., "local_path": ...}`` for ``url``, read from byte ``offset``."""
        stream = _verifying(self.manifest, url, offset, self.fetcher.open(url, offset))
        out: dict[str, Any] = {"stream": stream}
        local = self.local_path(url)
        if local is not None:
            out["local_path"] = local
            _count_local(self.stats, stream, local, offset)
        return out

    def open_range(self, url: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of ``url`` (a ranged read)."""
        return gopen(
            url,
            "rb",
            offset=start,
            length=end - start,
            storage_options=self.storage_options,
            retries=self.retries,
            timeout=self.timeout,
            stats=self.stats,
        )

    def run(self, src: Iterable[Any]) -> Iterator[dict]:
        return _open_each(self, src)


def _open_each(stage: Any, src: Iterable[Any]) -> Iterator[dict]:
    """``stage.open`` each shard item (a ``{"url": ...}`` dict, or a bare URL string), errors to its handler."""
    for sample in src:
        if isinstance(sample, str):
            sample = {"url": sample}
        try:
            opened = stage.open(sample["url"])
        except Exception as exn:
            if stage.handler(exn):
                continue
            break
        yield dict(sample, **opened)


def _count_local(stats: Any, stream: Any, path: str, offset: int) -> None:
    """Count a local shard file in ``stats``: its size from ``offset`` (one stat per shard, none per read)."""
    try:
        size = os.fstat(stream.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # a wrapped stream (a manifest check): the path then
        try:
            size = os.stat(path).st_size
        except OSError:
            size = 0
    stats.add(TransferStats(local_files=1, local_bytes=max(0, size - offset)))


def _local_path(url: str) -> Optional[str]:
    return local_path(url) if is_local(url) else None


class FileCache(PipelineStage):
    """Serve shards through a local cache directory shared by every process on the machine.

    On a miss the shard streams to the consumer while it is written to the cache (the first
    sample does not wait for the download); processes that want the same shard meanwhile read
    what has arrived instead of downloading it again; the entry is published only complete and
    checked; ``cache_size`` bounds the directory by least-recently-used eviction.  Local files
    are read in place unless ``cache_local=True``.  See :mod:`wds_cloud.io.shardcache`.
    """

    def __init__(
        self,
        cache_dir: Optional[str] = None,
        *,
        url_to_name: Callable[[str], str] = url_to_cache_name,
        verbose: bool = False,
        validator: Callable[[str], bool] = check_tar_format,
        handler: Callable = reraise_exception,
        cache_size: Any = -1,
        cache_cleanup_interval: float = 30,
        storage_options: Optional[dict] = None,
        retries: Optional[int] = None,
        timeout: Optional[float] = None,
        stats: Any = None,
        cache_local: bool = False,
        verify: bool = False,
        transfer: Optional[dict] = None,
        manifest: Any = None,
    ) -> None:
        self.retries = retries
        self.manifest = manifest
        self.timeout = timeout
        self.stats = stats if stats is not None else StatsSink()
        self.cache_dir = os.path.expanduser(cache_dir or config.current().cache_dir or "~/.cache/wds_cloud")
        self.url_to_name = url_to_name
        self.verbose = verbose or config.current().verbose_cache  # WDS_VERBOSE_CACHE=1 turns it on everywhere
        self.validator = validator  # accepted for compatibility; entries are checked by size and checksum
        self.handler = handler
        self.storage_options = storage_options
        self.cache_local = cache_local
        self.cache_size = _cache_size(cache_size)
        self.cache = ShardCache(
            self.cache_dir, self.cache_size, url_to_name=url_to_name, stats=self.stats, verify=verify
        )
        self.fetcher = Fetcher(storage_options, retries, timeout, self.stats, **(transfer or {}))
        os.makedirs(self.cache_dir, exist_ok=True)

    def path_for(self, url: str) -> str:
        return self.cache.path_for(url)

    def prefetch(self, urls: Iterable[str]) -> None:
        """The shards that come next: those not cached yet are requested ahead (see :class:`StreamingOpen`)."""
        self.fetcher.prefetch(
            [u for u in urls if _local_path(u) is None and not os.path.exists(self.cache.path_for(u))]
        )

    @property
    def prefetch_depth(self) -> int:
        """Shards fetched ahead: none unless the dataset asked (``prefetch=``).  Processes sharing the
        cache download each shard once; a shard fetched ahead here while another process fills its
        entry would be downloaded twice in part."""
        return self.fetcher.given.get("prefetch", 0)

    def _remote(self, url: str, offset: int = 0, length: Optional[int] = None) -> Any:
        if length is None:  # the stream the cache tees into its entry: parallel parts where possible
            stream = self.fetcher.open(url, offset)
            entry = self.manifest.entry(url) if self.manifest is not None else None
            if entry is not None and entry.get("md5"):
                stream.md5 = entry["md5"]  # the cache checks a fill against it before publishing
            return stream
        return gopen(
            url,
            "rb",
            offset=offset,
            length=length,
            storage_options=self.storage_options,
            retries=self.retries,
            timeout=self.timeout,
            stats=self.stats,
        )

    def local_path(self, url: str) -> str:
        """The ``local_path`` :meth:`open` reports for ``url``: the file itself where local files are read in
        place, else its cache entry."""
        local = _local_path(url)
        if local is not None and not self.cache_local:
            return local
        return self.cache.path_for(url)

    def open(self, url: str, offset: int = 0) -> dict:
        """``{"stream": ..., "local_path": ...}`` for ``url`` through the cache, read from byte ``offset``.

        A resumed read (``offset`` > 0) of a shard not yet cached streams it from its start, so
        the entry is complete; the bytes before ``offset`` are skipped here.
        """
        local = _local_path(url)
        if local is not None and not self.cache_local:  # local files are read in place
            return {
                "stream": _verifying(self.manifest, url, offset, gopen(url, "rb", offset=offset)),
                "local_path": self.local_path(url),
            }
        os.makedirs(self.cache.directory, exist_ok=True)
        stream = self.cache.open(url, functools.partial(self._remote, url))
        if self.verbose:
            log.info("cache: %s via %s", redact(url), self.cache.path_for(url))
        if offset:
            try:
                if hasattr(stream, "seek") and hasattr(stream, "fileno"):
                    stream.seek(offset)
                else:
                    skip(stream.read, offset)
            except BaseException:
                stream.close()
                raise
        return {"stream": _verifying(self.manifest, url, offset, stream), "local_path": self.local_path(url)}

    def open_range(self, url: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of ``url``: from the cached copy when there is one, else a ranged read."""
        local = _local_path(url)
        if local is not None and not self.cache_local:
            return gopen(url, "rb", offset=start, length=end - start)
        entry = self.cache._open_entry(self.cache.path_for(url))
        if entry is None:
            return self._remote(url, start, end - start)
        entry.seek(start)
        return _bounded(entry, end - start)

    def run(self, src: Iterable[Any]) -> Iterator[dict]:
        return _open_each(self, src)


def _cache_size(value: Any) -> int:
    """``FileCache``'s ``cache_size`` in bytes, parsed as ``WebDataset(cache_size=...)`` parses it (``50GB``, ``1e10``,
    ``1.5TiB``; the range of ``WDS_CACHE_SIZE``); -1 (the default), None and 0 leave the directory unbounded, as
    webdataset's ``FileCache`` does (it cleans up only for a size above 0; "no cache" is ``url_opener``)."""
    if isinstance(value, str) and not value.strip():
        raise ConfigError(
            f"cache_size={value!r} is empty: give a size in bytes (4096, 50GB, 1.5TiB), or -1 for no bound"
        )
    value = as_size("cache_size", value, least=-1)
    if value is None or value == -1:
        return -1
    return config.parse_size("cache_size", value)


def _verifying(manifest: Any, url: str, offset: int, stream: Any) -> Any:
    """``stream`` hashed as it is read, when a manifest is given (a read resumed mid-shard is not checked:
    it does not see the whole shard)."""
    if manifest is None or offset:
        return stream
    try:
        entry = manifest.entry(url)
    except BaseException:
        stream.close()
        raise
    return Verifying(stream, url, entry) if entry is not None else stream


def _bounded(stream: Any, length: int) -> Any:
    """At most ``length`` bytes of ``stream``."""
    return Bounded(stream, length)


def cached_url_opener(
    data: Iterable[dict], handler: Callable = reraise_exception, cache_dir: Optional[str] = None, **kw: Any
) -> Iterator[dict]:
    """Functional form of :class:`FileCache`."""
    return FileCache(cache_dir, handler=handler, **kw).run(data)


# webdataset 1.0.2's other names at this path

#: the cache folder when none is given (``WDS_CACHE``), its size bound (``WDS_CACHE_SIZE``, bytes) and whether
#: caching is logged (``WDS_VERBOSE_CACHE``): webdataset reads them once at import; here they are this process's
#: settings when asked, as ``FileCache`` uses them
_SETTINGS = {
    "default_cache_dir": lambda s: os.path.expanduser(s.cache_dir or "~/.cache/wds_cloud"),
    "default_cache_size": lambda s: float(s.cache_size) if s.cache_size is not None else 1e18,
    "verbose_cache": lambda s: int(bool(s.verbose_cache)),
}


def __getattr__(name: str) -> Any:
    if name in _SETTINGS:
        return _SETTINGS[name](config.current())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def islocal(url: str) -> bool:
    """Whether ``url`` names a local file (a bare path or ``file:``)."""
    return is_local(url)


def magic_filetype(fname: str) -> str:
    """What the first bytes of the file ``fname`` say it is, in ``file``'s words: ``"<fname>: gzip compressed
    data"``, ``"<fname>: POSIX tar archive"`` or ``"<fname>: data"``."""
    with open(fname, "rb") as f:
        head = f.read(512)
    if head[:2] == b"\x1f\x8b":
        return f"{fname}: gzip compressed data"
    if head[257:262] == b"ustar":
        return f"{fname}: POSIX tar archive"
    return f"{fname}: data"
