"""Elastic resume: one state for a whole job, loadable on any number of ranks and DataLoader workers.

A per-rank state (``WebLoader.state_dict()``) says where each worker of one rank stands, in terms of
that rank's and worker's share of the shards; it fits only a loader of the same shape.
:func:`~wds_cloud.resume.merge.merge_states` turns the states of every rank (or of every worker) into one state that names no
rank or worker:

- the epoch, and the shards of its order that no worker had started (``pending``, by index);
- each shard a worker had partly read, with the byte where its next sample begins (``partial``);
- every sample held in a shuffle buffer, as byte ranges of its shard (``buffered``);
- for a mix, the same per source, and what the mix still owes (``samples_per_epoch`` left);
- with ``equal_work``, the samples the job still owes; with ``with_epoch``, the items.

Loading it (``load_state_dict(merged)`` on a dataset or a ``WebLoader`` of any shape) gives each rank
and worker a share of that work (:func:`share`): the buffered samples are dealt in equal runs, the partly
read and unstarted shards by expected size, the biggest first, each to the least loaded share.  Every
sample not yet delivered then comes exactly once, over all ranks and workers, and none that was
delivered comes again.  The order differs from the uninterrupted run's (the shuffle buffers are refilled
on another shape); ``WebDataset(streams=K)`` keeps it (see :mod:`wds_cloud.resume.streams`).

A share is recorded in the shard list's state for the rest of that epoch (``"assigned"``), so a state
taken after an elastic resume resumes on its own shape as any other, or merges again.

Every merged state is plain JSON, sealed with a checksum, and checked field by field on load: URLs are
matched against the dataset's own shard list by hash (a state never supplies one), offsets are whole
tar blocks, buffered ranges do not overlap, counts fit the dataset.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import StateMismatchError
from ..io.datafile import shown
from .order import ShardOrder
from .state import MAX_OFFSET, SEAL, check_seal, expect

__all__ = [
    "ELASTIC_FORMAT",
    "LOADER_FORMAT",
    "REPLAY_REF",
    "SHARD_LISTS",
    "KNOWN_KINDS",
    "KNOWN_SPLITS",
    "MAX_STATES",
    "MAX_ENTRIES",
    "is_merged",
    "check_merged",
    "check_share",
    "check_start",
    "share",
    "RankShare",
    "rank_share",
    "shard_split",
    "shard_order",
    "items_share",
    "resolve",
    "encode_buffered",
    "decode_buffered",
    "decode_ranges",
    "as_count",
]

#: the format tag of a merged, topology-free state
ELASTIC_FORMAT = "wds_cloud.elastic/1"
#: the format tag of a WebLoader's per-rank state
LOADER_FORMAT = "wds_cloud.loader/1"
#: shard refs of samples replayed from a merged state start here (a reader's own shards count from 0)
REPLAY_REF = 1 << 40
#: the stage kinds of a shard list whose order follows from (shards, seed, epoch)
SHARD_LISTS = ("SimpleShardList", "ResampledShards")
#: stage kinds whose states merge_states knows how to combine
KNOWN_KINDS = SHARD_LISTS + ("TarSamples", "Shuffle", "CheckEmpty", "MixSource", "Streams")
#: bounds on what a merged state may hold (it is input when loaded)
MAX_STATES = 1 << 16
MAX_ENTRIES = 1 << 24


def shard_order(n: int, seed: int, epoch: int) -> ShardOrder:
    """The shuffled order of ``n`` shards for (seed, epoch): the same on every rank and worker.  A sequence whose
    i-th value is computed when asked (see :mod:`wds_cloud.resume.order`): slicing it, ``order[rank::world]``,
    gives a view, never a list of ``n`` ints."""
    return ShardOrder(n, seed, epoch)


def is_merged(state: Any) -> bool:
    """Whether ``state`` is a merged state (:func:`merge_states`)."""
    return isinstance(state, dict) and state.get("format") == ELASTIC_FORMAT


def as_count(value: Any) -> int:
    """``value`` when it is a count (an int, not negative), else 0."""
    return value if type(value) is int and value >= 0 else 0


# ------------------------------------------------------------------------------ buffered sample lists
def encode_buffered(buffered: dict, repeats: bool = False) -> list:
    """``[[url id, shown URL, compressed, [first, blocks, gap, blocks, ...]], ...]``: per shard its samples in
    block order, each start given as the gap after the end of the one before (small numbers: a few bytes each).

    ``repeats``: the same sample may be held twice (shards drawn with replacement, ``resampled=True``); a
    repeat is written as a gap of minus its length.  Otherwise two samples that overlap are refused."""
    out = []
    for url_id in sorted(buffered):
        text, compressed, ranges = buffered[url_id]
        flat: list[int] = []
        end = 0
        previous = None
        for first, blocks in sorted(ranges):
            if first < end and not (repeats and (first, blocks) == previous):
                raise StateMismatchError(
                    f"{text}: two buffered samples overlap at block {first}: the states were "
                    "changed or overlap (the same state given twice?)",
                    field="buffer",
                )
            flat += (first - end, blocks)
            end = first + blocks
            previous = (first, blocks)
        out.append([url_id, text, bool(compressed), flat])
    return out


def decode_ranges(flat: list) -> list:
    out = []
    end = 0
    for i in range(0, len(flat) - 1, 2):
        first = end + flat[i]
        out.append((first, flat[i + 1]))
        end = first + flat[i + 1]
    return out


def _slice_buffered(entries: list, lo: int, hi: int) -> list:
    """Samples ``lo`` to ``hi`` (in list order) of an encoded list, decoding only the shards they lie in."""
    out: list = []
    seen = 0
    for url_id, text, compressed, flat in entries:
        count = len(flat) // 2
        if seen + count > lo and seen < hi:
            for number, (first, blocks) in enumerate(decode_ranges(flat), seen):
                if lo <= number < hi:
                    out.append((url_id, text, compressed, first, blocks))
        seen += count
        if seen >= hi:
            break
    return out


def decode_buffered(entries: list) -> list:
    """``(url id, shown, compressed, first block, blocks)`` of every sample of an encoded list, in order."""
    out = []
    for entry in entries:
        url_id, text, compressed, flat = entry
        for first, blocks in decode_ranges(flat):
            out.append((url_id, text, compressed, first, blocks))
    return out


# ----------------------------------------------------------------------------------------- checking
#: the fields each part of a merged state may hold (anything else is refused: no state_dict() gives it)
_FIELDS = {
    "merged": {"format", "epoch", "from", "pipeline", "loader", SEAL},
    "from": {"world_size", "num_workers"},
    "loader": {"pass", "items", "ranks"},
    "fresh": {"fresh", "epoch"},
    "level": {"kinds", "configs", "epoch", "pass", "items", "slots"},
    "shards": {
        "split",
        "shards",
        "pending",
        "partial",
        "buffered",
        "read",
        "started",
        "owed",
        "outer",
        "done",
        "delivered",
        "replays",
    },
    "mix": {"names", "pass", "count", "taken", "sources", "quota"},
    "streams": {"count", "states"},
}
#: how the shards of a pipeline are split that merge_states() and the share-out know
KNOWN_SPLITS = ("nodes+workers", "nodes", "workers", "none")


def _only(part: dict, what: str, allowed: set) -> None:
    unknown = sorted(str(k) for k in part if k not in allowed)
    if unknown:
        raise StateMismatchError(
            f"the {what} state holds {shown(unknown[0])}, a field no merge_states() gives: the state was "
            "changed; load the state that merge_states() returned",
            field=unknown[0],
        )


def check_merged(state: Any) -> None:
    """Refuse a merged state that is not one :func:`merge_states` gives (its checksum, then every field, and how
    its parts agree: the epoch of every level, the job's shape and its counts of slots and ranks)."""
    expect(state, "merged", dict, epoch=(int, lambda n: n >= 0), pipeline=dict, loader=(dict, None, True))
    check_seal(state, "merged")
    _only(state, "merged", _FIELDS["merged"])
    expect(state, "merged", dict, **{"from": dict})
    shape = state["from"]
    _only(shape, "merged", _FIELDS["from"])
    expect(
        shape,
        "merged job shape ('from')",
        dict,
        world_size=(int, lambda n: 1 <= n <= MAX_STATES),
        num_workers=(int, lambda n: 1 <= n <= 4096),
    )
    _check_level(state["pipeline"], 0, state["epoch"], shape["world_size"], shape["num_workers"])
    loader = state.get("loader")
    if loader is not None:
        _only(loader, "merged loader", _FIELDS["loader"])
        expect(
            loader,
            "merged loader",
            dict,
            **{"pass": (int, lambda n: n >= 0)},
            items=(int, lambda n: n >= 0),
            ranks=(int, lambda n: n == shape["world_size"]),
        )


def _check_level(level: Any, depth: int, epoch: int, world_size: int, workers: int) -> None:
    """Refuse a merged level (or a mix's source, ``depth`` down) whose fields are not what merge_states() gives."""
    if depth > 2:
        raise StateMismatchError("the merged state nests mixes deeper than a mix of datasets", field="mix")
    expect(level, "merged", dict, epoch=(int, lambda n: n == epoch), fresh=(bool, lambda v: v, True))
    if level.get("fresh"):
        _only(level, "merged", _FIELDS["fresh"])
        return
    part = "mix" if "mix" in level else "streams" if "streams" in level else "shards"
    _only(level, "merged", _FIELDS["level"] | ({part} if part != "shards" else _FIELDS["shards"]))
    expect(
        level,
        "merged",
        dict,
        kinds=(list, lambda v: len(v) <= 256),
        configs=dict,
        **{"pass": (int, lambda n: n >= 0)},
        items=(int, lambda n: n >= 0),
        slots=(int, lambda n: n == world_size * workers),
        mix=(dict, None, True),
        streams=(dict, None, True),
    )
    _check_kinds(level)
    streams = level.get("streams")
    if streams is not None:
        _check_streams(streams)
        return
    mix = level.get("mix")
    if mix is not None:
        _check_mix(mix, depth, epoch, world_size, workers)
        return
    _check_shards_level(level, world_size, workers)


def _check_kinds(level: dict) -> None:
    """Refuse a level's ``kinds`` and ``configs`` that are not the stages' labels and settings."""
    for kind in level["kinds"]:
        if not (isinstance(kind, list) and len(kind) == 2 and type(kind[0]) is int and isinstance(kind[1], str)):
            raise StateMismatchError(
                f"the merged state lists the stage {shown(kind)}, which merge_states() does not "
                "give: the state was changed",
                field="kinds",
            )
    if not all(isinstance(k, str) and k.isdigit() and isinstance(v, dict) for k, v in level["configs"].items()):
        raise StateMismatchError(
            "the merged state's 'configs' are not the stages' settings merge_states() gives: the state was changed",
            field="configs",
        )


def _check_streams(streams: Any) -> None:
    """Refuse a level's virtual streams part that is not what merge_states() gives."""
    _only(streams, "merged streams", _FIELDS["streams"])
    expect(streams, "merged streams", dict, count=(int, lambda n: 1 <= n <= 65536), states=list)
    streams_seen: set = set()
    for entry in streams["states"]:
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and type(entry[0]) is int
            and 0 <= entry[0] < streams["count"]
            and entry[0] not in streams_seen
            and isinstance(entry[1], dict)
        ):
            raise StateMismatchError(
                f"the merged state's streams hold {shown(entry)}, which merge_states() does "
                "not give: the state was changed",
                field="streams",
            )
        streams_seen.add(entry[0])


