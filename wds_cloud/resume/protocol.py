"""The protocol a pipeline stage implements to take part in resume.

A stage is :class:`Resumable` when it has ``state_dict()`` and
``load_state_dict(state)``; ``DataPipeline.state_dict()`` gathers the states of
its resumable stages, by position, and gives each its own back on load.  Two
more methods are optional, with public names, and called only when present:

``next_pass_state()``
    The state that starts the stage's *next* pass.  Asked when a state is
    taken after ``iter()`` but before the first item of a new pass (torchdata's
    loader does this); without it, ``state_dict()`` is used.
``transport_state()``
    A state for a loader that asks with every batch and ships it between
    processes: it may hold ``array``\\ s or deltas, as long as ``state_dict()``
    of the main process can be rebuilt from it.  Without it, ``state_dict()``.

A stage that holds items across steps and cannot say where they came from sets
``resumable = False``: the pipeline still iterates as before, and only asking it
for a state raises :class:`~wds_cloud.errors.NotResumableError` naming the stage.

Some stage of a pipeline must keep where a pass stands, or a state taken inside the
pass could only start it again (such a state is refused: see
:func:`~wds_cloud.resume.wiring.unplaced`): a sample source, a resumable first stage
(unless it sets ``keeps_place = False``, as the shard lists do: they keep the pass's
shard order, and the reader keeps which shards were read, and where), or a stage that
sets ``keeps_place = True`` (virtual streams, which hold readers of their own).
A resumable stage between a sample source and the shuffle it feeds must pass every
sample through unchanged and say so (``passes_every_sample = True``): the shuffle's
buffered samples go through it again on resume.

The built-in shard reader and shuffle play two further roles, declared here so
that the pipeline wires them by what they do, never by their class names:
a :class:`SampleSource` knows the shard and byte range of each sample it
yields and can yield given ranges again; a :class:`BufferingStage` keeps
samples across steps and saves them as such ranges, so it must be fed by a
``SampleSource`` of the same pipeline.

How resume is laid out (the pipeline and the shard reader read like webdataset's; each owns a resume
side that it calls when a pass starts and when a state is taken or loaded, never per sample):

- :mod:`~wds_cloud.resume.pipeline_state`: a ``DataPipeline``'s resume side, ``PipelineResume``: what a
  pipeline's state holds (the states of its resumable stages by position), loading one, and what waits
  for the next pass (a DataLoader worker's state, a merged state's share, a checksum problem);
- :mod:`~wds_cloud.resume.wiring`: which sample source feeds each buffering stage, what blocks resume,
  how the shards reach the reader, read from the stage list alone;
- :mod:`~wds_cloud.resume.pipeline_checks`: a loaded state checked against its pipeline (an edited state is refused);
- :mod:`~wds_cloud.resume.reader_state`: the shard reader's resume side, ``ReaderResume``, and the cursor
  that says where its pass stands; :mod:`~wds_cloud.resume.refetch` fetches buffered samples again;
- :mod:`~wds_cloud.resume.shuffle` and :mod:`~wds_cloud.resume.rng`: the resumable shuffle, the counted RNG;
- :mod:`~wds_cloud.resume.order`: an epoch's seeded shard order, computed a position at a time (never held);
- :mod:`~wds_cloud.resume.state`: the state format, the checksum, field checks;
  :mod:`~wds_cloud.resume.consistency`: a state's fields proven consistent with each other;
- :mod:`~wds_cloud.resume.merge` (states of every rank merged into one), :mod:`~wds_cloud.resume.elastic`
  (the share-out rules) and :mod:`~wds_cloud.resume.share_out` (a merged state checked and shared out on a
  pipeline of another shape); :mod:`~wds_cloud.resume.streams`: virtual streams (order kept on any shape);
- :mod:`~wds_cloud.resume.loader`: a ``WebLoader``'s per-worker states; :mod:`~wds_cloud.resume.views`: the one
  bounded walk that hands the memoryviews of ``zero_copy=True`` batches over as bytes, at any depth.

Where a pass's state lives: a pipeline runs a copy of its own of every stateful built-in stage
(:class:`~wds_cloud.stages.PassHolder`): the live pass (a reader's cursor, a shuffle's buffer) and what waits for the
next pass belong to that copy, never to the stage object the user holds, and pickles and copies carry no live pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Protocol, runtime_checkable

__all__ = [
    "Resumable",
    "SampleSource",
    "BufferingStage",
    "is_resumable",
    "declines_resume",
    "next_pass_state",
    "transport_state",
    "is_source",
    "is_buffering",
    "keeps_place",
]


@runtime_checkable
class Resumable(Protocol):
    """A stage that can save where it stands and continue from there (see the module docstring)."""

    def state_dict(self) -> dict:
        """Where the stage stands at the last item it yielded: plain JSON (dicts, lists, str, int, float, bool)."""

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass continue from ``state``; check it (a state is input) and raise
        :class:`~wds_cloud.errors.StateMismatchError` naming the field that does not fit."""


