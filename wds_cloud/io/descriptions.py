"""wids dataset descriptions as data: the one check of a shard's row, and their two forms on disk.

- the document upstream ``wids`` reads, ``{"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist":
  [{"url", "nsamples", "filesize"}, ...]}``, read whole under ``WDS_MAX_DATA_FILE_SIZE`` (about 860k shards
  at the default 64 MiB);
- the lines form (:mod:`~wds_cloud.io.linesfile`), for more shards than that: a header line
  ``{"format": "wds_cloud.wids-lines", "version": 1, "wids_version": 1, "records": N[, "name"][, "base"]}``, then
  one shard row a line, read as a stream (the cap applies to a line).

:func:`read_description` gives either as the description's mapping, whose ``"shardlist"`` is a list (the
document) or a :class:`ShardRows` that reads the file again each time it is iterated (the lines form: nothing
proportional to the file stays in memory but what the caller keeps).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from .. import config
from ..errors import MalformedDataError, redact
from . import datafile, linesfile

__all__ = ["LINES_FORMAT", "MOST_SAMPLES", "ShardRows", "check_shard", "read_description", "write_description"]

LINES_FORMAT = "wds_cloud.wids-lines"
KIND = "wids-shard-index-v1"
#: the most samples a description may claim for one shard: each takes at least one block
MOST_SAMPLES = datafile.MAX_SHARD_BLOCKS
#: the fields of a shard row besides url, nsamples and filesize that readers understand (all strings)
TEXT_FIELDS = ("md5sum", "dataset")


def check_shard(shard: Any, shown: str, name: str) -> None:
    """Refuse a shard row that is not ``{"url": str, "nsamples": count[, "filesize": bytes][, "md5sum",
    "dataset": str]}`` with counts that fit the size (a sample spans at least one 512-byte tar block)."""
    need = datafile.need
    need(isinstance(shard, dict), shown, name, 'must be a mapping with "url" and "nsamples"')
    need(
        isinstance(shard.get("url"), str) and bool(shard["url"]),
        shown,
        f"{name}.url",
        "must be a URL or path (a string)",
    )
    need(
        datafile.is_count(shard.get("nsamples"), MOST_SAMPLES),
        shown,
        f"{name}.nsamples",
        "must be a whole number of "
        f"samples (at most {MOST_SAMPLES}: a shard of a petabyte), not {datafile.shown(shard.get('nsamples'))}",
    )
    size = shard.get("filesize")
    need(
        size is None or datafile.is_count(size, MOST_SAMPLES * 512),
        shown,
        f"{name}.filesize",
        f"must be a whole number of bytes, not {datafile.shown(size)}",
    )
    if size is not None:
        need(
            shard["nsamples"] * 512 <= size,
            shown,
            f"{name}.nsamples",
            f"claims {shard['nsamples']} samples in {size} bytes (each takes at least 512)",
        )
    for key in TEXT_FIELDS:
        need(shard.get(key) is None or isinstance(shard[key], str), shown, f"{name}.{key}", "must be a string")


class ShardRows:
    """The shard rows of a description's lines form: each iteration reads the file again as a stream and yields
    every row checked (:func:`check_shard`, errors naming the line); a URL listed twice is refused."""

    def __init__(self, url: str, storage_options: Optional[dict] = None) -> None:
        self.url = url
        self.storage_options = storage_options

    def __iter__(self) -> Iterator[dict]:
        opened = linesfile.open_json(self.url, "dataset description", (LINES_FORMAT,), self.storage_options)
        if opened.records is None:
            raise MalformedDataError(f"{redact(self.url)}: no longer a description of one shard a line", url=self.url)
        shown = redact(self.url)
        seen: dict[str, int] = {}  # url -> line: the strings are the rows' own, kept only while the file is read
        try:
            for number, row in opened.records:
                check_shard(row, shown, f"line {number}")
                first = seen.setdefault(row["url"], number)
                if first != number:
                    raise MalformedDataError(
                        f"{shown}: line {number} lists the shard {datafile.shown(row['url'])} of line {first} again; "
                        "a shard is listed once (write the description again)",
                        url=self.url,
                        field=f"line {number}.url",
                    )
                yield row
        finally:
            opened.close()

    def __repr__(self) -> str:
        return f"<ShardRows of {redact(self.url)}>"


def read_description(url: str, storage_options: Optional[dict] = None) -> dict:
    """The description at ``url`` in either form (see the module docstring), its top-level fields checked."""
    spec = read_json_spec(url, storage_options, "dataset description")
    datafile.need(
        isinstance(spec, dict),
        redact(url),
        "the description",
        'must be a JSON object with "wids_version": 1 and a "shardlist"',
    )
    return spec


def read_json_spec(url: str, storage_options: Optional[dict] = None, what: str = "dataset spec") -> Any:
    """A JSON spec file as parsed: the document, or a description's lines form as its header's fields with
    ``"shardlist"`` a :class:`ShardRows` (read when iterated)."""
    opened = linesfile.open_json(url, what, (LINES_FORMAT,), storage_options)
    shown = redact(url)
    if opened.header is None:
        return opened.document
    opened.close()  # the header is all this needs: the rows are read when iterated
    head = opened.header
    datafile.need(head.get("wids_version") == 1, shown, "line 1 'wids_version'", "must be 1")
    for key in ("name", "base"):
        datafile.need(head.get(key) is None or isinstance(head[key], str), shown, f"line 1 '{key}'", "must be a string")
    datafile.need(
        "shardlist" not in head and "datasets" not in head,
        shown,
        "line 1",
        "holds no shards: they follow, one a line",
    )
    return {**head, "shardlist": ShardRows(url, storage_options)}


def write_description(
    url: str,
    rows: Sequence[dict],
    name: Optional[str] = None,
    base: Optional[str] = None,
    lines: Optional[bool] = None,
    storage_options: Optional[dict] = None,
) -> bool:
    """Write a description of ``rows`` (their URLs as they should appear in the file) to ``url``; returns whether
    the lines form was written.  ``lines`` None decides: the lines form when the name ends ``.jsonl`` or when
    the document would be larger than ``WDS_MAX_DATA_FILE_SIZE`` (what a reader reads of a document, so such a
    document could not be read back), else the document upstream ``wids`` reads."""
    extra = {**({"name": name} if name else {}), **({"base": base} if base else {})}
    text = None
    if not (lines or (lines is None and (linesfile.lines_wanted(url) or not linesfile.fits_document(rows)))):
        document: dict = {"__kind__": KIND, "wids_version": 1, "shardlist": list(rows), **extra}
        text = json.dumps(document, indent=1).encode("utf-8")
        if lines is None and len(text) > config.current().max_data_file_size:
            text = None  # the estimate was short: a document its readers would refuse is never written
    if text is None:
        linesfile.write_lines(
            url, {"format": LINES_FORMAT, "wids_version": 1, **extra}, rows, len(rows), storage_options
        )
        return True
    with datafile.writing(url, storage_options) as out:
        out.write(text)
    return False