def _check_mix(mix: Any, depth: int, epoch: int, world_size: int, workers: int) -> None:
    """Refuse a level's mix part that is not what merge_states() gives; each source is a level of its own."""
    _only(mix, "merged mix", _FIELDS["mix"])
    expect(
        mix,
        "merged mix",
        dict,
        names=list,
        count=(int, lambda n: n >= 0),
        taken=list,
        quota=(int, lambda n: n >= 0, True),
        **{"pass": (int, lambda n: n >= 0)},
        sources=(list, lambda v: len(v) == len(mix["names"])),
    )
    for sub in mix["sources"]:
        _check_level(sub, depth + 1, epoch, world_size, workers)


def _check_shards_level(level: dict, world_size: int, workers: int) -> None:
    """Refuse a level of shards (pending, partly read, buffered) that is not what merge_states() gives."""
    expect(
        level,
        "merged",
        dict,
        shards=dict,
        pending=(list, lambda v: len(v) <= MAX_ENTRIES),
        partial=(list, lambda v: len(v) <= MAX_ENTRIES),
        buffered=(list, lambda v: len(v) <= MAX_ENTRIES),
        read=(int, lambda n: n >= 0),
        owed=(int, lambda n: n >= 0, True),
        outer=(int, lambda n: n >= 0, True),
        split=(str, lambda v: v in KNOWN_SPLITS),
    )
    _check_conservation_fields(level)
    split = level["split"]
    if ("nodes" not in split and world_size > 1) or ("workers" not in split and workers > 1):
        raise StateMismatchError(
            f"the merged state says its shards were split {split!r} over {world_size} ranks x {workers} "
            "workers, which merge_states() refuses: the state was changed",
            field="split",
        )
    n_shards = level["shards"].get("shards")
    if type(n_shards) is not int or n_shards < 1:
        raise StateMismatchError(f"the merged state's shard count is {shown(n_shards)}", field="shards")
    listed = [str(i) for i, kind in level["kinds"] if kind in SHARD_LISTS]
    if len(listed) != 1 or level["configs"].get(listed[0]) != level["shards"]:
        raise StateMismatchError(
            f"the merged state's shards {shown(level['shards'])} are not its shard list's settings: the state "
            "was changed",
            field="shards",
        )
    seen: set = set()
    for index in level["pending"]:
        if type(index) is not int or not 0 <= index < n_shards or index in seen:
            raise StateMismatchError(
                f"the merged state's 'pending' holds {shown(index)}, not a shard of the "
                f"{n_shards} (or twice): the state was changed",
                field="pending",
            )
        seen.add(index)
    for entry in level["partial"]:
        _check_partial(entry)
    repeats = level["shards"].get("kind") == "ResampledShards"
    for entry in level["buffered"]:
        _check_buffered(entry, repeats)


