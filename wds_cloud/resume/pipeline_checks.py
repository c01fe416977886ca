"""Load-time checks of a pipeline's state against the pipeline it is loaded into (its checksum proves only that it was not damaged: anyone can compute it again after an edit).

A state is input: each stage checks its own fields, and these check what the stages' states say together,
and with the pipeline's own shards, before any sample is read: the pass the state stands in, the entries
naming the stages, a shard reader's ``done`` and sample count against its shuffle, the buffered samples
against what its reader could have read (:mod:`wds_cloud.resume.consistency`), and every URL a buffered
sample names against the pipeline's shard list (:func:`trusted_replay`).

``resume`` is the pipeline's :class:`~wds_cloud.resume.pipeline_state.PipelineResume`, ``owner`` the pipeline.
"""

from __future__ import annotations

from typing import Any, Optional

from ..errors import StateMismatchError, redact
from ..io.datafile import shown
from ..io.security import untrusted
from . import consistency, elastic
from .protocol import is_buffering
from .state import shown_url, url_id
from .wiring import reader_index

__all__ = ["check_entries", "check_pass", "check_reader", "check_buffer", "worker_shards", "trusted_replay"]


def check_entries(entries: list) -> None:
    """Refuse a ``stages`` list whose entries are not ``[index, kind, state]`` as ``state_dict()`` gives them,
    or that lists a stage twice."""
    seen: set = set()
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int and isinstance(entry[1], str)):
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


def check_epoch_items(nsamples: int, yielded: int) -> None:
    """Refuse a saved count of items yielded this pass beyond what ``with_epoch(nsamples)`` makes a pass."""
    if nsamples > 0 and yielded > nsamples:
        raise StateMismatchError(
            f"the saved state says {yielded} items of this pass were yielded, but with_epoch({nsamples}) "
            "makes a pass of fewer: the state was changed (or comes from a pipeline with a longer epoch)",
            field="progress",
        )


def check_pass(repetitions: int, number: int, field: str) -> None:
    """Refuse a saved pass a pipeline of ``repetitions`` passes never reaches (``repeat(n)``: passes 0 to n-1; one
    pass without ``repeat``/``with_epoch``): resuming there would yield nothing more, silently."""
    if number >= repetitions:
        raise StateMismatchError(
            f"the saved state stands in pass {number} of this pipeline, which makes {repetitions} "
            f"pass{'es' if repetitions != 1 else ''} (repeat()/with_epoch()): the state was changed (or "
            "comes from a pipeline repeated more often); load the state that state_dict() returned",
            field=field,
        )


def check_reader(resume: Any, owner: Any, stages: list) -> None:
    """Refuse a shard reader's state that its own pipeline's other fields contradict (an edited state): ``done`` before
    the last of the worker's shards of this pass (without a sample limit that stops a pass early), or a
    count of samples read that is not the samples the shuffle right after it drew plus those it holds
    (a buffered sample removed, or one already delivered added)."""
    pipeline = owner.pipeline
    index = reader_index(pipeline)
    reader = next((st for i, _, st in stages if i == index), None)
    if index is None or not isinstance(reader, dict) or reader.get("fresh"):
        return
    listed = next((st for _, kind, st in stages if kind in elastic.SHARD_LISTS), None)
    share = listed.get("assigned") if isinstance(listed, dict) else None
    if reader.get("done") and reader.get("limit") is None and not isinstance(share, dict):
        items = worker_shards(resume, owner, listed, reader, None)
        if items is not None and reader["shard"] < len(items) - 1:
            raise StateMismatchError(
                f"the saved shard reader state says it is done with shard {reader['shard']} of this worker's "
                f"{len(items)} shards of the pass: the state was changed; load the state that state_dict() "
                "returned",
                field="done",
            )
    following = index + 1  # the shuffle the reader feeds, past stages that pass every sample on unchanged
    while following < len(pipeline) and getattr(pipeline[following], "passes_every_sample", False):
        following += 1
    after = next((st for i, _, st in stages if i == following), None)
    if not (isinstance(after, dict) and is_buffering(pipeline[following])) or after.get("fresh"):
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


def check_buffer(resume: Any, owner: Any, replay: list, source: Any, stages: list) -> None:
    """Refuse buffered samples that the state's own reader could not have read (see
    :func:`wds_cloud.resume.consistency.check_buffer`): only a reader of this pipeline's is held to it."""
    index = next((i for i, stage in enumerate(owner.pipeline) if stage is source), None)
    reader = next((st for i, _, st in stages if i == index), None)
    if index is None or not callable(getattr(source, "set_elastic", None)) or not isinstance(reader, dict):
        return  # a source of the user's (or a nested pipeline's): its refs mean what it says
    listed = next((st for _, kind, st in stages if kind in elastic.SHARD_LISTS), None)
    share = listed.get("assigned") if isinstance(listed, dict) else None
    consistency.check_buffer(replay, reader, worker_shards(resume, owner, listed, reader, share), share)


def worker_shards(resume: Any, owner: Any, listed: Optional[dict], reader: dict, share: Any) -> Optional[list]:
    """The URLs of the shards the worker that saved ``reader`` read in its pass, in order (its elastic share, or
    its split of the epoch's order), or None when that cannot be known here."""
    kinds = resume.kinds
    shard_list = next((s for s in owner.pipeline if isinstance(s, kinds.share_lists)), None)
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
    if not isinstance(shard_list, kinds.simple) or type(epoch) is not int or epoch < 0:
        return None
    seed = shard_list.seed
    order = elastic.shard_order(len(urls), seed, epoch) if seed is not None else list(range(len(urls)))
    mine = consistency.slot_items(order, resume.split_kind(owner), reader.get("identity"), elastic.shard_split)
    return None if mine is None else [urls[i] for i in mine]


def trusted_replay(known: dict, replay: list) -> list:
    """The replay locations with their URLs taken from the shard list (``known``: the pipeline's shard URLs by
    text), never from the state.

    A state is data: a URL in it that the shard list does not name is refused (it could name
    any file or a ``pipe:`` command); without a shard list to check against, it is marked
    untrusted, so a ``pipe:`` one runs only with ``WDS_ALLOW_UNTRUSTED_PIPES=1``.
    """
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
