"""How a pipeline's stages take part in resume, read from the stage list alone (never by iterating).

Which sample source feeds each buffering stage (:func:`feeding`), what keeps a pipeline's state from being
resumed (:func:`resume_blocker`), and how the shards of its shard list reach its reader (:func:`splitting`).
The stages are told apart by the roles they implement (:mod:`wds_cloud.resume.protocol`); the shard lists
and splitters, which live above ``resume/`` on the data path, by identity with those in ``kinds``
(:class:`StageKinds`, given by :mod:`wds_cloud.pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from .protocol import SampleSource, declines_resume, is_buffering, is_resumable, is_source, keeps_place

__all__ = [
    "StageKinds",
    "Unplaced",
    "stage_name",
    "feeding",
    "resume_blocker",
    "unplaced",
    "splitting",
    "reader_index",
    "shard_urls",
]


class Unplaced(str):
    """A reason (see :func:`unplaced`) that no stage of a pipeline keeps where its pass stands: it blocks a state
    taken inside a pass, not one at a pass's start, nor the state of a pipeline nested in one that places it (a
    shard list feeding the outer pipeline's reader)."""


@dataclass(frozen=True)
class StageKinds:
    """The stages of the layers above ``resume/`` that resume tells apart: a nested pipeline, the shard lists a
    merged state's shards are shared out from, and our splitters (matched by identity: a wrapper of the user's,
    a ``functools.partial`` or a lambda calling ours, may split otherwise)."""

    pipeline: Any  # (Any: a class whose instances have the pipeline's methods, which resume/ cannot import)
    share_lists: tuple
    resampled: type
    simple: type
    split_by_node: Callable
    split_by_worker: Callable
    single_node_only: Callable
    #: webdataset's stage that opens shard URLs (the reader of a pipeline composed by hand from its stages)
    opens_urls: tuple = ()


def stage_name(stage: Any) -> str:
    """A short human name for a pipeline stage (for messages)."""
    f = getattr(stage, "f", None)
    if f is not None and callable(f):  # a curried filter: name the function it runs
        name = getattr(f, "__name__", None) or type(f).__name__
        return name.lstrip("_")
    if isinstance(stage, type) or callable(stage) and hasattr(stage, "__name__"):
        return f"function {stage.__name__}" if not isinstance(stage, type) else stage.__name__
    return type(stage).__name__


def feeding(stages: Sequence, kinds: StageKinds) -> tuple[dict, Optional[SampleSource]]:
    """({index of each buffering stage: the sample source feeding it, or None}, the source feeding the output).

    The one walk over the stages that wiring, ``feeding_source``, :func:`resume_blocker` and loading share: a
    buffering stage's items are no reader's latest, so it ends a source's reach; a nested pipeline passes on
    the source feeding its output.
    """
    feeders: dict[int, Optional[SampleSource]] = {}
    source = None
    for i, stage in enumerate(stages):
        if is_buffering(stage):
            feeders[i], source = source, None
        elif isinstance(stage, kinds.pipeline):
            source = stage.feeding_source()
        elif is_source(stage):
            source = stage if getattr(stage, "replayable", True) else None
    return feeders, source


def resume_blocker(stages: Sequence, kinds: StageKinds) -> Optional[str]:
    """Why a state of a pipeline of ``stages`` could not be resumed (the stage and the fix), or None.

    A buffering stage (a sample shuffle) must be fed by a sample source of this pipeline
    (``tarfile_to_samples()``, or ``WebDataset``), since its buffered samples are saved as
    byte ranges of their shards; a stage that sets ``resumable = False`` blocks it too.
    """
    feeders = feeding(stages, kinds)[0]
    replayed = _replayed_through(stages, kinds)
    for i, stage in enumerate(stages):
        if i in replayed:
            return replayed[i]
        if declines_resume(stage):
            return (
                f"stage {i} ({stage_name(stage)}) declares that it cannot be resumed (resumable = False); "
                "implement state_dict()/load_state_dict() on it (see wds_cloud.Resumable) or leave it out"
            )
        if i in feeders and feeders[i] is None:
            return _unfed(stages, i)
        if isinstance(stage, kinds.pipeline):
            inner = stage.resume_blocker()
            if inner is not None and not isinstance(inner, Unplaced):  # where the pass stands: the outer's to say
                return f"stage {i} (a nested DataPipeline): {inner}"
        elif is_resumable(stage):  # a mix: each of its datasets is resumed on its own, and must be resumable
            for j, dataset in enumerate(getattr(stage, "datasets", None) or ()):
                inner = dataset.resume_blocker() if isinstance(dataset, kinds.pipeline) else None
                if inner is not None:
                    why = f"stage {i} ({stage_name(stage)}): its dataset {j}: {inner}"
                    return Unplaced(why) if isinstance(inner, Unplaced) else why
    return None


