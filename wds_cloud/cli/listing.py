"""``wds-cloud ls FOLDER/``: the objects of a local folder or a store's prefix with their sizes, as ``aws s3 ls``
and ``gsutil ls`` list them, with the total and a brace spec of the shards found.

One level, as those tools do: the objects directly under the folder or prefix, and its subfolders as ``DIR``
lines.  The listing is held once (sorted, name and size per object) and printed as it is walked, JSON too, so
that 10^6 objects cost one copy.  A local folder never leads out of itself: a link whose target is outside it is
counted, not followed.  HTTP servers have no listing; the message says what to give instead.
"""

from __future__ import annotations

import dataclasses
import errno
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
from .console import UsageError, shown

__all__ = ["is_folder", "list_folder"]

#: names of shards (a brace spec is made of those with a number before the extension)
_SHARD = re.compile(r"(?P<head>.*?)(?P<number>\d+)(?P<tail>\.(?:tar|tgz|tar\.(?:gz|bz2|xz|zst|lz4)))", re.S)
#: any shard's name (counted as a shard in the total)
_ANY_SHARD = re.compile(r".*\.(?:tar|tgz|tar\.(?:gz|bz2|xz|zst|lz4))", re.S)
#: brace specs shown at most; more runs of numbered shards are counted
MAX_SPECS = 20
#: shards outside every spec named at most; more are counted
MAX_OUTSIDE = 10
#: what a line of text cannot show as it is: control characters (a newline would start a false entry)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: characters a brace spec reads as its own, and control characters: a name holding one is in no spec
_ODD = re.compile(r"[{}\[\]*?\x00-\x1f\x7f]")


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


def _local_entries(url: str) -> tuple[list[Entry], int, dict[str, int]]:
    """The entries of a local folder, sorted, how many links lead out of it (not listed), and how many of each
    other kind are not listed (a FIFO, a socket, a device, a dangling link, a link loop)."""
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
    skipped: dict[str, int] = {}  # kind -> count: a handful of kinds, whatever the folder holds
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
            except OSError as exc:  # a dangling link, a link loop, or a name gone since the listing
                kind = "link loop" if exc.errno == errno.ELOOP else "dangling link" if item.is_symlink() else "gone"
                skipped[kind] = skipped.get(kind, 0) + 1
                continue
            if stat.S_ISDIR(st.st_mode):
                entries.append(Entry(item.name + "/", None))
            elif stat.S_ISREG(st.st_mode):
                entries.append(Entry(item.name, st.st_size))
            else:
                kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "device"
                skipped[kind] = skipped.get(kind, 0) + 1
    entries.sort(key=lambda e: e.name)
    return entries, outside, skipped


def _store_entries(url: str) -> list[Entry]:
    """The entries under a store's prefix, one level (the store's listing, paginated by its driver), sorted.

    Keys are taken as the store has them: a prefix is listed as given (``train//`` is not ``train/``), and each
    entry is named by what follows the prefix in its key, so an empty segment (``train//x``) or a ``..`` one is
    a folder of its own, never folded into another or dropped."""
    backend = open_backend(url)
    fs = getattr(backend, "fs", None) if hasattr(type(backend), "fs") else None
    scheme = split_scheme(url)[0]
    if fs is None:
        return _plugin_entries(backend, url, scheme)
    check = getattr(backend, "check_access", None)
    if check is not None:  # one request first: a driver's listing may retry an endpoint that refuses for minutes
        check(url)
    bucket, _, key = split_scheme(url)[1].lstrip("/").partition("/")
    prefix = key if not key or key.endswith("/") else key + "/"
    path = backend.path(url).rstrip("/")
    try:
        fs.invalidate_cache(path)
        if _lists_raw_prefixes(fs):  # s3fs: its listing by prefix keeps the key exactly as given
            import fsspec.asyn

            found = fsspec.asyn.sync(fs.loop, fs._lsdir, bucket, prefix=prefix, refresh=True)
            under = f"{bucket}/{prefix}"
        else:  # a driver that normalises paths: names are taken relative to the path it listed
            found = fs.ls(path, detail=True)
            under = path.rstrip("/") + "/"
    except FileNotFoundError as exc:
        said = backend.translate(exc, url)
        if not key or _names_a_bucket(said):  # no bucket: said so, as `ls s3://bucket/key` says it
            raise ShardNotFoundError(
                f"{redact(url)}: the bucket {bucket!r} does not exist (or these credentials cannot see it); "
                "check its name in the store's console",
                url=url,
            ) from None
        found = []
    except Exception as exc:
        raise backend.translate(exc, url) from exc
    finally:
        fs.invalidate_cache(path)  # the driver's cached copy goes: the listing below is the one held
    entries = []
    for info in found:
        full = str(info.get("name", ""))
        if not full.startswith(under):  # the prefix itself, or a name the driver gave outside it
            continue
        name = full[len(under) :]
        if info.get("type") == "directory":
            entries.append(Entry(name.rstrip("/") + "/", None))
        elif name and "/" not in name:
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


def _lists_raw_prefixes(fs: Any) -> bool:
    """Whether ``fs`` lists a raw key prefix (s3fs's ``_lsdir(bucket, prefix=...)``), keeping ``//`` and ``..``."""
    import inspect

    lsdir = getattr(fs, "_lsdir", None)
    try:
        return lsdir is not None and "prefix" in inspect.signature(lsdir).parameters and hasattr(fs, "loop")
    except (TypeError, ValueError):
        return False


