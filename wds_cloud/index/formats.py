"""Member indexes of shards: where every field of every sample lies, so a sample is one ranged read.

:func:`build_index` reads a shard once (streaming, any URL ``gopen`` opens) and records, for every
sample, its key and, for every field, the byte offset and size of its data in the tar (the
decompressed tar, for a compressed shard).  A :class:`ShardIndex` is written and read in three
formats (see ``docs/indexes.md``):

- ours, JSON (``{"format": "wds_cloud.index", "version": 1, ...}``): every sample and field;
- DALI's per-shard ``.idx`` text (``v1.2 <samples>``, then per sample ``ext offset size name`` per
  field), as DALI's ``wds2idx`` writes it, so one index serves ``fn.readers.webdataset`` too;
- ``wids``' dataset description (``{"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist":
  [{"url", "nsamples", "filesize", ...}]}``), which lists shards with their sample counts only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, Optional, cast

from .. import config
from ..errors import ConfigError, CorruptIndexError, CorruptShardError, MalformedDataError, redact
from ..io.datafile import is_count, need
from ..io.datafile import shown as shown_value
from ..io.descriptions import ShardRows, check_shard
from ..io.integrity import Hashing
from ..io.open import gopen
from ..io.urls import is_local, local_path, local_version, name_in_file
from ..tar.decompress import COMPRESSIONS, HEAD_SIZE, detect_compression
from ..tar.format import ZERO_BLOCK, plain_member
from ..tar.grouping import SKIP_META, base_plus_ext, member_filter, repeated_field
from ..tar.members import TarMembers

__all__ = [
    "ShardIndex",
    "SampleEntry",
    "build_index",
    "index_stream",
    "group_members",
    "FORMAT",
    "dali_text",
    "parse_dali",
    "wids_description",
    "parse_wids",
    "iter_wids",
    "split_name",
]

FORMAT = "wds_cloud.index"
VERSION = 1
DALI_VERSION = "v1.2"


@contextlib.contextmanager
def _acyclic() -> Iterator[None]:
    """Pause the cycle collector while an index (thousands of small lists and tuples, never a cycle) is built.

    Each few hundred containers made start a collection, and in a process holding torch's ~200k objects
    the full ones rescan all of them, most of the time of turning an index into JSON.  The
    collector runs again as it was when the block ends (a block in another thread cannot leave it off).
    """
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def split_name(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member name, as the reader splits it (webdataset's rule,
    :func:`~wds_cloud.tar.grouping.base_plus_ext`): at the first dot of its last path part (``a/b.seg.png`` ->
    ``("a/b", "seg.png")``; ``d/.hidden`` -> ``("d/", "hidden")``, ``a.`` -> ``("a", "")``); ``("", "")``
    when it has no key.  The extension keeps its case (as wids and DALI read it; WebDataset lower-cases it)."""
    key, ext = base_plus_ext(name)
    return ("", "") if key is None else (key, cast(str, ext))


@dataclasses.dataclass
class SampleEntry:
    """One sample: its key, and ``(extension, data offset, size, member name)`` per field, in tar order."""

    key: str
    fields: list[tuple[str, int, int, str]]

    @property
    def start(self) -> int:
        """Where the first field's data begins."""
        return self.fields[0][1]

    @property
    def end(self) -> int:
        """Where the last field's data ends (one ranged read ``[start, end)`` holds every field)."""
        return max(offset + size for _, offset, size, _ in self.fields)