def unplaced(stages: Sequence, kinds: StageKinds) -> Optional[Unplaced]:
    """Why no stage of ``stages`` keeps where a pass stands (so that a state taken inside it could only start it
    again), or None: one does.  A shard reader keeps it (a sample source), and so do virtual streams and mixes
    (their readers: they say ``keeps_place = True``), a nested pipeline that can be resumed on its own, and a first
    stage that implements ``state_dict``/``load_state_dict`` (a source of the user's: see
    :func:`~wds_cloud.resume.protocol.keeps_place`); a stateful stage later on (a filter that counts) does not; a
    shard list keeps
    only the pass's shard order (the reader keeps which shards were read, and where), a shuffle its buffer, and a
    generator, a list or webdataset's stages composed by hand (``url_opener``, ``tar_file_expander``,
    ``group_by_keys``) nothing."""
    by_hand = any(s is f for s in stages for f in kinds.opens_urls)  # webdataset's stages composed by hand
    for i, stage in enumerate(stages):
        if isinstance(stage, kinds.pipeline):
            if stage.resume_blocker() is None:
                return None
        elif is_source(stage) or getattr(stage, "keeps_place", None) is True:
            return None
        elif i == 0 and keeps_place(stage) and not by_hand:
            return None  # a source of the user's (a place kept in shard URLs that url_opener opens is a shard's)
    first = stages[0] if stages else None
    why = (
        f"no stage keeps where its pass stands (its source, stage 0, is {stage_name(first)}, and no shard reader "
        "follows it), so a state taken inside a pass could only start it again"
    )
    if isinstance(first, kinds.share_lists) or by_hand:
        return Unplaced(
            f"{why}; read the shards with tarfile_to_samples() (or WebDataset), not url_opener, tar_file_expander "
            "and group_by_keys composed by hand"
        )
    return Unplaced(
        f"{why}; make the source a stage that implements state_dict() and load_state_dict() (a class whose "
        "__call__() yields the samples: see 'A source of your own' in docs/stages.md), or read shards with "
        "WebDataset or tarfile_to_samples()"
    )


def _replayed_through(stages: Sequence, kinds: StageKinds) -> dict:
    """{index of a stage: why it blocks resume} for each resumable stage between a sample source and the shuffle
    it feeds that does not pass every sample through unchanged (``passes_every_sample``): a shuffle's buffered
    samples are fetched again on resume and go through it a second time, which a stage that counts or drops
    samples (``slice``, a filter of the user's with a state) takes as new ones."""
    found: dict = {}
    source_at = None
    for i, stage in enumerate(stages):
        if is_buffering(stage):
            if source_at is not None:
                for k in range(source_at + 1, i):
                    between = stages[k]
                    passes = getattr(between, "passes_every_sample", None)  # False: said to drop some at random
                    if passes is False or (is_resumable(between) and not passes):
                        found.setdefault(
                            k,
                            f"stage {k} ({stage_name(between)}) keeps a state (or draws at random) between the "
                            f"shard reader (stage {source_at}) and the shuffle at stage {i}: on resume the "
                            "shuffle's buffered samples are read again and pass through it a second time, so it "
                            "would count (or draw for) them twice. Put it after the shuffle, or give it no state",
                        )
            source_at = None
        elif isinstance(stage, kinds.pipeline):
            source_at = i if stage.feeding_source() is not None else None
        elif is_source(stage):
            source_at = i
    return found


def _unfed(stages: Sequence, i: int) -> str:
    """Why buffering stage ``i``, fed by no sample source, blocks resume."""
    stage = stages[i]
    if i == 0:
        feeder = "it is the source"
    elif is_buffering(stages[i - 1]):
        feeder = f"it takes its items from another shuffle (stage {i - 1})"
    else:
        feeder = f"it takes its items from stage {i - 1} ({stage_name(stages[i - 1])})"
    fix = getattr(stages[i - 1], "shuffle_after_fix", None) if i > 0 else None
    if fix:  # the stage before knows the fix that fits it (a mix: a shuffle per source)
        return (
            f"stage {i} ({stage_name(stage)}): {feeder}, so the items in its buffer could not be "
            f"fetched again on resume. To make the pipeline resumable, {fix}"
        )
    return f"stage {i} {stage.resume_blocker(feeder)}"


def reader_index(stages: Sequence) -> Optional[int]:
    """The index of the shard reader (the stage an elastic share is given to), or None."""
    return next((i for i, stage in enumerate(stages) if callable(getattr(stage, "set_elastic", None))), None)


def splitting(stages: Sequence, kinds: StageKinds) -> tuple[Optional[str], Any]:
    """(how the shards of the shard list reach the reader, the first stage of the user's in between or None).

    The first is ``"nodes+workers"``, ``"nodes"``, ``"workers"``, ``"none"`` (every worker reads every shard),
    ``"custom"`` (a stage of the user's in between), or None (no shard list and reader).
    """
    start = next((i for i, s in enumerate(stages) if isinstance(s, kinds.share_lists)), None)
    if start is None:
        return None, None
    end = next((i for i in range(start + 1, len(stages)) if callable(getattr(stages[i], "set_elastic", None))), None)
    if end is None:  # webdataset's stages composed by hand: the shards reach the one that opens them
        end = next((i for i in range(start + 1, len(stages)) if any(stages[i] is f for f in kinds.opens_urls)), None)
    if end is None:
        return None, None
    nodes = workers = False
    for stage in stages[start + 1 : end]:
        # identity, not equality: a wrapper (functools.partial, a lambda calling ours) may split otherwise
        if stage is kinds.split_by_node:
            nodes = True
        elif stage is kinds.split_by_worker:
            workers = True
        elif stage is not kinds.single_node_only and not getattr(stage, "keeps_shards", False):
            return "custom", stage
    kind = {(True, True): "nodes+workers", (True, False): "nodes", (False, True): "workers"}.get(
        (nodes, workers), "none"
    )
    return kind, None


def shard_urls(stages: Sequence, kinds: StageKinds) -> dict:
    """The shard URLs the shard lists among ``stages`` name (as the program gave them), by text: the only URLs
    a state's buffered samples may name (see :func:`wds_cloud.resume.pipeline_checks.trusted_replay`)."""
    urls: dict = {}
    for stage in stages:
        if isinstance(stage, kinds.pipeline):
            urls.update(stage.shard_urls())
        elif isinstance(getattr(stage, "urls", None), list):
            urls.update((str(u), u) for u in stage.urls)
        elif callable(getattr(stage, "shard_urls", None)):  # a stage over datasets of its own (a mix)
            urls.update(stage.shard_urls())
    return urls
