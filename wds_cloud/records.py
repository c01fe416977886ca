"""``wds_cloud.records``, a documented path: record streams of CBOR or msgpack records (the code lives in
:mod:`wds_cloud.codec.records`)."""

from __future__ import annotations

from .codec.records import (
    RecordWriter,
    cbors_samples,
    cbors_to_samples,
    msgpacks_samples,
    msgpacks_to_samples,
    read_records,
)

__all__ = [
    "RecordWriter",
    "cbors_samples",
    "cbors_to_samples",
    "msgpacks_samples",
    "msgpacks_to_samples",
    "read_records",
]
