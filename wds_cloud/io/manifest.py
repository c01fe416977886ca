"""Integrity manifests: per shard, its size, sample count and SHA-256, checked while shards are read.

A manifest is JSON (``docs/indexes.md``)::

    {"format": "wds_cloud.manifest", "version": 1,
     "shards": {"s3://bucket/train-0000.tar": {"size": 1048576, "samples": 1000, "sha256": "9f86d0..."}, ...}}

``wds-cloud verify SPEC --write-manifest M`` writes one; ``WebDataset(..., manifest=M)`` and
``ShardListDataset(..., manifest=M)`` check every shard against it: a streamed shard is hashed as it
is read (no second read) and a mismatch raises :class:`~wds_cloud.errors.IntegrityError` (URL,
expected, actual) when its last sample has been read; a shard missing from the manifest is an
error unless ``allow_missing=True``.

A manifest of more shards than one JSON document holds under ``WDS_MAX_DATA_FILE_SIZE`` (about 359k at the
default 64 MiB), or written to a name ending ``.jsonl``, takes the lines form (:mod:`~wds_cloud.io.linesfile`)::

    {"format": "wds_cloud.manifest-lines", "version": 1, "records": 2}
    {"shard": "train-0000.tar", "size": 1048576, "samples": 1000, "sha256": "9f86d0..."}
    {"shard": "train-0001.tar", ...}

read as a stream, the size cap applying to a line; :func:`load_manifest` reads both forms.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from .. import config
from ..errors import IntegrityError, MalformedDataError, redact
from . import datafile, linesfile
from .integrity import Verifying, mismatch
from .urls import folder_of, location_of, relative_to_folder, resolved

__all__ = ["Manifest", "load_manifest", "Verifying", "check_index", "FORMAT"]

FORMAT = "wds_cloud.manifest"
LINES_FORMAT = "wds_cloud.manifest-lines"


class Manifest:
    """Expected size, sample count and SHA-256 per shard.

    A shard is named by its URL, or by a path relative to the manifest's own location (``base``, the
    manifest's URL), which is how :meth:`write` names the shards beside or below it: a dataset copied with
    its manifest still matches.  :meth:`entry` finds a shard by the name it is given, or by where it is.
    """

    def __init__(self, shards: Optional[dict] = None, allow_missing: bool = False, base: Optional[str] = None) -> None:
        self.shards: dict[str, dict] = dict(shards or {})
        for url, entry in self.shards.items():  # checked before a shard is read, whoever built it
            _check_entry(url, entry, "<manifest>")
        self.allow_missing = allow_missing
        self.base = base
        self._where: Optional[dict[str, str]] = None
        self._indexed = -1

    def name_of(self, url: str) -> Optional[str]:
        """The manifest's name for the shard at ``url`` (None: it has none): the same name, or one that is the
        same file once relative names are read from the manifest's folder and links are followed (a shard given
        through a linked folder, or spelled with ``..``, is the shard the manifest names)."""
        if url in self.shards:
            return url
        if self._where is None or self._indexed != len(self.shards):
            folder = folder_of(self.base) if self.base is not None else None
            self._where = {resolved(location_of(name, folder)): name for name in self.shards}
            self._indexed = len(self.shards)
        return self._where.get(resolved(location_of(url, None)))

    def find(self, url: str) -> Optional[dict]:
        """The entry for the shard at ``url``, or None."""
        name = self.name_of(url)
        return None if name is None else self.shards[name]

    def entry(self, url: str) -> Optional[dict]:
        """The entry for ``url``; None when it has none and that is allowed, else an IntegrityError."""
        found = self.find(url)
        if found is None and not self.allow_missing:
            raise IntegrityError(
                f"{redact(url)}: the shard is not in the manifest; add it (`wds-cloud verify ... "
                "--write-manifest`) or pass allow_missing=True",
                url=url,
                expected="an entry",
                actual="none",
            )
        return found

    def add(self, url: str, size: int, samples: int, sha256: str) -> None:
        self.shards[url] = {"size": size, "samples": samples, "sha256": sha256}

    def to_json(self, relative_to: Optional[str] = None) -> dict:
        """The manifest as JSON; with ``relative_to`` (where it will be written), shards in that folder or
        below it are named relative to it."""
        shards = self.shards
        if relative_to is not None:
            folder = folder_of(relative_to)
            own = folder_of(self.base) if self.base is not None else None
            shards = {relative_to_folder(location_of(name, own), folder): entry for name, entry in self.shards.items()}
        return {"format": FORMAT, "version": 1, "shards": shards}

    def write(self, url: str, storage_options: Optional[dict] = None, lines: Optional[bool] = None) -> bool:
        """Write the manifest to ``url``, naming the shards beside or below it relative to it; returns whether
        the lines form was written (``lines`` None: for a name ending ``.jsonl``, or when the document would be
        larger than ``WDS_MAX_DATA_FILE_SIZE``, which its readers would refuse)."""
        document = self.to_json(relative_to=url)
        shards = document["shards"]
        text = None
        if not (
            lines or (lines is None and (linesfile.lines_wanted(url) or not linesfile.fits_document(shards.values())))
        ):
            text = json.dumps(document, indent=1, sort_keys=True).encode("utf-8")
            if lines is None and len(text) > config.current().max_data_file_size:
                text = None  # the estimate was short: a document its readers would refuse is never written
        if text is None:
            names = sorted(shards)
            rows = ({"shard": name, **shards[name]} for name in names)
            linesfile.write_lines(url, {"format": LINES_FORMAT}, rows, len(names), storage_options)
            return True
        with datafile.writing(url, storage_options) as out:
            out.write(text)
        return False

    def __len__(self) -> int:
        return len(self.shards)


def load_manifest(
    source: Union[str, dict, Manifest], allow_missing: bool = False, storage_options: Optional[dict] = None
) -> Manifest:
    """A :class:`Manifest` from a URL/path of its JSON, the parsed dict, or a Manifest; every entry is checked
    before a shard is read (a :class:`~wds_cloud.errors.MalformedDataError` naming the file and the shard)."""
    if isinstance(source, Manifest):
        return source
    where = "<manifest>"
    if isinstance(source, str):
        where = source
        opened = linesfile.open_json(source, "manifest", (LINES_FORMAT,), storage_options)
        if opened.records is not None:
            return _from_lines(source, opened.records, allow_missing)
        source = opened.document
    shown = redact(where)
    if not isinstance(source, dict) or source.get("format") != FORMAT or not isinstance(source.get("shards"), dict):
        raise MalformedDataError(
            f'{shown}: not a wds_cloud manifest (expected {{"format": "{FORMAT}", '
            '"shards": {...}}}); write one with `wds-cloud verify SPEC --write-manifest FILE`',
            field="format",
        )
    for url, entry in source["shards"].items():
        _check_entry(url, entry, shown)
    manifest = Manifest(None, allow_missing, base=where if where != "<manifest>" else None)
    manifest.shards = dict(source["shards"])
    return manifest


def _from_lines(url: str, records: Any, allow_missing: bool) -> Manifest:
    """A manifest of one shard a line, read as a stream: every line checked, a shard named twice refused."""
    shown = redact(url)
    shards: dict[str, dict] = {}
    for number, record in records:
        name = record.pop("shard", None)
        datafile.need(
            isinstance(name, str) and bool(name),
            shown,
            f"line {number} 'shard'",
            "must be the shard's URL or path (a string)",
            _FIX,
        )
        _check_entry(name, record, shown, f"line {number}")
        datafile.need(
            name not in shards, shown, f"line {number}", f"names the shard {datafile.shown(name)} again", _FIX
        )
        shards[name] = record
    manifest = Manifest(None, allow_missing, base=url)
    manifest.shards = shards
    return manifest


_HEX = {"sha256": 64, "md5": 32}
_FIX = "write the manifest again with `wds-cloud verify SPEC --write-manifest FILE`"


def _check_entry(url: str, entry: Any, shown: str, field: Optional[str] = None) -> None:
    fix = _FIX
    field = field or f"shards[{datafile.shown(url)}]"
    datafile.need(
        isinstance(entry, dict),
        shown,
        field,
        f"must be a mapping of size, samples and sha256, not {datafile.shown(entry)}",
        fix,
    )
    for key in ("size", "samples"):
        if key in entry:
            datafile.need(
                datafile.is_count(entry[key]),
                shown,
                f"{field}.{key}",
                f"must be a whole number, not {datafile.shown(entry[key])}",
                fix,
            )
    for key, length in _HEX.items():
        if key in entry:
            value = entry[key]
            datafile.need(
                isinstance(value, str) and len(value) == length and all(c in "0123456789abcdef" for c in value.lower()),
                shown,
                f"{field}.{key}",
                f"must be {length} hex digits",
                fix,
            )


def check_index(manifest: Any, index: Any) -> None:
    """An index's sample count (and size, when known) against the manifest (random access cannot hash)."""
    manifest = load_manifest(manifest)
    entry = manifest.entry(index.url)
    if entry is None:
        return
    if "samples" in entry and len(index) != entry["samples"]:
        raise mismatch(index.url, "samples", entry["samples"], len(index))
    if index.size is not None and "size" in entry and index.size != entry["size"]:
        raise mismatch(index.url, "size", entry["size"], index.size)
