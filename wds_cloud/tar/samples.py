"""From tar members to samples: the key rules, and grouping adjacent members into samples.

A sample is the run of *adjacent* members sharing a key: by default the key
is the member path up to the first dot of its basename and the rest, lower
cased, is the field name (``a/b.seg.png`` -> key ``a/b``, field ``seg.png``).
``key_rule="last_dot"`` (or any callable returning ``(key, field)``) serves
datasets whose basenames contain periods.  Samples never span shards.

:func:`shard_samples` reads one shard and groups it in a single loop (the shard
reader, :mod:`wds_cloud.tar.shardreader`, uses it); webdataset's separate stages
(``url_opener``, ``tar_file_expander``, ``group_by_keys``) are kept, with their
semantics, for code that composes them itself.
"""

from __future__ import annotations

import collections
import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, TypeGuard, Union

from .. import config
from ..errors import ConfigError, CorruptShardError, SampleError, StateMismatchError, redact
from ..handlers import reraise_exception
from ..io.open import gopen
from .reader import END, TarMembers, sample_too_large

__all__ = [
    "base_plus_ext",
    "last_dot_split",
    "key_rule",
    "valid_sample",
    "url_opener",
    "tar_file_iterator",
    "tar_file_expander",
    "group_by_keys",
    "meta_prefix",
    "meta_suffix",
    "shard_samples",
    "member_filter",
    "close_quietly",
    "SKIP_META",
    "sample_limit",
    "FIELD_COST",
    "held_bytes",
    "Barren",
]

meta_prefix = "__"
meta_suffix = "__"
SKIP_META = r"__[^/]*__($|/)"


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


def valid_sample(sample: Any) -> TypeGuard[dict]:
    """True for a non-empty sample dict not marked ``__bad__``."""
    return sample is not None and isinstance(sample, dict) and len(sample) > 0 and not sample.get("__bad__", False)


def _is_meta(name: str, skip_meta: Optional[str]) -> bool:
    if not name.startswith(meta_prefix):
        return False
    if "/" not in name and name.endswith(meta_suffix):
        return True
    return skip_meta is not None and re.match(skip_meta, name) is not None


def member_filter(skip_meta, select_files, rename_files) -> Optional[Callable[[str], bool]]:
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


class Barren:
    """Notices a shard list that goes round without end over shards giving no sample (each damaged or empty).

    Resampled shards never run out, so with a handler that skips damaged shards a dataset of
    damaged or empty shards would spin for ever; ``check(url, samples so far)``, called as each
    shard begins, raises once such a run has gone over the same shards many times (``ROUNDS``
    times as many shards as distinct URLs in it, and at least ``MINIMUM``).  A finite list never
    repeats a URL that often, and a shard giving samples ends the run.
    """

    ROUNDS = 20
    MINIMUM = 100

    def __init__(self) -> None:
        self.samples = -1
        self.run = 0
        self.urls: set = set()
        self.last_error: Optional[BaseException] = None

    def check(self, url: Any, samples: int) -> None:
        if samples != self.samples:  # the shard before gave samples (or this is the first)
            self.samples, self.run, self.last_error = samples, 0, None
            self.urls.clear()
            return
        self.run += 1
        if len(self.urls) < 10_000:
            self.urls.add(url)
        if self.run >= self.MINIMUM and self.run >= self.ROUNDS * len(self.urls):
            shown = ", ".join(redact(u) for u in sorted(map(str, self.urls))[:3])
            more = f" and {len(self.urls) - 3} more" if len(self.urls) > 3 else ""
            why = (
                f"; the last error: {type(self.last_error).__name__}: {self.last_error}"
                if self.last_error is not None
                else "; they were empty (or every member was filtered out)"
            )
            raise ValueError(
                f"{self.run} shards in a row gave no sample, going round {len(self.urls)} distinct shards "
                f"({shown}{more}){why}. A resampled dataset of such shards would never yield anything: fix or "
                "remove those shards, or check the shard spec and select_files"
            )

    def failed(self, exn: BaseException) -> None:
        self.last_error = exn


