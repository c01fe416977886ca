"""The one reader of structured files that may come from data: indexes, wids descriptions, manifests,
dataset specs, job records, saved states and JSON lines of documents.

Such a file may have been written by anyone who can write where the data lives, so nothing in it is
believed before it is checked:

- its size is bounded before it is parsed (``WDS_MAX_DATA_FILE_SIZE``, 64 MiB by default; a ``.gz``
  file is bounded after decompression too);
- its nesting is bounded (JSON nested deeper than :data:`MAX_DEPTH`, or a YAML document whose aliases
  expand past :data:`MAX_NODES` values, is refused: a 600-byte "billion laughs" never grows);
- text that is not UTF-8, JSON or YAML that does not parse, and every check of a field fail with
  :class:`~wds_cloud.errors.MalformedDataError` (a ``ConfigError``, so a ``ValueError``) naming the
  file, the field and the fix; :func:`shown` keeps any value put into a message short.

The callers check their fields with :func:`need` and the ``is_*`` helpers; what a field means is
theirs to know.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import re
import reprlib
import zlib
from collections.abc import Iterator
from typing import Any, Optional

from .. import config
from ..errors import MalformedDataError, MissingExtraError, redact

__all__ = [
    "MAX_SHARD_BLOCKS",
    "read_bytes",
    "load",
    "first_line",
    "iter_lines",
    "writing",
    "parse_json",
    "parse_yaml",
    "shown",
    "need",
    "is_count",
    "check_shape",
    "MAX_DEPTH",
    "MAX_NODES",
]

#: the most 512-byte tar blocks a shard is believed to hold (a petabyte): what a description, index or state
#: read from data may claim about one shard (a count of samples, where a sample begins)
MAX_SHARD_BLOCKS = 1 << 41
#: nesting deeper than this is refused in every structured file (ours nest 4 or 5 deep)
MAX_DEPTH = 64
#: values a document may hold once YAML aliases are expanded (a spec holds a few hundred)
MAX_NODES = 1_000_000
#: the longest text of a value put into an error message
SHOWN = 120


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 6, 6, 6
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 80, 80, 40


def shown(value: Any, limit: int = SHOWN) -> str:
    """``repr(value)`` cut to ``limit`` characters: a few levels, items and characters of a large or deep value
    (never all of it: a YAML alias bomb or a 10**12-digit number stays short)."""
    try:
        text = _REPR.repr(value)
    except Exception:
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."


def _read_upto(stream: Any, most: int) -> bytes:
    """At most ``most`` bytes of ``stream``, a MiB at a time: ``read(most)`` sets aside ``most`` bytes at once (the
    whole cap, 64 MiB, for a 1 kB index)."""
    pieces, got = [], 0
    while got < most:
        piece = stream.read(min(1 << 20, most - got))
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
    return b"".join(pieces)


def read_bytes(url: str, what: str, storage_options: Optional[dict] = None, max_size: Optional[int] = None) -> bytes:
    """The bytes of ``url`` (decompressed when it ends in ``.gz``), refused past ``max_size`` (default
    ``WDS_MAX_DATA_FILE_SIZE``) before more is read."""
    from .open import gopen

    limit = max_size if max_size is not None else config.current().max_data_file_size
    with gopen(url, "rb", storage_options=storage_options) as stream:
        data = _read_upto(stream, limit + 1)
    if url.endswith(".gz"):
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as plain:
                data = _read_upto(plain, limit + 1)
        except (OSError, EOFError) as exc:
            raise MalformedDataError(
                f"{redact(url)}: the {what} is not valid gzip ({type(exc).__name__}); write it again", url=url
            ) from None
    if len(data) > limit:
        raise MalformedDataError(
            f"{redact(url)}: the {what} is larger than {limit} bytes, the most read for one; "
            "if it is genuine, raise WDS_MAX_DATA_FILE_SIZE",
            url=url,
            limit=limit,
        )
    return data


class _Raw(io.RawIOBase):
    """A stream that has ``readinto`` (a remote one) as the raw stream of an ``io.BufferedReader``."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._stream.readinto(buffer)


@contextlib.contextmanager
def _stream(url: str, storage_options: Optional[dict]) -> Iterator[Any]:
    from .open import gopen

    with gopen(url, "rb", storage_options=storage_options) as raw:
        if not hasattr(raw, "readline"):  # a remote stream reads into buffers only: lines come from a buffer
            raw = io.BufferedReader(_Raw(raw), 1 << 16)
        if not url.endswith(".gz"):
            yield raw
            return
        with gzip.GzipFile(fileobj=raw, mode="rb") as plain:
            yield plain


@contextlib.contextmanager
def writing(url: str, storage_options: Optional[dict] = None) -> Iterator[Any]:
    """A binary stream that writes the data file at ``url``, gzipped when its name ends in ``.gz`` (as every reader
    here reads such a name): a description, manifest or index written under a ``.gz`` name reads back."""
    from .open import gopen

    with gopen(url, "wb", storage_options=storage_options) as raw:
        if not url.endswith(".gz"):
            yield raw
            return
        with gzip.GzipFile(fileobj=raw, mode="wb") as packed:
            yield packed


def _line_too_long(url: str, what: str, number: int, limit: int) -> MalformedDataError:
    return MalformedDataError(
        f"{redact(url)}: line {number} of the {what} is longer than {limit} bytes, the most read for one record; "
        "if it is genuine, raise WDS_MAX_DATA_FILE_SIZE",
        url=url,
        limit=limit,
    )


