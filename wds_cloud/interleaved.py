"""``wds_cloud.interleaved``, a documented path: interleaved image-text documents (the code lives in
:mod:`wds_cloud.tools.interleaved`)."""

from __future__ import annotations

from .tools.interleaved import (
    collate_interleaved,
    convert_mmc4,
    document_items,
    interleaved,
    interleaved_sample,
    mmc4_plan,
    mmc4_shard,
)

__all__ = [
    "interleaved",
    "interleaved_sample",
    "collate_interleaved",
    "convert_mmc4",
    "document_items",
    "mmc4_plan",
    "mmc4_shard",
]