def url_opener(data: Iterable[dict], handler: Callable = reraise_exception, **kw: Any) -> Iterator[dict]:
    """Add an open ``stream`` to each ``{"url": ...}`` item (``kw`` go to ``gopen``)."""
    barren = Barren()
    opened = 0
    for sample in data:
        url = sample["url"]
        barren.check(url, opened)
        try:
            stream = gopen(url, **kw)
        except Exception as exn:
            barren.failed(exn)
            if handler(exn):
                continue
            break
        opened += 1
        sample.update(stream=stream)
        yield sample


def tar_file_iterator(
    fileobj,
    skip_meta: Optional[str] = SKIP_META,
    handler: Callable = reraise_exception,
    select_files: Optional[Callable] = None,
    rename_files: Optional[Callable] = None,
    url: str = "",
    _failed: Optional[list] = None,
) -> Iterator[dict]:
    """Yield ``{"fname": name, "data": bytes}`` for the regular members of a tar stream.

    An error the handler lets pass ends the shard (``_failed``, when given, records it).
    """
    members = TarMembers(
        fileobj,
        url or _name_of(fileobj),
        select=member_filter(skip_meta, select_files, rename_files),
        max_member=config.current().max_member_size,
    )
    try:
        for name, data in members:
            yield {"fname": rename_files(name) if rename_files else name, "data": data}
        members.finish()
    except Exception as exn:
        if _failed is not None:
            _failed.append(exn)
        exn_handled = handler(exn)
        if not exn_handled:
            raise _Stop() from exn


def _name_of(fileobj: Any) -> str:
    """What a stream calls itself (a file's path), for messages; a stream named by a descriptor number says nothing."""
    name = getattr(fileobj, "name", "")
    return name if isinstance(name, str) else ""


class _Stop(Exception):
    """Internal: a handler asked to stop the whole iteration."""


class _Expansion:
    """What :func:`tar_file_expander` returns: an iterator of exactly what webdataset's yields (member dicts,
    and ``eof_value`` after each shard read to its end), that also tells :func:`group_by_keys` where each
    shard ended and whether it ended in an error the handler let pass, through ``boundaries``, a channel
    user code never sees.  (webdataset yields nothing after such a shard; code of one's own that groups
    members, such as open_clip's, sees member dicts only.)"""

    __slots__ = ("_items", "boundaries")

    def __init__(self, expand: Callable[[_Expansion], Iterator[dict]]) -> None:
        """``expand(expansion)`` makes the items' generator, which records shard ends in ``boundaries``."""
        #: (items yielded before the boundary, whether the shard ended in an error), oldest first
        self.boundaries: collections.deque = collections.deque()
        self._items: Iterator[dict] = expand(self)

    def __iter__(self) -> Iterator[dict]:
        return self._items  # a for loop runs the generator itself: nothing added per member

    def __next__(self) -> dict:
        return next(self._items)


def tar_file_expander(
    data: Iterable[dict],
    handler: Callable = reraise_exception,
    select_files: Optional[Callable] = None,
    rename_files: Optional[Callable] = None,
    eof_value: Optional[dict] = {},  # noqa: B006 (webdataset's default: an empty dict marks a shard's end)
) -> Iterator[dict]:
    """Expand each opened shard into its members, tagged with ``__url__``; ``eof_value`` ends each shard read
    to its end (a shard that ended in an error the handler let pass ends without it, as in webdataset)."""
    return _Expansion(lambda expansion: _expand(expansion, data, handler, select_files, rename_files, eof_value))


