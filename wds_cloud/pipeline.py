"""``DataPipeline``: a source followed by stages, iterated as one dataset.

The first stage is called with no argument (a shard list, a dataset, a list)
and every later stage receives the iterator of the one before.  ``with_epoch``
and ``with_length`` return the pipeline itself and keep it picklable, so
spawn-started DataLoader workers receive it intact.

``state_dict()`` / ``load_state_dict(state)`` save and restore where the most
recent iterator stands, at the last sample it yielded (see :mod:`wds_cloud.resume`).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator
from typing import Any, Optional

from . import shardlists, utils
from .errors import ConfigError, NotResumableError, StateMismatchError, redact
from .io.datafile import shown
from .io.security import untrusted
from .pytorch import DataLoader, IterableDataset
from .resume import consistency, elastic
from .resume.arguments import as_count
from .resume.protocol import (
    SampleSource,
    declines_resume,
    is_buffering,
    is_resumable,
    is_source,
    next_pass_state,
    transport_state,
)
from .resume.state import (
    FORMAT,
    SEAL,
    check_same,
    expect,
    inexact_state,
    is_inexact,
    refuse_unknown,
    restart_from,
    seal,
    seal_problem,
    shown_url,
    url_id,
)
from .stages import PipelineStage

__all__ = ["DataPipeline", "add_length_method"]


def _refused(items: Iterator, problem: StateMismatchError) -> Iterator:
    """A pass resumed from a state whose checksum did not match: the stages make their first item (their own
    checks of the state raise, naming the field), then ``problem`` is raised; nothing is yielded."""
    try:
        for _ in items:
            break
    except StateMismatchError:
        raise
    except Exception as exc:  # what a changed state made fail is reported as what it is: a changed state
        raise problem from exc
    raise problem
    yield  # a generator


def add_length_method(obj: Any) -> Any:
    """Give ``obj`` (a DataPipeline with ``size`` set) a working ``len()``; returns ``obj``."""
    obj.enable_length()
    return obj


def _plain_state(stage: Any) -> Any:
    return stage.state_dict()


def stage_name(stage: Any) -> str:
    """A short human name for a pipeline stage (for messages)."""
    f = getattr(stage, "f", None)
    if f is not None and callable(f):  # a curried filter: name the function it runs
        name = getattr(f, "__name__", None) or type(f).__name__
        return name.lstrip("_")
    if isinstance(stage, type) or callable(stage) and hasattr(stage, "__name__"):
        return f"function {stage.__name__}" if not isinstance(stage, type) else stage.__name__
    return type(stage).__name__


class DataPipeline(IterableDataset, PipelineStage):
    """A pipeline of stages; ``DataPipeline(source, stage1, stage2, ...)``."""

    _elastic: Optional[dict] = None  # (also for pipelines pickled by an earlier version)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.pipeline: list = []
        self.length = -1
        self.repetitions = 1
        self.nsamples = -1
        self.size: Optional[int] = None
        self._has_length = False
        self.epoch: Optional[int] = None
        #: (pass, samples yielded, begun, ended) of the most recent iterator; "ended": it raised StopIteration
        self._progress = [0, 0, True, False]
        self._resume_progress: Optional[list] = None
        self._worker_states: Optional[dict] = None  # per-DataLoader-worker states, applied in each worker
        self._seal_problem: Optional[StateMismatchError] = None  # a loaded state's checksum did not match
        self._elastic: Optional[dict] = None  # a merged state, shared out when the next pass begins (per worker)
        for arg in args:
            if arg is None:
                continue
            if isinstance(arg, list):
                self.pipeline.extend(arg)
            else:
                self.pipeline.append(arg)

    def close(self) -> None:
        """Drop references to the stages (and what they hold open)."""
        self.pipeline = []

    def invoke(self, f: Any, *args: Any, **kwargs: Any) -> Iterator:
        if isinstance(f, DataPipeline) and not args:  # a whole dataset as the source: iterate it
            return iter(f)
        if isinstance(f, PipelineStage):
            return f.run(*args, **kwargs)
        if isinstance(f, (IterableDataset, DataLoader)) and len(args) == 0:
            return iter(f)
        if isinstance(f, list):
            return iter(f)
        if callable(f):
            return f(*args, **kwargs)
        raise ConfigError(
            f"{f!r} is not a pipeline stage: give a callable, a PipelineStage, an iterable dataset or a list"
        )

    def iterator1(self) -> Iterator:
        """One pass through the pipeline."""
        if not self.pipeline:
            raise ConfigError("this DataPipeline has no stages")
        self._wire()
        source = self.invoke(self.pipeline[0])
        for step in self.pipeline[1:]:
            source = self.invoke(step, source)
        return source

    def iterator(self) -> Iterator:
        """``repetitions`` passes; stops early when a pass yields nothing."""
        self._progress = [0, 0, False, False]
        return self._run(self._progress, None)

    def __iter__(self) -> Iterator:
        if self._elastic is not None:
            self._apply_elastic()
        if self._worker_states is not None:
            self._apply_worker_state()
        resume, self._resume_progress = self._resume_progress, None
        limit = self.nsamples if self.repetitions != 1 and self.nsamples > 0 else None
        # at once: state_dict() may come before next(); a resumed pass is "begun" (its stages hold the state)
        self._progress = [resume[0], resume[1], True, False] if resume else [0, 0, False, False]
        problem, self._seal_problem = self._seal_problem, None
        items = self._run(self._progress, limit)
        return items if problem is None else _refused(items, problem)

    def _resumed_pass_is_over(self) -> bool:
        """Whether a loaded state's pass had already yielded the items ``with_epoch`` allows."""
        resume = self._resume_progress
        limit = self.nsamples if self.repetitions != 1 and self.nsamples > 0 else None
        return resume is not None and limit is not None and resume[1] >= limit

    def _run(self, progress: list, limit: Any) -> Iterator:
        # progress[3] ("ended") is set only where the consumer asked past the last item, not when it
        # stopped early (set inline: a generator layer of its own would cost every sample)
        first, count = progress[0], progress[1]
        progress[2] = True
        if limit is not None and count >= limit:
            progress[3] = True
            return
        for repetition in range(first, self.repetitions):
            progress[0] = repetition
            produced = False
            for sample in self.iterator1():
                produced = True
                count += 1
                progress[1] = count
                yield sample
                if limit is not None and count >= limit:
                    progress[3] = True
                    return
            if not produced:
                break
        progress[3] = True

    # pickling (spawn-started DataLoader workers)
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        # A spawned worker has no process group: it learns this rank from the pickle.
        state["_dist_hint"] = utils.torch_distributed()
        return state

    def __setstate__(self, state: dict) -> None:
        hint = state.pop("_dist_hint", None)
        if hint is not None and hint[1] > 1:
            utils.inherit_distributed(*hint)
        self.__dict__.update(state)

    # resume (the stages take part through wds_cloud.resume.protocol)
    def _feeding(self) -> tuple[dict, Optional[SampleSource]]:
        """({index of each buffering stage: the sample source feeding it, or None}, the source feeding the output).

        The one walk over the stages that :meth:`_wire`, :meth:`feeding_source`, :meth:`resume_blocker`
        and :meth:`load_state_dict` share: a buffering stage's items are no reader's latest, so it ends a
        source's reach; a nested pipeline passes on the source feeding its output.
        """
        feeders: dict[int, Optional[SampleSource]] = {}
        source = None
        for i, stage in enumerate(self.pipeline):
            if is_buffering(stage):
                feeders[i], source = source, None
            elif isinstance(stage, DataPipeline):
                source = stage.feeding_source()
            elif is_source(stage):
                source = stage if getattr(stage, "replayable", True) else None
        return feeders, source

    def _wire(self) -> None:
        """Tell each buffering stage (a shuffle) which sample source feeds it, so it can record where its
        samples came from."""
        for i, source in self._feeding()[0].items():
            self.pipeline[i].attach_source(source)

    def feeding_source(self) -> Optional[SampleSource]:
        """The sample source (shard reader) whose latest sample is this pipeline's latest output, if any."""
        return self._feeding()[1]

    def resume_blocker(self) -> Optional[str]:
        """Why a state of this pipeline could not be resumed (the stage and the fix), or None.

        Decided from the stage list alone, without iterating: iteration never depends on it.
        A buffering stage (a sample shuffle) must be fed by a sample source of this pipeline
        (``tarfile_to_samples()``, or ``WebDataset``), since its buffered samples are saved as
        byte ranges of their shards; a stage that sets ``resumable = False`` blocks it too.
        """
        feeders = self._feeding()[0]
        for i, stage in enumerate(self.pipeline):
            if declines_resume(stage):
                return (
                    f"stage {i} ({stage_name(stage)}) declares that it cannot be resumed (resumable = False); "
                    "implement state_dict()/load_state_dict() on it (see wds_cloud.Resumable) or leave it out"
                )
            if i in feeders and feeders[i] is None:
                if i == 0:
                    feeder = "it is the source"
                elif is_buffering(self.pipeline[i - 1]):
                    feeder = f"it takes its items from another shuffle (stage {i - 1})"
                else:
                    feeder = f"it takes its items from stage {i - 1} ({stage_name(self.pipeline[i - 1])})"
                fix = getattr(self.pipeline[i - 1], "shuffle_after_fix", None) if i > 0 else None
                if fix:  # the stage before knows the fix that fits it (a mix: a shuffle per source)
                    return (
                        f"stage {i} ({stage_name(stage)}): {feeder}, so the items in its buffer could not be "
                        f"fetched again on resume. To make the pipeline resumable, {fix}"
                    )
                return f"stage {i} {stage.resume_blocker(feeder)}"
            if isinstance(stage, DataPipeline):
                inner = stage.resume_blocker()
                if inner is not None:
                    return f"stage {i} (a nested DataPipeline): {inner}"
        return None

    def _stateful(self) -> list:
        """``(index, kind, stage)`` of the stages that save state (cached while the stage list is unchanged)."""
        return self._stage_facts()[1]

    def _stage_facts(self) -> tuple:
        """(stage list, resumable stages, resume blocker, splitting), computed again only when the stage list
        changed."""
        pipeline = self.pipeline
        cached = self.__dict__.get("_stateful_cache")
        if cached is not None and cached[0] == pipeline:  # list equality: identity first, element by element
            return cached
        # the kind is a label saved with each stage's state, to tell a different pipeline apart on load
        found = [(i, type(stage).__name__, stage) for i, stage in enumerate(pipeline) if is_resumable(stage)]
        self._stateful_cache = (list(pipeline), found, self.resume_blocker(), self._split_kind())
        return self._stateful_cache

    def _split_kind(self) -> Optional[str]:
        """How the shards of the shard list reach the reader: ``"nodes+workers"``, ``"nodes"``, ``"workers"``,
        ``"none"`` (every worker reads every shard), ``"custom"`` (a stage of the user's in between), or None
        (no shard list and reader)."""
        return self._splitting()[0]

    def _splitting(self) -> tuple[Optional[str], Any]:
        """(:meth:`_split_kind`, the first stage of the user's between the shard list and the reader, or None)."""
        stages = self.pipeline
        start = next((i for i, s in enumerate(stages) if isinstance(s, shardlists.SHARE_LISTS)), None)
        if start is None:
            return None, None
        end = next(
            (i for i in range(start + 1, len(stages)) if callable(getattr(stages[i], "set_elastic", None))), None
        )
        if end is None:
            return None, None
        nodes = workers = False
        for stage in stages[start + 1 : end]:
            # identity, not equality: a wrapper (functools.partial, a lambda calling ours) may split otherwise
            if stage is shardlists.split_by_node:
                nodes = True
            elif stage is shardlists.split_by_worker:
                workers = True
            elif stage is not shardlists.single_node_only and not getattr(stage, "keeps_shards", False):
                return "custom", stage
        kind = {(True, True): "nodes+workers", (True, False): "nodes", (False, True): "workers"}.get(
            (nodes, workers), "none"
        )
        return kind, None

    def state_dict(self, strict: bool = False) -> dict:
        """Where the most recent iterator stands, at the last sample it yielded: plain JSON.

        Build an identical pipeline, ``load_state_dict`` it, and iterating yields exactly
        the rest of the pass (shuffle buffer included).  Inside a DataLoader worker this
        is that worker's state; ``WebLoader.state_dict()`` and torchdata's
        ``StatefulDataLoader`` gather the workers' states.

        Trainers call this on their own (Lightning with every checkpoint, torchdata's loader in
        every worker with every batch), so a pipeline that cannot be resumed exactly never makes
        it raise: it returns an *inexact* state (see :func:`wds_cloud.resume.state.inexact_state`),
        logs why once, and loading that state starts the pass again, as webdataset would.
        ``strict=True`` raises :class:`~wds_cloud.errors.NotResumableError` instead.
        """
        if self._elastic is not None:  # a merged state loaded, its pass not begun: still that state
            return self._elastic
        try:
            return seal(self._state(False))
        except NotResumableError as exc:
            if strict:
                raise
            return seal(inexact_state(FORMAT, str(exc), progress=self._current_progress()))

    def transport_state(self) -> dict:
        """:meth:`state_dict` where stages may give arrays and deltas (for a loader that sends one per batch)."""
        return self._state(True)

    def next_pass_state(self) -> dict:
        """The state that starts this pipeline's next pass."""
        return seal(self._state(False, next_pass=True))

    def _current_progress(self) -> list:
        """(pass, items yielded) that a state taken now reports: a loaded state's until a pass begins."""
        progress = self._resume_progress if self._resume_progress is not None else self._progress
        return [progress[0], progress[1]]

    def _state(self, fast: bool, next_pass: bool = False) -> dict:
        blocker = self._stage_facts()[2]
        if blocker is not None:
            raise NotResumableError(f"this pipeline cannot save a resumable state: {blocker}")
        progress = self._current_progress()
        if next_pass or (self._resume_progress is None and not self._progress[2]):
            # iter() was called but the pass has not begun: its stages still describe the pass before
            return {
                "format": FORMAT,
                "progress": [0, 0],
                "stages": [[i, kind, next_pass_state(stage)] for i, kind, stage in self._stateful()],
            }
        take = transport_state if fast else _plain_state
        stages = []
        for i, kind, stage in self._stateful():
            try:
                stages.append([i, kind, take(stage)])
            except NotResumableError:
                raise
            except Exception as exc:  # a stage of the user's: reported, never raised into a trainer's loop
                raise NotResumableError(
                    f"this pipeline cannot save a resumable state: stage {i} "
                    f"({stage_name(stage)}) could not take its state: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        split = self._stage_facts()[3]
        if split is not None:
            return {"format": FORMAT, "progress": progress, "stages": stages, "split": split}
        return {"format": FORMAT, "progress": progress, "stages": stages}

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration continue where ``state`` (from :meth:`state_dict`) stood.

        An inexact state (taken from a pipeline that cannot be resumed) is logged and makes the
        next pass start from its beginning.
        """
        if elastic.is_merged(state):
            self.load_merged(state)
            return
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise StateMismatchError(
                f"not a wds_cloud pipeline state (expected format {FORMAT!r}, got "
                f"{shown(state.get('format')) if isinstance(state, dict) else type(state).__name__}): pass the dict "
                "that state_dict() returned",
                field="format",
            )
        problem = seal_problem(state, "pipeline")
        if problem is not None and is_inexact(state):
            raise problem
        self._load(state)  # the stages check their fields first: a changed one is named
        self._seal_problem = problem  # raised before the first item, after the stages' own checks (see __iter__)

    def nested_state(self, fast: bool) -> dict:
        """This pipeline's state as part of a larger one (not sealed: the whole is): ``fast`` as for a loader that
        asks with every batch (see :meth:`transport_state`)."""
        return self._state(fast)

    def load_nested_state(self, state: dict) -> None:
        """Load a state taken with :meth:`nested_state`, as part of a larger state whose checksum was checked."""
        self._load(state)

    def _load(self, state: dict) -> None:
        """:meth:`load_state_dict` of a state whose checksum was checked (or that came from a loader whose state
        was): a DataLoader worker's share of a WebLoader state."""
        if is_inexact(state):
            restart_from(state, "pipeline")
            self._resume_progress = None
            return
        expect(
            state,
            "pipeline",
            dict,
            progress=(list, lambda v: len(v) == 2 and all(type(x) is int and x >= 0 for x in v), True),
            stages=list,
        )
        refuse_unknown(state, ("format", "progress", "stages", "split", SEAL), "pipeline")
        seen: set = set()
        for entry in state["stages"]:
            if not (
                isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int and isinstance(entry[1], str)
            ):
                raise StateMismatchError(
                    f"the saved pipeline state lists the stage {shown(entry)}, which no "
                    "state_dict() gives: the state was changed",
                    field="stages",
                )
            if entry[0] in seen:
                raise StateMismatchError(
                    f"the saved pipeline state lists stage {entry[0]} twice: no state_dict() gives that, the state "
                    "was changed; load the state that state_dict() returned",
                    field="stages",
                )
            seen.add(entry[0])
        saved = {f"stage {i}": kind for i, kind, _ in state["stages"]}
        here = {f"stage {i}": kind for i, kind, _ in self._stateful()}
        check_same("pipeline (its stages differ)", saved, here)
        self._check_pass((state.get("progress") or (0, 0))[0], "progress")
        yielded = (state.get("progress") or (0, 0))[1]
        if self.nsamples > 0 and yielded > self.nsamples:
            raise StateMismatchError(
                f"the saved state says {yielded} items of this pass were yielded, but with_epoch({self.nsamples}) "
                "makes a pass of fewer: the state was changed (or comes from a pipeline with a longer epoch)",
                field="progress",
            )
        self._wire()
        for i, _, stage_state in state["stages"]:
            stage = self.pipeline[i]
            if isinstance(stage, DataPipeline):  # a nested pipeline's part of a state checked as a whole
                stage._load(stage_state)
            else:
                stage.load_state_dict(stage_state)
        feeders = self._feeding()[0]
        for i, _, stage_state in state["stages"]:
            stage = self.pipeline[i]
            if is_buffering(stage):
                replay = stage.replay_locations(stage_state)
                if replay:
                    source = feeders.get(i)
                    if source is None:
                        raise StateMismatchError(
                            "the saved state has samples in a shuffle buffer, but no shard "
                            "reader feeds that shuffle here"
                        )
                    self._check_buffer(replay, source, state["stages"])
                    source.set_replay(self._trusted_replay(replay))
        self._check_reader(state["stages"])
        for _i, kind, stage_state in state["stages"]:
            if kind in elastic.SHARD_LISTS and isinstance(stage_state.get("assigned"), dict):
                self.assign_share(stage_state["assigned"])  # a pass begun by an elastic resume goes on
        self._resume_progress = list(state.get("progress") or (0, 0))

    def _check_pass(self, number: int, field: str) -> None:
        """Refuse a saved pass this pipeline never reaches (``repeat(n)``: passes 0 to n-1; one pass without
        ``repeat``/``with_epoch``): resuming there would yield nothing more (issue 41)."""
        if number >= self.repetitions:
            raise StateMismatchError(
                f"the saved state stands in pass {number} of this pipeline, which makes {self.repetitions} "
                f"pass{'es' if self.repetitions != 1 else ''} (repeat()/with_epoch()): the state was changed (or "
                "comes from a pipeline repeated more often); load the state that state_dict() returned",
                field=field,
            )

    def _check_reader(self, stages: list) -> None:
        """Refuse a shard reader's state that its own pipeline's other fields contradict (issue 41): ``done`` before
        the last of the worker's shards of this pass (without a sample limit that stops a pass early), or a
        count of samples read that is not the samples the shuffle right after it drew plus those it holds
        (a buffered sample removed, or one already delivered added)."""
        index = next(
            (i for i, stage in enumerate(self.pipeline) if callable(getattr(stage, "set_elastic", None))), None
        )
        reader = next((st for i, _, st in stages if i == index), None)
        if index is None or not isinstance(reader, dict) or reader.get("fresh"):
            return
        listed = next((st for _, kind, st in stages if kind in elastic.SHARD_LISTS), None)
        share = listed.get("assigned") if isinstance(listed, dict) else None
        if reader.get("done") and reader.get("limit") is None and not isinstance(share, dict):
            items = self._worker_shards(listed, reader, None)
            if items is not None and reader["shard"] < len(items) - 1:
                raise StateMismatchError(
                    f"the saved shard reader state says it is done with shard {reader['shard']} of this worker's "
                    f"{len(items)} shards of the pass: the state was changed; load the state that state_dict() "
                    "returned",
                    field="done",
                )
        following = index + 1  # the shuffle the reader feeds, past stages that pass every sample on unchanged
        while following < len(self.pipeline) and getattr(self.pipeline[following], "passes_every_sample", False):
            following += 1
        after = next((st for i, _, st in stages if i == following), None)
        if not (isinstance(after, dict) and is_buffering(self.pipeline[following])) or after.get("fresh"):
            return
        rng, buffer = after.get("rng"), after.get("buffer")
        if not (isinstance(rng, list) and len(rng) == 2 and type(rng[1]) is int and isinstance(buffer, list)):
            return  # a generator of the user's (random.Random) counts no draws
        if reader["samples"] != rng[1] + len(buffer):
            raise StateMismatchError(
                f"the saved shard reader read {reader['samples']} samples, but the shuffle after it drew "
                f"{rng[1]} and holds {len(buffer)}: every sample read is delivered or buffered, once; the state "
                "was changed; load the state that state_dict() returned",
                field="samples",
            )

    def _check_buffer(self, replay: list, source: Any, stages: list) -> None:
        """Refuse buffered samples that the state's own reader could not have read (see
        :func:`wds_cloud.resume.consistency.check_buffer`): only a reader of this pipeline's is held to it."""
        index = next((i for i, stage in enumerate(self.pipeline) if stage is source), None)
        reader = next((st for i, _, st in stages if i == index), None)
        if index is None or not callable(getattr(source, "set_elastic", None)) or not isinstance(reader, dict):
            return  # a source of the user's (or a nested pipeline's): its refs mean what it says
        listed = next((st for _, kind, st in stages if kind in elastic.SHARD_LISTS), None)
        share = listed.get("assigned") if isinstance(listed, dict) else None
        consistency.check_buffer(replay, reader, self._worker_shards(listed, reader, share), share)

    def _worker_shards(self, listed: Optional[dict], reader: dict, share: Any) -> Optional[list]:
        """The URLs of the shards the worker that saved ``reader`` read in its pass, in order (its elastic share, or
        its split of the epoch's order), or None when that cannot be known here."""
        shard_list = next((s for s in self.pipeline if isinstance(s, shardlists.SHARE_LISTS)), None)
        if shard_list is None or not isinstance(listed, dict):
            return None
        urls = shard_list.urls
        if isinstance(share, dict):
            by_id = {url_id(u): u for u in urls}
            partial = [by_id.get(e[0]) if isinstance(e, list) and e else None for e in share.get("partial") or ()]
            pending = share.get("pending") or []
            if None in partial or not all(type(i) is int and 0 <= i < len(urls) for i in pending):
                return None  # refused, naming the field, where the share is taken (assign_share)
            return partial + [urls[i] for i in pending]
        epoch = listed.get("epoch")
        if not isinstance(shard_list, shardlists.SimpleShardList) or type(epoch) is not int or epoch < 0:
            return None
        seed = shard_list.seed
        order = elastic.shard_order(len(urls), seed, epoch) if seed is not None else list(range(len(urls)))
        mine = consistency.slot_items(order, self._split_kind(), reader.get("identity"), elastic.shard_split)
        return None if mine is None else [urls[i] for i in mine]

    # elastic resume (wds_cloud.resume.elastic)
    def load_merged(self, state: dict) -> None:
        """Continue the epoch of a merged state (:func:`wds_cloud.merge_states`) with this process's share of its
        work, whatever the number of ranks and workers; the share is taken when the next pass begins (in each
        DataLoader worker)."""
        elastic.check_merged(state)
        self.check_level(state["pipeline"])
        self._elastic = state
        self._worker_states = None
        self._resume_progress = None
        self._seal_problem = None

    def check_level(self, level: dict) -> None:
        """Refuse a merged level that was not taken from a pipeline like this one, naming what differs, or whose
        fields do not agree with each other and with this pipeline's shards (see :mod:`wds_cloud.resume.consistency`),
        or that this pipeline could not share out exactly (its shards split by a stage of the user's)."""
        if level.get("fresh"):
            return
        self._check_pass(level["pass"], "pass")
        if self.repetitions != 1 and self.nsamples > 0 and level["items"] > level["slots"] * self.nsamples:
            raise StateMismatchError(
                f"the merged state says its {level['slots']} ranks x workers yielded {level['items']} items in "
                f"this pass, more than with_epoch({self.nsamples}) lets each: the state was changed; load the "
                "state that merge_states() returned",
                field="items",
            )
        here = [[i, kind] for i, kind, _ in self._stateful()]
        if level["kinds"] != here:
            check_same(
                "pipeline (its stages differ)",
                {f"stage {i}": k for i, k in level["kinds"]},
                {f"stage {i}": k for i, k in here},
            )
        stages = dict((i, stage) for i, _, stage in self._stateful())
        for key, saved in level["configs"].items():
            stage = stages.get(int(key)) if key.isdigit() else None
            current = next_pass_state(stage).get("config") if stage is not None else None
            if isinstance(saved, dict) and isinstance(current, dict):
                check_same(f"dataset (stage {key}, {stage_name(stage)})", saved, current)
        mix = level.get("mix")
        if mix is not None:
            for stage in stages.values():
                if callable(getattr(stage, "check_merged_mix", None)):
                    stage.check_merged_mix(mix)
        streams = level.get("streams")
        if streams is not None:
            for stage in stages.values():
                if callable(getattr(stage, "check_merged_streams", None)):
                    stage.check_merged_streams(streams)
        if mix is None and streams is None:
            self._share_split()
            shard_list = self._share_list()
            urls = shard_list.urls
            repeats = isinstance(shard_list, shardlists.ResampledShards)
            equal_work = getattr(self, "equal_work", None)
            laps = level.get("owed") is not None and equal_work != "min"
            consistency.check_work(level, urls, repeats=repeats, laps=repeats or laps)
            consistency.check_owed(level, equal_work, self.shard_counts(), len(urls))
            consistency.check_counts(level, repeats)

    def _share_list(self) -> Any:
        """The shard list a merged state's shards are shared out from (refused when this pipeline has none)."""
        shard_list = next((s for s in self.pipeline if isinstance(s, shardlists.SHARE_LISTS)), None)
        reader = next((s for s in self.pipeline if callable(getattr(s, "set_elastic", None))), None)
        if shard_list is None or reader is None:
            raise StateMismatchError(
                "the merged state holds shards, but this pipeline has no shard list (SimpleShardList, "
                "ResampledShards) and shard reader to read them: load it into a dataset like the one it was "
                "taken from",
                field="stages",
            )
        return shard_list

    def _share_split(self, world_size: int = 1, workers: int = 1) -> str:
        """How this pipeline splits its shards, when a merged state can be shared out by it on ``world_size`` ranks
        x ``workers`` DataLoader workers; else StateMismatchError naming the stage and the fix.

        A share is computed for our splitting (split_by_node, split_by_worker, single_node_only): a splitter of
        the user's would split the shares again (shards lost) while the buffered samples, replayed by the
        reader, came once per rank (issue 41), and one that does not split at all gives every rank all of it."""
        split, stage = self._splitting()
        if split == "custom":
            raise StateMismatchError(
                f"this pipeline's shards are split by {stage_name(stage)} ({shown(stage)}), a stage of its own "
                "between the shard list and the reader, so a merged state cannot be shared out exactly (its "
                "buffered samples would come once per rank): split with nodesplitter=wds.split_by_node and the "
                "default workersplitter (wds.split_by_worker), which split the same way",
                field="split",
            )
        if split is None:
            self._share_list()
            raise StateMismatchError("this pipeline has no shard reader after its shard list", field="stages")
        if (world_size > 1 and "nodes" not in split) or (workers > 1 and "workers" not in split):
            lacking = "ranks" if world_size > 1 and "nodes" not in split else "DataLoader workers"
            raise StateMismatchError(
                f"this pipeline does not split its shards over {lacking} (split: {split}), so every one of the "
                f"{world_size} ranks x {workers} workers would read all that the merged state holds: give "
                "nodesplitter=wds.split_by_node (and the default workersplitter, wds.split_by_worker)",
                field="split",
            )
        return split

    def _apply_elastic(self) -> None:
        state, self._elastic = self._elastic, None
        assert state is not None
        rank, world_size, worker, workers = utils.pytorch_worker_info()
        self.apply_start(self.elastic_start(state, rank, world_size, worker, workers))

    def elastic_start(self, merged: dict, rank: int, world_size: int, worker: int, workers: int) -> dict:
        """What the rank and worker given start from after loading ``merged``: a *start*, a worker state of its
        own kind (``{"start": ...}``), kept as that worker's state until it delivers (so that a state taken
        before then still holds its share).  Deterministic: every process computes the same."""
        level = merged["pipeline"]
        start = self.start_of_level(level, rank, world_size, worker, workers)
        slot, slots = rank * workers + worker, world_size * workers
        passes = level.get("pass", 0)
        items = 0
        if self.repetitions != 1 and self.nsamples > 0 and not level.get("fresh"):
            items = max(
                0, self.nsamples - elastic.items_share(level["items"], level["slots"], self.nsamples, slot, slots)
            )
        return {"start": start, "epoch": merged["epoch"], "progress": [passes, items]}

    def start_of_level(self, level: dict, rank: int, world_size: int, worker: int, workers: int) -> dict:
        """The start of one rank and worker in a merged level (see :meth:`elastic_start`)."""
        head = {
            "epoch": level["epoch"],
            "kinds": level.get("kinds"),
            "configs": level.get("configs"),
            "split": level.get("split"),
        }
        if level.get("fresh"):
            return {"fresh": True, **head}
        stages = [stage for _, _, stage in self._stateful()]
        mix = level.get("mix")
        if mix is not None:
            stage = next(s for s in stages if callable(getattr(s, "mix_start", None)))
            return {"mix": stage.mix_start(mix, rank, world_size, worker, workers), **head}
        streams = level.get("streams")
        if streams is not None:
            stage = next(s for s in stages if callable(getattr(s, "streams_start", None)))
            return {
                "streams": stage.streams_start(streams, rank, world_size, worker, workers),
                "count": streams["count"],
                **head,
            }
        split = self._share_split(world_size, workers)
        slot, slots = elastic.shard_split(split, world_size, workers, rank, worker)
        counts = self.shard_counts() if level.get("owed") is not None else None
        mode = getattr(self, "equal_work", None) if level.get("owed") is not None else None
        return {"share": elastic.share(level, slot, slots, counts, mode), **head}

    def apply_start(self, state: dict) -> None:
        """Make the next pass begin from a start (:meth:`elastic_start`)."""
        elastic.check_start(state)
        self.set_epoch(state["epoch"])
        self.apply_level_start(state["start"])
        self._resume_progress = list(state["progress"])

    def apply_level_start(self, start: dict) -> None:
        """Take a start of this pipeline's level (:meth:`start_of_level`) for the next pass."""
        if start.get("fresh"):
            return
        stages = [stage for _, _, stage in self._stateful()]
        if "mix" in start:
            next(s for s in stages if callable(getattr(s, "apply_mix_start", None))).apply_mix_start(start["mix"])
        elif "streams" in start:
            next(s for s in stages if callable(getattr(s, "load_merged_streams", None))).load_merged_streams(
                {v: s for v, s in start["streams"]}
            )
            for stage in stages:
                if callable(getattr(stage, "on_elastic_resume", None)):
                    stage.on_elastic_resume()
        else:
            self.assign_share(start["share"])

    def shard_counts(self) -> Optional[dict]:
        """Samples per shard index, when the dataset knows them (``equal_work``); None here."""
        return None

    def assign_share(self, record: dict) -> None:
        """Make the next pass read the share ``record`` (see :func:`wds_cloud.resume.elastic.share`): its buffered
        samples, then its partly read shards from their saved bytes, then its unstarted shards."""
        shard_list = self._share_list()
        reader = next(s for s in self.pipeline if callable(getattr(s, "set_elastic", None)))
        urls = shard_list.urls
        repeats = isinstance(shard_list, shardlists.ResampledShards)
        elastic.check_share(record, len(urls), repeats=repeats)
        consistency.check_work(
            record,
            urls,
            repeats=repeats,
            laps=repeats or (record.get("limit") is not None and getattr(self, "equal_work", None) != "min"),
            buffered="replay",
            what="saved elastic share",
        )
        by_id = {url_id(u): u for u in urls}
        items = [
            {
                "url": url,
                "resume_at": {
                    "url": shown_url(url),
                    "url_id": entry[0],
                    "offset": entry[2],
                    "next": entry[3],
                    "compressed": entry[4],
                    "pax": entry[5],
                },
            }
            for url, entry in zip(elastic.resolve(record["partial"], by_id, "partial"), record["partial"])
        ]
        items += [{"url": urls[index]} for index in record["pending"]]
        replays = []
        for entry in record["replay"]:
            url = elastic.resolve([entry], by_id, "buffered")[0]
            replays += [
                (url, first * 512, (first + blocks) * 512, entry[2])
                for first, blocks in elastic.decode_ranges(entry[3])
            ]
        shard_list.assign(record, items)
        reader.set_elastic(replays, record.get("limit"))
        for stage in self.pipeline:
            if callable(getattr(stage, "on_elastic_resume", None)):
                stage.on_elastic_resume()

    def shard_urls(self) -> dict:
        """The shard URLs this pipeline's shard lists name (as the program gave them), by text."""
        urls: dict = {}
        for stage in self.pipeline:
            if isinstance(stage, DataPipeline):
                urls.update(stage.shard_urls())
            elif isinstance(getattr(stage, "urls", None), list):
                urls.update((str(u), u) for u in stage.urls)
            elif callable(getattr(stage, "shard_urls", None)):  # a stage over datasets of its own (a mix)
                urls.update(stage.shard_urls())
        return urls

    def _trusted_replay(self, replay: list) -> list:
        """The replay locations with their URLs taken from the shard list, never from the state.

        A state is data: a URL in it that the shard list does not name is refused (it could name
        any file or a ``pipe:`` command); without a shard list to check against, it is marked
        untrusted, so a ``pipe:`` one runs only with ``WDS_ALLOW_UNTRUSTED_PIPES=1``.
        """
        known = self.shard_urls()
        by_id = {url_id(text): url for text, url in known.items()}
        out = []
        for url, start, end, compressed, ref in replay:
            if known:
                ident = getattr(url, "id", None)
                found = by_id.get(ident) if ident else known.get(url)
                if found is not None and ident and shown_url(found) != url:
                    found = None  # the text was changed: the state was tampered with
                if found is None:
                    raise StateMismatchError(
                        f"the saved state names the shard {redact(url)!r}, which this dataset's shard list does "
                        "not: load a state saved by a dataset over the same shards",
                        url=url,
                    )
                url = found
            else:
                url = untrusted(url)
            out.append((url, start, end, compressed, ref))
        return out

    def set_worker_states(self, states: Optional[dict]) -> None:
        """States to load, one per DataLoader worker (``{worker id: state}``), each in its own worker when
        the next pass begins; None: none, and no merged state either (a loader calls this once its workers
        have started)."""
        self._worker_states = states
        if states is None:
            self._elastic = None

    @property
    def has_worker_states(self) -> bool:
        """Whether per-worker states (or a merged state) wait to be loaded at the start of the next pass."""
        return self._worker_states is not None or self.__dict__.get("_elastic") is not None

    def _apply_worker_state(self) -> None:
        _, _, worker, _ = utils.pytorch_worker_info()
        state = (self._worker_states or {}).get(worker)
        self._worker_states = None  # applied once (a persistent worker starts the next epoch afresh)
        if state is not None and "start" in state:
            self.apply_start(state)  # a share of an elastic resume this worker had not begun
        elif state is not None:
            self._load(state)  # the loader's state it came from had its checksum checked

    def enable_length(self) -> None:
        """Make ``len()`` answer ``size`` (what :func:`add_length_method` and :meth:`with_length` do)."""
        self._has_length = True

    def __len__(self) -> int:
        if not self._has_length or self.size is None:
            raise TypeError("this pipeline has no length: call .with_length(n) to declare one")
        return self.size

    def stage(self, i: int) -> Any:
        return self.pipeline[i]

    def append(self, f: Callable) -> None:
        self.pipeline.append(f)

    def compose(self, *args: Callable) -> DataPipeline:
        """A copy of this pipeline with ``args`` appended (fluent methods return new objects)."""
        result = copy.copy(self)
        result.pipeline = list(self.pipeline)
        for arg in args:
            result.append(arg)
        return result

    def with_length(self, n: int, silent: bool = False) -> DataPipeline:
        """Declare ``len(self) == n`` (picklable, unlike webdataset's)."""
        self.size = as_count("with_length", n)
        return add_length_method(self)

    def with_epoch(self, nsamples: int = -1, nbatches: int = -1) -> DataPipeline:
        """Make each epoch exactly ``nsamples`` items, repeating the pipeline as needed."""
        self.repetitions = sys.maxsize
        # plain ints (numpy's too), -1 for "not given"; nan or a fraction refused here, not a pass without end
        self.nsamples = max(as_count("nsamples", nsamples, least=-1), as_count("nbatches", nbatches, least=-1))
        if self.nsamples < 1:  # -1 or 0 would repeat the pipeline without end (issue 41)
            raise ConfigError(
                f"with_epoch(nsamples={shown(nsamples)}, nbatches={shown(nbatches)}) gives no epoch size: give "
                "nsamples (or nbatches) as a whole number of at least 1, the items each epoch yields"
            )
        return self

    def repeat(self, nepochs: int = -1, nbatches: int = -1) -> DataPipeline:
        """Repeat the pipeline ``nepochs`` times (forever when <= 0), stopping after ``nbatches`` items."""
        nepochs, nbatches = as_count("nepochs", nepochs, least=-(1 << 63)), as_count("nbatches", nbatches, least=-1)
        self.repetitions = nepochs if nepochs > 0 else sys.maxsize
        self.nsamples = nbatches
        return self

    def set_epoch(self, epoch: int) -> None:
        """Tell every stage that has ``set_epoch`` which epoch comes next."""
        self.epoch = epoch
        for stage in self.pipeline:
            if hasattr(stage, "set_epoch"):
                stage.set_epoch(epoch)