#: the fields that make a merged level's work checkable (an edited state could otherwise drop or add work); a
#: state merged without them is refused
_CONSERVATION = ("done", "delivered", "replays", "started")


def _check_conservation_fields(level: dict) -> None:
    missing = [name for name in _CONSERVATION if name not in level]
    if missing:
        raise StateMismatchError(
            f"the merged state has no {missing[0]!r}: it was merged by an earlier wds_cloud, whose merged states "
            "cannot be checked to hold every sample not yet delivered; take a new state_dict() of every rank "
            "(resume from the per-rank states, or from the checkpoint they were merged from) and merge it with "
            "this version",
            field=missing[0],
        )
    for name in _CONSERVATION:
        value = level[name]
        if type(value) is not int or not 0 <= value < MAX_OFFSET:
            raise StateMismatchError(
                f"the merged state's {name!r} is {shown(value)}, not a count merge_states() gives: the state was "
                "changed; load the state that merge_states() returned",
                field=name,
            )


def _check_partial(entry: Any) -> None:
    if not (
        isinstance(entry, list)
        and len(entry) == 6
        and isinstance(entry[0], str)
        and isinstance(entry[1], str)
        and type(entry[2]) is int
        and 0 < entry[2] < MAX_OFFSET  # a partial read has begun: its offset is past the first header
        and entry[2] % 512 == 0
        and (entry[3] is None or isinstance(entry[3], str))
        and isinstance(entry[4], bool)
        and isinstance(entry[5], dict)
        and len(entry[5]) <= 64
        and all(isinstance(k, str) and isinstance(v, str) for k, v in entry[5].items())
    ):
        raise StateMismatchError(
            f"the merged state's 'partial' holds {shown(entry)}, which merge_states() does not "
            "give: the state was changed",
            field="partial",
        )