@runtime_checkable
class SampleSource(Resumable, Protocol):
    """A stage whose samples are byte ranges of shards, which it can fetch again.

    ``cursor`` tells where the sample last yielded came from (``shard``: its index among
    this worker's shards, ``url``, ``compressed``, ``where``: ``[start, end, samples, next
    member]``); it is read per sample by a buffering stage, so it is an attribute.
    """

    cursor: Any

    def set_replay(self, locations: Sequence[tuple]) -> None:
        """Yield the samples at ``locations`` (``(url, start, end, compressed, ref)``) first on the next pass."""


@runtime_checkable
class BufferingStage(Resumable, Protocol):
    """A stage that keeps samples across steps and saves them as locations in their shards."""

    def attach_source(self, source: Optional[SampleSource]) -> None:
        """Tell the stage which sample source feeds it directly (None: none does)."""

    def replay_locations(self, state: dict) -> list:
        """``(url, start, end, compressed, ref)`` of the samples buffered in ``state``, in buffer order."""

    def resume_blocker(self, feeder: str) -> str:
        """Why this stage cannot be resumed when no sample source feeds it (``feeder`` says what does)."""


_ROLES: dict[type, tuple[bool, bool, bool]] = {}


def _roles(stage: Any) -> tuple[bool, bool, bool]:
    """(is a SampleSource, is a BufferingStage, is Resumable), found once per class: a runtime protocol
    check costs about 12 us, and pipelines ask per pass for every stage."""
    cls = type(stage)
    roles = _ROLES.get(cls)
    if roles is None:
        roles = (isinstance(stage, SampleSource), isinstance(stage, BufferingStage), isinstance(stage, Resumable))
        if not hasattr(cls, "__getattr__"):  # a proxy's instances may differ: asked each time
            _ROLES[cls] = roles
    return roles


def is_source(stage: Any) -> bool:
    """Whether ``stage`` is a :class:`SampleSource` (its class implements the role)."""
    return _roles(stage)[0]


def is_buffering(stage: Any) -> bool:
    """Whether ``stage`` is a :class:`BufferingStage` (its class implements the role)."""
    return _roles(stage)[1]


def is_resumable(stage: Any) -> bool:
    """Whether ``stage`` takes part in resume (it implements :class:`Resumable` and does not decline)."""
    return _roles(stage)[2] and getattr(stage, "resumable", True) is not False


def declines_resume(stage: Any) -> bool:
    """Whether ``stage`` says it cannot be resumed (``resumable = False``)."""
    return getattr(stage, "resumable", True) is False


def next_pass_state(stage: Any) -> dict:
    """``stage.next_pass_state()`` where it has one, else ``stage.state_dict()``."""
    method = getattr(stage, "next_pass_state", None)
    return method() if method is not None else stage.state_dict()


def transport_state(stage: Any) -> Any:
    """``stage.transport_state()`` where it has one, else ``stage.state_dict()``."""
    method = getattr(stage, "transport_state", None)
    return method() if method is not None else stage.state_dict()


def keeps_place(stage: Any) -> bool:
    """Whether ``stage`` keeps where a pass stands: it is resumable, buffers no items of a source's (a shuffle
    saves its buffer, not the place), and does not say ``keeps_place = False`` (a shard list)."""
    return is_resumable(stage) and not is_buffering(stage) and getattr(stage, "keeps_place", True) is not False