def _expand(
    expansion: _Expansion,
    data: Iterable[dict],
    handler: Callable,
    select_files: Optional[Callable],
    rename_files: Optional[Callable],
    eof_value: Optional[dict],
) -> Iterator[dict]:
    barren = Barren()
    members = 0
    yielded = 0  # items yielded, eof_value included: where the boundaries lie
    boundaries = expansion.boundaries
    for source in data:
        url = source["url"]
        stream = source["stream"]
        try:
            barren.check(url, members)
        except ValueError:
            close_quietly(stream)
            raise
        failed: list = []
        try:
            for sample in tar_file_iterator(
                stream, handler=handler, select_files=select_files, rename_files=rename_files, url=url, _failed=failed
            ):
                sample["__url__"] = url
                if "local_path" in source:
                    sample["__local_path__"] = source["local_path"]
                members += 1
                yielded += 1
                yield sample
        except _Stop:
            boundaries.append((yielded, True))
            return
        finally:
            close_quietly(stream)
        if failed:  # the shard ended in an error the handler let pass: its partial sample is dropped
            barren.failed(failed[-1])
            boundaries.append((yielded, True))
        else:
            boundaries.append((yielded, False))
            if eof_value is not None:
                yielded += 1
                yield eof_value


def close_quietly(stream: Any) -> None:
    close = getattr(stream, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # an error while closing after a complete read is not the data's fault
            pass


def group_by_keys(
    data: Iterable[dict],
    keys: Callable = base_plus_ext,
    lcase: bool = True,
    suffixes: Optional[Iterable[str]] = None,
    handler: Optional[Callable] = None,
) -> Iterator[dict]:
    """Group adjacent ``{"fname", "data"}`` members into samples; an empty dict ends a shard.

    The grouping is :func:`shard_samples`' own loop, run over each shard's members in turn; a
    repeated field goes to ``handler`` (True: skip the member and go on; False: stop, as webdataset's
    ``break``, without the sample the repeat was in) and a shard that ended in an error (as
    ``tar_file_expander`` tells it, through a channel the items do not carry) drops the sample it cut short.
    """
    expansion = data if isinstance(data, _Expansion) else None  # our expander: it says where shards end
    counted = _Counted(iter(data), expansion)
    refused: list = []

    def on_repeat(exn: Exception) -> bool:
        if handler is None:
            return False
        passes = handler(exn)
        if not passes:
            refused.append(exn)
        return passes

    item: Any = counted.next()
    while item is not _EXHAUSTED:
        if not item or "fname" not in item:  # an end-of-shard marker with no member before it
            item = counted.next()
            continue
        run = _MemberRun(item, counted, sample_limit())
        try:
            yield from _grouped(
                run,
                run.url,
                run,
                keys=keys,
                lcase=lcase,
                suffixes=suffixes,
                local_path=run.local_path,
                where=None,
                rename_files=None,
                on_repeat=on_repeat,
                last_ok=run.keeps_last,
            )
        except SampleError as exn:
            if refused and exn is refused[-1]:  # the handler saw it and said stop
                return
            raise
        item = run.next_item


_EXHAUSTED = object()


class _Counted:
    """The items of ``group_by_keys``' input, counted, with the shard boundaries :class:`_Expansion` reported:
    ``ended`` says, after an item was taken, that a shard ended just before it (and whether in an error)."""

    __slots__ = ("_items", "_boundaries", "_taken", "ended")

    def __init__(self, items: Iterator[Any], expansion: Optional[_Expansion]) -> None:
        self._items = items
        self._boundaries: collections.deque = expansion.boundaries if expansion is not None else collections.deque()
        self._taken = 0
        self.ended: Optional[bool] = None  # None: no boundary before the item just taken; else: aborted?

    def next(self) -> Any:
        item = next(self._items, _EXHAUSTED)
        before = self._taken
        self.ended = None
        boundaries = self._boundaries
        while boundaries and boundaries[0][0] <= before:
            self.ended = boundaries.popleft()[1] or bool(self.ended)
        if item is not _EXHAUSTED:
            self._taken = before + 1
        return item


class _MemberRun:
    """One shard's member dicts as ``(name, data)``, up to the marker that ends the shard.

    A change of ``__url__`` (or ``__local_path__``) without a marker (``eof_value=None``) also
    ends a run: a sample never spans shards.  Stands for the tar reader in the grouping loop:
    its offsets count the members' bytes (names, and ``FIELD_COST`` each), so the sample limit
    applies here as it does to the reader.  A user's iterator may yield any value as a member's data (a
    replaced ``tar_file_expander`` yielding metadata: text, numbers, None, dicts), as webdataset's grouping
    stores any value: :func:`held_bytes` says what each counts.
    """

    member_offset = None

    def __init__(self, first: dict, items: _Counted, max_sample: int) -> None:
        self._first = first
        self._items = items
        self.url = first.get("__url__")
        self.local_path = first.get("__local_path__")
        self.aborted = False
        self.next_item: Any = _EXHAUSTED
        self.record_start = 0
        self.sample_start = 0
        self.max_sample = max_sample

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        item: Any = self._first
        while True:
            name, data = item["fname"], item["data"]
            end = self.record_start + len(name) + (len(data) if type(data) is bytes else held_bytes(data)) + FIELD_COST
            if end - self.sample_start > self.max_sample:
                raise sample_too_large(self.url, self.sample_start, end, self.max_sample, name)
            yield name, data
            self.record_start = end
            item = self._items.next()
            if self._items.ended is not None:  # our expander said the shard ended here
                self.aborted = self._items.ended
                if item is not _EXHAUSTED and (not item or "fname" not in item):
                    item = self._items.next()  # its end-of-shard marker
                self.next_item = item
                return
            if item is _EXHAUSTED:
                return
            if not item or "fname" not in item:
                self.next_item = self._items.next()
                return
            # a member without a __url__ or __local_path__ belongs to the run it follows: a user's iterator adds
            # members (metadata) carrying only some of the tags, and webdataset's grouping splits samples by key alone
            if (
                item.get("__url__", self.url) != self.url
                or item.get("__local_path__", self.local_path) != self.local_path
            ):
                self.next_item = item
                return

    def keeps_last(self, sample: dict) -> bool:
        """The last sample of the run is kept unless the shard ended in an error (webdataset's rule)."""
        return not self.aborted and valid_sample(sample)

    def finish(self) -> None:
        pass


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
    where: Optional[list] = None,
    members: Optional[TarMembers] = None,
    expect_first: Any = (),
    record: Optional[Callable[[str, int, int], None]] = None,
    max_sample: Optional[int] = None,
    on_repeat: Optional[Callable[[Exception], bool]] = None,
) -> Iterator[dict]:
    """The samples of one shard, read and grouped in a single loop.

    Raises on damage; a sample cut short by the damage is never yielded.  When
    ``where`` (a list of four) is given, ``where[:2]`` holds the byte range
    ``[start, end)`` of each sample, in the tar stream, while that sample is
    being yielded (``end`` is also where the next sample begins), and
    ``where[2]`` is incremented for each sample, and ``where[3]`` is the name of the member
    that begins the next sample (None at the end).  ``members`` is a prepared
    :class:`TarMembers` over ``stream`` (to read from a given offset); ``expect_first`` (a
    resumed read) is the name its first member must have, None for the end of the archive.
    ``record(name, data offset, size)`` sees every member read (to index the shard as it streams).
    ``max_sample``: the most bytes a sample may hold (see :func:`sample_limit`).
    ``on_repeat(error)`` is given the :func:`repeated_field` error of a member repeating a field of its
    sample: True skips that member and the shard goes on (webdataset's ``group_by_keys`` with a handler);
    without it, or when it returns False, the error is raised.
    """
    if members is None:
        members = TarMembers(
            stream,
            url,
            select=member_filter(skip_meta, select_files, rename_files),
            max_member=config.current().max_member_size,
        )
    source = members if expect_first == () else _checked_start(members, expect_first, url, rename_files)
    if record is not None:
        source = _recorded(source, members, record)
    # the grouping generator itself is returned: no generator layer of our own per sample
    members.max_sample = sample_limit(max_sample, members.max_member)
    if source is members and members.mapped and (members.views or members.table is not None):
        # a mapped shard read from a sample's start, with views or with its member table: runs of members (with
        # bytes and no table, the copy of each member is faster right after its header is read, as the
        # member-by-member loop does)
        return _grouped_mapped(
            members,
            url,
            keys=keys,
            lcase=lcase,
            suffixes=suffixes,
            local_path=local_path,
            where=where,
            rename_files=rename_files,
            on_repeat=on_repeat,
        )
    return _grouped(
        source,
        url,
        members,
        keys=keys,
        lcase=lcase,
        suffixes=suffixes,
        local_path=local_path,
        where=where,
        rename_files=rename_files,
        on_repeat=on_repeat,
        last_ok=None,
    )