def _check_buffered(entry: Any, repeats: bool = False) -> None:
    from ..io.datafile import MAX_SHARD_BLOCKS

    if not (
        isinstance(entry, list)
        and len(entry) == 4
        and isinstance(entry[0], str)
        and isinstance(entry[1], str)
        and isinstance(entry[2], bool)
        and isinstance(entry[3], list)
        and len(entry[3]) % 2 == 0
        and len(entry[3]) <= 2 * MAX_ENTRIES
    ):
        raise StateMismatchError(
            f"the merged state's 'buffered' holds {shown(entry)}, which merge_states() does not "
            "give: the state was changed",
            field="buffered",
        )
    flat = entry[3]
    lengths = flat[1::2]
    if not flat or (
        set(map(type, flat)) == {int}
        and min(flat[0::2]) >= 0
        and min(lengths) > 0
        and max(lengths) <= MAX_SHARD_BLOCKS
        and sum(flat) <= MAX_SHARD_BLOCKS  # gaps are not negative: the end only grows, to the sum
    ):
        return  # every pair is one the loop below accepts, found without a Python step per sample
    end = 0
    last = 0
    for i in range(0, len(flat), 2):
        gap, blocks = flat[i], flat[i + 1]
        repeat = repeats and i and type(gap) is int and gap == -last and blocks == last
        if not (type(gap) is int and type(blocks) is int and (gap >= 0 or repeat) and 0 < blocks <= MAX_SHARD_BLOCKS):
            raise StateMismatchError(
                f"the merged state's buffered samples of {entry[1]!r} hold {shown([gap, blocks])}: "
                "the state was changed",
                field="buffered",
            )
        end += gap + blocks
        last = blocks
        if end > MAX_SHARD_BLOCKS:
            raise StateMismatchError(
                f"the merged state's buffered samples of {entry[1]!r} lie beyond any shard: the state was changed",
                field="buffered",
            )


