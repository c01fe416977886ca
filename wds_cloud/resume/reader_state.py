"""The resume side of the shard reader (:class:`~wds_cloud.tar.shardreader.TarSamples`): where a pass stands,
what its state records, and the buffered samples it yields again first.

The reader reads (opening, members, samples, limits, errors, prefetch); it keeps a :class:`ReaderCursor`
up to date as it goes (the byte range of the sample last yielded, kept by the grouping loop itself, so
resume adds no work per sample), and owns a :class:`ReaderResume`, which it calls when a pass starts
(:meth:`ReaderResume.take`, :meth:`~ReaderResume.identify`, :meth:`~ReaderResume.resumed`) and when a state
is taken or loaded.  Through it the reader plays the :class:`~wds_cloud.resume.protocol.SampleSource` role:
``state_dict``/``load_state_dict``, ``set_replay`` (a shuffle's buffered samples, fetched again with ranged
reads before the shards), and ``set_elastic`` (a share of a merged state).

A reader's state: ``shard`` (index among the worker's shards of the pass), ``url`` and ``url_id``, ``offset``
(where the next sample begins, a whole tar block), ``next`` (the member that begins it), ``samples`` (read in
the pass), ``done``, ``identity`` (rank and worker, or virtual stream), and where they apply ``compressed``,
``pax`` (global PAX records in force), ``replayed`` and ``limit`` (an elastic share; ``equal_work``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Optional

from .. import utils
from ..errors import NotResumableError
from . import state as resuming
from .elastic import REPLAY_REF
from .refetch import refetch
from .state import MAX_OFFSET, expect, refuse_unknown, shown_url, url_id

#: every field a shard reader's state_dict() gives (a state is input: anything else was added by hand)
STATE_FIELDS = frozenset(
    ("fresh", "shard", "url", "url_id", "offset", "samples", "done", "identity", "compressed", "pax", "next")
    + ("replayed", "limit")
)

__all__ = ["ReaderCursor", "ReaderResume", "check_resumed_shard"]

#: (ranged read, whole read, parse) of a reader: how buffered samples are fetched again (see refetch)
Fetch = tuple[Callable, Callable, Callable]


class ReaderCursor:
    """Where one pass of a shard reader stands (read by its state and by the shuffle it feeds).

    ``position`` (a :class:`~wds_cloud.tar.grouping.SamplePosition`, given by the reader) is the byte range of the
    sample last yielded (``end`` is where the next one begins), the samples read in this pass and the member that
    begins the next, kept up to date by the grouping kernel itself, so the reader adds no work per sample.
    """

    __slots__ = (
        "shard",
        "url",
        "compressed",
        "done",
        "position",
        "identity",
        "members",
        "base_pax",
        "recorded",
        "elastic",
        "limit",
    )

    def __init__(self, position: Any) -> None:
        self.shard = 0  # index of the current shard among the shards this worker was given
        self.url: Optional[str] = None
        self.compressed = False
        self.done = False
        self.position = position
        self.identity: Optional[dict] = None
        self.members: Any = None  # the TarMembers of the current shard
        self.base_pax: dict = {}  # global PAX records in force where the current read began
        self.recorded: Optional[list] = None  # (name, data offset, size) of the members read (index_sink)
        #: after an elastic resume: [samples of the share's replay list yielded, its length]
        self.elastic: Optional[list] = None
        self.limit: Optional[int] = None  # the samples this pass yields (equal_work), when limited

    @property
    def offset(self) -> int:
        """Where the next sample of the current shard begins."""
        return self.position.end

    @property
    def samples(self) -> int:
        return self.position.samples

    @property
    def pax(self) -> dict:
        members = self.members
        return (members.pax_global if members is not None else None) or self.base_pax


def _shown(url: Optional[str]) -> Optional[str]:
    return shown_url(url) if url is not None else None


def _ident(url: Optional[str]) -> Optional[str]:
    return url_id(url) if url is not None else None


def _share_fields(state: dict, cursor: ReaderCursor) -> None:
    """The fields of a reader's state that an elastic share and equal_work add: the replays yielded, the limit."""
    progress = cursor.elastic
    if progress is not None:
        state["replayed"] = progress[0]
        if progress[0] < progress[1] and not cursor.done:  # still replaying: no shard begun
            state.update(shard=0, url=None, url_id=None, offset=0, next=None)
            state.pop("compressed", None)
            state.pop("pax", None)
    if cursor.limit is not None:
        state["limit"] = cursor.limit


