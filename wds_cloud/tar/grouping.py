"""From members to samples: the key rules, and the one grouping kernel over any member source.

A sample is the run of *adjacent* members sharing a key: by default the key is the member path up to the first
dot of its basename and the rest, lower cased, is the field name (``a/b.seg.png`` -> key ``a/b``, field
``seg.png``).  ``key_rule="last_dot"`` (or any callable returning ``(key, field)``) serves datasets whose
basenames contain periods.  Samples never span shards.

:func:`group` groups the runs a member source hands over (:class:`~wds_cloud.tar.runs.Run`: a shard's members,
read by :class:`~wds_cloud.tar.members.TarMembers`, or member dicts of webdataset's stages, see
:func:`~wds_cloud.tar.samples.group_by_keys`), and keeps a :class:`SamplePosition` (where the sample last
yielded lies in the tar stream) as it goes.  :func:`shard_samples` reads and groups one shard.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Union

from .. import config
from ..errors import ConfigError, CorruptShardError, SampleError, StateMismatchError, redact
from .members import TarMembers, sample_too_large
from .runs import KeyedRun, Run

__all__ = [
    "SamplePosition",
    "group",
    "shard_samples",
    "base_plus_ext",
    "last_dot_split",
    "key_rule",
    "member_filter",
    "sample_limit",
    "repeated_field",
    "meta_prefix",
    "meta_suffix",
    "SKIP_META",
]

meta_prefix = "__"
meta_suffix = "__"
SKIP_META = r"__[^/]*__($|/)"


@dataclass(slots=True)
class SamplePosition:
    """Where a pass over a shard stands, kept by :func:`group` as each sample is yielded (so a reader's state
    costs nothing per sample): the byte range ``[start, end)`` of the sample last yielded in the tar stream
    (``end`` is where the next one begins), the ``samples`` yielded in the pass, and ``next_name``, the member that
    begins the next sample (None at the end of the archive)."""

    start: int = 0
    end: int = 0
    samples: int = 0
    next_name: Optional[str] = None


def _item(index: int) -> property:
    return property(lambda self: self.items[index], lambda self, value: self.items.__setitem__(index, value))


class _ListPosition:
    """A position kept in a list ``[start, end, samples, next_name]``, the spelling ``shard_samples(where=)``
    took before :class:`SamplePosition`."""

    __slots__ = ("items",)

    def __init__(self, items: list) -> None:
        self.items = items

    start = _item(0)
    end = _item(1)
    samples = _item(2)
    next_name = _item(3)


def base_plus_ext(path: str) -> tuple[Optional[str], Optional[str]]:
    """Split at the first dot of the basename: ``a/b.seg.png`` -> ``("a/b", "seg.png")``.

    A basename without a dot gives ``(None, None)``, and so does one starting with a dot, except under a folder
    whose name has no dot, as webdataset 1.0.2 splits it: ``d/.hidden`` -> ``("d/", "hidden")``.
    """
    slash = path.rfind("/")
    dot = path.find(".", slash + 1)
    if dot <= slash + 1 and _keyless(path, slash, dot):
        return None, None
    return path[:dot], path[dot + 1 :]


def _keyless(path: str, slash: int, dot: int) -> bool:
    """For a name whose basename has no dot or starts with one (``dot <= slash + 1``): whether it has no key.  A
    basename starting with a dot under a folder whose name has none (``d/.hidden``) is webdataset 1.0.2's key
    ``d/`` and field ``hidden`` (its pattern lets the key end at the folder's slash)."""
    return dot < 0 or slash < 0 or "." in path[path.rfind("/", 0, slash) + 1 : slash]


def last_dot_split(path: str) -> tuple[Optional[str], Optional[str]]:
    """Split at the last dot of the basename: ``a/img.v2.png`` -> ``("a/img.v2", "png")``."""
    slash = path.rfind("/")
    dot = path.rfind(".")
    if dot <= slash + 1:
        return None, None
    return path[:dot], path[dot + 1 :]


_RULES = {"first_dot": base_plus_ext, "last_dot": last_dot_split}


def key_rule(rule: Union[str, Callable[[str], tuple], None]) -> Callable[[str], tuple]:
    """The key/field splitter for ``rule``: ``"first_dot"`` (default), ``"last_dot"``, or a callable."""
    if rule is None:
        return base_plus_ext
    if callable(rule):
        return rule
    try:
        return _RULES[rule]
    except KeyError:
        raise ConfigError(
            f"unknown key rule {rule!r}: use 'first_dot', 'last_dot', or a callable returning (key, field)"
        ) from None


def _is_meta(name: str, skip_meta: Optional[str]) -> bool:
    if not name.startswith(meta_prefix):
        return False
    if "/" not in name and name.endswith(meta_suffix):
        return True
    return skip_meta is not None and re.match(skip_meta, name) is not None


def member_filter(skip_meta, select_files, rename_files) -> Optional[Callable[[str], bool]]:
    """Which members a shard's reader keeps: not the metadata ones (``__key__``-like names, or ``skip_meta``'s),
    and those ``select_files`` keeps (asked with the renamed name)."""
    if skip_meta is None and select_files is None:

        def select(name: str) -> bool:
            return not (name.startswith(meta_prefix) and "/" not in name and name.endswith(meta_suffix))

    else:

        def select(name: str) -> bool:
            if _is_meta(name, skip_meta):
                return False
            if select_files is not None:
                return bool(select_files(rename_files(name) if rename_files else name))
            return True

    # without select_files, only names that begin with meta_prefix can be dropped: the tar reader asks about
    # those alone (a call per member saved)
    select.meta_only = select_files is None and meta_prefix == "__" and skip_meta in (None, SKIP_META)  # type: ignore[attr-defined]
    return select


def sample_limit(given: Optional[int] = None, member_limit: Optional[int] = None) -> int:
    """The most bytes one sample may span in its tar stream (headers, long names and data): ``given``,
    else ``WDS_MAX_SAMPLE_SIZE``, else the member limit (``member_limit``, else the setting).

    A sample's fields are held in memory together, so a shard whose members share one key (a few
    bytes each when compressed) could otherwise fill memory one member at a time.
    """
    if given is not None:
        return given
    settings = config.current()
    if settings.max_sample_size is not None:
        return settings.max_sample_size
    return member_limit if member_limit is not None else settings.max_member_size


def repeated_field(url: Any, name: str, offset: Optional[int], key: str, field: str) -> SampleError:
    """The error for a member repeating a field of its sample (webdataset's "duplicate file name").

    A ``SampleError`` (a ``ValueError``, as webdataset raises), not a ``CorruptShardError``: the tar stream
    is sound, so a handler that lets it pass skips the member and the shard goes on.
    """
    where = f" at byte {offset}" if offset is not None else ""
    return SampleError(
        f"{redact(url or '<stream>')}: member {name!r}{where} repeats the field {field!r} of sample {key!r} "
        "(a duplicate file name in the tar file); a sample holds one member per field: write each field once "
        "per sample, or give a handler (handler=warn_and_continue) to skip the repeat and keep the first",
        url=url,
        member=name,
        offset=offset,
        key=key,
        field=field,
    )


def group(
    runs: Iterable[Union[Run, KeyedRun]],
    members: Any,
    url: Any,
    *,
    keys: Callable = base_plus_ext,
    lcase: bool = True,
    suffixes: Optional[Iterable[str]] = None,
    local_path: Optional[str] = None,
    position: Optional[SamplePosition] = None,
    rename_files: Optional[Callable] = None,
    on_repeat: Optional[Callable[[Exception], bool]] = None,
    limit: Optional[int] = None,
    last_ok: Optional[Callable[[dict], bool]] = None,
) -> Iterator[dict]:
    """The grouping kernel: adjacent members sharing a key become a sample, over the runs of any member source.

    ``members`` is the source (``sample_start`` is set where each sample begins, ``finish()`` is called after
    the last; ``archive_end`` and ``offset`` say where a shard ended); ``position`` is kept up to date.  A sample
    spanning more than ``limit`` bytes raises, checked at every member; a repeated field raises unless
    ``on_repeat(error)`` says to skip the member; the last sample is yielded when ``last_ok(sample)`` says so
    (default: it holds a field).

    Two loops, one per kind of run: the general one, and the keyed one for a member table's split names
    (:class:`~.runs.KeyedRun`, where the default rule's split is done already), which repeats the general loop's
    steps without the name splitting and is kept for speed (bench_read's tiny row; the mapped-read tests compare
    the two on the same shards).  Kept whole, with its steps written out: it runs per member, and a call or a
    generator layer per member or per sample would cost the small-sample workloads several percent.
    """
    suffixes = set(suffixes) if suffixes is not None else None
    fast_keys = keys is base_plus_ext
    limit = limit if limit is not None else 1 << 62
    current: Optional[dict] = None  # the sample being grouped (None before the first)
    key = None
    start = members.sample_start
    for run in runs:
        base = run.base
        # a member whose header lies past this position of the run's buffer runs its sample past the limit
        over = start - base + limit
        if isinstance(run, KeyedRun):
            source = run.source
            for prefix, suffix, head, size in zip(run.keys, run.fields, run.heads, run.sizes):
                if prefix != key:
                    record = base + head
                    if current is not None:
                        if position is not None:
                            position.start, position.end, position.next_name = start, record, prefix + "." + suffix
                            position.samples += 1
                        yield current
                    current = {"__key__": prefix, "__url__": url}
                    if local_path is not None:
                        current["__local_path__"] = local_path
                    key = prefix
                    start = members.sample_start = record
                    over = head + limit
                if head > over:
                    raise sample_too_large(url, start, base + head, limit)
                if suffix in current:  # type: ignore[operator]
                    exn = repeated_field(url, prefix + "." + suffix, base + head, prefix, suffix)
                    if on_repeat is None or not on_repeat(exn):
                        raise exn
                    continue
                begin = head + 512
                current[suffix] = source[begin : begin + size]  # type: ignore[index]
            continue
        record0, items = run.record, run.items
        if run.read is not None:  # a large member: the sample before it goes out before its data is read
            name = rename_files(run.names[0]) if rename_files is not None else run.names[0]
            if current is not None and keys(name)[0] not in (None, key):
                if position is not None:
                    position.start, position.end = start, base + run.heads[0] if record0 is None else record0
                    position.next_name = name
                    position.samples += 1
                yield current
                current = None
            data = None  # (the last member of the sample handed over: not held while this one is read)
            run.datas[0] = run.read()
        at = items is None  # offsets are the tar stream's (member dicts have none to name)
        for name, data, head in zip(run.names, run.datas, run.heads) if at else items:
            if rename_files is not None:
                name = rename_files(name)
            if fast_keys:
                slash = name.rfind("/")
                dot = name.find(".", slash + 1)
                if dot <= slash + 1 and _keyless(name, slash, dot):
                    if head > over:  # no sample takes it, but it lies within the one being grouped
                        raise sample_too_large(url, start, base + head, limit)
                    continue
                prefix, suffix = name[:dot], name[dot + 1 :]
            else:
                prefix, suffix = keys(name)
                if prefix is None:
                    if head > over:
                        raise sample_too_large(url, start, base + head, limit)
                    continue
            if lcase:
                suffix = suffix.lower()
            if prefix != key or current is None:
                record = base + head if record0 is None else record0
                if current is not None:
                    if position is not None:
                        position.start, position.end, position.next_name = start, record, name
                        position.samples += 1
                    yield current
                current = {"__key__": prefix, "__url__": url}
                if local_path is not None:
                    current["__local_path__"] = local_path
                key = prefix
                start = members.sample_start = record
                over = start - base + limit
            if head > over:
                raise sample_too_large(url, start, base + head, limit)
            if suffixes is not None and suffix not in suffixes:
                continue
            if suffix in current:
                exn = repeated_field(url, name, base + head if at else None, prefix, suffix)
                if on_repeat is None or not on_repeat(exn):
                    raise exn
                continue  # the member is skipped; the sample keeps the field's first member, as webdataset's
            current[suffix] = data
    if current is not None and (last_ok is None or last_ok(current)):
        if position is not None:
            position.start, position.end = (
                start,
                members.archive_end if members.archive_end is not None else members.offset,
            )
            position.samples += 1
            position.next_name = None
        yield current
    members.finish()  # after the last sample: what trails the archive never delays it


def shard_samples(
    url: str,
    stream: Any,
    *,
    keys: Callable = base_plus_ext,
    lcase: bool = True,
    suffixes: Optional[Iterable[str]] = None,
    select_files: Optional[Callable] = None,
    rename_files: Optional[Callable] = None,
    skip_meta: Optional[str] = SKIP_META,
    local_path: Optional[str] = None,
    position: Optional[SamplePosition] = None,
    members: Optional[TarMembers] = None,
    expect_first: Any = (),
    record: Optional[Callable[[str, int, int], None]] = None,
    max_sample: Optional[int] = None,
    on_repeat: Optional[Callable[[Exception], bool]] = None,
    where: Optional[list] = None,
) -> Iterator[dict]:
    """The samples of one shard, read and grouped in a single loop.

    Raises on damage; a sample cut short by the damage is never yielded.  ``position`` (a
    :class:`SamplePosition`), when given, is kept up to date as each sample is yielded.  ``members`` is a prepared
    :class:`~.members.TarMembers` over ``stream`` (to read from a given offset); ``expect_first`` (a resumed read)
    is the name its first member must have, None for the end of the archive.  ``record(name, data offset,
    size)`` sees every member read (to index the shard as it streams).  ``max_sample``: the most bytes a
    sample may hold (see :func:`sample_limit`).  ``on_repeat(error)`` is given the :func:`repeated_field` error
    of a member repeating a field of its sample: True skips that member and the shard goes on (webdataset's
    ``group_by_keys`` with a handler); without it, or when it returns False, the error is raised.  ``where``, a
    list of four kept as ``[start, end, samples, next_name]``, is the position's older spelling.
    """
    if where is not None:
        position = _ListPosition(where)  # type: ignore[assignment]
    if members is None:
        members = TarMembers(
            stream,
            url,
            select=member_filter(skip_meta, select_files, rename_files),
            max_member=config.current().max_member_size,
        )
    members.max_sample = sample_limit(max_sample, members.max_member)
    # a table's split names serve the default rule as it stands (no renaming, every field, lower-cased)
    keyed = rename_files is None and keys is base_plus_ext and lcase and suffixes is None and record is None
    runs: Iterable[Union[Run, KeyedRun]] = members.runs(keyed, defer=record is None)
    if expect_first != ():
        runs = _checked_start(runs, members, expect_first, url, rename_files)
    if record is not None:
        runs = _recorded(runs, record)
    # the kernel's generator itself is returned: no generator layer of our own per sample
    return group(
        runs,
        members,
        url,
        keys=keys,
        lcase=lcase,
        suffixes=suffixes,
        local_path=local_path,
        position=position,
        rename_files=rename_files,
        on_repeat=on_repeat,
        limit=members.max_sample,
    )


def _recorded(runs: Iterable[Any], record: Callable[[str, int, int], None]) -> Iterator[Any]:
    """``runs``, each member seen by ``record(name, data offset, size)`` first."""
    for run in runs:
        base = run.base
        for name, data, head in zip(run.names, run.datas, run.heads):
            record(name, base + head + 512, len(data))
        yield run


def _checked_start(
    runs: Iterable[Any], members: TarMembers, expected: Optional[str], url: str, rename_files: Optional[Callable]
) -> Iterator[Any]:
    """``runs``, having checked that a resumed read begins at the member the saved state names."""
    iterator = iter(runs)
    try:
        first = next(iterator, None)
    except CorruptShardError as exc:  # no tar member where the state says one begins
        raise StateMismatchError(
            f"{redact(url)}: the saved state resumes at byte {members.sample_start}, where no tar member begins "
            f"({exc}); the state was changed, or the shard was: load a state that state_dict() returned for "
            "these shards",
            url=url,
            offset=members.sample_start,
            field="offset",
        ) from exc
    if first is None:
        if expected is not None:
            raise StateMismatchError(
                f"{redact(url)}: the saved state expects the member {expected!r} at byte {members.offset}, but the "
                "archive ends there: the state was changed, or the shard was",
                url=url,
                field="offset",
            )
        return
    name = first.keys[0] + "." + first.fields[0] if type(first) is KeyedRun else first.names[0]
    shown = rename_files(name) if rename_files else name
    if shown != expected:
        record = first.record if type(first) is Run and first.record is not None else first.base + first.heads[0]
        raise StateMismatchError(
            f"{redact(url)}: the saved state resumes at byte {record}, where it expects the "
            f"member {expected!r} to begin a sample, but {shown!r} is there: the state was changed, or "
            "the shard was; load a state that state_dict() returned for these shards",
            url=url,
            offset=record,
            field="offset",
        )
    yield first
    yield from iterator