def _names_a_bucket(error: BaseException) -> bool:
    """Whether the store's own answer (as the backend translated it) says the bucket or container is missing."""
    text = str(error)
    return "bucket" in text or "container" in text


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
        self.usable = _ODD.search(base) is None  # a base a spec cannot carry as it is: no spec at all
        self.specs: list[str] = []
        self.more = 0
        self.beyond = 0  # shards in the runs counted in ``more`` (no spec of theirs is printed)
        self.run: Optional[list[Any]] = None  # head, tail, width, first, last

    def add(self, name: str) -> bool:
        """Take ``name`` into a run; whether it is in one (a name a spec cannot carry as it is, is not)."""
        match = _SHARD.fullmatch(name)
        if match is None or not self.usable or _ODD.search(name):
            return False
        head, number, tail = match.group("head", "number", "tail")
        run = self.run
        if run is not None and (run[0], run[1], run[2]) == (head, tail, len(number)) and int(number) == run[4] + 1:
            run[4] += 1
            return True
        self._close()
        self.run = [head, tail, len(number), int(number), int(number)]
        return True

    def _close(self) -> None:
        if self.run is None:
            return
        head, tail, width, first, last = self.run
        self.run = None
        if len(self.specs) >= MAX_SPECS:
            self.more += 1
            self.beyond += last - first + 1
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
    outside, skipped = 0, dict[str, int]()
    if is_local(url):
        entries, outside, skipped = _local_entries(url)
    else:
        entries = _store_entries(url)
    base = url if url.endswith("/") else url + "/"
    specs = _Specs(base)
    objects = total = shards = folders = 0
    unspecified: list[str] = []  # the first MAX_OUTSIDE shards no spec names; the rest are counted
    loose = 0
    if as_json:
        out.write('{"url": %s, "entries": [' % json.dumps(shown(redact(base))))
    for n, entry in enumerate(_walk(entries)):
        if entry.size is None:
            folders += 1
        else:
            objects += 1
            total += entry.size
            in_spec = specs.add(entry.name)
            if _ANY_SHARD.fullmatch(entry.name):
                shards += 1
                if not in_spec:
                    loose += 1
                    if len(unspecified) < MAX_OUTSIDE:
                        unspecified.append(entry.name)
        if as_json:
            row = {"name": shown(entry.name), "size": entry.size, "kind": "folder" if entry.size is None else "object"}
            note = _misleading(entry.name) if entry.size is None else None
            if note:
                row["note"] = note
            out.write(("," if n else "") + "\n " + json.dumps(row))
        else:
            note = _misleading(entry.name) if entry.size is None else None
            out.write(
                ("       DIR" if entry.size is None else f"{entry.size:>10}")
                + f"  {_printed(entry.name)}"
                + (f"  ({note}: `wds-cloud ls {_printed(redact(base + entry.name))}`)" if note else "")
                + "\n"
            )
    found = specs.done()
    summary = {"objects": objects, "bytes": total, "folders": folders, "shards": shards}
    if as_json:
        extra: dict[str, Any] = {"total": summary, "shard_specs": [shown(redact(s)) for s in found]}
        extra["more_specs"] = specs.more
        if loose:
            extra["shards_outside_specs"] = loose
            extra["shards_outside_specs_named"] = [shown(name) for name in unspecified]
        if outside:
            extra["links_outside_not_listed"] = outside
        if skipped:
            extra["not_listed"] = skipped
        out.write("\n], " + json.dumps(extra)[1:] + "\n")
        return
    out.write(
        f"total: {objects} object{'' if objects == 1 else 's'}, {total:,} bytes"
        + (f", {folders} folder{'' if folders == 1 else 's'}" if folders else "")
        + f", {shards} shard{'' if shards == 1 else 's'}\n"
    )
    for spec in found:
        out.write(f"shards: {_printed(redact(spec))}\n")
    if specs.more:
        out.write(f"  ... and {specs.more} more runs of numbered shards ({specs.beyond} shards)\n")
    if loose:
        named = ", ".join(_printed(name) for name in unspecified) + (", ..." if loose > len(unspecified) else "")
        out.write(
            f"{loose} shard{'' if loose == 1 else 's'} outside any spec (not numbered, or named with "
            f"characters a spec would expand): {named}\n"
        )
    if outside:
        out.write(f"{outside} link{'' if outside == 1 else 's'} leading out of the folder, not followed or listed\n")
    if skipped:
        kinds = ", ".join(f"{count} {kind}{'' if count == 1 else 's'}" for kind, count in sorted(skipped.items()))
        out.write(f"{sum(skipped.values())} entries not listed (not a file or a folder): {kinds}\n")


def _printed(name: str) -> str:
    """``name`` as a line of text shows it: as the CLI shows names (:func:`shown`), control characters escaped
    (``\\n``), so that a name never starts a line that looks like an entry of its own."""
    if name.isprintable():  # most names: nothing to escape (a lone surrogate or a control character is not)
        return name
    name = shown(name)
    if _CONTROL.search(name):
        name = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), name)
    return name


def _misleading(name: str) -> Optional[str]:
    """What a store's folder name with an empty or a dot segment really is (``/``: a key holding ``//``;
    ``../``: a key segment ``..``, not the parent), None for any other name."""
    if name == "/":
        return "an empty key segment (a key with '//'), not this prefix"
    if name in ("../", "./"):
        return f"a key segment {name[:-1]!r}, not a relative path"
    return None


def _walk(entries: list[Entry]) -> Iterable[Entry]:
    """The entries in order, each let go once printed (the listing is held once, and shrinks as it is shown)."""
    entries.reverse()
    while entries:
        yield entries.pop()


def entries_of(url: str) -> Iterator[Entry]:
    """The entries of the folder or prefix ``url`` (for tests and scripts)."""
    entries = _local_entries(url)[0] if is_local(url) else _store_entries(url)
    yield from _walk(entries)
