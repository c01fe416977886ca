"""Random access: member indexes of shards, the sidecar files that hold them, and a map-style dataset over
them with samplers that keep locality.

- :mod:`~wds_cloud.index.formats`: the index of a shard (``ShardIndex``), built from its tar members, and
  its file formats (ours, DALI's ``.idx``, wids descriptions);
- :mod:`~wds_cloud.index.sidecar`: writing and reading index files beside shards, freshness checks, ranged
  reads of one sample;
- :mod:`~wds_cloud.index.dataset`: ``ShardListDataset`` and its samplers (webdataset's ``wids``);
- :mod:`~wds_cloud.index.held`: what a dataset keeps, bounded: its shards compactly, its loaded indexes up to
  ``WDS_INDEX_CACHE`` bytes.

``import wds_cloud.index as index`` gives all of it."""

from __future__ import annotations

from .dataset import (
    ChunkedSampler,
    DistributedChunkedSampler,
    IndexedTarSamples,
    ShardedSampler,
    ShardListDataset,
    ShardListSampler,
    default_decoder,
)
from .formats import (
    FORMAT,
    SampleEntry,
    ShardIndex,
    build_index,
    dali_text,
    group_members,
    index_stream,
    parse_dali,
    parse_wids,
    split_name,
    wids_description,
)
from .sidecar import check_fresh, dali_url, index_of, index_url, read_index, read_range, write_index

__all__ = [
    "ShardIndex",
    "SampleEntry",
    "build_index",
    "index_stream",
    "group_members",
    "FORMAT",
    "dali_text",
    "parse_dali",
    "wids_description",
    "parse_wids",
    "split_name",
    "write_index",
    "read_index",
    "index_of",
    "check_fresh",
    "read_range",
    "index_url",
    "dali_url",
    "ShardListDataset",
    "ShardListSampler",
    "ShardedSampler",
    "ChunkedSampler",
    "DistributedChunkedSampler",
    "IndexedTarSamples",
    "default_decoder",
]