#: what a member dict costs beyond its bytes and its name, in the limit's count where grouping is fed
#: member dicts (the tar reader counts the tar bytes a sample spans: 512 or more per member)
FIELD_COST = 256


def held_bytes(data: Any) -> int:
    """What a member's value counts toward the sample limit where grouping is fed member dicts: the bytes of a
    bytes-like value or an array (``nbytes``), the characters of text, nothing for any other value (a number,
    None, a dict or list of metadata): those are small, or already in memory when the iterator made them, and
    the member's ``FIELD_COST`` still bounds how many one sample gathers."""
    if isinstance(data, (bytes, bytearray)):
        return len(data)
    if isinstance(data, str):
        return len(data)
    nbytes = getattr(data, "nbytes", None)  # memoryview, numpy array, tensor-likes
    return nbytes if type(nbytes) is int and nbytes >= 0 else 0


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


def _recorded(
    source: Iterable[tuple[str, Any]], members: Any, record: Callable[[str, int, int], None]
) -> Iterator[tuple[str, Any]]:
    for name, data in source:
        record(name, members.member_offset + 512, len(data))
        yield name, data


def _grouped(
    source: Iterable[tuple[str, Any]],
    url: Any,
    members: Any,
    *,
    keys: Callable,
    lcase: bool,
    suffixes: Optional[Iterable[str]],
    local_path: Optional[str],
    where: Optional[list],
    rename_files: Optional[Callable],
    on_repeat: Optional[Callable],
    last_ok: Optional[Callable[[dict], bool]],
) -> Iterator[dict]:
    """The one grouping loop: adjacent ``(name, data)`` members sharing a key become a sample.

    ``members`` tells byte offsets (a :class:`TarMembers`, or the member-dict run standing for one); a
    repeated field raises unless ``on_repeat(error)`` says to skip the member; the last sample
    is yielded when ``last_ok(sample)`` says so (default: it holds a field).  ``members.sample_start``
    is set where each sample begins: the reader refuses a sample spanning more than its sample limit.
    """
    # Kept as one loop (reading, key rules and grouping inline), hence its length: it runs per member,
    # and a call per member would cost the tiny-sample workload of bench_read several percent.
    suffixes = set(suffixes) if suffixes is not None else None
    fast_keys = keys is base_plus_ext
    current: Optional[dict] = None
    key = None
    start = 0
    # the sample limit, checked at every member (the reader checks it only each window or chunk, and where those
    # fall differs between reads); a member-dict run checks its own
    limit = members.max_sample if isinstance(members, TarMembers) else None
    for name, data in source:
        if rename_files is not None:
            name = rename_files(name)
        if fast_keys:
            slash = name.rfind("/")
            dot = name.find(".", slash + 1)
            if dot <= slash + 1 and _keyless(name, slash, dot):
                _within(members, limit)
                continue
            prefix, suffix = name[:dot], name[dot + 1 :]
        else:
            prefix, suffix = keys(name)
            if prefix is None:
                _within(members, limit)
                continue
        if lcase:
            suffix = suffix.lower()
        if prefix != key or current is None:
            if current is not None:
                if where is not None:
                    where[0], where[1], where[3] = start, members.record_start, name
                    where[2] += 1
                yield current
            current = {"__key__": prefix, "__url__": url}
            if local_path is not None:
                current["__local_path__"] = local_path
            key = prefix
            start = members.sample_start = members.record_start  # once per sample: the limit's base
        if limit is not None and members.member_offset - start > limit:
            raise sample_too_large(url, start, members.member_offset, limit)
        if suffixes is not None and suffix not in suffixes:
            continue
        if suffix in current:
            exn = repeated_field(url, name, members.member_offset, prefix, suffix)
            if on_repeat is None or not on_repeat(exn):
                raise exn
            continue  # the member is skipped; the sample keeps the field's first member, as webdataset's
        current[suffix] = data
    if current is not None and (len(current) > 2 + (local_path is not None) if last_ok is None else last_ok(current)):
        if where is not None:
            where[0], where[1] = start, members.archive_end if members.archive_end is not None else members.offset
            where[2] += 1
            where[3] = None
        yield current
    members.finish()  # after the last sample: what trails the archive never delays it