def check_resumed_shard(url: str, saved: dict) -> None:
    """Refuse to resume in shard ``url`` a state saved in another (the shard order differs)."""
    if not resuming.same_url(url, saved["url"], saved.get("url_id")):
        resuming.check_same(
            "dataset (the shard order differs)", {"shard": saved["url"]}, {"shard": resuming.shown_url(url)}
        )


class ReaderResume:
    """What a shard reader records for a state, and what waits for its next pass: a loaded state, the samples
    a shuffle had buffered (:meth:`set_replay`), an elastic share (:meth:`set_elastic`).

    ``stream_identity``: the identity a state records (None: this rank and DataLoader worker; a virtual
    stream's, see :mod:`wds_cloud.resume.streams`).  ``last_refetch``: what the last resume fetched again:
    samples, requests, bytes (compressed shards: bytes decompressed), seconds.
    """

    def __init__(self, stream_identity: Optional[dict] = None) -> None:
        self.loaded: Optional[dict] = None
        self.replay: list = []
        self.elastic: Optional[tuple] = None  # (samples to replay, limit) of an elastic resume's share
        self.stream_identity = stream_identity
        self.last_refetch: dict = {}

    @property
    def pending(self) -> bool:
        """Whether a loaded state, a replay or an elastic share waits for the next pass."""
        return self.loaded is not None or bool(self.replay) or self.elastic is not None

    def take(self) -> tuple[Optional[dict], list, Optional[tuple]]:
        """(loaded state, replay, elastic share) for the pass that starts now; none of them waits any more."""
        taken = self.loaded, self.replay, self.elastic
        self.loaded, self.replay, self.elastic = None, [], None
        return taken

    # taking a state
    @staticmethod
    def refuse_replaced(replaced_now: Any) -> None:
        """Refuse a state of a pass read through module-level functions user code replaced (``replaced_now``)."""
        if replaced_now is not None:
            raise NotResumableError(
                f"the shards of this pass were read through {replaced_now}, which user code replaced (as "
                "webdataset allows), so where the pass stands is not known: restore the library's function "
                "to take exact states"
            )

    def state_dict(self, c: Optional[ReaderCursor], replaced_now: Any) -> dict:
        """The reader's state at cursor ``c`` (a loaded state, until a pass begins)."""
        if self.loaded is not None:  # loaded, not yet iterated: still that state
            return dict(self.loaded)
        self.refuse_replaced(replaced_now)
        if c is None:
            return {"fresh": True}
        state = {
            "shard": c.shard,
            "url": _shown(c.url),
            "url_id": _ident(c.url),
            "offset": c.offset,
            "samples": c.samples,
            "done": c.done,
            "identity": dict(c.identity) if c.identity is not None else None,
            "next": c.position.next_name,
        }
        if c.compressed:
            state["compressed"] = True
        if c.pax:
            state["pax"] = dict(c.pax)
        if c.elastic is not None or c.limit is not None:
            _share_fields(state, c)
        return state

    def transport_state(self, c: Optional[ReaderCursor], replaced_now: Any) -> dict:
        """:meth:`state_dict` for a loader that asks with every batch: the same, without defensive copies."""
        self.refuse_replaced(replaced_now)
        if self.loaded is not None or c is None:
            return self.state_dict(c, replaced_now)
        position = c.position
        state = {
            "shard": c.shard,
            "url": _shown(c.url),
            "url_id": _ident(c.url),
            "offset": position.end,
            "samples": position.samples,
            "done": c.done,
            "identity": c.identity,
            "next": position.next_name,
        }
        if c.compressed:
            state["compressed"] = True
        pax = c.pax
        if pax:
            state["pax"] = dict(pax)
        if c.elastic is not None or c.limit is not None:
            _share_fields(state, c)
        return state

    def next_pass_state(self) -> dict:
        return dict(self.loaded) if self.loaded is not None else {"fresh": True}

    # loading a state
    def load(self, state: dict) -> None:
        """Continue from ``state`` on the next pass (checked field by field: a state is input)."""
        expect(state, "shard reader", dict)
        if state.get("fresh"):
            self.loaded = None
            return
        refuse_unknown(state, STATE_FIELDS, "shard reader")
        replaying = "replayed" in state  # an elastic share: no shard is begun while its replays last
        # a pass that ended before any shard began (a virtual stream given no shard: more streams than shards)
        empty = state.get("done") is True and state.get("offset") == 0 and state.get("samples") == 0
        expect(
            state,
            "shard reader",
            dict,
            shard=(int, lambda v: v >= 0),
            url=(str, None, replaying or empty),
            offset=(int, lambda v: 0 <= v < MAX_OFFSET and v % 512 == 0),
            samples=(int, lambda v: v >= 0),
            done=bool,
            identity=(dict, None, True),
            compressed=(bool, None, True),
            pax=(dict, None, True),
            next=(str, None, True),
            url_id=(str, None, True),
            replayed=(int, lambda v: v >= 0, True),
            limit=(int, lambda v: v >= 0, True),
        )
        self.loaded = dict(state)

    def set_replay(self, replay: Sequence[tuple]) -> None:
        """First yield the samples at ``replay`` (``(url, start, end, compressed, ref)``) on the next pass."""
        self.replay = list(replay)

    def set_elastic(self, replay: Sequence[tuple], limit: Optional[int]) -> None:
        """Begin the next pass with this rank and worker's share of an elastic resume (see the reader's
        ``set_elastic``)."""
        self.elastic = (list(replay), limit)

    # when a pass starts
    def identify(self, cursor: ReaderCursor, resume: Optional[dict]) -> None:
        """Record which rank and worker reads; a resumed pass must be the same one, at the saved count."""
        if self.stream_identity is not None:
            cursor.identity = dict(self.stream_identity)
        else:
            rank, world_size, worker, num_workers = utils.pytorch_worker_info()
            cursor.identity = {"rank": rank, "world_size": world_size, "worker": worker, "num_workers": num_workers}
        if resume is not None:
            resuming.check_same(
                "dataset (rank and DataLoader worker)",
                resume.get("identity") or {},
                cursor.identity,
                "This state was taken by another rank or DataLoader worker, or on another shape. "
                + resuming.RESHAPE_FIX,
            )
            cursor.position.samples = resume.get("samples", 0)

    def resumed(
        self,
        cursor: ReaderCursor,
        resume: Optional[dict],
        replay: list,
        elastic: Optional[tuple],
        fetch: Fetch,
    ) -> Generator[dict, None, Optional[dict]]:
        """The start of a resumed pass: the samples a shuffle had buffered, then an elastic share's, with the
        cursor placed where the saved state stood.  Returns the saved state the shards resume from (``{}``: from
        their start), or None when the saved pass was done."""
        position = cursor.position
        self.identify(cursor, resume)
        if replay:
            yield from self._replayed(cursor, replay, fetch)
        saved: dict = resume if resume is not None else {}
        if elastic is not None:
            cursor.limit = elastic[1]
            cursor.elastic = [saved.get("replayed", 0), len(elastic[0])]
            if saved.get("done"):
                cursor.done = True
                return None
            yield from self._shared(cursor, elastic[0], fetch)
            if saved.get("url") is None:  # the state was taken while replaying: no shard had begun
                saved = {}
        if saved:
            cursor.shard, cursor.url, position.end = saved["shard"], saved["url"], saved["offset"]
            cursor.compressed, cursor.base_pax = bool(saved.get("compressed")), dict(saved.get("pax") or {})
            if saved.get("done"):
                cursor.done = True
                return None
        return saved

    def _replayed(self, cursor: ReaderCursor, replay: list, fetch: Fetch) -> Iterator[dict]:
        """The samples a resumed shuffle had buffered, fetched again with ranged reads, in buffer order."""
        position = cursor.position
        started = time.perf_counter()
        report: dict = {}
        samples = refetch([loc[:4] for loc in replay], *fetch, report=report)
        report["seconds"] = time.perf_counter() - started
        self.last_refetch = report
        for (url, start, end, compressed, ref), sample in zip(replay, samples):
            cursor.shard, cursor.url, cursor.compressed = ref, url, compressed
            position.start, position.end = start, end
            yield sample

    @staticmethod
    def _shared(cursor: ReaderCursor, replay: list, fetch: Fetch) -> Iterator[dict]:
        """The buffered samples an elastic resume gave this share, fetched again in runs (bounded memory), from
        the count already yielded; each counts as a sample of the pass."""
        position, progress = cursor.position, cursor.elastic
        assert progress is not None
        batch = 256
        while progress[0] < len(replay):
            first = progress[0]
            chunk = replay[first : first + batch]
            samples = refetch([loc[:4] for loc in chunk], *fetch)
            for number, ((url, start, end, compressed), sample) in enumerate(zip(chunk, samples), first):
                cursor.shard, cursor.url, cursor.compressed = REPLAY_REF + number, url, compressed
                position.start, position.end = start, end
                position.samples += 1
                progress[0] = number + 1
                yield sample
        cursor.shard, cursor.url, cursor.compressed, position.start, position.end = 0, None, False, 0, 0
