"""``wids``' import path: random access to indexed shards (the code lives in :mod:`wds_cloud.index.dataset`).

Code written for ``import wids`` runs with ``import wds_cloud.wids as wids``: ``ShardListDataset``
takes the same arguments and gives samples of the same shape, and the samplers order indexes the
same way per (seed, epoch); samples are fetched with ranged reads instead of whole-shard downloads.
"""

from __future__ import annotations

from .index.dataset import (
    ChunkedSampler,
    DistributedChunkedSampler,
    IndexedTarSamples,
    ShardedSampler,
    ShardListDataset,
    ShardListSampler,
    default_decoder,
)

__all__ = [
    "ShardListDataset",
    "ChunkedSampler",
    "DistributedChunkedSampler",
    "ShardedSampler",
    "ShardListSampler",
    "IndexedTarSamples",
    "default_decoder",
]