def check_share(record: Any, n_shards: int, repeats: bool = False) -> None:
    """Refuse a share (a shard list's ``"assigned"``, or one :func:`share` made) that does not fit ``n_shards``.

    ``partial_at`` and ``replay_at`` (optional: shares made before them lack them) give the index in the shard list
    of each partly read shard and of each shard with buffered samples, so that a worker finds them without hashing
    every URL of the list; they are checked against the URL hashes where they are used."""
    expect(
        record,
        "elastic share",
        dict,
        epoch=(int, lambda n: n >= 0),
        replay=(list, lambda v: len(v) <= MAX_ENTRIES),
        partial=(list, lambda v: len(v) <= MAX_ENTRIES),
        pending=(list, lambda v: len(v) <= n_shards),
        limit=(int, lambda n: n >= 0, True),
        items=(list, None, True),
        done=(int, lambda n: 0 <= n <= n_shards, True),
    )
    if len(set(map(repr, record["pending"]))) != len(record["pending"]) or not all(
        type(i) is int and 0 <= i < n_shards for i in record["pending"]
    ):
        raise StateMismatchError(
            f"the saved share's 'pending' holds {shown(record['pending'])}, not distinct shards of "
            f"the {n_shards}: the state was changed",
            field="pending",
        )
    for entry in record["partial"]:
        _check_partial(entry)
    for entry in record["replay"]:
        _check_buffered(entry, repeats)
    for name, listed in (("partial_at", "partial"), ("replay_at", "replay")):
        hints = record.get(name)
        if hints is not None and not (
            isinstance(hints, list)
            and len(hints) == len(record[listed])
            and all(type(i) is int and 0 <= i < n_shards for i in hints)
        ):
            raise StateMismatchError(
                f"the saved share's {name!r} is {shown(hints)}, not the index of each of its {len(record[listed])} "
                f"{listed!r} shards among the {n_shards}: the state was changed",
                field=name,
            )


def check_start(state: Any) -> None:
    """Refuse a start (a worker's share of a merged state, see ``DataPipeline.elastic_start``) of the wrong shape;
    the shares inside are checked where they are taken."""
    expect(
        state,
        "elastic start",
        dict,
        start=dict,
        epoch=(int, lambda n: n >= 0),
        progress=(list, lambda v: len(v) == 2 and all(type(x) is int and x >= 0 for x in v)),
    )
    _check_level_start(state["start"], 0)


