"""A merged state shared out on a pipeline of another shape: checked, cut into one start per rank and worker,
and applied to the stages when that worker's next pass begins.

:func:`check_level` refuses a merged level that was not taken from a pipeline like this one (or that it
could not share out exactly); :func:`elastic_start` is what one rank and worker start from (computed the same
in every process, and kept as that worker's state until it delivers); :func:`apply_start` gives it to the
stages: a mix's start to the mix, virtual streams' to the streams, else the share of shards and buffered
samples (:func:`wds_cloud.resume.elastic.share`) to the shard list and the reader (:func:`assign_share`).

``resume`` is the pipeline's :class:`~wds_cloud.resume.pipeline_state.PipelineResume`; the share-out rules
themselves are :mod:`wds_cloud.resume.elastic`'s.

What a load costs at 4,096 ranks x 8 workers: the whole job is looked at once per process.  The process that
loads a merged state checks it (:func:`check_level`: every URL of the shard list hashed once, to match the
state's shards) and keeps where the level's shards are in the shard list (:func:`level_plan`); the first start
it computes deals the job's shards over every slot once and keeps the shares of this rank's slots
(:func:`rank_part`, :func:`elastic.rank_share`).  Each worker's start is then taken from them in time linear in
it, and names the index in the shard list of each shard it holds (``partial_at``, ``replay_at``), so the worker
that applies it hashes only its own shards' URLs.  A ``WebLoader`` computes its workers' starts in the main
process, and they travel to the workers (forked or spawned) with the dataset.  A dataset loaded outside a
``WebLoader`` learns its number of DataLoader workers only in them, so there each worker deals the job once.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import StateMismatchError
from ..io.datafile import shown
from . import consistency, elastic
from .pipeline_checks import check_pass
from .protocol import next_pass_state
from .state import check_same, shown_url, url_id
from .wiring import stage_name

__all__ = [
    "check_level",
    "elastic_start",
    "start_of_level",
    "apply_start",
    "apply_level_start",
    "assign_share",
    "level_plan",
    "rank_part",
    "LevelPlan",
]


def check_level(resume: Any, owner: Any, level: dict) -> None:
    """Refuse a merged level that was not taken from a pipeline like this one, naming what differs, or whose
    fields do not agree with each other and with this pipeline's shards (see :mod:`wds_cloud.resume.consistency`),
    or that this pipeline could not share out exactly (its shards split by a stage of the user's)."""
    if level.get("fresh"):
        return
    check_pass(owner.repetitions, level["pass"], "pass")
    if owner.repetitions != 1 and owner.nsamples > 0 and level["items"] > level["slots"] * owner.nsamples:
        raise StateMismatchError(
            f"the merged state says its {level['slots']} ranks x workers yielded {level['items']} items in "
            f"this pass, more than with_epoch({owner.nsamples}) lets each: the state was changed; load the "
            "state that merge_states() returned",
            field="items",
        )
    here = [[i, kind] for i, kind, _ in resume.stateful(owner)]
    if level["kinds"] != here:
        check_same(
            "pipeline (its stages differ)",
            {f"stage {i}": k for i, k in level["kinds"]},
            {f"stage {i}": k for i, k in here},
        )
    stages = dict((i, stage) for i, _, stage in resume.stateful(owner))
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
        share_split(resume, owner)
        shard_list = share_list(resume, owner)
        urls = shard_list.urls
        repeats = isinstance(shard_list, resume.kinds.resampled)
        equal_work = getattr(owner, "equal_work", None)
        laps = level.get("owed") is not None and equal_work != "min"
        index_of = _index_of(urls)  # the one hash of every URL this process makes for this state
        consistency.check_work(level, urls, repeats=repeats, laps=repeats or laps, index_of=index_of)
        consistency.check_owed(level, equal_work, owner.shard_counts(), len(urls))
        consistency.check_counts(level, repeats)
        # where the level's shards are in the shard list, kept for the starts this process computes (see level_plan)
        level_plan(resume, owner, level, index_of)


def share_list(resume: Any, owner: Any) -> Any:
    """The shard list a merged state's shards are shared out from (refused when this pipeline has none)."""
    pipeline = owner.pipeline
    shard_list = next((s for s in pipeline if isinstance(s, resume.kinds.share_lists)), None)
    reader = next((s for s in pipeline if callable(getattr(s, "set_elastic", None))), None)
    if shard_list is None or reader is None:
        raise StateMismatchError(
            "the merged state holds shards, but this pipeline has no shard list (SimpleShardList, "
            "ResampledShards) and shard reader to read them: load it into a dataset like the one it was "
            "taken from",
            field="stages",
        )
    return shard_list


def share_split(resume: Any, owner: Any, world_size: int = 1, workers: int = 1) -> str:
    """How this pipeline splits its shards, when a merged state can be shared out by it on ``world_size`` ranks
    x ``workers`` DataLoader workers; else StateMismatchError naming the stage and the fix.

    A share is computed for our splitting (split_by_node, split_by_worker, single_node_only): a splitter of
    the user's would split the shares again (shards lost) while the buffered samples, replayed by the
    reader, came once per rank (delivered several times), and one that does not split at all gives every rank all of it."""
    split, stage = resume.splitting(owner)
    if split == "custom":
        raise StateMismatchError(
            f"this pipeline's shards are split by {stage_name(stage)} ({shown(stage)}), a stage of its own "
            "between the shard list and the reader, so a merged state cannot be shared out exactly (its "
            "buffered samples would come once per rank): split with nodesplitter=wds.split_by_node and the "
            "default workersplitter (wds.split_by_worker), which split the same way",
            field="split",
        )
    if split is None:
        share_list(resume, owner)
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


def elastic_start(resume: Any, owner: Any, merged: dict, rank: int, world_size: int, worker: int, workers: int) -> dict:
    """What the rank and worker given start from after loading ``merged``: a *start*, a worker state of its
    own kind (``{"start": ...}``), kept as that worker's state until it delivers (so that a state taken
    before then still holds its share).  Deterministic: every process computes the same."""
    level = merged["pipeline"]
    start = owner.start_of_level(level, rank, world_size, worker, workers)
    slot, slots = rank * workers + worker, world_size * workers
    passes = level.get("pass", 0)
    items = 0
    if owner.repetitions != 1 and owner.nsamples > 0 and not level.get("fresh"):
        items = max(
            0, owner.nsamples - elastic.items_share(level["items"], level["slots"], owner.nsamples, slot, slots)
        )
    return {"start": start, "epoch": merged["epoch"], "progress": [passes, items]}


def start_of_level(resume: Any, owner: Any, level: dict, rank: int, world_size: int, worker: int, workers: int) -> dict:
    """The start of one rank and worker in a merged level (see :func:`elastic_start`)."""
    head = {
        "epoch": level["epoch"],
        "kinds": level.get("kinds"),
        "configs": level.get("configs"),
        "split": level.get("split"),
    }
    if level.get("fresh"):
        return {"fresh": True, **head}
    stages = [stage for _, _, stage in resume.stateful(owner)]
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
    split = share_split(resume, owner, world_size, workers)
    slot, slots = elastic.shard_split(split, world_size, workers, rank, worker)
    rank_slot, ranks = elastic.shard_split(split, world_size, 1, rank, 0)  # the rank's place among those split over
    part, at = rank_part(resume, owner, level, rank_slot, ranks, slots // ranks)
    mode = getattr(owner, "equal_work", None) if level.get("owed") is not None else None
    record = elastic.share(level, slot, slots, None, mode, per=slots // ranks, part=part)
    record["partial_at"] = _indices(record["partial"], at, "partial")
    record["replay_at"] = _indices(record["replay"], at, "buffered")
    return {"share": record, **head}


@dataclass
class LevelPlan:
    """What this process worked out of one merged level for one pipeline, once (see :func:`rank_part`)."""

    #: the pipeline it was worked out for (its shard list and shard counts), weakly
    owner: Any
    #: facts of the level, checked on each use beside its identity (see :func:`_fingerprint`)
    fingerprint: tuple
    #: url id -> index in the shard list, of each partly read shard and each shard with buffered samples
    at: dict
    #: the shares of a rank's slots (:func:`elastic.rank_share`), by (rank, ranks, slots per rank)
    parts: dict = field(default_factory=dict)


#: the plans of this process, by (level identity, pipeline identity); the newest last
_PLANS: OrderedDict = OrderedDict()
#: how many are kept: one per level of a state (a mix has one per source) of the few states a process loads
_PLANS_HELD = 64
_PLANS_LOCK = threading.Lock()


def level_plan(resume: Any, owner: Any, level: dict, index_of: Optional[dict] = None) -> LevelPlan:
    """This process's plan of a merged level for this pipeline: made once (``index_of``: URL hash -> index of the
    shard list, when made already; else every URL is hashed once here) and kept by the level's identity and a
    fingerprint of it (a merged state is not changed once loaded; the fingerprint catches another state given the
    same address) and by the pipeline's."""
    key = (id(level), id(owner))
    fingerprint = _fingerprint(level)
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is not None and plan.owner() is owner and plan.fingerprint == fingerprint:
            _PLANS.move_to_end(key)
            return plan
    if index_of is None:
        index_of = _index_of(share_list(resume, owner).urls)
    ids = [entry[0] for entry in level.get("partial") or ()] + [entry[0] for entry in level.get("buffered") or ()]
    plan = LevelPlan(_weak(owner), fingerprint, {i: index_of[i] for i in ids if i in index_of})
    if plan.owner is not None:
        with _PLANS_LOCK:
            _PLANS[key] = plan
            while len(_PLANS) > _PLANS_HELD:
                _PLANS.popitem(last=False)
    return plan


def rank_part(resume: Any, owner: Any, level: dict, rank: int, ranks: int, per: int) -> tuple[elastic.RankShare, dict]:
    """(the shares of the ``per`` slots of ``rank`` of ``ranks``, dealt once per process: the one pass over the
    whole job a load makes; the plan's ``at``)."""
    plan = level_plan(resume, owner, level)
    part = plan.parts.get((rank, ranks, per))
    if part is None:
        counts = owner.shard_counts() if level.get("owed") is not None else None
        part = plan.parts[(rank, ranks, per)] = elastic.rank_share(level, rank, ranks, per, counts)
    return part, plan.at


def _weak(owner: Any) -> Any:
    """A weak reference to ``owner`` (a pipeline that cannot have one is never kept: see :func:`rank_part`)."""
    try:
        return weakref.ref(owner)
    except TypeError:
        return None


def _fingerprint(level: dict) -> tuple:
    """What tells two merged levels apart in constant time: their counts, the sizes of their lists, and the first
    and last entry of each (two states of one job differ in what was read and delivered)."""
    facts: list = [level.get(k) for k in ("epoch", "pass", "items", "slots", "read", "started", "done", "owed")]
    facts += [level.get(k) for k in ("delivered", "replays", "split")]
    for name in ("pending", "partial", "buffered"):
        listed = level.get(name) or ()
        facts.append(len(listed))
        if listed:
            facts += [_head(listed[0]), _head(listed[-1])]
    return tuple(facts)


def _head(entry: Any) -> Any:
    """An entry of a level's list as a fingerprint holds it, in constant time: a shard index, or the first fields
    of a partly read shard or of a shard's buffered samples (and how many numbers its ranges hold)."""
    if not isinstance(entry, list):
        return repr(entry)[:200]
    ranges = entry[3] if len(entry) > 3 else None
    return repr(entry[:3])[:400], len(ranges) if isinstance(ranges, list) else repr(ranges)[:200]


def _index_of(urls: Any) -> dict:
    """URL hash -> index of every shard of a shard list: one hash per URL."""
    return {url_id(u): i for i, u in enumerate(urls)}


def _indices(entries: list, at: dict, what: str) -> list:
    """The index in the shard list of each entry's shard (the rank part's ``at``), refused when the list has none."""
    out = []
    for entry in entries:
        index = at.get(entry[0])
        if index is None:
            raise StateMismatchError(
                f"the merged state names the shard {entry[1]!r}, which this dataset's shard list does not ({what}): "
                "load a state merged from a job over the same shards",
                url=entry[1],
                field=what,
            )
        out.append(index)
    return out


def apply_start(resume: Any, owner: Any, state: dict) -> list:
    """Make the next pass begin from a start (:func:`elastic_start`); returns the (pass, items) it begins at."""
    elastic.check_start(state)
    owner.set_epoch(state["epoch"])
    owner.apply_level_start(state["start"])
    return list(state["progress"])


def apply_level_start(resume: Any, owner: Any, start: dict) -> None:
    """Take a start of this pipeline's level (:func:`start_of_level`) for the next pass."""
    if start.get("fresh"):
        return
    stages = [stage for _, _, stage in resume.stateful(owner)]
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
        assign_share(resume, owner, start["share"])


def assign_share(resume: Any, owner: Any, record: dict) -> None:
    """Make the next pass read the share ``record`` (see :func:`wds_cloud.resume.elastic.share`): its buffered
    samples, then its partly read shards from their saved bytes, then its unstarted shards."""
    shard_list = share_list(resume, owner)
    pipeline = owner.pipeline
    reader = next(s for s in pipeline if callable(getattr(s, "set_elastic", None)))
    urls = shard_list.urls
    repeats = isinstance(shard_list, resume.kinds.resampled)
    elastic.check_share(record, len(urls), repeats=repeats)
    index_of = _share_index(record, urls)
    consistency.check_work(
        record,
        urls,
        repeats=repeats,
        laps=repeats or (record.get("limit") is not None and getattr(owner, "equal_work", None) != "min"),
        buffered="replay",
        what="saved elastic share",
        index_of=index_of,
    )
    by_id = {uid: urls[index] for uid, index in index_of.items()}
    items, replays = _share_items(record, urls, by_id), _share_replays(record, by_id)  # both checked, then given
    shard_list.assign(record, items)
    reader.set_elastic(replays, record.get("limit"))
    for stage in pipeline:
        if callable(getattr(stage, "on_elastic_resume", None)):
            stage.on_elastic_resume()


def _share_index(record: dict, urls: Any) -> dict:
    """URL hash -> index in the shard list of the shards a share names, from its ``partial_at`` and ``replay_at``
    (each checked: the URL there has that hash), hashing only those URLs; a share made before them: every URL's."""
    partial_at, replay_at = record.get("partial_at"), record.get("replay_at")
    if partial_at is None or replay_at is None:
        return _index_of(urls)
    out: dict = {}
    for entries, at in ((record["partial"], partial_at), (record["replay"], replay_at)):
        for entry, index in zip(entries, at):
            if url_id(urls[index]) != entry[0]:
                raise StateMismatchError(
                    f"the saved elastic share says the shard {entry[1]!r} is shard {index} of the shard list, which "
                    "holds another URL there: the state was changed (or comes from another dataset); load the state "
                    "that state_dict() returned",
                    url=entry[1],
                    field="partial_at" if entries is record["partial"] else "replay_at",
                )
            out[entry[0]] = index
    return out


def _share_items(record: dict, urls: list, by_id: dict) -> list:
    """The shard items of a share: its partly read shards (from their saved bytes), then its unstarted ones."""
    items: list[dict[str, Any]] = [
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
    return items


def _share_replays(record: dict, by_id: dict) -> list:
    """``(url, start, end, compressed)`` of a share's buffered samples, in order."""
    replays: list[tuple] = []
    for entry in record["replay"]:
        url = elastic.resolve([entry], by_id, "buffered")[0]
        replays += [
            (url, first * 512, (first + blocks) * 512, entry[2]) for first, blocks in elastic.decode_ranges(entry[3])
        ]
    return replays
