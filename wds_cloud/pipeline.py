"""``DataPipeline``: a source followed by stages, iterated as one dataset.

The first stage is called with no argument (a shard list, a dataset, a list)
and every later stage receives the iterator of the one before.  ``with_epoch``
and ``with_length`` return the pipeline itself and keep it picklable, so
spawn-started DataLoader workers receive it intact.

``state_dict()`` / ``load_state_dict(state)`` save and restore where the most
recent iterator stands, at the last sample it yielded.  All of that is the
pipeline's resume side, :class:`~wds_cloud.resume.pipeline_state.PipelineResume`,
which the pipeline calls when a pass starts and when a state is taken or loaded,
never per sample (see :mod:`wds_cloud.resume.protocol` for how a stage takes part).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, Optional

from . import config, shardlists, utils
from .errors import ConfigError
from .io.datafile import shown
from .pytorch import DataLoader, IterableDataset
from .resume import handoff, share_out, wiring
from .resume.arguments import as_count
from .resume.pipeline_state import PipelineResume, StageKinds, refused
from .resume.protocol import SampleSource
from .stages import PipelineStage, for_pipeline
from .tar.samples import url_opener

__all__ = ["DataPipeline", "add_length_method"]


def add_length_method(obj: Any) -> Any:
    """Give ``obj`` (a DataPipeline with ``size`` set) a working ``len()``; returns ``obj``."""
    obj.enable_length()
    return obj


class DataPipeline(IterableDataset, PipelineStage):
    """A pipeline of stages; ``DataPipeline(source, stage1, stage2, ...)``."""

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
        #: (pass, samples yielded) a loaded state's next pass starts from
        self._resume_progress: Optional[list] = None
        self._resumer = PipelineResume(_KINDS)  # states taken, loaded, and waiting for the next pass
        for arg in args:
            if arg is None:
                continue
            if isinstance(arg, list):
                self.pipeline.extend(for_pipeline(stage) for stage in arg)
            else:
                self.pipeline.append(for_pipeline(arg))

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
        return self._chain()[-1]

    def _chain(self) -> list:
        """One pass through the pipeline: the iterator of each stage, the source first."""
        if not self.pipeline:
            raise ConfigError("this DataPipeline has no stages")
        self._resumer.wire(self)  # each shuffle learns which reader feeds it
        source = self.invoke(self.pipeline[0])
        chain = [source]
        for step in self.pipeline[1:]:
            source = self.invoke(step, source)
            chain.append(source)
        return chain

    def iterator(self) -> Iterator:
        """``repetitions`` passes; stops early when a pass yields nothing."""
        self._progress = [0, 0, False, False]
        return self._run(self._progress, None)

    def __iter__(self) -> Iterator:
        # a merged state's share or a DataLoader worker's state, waiting for this pass, is applied now
        resume, problem = self._resumer.pass_start(self, self._resume_progress)
        self._resume_progress = None
        limit = self.nsamples if self.repetitions != 1 and self.nsamples > 0 else None
        # at once: state_dict() may come before next(); a resumed pass is "begun" (its stages hold the state)
        self._progress = [resume[0], resume[1], True, False] if resume else [0, 0, False, False]
        items = self._run(self._progress, limit)
        return items if problem is None else refused(items, problem)

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
            chain = self._chain()
            try:
                for sample in chain[-1]:
                    produced = True
                    count += 1
                    progress[1] = count
                    yield sample
                    sample = None  # not held while the next is made (a large one is read after this is let go)
                    if limit is not None and count >= limit:
                        progress[3] = True
                        return
            except BaseException:
                # an error in a stage, or the consumer closing this pass: every stage's iterator is closed now, the
                # source too (what it holds, such as a directory queue's claimed file, is given back at once, not
                # when a collection of the traceback's frames gets to it)
                _close(chain)
                raise
            if not produced:
                break
        progress[3] = True

    # pickling (spawn-started DataLoader workers), copying, and a pipeline put in another one as a stage
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        # the stages drop their passes (see wds_cloud.stages.PassHolder): so does the pipeline, whose progress
        # counts the items of its pass (a loaded state waiting for the next pass is kept)
        state["_progress"] = [0, 0, False, False]  # not begun: a state taken from the copy starts its next pass
        # A spawned worker has no process group: it learns this rank from the pickle.
        state["_dist_hint"] = utils.torch_distributed()
        if handoff.starting_workers():  # a forkserver's worker would read the server's settings, not the program's
            state["_worker_environ"] = config.carried_environ()
        return state

    def __setstate__(self, state: dict) -> None:
        carried = state.pop("_worker_environ", None)
        if carried is not None:
            config.take_carried_environ(carried)
        hint = state.pop("_dist_hint", None)
        if hint is not None and hint[1] > 1:
            utils.inherit_distributed(*hint)
        self.__dict__.update(state)

    # resume: the pipeline's resume side (wds_cloud.resume.pipeline_state) does the work
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
        return self._resumer.state_dict(self, strict, self._current_progress(), self._pass_begun())

    def transport_state(self) -> dict:
        """:meth:`state_dict` where stages may give arrays and deltas (for a loader that sends one per batch)."""
        return self._resumer.state(self, True, self._current_progress(), self._pass_begun())

    def next_pass_state(self) -> dict:
        """The state that starts this pipeline's next pass."""
        return self._resumer.next_pass_state(self)

    def nested_state(self, fast: bool) -> dict:
        """This pipeline's state as part of a larger one (not sealed: the whole is): ``fast`` as for a loader that
        asks with every batch (see :meth:`transport_state`)."""
        return self._resumer.state(self, fast, self._current_progress(), self._pass_begun(), nested=True)

    def _current_progress(self) -> list:
        """(pass, items yielded) that a state taken now reports: a loaded state's until a pass begins."""
        progress = self._resume_progress if self._resume_progress is not None else self._progress
        return [progress[0], progress[1]]

    def _pass_begun(self) -> bool:
        """Whether the pass a state taken now describes has begun (iter() alone does not begin it)."""
        return self._resume_progress is not None or bool(self._progress[2])

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration continue where ``state`` (from :meth:`state_dict`, or a merged state from
        :func:`wds_cloud.merge_states`) stood.

        An inexact state (taken from a pipeline that cannot be resumed) is logged and makes the
        next pass start from its beginning.
        """
        progress = self._resumer.load_state_dict(self, state)
        self._resume_progress = progress

    def check_stages_of(self, state: dict) -> None:
        """Refuse (StateMismatchError) a state of this pipeline's whose stages are not this pipeline's, without
        loading it: what a loader checks in its process before its workers load their states."""
        if isinstance(state, dict) and isinstance(state.get("stages"), list):
            self._resumer.check_stages(self, state["stages"])

    def load_nested_state(self, state: dict) -> None:
        """Load a state taken with :meth:`nested_state`, as part of a larger state whose checksum was checked."""
        self._resume_progress = self._resumer.load(self, state)

    def set_worker_states(self, states: Optional[dict]) -> None:
        """States to load, one per DataLoader worker (``{worker id: state}``), each in its own worker when
        the next pass begins; None: none, and no merged state either (a loader calls this once its workers
        have started)."""
        self._resumer.set_worker_states(states)

    @property
    def has_worker_states(self) -> bool:
        """Whether per-worker states (or a merged state) wait to be loaded at the start of the next pass."""
        return self._resumer.waiting

    def resume_blocker(self) -> Optional[str]:
        """Why a state of this pipeline could not be resumed (the stage and the fix), or None; decided from the
        stage list alone (see :func:`wds_cloud.resume.wiring.resume_blocker`)."""
        return self._resumer.resume_blocker(self)

    def feeding_source(self) -> Optional[SampleSource]:
        """The sample source (shard reader) whose latest sample is this pipeline's latest output, if any."""
        return self._resumer.feeding(self)[1]

    def shard_split(self) -> Optional[str]:
        """How the shards of this pipeline's fixed shard list reach its reader: ``"nodes+workers"``,
        ``"nodes"``, ``"workers"``, ``"none"`` (every DataLoader worker reads every shard), ``"custom"`` (a
        stage of the user's in between), or None (no fixed list and reader: a resampled list draws per worker)."""
        kind, _ = wiring.splitting(self.pipeline, _KINDS)
        if kind is None or not any(isinstance(stage, shardlists.SimpleShardList) for stage in self.pipeline):
            return None
        return kind

    def shard_urls(self) -> dict:
        """The shard URLs this pipeline's shard lists name (as the program gave them), by text."""
        return wiring.shard_urls(self.pipeline, _KINDS)

    def shard_counts(self) -> Optional[dict]:
        """Samples per shard index, when the dataset knows them (``equal_work``); None here."""
        return None

    # elastic resume: a merged state shared out (wds_cloud.resume.share_out)
    def check_level(self, level: dict) -> None:
        """Refuse a merged level this pipeline could not continue (see :func:`wds_cloud.resume.share_out.check_level`)."""
        share_out.check_level(self._resumer, self, level)

    def elastic_start(self, merged: dict, rank: int, world_size: int, worker: int, workers: int) -> dict:
        """What the rank and worker given start from after loading ``merged`` (see
        :func:`wds_cloud.resume.share_out.elastic_start`)."""
        return share_out.elastic_start(self._resumer, self, merged, rank, world_size, worker, workers)

    def start_of_level(self, level: dict, rank: int, world_size: int, worker: int, workers: int) -> dict:
        """The start of one rank and worker in a merged level (see :meth:`elastic_start`)."""
        return share_out.start_of_level(self._resumer, self, level, rank, world_size, worker, workers)

    def apply_level_start(self, start: dict) -> None:
        """Take a start of this pipeline's level (:meth:`start_of_level`) for the next pass."""
        share_out.apply_level_start(self._resumer, self, start)

    def _own_resumer(self) -> None:
        """Give a copy of a pipeline (:meth:`compose`) a resume side of its own, starting as the original's."""
        self._resumer = self._resumer.copy()

    def for_pipeline(self) -> DataPipeline:
        """This pipeline as a stage of another one: a copy with stages and a resume side of its own and no pass
        (see :class:`wds_cloud.stages.PassHolder`), so that two pipelines sharing it never share a pass."""
        return self.compose()

    def __copy__(self) -> DataPipeline:
        # copy.copy(dataset): a dataset whose passes are its own, as a deep copy's are (only cheaper)
        return self.compose()

    def _stages_copied(self, copies: dict) -> None:
        """Called on a copy (:meth:`compose`) once each stage that keeps pass state was copied: ``copies`` maps
        ``id()`` of the original's stages to the copy's.  A subclass that keeps references to its stages, or
        gave them callables bound to itself, points them at the copy's here."""
        for name, value in list(self.__dict__.items()):
            made = copies.get(id(value))
            if made is not None:
                self.__dict__[name] = made

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
        """Add a stage (a stage that keeps pass state is added as a copy of this pipeline's own: see
        :class:`wds_cloud.stages.PassHolder`)."""
        self.pipeline.append(for_pipeline(f))

    def compose(self, *args: Callable) -> DataPipeline:
        """A copy of this pipeline with ``args`` appended (fluent methods return new objects); the copy has its
        own copies of the stages that keep pass state, so the original and the copy never share a pass."""
        result = type(self).__new__(type(self))
        result.__setstate__(self.__getstate__())  # as a pickle would carry it: no pass
        copies = {}
        stages = []
        for stage in self.pipeline:
            made = for_pipeline(stage)
            if made is not stage:
                copies[id(stage)] = made
            stages.append(made)
        result.pipeline = stages
        result._own_resumer()
        if copies:
            result._stages_copied(copies)
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
        if self.nsamples < 1:  # -1 or 0 would repeat the pipeline without end, and a run would never finish
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


#: the stages of the layers above resume/ that it tells apart (a nested pipeline, shard lists, our splitters)
_KINDS = StageKinds(
    pipeline=DataPipeline,
    share_lists=shardlists.SHARE_LISTS,
    resampled=shardlists.ResampledShards,
    simple=shardlists.SimpleShardList,
    split_by_node=shardlists.split_by_node,
    split_by_worker=shardlists.split_by_worker,
    single_node_only=shardlists.single_node_only,
    opens_urls=(url_opener,),
)


def _close(chain: list) -> None:
    """Close the iterators of a pass's stages that can be closed, the last stage first; an error closing one is
    not the error the pass is ending with, so it is not raised over it."""
    for iterator in reversed(chain):
        close = getattr(iterator, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # the pass ends with its own error (or GeneratorExit)
                pass
