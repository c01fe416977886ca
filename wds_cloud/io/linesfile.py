"""Files of one JSON record a line behind a header line: the form a description or a manifest takes when it
lists more than one JSON document can hold under ``WDS_MAX_DATA_FILE_SIZE`` (10^7 shards), read as a stream.

The first line is a header, ``{"format": FORMAT, "version": 1, "records": N, ...}``, and N lines of one JSON
object each follow.  The size cap applies to a line, never to the file, and nothing proportional to the file
is kept while it is read.  ``records`` is a claim checked at the end: a file cut at a line boundary (a copy
that stopped) holds fewer, one with lines added holds more, and both are refused.

:func:`open_json` tells the two forms apart by the first line alone, so a file keeps its name (``.json``) in
either form and every reader that opens it through here reads both.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from typing import Any, Optional, cast

from .. import config
from ..errors import MalformedDataError, redact
from . import datafile

__all__ = ["Opened", "open_json", "write_lines", "fits_document", "lines_wanted", "VERSION"]

VERSION = 1
#: bytes gathered before one write of the lines form (a store's upload is many small writes otherwise)
_CHUNK = 1 << 20


@dataclasses.dataclass
class Opened:
    """What a structured file holds: one JSON ``document``, or the ``header`` of its lines form and the
    ``records`` that follow, ``(line number, object)`` each, read as they are iterated."""

    document: Any = None
    header: Optional[dict] = None
    records: Optional[Iterator[tuple[int, dict]]] = None
    lines: Any = dataclasses.field(default=None, repr=False)  #: the open file's line generator

    def close(self) -> None:
        """Close the file (when the records are not read to their end)."""
        if self.lines is not None:
            self.lines.close()


def _loads(text: bytes) -> Any:
    """``text`` parsed when it is JSON, else None (the first line of a document written over several lines)."""
    try:
        return json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError):
        return None


def open_json(url: str, what: str, formats: Iterable[str], storage_options: Optional[dict] = None) -> Opened:
    """The file at ``url`` as one JSON document (read whole, under the cap of a file) or, when its first line is
    a header whose ``format`` is one of ``formats``, as a header and its records read as a stream (the cap
    applying to each line)."""
    shown = redact(url)
    lines: Any = datafile.iter_lines(url, what, storage_options)  # a generator: closed to close the file
    try:
        first = next(lines, None)
        if first is None:
            raise MalformedDataError(f"{shown}: the {what} is empty; write it again", url=url, field="header")
        head = _loads(first[1])
        if isinstance(head, dict) and head.get("format") in tuple(formats):
            return Opened(header=head, records=_records(lines, url, what, head), lines=lines)
        if head is not None:  # a whole document on its first line: nothing may follow it
            extra = next(lines, None)
            if extra is not None:
                raise MalformedDataError(
                    f"{shown}: the {what} is not valid JSON (more after the document, line {extra[0]}); write it again",
                    url=url,
                    field="syntax",
                )
            datafile.check_shape(head, shown, what)
            return Opened(document=head)
    except BaseException:
        lines.close()
        raise
    lines.close()
    return Opened(document=datafile.load(url, what, storage_options))


def _records(lines: Any, url: str, what: str, head: dict) -> Iterator[tuple[int, dict]]:
    shown = redact(url)
    fix = "write it again"
    datafile.need(head.get("version") == VERSION, shown, "line 1 'version'", f"must be {VERSION}", fix)
    count = head.get("records")
    datafile.need(
        datafile.is_count(count),
        shown,
        "line 1 'records'",
        f"must be the number of records that follow, not {datafile.shown(count)}",
        fix,
    )
    count = cast(int, count)
    seen = 0
    try:
        for number, text in lines:
            seen += 1
            if seen > count:
                raise MalformedDataError(
                    f"{shown}: line {number} is one record more than the {count} the header announces "
                    f"('records'); {fix}",
                    url=url,
                    field=f"line {number}",
                )
            record = datafile.parse_json(text, f"{shown}: line {number}", what, max_depth=8)
            datafile.need(isinstance(record, dict), shown, f"line {number}", "must be a JSON object", fix)
            yield number, record
    finally:
        lines.close()
    if seen != count:
        raise MalformedDataError(
            f"{shown}: the header announces {count} records ('records'), the file holds {seen}: it was cut "
            f"short or edited; {fix}",
            url=url,
            field="records",
        )


def lines_wanted(url: str) -> bool:
    """Whether the name asks for the lines form (``.jsonl``, ``.jsonl.gz``)."""
    return url.endswith(".jsonl") or url.endswith(".jsonl.gz")


def fits_document(records: Iterable[Any], overhead: int = 1024, limit: Optional[int] = None) -> bool:
    """Whether ``records`` written as one JSON document stay under ``limit`` (``WDS_MAX_DATA_FILE_SIZE``), the
    most a reader reads of a document; stops counting once past it."""
    most = limit if limit is not None else config.current().max_data_file_size
    total = overhead
    for record in records:
        # indented inside a document a record's lines start up to 4 deeper than dumped alone: an upper bound
        total += len(json.dumps(record, indent=1)) + 4 * (len(record) + 2)
        if total > most:
            return False
    return True


def write_lines(
    url: str, header: dict, records: Iterable[dict], count: int, storage_options: Optional[dict] = None
) -> None:
    """Write ``header`` (with ``"version"`` and ``"records": count``) and ``count`` records, one a line."""

    written = 0
    with datafile.writing(url, storage_options) as out:
        parts = [json.dumps({**header, "version": VERSION, "records": count}, separators=(",", ":")), "\n"]
        size = 0
        for record in records:
            line = json.dumps(record, separators=(",", ":"))
            parts += (line, "\n")
            written += 1
            size += len(line) + 1
            if size >= _CHUNK:
                out.write("".join(parts).encode("utf-8"))
                parts, size = [], 0
        if written != count:  # every reader checks the header's claim: a file that lies is never completed
            raise ValueError(f"{redact(url)}: {written} records to write under a header of {count}")
        out.write("".join(parts).encode("utf-8"))
