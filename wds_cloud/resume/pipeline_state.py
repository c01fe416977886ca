"""The resume side of a :class:`~wds_cloud.pipeline.DataPipeline`: what its state holds, how a state is loaded,
and what waits for the next pass.

A pipeline owns one :class:`PipelineResume` and calls it at three points only: when a state is taken
(``state_dict``, ``transport_state``, ``next_pass_state``), when one is loaded (``load_state_dict``: a
pipeline's own state, or a merged one), and when a pass starts (:meth:`PipelineResume.pass_start`: a merged
state's share, or a DataLoader worker's state, is applied there, in the worker).  It never takes part in
iterating: the per-sample loop is the pipeline's alone.

A pipeline's state is ``{"format", "progress": [pass, items], "stages": [[index, kind, state], ...],
"split"}``: the states of its resumable stages by position (:mod:`wds_cloud.resume.protocol`), sealed with a
checksum.  Loading checks it field by field, then as a whole (:mod:`wds_cloud.resume.pipeline_checks`), gives
each stage its own state back, and each sample source the buffered samples its shuffle held, to fetch again
first.  A merged state (:func:`wds_cloud.merge_states`) is checked when loaded and shared out when the pass
starts (:mod:`wds_cloud.resume.share_out`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

from .. import utils
from ..errors import NotResumableError, StateMismatchError
from ..io.datafile import shown
from . import elastic, handoff, pipeline_checks, share_out, wiring
from .protocol import SampleSource, is_buffering, is_resumable, next_pass_state, transport_state
from .state import (
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
)
from .wiring import StageKinds

__all__ = ["PipelineResume", "StageKinds", "refused"]


def refused(items: Iterator, problem: StateMismatchError) -> Iterator:
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


def _plain_state(stage: Any) -> Any:
    return stage.state_dict()


class PipelineResume:
    """What one pipeline needs for resume: its states taken and loaded, and what waits for its next pass
    (per-worker states, a merged state, a loaded state's checksum problem).

    The pipeline passes itself (``owner``) to each call rather than being held (a reference cycle would keep
    a pipeline, and the shards its passes hold open, alive until the garbage collector runs).  ``owner`` is read through its public face only: ``pipeline`` (the stages), ``repetitions``, ``nsamples``,
    ``equal_work``, ``shard_counts()``, ``shard_urls()``, ``set_epoch()``, ``resume_blocker()``,
    ``check_level()``, ``elastic_start()``, ``start_of_level()`` and ``apply_level_start()`` (which a subclass
    may override: a loader answers ``resume_blocker()`` for its workers).
    Progress (pass, items yielded) is the pipeline's: it is given to the methods that need it, and the
    (pass, items) a loaded state starts from is returned to it.
    """

    def __init__(self, kinds: StageKinds) -> None:
        self.kinds = kinds
        self.worker_states: Optional[dict] = None  # per-DataLoader-worker states, applied in each worker
        self.merged: Optional[dict] = None  # a merged state, shared out when the next pass begins (per worker)
        self.seal_problem: Optional[StateMismatchError] = None  # a loaded state's checksum did not match
        self._facts: Optional[tuple] = None

    def copy(self) -> PipelineResume:
        """A copy for a copy of the pipeline (``compose``): what waits is copied, not shared."""
        made = PipelineResume.__new__(PipelineResume)
        made.__dict__.update(self.__dict__)  # not copy.copy: that pickles, which looks for a DataLoader starting
        return made

    def __getstate__(self) -> dict:
        # a spawn- or forkserver-started DataLoader worker receives its dataset pickled: the pipeline in this
        # process is then handed over (see wds_cloud.resume.handoff)
        handoff.note_pickled()
        return dict(self.__dict__)

    # what the stage list says (cached while it is unchanged)
    def facts(self, owner: Any) -> tuple:
        """(stage list, resumable stages, resume blocker, splitting), computed again only when the stage list
        changed."""
        pipeline = owner.pipeline
        cached = self._facts
        if cached is not None and cached[0] == pipeline:  # list equality: identity first, element by element
            return cached
        # the kind is a label saved with each stage's state, to tell a different pipeline apart on load
        found = [(i, type(stage).__name__, stage) for i, stage in enumerate(pipeline) if is_resumable(stage)]
        holders = [(i, stage) for i, stage in enumerate(pipeline) if callable(getattr(stage, "holding", None))]
        self._facts = (list(pipeline), found, owner.resume_blocker(), self.split_kind(owner), holders)
        return self._facts

    def stateful(self, owner: Any) -> list:
        """``(index, kind, stage)`` of the stages that save state."""
        return self.facts(owner)[1]

    def feeding(self, owner: Any) -> tuple[dict, Optional[SampleSource]]:
        """See :func:`wds_cloud.resume.wiring.feeding`."""
        return wiring.feeding(owner.pipeline, self.kinds)

    def wire(self, owner: Any) -> None:
        """Tell each buffering stage (a shuffle) which sample source feeds it, so it can record where its
        samples came from (when a pass starts, and before a state is loaded)."""
        pipeline = owner.pipeline
        for i, source in self.feeding(owner)[0].items():
            pipeline[i].attach_source(source)

    def resume_blocker(self, owner: Any) -> Optional[str]:
        """See :func:`wds_cloud.resume.wiring.resume_blocker`, and :func:`~wds_cloud.resume.wiring.unplaced` (an
        :class:`~wds_cloud.resume.wiring.Unplaced` reason)."""
        return wiring.resume_blocker(owner.pipeline, self.kinds) or wiring.unplaced(owner.pipeline, self.kinds)

    def splitting(self, owner: Any) -> tuple[Optional[str], Any]:
        """See :func:`wds_cloud.resume.wiring.splitting`."""
        return wiring.splitting(owner.pipeline, self.kinds)

    def split_kind(self, owner: Any) -> Optional[str]:
        """How the shards of the shard list reach the reader (see :func:`wds_cloud.resume.wiring.splitting`)."""
        return self.splitting(owner)[0]

    # taking a state
    def state_dict(self, owner: Any, strict: bool, progress: list, begun: bool) -> dict:
        """The pipeline's sealed state; ``progress``: (pass, items) a state taken now reports, ``begun``: whether
        the pass it describes has begun.  Inexact (see the pipeline's ``state_dict``) unless ``strict``.

        Refused (NotResumableError, strict or not) when the pipeline was handed to DataLoader worker processes
        and ran no pass here since: the state would describe a pass that never ran (no trainer asks for it
        there: torchdata's loader asks in its workers, Lightning asks the loader)."""
        if handoff.handed(owner):
            reason = handoff.refusal(owner)
            try:  # a pipeline that could not take a state anyway says why first (its stage, the fix)
                self.state(owner, False, progress, begun)
            except NotResumableError as exc:
                raise NotResumableError(f"{exc}; and {reason}") from exc
            raise NotResumableError(reason)
        if self.merged is not None:  # a merged state loaded, its pass not begun: still that state
            return self.merged
        try:
            return seal(self.state(owner, False, progress, begun))
        except NotResumableError as exc:
            if strict:
                raise
            return seal(inexact_state(FORMAT, str(exc), progress=progress))

    def next_pass_state(self, owner: Any) -> dict:
        """The sealed state that starts the pipeline's next pass."""
        return seal(self.state(owner, False, [0, 0], False, next_pass=True))

    def state(
        self, owner: Any, fast: bool, progress: list, begun: bool, next_pass: bool = False, nested: bool = False
    ) -> dict:
        """The pipeline's state, not sealed; ``fast``: the stages' transport states (for a loader that asks with
        every batch); ``nested``: a part of the state of a pipeline this one is a stage of (which says where the
        pass stands: see :class:`~wds_cloud.resume.wiring.Unplaced`)."""
        facts = self.facts(owner)
        blocker = facts[2]
        if isinstance(blocker, wiring.Unplaced) and (nested or next_pass or not begun or not progress[1]):
            blocker = None  # a pass's start needs no place in it
        if blocker is not None:
            raise NotResumableError(f"this pipeline cannot save a resumable state: {blocker}")
        if next_pass or not begun:
            # iter() was called but the pass has not begun: its stages still describe the pass before
            return {
                "format": FORMAT,
                "progress": [0, 0],
                "stages": [[i, kind, next_pass_state(stage)] for i, kind, stage in facts[1]],
            }
        for i, stage in facts[4]:  # a stage holding parts of an item whose source has moved past it
            held = stage.holding()
            if held is not None:
                raise NotResumableError(
                    f"this pipeline cannot save a resumable state now: stage {i} ({wiring.stage_name(stage)}) {held}"
                )
        take = transport_state if fast else _plain_state
        stages = []
        nested_in = self.kinds.pipeline
        for i, kind, stage in facts[1]:
            try:
                if isinstance(stage, nested_in) and type(stage).state_dict is nested_in.state_dict:
                    stages.append([i, kind, stage.nested_state(fast)])  # this pipeline says where the pass stands
                    continue
                stages.append([i, kind, take(stage)])
            except NotResumableError:
                raise
            except Exception as exc:  # a stage of the user's: reported, never raised into a trainer's loop
                raise NotResumableError(
                    f"this pipeline cannot save a resumable state: stage {i} "
                    f"({wiring.stage_name(stage)}) could not take its state: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        split = facts[3]
        if split is not None:
            return {"format": FORMAT, "progress": progress, "stages": stages, "split": split}
        return {"format": FORMAT, "progress": progress, "stages": stages}

    # loading a state
    def load_state_dict(self, owner: Any, state: dict) -> Optional[list]:
        """Load a state of the pipeline's (or a merged one); returns the (pass, items) its next pass starts from
        (None: from the beginning).  A checksum problem is raised before the pass's first item (see
        :func:`refused`), after the stages' own checks, so that a changed field is named."""
        if elastic.is_merged(state):
            self.load_merged(owner, state)
            return None
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
        progress = self.load(owner, state)  # the stages check their fields first: a changed one is named
        self.seal_problem = problem
        return progress

    def load(self, owner: Any, state: dict) -> Optional[list]:
        """Load a state whose checksum was checked (or that came from a loader whose state was: a DataLoader
        worker's share of a WebLoader state); returns the (pass, items) the next pass starts from."""
        if is_inexact(state):
            restart_from(state, "pipeline")
            return None
        expect(
            state,
            "pipeline",
            dict,
            progress=(list, lambda v: len(v) == 2 and all(type(x) is int and x >= 0 for x in v), True),
            stages=list,
        )
        refuse_unknown(state, ("format", "progress", "stages", "split", SEAL), "pipeline")
        self.check_stages(owner, state["stages"])
        pipeline_checks.check_pass(owner.repetitions, (state.get("progress") or (0, 0))[0], "progress")
        pipeline_checks.check_epoch_items(owner.nsamples, (state.get("progress") or (0, 0))[1])
        self.wire(owner)
        pipeline = owner.pipeline
        for i, _, stage_state in state["stages"]:
            stage = pipeline[i]
            if isinstance(stage, self.kinds.pipeline):  # a nested pipeline's part of a state checked as a whole
                stage.load_nested_state(stage_state)
            else:
                stage.load_state_dict(stage_state)
        self._replay_buffers(owner, state["stages"])
        pipeline_checks.check_reader(self, owner, state["stages"])
        for _i, kind, stage_state in state["stages"]:
            if kind in elastic.SHARD_LISTS and isinstance(stage_state.get("assigned"), dict):
                share_out.assign_share(
                    self, owner, stage_state["assigned"]
                )  # a pass begun by an elastic resume goes on
        return list(state.get("progress") or (0, 0))

    def check_stages(self, owner: Any, stages: Any) -> None:
        """Refuse a state whose resumable stages (by position and kind) are not this pipeline's: checked where the
        state is loaded, before any worker starts (a worker's own checks would raise only at its first item)."""
        pipeline_checks.check_entries(stages)
        saved = {f"stage {i}": kind for i, kind, _ in stages}
        here = {f"stage {i}": kind for i, kind, _ in self.stateful(owner)}
        check_same(
            "pipeline (its stages differ)",
            saved,
            here,
            "Load a state into a dataset built with the same stages (shuffles, shard list, reader) as the one that "
            "saved it: a state of another pipeline (a training state loaded into a validation loader) never fits",
        )

    def _replay_buffers(self, owner: Any, stages: list) -> None:
        """Give each sample source the samples the buffering stage it feeds held, checked, to fetch again first."""
        pipeline = owner.pipeline
        feeders = self.feeding(owner)[0]
        for i, _, stage_state in stages:
            stage = pipeline[i]
            if is_buffering(stage):
                replay = stage.replay_locations(stage_state)
                if replay:
                    source = feeders.get(i)
                    if source is None:
                        raise StateMismatchError(
                            "the saved state has samples in a shuffle buffer, but no shard "
                            "reader feeds that shuffle here"
                        )
                    pipeline_checks.check_buffer(self, owner, replay, source, stages)
                    source.set_replay(pipeline_checks.trusted_replay(owner.shard_urls(), replay))

    def load_merged(self, owner: Any, state: dict) -> None:
        """Continue the epoch of a merged state (:func:`wds_cloud.merge_states`) with this process's share of its
        work, whatever the number of ranks and workers; the share is taken when the next pass begins (in each
        DataLoader worker)."""
        elastic.check_merged(state)
        owner.check_level(state["pipeline"])
        self.merged = state
        self.worker_states = None
        self.seal_problem = None

    # what waits for the next pass
    def set_worker_states(self, states: Optional[dict]) -> None:
        """States to load, one per DataLoader worker (``{worker id: state}``); None: none, and no merged state."""
        self.worker_states = states
        if states is None:
            self.merged = None

    @property
    def waiting(self) -> bool:
        """Whether per-worker states (or a merged state) wait to be loaded at the start of the next pass."""
        return self.worker_states is not None or self.merged is not None

    def pass_start(self, owner: Any, progress: Optional[list]) -> tuple[Optional[list], Optional[StateMismatchError]]:
        """When a pass starts (in the DataLoader worker): take this worker's share of a merged state, or its state,
        where one waits.  Returns the (pass, items) the pass starts from (``progress``, the pipeline's, unless a
        state was applied) and a loaded state's checksum problem, to raise before the pass's first item."""
        handoff.ran_here(owner)  # a state taken from now on describes this pass
        if self.merged is not None:
            state, self.merged = self.merged, None
            rank, world_size, worker, workers = utils.pytorch_worker_info()
            progress = share_out.apply_start(self, owner, owner.elastic_start(state, rank, world_size, worker, workers))
        if self.worker_states is not None:
            _, _, worker, _ = utils.pytorch_worker_info()
            own = self.worker_states.get(worker)
            self.worker_states = None  # applied once (a persistent worker starts the next epoch afresh)
            if own is not None and "start" in own:  # a share of an elastic resume this worker had not begun
                progress = share_out.apply_start(self, owner, own)
            elif own is not None:
                progress = self.load(owner, own)  # the loader's state it came from had its checksum checked
        problem, self.seal_problem = self.seal_problem, None
        return progress, problem
