"""``wds-cloud ls FOLDER/``: the objects of a local folder or a store's prefix with their sizes, as ``aws s3 ls``
and ``gsutil ls`` list them, with the total and a brace spec of the shards found.

One level, as those tools do: the objects directly under the folder or prefix, and its subfolders as ``DIR``
lines.  The listing is held once (sorted, name and size per object) and printed as it is walked, JSON too, so
that 10^6 objects cost one copy.  A local folder never leads out of itself: a link whose target is outside it is
counted, not followed.  HTTP servers have no listing; the message says what to give instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import sys
from collections.abc import Iterable, Iterator
from typing import Any, Optional

from ..errors import ShardNotFoundError, redact
from ..io.open import open_backend
from ..io.urls import is_local, local_path, split_scheme
from .console import UsageError

__all__ = ["is_folder", "list_folder"]

#: names of shards (a brace spec is made of those with a number before the extension)
_SHARD = re.compile(r"(?P<head>.*?)(?P<number>\d+)(?P<tail>\.(?:tar|tgz|tar\.(?:gz|bz2|xz|zst|lz4)))")
#: any shard's name (counted as a shard in the total)
_ANY_SHARD = re.compile(r".*\.(?:tar|tgz|tar\.(?:gz|bz2|xz|zst|lz4))")
#: brace specs shown at most; more runs of numbered shards are counted
MAX_SPECS = 20


@dataclasses.dataclass(frozen=True)
class Entry:
    """One line of a listing: an object (``size`` bytes) or a subfolder (``size`` None)."""

    name: str
    size: Optional[int]


def is_folder(url: str) -> bool:
    """Whether ``url`` names a folder or prefix to list rather than one shard: a trailing ``/``, a local
    directory, or a bucket with no key (``s3://bucket``)."""
    if url.endswith("/"):
        return True
    if is_local(url):
        return os.path.isdir(local_path(url) or ".")
    scheme, rest = split_scheme(url)
    return bool(scheme) and scheme not in ("pipe",) and "/" not in rest.lstrip("/")


def _local_entries(url: str) -> tuple[list[Entry], int]:
    """The entries of a local folder, sorted, and how many links lead out of it (not listed)."""
    folder = local_path(url) or "."
    named = folder.rstrip("/") or "/"
    if os.path.isfile(named):
        raise UsageError(
            f"{redact(url)}: a file, not a folder; to list a shard's members give its name without the '/'"
        )
    if os.path.exists(named) and not os.path.isdir(named):
        raise UsageError(f"{redact(url)}: not a folder (a device, a pipe or a socket): give a folder or a shard")
    if not os.path.exists(folder):
        raise ShardNotFoundError(
            f"{redact(url)}: no such folder; check the path (`wds-cloud ls` of the folder above it lists "
            "what is there)",
            url=url,
        )
    root = os.path.realpath(folder)
    entries, outside = [], 0
    try:
        listing = os.scandir(folder)
    except PermissionError:
        raise PermissionError(
            f"{redact(url)}: no permission to list this folder; list it as a user who may read it"
        ) from None
    with listing:
        for item in listing:
            path = item.path
            if item.is_symlink():
                target = os.path.realpath(path)
                if os.path.commonpath([root, target]) != root:  # a link out of the folder: never followed
                    outside += 1
                    continue
            try:
                st = os.stat(path)
            except OSError:  # a dangling link, or a name gone since the listing
                continue
            if stat.S_ISDIR(st.st_mode):
                entries.append(Entry(item.name + "/", None))
            elif stat.S_ISREG(st.st_mode):
                entries.append(Entry(item.name, st.st_size))
    entries.sort(key=lambda e: e.name)
    return entries, outside


def _store_entries(url: str) -> list[Entry]:
    """The entries under a store's prefix, one level (the store's listing, paginated by its driver), sorted."""
    backend = open_backend(url)
    fs = getattr(backend, "fs", None) if hasattr(type(backend), "fs") else None
    scheme = split_scheme(url)[0]
    if fs is None:
        return _plugin_entries(backend, url, scheme)
    path = backend.path(url).rstrip("/")
    try:
        fs.invalidate_cache(path)
        found = fs.ls(path, detail=True)
    except FileNotFoundError:
        found = []
    except Exception as exc:
        raise backend.translate(exc, url) from exc
    finally:
        fs.invalidate_cache(path)  # the driver's cached copy goes: the listing below is the one held
    entries = []
    for info in found:
        name = str(info.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
        if not name or name in (".", ".."):
            continue
        if info.get("type") == "directory":
            entries.append(Entry(name + "/", None))
        else:
            entries.append(Entry(name, int(info.get("size") or 0)))
    del found
    if not entries:
        parent = url.rstrip("/").rpartition("/")[0]
        above = f"`wds-cloud ls {redact(parent)}/`" if "/" in parent.split("://", 1)[-1] else "the bucket's console"
        raise ShardNotFoundError(
            f"{redact(url)}: nothing under this prefix (no such folder, or it is empty); check the name with {above}",
            url=url,
        )
    entries.sort(key=lambda e: e.name)
    return entries


def _plugin_entries(backend: Any, url: str, scheme: Optional[str]) -> list[Entry]:
    """The entries under ``url`` from a backend that is not fsspec's: its ``list`` (object URLs) and a ``stat``
    of each; a backend that cannot list (HTTP: a server lists nothing a client can read) is said so."""
    base = url if url.endswith("/") else url + "/"
    web = scheme in ("http", "https")
    # HTTP has no listing of its own: a server may give an index page of links (read as one), or nothing
    no_listing = UsageError(
        f"{redact(base)}: {scheme}:// has no listing"
        + (" (HTTP has none; this server gives no index page of links there)" if web else "")
        + "; name the shards instead, as a brace spec such as "
        f"'{redact(base)}train-{{0000..0099}}.tar', or list them where they were written"
    )
    try:
        names = [found for found in backend.list(base) if found.startswith(base)]
    except NotImplementedError:
        raise no_listing from None
    except ShardNotFoundError:
        if web:
            raise no_listing from None
        raise
    if not names and web:
        raise no_listing
    entries: dict[str, Optional[int]] = {}
    for found in names:
        rest = found[len(base) :]
        if "/" in rest:
            entries[rest.split("/", 1)[0] + "/"] = None
        elif rest:
            entries[rest] = backend.stat(found).size or 0
    if not entries:
        raise ShardNotFoundError(f"{redact(url)}: nothing under this prefix; check the name", url=url)
    return sorted((Entry(name, size) for name, size in entries.items()), key=lambda e: e.name)


class _Specs:
    """Brace specs of the numbered shards of a sorted listing, built as it is walked: a run of consecutive
    numbers of one width under one name becomes ``head{0000..0099}tail``."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.specs: list[str] = []
        self.more = 0
        self.run: Optional[list[Any]] = None  # head, tail, width, first, last

    def add(self, name: str) -> None:
        match = _SHARD.fullmatch(name)
        if match is None:
            return
        head, number, tail = match.group("head", "number", "tail")
        run = self.run
        if run is not None and (run[0], run[1], run[2]) == (head, tail, len(number)) and int(number) == run[4] + 1:
            run[4] += 1
            return
        self._close()
        self.run = [head, tail, len(number), int(number), int(number)]

    def _close(self) -> None:
        if self.run is None:
            return
        head, tail, width, first, last = self.run
        self.run = None
        if len(self.specs) >= MAX_SPECS:
            self.more += 1
            return
        numbers = f"{first:0{width}d}" if first == last else f"{{{first:0{width}d}..{last:0{width}d}}}"
        self.specs.append(f"{self.base}{head}{numbers}{tail}")

    def done(self) -> list[str]:
        self._close()
        return self.specs


def list_folder(url: str, as_json: bool, out: Any = None) -> None:
    """Print the listing of the folder or prefix ``url``: a line per entry, the total and the shards' brace
    specs (``as_json``: one JSON document, written as the entries are walked)."""
    out = out or sys.stdout
    outside = 0
    if is_local(url):
        entries, outside = _local_entries(url)
    else:
        entries = _store_entries(url)
    base = url if url.endswith("/") else url + "/"
    specs = _Specs(base)
    objects = total = shards = folders = 0
    if as_json:
        out.write('{"url": %s, "entries": [' % json.dumps(redact(base)))
    for n, entry in enumerate(_walk(entries)):
        if entry.size is None:
            folders += 1
        else:
            objects += 1
            total += entry.size
            if _ANY_SHARD.fullmatch(entry.name):
                shards += 1
            specs.add(entry.name)
        if as_json:
            row = {"name": entry.name, "size": entry.size, "kind": "folder" if entry.size is None else "object"}
            out.write(("," if n else "") + "\n " + json.dumps(row))
        else:
            out.write(("       DIR" if entry.size is None else f"{entry.size:>10}") + f"  {entry.name}\n")
    found = specs.done()
    summary = {"objects": objects, "bytes": total, "folders": folders, "shards": shards}
    if as_json:
        extra = {"total": summary, "shard_specs": [redact(s) for s in found], "more_specs": specs.more}
        if outside:
            extra["links_outside_not_listed"] = outside
        out.write("\n], " + json.dumps(extra)[1:] + "\n")
        return
    out.write(
        f"total: {objects} object{'' if objects == 1 else 's'}, {total:,} bytes"
        + (f", {folders} folder{'' if folders == 1 else 's'}" if folders else "")
        + f", {shards} shard{'' if shards == 1 else 's'}\n"
    )
    for spec in found:
        out.write(f"shards: {redact(spec)}\n")
    if specs.more:
        out.write(f"  ... and {specs.more} more runs of numbered shards\n")
    if outside:
        out.write(f"{outside} link{'' if outside == 1 else 's'} leading out of the folder, not followed or listed\n")


def _walk(entries: list[Entry]) -> Iterable[Entry]:
    """The entries in order, each let go once printed (the listing is held once, and shrinks as it is shown)."""
    entries.reverse()
    while entries:
        yield entries.pop()


def entries_of(url: str) -> Iterator[Entry]:
    """The entries of the folder or prefix ``url`` (for tests and scripts)."""
    entries = _local_entries(url)[0] if is_local(url) else _store_entries(url)
    yield from _walk(entries)
