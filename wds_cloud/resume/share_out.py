"""A merged state shared out on a pipeline of another shape: checked, cut into one start per rank and worker,
and applied to the stages when that worker's next pass begins.

:func:`check_level` refuses a merged level that was not taken from a pipeline like this one (or that it
could not share out exactly); :func:`elastic_start` is what one rank and worker start from (computed the same
in every process, and kept as that worker's state until it delivers); :func:`apply_start` gives it to the
stages: a mix's start to the mix, virtual streams' to the streams, else the share of shards and buffered
samples (:func:`wds_cloud.resume.elastic.share`) to the shard list and the reader (:func:`assign_share`).

``resume`` is the pipeline's :class:`~wds_cloud.resume.pipeline_state.PipelineResume`; the share-out rules
themselves are :mod:`wds_cloud.resume.elastic`'s.
"""

from __future__ import annotations

from typing import Any

from ..errors import StateMismatchError
from ..io.datafile import shown
from . import consistency, elastic
from .pipeline_checks import check_pass
from .protocol import next_pass_state
from .state import check_same, shown_url, url_id
from .wiring import stage_name

__all__ = ["check_level", "elastic_start", "start_of_level", "apply_start", "apply_level_start", "assign_share"]


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
        consistency.check_work(level, urls, repeats=repeats, laps=repeats or laps)
        consistency.check_owed(level, equal_work, owner.shard_counts(), len(urls))
        consistency.check_counts(level, repeats)


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
    reader, came once per rank (issue 41), and one that does not split at all gives every rank all of it."""
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
    counts = owner.shard_counts() if level.get("owed") is not None else None
    mode = getattr(owner, "equal_work", None) if level.get("owed") is not None else None
    return {"share": elastic.share(level, slot, slots, counts, mode), **head}


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
    consistency.check_work(
        record,
        urls,
        repeats=repeats,
        laps=repeats or (record.get("limit") is not None and getattr(owner, "equal_work", None) != "min"),
        buffered="replay",
        what="saved elastic share",
    )
    by_id = {url_id(u): u for u in urls}
    items, replays = _share_items(record, urls, by_id), _share_replays(record, by_id)  # both checked, then given
    shard_list.assign(record, items)
    reader.set_elastic(replays, record.get("limit"))
    for stage in pipeline:
        if callable(getattr(stage, "on_elastic_resume", None)):
            stage.on_elastic_resume()


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
