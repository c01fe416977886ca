"""What a :class:`~wds_cloud.index.dataset.ShardListDataset` keeps, bounded: its shards, compactly, and the
indexes it loaded, least recently used dropped past ``WDS_INDEX_CACHE`` bytes.

A dataset of 10^7 shards and 10^10 samples keeps per shard its URL and two 8-byte counts (no dict per shard),
and of its indexes (about 250 bytes a sample and 225 a field as Python objects) only as many as the bound
allows, however many samples it serves.
"""

from __future__ import annotations

import collections
import threading
from array import array
from collections.abc import Iterator
from typing import Any, Optional

from .formats import ShardIndex

__all__ = ["ShardTable", "IndexCache", "index_bytes", "SAMPLE_BYTES", "FIELD_BYTES"]

#: the memory of a loaded index, measured with tracemalloc (keys of ~14 characters): per sample, and per field
SAMPLE_BYTES = 250
FIELD_BYTES = 225
#: an index's own object, its URL and the list of samples
INDEX_BYTES = 1024
_UNKNOWN = -1
#: the fields of a shard row kept in arrays; any other key of a row is kept as given, for that row only
_COUNTS = ("nsamples", "filesize")


def index_bytes(index: ShardIndex) -> int:
    """The memory ``index`` holds, estimated from its sample count and the fields of its first sample (the
    samples of a shard have the same fields, as a rule): constant work, whatever its size."""
    samples = index.samples
    fields = len(samples[0].fields) if samples else 0
    return INDEX_BYTES + len(samples) * (SAMPLE_BYTES + FIELD_BYTES * fields)


class ShardTable:
    """The shards of a dataset by position, compactly: URLs in a list, ``nsamples`` and ``filesize`` in 8-byte
    arrays (-1: not given), and whatever else a row holds (``dataset``, ``md5sum``, ``base``) only for the rows
    that hold it.  ``table[i]`` is the row as a new dict, as a list of rows would give it."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.counts = {name: array("q") for name in _COUNTS}
        self.extras: dict[int, dict] = {}

    def append(self, row: dict, url: Any) -> None:
        """Add ``row`` (a shard's mapping) under ``url`` (its URL as the dataset opens it)."""
        position = len(self.urls)
        extra = {}
        for name, column in self.counts.items():
            value = row.get(name)
            if type(value) is int and 0 <= value < 1 << 62:
                column.append(value)
            else:
                column.append(_UNKNOWN)
                if name in row:
                    extra[name] = value  # kept as given (None, a numpy integer): the row reads back the same
        for key, value in row.items():
            if key != "url" and key not in self.counts:
                extra[key] = value
        if extra:
            self.extras[position] = extra
        self.urls.append(url)

    def __len__(self) -> int:
        return len(self.urls)

    def url(self, shard: int) -> Any:
        return self.urls[shard]

    def nsamples(self, shard: int) -> Optional[int]:
        """The shard's sample count as given, or None."""
        value = self.counts["nsamples"][shard]
        return None if value == _UNKNOWN else value

    def extra(self, shard: int, key: str) -> Any:
        return self.extras.get(shard, {}).get(key)

    def all_counted(self) -> bool:
        """Whether every shard's ``nsamples`` was given."""
        column = self.counts["nsamples"]
        return bool(column) and min(column) >= 0

    def __getitem__(self, shard: Any) -> Any:
        if isinstance(shard, slice):
            return [self[i] for i in range(*shard.indices(len(self)))]
        if shard < 0:
            shard += len(self.urls)
        row: dict = {"url": self.urls[shard]}
        for name, column in self.counts.items():
            if column[shard] != _UNKNOWN:
                row[name] = column[shard]
        row.update(self.extras.get(shard, {}))
        return row

    def __iter__(self) -> Iterator[dict]:
        for shard in range(len(self.urls)):
            yield self[shard]

    def __repr__(self) -> str:
        return f"<ShardTable {len(self.urls)} shards>"


class IndexCache:
    """Loaded indexes by shard, the least recently used dropped once they hold more than ``limit`` bytes
    (:func:`index_bytes`); the one used last is always kept, so a pass through a shard never loads its index
    twice, even with ``limit`` 0.  ``loads`` counts the indexes put in (a test counts them, never times)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self.loads = 0
        self._held: collections.OrderedDict[int, tuple[ShardIndex, int]] = collections.OrderedDict()
        self._lock = threading.Lock()  # DataLoader threads, or a thread pool, read one dataset at once

    def __reduce__(self) -> tuple:
        # a copy (a DataLoader worker's) loads what it reads, within the same bound: nothing held travels
        return (IndexCache, (self.limit,))

    def get(self, shard: int) -> Optional[ShardIndex]:
        with self._lock:
            held = self._held.get(shard)
            if held is None:
                return None
            self._held.move_to_end(shard)
            return held[0]

    def put(self, shard: int, index: ShardIndex) -> None:
        size = index_bytes(index)
        with self._lock:
            old = self._held.pop(shard, None)
            if old is not None:
                self.bytes -= old[1]
            self._held[shard] = (index, size)
            self.bytes += size
            self.loads += 1
            while self.bytes > self.limit and len(self._held) > 1:
                _, (_, dropped) = self._held.popitem(last=False)
                self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, shard: object) -> bool:
        return shard in self._held

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self.bytes = 0