def _check_level_start(start: Any, depth: int) -> None:
    if depth > 2:
        raise StateMismatchError("a saved start nests mixes deeper than a mix of datasets", field="start")
    expect(
        start,
        "elastic start",
        dict,
        epoch=(int, lambda n: n >= 0),
        share=(dict, None, True),
        mix=(dict, None, True),
        streams=(list, lambda v: len(v) <= 65536, True),
        fresh=(bool, None, True),
    )
    if sum(key in start for key in ("share", "mix", "streams", "fresh")) != 1:
        raise StateMismatchError(
            f"the saved start {shown(start)} is not one a merged state gives: the state was changed", field="start"
        )
    if "mix" in start:
        sources = start["mix"].get("sources")
        if not isinstance(sources, list) or len(sources) > 4096:
            raise StateMismatchError("a saved mix start holds no list of its sources' starts", field="mix")
        for source in sources:
            _check_level_start(source, depth + 1)
    if "streams" in start:
        seen: set = set()
        for entry in start["streams"]:
            if not (
                isinstance(entry, list)
                and len(entry) == 2
                and type(entry[0]) is int
                and entry[0] >= 0
                and entry[0] not in seen
                and isinstance(entry[1], dict)
            ):
                raise StateMismatchError(f"a saved streams start lists {shown(entry)}", field="streams")
            seen.add(entry[0])


# ------------------------------------------------------------------------------------------ sharing
def shard_split(split: Any, world_size: int, workers: int, rank: int, worker: int) -> tuple[int, int]:
    """(slot, slots) of a rank and worker among the shares a pipeline's splitting (``split``) makes."""
    nodes = split in ("nodes+workers", "nodes")
    by_worker = split in ("nodes+workers", "workers")
    ranks = world_size if nodes else 1
    per = workers if by_worker else 1
    return (rank if nodes else 0) * per + (worker if by_worker else 0), ranks * per


@dataclass(frozen=True)
class RankShare:
    """The shares of one rank's ``per`` slots (its DataLoader workers) in a merged level, from which :func:`share`
    gives each worker its own without looking at the whole level again.

    Computing it (:func:`rank_share`) is the one pass over the whole job a load makes in a process: it deals every
    partly read and unstarted shard of the job over all its slots; a worker's share is then taken from it in time
    linear in that share."""

    #: the rank's first slot, and its number of slots
    first: int
    per: int
    #: the buffered samples of the whole level (their runs are cut at ``total * slot // slots``)
    total: int
    #: the number of the first sample of ``buffered`` in the whole level's list
    start: int
    #: ``(url id, shown, compressed, first block, blocks)`` of the rank's slots' runs of buffered samples, in order
    buffered: list
    #: per slot of the rank: ``(kind, item, position)`` of the partly read (``"p"``: an entry of ``partial``) and
    #: unstarted (``"i"``: a shard index) shards dealt to it; ``position``: the entry's place in the level's list
    units: list


