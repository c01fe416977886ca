"""Virtual streams: an order of samples that does not depend on the number of ranks and workers.

``WebDataset(urls, streams=K)`` cuts each epoch's shard order into ``K`` streams (stream ``v`` reads
shards ``v, v + K, v + 2K, ...`` of the order).  Each stream is a pipeline of its own: its own reader,
its own shuffle buffer (seeded from the stream's number) and its own copies of the stages chained on the
dataset.  The physical workers (ranks x DataLoader workers, ``P`` of them, a divisor of ``K``) take whole
streams, worker ``p`` the streams ``v`` with ``v % P == p``, and yield one item of each in turn, in stream
order, skipping streams that ended.

So what a stream yields, and in which order, is the same on 1 x 1, 2 x 2, 4 x 1 or any shape whose
worker count divides ``K``; so is the set of samples of an epoch.  What changes with the shape is how
the streams' items are interleaved into each worker's output, and so which batch (and rank) an item
lands in.  A state names streams, never ranks: :func:`~wds_cloud.resume.elastic.merge_states` gathers every
stream's state, and a loader of another shape continues each stream where it stood.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

from .. import utils
from ..errors import ConfigError, StateMismatchError
from ..io.datafile import shown
from ..stages import PassHolder, PipelineStage
from .state import expect

__all__ = ["Streams", "STREAMS_KIND"]

#: the kind label a state gives each stream's pipeline
STREAMS_KIND = "stream"


class _StreamShards(PipelineStage):
    """The source of one stream's pipeline: the shard items of that stream in this epoch."""

    def __init__(self) -> None:
        self.items: list = []
        self.urls: list = []  # every shard URL of the epoch (what a saved state's URLs are checked against)

    def run(self) -> Iterator[dict]:
        return iter(self.items)