def _within(members: Any, limit: Optional[int], offset: Optional[int] = None) -> None:
    """The sample limit at a member no sample takes (no key): it still lies within the sample being grouped, as
    the reader counts it."""
    if limit is None:
        return
    offset = members.member_offset if offset is None else offset
    if offset - members.sample_start > limit:
        raise sample_too_large(members.url, members.sample_start, offset, limit)


def _grouped_mapped(
    members: TarMembers,
    url: Any,
    *,
    keys: Callable,
    lcase: bool,
    suffixes: Optional[Iterable[str]],
    local_path: Optional[str],
    where: Optional[list],
    rename_files: Optional[Callable],
    on_repeat: Optional[Callable],
) -> Iterator[dict]:
    """:func:`_grouped` over a mapped shard: the members come in runs (:meth:`TarMembers.plain_run`: their
    headers read in one tight pass, each checked as the fast path checks it, or taken from the member table), and
    what is left per member is the key,
    the slice and the dict; a member the runs do not take goes through the general reader.  The same
    samples, offsets (``where``), limits and errors as :func:`_grouped` (the mapped-read tests compare them).
    Under the usual key rules a kept table's split names (:meth:`TarMembers.keyed_run`) leave only the slice and
    the dict.  Its steps per member repeat :func:`_grouped`'s, and the keyed loop repeats its general loop without
    the name splitting: inlined on purpose, as a call per member would cost them."""
    suffixes = set(suffixes) if suffixes is not None else None
    fast_keys = keys is base_plus_ext
    buf = members.buffer
    view = memoryview(buf) if members.views else None
    source = view if view is not None else buf
    base = members.base
    current: Any = None  # the sample being grouped (None before the first)
    key = None
    start = 0
    given: Any = None  # a member the general reader gave: (name, data)
    run_heads: Any = None
    plain = rename_files is None and fast_keys and lcase and suffixes is None
    limit = members.max_sample if members.max_sample is not None else 1 << 62  # checked at every member
    # a member whose header lies past this position in the buffer runs its sample past the limit (set wherever a
    # sample begins: in a keyed run or in the general loop, either of which may go on with it)
    over = limit
    try:
        while True:
            if plain and members.table is not None:
                keyed = members.keyed_run()
                if keyed is not None:  # the usual rules over a kept table: keys and field names split already
                    for prefix, suffix, head, size in zip(*keyed):
                        if prefix != key:
                            record = base + head
                            if current is not None:
                                if where is not None:
                                    where[0], where[1] = start, record
                                    where[3] = prefix + "." + suffix
                                    where[2] += 1
                                yield current
                            current = {"__key__": prefix, "__url__": url}
                            if local_path is not None:
                                current["__local_path__"] = local_path
                            key = prefix
                            start = members.sample_start = record
                            over = head + limit
                        if head > over:
                            raise sample_too_large(url, start, base + head, limit)
                        if suffix in current:
                            exn = repeated_field(url, prefix + "." + suffix, base + head, prefix, suffix)
                            if on_repeat is None or not on_repeat(exn):
                                raise exn
                            continue
                        begin = head + 512
                        current[suffix] = source[begin : begin + size]
                    continue
            run = members.plain_run()
            if run is None:
                item = members.next_member()
                if item is END:
                    break
                if item is None:
                    continue
                given, run_heads = item, None
                names, heads, sizes = [item[0]], [-1], [0]
            else:
                names, heads, sizes = run
                given, run_heads = None, heads
            for name, head, size in zip(names, heads, sizes):
                if rename_files is not None:
                    name = rename_files(name)
                if fast_keys:
                    slash = name.rfind("/")
                    dot = name.find(".", slash + 1)
                    if dot <= slash + 1 and _keyless(name, slash, dot):
                        _within(members, limit, base + head if run_heads is not None else None)
                        continue
                    prefix, suffix = name[:dot], name[dot + 1 :]
                else:
                    prefix, suffix = keys(name)
                    if prefix is None:
                        _within(members, limit, base + head if run_heads is not None else None)
                        continue
                if lcase:
                    suffix = suffix.lower()
                if prefix != key or current is None:
                    record = base + head if run_heads is not None else members.record_start
                    if current is not None:
                        if where is not None:
                            where[0], where[1], where[3] = start, record, name
                            where[2] += 1
                        yield current
                    current = {"__key__": prefix, "__url__": url}
                    if local_path is not None:
                        current["__local_path__"] = local_path
                    key = prefix
                    start = members.sample_start = record  # once per sample: the limit's base
                    over = start - base + limit
                if given is None:
                    if head > over:
                        raise sample_too_large(url, start, base + head, limit)
                elif members.member_offset - start > limit:
                    raise sample_too_large(url, start, members.member_offset, limit)
                if suffixes is not None and suffix not in suffixes:
                    continue
                if suffix in current:
                    offset = base + head if run_heads is not None else members.member_offset
                    exn = repeated_field(url, name, offset, prefix, suffix)
                    if on_repeat is None or not on_repeat(exn):
                        raise exn
                    continue
                if given is not None:
                    current[suffix] = given[1]
                else:
                    begin = head + 512
                    current[suffix] = source[begin : begin + size]
    finally:
        if view is not None:
            view.release()  # the views handed out stay valid (each holds the mapping)
    if current is not None and len(current) > 2 + (local_path is not None):
        if where is not None:
            where[0], where[1] = start, members.archive_end if members.archive_end is not None else members.offset
            where[2] += 1
            where[3] = None
        yield current
    members.finish()


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