@dataclasses.dataclass
class ShardIndex:
    """The index of one shard (see the module docstring)."""

    url: str
    samples: list[SampleEntry]
    size: Optional[int] = None  #: bytes of the shard as stored
    version: Optional[str] = None  #: the store's version tag (ETag, generation) when it gave one
    compression: Optional[str] = None  #: None for a plain tar; offsets then are in the decompressed tar
    #: whether ``version`` is a local file's (modification time and size): a copy elsewhere (uploaded with its
    #: index, which names it relatively) has the store's versions, so only its size can be compared
    local_version: bool = False

    def __len__(self) -> int:
        return len(self.samples)

    # ours
    def to_json(self, relative_to: Optional[str] = None) -> dict:
        """The index as JSON; ``relative_to`` (where it will be written) names the shard relative to it when the
        shard lies in that folder or below (see :func:`~wds_cloud.io.urls.name_in_file`)."""
        rows = []
        with _acyclic():
            for sample in self.samples:
                prefix = sample.key + "."
                rows.append(
                    [
                        sample.key,
                        [
                            [ext, offset, size] if name == prefix + ext else [ext, offset, size, name]
                            for ext, offset, size, name in sample.fields
                        ],
                    ]
                )
        return {
            "format": FORMAT,
            "version": VERSION,
            "url": name_in_file(self.url, relative_to) if relative_to is not None else self.url,
            "size": self.size,
            "object_version": self.version,
            "compression": self.compression,
            **({"version_of": "local file"} if self.version is not None and is_local(self.url) else {}),
            "samples": rows,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "<index>") -> ShardIndex:
        """Our index from parsed JSON, every field checked (see :func:`check_layout`); a
        :class:`~wds_cloud.errors.CorruptIndexError` naming ``where`` and the field otherwise."""
        shown = redact(where)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CorruptIndexError(
                f'{shown}: not a wds_cloud index (no "format": "{FORMAT}"); write one with `wds-cloud index URL`',
                field="format",
            )
        if data.get("version") != VERSION:
            raise CorruptIndexError(
                f"{shown}: wds_cloud index version {shown_value(data.get('version'))} is not "
                f"supported (this version reads {VERSION}); write it again with `wds-cloud index`",
                field="version",
            )
        url, size, version, compression = (
            data.get("url"),
            data.get("size"),
            data.get("object_version"),
            data.get("compression"),
        )
        _need(isinstance(url, str), shown, "'url'", "must be the shard's URL")
        _need(
            size is None or is_count(size), shown, "'size'", f"must be a whole number of bytes, not {shown_value(size)}"
        )
        _need(
            version is None or (isinstance(version, str) and len(version) <= 1024),
            shown,
            "'object_version'",
            "must be the store's version tag (a string)",
        )
        _need(
            compression is None or compression in COMPRESSIONS,
            shown,
            "'compression'",
            f"must be one of {', '.join(COMPRESSIONS)} or null",
        )
        rows = data.get("samples")
        _need(isinstance(rows, list), shown, "'samples'", "must be a list of [key, fields] rows")
        with _acyclic():
            samples = _samples_from_json(cast(list, rows), shown, size)
        _need(
            data.get("version_of") in (None, "local file"),
            shown,
            "'version_of'",
            'must be "local file" or absent (a store\'s version)',
        )
        return cls(cast(str, url), samples, size, version, compression, data.get("version_of") == "local file")

    # DALI
    def to_dali(self) -> str:
        return dali_text(self)

    def __repr__(self) -> str:
        return f"<ShardIndex {redact(self.url)}: {len(self.samples)} samples>"


def _need(ok: bool, shown: str, field: str, problem: str) -> None:
    need(ok, shown, field, problem, "write the index again with `wds-cloud index`", CorruptIndexError)


def _samples_from_json(rows: list, shown: str, size: Optional[int]) -> list[SampleEntry]:
    """The samples of our JSON index, each checked, its layout too (as :func:`check_layout`, in the same loop:
    this is on the path to a first sample, and runs once per field)."""
    settings = config.current()
    most_member = settings.max_member_size
    most_span = settings.max_sample_size or most_member
    end_of_shard = size if size is not None else 1 << 62
    free = 0  # the first byte the next header may use
    samples: list[SampleEntry] = []
    append = samples.append
    for number, row in enumerate(rows):
        if type(row) is not list or len(row) != 2:
            _need(False, shown, f"samples[{number}]", "must be [key, fields] with a key and at least one field")
        key, fields = row
        if type(key) is not str or type(fields) is not list or not key or not fields:
            _need(False, shown, f"samples[{number}]", "must be [key, fields] with a key and at least one field")
        prefix = key + "."
        entries: list[tuple[str, int, int, str]] = []
        for f in fields:
            if type(f) is not list:
                _need(False, shown, f"samples[{number}]", "has a field that is not [ext, offset, size(, name)]")
            n = len(f)
            if n == 3:
                ext, offset, length = f
                name = prefix + ext if type(ext) is str else None
            elif n == 4:
                ext, offset, length, name = f
            else:
                _need(False, shown, f"samples[{number}]", "has a field that is not [ext, offset, size(, name)]")
            if (
                type(ext) is not str
                or type(offset) is not int
                or type(length) is not int
                or offset < 0
                or length < 0
                or type(name) is not str
                or not ext
            ):
                _need(False, shown, f"samples[{number}]", "has an extension, offset, size or name of the wrong type")
            if offset & 511 or offset - 512 < free or length > most_member:
                _bad_field(shown, number, offset, length, most_member, size)
            free = offset + ((length + 511) & ~511)
            entries.append((ext, offset, length, cast(str, name)))
        end = offset + length
        if end > end_of_shard or end - entries[0][1] > most_span:
            _bad_sample(shown, number, entries[0][1], end, size, most_span)
        append(SampleEntry(key, entries))
    return samples


