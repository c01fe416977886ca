"""The shard reader stage: ``{"url": ...}`` items in, samples out, resumable mid-shard.

:class:`TarSamples` opens each shard (through ``gopen`` or a given opener), reads and
groups it with :func:`~wds_cloud.tar.grouping.shard_samples`, and keeps a cursor of where
the sample last yielded came from, which its state and a shuffle fed by it read.
"""

from __future__ import annotations

import collections
import copy
import errno
import functools
import itertools
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any, Optional, Union

from .. import config
from ..errors import StateMismatchError, redact
from ..handlers import reraise_exception
from ..io.open import gopen
from ..io.parallel import Fetcher
from ..resume.reader_state import ReaderCursor, ReaderResume, check_resumed_shard
from ..stages import PassHolder
from .grouping import SKIP_META, SamplePosition, key_rule, member_filter, sample_limit, shard_samples
from .members import TarMembers
from .samples import Barren, close_quietly

__all__ = ["TarSamples", "tarfile_samples", "tarfile_to_samples"]


def tarfile_samples(
    src: Iterable[dict],
    handler: Callable = reraise_exception,
    select_files: Optional[Callable] = None,
    rename_files: Optional[Callable] = None,
    keys: Union[str, Callable, None] = None,
    lcase: bool = True,
    suffixes: Optional[Iterable[str]] = None,
    opener: Optional[Callable] = None,
    replaced: Optional[Callable[[], Any]] = None,
    **open_kw: Any,
) -> Iterator[dict]:
    """Samples from a stream of ``{"url": ...}`` shard descriptions.

    ``opener(url)`` (default ``gopen``) opens each shard; ``keys`` is a key
    rule (see :func:`key_rule`).  ``handler`` decides, for an error in a shard,
    whether to go on with the next shard (True) or stop (False); the sample
    the error cut short is never yielded.  ``replaced``: see :class:`TarSamples`.
    """
    return TarSamples(
        handler=handler,
        select_files=select_files,
        rename_files=rename_files,
        keys=keys,
        lcase=lcase,
        suffixes=suffixes,
        opener=opener,
        replaced=replaced,
        **open_kw,
    ).run(src)