def rank_share(level: dict, rank: int, ranks: int, per: int = 1, counts: Optional[dict] = None) -> RankShare:
    """The shares of the ``per`` slots of ``rank`` of ``ranks`` in a merged level: to each slot of the job an equal
    run of the buffered samples (in shard order, so a run reads adjacent bytes), then the partly read and unstarted
    shards dealt, the biggest expected first, each to the slot with the least expected work (``counts``: samples
    per shard index when an index gives them, else every shard counts as the average the workers read, a partly
    read one as half).  Deterministic: every process computes the same."""
    slots = ranks * per
    first = rank * per
    entries = level.get("buffered") or []
    total = sum(len(entry[3]) // 2 for entry in entries)
    lo, hi = total * first // slots, total * (first + per) // slots
    if counts:
        average = max(1.0, sum(counts.values()) / max(1, len(counts)))
    else:  # the samples of a shard, as far as the workers read
        average = max(1.0, as_count(level.get("read")) / max(1, as_count(level.get("started"))))
    partial = level.get("partial") or ()
    # (-weight, tie, kind, item, position): the biggest first; of one weight, partly read shards before unstarted
    # ones, each in its list's order
    units: list = [(-(average / 2), number, "p", entry, number) for number, entry in enumerate(partial)]
    for position, index in enumerate(level.get("pending") or ()):
        weight = float(counts.get(index, average)) if counts else average
        units.append((-weight, len(partial) + 2 * position, "i", index, position))
    units.sort(key=lambda u: (u[0], u[1]))
    heap = [(float(total * (s + 1) // slots - total * s // slots), s) for s in range(slots)]
    heapq.heapify(heap)
    mine: list = [[] for _ in range(per)]
    for weight, _, kind, item, position in units:
        load, owner = heapq.heappop(heap)
        heapq.heappush(heap, (load - weight, owner))
        if first <= owner < first + per:
            mine[owner - first].append((kind, item, position))
    return RankShare(first, per, total, lo, _slice_buffered(entries, lo, hi), mine)


def share(
    level: dict,
    slot: int,
    slots: int,
    counts: Optional[dict] = None,
    limit_mode: Any = None,
    per: int = 1,
    part: Optional[RankShare] = None,
) -> dict:
    """The work of ``slot`` of ``slots`` from a merged level: ``{"epoch", "replay", "partial", "pending", "limit",
    "done"}`` (what the shard list records as ``"assigned"``).

    Deterministic: every rank and worker computes its own share from the same state and they add up to the
    whole.  Buffered samples are cut into ``slots`` runs of equal length; then partly read and unstarted shards
    go, the biggest expected first, to the share with the least expected work (see :func:`rank_share`, which
    deals them for the ``per`` slots of one rank at once; ``part``: what it gave for this slot's rank).
    """
    if part is None:
        part = rank_share(level, slot // per, slots // per, per, counts)
    total = part.total
    lo, hi = total * slot // slots - part.start, total * (slot + 1) // slots - part.start
    limit = None
    owed = level.get("owed")
    if owed is not None and limit_mode is not None:
        limit = owed // slots if limit_mode != "max" else -(-owed // slots)
    mine = part.buffered[lo:hi]
    if limit is not None and len(mine) > limit:  # equal_work: a share never holds more than its count
        mine = mine[:limit]
    partial: list = []
    pending: list = []
    for kind, item, position in part.units[slot - part.first]:
        (partial if kind == "p" else pending).append((position, item))
    replay: dict = {}
    for url_id, text, compressed, first, blocks in mine:
        replay.setdefault(url_id, [text, compressed, []])[2].append((first, blocks))
    repeats = isinstance(level.get("shards"), dict) and level["shards"].get("kind") == "ResampledShards"
    return {
        "epoch": level["epoch"],
        "replay": encode_buffered(replay, repeats),
        "partial": [item for _, item in sorted(partial, key=lambda p: p[0])],
        "pending": [item for _, item in sorted(pending, key=lambda p: p[0])],
        "limit": limit,
        "done": level.get("done", 0),  # the shards done before the shares: a later merge_states adds them up
    }


def items_share(done: int, old_slots: int, per_slot: int, slot: int, slots: int) -> int:
    """How many items ``slot`` of ``slots`` still yields when each of ``old_slots`` had to yield ``per_slot`` and
    ``done`` were yielded (``with_epoch`` after an elastic resume): the same for every slot (so that DDP ranks
    make the same number of steps), rounded down (fewer than ``slots`` items of the epoch are left out)."""
    return max(0, old_slots * per_slot - done) // slots


def resolve(entries: Iterable[Any], by_id: dict, what: str) -> list:
    """The URLs of a share's entries, from the shard list (by hash): a state never supplies a URL."""
    out = []
    for entry in entries:
        url = by_id.get(entry[0])
        if url is None:
            raise StateMismatchError(
                f"the merged state names the shard {entry[1]!r}, which this dataset's shard list "
                f"does not ({what}): load a state merged from a job over the same shards",
                url=entry[1],
                field=what,
            )
        out.append(url)
    return out