def _over_limit(shown: str, number: int, what: str, length: int, variable: str, limit: int) -> None:
    """A field or sample the index places inside its shard but larger than a limit of this configuration: the
    limit refuses it, not the index (writing the index again gives the same one), so the fix is the limit."""
    raise CorruptIndexError(
        f"{shown}: samples[{number}] has {what} {length} bytes, more than the {variable} limit ({limit} bytes) "
        f"this run reads; raise {variable} (such as 8GiB) if the shard is trusted",
        field=f"samples[{number}]",
    )


def _bad_field(shown: str, number: int, offset: int, length: int, most_member: int, size: Optional[int]) -> None:
    if length > most_member:
        if size is not None and offset + length > size:  # the index disagrees with its shard
            _need(
                False,
                shown,
                f"samples[{number}]",
                f"claims a field of {length} bytes, past the end of the {size}-byte shard (and more than "
                f"WDS_MAX_MEMBER_SIZE, {most_member})",
            )
        _over_limit(shown, number, "a field of", length, "WDS_MAX_MEMBER_SIZE", most_member)
    _need(
        False,
        shown,
        f"samples[{number}]",
        f"has a field at byte {offset}, which is not where a tar member's "
        "data can begin (each follows its 512-byte header, after the field before it)",
    )


def _bad_sample(shown: str, number: int, first: int, end: int, size: Optional[int], most_span: int) -> None:
    if size is not None and end > size:
        _need(False, shown, f"samples[{number}]", f"ends at byte {end}, past the end of the {size}-byte shard")
    _over_limit(shown, number, "a sample that spans", end - first, "WDS_MAX_SAMPLE_SIZE", most_span)


def check_layout(samples: list[SampleEntry], size: Optional[int], shown: str) -> None:
    """Refuse an index that cannot describe a tar: every field's data starts on a 512-byte block after its
    header, fields (and samples) in the order of the tar and never overlapping, inside the shard's ``size``
    when known, no field beyond ``WDS_MAX_MEMBER_SIZE`` and no sample beyond ``WDS_MAX_SAMPLE_SIZE``.
    What is read by this index is then bounded by the configuration, never by the index's claims.  (Our JSON
    index is checked so as it is parsed; this is for indexes built otherwise, such as DALI's.)"""
    settings = config.current()
    most_member = settings.max_member_size
    most_span = settings.max_sample_size or most_member
    end_of_shard = size if size is not None else 1 << 62
    free = 0
    for number, sample in enumerate(samples):
        for _, offset, length, _ in sample.fields:
            if offset & 511 or offset - 512 < free or length > most_member:
                _bad_field(shown, number, offset, length, most_member, size)
            free = offset + ((length + 511) & ~511)
        end = offset + length
        if end > end_of_shard or end - sample.fields[0][1] > most_span:
            _bad_sample(shown, number, sample.fields[0][1], end, size, most_span)


