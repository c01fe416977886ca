"""``wds_cloud.transport``, a documented path: batches through shared memory (the code lives in
:mod:`wds_cloud.loader.transport`)."""

from __future__ import annotations

from .loader.transport import AUTO_MIN_BYTES, PackedBytes, PackingCollate, pack_batch

__all__ = ["PackedBytes", "pack_batch", "PackingCollate", "AUTO_MIN_BYTES"]