def _checked_start(
    members: TarMembers, expected: Optional[str], url: str, rename_files: Optional[Callable]
) -> Iterator[tuple[str, bytes]]:
    """``members``, having checked that a resumed read begins at the member the saved state names."""
    first = True
    iterator = iter(members)
    try:
        head = next(iterator, None)
    except CorruptShardError as exc:  # no tar member where the state says one begins
        raise StateMismatchError(
            f"{redact(url)}: the saved state resumes at byte {members.record_start}, where no tar member begins "
            f"({exc}); the state was changed, or the shard was: load a state that state_dict() returned for "
            "these shards",
            url=url,
            offset=members.record_start,
            field="offset",
        ) from exc
    for name, data in itertools.chain([head] if head is not None else [], iterator):
        if first:
            first = False
            shown = rename_files(name) if rename_files else name
            if shown != expected:
                raise StateMismatchError(
                    f"{redact(url)}: the saved state resumes at byte {members.record_start}, where it expects the "
                    f"member {expected!r} to begin a sample, but {shown!r} is there: the state was changed, or "
                    "the shard was; load a state that state_dict() returned for these shards",
                    url=url,
                    offset=members.record_start,
                    field="offset",
                )
        yield name, data
    if first and expected is not None:
        raise StateMismatchError(
            f"{redact(url)}: the saved state expects the member {expected!r} at byte {members.offset}, but the "
            "archive ends there: the state was changed, or the shard was",
            url=url,
            field="offset",
        )