def index_stream(
    stream: IO[bytes],
    url: str = "",
    keys: Optional[Callable[[str], tuple]] = None,
    max_member: Optional[int] = None,
    on_member: Optional[Callable[[str, bytes], None]] = None,
    read: Optional[list] = None,
) -> tuple[list[SampleEntry], TarMembers]:
    """The samples of a tar stream read once from its start (``keys``: the key rule, default first dot).

    Members whose key is empty (hidden files, names without a dot) and ``__meta__`` files are left out,
    as the readers leave them out.  ``on_member(name, data)`` sees every member read (for checksums);
    ``read`` (a list), where given, gets each member's ``(name, data offset, size)`` as it is read: what was read
    before damage stops the stream (``wds-cloud ls`` lists it before the error).
    """
    if max_member is None:  # the limit every reader applies (WDS_MAX_MEMBER_SIZE), so the tools agree with them
        max_member = config.current().max_member_size
    members = TarMembers(stream, url, select=member_filter(SKIP_META, None, None), max_member=max_member)
    if read is None:
        read = []
    for name, data in members:
        if on_member is not None:
            on_member(name, data)
        read.append((name, members.member_offset + 512, len(data)))
    return group_members(read, keys, url), members


#: the fields every sample the reader yields holds before its members: a member naming one repeats it
_TAKEN = frozenset(("__key__", "__url__"))


def group_members(
    members: Iterable[tuple[str, int, int]], keys: Optional[Callable[[str], tuple]] = None, url: str = ""
) -> list[SampleEntry]:
    """``(name, data offset, size)`` members, in tar order, grouped into samples by key.

    A member repeating a field of its sample (the field names compared lower-cased, as the reader groups them,
    ``__key__`` and ``__url__`` taken already) raises the reader's :func:`~wds_cloud.tar.grouping.repeated_field`
    error: an index or a check of a shard agrees with what reading it gives."""
    split = keys or split_name
    samples: list[SampleEntry] = []
    last = None
    taken: set = set()
    for name, offset, size in members:
        key, ext = split(name)
        if not key:  # (an empty extension is a field, as the reader groups it)
            continue
        field = ext.lower()
        if key != last:
            taken = set(_TAKEN)
        if field in taken:
            raise repeated_field(url, name, offset - 512, key, field)
        taken.add(field)
        entry = (ext, offset, size, name)
        if key != last:
            samples.append(SampleEntry(key, [entry]))
            last = key
        else:
            samples[-1].fields.append(entry)
    return samples


def build_index(
    url: str,
    *,
    keys: Optional[Callable[[str], tuple]] = None,
    storage_options: Optional[dict] = None,
    max_member: Optional[int] = None,
) -> ShardIndex:
    """Read the shard at ``url`` once and index it (any URL ``gopen`` opens).

    A local uncompressed shard of plain headers is indexed by reading its headers only (the data is
    stepped over); anything else, and any header out of the ordinary, is read through the tar reader.
    """
    if is_local(url):
        with _acyclic():
            walked = _walk_local(local_path(url), url, keys or split_name)
        if walked is not None:
            _refuse_large_members(walked, url, max_member)
            return walked
    before = None
    if is_local(url):
        try:
            before = local_version(os.stat(local_path(url)))
        except OSError:
            pass  # gopen gives the error, with the fix
    with gopen(url, "rb", storage_options=storage_options) as stream:
        counted = Hashing(stream)
        samples, members = index_stream(cast(IO[bytes], counted), url, keys, max_member)
        if members.archive_end is None:
            raise CorruptShardError(
                f"{redact(url)}: the shard ended without the tar end-of-archive marker; it cannot be indexed", url=url
            )
        counted.drain()  # the rest (zero blocks), so the size is the object's
        return ShardIndex(
            url,
            samples,
            size=getattr(stream, "size", None) or counted.count,
            version=before or getattr(stream, "version", None),
            compression=members.compression,
        )


def _refuse_large_members(index: ShardIndex, url: str, max_member: Optional[int]) -> None:
    """The member limit the tar reader applies, for a shard indexed from its headers alone (same error, same
    advice: the shard is as it is, the limit is the setting)."""
    limit = max_member if max_member is not None else config.current().max_member_size
    for sample in index.samples:
        for _, offset, length, name in sample.fields:
            if length > limit:
                raise CorruptShardError(
                    f"{redact(url)}: member {name!r} at byte {offset - 512} is {length} bytes, more than the limit "
                    f"of {limit} bytes on one member; raise it with WDS_MAX_MEMBER_SIZE (such as 8GiB) if the "
                    "shard is trusted",
                    url=url,
                    offset=offset - 512,
                    member=name,
                    size=length,
                    limit=limit,
                )


