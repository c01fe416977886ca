"""Shard indexes: build, write and read them (the formats are in :mod:`wds_cloud.tar.index` and docs/index.md).

    idx = wds_cloud.index.build_index("s3://bucket/train-0000.tar")      # reads the shard once
    wds_cloud.index.write_index(idx)                                     # s3://bucket/train-0000.tar.index.json
    wds_cloud.index.write_index(idx, fmt="dali")                         # s3://bucket/train-0000.idx
    idx = wds_cloud.index.read_index("s3://bucket/train-0000.tar")       # the sidecar, ours or DALI's
"""

from __future__ import annotations

import json
from typing import Optional

from .errors import ConfigError, ShardNotFoundError, redact
from .io.open import gopen
from .tar.index import (
    FORMAT,
    SampleEntry,
    ShardIndex,
    build_index,
    dali_text,
    parse_dali,
    parse_wids,
    split_name,
    wids_description,
)

__all__ = ["ShardIndex", "SampleEntry", "build_index", "write_index", "read_index", "index_of", "index_url", "dali_url",
           "dali_text", "parse_dali", "wids_description", "parse_wids", "split_name", "FORMAT"]

FORMATS = ("json", "dali")


def index_url(shard_url: str) -> str:
    """Where our index of a shard lives by default: beside it, ``<shard URL>.index.json``."""
    return shard_url + ".index.json"


def dali_url(shard_url: str) -> str:
    """Where DALI's ``wds2idx`` puts a shard's index: the name up to its first dot, then ``.idx``."""
    slash = shard_url.rfind("/")
    dot = shard_url.find(".", slash + 2)
    return (shard_url[:dot] if dot > 0 else shard_url) + ".idx"


def write_index(index: ShardIndex, url: Optional[str] = None, fmt: str = "json",
                storage_options: Optional[dict] = None) -> str:
    """Write ``index`` (``fmt``: ``json``, ours, or ``dali``) to ``url`` (default: beside the shard); returns it."""
    if fmt not in FORMATS:
        raise ConfigError(f"index format {fmt!r} is not one of {', '.join(FORMATS)} (wids descriptions list whole "
                          "datasets: see wds_cloud.index.wids_description)")
    url = url or (index_url(index.url) if fmt == "json" else dali_url(index.url))
    if fmt == "json":
        text = json.dumps(index.to_json(), separators=(",", ":"), check_circular=False)
    else:
        text = dali_text(index)
    with gopen(url, "wb", storage_options=storage_options) as out:
        out.write(text.encode("utf-8"))
    return url


def read_index(url: str, storage_options: Optional[dict] = None, shard_url: Optional[str] = None) -> ShardIndex:
    """The index at ``url``, ours or DALI's; given a shard's URL (``.tar``...), its sidecar: ours, else DALI's.

    Raises ``ShardNotFoundError`` when there is none.
    """
    candidates = [url]
    if not (url.endswith(".json") or url.endswith(".idx")):
        shard_url = shard_url or url
        candidates = [index_url(url), dali_url(url)]
    last: Optional[BaseException] = None
    for candidate in candidates:
        try:
            with gopen(candidate, "rb", storage_options=storage_options) as stream:
                text = stream.read().decode("utf-8")
        except ShardNotFoundError as exc:
            last = exc
            continue
        if text.lstrip().startswith("{"):
            index = ShardIndex.from_json(json.loads(text), candidate)
        else:
            index = parse_dali(text, shard_url or candidate)
        if shard_url is not None:
            index.url = shard_url
        return index
    raise ShardNotFoundError(f"{redact(url)}: no index found (looked for {', '.join(map(redact, candidates))}); "
                             "write one with `wds-cloud index URL`", url=url) from last


def index_of(shard_url: str, storage_options: Optional[dict] = None) -> ShardIndex:
    """The shard's sidecar index (ours, else DALI's) when it has one, else one built by reading the shard."""
    try:
        return read_index(shard_url, storage_options, shard_url=shard_url)
    except ShardNotFoundError:
        return build_index(shard_url, storage_options=storage_options)