class TarSamples(PassHolder):
    """The shard reader stage: ``{"url": ...}`` items in, samples out; resumable mid-shard.

    ``opener`` opens a shard: a callable ``opener(url)`` (webdataset style), or
    an object with ``open(url, offset)`` returning ``{"stream": ..., "local_path": ...}``
    (:class:`~wds_cloud.cache.StreamingOpen`, :class:`~wds_cloud.cache.FileCache`).
    ``limit`` (an int, or a callable returning one at the start of a pass, see
    ``WebDataset(equal_work=...)``) makes every pass yield exactly that many
    samples: it stops early, or goes over this worker's shards again from the
    first when they run short.

    ``state_dict()`` is where the most recent pass stands, ``load_state_dict(state)``
    makes the next pass continue from there: the reader plays the ``SampleSource`` role
    (:mod:`wds_cloud.resume.protocol`) through its resume side, a
    :class:`~wds_cloud.resume.reader_state.ReaderResume`, which it calls when a pass starts
    and when a state is taken or loaded.

    ``replaced``, called when a pass begins, tells whether user code replaced webdataset's module-level
    functions (``tariterators.url_opener = mine``): None, or an object whose ``samples(src, handler,
    select_files, rename_files, grouping)`` gives that pass through them (see :mod:`wds_cloud.tariterators`);
    such a pass cannot be resumed exactly, and taking its state raises ``NotResumableError`` naming them.

    A pipeline runs a copy of its own (see :class:`~wds_cloud.stages.PassHolder`): the cursor (with the open
    shard, its mapping and member filter) belongs to the pass, the resume record to the copy.
    """

    PASS_FIELDS = {"cursor": None, "replaced_now": None}
    COPIED_FIELDS = ("_record",)

    def __init__(
        self,
        handler: Callable = reraise_exception,
        select_files: Optional[Callable] = None,
        rename_files: Optional[Callable] = None,
        keys: Union[str, Callable, None] = None,
        lcase: bool = True,
        suffixes: Optional[Iterable[str]] = None,
        opener: Any = None,
        limit: Any = None,
        max_member_size: Optional[int] = None,
        index_sink: Optional[Callable[[Any], None]] = None,
        max_sample_size: Optional[int] = None,
        replaced: Optional[Callable[[], Any]] = None,
        zero_copy: bool = False,
        **open_kw: Any,
    ) -> None:
        self.handler = handler
        #: members come out as read-only memoryviews (into the mapping of a local shard), not bytes
        self.zero_copy = bool(zero_copy)
        self.replaced = replaced
        #: the replaced functions the current pass reads through (see ``replaced``), or None
        self.replaced_now: Any = None
        #: given, for every shard read whole in a pass, what its index needs (see WebDataset(write_index=))
        self.index_sink = index_sink
        #: the largest member read (bytes); None: WDS_MAX_MEMBER_SIZE or its default, when a pass begins
        self.max_member_size = max_member_size
        #: the most bytes one sample holds; None: WDS_MAX_SAMPLE_SIZE, else the member limit
        self.max_sample_size = max_sample_size
        self.select_files = select_files
        self.rename_files = rename_files
        self.keys = keys
        self.lcase = lcase
        self.suffixes = suffixes
        self.opener = opener
        self.limit = limit
        self.open_kw = open_kw
        self.cursor: Optional[ReaderCursor] = None
        #: opens shards when no opener is given: parallel ranged parts for remote ones, nothing fetched
        #: ahead (the stages before this one may hold state that a look ahead would disturb)
        self.fetcher = Fetcher(prefetch=0) if opener is None and not open_kw else None
        self._record = ReaderResume()  # what a state records, and what waits for the next pass
        self.lookahead = True  # ask the opener to fetch the next shards ahead, when it can

    def __call__(self, src: Iterable[dict]) -> Iterator[dict]:
        return self.run(src)

    def run(self, src: Iterable[dict]) -> Iterator[dict]:
        replaced = self.replaced() if self.replaced is not None else None
        self.replaced_now = replaced
        if replaced is not None:
            return self._through(replaced, src)
        cursor = ReaderCursor(SamplePosition())
        self.cursor = cursor
        resume, replay, elastic = self._record.take()
        return self._samples(src, cursor, resume, replay, elastic)

    def _through(self, replaced: Any, src: Iterable[dict]) -> Iterator[dict]:
        """A pass through the module-level functions user code replaced, called as webdataset calls them."""
        if self._record.pending:
            raise StateMismatchError(
                f"a saved state was loaded, but {replaced} was replaced, so the shards are no longer read by the "
                "resumable reader and the state cannot be continued exactly: restore the library's function before "
                "loading a state, or start the pass afresh without load_state_dict()"
            )
        self.cursor = None  # no sample's location is known: a shuffle fed by this pass keeps samples, not places
        grouping = {
            k: v
            for k, v, default in (
                ("keys", self.keys, None),
                ("lcase", self.lcase, True),
                ("suffixes", self.suffixes, None),
            )
            if v is not default
        }
        if "keys" in grouping:
            grouping["keys"] = key_rule(self.keys)
        return replaced.samples(src, self.handler, self.select_files, self.rename_files, grouping, self._opened)

    def _opened(self, src: Iterable[dict]) -> Iterator[dict]:
        """``{"url", "stream"[, "local_path"]}`` for each shard item, opened with this reader's opener (a pass
        through replaced functions that keeps the reader's own opening: WebDataset's cache and storage options)."""
        for source in src:
            try:
                stream, local = self._open(source, 0)
            except Exception as exn:
                if self.handler(exn):
                    continue
                break
            item = {"url": source["url"], "stream": stream}
            if local is not None:
                item["local_path"] = local
            yield item

    # resume: the reader's resume side (wds_cloud.resume.reader_state) records and replays
    def state_dict(self) -> dict:
        return self._record.state_dict(self.cursor, self.replaced_now)

    def transport_state(self) -> dict:
        """:meth:`state_dict` for a loader that asks with every batch: the same, without defensive copies."""
        return self._record.transport_state(self.cursor, self.replaced_now)

    def next_pass_state(self) -> dict:
        return self._record.next_pass_state()

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` on the next pass (checked field by field: a state is input)."""
        self._record.load(state)

    def set_replay(self, replay: Sequence[tuple]) -> None:
        """First yield the samples at ``replay`` (``(url, start, end, compressed, ref)``) on the next pass."""
        self._record.set_replay(replay)

    def set_elastic(self, replay: Sequence[tuple], limit: Optional[int]) -> None:
        """Begin the next pass with this rank and worker's share of an elastic resume: the buffered samples at
        ``replay`` (``(url, start, end, compressed)``, yielded after those of :meth:`set_replay`, from the count a
        loaded state says were), then the shards the shard list gives; ``limit``: the samples the pass yields
        (``equal_work``), or None."""
        self._record.set_elastic(replay, limit)

    @property
    def stream_identity(self) -> Optional[dict]:
        """The identity a state records (None: this rank and DataLoader worker; a stream's, see for_stream)."""
        return self._record.stream_identity

    @property
    def last_refetch(self) -> dict:
        """What the last resume fetched again: samples, requests, bytes (compressed shards: bytes decompressed),
        seconds."""
        return self._record.last_refetch

    def for_stream(self, stream: int, streams: int) -> TarSamples:
        """A reader of its own for virtual stream ``stream`` of ``streams`` (see :mod:`wds_cloud.resume.streams`):
        the same settings and opener, a state that names the stream (not a rank and worker), and no look
        ahead (the streams of a worker read their shards side by side)."""
        clone = copy.copy(self)
        clone._start_stream(stream, streams)
        return clone

    def _start_stream(self, stream: int, streams: int) -> None:
        """Forget any loaded state or replay (a copy has no pass already), and name the stream (what
        :meth:`for_stream`'s copy does)."""
        self._record = ReaderResume(stream_identity={"stream": stream, "streams": streams})
        self.lookahead = False

    def set_limit(self, limit: Any) -> None:
        """The samples each pass yields (an int, or a callable giving one when a pass begins), or None."""
        self.limit = limit

    def _max_member(self) -> int:
        return config.parse_positive_size("max_member_size", self.max_member_size, config.current().max_member_size)

    def _max_sample(self) -> int:
        return sample_limit(config.parse_positive_size("max_sample_size", self.max_sample_size), self._max_member())

    # opening
    def _member_filter(self) -> Optional[Callable[[str], bool]]:
        return member_filter(SKIP_META, self.select_files, self.rename_files)

    def _open(self, source: dict, offset: int) -> tuple[Any, Optional[str]]:
        """(stream, local path) for a shard item, positioned at ``offset`` where the opener can."""
        url = source["url"]
        if "stream" in source:  # opened upstream (url_opener): it can only be read from its start
            return source["stream"], source.get("local_path")
        opener = self.opener
        if opener is not None and hasattr(opener, "open"):
            opened = opener.open(url, offset)
            return opened["stream"], opened.get("local_path")
        if opener is not None:
            return opener(url, **self.open_kw), None
        if self.fetcher is not None:
            return self.fetcher.open(url, offset), None
        return gopen(url, offset=offset, **self.open_kw), None

    def _range(self, url: str, start: int, end: int) -> Any:
        opener = self.opener
        if opener is not None and hasattr(opener, "open_range"):
            return opener.open_range(url, start, end)
        return gopen(url, offset=start, length=end - start, **self.open_kw)

    def _whole(self, url: str) -> Any:
        return self._open({"url": url}, 0)[0]

    # reading
    def _samples(
        self,
        src: Iterable[dict],
        cursor: ReaderCursor,
        resume: Optional[dict],
        replay: list,
        elastic: Optional[tuple] = None,
    ) -> Iterator[dict]:
        """One pass: the replayed samples of a resumed shuffle, then the shards from where ``resume`` stood."""
        position = cursor.position
        fetch = (self._range, self._whole, functools.partial(_parse_range, self))
        saved = yield from self._record.resumed(cursor, resume, replay, elastic, fetch)
        if saved is None:  # the saved pass was done: its shard list is begun all the same, so that this pass
            next(iter(src), None)  # counts as its epoch and the next one is the epoch after (not this one again)
            return
        src, ahead, lookahead = self._looking_ahead(src)
        try:
            limit = self._pass_limit(cursor, elastic)
            skip = saved["shard"] if saved else 0
            reached = -1
            barren = Barren()
            refused: list = []  # a repeated field the handler was given and did not let pass
            on_repeat = _repeat_handler(self.handler, refused)
            for index, source in enumerate(_shards(src, cursor, limit, skip)):
                reached = index
                if index < skip:
                    continue
                barren.check(source.get("url") if isinstance(source, dict) else source, position.samples)
                if limit is not None and position.samples >= limit:  # reached before this shard (a resumed pass)
                    cursor.done = True
                    return
                stream = None
                try:
                    stream, samples, skipping = self._begin_shard(
                        source,
                        index,
                        cursor,
                        saved if saved and index == skip else source.get("resume_at"),
                        on_repeat,
                    )
                    if lookahead is not None:
                        ahead.prefetch(_urls(lookahead.peek(ahead.prefetch_depth)))
                    before = position.samples
                    if limit is None and skipping is None:
                        yield from samples  # the common path: one generator layer per sample, not two
                    elif (yield from _limited(samples, cursor, limit, skipping)):
                        return
                    verify = getattr(stream, "verify", None)
                    if verify is not None:  # checked against a manifest once its last sample was read
                        verify(position.samples - before)
                    if cursor.recorded is not None and self.index_sink is not None:
                        self.index_sink(_index_read(source["url"], cursor, stream))
                except StateMismatchError:
                    raise  # a state that does not fit is the caller's to fix, never a damaged shard to skip
                except Exception as exn:
                    if refused and exn is refused[-1][0]:  # the handler has seen it once and said stop
                        if refused[-1][1]:
                            raise  # what the handler raised
                        return
                    barren.failed(exn)
                    if not self.handler(exn):
                        return
                finally:
                    if stream is not None:
                        close_quietly(stream)
                        if cursor.members is not None:  # its mapping too (views of it keep it while they live)
                            cursor.members.close()
            if saved and reached < skip and limit is None:  # (equal_work passes may stop before it)
                raise _short_of(skip, reached)
            cursor.done = True
        finally:
            if ahead is not None:
                ahead.prefetch([])  # the reader stopped: what was fetched ahead is cancelled

    def _looking_ahead(self, src: Iterable[dict]) -> tuple[Iterator[dict], Any, Optional[_Lookahead]]:
        """(the shard items, the opener that fetches ahead or None, the items' look-ahead or None)."""
        src = iter(src)
        first = next(src, None)  # pulled before the limit: the shard list has begun its epoch
        if first is not None:
            src = itertools.chain([first], src)
        ahead = self._prefetcher()
        lookahead = _Lookahead(src) if ahead is not None else None
        return (lookahead if lookahead is not None else src), ahead, lookahead

    def _pass_limit(self, cursor: ReaderCursor, elastic: Optional[tuple]) -> Optional[int]:
        """The samples this pass yields (an elastic share's, or ``limit``'s when a pass begins), or None."""
        if elastic is not None:
            return elastic[1]
        limit = self.limit() if callable(self.limit) else self.limit
        cursor.limit = limit if self.limit is not None else None
        return limit

    def _prefetcher(self) -> Any:
        """The opener, when it fetches the next shards ahead (``prefetch(urls)``) and is asked to."""
        opener = self.opener
        if (
            not self.lookahead
            or opener is None
            or not hasattr(opener, "prefetch")
            or not getattr(opener, "prefetch_depth", 0)
        ):
            return None
        return opener

    def _begin_shard(
        self,
        source: dict,
        index: int,
        cursor: ReaderCursor,
        saved: Optional[dict],
        on_repeat: Optional[Callable[[Exception], bool]] = None,
    ) -> tuple[Any, Iterator[dict], Optional[int]]:
        """Open one shard (at the saved offset when ``saved``): (stream, its samples, skip-before).

        ``skip-before`` is None when the samples start where they should; else the shard is read from
        its start (an opened stream, or a compressed one) and samples before that byte were delivered.
        """
        url = source["url"]
        offset, pax = 0, {}
        if saved is not None:
            check_resumed_shard(url, saved)
            offset, pax = saved["offset"], dict(saved.get("pax") or {})
        compressed = bool(saved is not None and saved.get("compressed"))
        cursor.shard, cursor.url, cursor.members, cursor.base_pax = index, url, None, pax
        cursor.position.end = offset
        try:
            stream, local_path = self._open(source, 0 if compressed else offset)
        except OSError as exc:
            if not offset or compressed or exc.errno != errno.EINVAL:
                raise
            # a seek no file takes (past what the file system holds): the offset is a forged one, not the shard's
            raise StateMismatchError(
                f"{redact(url)}: the saved state resumes at byte {offset}, which this shard cannot hold ({exc}); "
                "the state was changed: load a state that state_dict() returned for these shards",
                url=url,
                offset=offset,
                field="offset",
            ) from exc
        try:
            seekable = "stream" not in source and not compressed
            members = TarMembers(
                stream,
                url,
                select=self._member_filter(),
                start=offset if seekable else 0,
                pax_global=pax if seekable else None,
                max_member=self._max_member(),
                views=self.zero_copy,
            )
            members.begin()
        except BaseException:
            close_quietly(stream)
            raise
        cursor.compressed = members.compression is not None
        cursor.members = members
        local_path = source.get("local_path") or local_path or getattr(stream, "local_path", None)
        # checked at offset 0 too: a partial read's offset set back to 0 would read its first samples again
        expected = saved.get("next", ()) if saved is not None and seekable else ()
        recorded: Optional[list] = [] if self.index_sink is not None and not offset else None
        cursor.recorded = recorded
        samples = shard_samples(
            url,
            stream,
            keys=key_rule(self.keys),
            lcase=self.lcase,
            suffixes=self.suffixes,
            rename_files=self.rename_files,
            local_path=local_path,
            position=cursor.position,
            members=members,
            expect_first=expected,
            record=(lambda *member: recorded.append(member)) if recorded is not None else None,
            max_sample=self._max_sample(),
            on_repeat=on_repeat,
        )
        return stream, samples, None if seekable else offset


def _index_read(url: str, cursor: ReaderCursor, stream: Any) -> dict:
    """What the index of the shard just read whole needs (by-product of the pass, for ``index_sink``): the URL,
    its members as ``(name, data offset, size)``, its size, version and compression."""
    members = cursor.members
    read = {
        "url": url,
        "members": cursor.recorded or [],
        "size": getattr(stream, "size", None),
        "version": getattr(stream, "version", None),
        "compression": members.compression if members is not None else None,
    }
    cursor.recorded = None
    return read


def _repeat_handler(handler: Callable, refused: list) -> Callable[[Exception], bool]:
    """What a member repeating a field of its sample is given to: the handler, once (webdataset's
    ``group_by_keys`` calls it there and goes on within the shard when it returns True).

    A duplicate name does not damage the tar stream, so a repeat let pass costs that member only, and
    the cursor (where the next sample begins, samples counted) is untouched by it; one not let pass
    (False, or raised by the handler) is noted in ``refused`` so the reader does not hand it over twice.
    """

    def on_repeat(exn: Exception) -> bool:
        try:
            passes = handler(exn)
        except Exception as raised:
            refused.append((raised, True))
            raise
        if not passes:
            refused.append((exn, False))
        return passes

    return on_repeat


def _limited(
    samples: Iterator[dict], cursor: ReaderCursor, limit: Optional[int], skipping: Optional[int]
) -> Generator[dict, None, bool]:
    """``samples`` past byte ``skipping`` (when given), up to ``limit`` in the pass; True: the limit was hit."""
    position = cursor.position
    delivered = -1 if skipping is None else skipping
    for sample in samples:
        if position.start < delivered:
            position.samples -= 1
            continue
        yield sample
        if limit is not None and position.samples >= limit:
            cursor.done = True
            return True
    return False


def _shards(src: Iterable[dict], cursor: ReaderCursor, limit: Optional[int], skip: int = 0) -> Iterator[dict]:
    """The shard items, and with a ``limit`` not yet reached, the same items again from the first.

    ``skip`` items are passed over unread (a resumed pass), so they count for nothing.
    """
    seen = []
    given = 0
    for source in src:
        if limit is not None:
            seen.append(source)
        given += 1
        yield source
    if limit is None or cursor.samples >= limit:
        return
    if not seen:
        if cursor.elastic is not None:
            return  # an elastic share of buffered samples only: it has no shards to go over again
        ident = cursor.identity or {}
        if "stream" in ident:
            raise ValueError(
                f"equal_work: stream {ident['stream']} of {ident['streams']} was given no shards, so "
                f"it cannot produce its {limit} samples; use at least {ident['streams']} shards or "
                "fewer streams"
            )
        raise ValueError(
            f"equal_work: rank {ident.get('rank')} worker {ident.get('worker')} was given no shards, so it cannot "
            f"produce its {limit} samples; use at least "
            f"{ident.get('world_size', 1) * ident.get('num_workers', 1)} shards (ranks x workers) or fewer "
            "DataLoader workers"
        )
    while cursor.samples < limit:
        before, first = cursor.samples, given
        for source in seen:
            given += 1
            yield {k: v for k, v in source.items() if k != "stream"}
        if cursor.samples == before and first > skip:
            return  # a whole round of reading gave no sample: stop rather than loop forever


def _short_of(skip: int, reached: int) -> StateMismatchError:
    """A saved state resumes at shard ``skip`` of the worker's shards, but the pass was given ``reached + 1``."""
    return StateMismatchError(
        f"the saved state resumes at shard {skip} of this worker's shards, but it was given only "
        f"{reached + 1}: load a state saved by a dataset over the same shards and workers",
        field="shard",
        shard=skip,
    )


class _Lookahead:
    """An iterator whose next items can be looked at before they are taken (to fetch those shards ahead)."""

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it
        self._ahead: collections.deque = collections.deque()

    def __iter__(self) -> _Lookahead:
        return self

    def __next__(self) -> Any:
        return self._ahead.popleft() if self._ahead else next(self._it)

    def peek(self, n: int) -> list:
        while len(self._ahead) < n:
            try:
                self._ahead.append(next(self._it))
            except StopIteration:
                break
        return list(itertools.islice(self._ahead, n))


def _parse_range(reader: TarSamples, stream: Any, url: str, start: int, ranged: bool) -> Iterator[tuple[int, dict]]:
    """``(offset, sample)`` of a range ``reader`` fetches again, with the fields its first read gave them
    (``__local_path__`` as the opener names the shard)."""
    position = SamplePosition()
    members = TarMembers(
        stream,
        url,
        select=reader._member_filter(),
        start=start,
        ranged=ranged,
        max_member=reader._max_member(),
        views=reader.zero_copy,
    )
    for sample in shard_samples(
        url,
        stream,
        keys=key_rule(reader.keys),
        lcase=reader.lcase,
        suffixes=reader.suffixes,
        rename_files=reader.rename_files,
        local_path=_local_path_of(reader.opener, url),
        position=position,
        members=members,
        max_sample=reader._max_sample(),
        on_repeat=_skip_quietly,  # as the first read did; its handler saw the repeat then
    ):
        yield position.start, sample


def _local_path_of(opener: Any, url: str) -> Optional[str]:
    """The ``local_path`` the opener reports for ``url`` when it opens it (None without an opener that says)."""
    return opener.local_path(url) if opener is not None and hasattr(opener, "local_path") else None


def _skip_quietly(exn: Exception) -> bool:
    return True


def _urls(items: Sequence[Any]) -> list[str]:
    """The URLs of shard items to fetch ahead: not those opened already (an item holding a stream is read as
    it is), nor partly read shards of an elastic resume (``resume_at``: read from their saved byte, not
    fetched whole)."""
    return [
        item if isinstance(item, str) else item["url"]
        for item in items
        if isinstance(item, str)
        or (isinstance(item, dict) and "url" in item and "stream" not in item and "resume_at" not in item)
    ]


def tarfile_to_samples(handler: Callable = reraise_exception, **kw: Any) -> TarSamples:
    """The shard reader stage (``{"url": ...}`` items in, samples out): a resumable :class:`TarSamples`."""
    return TarSamples(handler=handler, **kw)