#: the members every reader leaves out (metadata files), asked as the readers ask
_KEEP = member_filter(SKIP_META, None, None)


def _walk_local(path: str, url: str, split: Callable[[str], tuple]) -> Optional[ShardIndex]:
    """The index of a local plain tar from its headers alone, or None (compressed, GNU/PAX records, links,
    damage: the tar reader then reads it and says what is wrong)."""
    try:  # not waiting for a FIFO's writer; anything but a regular file is left to gopen, which refuses it
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError):
        return None  # gopen gives the error, with the fix
    try:
        st = os.fstat(fd)
        total = st.st_size
        if not stat.S_ISREG(st.st_mode) or total < 1024 or detect_compression(os.pread(fd, HEAD_SIZE, 0)) is not None:
            return None
        read: list[tuple[str, int, int]] = []
        at = 0
        while at + 512 <= total:
            header = os.pread(fd, 512, at)
            if header == ZERO_BLOCK:
                samples = group_members(read, split, url)
                return ShardIndex(url, samples, size=total, version=local_version(os.fstat(fd)))
            member = plain_member(header)
            if member is None:
                return None
            name, size = member
            if at + 512 + size > total:
                return None
            if _KEEP(name):  # type: ignore[misc]
                read.append((name, at + 512, size))
            at += 512 + ((size + 511) & ~511)
        return None  # no end-of-archive block: the reader says so
    except OSError:
        return None  # a read the system refused (EIO): the tar reader reads it again and names the file and byte
    finally:
        os.close(fd)


# DALI's .idx text
def dali_text(index: ShardIndex) -> str:
    """The index as DALI's ``wds2idx`` writes it: ``v1.2 N``, then one line per sample of
    ``ext offset size name`` groups (offset: where the member's data begins)."""
    if index.compression is not None:
        raise ConfigError(
            f"{redact(index.url)}: DALI reads only uncompressed tar shards ({index.compression} "
            "here); reshard it without compression (`wds-cloud reshard --compress none`)"
        )
    lines = [f"{DALI_VERSION} {len(index.samples)}"]
    for sample in index.samples:
        if any(" " in name for *_, name in sample.fields):
            raise ConfigError(
                f"{redact(index.url)}: member names with spaces cannot be written in DALI's "
                f"index format (sample {sample.key!r})"
            )
        if any(not ext for ext, *_ in sample.fields):
            raise ConfigError(
                f"{redact(index.url)}: a member whose name ends with its dot (a field without an extension) "
                f"cannot be written in DALI's index format (sample {sample.key!r}); use the json format"
            )
        lines.append(" ".join(f"{ext} {offset} {size} {name}" for ext, offset, size, name in sample.fields))
    return "\n".join(lines) + "\n"


def parse_dali(text: str, url: str = "") -> ShardIndex:
    """A DALI ``.idx`` text as a :class:`ShardIndex` (v1.0 lines without names, and v1.1/v1.2), every field checked."""
    shown = redact(url) or "<index>"
    lines = text.splitlines()
    if not lines:
        raise CorruptIndexError(f"{shown}: an empty DALI index; write it again", field="header")
    head = lines[0].split()
    if len(head) != 2 or not head[0].startswith("v1.") or not head[1].isdigit() or not head[1].isascii():
        raise CorruptIndexError(
            f"{shown}: not a DALI index (first line {lines[0][:40]!r}, expected 'v1.2 <samples>')", field="header"
        )
    width = 4 if head[0] in ("v1.1", "v1.2") else 3
    samples: list[SampleEntry] = []
    for number, line in enumerate(lines[1:], 2):
        parts = line.split()
        if not parts:
            continue
        if len(parts) % width:
            raise CorruptIndexError(
                f"{shown}: line {number} of the DALI index has {len(parts)} words, not groups of "
                f"{width}; write it again",
                field=f"line {number}",
            )
        fields = []
        for i in range(0, len(parts), width):
            ext, offset, size = parts[i], parts[i + 1], parts[i + 2]
            if not (offset.isdigit() and size.isdigit() and offset.isascii() and size.isascii()):
                raise CorruptIndexError(
                    f"{shown}: line {number} of the DALI index has an offset or size that is not "
                    "a whole number; write it again",
                    field=f"line {number}",
                )
            name = parts[i + 3] if width == 4 else f"{len(samples):08d}.{ext}"
            fields.append((ext, int(offset), int(size), name))
        samples.append(SampleEntry(split_name(fields[0][3])[0] or f"{len(samples):08d}", fields))
    if len(samples) != int(head[1]):
        raise CorruptIndexError(
            f"{shown}: the DALI index announces {int(head[1])} samples but lists {len(samples)}; write it again",
            field="header",
        )
    check_layout(samples, None, shown)
    return ShardIndex(url, samples)


