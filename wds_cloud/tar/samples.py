"""webdataset's stages from shards to samples, for code that composes them itself.

``url_opener`` opens each shard, ``tar_file_iterator`` and ``tar_file_expander`` give its members as dicts, and
``group_by_keys`` groups adjacent member dicts into samples, with webdataset 1.0.2's semantics (the key rules
``base_plus_ext`` and ``last_dot_split`` come from :mod:`wds_cloud.tar.grouping`, whose kernel groups here too).
The shard reader (:mod:`wds_cloud.tar.shardreader`) reads and groups a shard in one loop instead
(:func:`~wds_cloud.tar.grouping.shard_samples`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, TypeGuard

from .. import config
from ..errors import SampleError, redact
from ..handlers import reraise_exception
from ..io.open import gopen
from .grouping import (
    SKIP_META,
    base_plus_ext,
    group,
    key_rule,
    last_dot_split,
    member_filter,
    meta_prefix,
    meta_suffix,
    sample_limit,
)
from .members import TarMembers, sample_too_large
from .runs import Run

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
    "close_quietly",
    "FIELD_COST",
    "held_bytes",
    "Barren",
]


def valid_sample(sample: Any) -> TypeGuard[dict]:
    """True for a non-empty sample dict not marked ``__bad__``."""
    return sample is not None and isinstance(sample, dict) and len(sample) > 0 and not sample.get("__bad__", False)


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

    The grouping is :func:`~wds_cloud.tar.grouping.group`, the shard reader's own kernel, run over each shard's
    members in turn; a
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
            yield from group(
                (Run([], [], [], 0, None, run),),
                run,
                run.url,
                keys=keys,
                lcase=lcase,
                suffixes=suffixes,
                local_path=run.local_path,
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
    """One shard's member dicts, up to the marker that ends the shard: the member source grouping is fed.

    A change of ``__url__`` (or ``__local_path__``) without a marker (``eof_value=None``) also
    ends a run: a sample never spans shards.  Stands for the tar reader in the grouping loop:
    its offsets count the members' bytes (names, and ``FIELD_COST`` each), so the sample limit
    applies here as it does to the reader.  A user's iterator may yield any value as a member's data (a
    replaced ``tar_file_expander`` yielding metadata: text, numbers, None, dicts), as webdataset's grouping
    stores any value: :func:`held_bytes` says what each counts.
    """

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

    def __iter__(self) -> Iterator[tuple[str, Any, int]]:
        """``(name, data, where the member begins)``: the offsets count what the members hold."""
        item: Any = self._first
        while True:
            name, data = item["fname"], item["data"]
            begin = self.record_start
            end = begin + len(name) + (len(data) if type(data) is bytes else held_bytes(data)) + FIELD_COST
            if end - self.sample_start > self.max_sample:
                raise sample_too_large(self.url, self.sample_start, end, self.max_sample, name)
            yield name, data, begin
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