class Streams(PassHolder, PipelineStage):
    """``count`` virtual streams, each a pipeline of ``template`` stages over its share of the epoch's shards.

    ``pipeline``: makes a pipeline from its stages (``DataPipeline``); ``limit_for(stream)`` gives a stream
    reader's ``limit`` (``equal_work`` counts per stream), or None.  A pipeline holds a copy of its own (see
    :class:`~wds_cloud.stages.PassHolder`): the streams' pipelines belong to its passes.
    """

    PASS_FIELDS = {"_pipelines": dict, "_owned": list, "_slot": None, "_next": 0}
    COPIED_FIELDS = ("_resume", "_merged")
    #: each stream's reader keeps where the pass stands (see wds_cloud.resume.protocol)
    keeps_place = True

    def __init__(
        self, count: int, template: list, pipeline: Callable[..., Any], limit_for: Optional[Callable[[int], Any]] = None
    ) -> None:
        if not (isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= 65536):
            raise ConfigError(
                f"streams={count!r}: give a number of virtual streams from 1 to 65536 (a multiple of "
                "every ranks x workers count you will run on)"
            )
        self.count = count
        self.template = list(template)
        self.make_pipeline = pipeline
        self.limit_for = limit_for
        self._pipelines: dict[int, Any] = {}
        self._resume: Optional[dict] = None  # a state of this stage, for the next pass
        self._merged: Optional[dict] = None  # {stream: state} of a merged state, for the next pass
        self._owned: list = []
        self._slot: Optional[list] = None  # [worker, workers] of the current pass
        self._next = 0  # position (in _owned) of the stream the next item comes from

    def extended(self, stages: Iterable[Any]) -> Streams:
        """A copy with ``stages`` added to every stream (what fluent methods on the dataset do)."""
        return Streams(self.count, self.template + list(stages), self.make_pipeline, self.limit_for)

    def _pipeline(self, stream: int) -> Any:
        pipe = self._pipelines.get(stream)
        if pipe is None:
            stages = []
            for stage in self.template:
                clone = getattr(stage, "for_stream", None)
                stages.append(clone(stream, self.count) if callable(clone) else stage)
            pipe = self._pipelines[stream] = self.make_pipeline(_StreamShards(), *stages)
            for stage in pipe.pipeline:
                if callable(getattr(stage, "set_limit", None)) and self.limit_for is not None:
                    stage.set_limit(self.limit_for(stream))
        return pipe

    def run(self, src: Iterable[dict]) -> Iterator:
        rank, world_size, worker, workers = utils.pytorch_worker_info()
        slot, slots = rank * workers + worker, world_size * workers
        if self.count % slots:
            raise ConfigError(
                f"streams={self.count} cannot be shared by {world_size} ranks x {workers} DataLoader "
                f"workers ({slots}): the number of streams must be a multiple of ranks x workers; run "
                f"on a shape that divides {self.count}, or build the dataset with another streams="
            )
        resume, merged = self._resume, self._merged
        self._resume = self._merged = None
        states: dict = dict(merged or {})
        start = 0
        owned = [v for v in range(self.count) if v % slots == slot]
        if resume is not None:
            if resume.get("slot") != [slot, slots]:
                raise StateMismatchError(
                    f"this state of a streams={self.count} dataset was taken by worker {shown(resume.get('slot'))} "
                    f"(worker, workers), and is loaded into worker {[slot, slots]}: on another shape, merge every "
                    "rank's states with wds.merge_states() (or state_dict(gather=True)) and load that",
                    field="slot",
                )
            states = {v: s for v, _, s in resume["stages"]}
            start = owned.index(resume["next"]) if resume["next"] in owned else 0
        items = list(src)
        urls = [item.get("url") for item in items if isinstance(item, dict)]
        pipes = []
        for v in owned:
            pipe = self._pipeline(v)
            source = pipe.pipeline[0]
            source.items, source.urls = items[v :: self.count], urls
            if v in states:
                pipe.load_nested_state(states[v])
            pipes.append(pipe)
        self._owned, self._slot, self._next = owned, [slot, slots], start
        return self._interleave(pipes, start)

    def _interleave(self, pipes: list, position: int) -> Iterator:
        iterators = [iter(pipe) for pipe in pipes]
        live = len(iterators)
        ended = [False] * live
        n = live
        try:
            while live:
                if not ended[position]:
                    try:
                        item = next(iterators[position])
                    except StopIteration:
                        ended[position] = True
                        live -= 1
                    else:
                        self._next = (position + 1) % n
                        yield item
                position = (position + 1) % n
        finally:  # stopped early or failed: the other streams close the shards they hold open
            for iterator in iterators:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()

    # the Resumable protocol
    def _state(self, take: Callable[[Any], dict]) -> dict:
        owned = self._owned
        return {
            "streams": self.count,
            "slot": self._slot,
            "next": owned[self._next] if owned else 0,
            "stages": [[v, STREAMS_KIND, take(self._pipeline(v))] for v in owned],
        }

    def state_dict(self) -> dict:
        if self._resume is not None:
            return dict(self._resume)
        if self._slot is None:
            return self.next_pass_state()
        return self._state(lambda pipe: pipe.nested_state(False))

    def transport_state(self) -> dict:
        if self._resume is not None or self._slot is None:
            return self.state_dict()
        return self._state(lambda pipe: pipe.nested_state(True))

    def next_pass_state(self) -> dict:
        return {"streams": self.count, "fresh": True}

    def load_state_dict(self, state: dict) -> None:
        expect(state, "streams", dict, streams=(int, lambda n: n == self.count))
        if state.get("fresh"):
            self._resume = None
            return
        expect(
            state,
            "streams",
            dict,
            slot=(list, lambda v: len(v) == 2 and all(type(x) is int for x in v)),
            next=(int, lambda n: 0 <= n < self.count),
            stages=(list, lambda v: len(v) <= self.count),
        )
        seen = set()
        for entry in state["stages"]:
            if not (
                isinstance(entry, list)
                and len(entry) == 3
                and type(entry[0]) is int
                and 0 <= entry[0] < self.count
                and entry[1] == STREAMS_KIND
                and isinstance(entry[2], dict)
                and entry[0] not in seen
            ):
                raise StateMismatchError(
                    f"the saved streams state lists {shown(entry)}, which no state_dict() gives: the state was changed",
                    field="stages",
                )
            seen.add(entry[0])
        self._resume = dict(state)

    def check_merged_streams(self, streams: dict) -> None:
        """Refuse the streams of a merged state taken with another number of streams."""
        if streams.get("count") != self.count:
            raise StateMismatchError(
                f"the merged state was taken from streams={shown(streams.get('count'))}; this "
                f"dataset has streams={self.count}: build it as the job that took the state",
                field="streams",
            )

    def streams_start(self, streams: dict, rank: int, world_size: int, worker: int, workers: int) -> list:
        """The states (``[[stream, state], ...]``) of the streams a rank and worker takes from a merged state."""
        slot, slots = rank * workers + worker, world_size * workers
        return [[v, state] for v, state in streams["states"] if v % slots == slot]

    def load_merged_streams(self, states: dict) -> None:
        """Continue every stream of a merged state (``{stream: state}``) where it stood; streams this worker does
        not own are left to the workers that do."""
        self._merged = dict(states)
        self._resume = None