# wids dataset descriptions
def wids_description(
    shards: Iterable[dict], name: Optional[str] = None, base: Optional[str] = None, at: Optional[str] = None
) -> dict:
    """A ``wids`` dataset description: ``shards`` are ``{"url", "nsamples", "filesize"[, "md5sum"]}``; ``at``, where
    it will be written, makes each shard's name relative to that file's folder (readers resolve names there) when
    the shard lies in it or below, else absolute, so the description reads back from any working directory."""
    rows = [dict(s) for s in shards]
    if at is not None:
        for row in rows:
            row["url"] = name_in_file(row["url"], at)
    out: dict = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": rows}
    if name:
        out["name"] = name
    if base:
        out["base"] = base
    return out


def parse_wids(data: Any, where: str = "<description>") -> list[dict]:
    """The shard list of a ``wids`` dataset description, every field checked (``url`` a string, ``nsamples`` and
    ``filesize`` whole and consistent: a sample spans at least one 512-byte tar block), with ``datasets``
    components flattened; URLs are returned as written (resolve them with :func:`wds_cloud.io.security.resolve`)."""
    shards = list(iter_wids(data, where))
    if not shards:
        raise MalformedDataError(f"{redact(where)}: the dataset description lists no shards", field="shardlist")
    return shards


def iter_wids(data: Any, where: str = "<description>") -> Iterator[dict]:
    """The shards of :func:`parse_wids` one at a time (a description of one shard a line is read as a stream)."""
    shown = redact(where)
    if not isinstance(data, dict) or data.get("wids_version") != 1:
        raise MalformedDataError(
            f'{shown}: not a wids dataset description (it needs "wids_version": 1 and a "shardlist")',
            field="wids_version",
        )
    components = data.get("datasets") or []
    need(isinstance(components, list), shown, "'datasets'", "must be a list of components")
    for c, component in enumerate(components):
        need(isinstance(component, dict), shown, f"datasets[{c}]", 'must be a mapping with a "shardlist"')
        if "source_url" in component:
            raise MalformedDataError(
                f'{shown}: components with "source_url" are not followed; list their shards in this description',
                field=f"datasets[{c}].source_url",
            )
        base = component.get("base")
        need(base is None or isinstance(base, str), shown, f"datasets[{c}].base", "must be a URL or path")
    yield from _shardlist(data, shown, "shardlist")
    for c, component in enumerate(components):
        yield from _shardlist(component, shown, f"datasets[{c}].shardlist", component.get("base"))


def _shardlist(data: dict, shown: str, field: str, base: Optional[str] = None) -> Iterator[dict]:
    entries = data.get("shardlist") or []
    if isinstance(entries, ShardRows):  # the lines form: read as a stream, each row checked as it is read
        for shard in entries:
            yield dict(shard, base=base) if base else shard
        return
    need(isinstance(entries, list), shown, f"'{field}'", "must be a list of shards")
    for i, shard in enumerate(entries):
        check_shard(shard, shown, f"{field}[{i}]")
        item = dict(shard)
        if base:
            item["base"] = base
        yield item


def dumps(index: ShardIndex) -> str:
    return json.dumps(index.to_json(), separators=(",", ":"))
