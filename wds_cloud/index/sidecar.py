"""Shard indexes: build, write and read them (the formats are in :mod:`wds_cloud.index.formats` and docs/indexes.md).

idx = wds_cloud.index.build_index("s3://bucket/train-0000.tar")      # reads the shard once
wds_cloud.index.write_index(idx)                                     # s3://bucket/train-0000.tar.index.json
wds_cloud.index.write_index(idx, fmt="dali")                         # s3://bucket/train-0000.idx
idx = wds_cloud.index.read_index("s3://bucket/train-0000.tar")       # the sidecar, ours or DALI's
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from ..errors import ConfigError, ObjectChangedError, SecurityError, ShardNotFoundError, redact
from ..io import datafile
from ..io.open import gopen
from ..io.security import resolve
from ..io.urls import is_local, local_path, local_version, same_location
from .formats import (
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

__all__ = [
    "ShardIndex",
    "SampleEntry",
    "build_index",
    "write_index",
    "read_index",
    "index_of",
    "check_fresh",
    "read_range",
    "index_url",
    "dali_url",
    "dali_text",
    "parse_dali",
    "wids_description",
    "parse_wids",
    "split_name",
    "FORMAT",
]

FORMATS = ("json", "dali")


def index_url(shard_url: str) -> str:
    """Where our index of a shard lives by default: beside it, ``<shard URL>.index.json``."""
    return shard_url + ".index.json"


def dali_url(shard_url: str) -> str:
    """Where DALI's ``wds2idx`` puts a shard's index: the name up to its first dot, then ``.idx``."""
    slash = shard_url.rfind("/")
    dot = shard_url.find(".", slash + 2)
    return (shard_url[:dot] if dot > 0 else shard_url) + ".idx"


def write_index(
    index: ShardIndex, url: Optional[str] = None, fmt: str = "json", storage_options: Optional[dict] = None
) -> str:
    """Write ``index`` (``fmt``: ``json``, ours, or ``dali``) to ``url`` (default: beside the shard); returns it."""
    if fmt not in FORMATS:
        raise ConfigError(
            f"index format {fmt!r} is not one of {', '.join(FORMATS)} (wids descriptions list whole "
            "datasets: see wds_cloud.index.wids_description)"
        )
    url = url or (index_url(index.url) if fmt == "json" else dali_url(index.url))
    if fmt == "json":
        text = json.dumps(index.to_json(relative_to=url), separators=(",", ":"), check_circular=False)
    else:
        text = dali_text(index)
    with gopen(url, "wb", storage_options=storage_options) as out:
        # a member name that is not UTF-8 (latin-1 caf\xe9.txt, escaped by the reader) is written as its own bytes,
        # as they stand in the tar header; JSON is ASCII (its escapes read back as the same name)
        out.write(text.encode("utf-8", "surrogateescape"))
    return url


def read_index(url: str, storage_options: Optional[dict] = None, shard_url: Optional[str] = None) -> ShardIndex:
    """The index at ``url``, ours or DALI's; given a shard's URL (``.tar``...), its sidecar: ours, else DALI's.

    An index file is data: it is read bounded (``WDS_MAX_DATA_FILE_SIZE``), every field is checked
    (:class:`~wds_cloud.errors.CorruptIndexError` naming the file and field), and the shard URL it names is
    resolved as any URL read from a file (untrusted, relative to it).  Raises ``ShardNotFoundError`` when
    there is none.
    """
    candidates = [url]
    if not (url.endswith(".json") or url.endswith(".idx")):
        shard_url = shard_url or url
        candidates = [index_url(url), dali_url(url)]
    last: Optional[BaseException] = None
    for candidate in candidates:
        try:
            data = datafile.read_bytes(candidate, "shard index", storage_options)
        except FileNotFoundError as exc:  # ours, or the builtin one an opener of the user's (gopen_schemes) raises
            last = exc
            continue
        shown = redact(candidate)
        if data.lstrip().startswith(b"{"):
            index = ShardIndex.from_json(datafile.parse_json(data, shown, "shard index", max_depth=None), candidate)
        else:
            # member names as the tar header's bytes, UTF-8 or not (written so by write_index); parse_dali checks
            # the rest, its first line first (anything else is "not a DALI index")
            index = parse_dali(data.decode("utf-8", "surrogateescape"), shard_url or candidate)
        try:  # where the index says its shard is: names are relative to the index file, as in every data file
            built_for: str = resolve(index.url, candidate, field="url")
        except SecurityError:
            if shard_url is None:
                raise
            built_for = index.url  # an index made elsewhere (a local path in an uploaded index): not this copy's
        index.url = shard_url if shard_url is not None else built_for
        if not same_location(built_for, index.url) or (index.local_version and not is_local(index.url)):
            # built for a copy elsewhere (indexed on local disk, then uploaded): that copy's version says
            # nothing of this one's, so only the size is compared
            index.version = None
        return index
    raise ShardNotFoundError(
        f"{redact(url)}: no index found (looked for {', '.join(map(redact, candidates))}); "
        "write one with `wds-cloud index URL`",
        url=url,
    ) from last


def check_fresh(index: ShardIndex, url: str, stream: Any = None, stat: Optional[os.stat_result] = None) -> None:
    """Refuse to read ``url`` by ``index`` when the shard is no longer the one indexed: another size, or another
    version (ETag, generation; a local file's modification time and size).  ``stream``: an open ranged read of
    the shard, whose answer tells its size and version; a local shard is asked with ``stat`` (or ``stat`` is
    the ``os.fstat`` of the file opened).  An index that
    recorded a version, read over a store that now gives none, is refused too (no version cannot match)."""
    if stat is not None or is_local(url):
        try:
            st = stat if stat is not None else os.stat(local_path(url))
        except OSError:
            return  # opening it says what is wrong
        size: Optional[int] = st.st_size
        version: Optional[str] = local_version(st)
    else:
        size = getattr(stream, "size", None)
        version = getattr(stream, "version", None)
    stale = (index.size is not None and size is not None and size != index.size) or (
        index.version is not None and version != index.version
    )
    if stale:
        raise ObjectChangedError(
            f"{redact(url)}: the shard changed since it was indexed (now {size} bytes, version {version!r:.80}; the "
            f"index says {index.size} bytes, version {index.version!r:.80}); index it again with `wds-cloud index "
            f"{redact(url)}`",
            url=url,
            expected=index.version,
            actual=version,
        )


def read_range(index: ShardIndex, url: str, start: int, end: int, **gopen_kw: Any) -> bytes:
    """Bytes ``[start, end)`` of the shard ``index`` describes, one ranged read (``gopen_kw``: storage options,
    retries, timeout, stats), after checking the shard is still the one indexed (:func:`check_fresh`); a
    shard shorter than its index says is :class:`~wds_cloud.errors.ObjectChangedError`."""
    local = is_local(url)
    if local:
        check_fresh(index, url)
    with gopen(url, "rb", offset=start, length=end - start, **gopen_kw) as stream:
        if not local:
            check_fresh(index, url, stream)
        data = stream.read()
    if len(data) != end - start:
        raise ObjectChangedError(
            f"{redact(url)}: bytes {start}-{end} asked for, {len(data)} received: the shard "
            "is shorter than its index says; index it again",
            url=url,
            offset=start,
        )
    return data


def index_of(shard_url: str, storage_options: Optional[dict] = None) -> ShardIndex:
    """The shard's sidecar index (ours, else DALI's) when it has one, else one built by reading the shard."""
    try:
        return read_index(shard_url, storage_options, shard_url=shard_url)
    except ShardNotFoundError:
        return build_index(shard_url, storage_options=storage_options)