def iter_lines(
    url: str, what: str, storage_options: Optional[dict] = None, max_record: Optional[int] = None
) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` for each line of ``url`` that is not blank (decompressed when it ends in ``.gz``),
    read as a stream: memory stays within one record however long the file.  A line longer than ``max_record``
    (default ``WDS_MAX_DATA_FILE_SIZE``: for a file of one record a line the cap applies to a record, not to the
    file) is refused before more of it is read."""
    limit = max_record if max_record is not None else config.current().max_data_file_size
    try:
        with _stream(url, storage_options) as stream:
            number = 0
            while True:
                line = stream.readline(limit + 2)
                if not line:
                    return
                number += 1
                if len(line) > limit + 1 or (len(line) == limit + 1 and not line.endswith(b"\n")):
                    raise _line_too_long(url, what, number, limit)
                if line.strip():
                    yield number, line
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise MalformedDataError(
            f"{redact(url)}: the {what} is not valid gzip ({type(exc).__name__}); write it again", url=url
        ) from None


def first_line(url: str, what: str, storage_options: Optional[dict] = None, max_record: Optional[int] = None) -> bytes:
    """The first line of ``url`` that is not blank (``b""`` for an empty file), bounded as :func:`iter_lines`
    bounds a record: how a reader tells a file of one record a line from one JSON document without reading it."""
    for _, line in iter_lines(url, what, storage_options, max_record):
        return line
    return b""


def _text(data: Any, where: str, what: str) -> str:
    if isinstance(data, str):
        return data
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedDataError(
            f"{where}: the {what} is not UTF-8 text (byte {exc.start}); write it again", field="encoding"
        ) from None


def parse_json(data: Any, where: str = "<data>", what: str = "file", max_depth: Optional[int] = MAX_DEPTH) -> Any:
    """JSON ``data`` (bytes or text) parsed; ``max_depth`` None skips the depth walk (the caller checks every
    field's type, as the index reader does), though Python's own recursion bound still applies."""
    text = _text(data, where, what)
    try:
        value = json.loads(text)
    except RecursionError:
        raise MalformedDataError(
            f"{where}: the {what} is nested too deeply to be a {what}; write it again", field="nesting"
        ) from None
    except ValueError as exc:
        raise MalformedDataError(
            f"{where}: the {what} is not valid JSON ({_why(exc)}); write it again", field="syntax"
        ) from None
    if max_depth is not None:
        check_shape(value, where, what, max_depth)
    return value


def _why(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."


def parse_yaml(data: Any, where: str = "<data>", what: str = "file", max_depth: int = MAX_DEPTH) -> Any:
    """YAML ``data`` parsed safely (no Python objects), with aliases expanded no further than :data:`MAX_NODES`."""
    text = _text(data, where, what)
    try:
        import yaml
    except ImportError:
        raise MissingExtraError(
            f"{where}: reading a YAML {what} needs PyYAML, a dependency of wds_cloud that is "
            "missing here: pip install pyyaml (or write it as JSON)"
        ) from None
    try:
        value = yaml.safe_load(text)
    except RecursionError:
        raise MalformedDataError(f"{where}: the {what} is nested too deeply; write it again", field="nesting") from None
    except yaml.YAMLError as exc:
        raise MalformedDataError(
            f"{where}: the {what} is not valid YAML ({_why(exc)}); write it again", field="syntax"
        ) from None
    check_shape(value, where, what, max_depth)
    return value


def check_shape(value: Any, where: str, what: str, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
    """Refuse a parsed value nested deeper than ``max_depth`` or holding more than ``max_nodes`` values when
    shared ones (YAML aliases) are counted each time they appear.  Iterative: no recursion to exhaust."""
    stack = [(value, 1)]
    nodes = 0
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise MalformedDataError(
                f"{where}: the {what} holds more than {max_nodes} values once its aliases are "
                "expanded; write it without them",
                field="size",
            )
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= max_depth:
            raise MalformedDataError(
                f"{where}: the {what} is nested more than {max_depth} deep; write it again", field="nesting"
            )
        stack.extend((child, depth + 1) for child in children)


def load(
    url: str,
    what: str,
    storage_options: Optional[dict] = None,
    fmt: Optional[str] = None,
    max_size: Optional[int] = None,
    max_depth: Optional[int] = MAX_DEPTH,
) -> Any:
    """Read and parse the structured file at ``url``: JSON, or YAML for ``.yaml``/``.yml`` (``fmt`` overrides)."""
    data = read_bytes(url, what, storage_options, max_size)
    where = redact(url)
    fmt = fmt or ("yaml" if re.search(r"\.ya?ml(\.gz)?$", url) else "json")
    if fmt == "yaml":
        return parse_yaml(data, where, what)
    return parse_json(data, where, what, max_depth)


def need(
    ok: bool,
    where: str,
    field: str,
    problem: str,
    fix: str = "write it again",
    error: type[MalformedDataError] = MalformedDataError,
) -> None:
    """Raise ``error`` ``"{where}: {field} {problem}; {fix}"`` unless ``ok``."""
    if not ok:
        raise error(f"{where}: {field} {problem}; {fix}", field=field)


def is_count(value: Any, most: Optional[int] = None) -> bool:
    """A whole number (not a bool) from 0 to ``most``."""
    return type(value) is int and value >= 0 and (most is None or value <= most)
