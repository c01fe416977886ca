"""``merge_states``: the states of every rank (or worker) of a job made into one state that names none.

What a merged state holds, how it is shared out on load and how it is checked: :mod:`wds_cloud.resume.elastic`.
This module reads the per-rank and per-worker states (and the *starts* of workers that had not begun
the share an earlier elastic resume gave them) and gathers, pipeline level by pipeline level, the
unstarted shards, the partly read ones, the buffered samples, and a mix's or equal_work's accounts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from ..errors import StateMismatchError
from ..io.datafile import shown
from .elastic import (
    ELASTIC_FORMAT,
    KNOWN_KINDS,
    LOADER_FORMAT,
    MAX_STATES,
    SHARD_LISTS,
    as_count,
    check_start,
    decode_buffered,
    decode_ranges,
    encode_buffered,
    is_merged,
    shard_order,
    shard_split,
)
from .state import FORMAT, check_seal, expect, is_inexact, seal
from .streams import STREAMS_KIND

__all__ = ["merge_states"]


def merge_states(states: Sequence[dict]) -> dict:
    """One state that any number of ranks and DataLoader workers can load, from the states of a whole job.

    ``states``: the ``WebLoader.state_dict()`` of every rank, or the dataset ``state_dict()`` of every rank
    and worker (as torchdata's ``StatefulDataLoader`` keeps them), all taken at the same step.  Raises
    :class:`~wds_cloud.errors.StateMismatchError` naming what is missing or does not agree (a rank left
    out, two epochs, another dataset, a changed state).
    """
    if isinstance(states, dict):
        states = [states]
    if not isinstance(states, (list, tuple)) or not states:
        raise StateMismatchError(
            "merge_states() takes a list of the states of every rank (WebLoader.state_dict()) "
            "or of every rank and worker (dataset.state_dict())",
            field="states",
        )
    if len(states) > MAX_STATES:
        raise StateMismatchError(
            f"merge_states() was given {len(states)} states, more than {MAX_STATES}", field="states"
        )
    slots, world_size, num_workers, epoch, loader = _slots(states)
    level = _merge_level([(slot, state) for slot, state in enumerate(slots)], world_size, num_workers, epoch)
    merged = {
        "format": ELASTIC_FORMAT,
        "epoch": epoch,
        "from": {"world_size": world_size, "num_workers": num_workers},
        "pipeline": level,
    }
    if loader is not None:
        merged["loader"] = loader
    return seal(merged)


def _nothing_read(progress: Any) -> bool:
    """Whether a loader state's progress (``[repetition, items]``) says its pass has read nothing."""
    return isinstance(progress, list) and len(progress) == 2 and progress[1] == 0


def _slots(states: Sequence[Any]) -> tuple[list, int, int, int, Optional[dict]]:
    """(pipeline state or None of every slot ``rank * workers + worker``, world size, workers, epoch, loader part)."""
    per: dict[int, list] = {}  # rank -> [world size, workers, epoch, {worker: state}, loader progress or None]
    shape: Optional[tuple] = None
    for number, state in enumerate(states):
        what = f"state {number}"
        if not isinstance(state, dict):
            raise StateMismatchError(
                f"{what} is a {type(state).__name__}, not a state_dict(): pass the dicts that state_dict() returned",
                field="states",
            )
        if is_merged(state):
            raise StateMismatchError(
                f"{what} is already merged: load it as it is (load_state_dict accepts it on any shape)", field="format"
            )
        if is_inexact(state):
            raise StateMismatchError(
                f"{what} cannot be resumed exactly ({str(state['inexact'])[:300]}), so no merged "
                "state can be made from it; make the pipeline resumable (see resume_blocker())",
                field="inexact",
            )
        fmt = state.get("format")
        if fmt == LOADER_FORMAT:
            check_seal(state, "WebLoader")
            rank, world_size, workers, epoch, entries, progress = _loader_slots(state, what, len(states))
        elif fmt == FORMAT:
            check_seal(state, "pipeline")
            rank, world_size, worker, workers = _identity(state, what, len(states))
            epoch = _epoch_of(state)
            entries, progress = {worker: state}, None
        else:
            raise StateMismatchError(
                f"{what} is not a WebLoader or dataset state (format {shown(fmt)}): pass the "
                "dicts that state_dict() returned",
                field="format",
            )
        if shape is None:
            shape = (world_size, workers)
        elif shape != (world_size, workers):
            raise StateMismatchError(
                f"{what} was taken on {world_size} ranks x {workers} workers, state 0 on "
                f"{shape[0]} x {shape[1]}: merge the states of one job, taken at one step",
                field="world_size",
            )
        entry = per.setdefault(rank, [epoch, {}, progress])
        if entry[0] is None:
            entry[0] = epoch
        elif epoch is not None and entry[0] != epoch:
            raise StateMismatchError(
                f"{what} (rank {rank}) is in epoch {epoch}, another state of that rank in epoch {entry[0]}",
                field="epoch",
            )
        for worker, pipeline_state in entries.items():
            if worker in entry[1]:
                raise StateMismatchError(f"{what}: rank {rank} worker {worker} is given twice", field="states")
            entry[1][worker] = pipeline_state
        if progress is not None:
            entry[2] = progress
    assert shape is not None
    world_size, workers = shape
    missing = [rank for rank in range(world_size) if rank not in per]
    if missing:
        raise StateMismatchError(
            f"the states name {world_size} ranks but none of rank(s) {_few(missing)} was "
            "given: merge the states of every rank (state_dict(gather=True) gathers them)",
            field="rank",
            missing=missing,
        )
    epochs = {rank: entry[0] for rank, entry in per.items() if entry[0] is not None}
    if len(set(epochs.values())) > 1:
        first = min(epochs.values())
        # a rank whose share of the epoch ran out stands at the start of its next pass, nothing read
        ended = [r for r, e in sorted(epochs.items()) if e == first + 1 and _nothing_read(per[r][2])]
        later = [r for r, e in epochs.items() if e != first and r not in ended]
        why = (
            f": rank(s) {_few(ended)} had come to the end of their share of epoch {first} (a state taken after "
            f"the iterator ended is at the start of epoch {first + 1}) while the others' states are still in epoch "
            f"{first}. States merge within one epoch: take them before a rank's share runs out (give every rank "
            "the same number of samples, with_epoch(n)); where every rank has read its whole share, take each "
            f"state after its iterator has ended, all then at the start of epoch {first + 1}"
            if ended and not later
            else ": take every rank's state at the same step"
        )
        raise StateMismatchError(
            "the ranks' states are in different epochs ("
            + ", ".join(f"rank {r}: {e}" for r, e in sorted(epochs.items())[:8])
            + ")"
            + why,
            field="epoch",
        )
    epoch = next(iter(epochs.values()), 0)
    loader_states = [entry[2] for _, entry in sorted(per.items())]
    loader = None
    if all(p is not None for p in loader_states):
        passes = {p[0] for p in loader_states}
        if len(passes) > 1:
            raise StateMismatchError(
                f"the ranks' loaders are in different passes ({sorted(passes)[:8]}): take every "
                "rank's state at the same step",
                field="progress",
            )
        loader = {"pass": passes.pop(), "items": sum(p[1] for p in loader_states), "ranks": world_size}
    by_rank_worker = [per[rank][1].get(worker) for rank in range(world_size) for worker in range(workers)]
    if loader is None:
        absent = [i for i, s in enumerate(by_rank_worker) if s is None]
        if absent:
            raise StateMismatchError(
                f"no state was given for rank {absent[0] // workers} worker {absent[0] % workers}"
                f"{' (and ' + str(len(absent) - 1) + ' more)' if len(absent) > 1 else ''}: merge the dataset states "
                "of every rank and worker, or the WebLoader states of every rank",
                field="worker",
            )
    return by_rank_worker, world_size, workers, epoch, loader


def _few(items: list) -> str:
    return ", ".join(str(i) for i in items[:8]) + (f" and {len(items) - 8} more" if len(items) > 8 else "")


def _loader_slots(state: dict, what: str, count: int) -> tuple:
    expect(
        state,
        "WebLoader",
        dict,
        num_workers=(int, lambda n: 0 <= n <= 4096),
        epoch=(int, lambda n: n >= 0),
        workers=(
            list,
            lambda v: all(
                isinstance(e, (list, tuple)) and len(e) == 2 and type(e[0]) is int and isinstance(e[1], dict) for e in v
            ),
        ),
        progress=(list, lambda v: len(v) == 2 and all(type(x) is int and x >= 0 for x in v), True),
        rank=(int, lambda n: n >= 0, True),
        world_size=(int, lambda n: 1 <= n <= MAX_STATES, True),
    )
    rank, world_size = state.get("rank"), state.get("world_size")
    if rank is None or world_size is None:
        if count > 1:
            raise StateMismatchError(
                f"{what} does not say which rank took it (a state of an older wds_cloud): take "
                "the states again with this version",
                field="rank",
            )
        rank, world_size = 0, 1
    if rank >= world_size:
        raise StateMismatchError(f"{what} says rank {rank} of {world_size}: the state was changed", field="rank")
    workers = max(1, state["num_workers"])
    entries = {}
    for worker, pipeline_state in state["workers"]:
        if not 0 <= worker < workers:
            raise StateMismatchError(
                f"{what} names worker {worker} of a loader with {workers}: the state was changed", field="workers"
            )
        if "start" in pipeline_state:  # the share of an earlier elastic resume, not begun: all of it is left
            check_start(pipeline_state)
            pipeline_state = dict(pipeline_state["start"], progress=pipeline_state["progress"])
        entries[worker] = pipeline_state
    return rank, world_size, workers, state["epoch"], entries, list(state.get("progress") or (0, 0))


def _identity(state: dict, what: str, count: int) -> tuple[int, int, int, int]:
    for entry in state.get("stages") or ():  # virtual streams: the state names its worker among all of them
        if isinstance(entry, list) and len(entry) == 3 and entry[1] == "Streams" and isinstance(entry[2], dict):
            slot = entry[2].get("slot")
            if (
                isinstance(slot, list)
                and len(slot) == 2
                and all(type(v) is int for v in slot)
                and 0 <= slot[0] < slot[1] <= MAX_STATES * 4096
            ):
                return slot[0], slot[1], 0, 1
    found = _find_identity(state, 0)
    if found is None:
        if count > 1:
            raise StateMismatchError(
                f"{what} does not say which rank and worker took it (its pass had not begun): "
                "merge WebLoader states, or take the dataset states after an item",
                field="identity",
            )
        return 0, 1, 0, 1
    try:
        rank, world_size, worker, workers = (found[k] for k in ("rank", "world_size", "worker", "num_workers"))
    except KeyError:
        raise StateMismatchError(
            f"{what}: the reader's identity {shown(found)} is not one state_dict() gives", field="identity"
        ) from None
    if not all(type(v) is int for v in (rank, world_size, worker, workers)) or not (
        0 <= rank < world_size <= MAX_STATES and 0 <= worker < workers <= 4096
    ):
        raise StateMismatchError(
            f"{what}: the reader's identity {shown(found)} is not one state_dict() gives", field="identity"
        )
    return rank, world_size, worker, workers


def _find_identity(state: Any, depth: int) -> Optional[dict]:
    if depth > 8 or not isinstance(state, dict):
        return None
    if isinstance(state.get("identity"), dict):
        return state["identity"]
    for entry in state.get("stages") or ():
        if isinstance(entry, list) and len(entry) == 3:
            found = _find_identity(entry[2], depth + 1)
            if found is not None:
                return found
    for source in state.get("sources") or ():
        found = _find_identity(source, depth + 1)
        if found is not None:
            return found
    return None


def _epoch_of(state: dict) -> Optional[int]:
    for entry in state.get("stages") or ():
        if isinstance(entry, list) and len(entry) == 3 and entry[1] in SHARD_LISTS and isinstance(entry[2], dict):
            epoch = entry[2].get("epoch")
            return epoch if type(epoch) is int and epoch >= 0 else None
        if isinstance(entry, list) and len(entry) == 3 and entry[1] == "MixSource" and isinstance(entry[2], dict):
            for source in entry[2].get("sources") or ():
                if isinstance(source, dict):
                    return _epoch_of(source)
    return None


class _Level:
    """What the slots of one pipeline (a dataset, or a source of a mix) leave, gathered slot by slot."""

    def __init__(self) -> None:
        self.pending: dict[int, int] = {}  # shard index -> its position in the order (to keep the order)
        self.partial: list = []
        self.buffered: dict[str, list] = {}  # url id -> [shown, compressed, [(first, blocks), ...]]
        self.read = 0
        self.items = 0
        self.started = 0  # shards begun (to estimate the samples of a shard)
        self.held = 0  # samples read but held in shuffle buffers (delivered later)
        self.done = 0  # shards of the epoch read to their end (or left by a limit) in this generation
        self.replays = 0  # buffered samples of an earlier elastic resume's shares not yet replayed
        self.carried: set = set()  # shards done before the shares of an earlier elastic resume (each share says)
        self.limits: set = set()


def _is_start(state: Any) -> bool:
    """Whether a slot's entry is a start (the share of an earlier elastic resume it had not begun)."""
    return isinstance(state, dict) and "stages" not in state


def _merge_level(entries: list, world_size: int, workers: int, epoch: int) -> dict:
    """The merged state of one pipeline from ``(slot, pipeline state, start or None)`` of every slot."""
    started = [(slot, state) for slot, state in entries if state is not None and not state.get("fresh")]
    if not started:
        return {"fresh": True, "epoch": epoch}
    states = [(slot, state) for slot, state in started if not _is_start(state)]
    ref_slot, reference = (states or started)[0]
    kinds = _kinds(reference, ref_slot)
    for slot, state in started:
        other = _kinds(state, slot)
        if other != kinds:
            raise StateMismatchError(
                f"the states of slot {ref_slot} and slot {slot} have other stages ({kinds} vs "
                f"{other}): merge the states of one job",
                field="stages",
            )
    unknown = [f"stage {i} ({kind})" for i, kind in kinds if kind not in KNOWN_KINDS]
    if unknown:
        raise StateMismatchError(
            f"merge_states() cannot split the state of {', '.join(unknown)} over another number "
            "of ranks and workers (only shard lists, shard readers, shuffles and mixes): load the "
            "per-rank states on the same shape instead",
            field="stages",
        )
    passes = {tuple(state.get("progress") or (0, 0))[0] for _, state in started}
    passes = {p for p in passes if type(p) is int} or {0}
    if len(passes) > 1:
        raise StateMismatchError(
            f"the workers are in different passes of the pipeline ({sorted(passes)[:8]}; "
            "repeat()/with_epoch): take every worker's state at the same step",
            field="progress",
        )
    configs = _configs(reference, kinds)
    for slot, state in states:
        for i, _ in kinds:
            if str(i) in configs and _config_of(state, i) != configs[str(i)]:
                raise StateMismatchError(
                    f"the states of slot {ref_slot} and slot {slot} were taken from datasets "
                    f"configured differently at stage {i}: merge the states of one job",
                    field="config",
                )
    if any(kind == "MixSource" for _, kind in kinds):
        return _merge_mix(entries, kinds, configs, world_size, workers, epoch, passes.pop())
    if any(kind == "Streams" for _, kind in kinds):
        return _merge_streams(entries, kinds, configs, epoch, passes.pop())
    split = reference.get("split")
    shards_config = next((configs.get(str(i)) for i, kind in kinds if kind in SHARD_LISTS), None)
    list_kind = next((kind for _, kind in kinds if kind in SHARD_LISTS), None)
    if list_kind is None or not any(kind == "TarSamples" for _, kind in kinds):
        raise StateMismatchError(
            "merge_states() needs a pipeline that starts with a shard list read by a shard reader "
            "(WebDataset, or DataPipeline(SimpleShardList(...), split_by_node, split_by_worker, "
            "tarfile_to_samples(), ...))",
            field="stages",
        )
    if split not in ("nodes+workers", "nodes", "workers", "none"):
        raise StateMismatchError(
            "the shards of this pipeline are split by a stage of its own between the shard list "
            "and the reader, so merge_states() cannot tell which worker had which shard: split "
            "with wds.split_by_node and wds.split_by_worker",
            field="split",
        )
    if (split in ("workers", "none") and world_size > 1) or (split in ("nodes", "none") and workers > 1):
        raise StateMismatchError(
            f"this pipeline does not split its shards over {'ranks' if world_size > 1 and split in ('workers', 'none') else 'DataLoader workers'} "
            f"(split: {split}), so every one read the same shards: there is no share to carry "
            "over; give nodesplitter=wds.split_by_node (and the default workersplitter)",
            field="split",
        )
    level = _Level()
    n_shards = shards_config.get("shards") if isinstance(shards_config, dict) else None
    if not isinstance(shards_config, dict) or type(n_shards) is not int or n_shards < 1:
        raise StateMismatchError(f"the shard list's state says {shown(n_shards)} shards", field="config")
    seed = shards_config.get("seed")
    resampled = list_kind == "ResampledShards"
    order: Optional[Sequence] = None
    if not resampled:
        order = shard_order(n_shards, seed, epoch) if seed is not None else list(range(n_shards))
    position = {index: pos for pos, index in enumerate(order)} if order is not None else {}
    for slot, state in entries:
        rank, worker = divmod(slot, workers)
        _merge_slot(
            level, state, kinds, split, world_size, workers, rank, worker, order, n_shards, epoch, resampled, position
        )
    out: dict = {
        "kinds": [list(k) for k in kinds],
        "configs": configs,
        "split": split,
        "epoch": epoch,
        "pass": passes.pop(),
        "items": level.items,
        "slots": len(entries),
        "shards": shards_config,
        "pending": sorted(level.pending, key=level.pending.__getitem__),
        "partial": level.partial,
        "buffered": encode_buffered(level.buffered, resampled),
        "read": level.read,
        "started": level.started,
        # conservation, so that an edited state cannot add or drop work: done + partial + pending == shards; read == delivered + held, where the
        # buffered samples are the held ones plus the replays not yet read (see elastic._check_conservation)
        "done": _carried(level) + level.done,
        "delivered": level.read - level.held,
        "replays": level.replays,
    }
    if len(level.limits) > 1:
        raise StateMismatchError(
            f"the workers' readers had different equal_work limits ({sorted(level.limits)[:8]}): "
            "merge the states of one job",
            field="limit",
        )
    if level.limits:
        limit = level.limits.pop()
        out["owed"] = max(0, limit * len(entries) - level.read + level.held)
    return out


def _carried(level: _Level) -> int:
    """The shards done before the shares the slots read (every share of one elastic resume says the same)."""
    if len(level.carried) > 1:
        raise StateMismatchError(
            f"the workers' elastic shares say {sorted(level.carried)[:8]} shards were done before them: the "
            "states were changed or come from different resumes; merge the states of one job, taken at one step",
            field="done",
        )
    return level.carried.pop() if level.carried else 0


def _configs(state: dict, kinds: list) -> dict:
    if _is_start(state):
        configs = state.get("configs")
        if not isinstance(configs, dict):
            raise StateMismatchError(f"a saved start holds the configs {shown(configs)}", field="configs")
        return configs
    return {str(i): _config_of(state, i) for i, _ in kinds if _config_of(state, i) is not None}


def _kinds(state: dict, slot: int) -> list:
    if _is_start(state):
        kinds = state.get("kinds")
        if not (
            isinstance(kinds, list)
            and len(kinds) <= 256
            and all(isinstance(k, list) and len(k) == 2 and type(k[0]) is int and isinstance(k[1], str) for k in kinds)
        ):
            raise StateMismatchError(f"the start of slot {slot} lists the stages {shown(kinds)}", field="kinds")
        return [tuple(k) for k in kinds]
    stages = state.get("stages")
    if not isinstance(stages, list) or len(stages) > 256:
        raise StateMismatchError(f"the state of slot {slot} lists no stages a state_dict() gives", field="stages")
    kinds = []
    for entry in stages:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and type(entry[0]) is int
            and isinstance(entry[1], str)
            and isinstance(entry[2], dict)
        ):
            raise StateMismatchError(
                f"the state of slot {slot} lists the stage {shown(entry)}, which no state_dict() gives", field="stages"
            )
        kinds.append((entry[0], entry[1]))
    return kinds


def _stage(state: dict, index: int) -> dict:
    for i, _, stage in state["stages"]:
        if i == index:
            return stage
    raise KeyError(index)


def _config_of(state: dict, index: int) -> Any:
    stage = _stage(state, index)
    config = stage.get("config")
    return config if isinstance(config, dict) else None


def _merge_slot(
    level: _Level,
    state: Optional[dict],
    kinds: list,
    split: str,
    world_size: int,
    workers: int,
    rank: int,
    worker: int,
    order: Optional[Sequence],
    n_shards: int,
    epoch: int,
    resampled: bool,
    position: dict,
) -> None:
    """Add what one slot leaves (all of its share when it had not started) to ``level``."""
    slot, slots = shard_split(split, world_size, workers, rank, worker)
    listed = reader = None
    shuffles = []
    if _is_start(state):  # a share not begun: all of it is left
        assert state is not None
        level.items += as_count((state.get("progress") or (0, 0))[1])
        share = state.get("share")
        if not isinstance(share, dict):
            raise StateMismatchError(f"the start of rank {rank} worker {worker} holds no share", field="share")
        listed, state = {"epoch": share.get("epoch"), "assigned": share}, None
        if type(share.get("limit")) is int:
            level.limits.add(share["limit"])
    if state is not None:
        level.items += (state.get("progress") or (0, 0))[1]
        for i, kind in kinds:
            stage = _stage(state, i)
            if kind in SHARD_LISTS:
                listed = stage
            elif kind == "TarSamples":
                reader = stage
            elif kind == "Shuffle":
                shuffles.append(stage)
        if listed is not None and listed.get("epoch") not in (epoch, -1):
            raise StateMismatchError(
                f"rank {rank} worker {worker} reads epoch {shown(listed.get('epoch'))}, the job "
                f"epoch {epoch}: take every state at the same step",
                field="epoch",
            )
    assigned = listed.get("assigned") if isinstance(listed, dict) else None
    replays: list = []
    if isinstance(assigned, dict):  # a share of an earlier elastic resume: its items, not the split
        if type(assigned.get("done")) is not int or assigned["done"] < 0:
            raise StateMismatchError(
                f"rank {rank} worker {worker} reads a share of an elastic resume made by an earlier wds_cloud "
                "(it does not say how many shards were done before it), so the shards of the epoch cannot be "
                "accounted for: resume it on the same shape, or let the epoch end before merging",
                field="done",
            )
        level.carried.add(assigned["done"])
        items = [("p", entry) for entry in assigned.get("partial") or ()]
        items += [("i", index) for index in assigned.get("pending") or ()]
        replays = decode_buffered(assigned.get("replay") or [])
    elif resampled:
        items = []
    else:
        assert order is not None
        ranks_split = slots // (workers if split in ("nodes+workers", "workers") else 1)
        per = slots // ranks_split
        mine = order[slot // per :: ranks_split][slot % per :: per]
        items = [("i", index) for index in mine]
    if reader is None or reader.get("fresh"):
        left_items, left_replays = items, replays
    elif reader.get("done"):
        left_items, left_replays = [], []
        level.read += as_count(reader.get("samples"))
        level.started += as_count(reader.get("shard")) + 1 if resampled else len(items)
        level.done += len(items)
    else:
        level.read += as_count(reader.get("samples"))
        done_replays = min(as_count(reader.get("replayed")), len(replays))
        left_replays = replays[done_replays:]
        url = reader.get("url")
        if url is None:
            left_items = items
        else:
            k = as_count(reader.get("shard"))
            if items:
                k %= len(items)  # equal_work="max" goes over a share again
            entry = [
                reader.get("url_id"),
                url,
                reader.get("offset"),
                reader.get("next"),
                bool(reader.get("compressed")),
                reader.get("pax") or {},
            ]
            if not isinstance(entry[0], str):
                raise StateMismatchError(
                    f"rank {rank} worker {worker}: the reader's state has no URL hash (a state of "
                    "an older wds_cloud): take the states again with this version",
                    field="url_id",
                )
            level.partial.append(entry)
            left_items = items[k + 1 :]
            level.started += k + 1
            level.done += min(k, len(items))
        if type(reader.get("limit")) is int:
            level.limits.add(reader["limit"])
    for kind, item in left_items:
        if kind == "p":
            level.partial.append(list(item))
        else:
            if item in level.pending:
                raise StateMismatchError(
                    f"shard {item} is in the unread share of two workers: the states were changed "
                    "or come from different jobs",
                    field="pending",
                )
            level.pending[item] = position.get(item, item)
    level.replays += len(left_replays)
    for url_id, text, compressed, first, blocks in left_replays:
        level.buffered.setdefault(url_id, [text, compressed, []])[2].append((first, blocks))
    for shuffle in shuffles:
        if shuffle.get("fresh"):
            continue
        table = {}
        for entry in shuffle.get("urls") or ():
            if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[3], str)):
                raise StateMismatchError(
                    f"rank {rank} worker {worker}: a shuffle buffer names {shown(entry)} without a "
                    "URL hash: take the states again with this version",
                    field="urls",
                )
            table[entry[0]] = entry
        for loc in shuffle.get("buffer") or ():
            ref, first, blocks = loc
            _, text, compressed, url_id = table[ref]
            level.buffered.setdefault(url_id, [text, bool(compressed), []])[2].append((first, blocks))
            level.held += 1


def _merge_streams(entries: list, kinds: list, configs: dict, epoch: int, pass_number: int) -> dict:
    """Virtual streams name no rank or worker: the merged state is every stream's state, each once."""
    index = next(i for i, kind in kinds if kind == "Streams")
    count = None
    states: dict = {}
    items = 0
    for slot, state in entries:
        if state is None or state.get("fresh"):
            continue  # its streams had delivered nothing: they start afresh
        items += as_count((state.get("progress") or (0, 0))[1])
        if _is_start(state):  # the streams an earlier elastic resume gave it, not begun
            held = {
                "streams": state.get("count"),
                "stages": [[v, STREAMS_KIND, st] for v, st in state.get("streams") or ()],
            }
        else:
            held = _stage(state, index)
        if count is None:
            count = held.get("streams")
        if held.get("streams") != count or type(count) is not int:
            raise StateMismatchError(
                f"slot {slot} has streams={shown(held.get('streams'))}, another slot {count}: merge "
                "the states of one job",
                field="streams",
            )
        for entry in held.get("stages") or ():
            if not (
                isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int and isinstance(entry[2], dict)
            ):
                raise StateMismatchError(f"slot {slot}'s streams state lists {shown(entry)}", field="stages")
            if entry[0] in states:
                raise StateMismatchError(
                    f"stream {entry[0]} is in the states of two workers: the states were changed "
                    "or come from different jobs",
                    field="stages",
                )
            states[entry[0]] = entry[2]
    return {
        "kinds": [list(k) for k in kinds],
        "configs": configs,
        "epoch": epoch,
        "pass": pass_number,
        "items": items,
        "slots": len(entries),
        "streams": {"count": count, "states": [[v, states[v]] for v in sorted(states)]},
    }


def _merge_mix(
    entries: list, kinds: list, configs: dict, world_size: int, workers: int, epoch: int, pass_number: int
) -> dict:
    mix_index = next(i for i, kind in kinds if kind == "MixSource")
    if any(kind not in ("MixSource", "Shuffle", "CheckEmpty") for _, kind in kinds):
        raise StateMismatchError("merge_states() handles a mix followed by shuffles only", field="stages")
    names = None
    count = 0
    quotas: list = []  # the shares of an earlier elastic resume, when the pass had them
    taken: Optional[list] = None
    mix_pass = None
    per_slot: list = []  # (slot, [each source's state or start, or None])
    outer: dict[int, dict] = {}  # source -> url id -> [shown, compressed, ranges]: a shuffle after the mix
    items = 0
    for slot, state in entries:
        if state is None or state.get("fresh"):
            per_slot.append((slot, None))
            continue
        items += as_count((state.get("progress") or (0, 0))[1])
        mix = state.get("mix") if _is_start(state) else _stage(state, mix_index)
        if not isinstance(mix, dict):
            raise StateMismatchError(f"slot {slot} holds no mix state", field="mix")
        if names is None:
            names, mix_pass = mix.get("names"), mix.get("pass")
            if not (isinstance(names, list) and 0 < len(names) <= 4096):
                raise StateMismatchError(f"slot {slot}'s mix state names the sources {shown(names)}", field="names")
            taken = [0] * len(names)
        if mix.get("names") != names or mix.get("pass") != mix_pass:
            raise StateMismatchError(
                f"slot {slot}'s mix state names other sources or another pass: merge the states of one job",
                field="names",
            )
        held = mix.get("sources")
        if not (isinstance(held, list) and len(held) == len(names)):
            raise StateMismatchError(f"slot {slot}'s mix state does not hold one state per source", field="sources")
        per_slot.append((slot, held))
        if type(mix.get("quota")) is int:
            quotas.append(mix["quota"])
        if _is_start(state):
            continue
        count += as_count(mix.get("count"))
        for j, n in enumerate(mix.get("taken") or ()):
            if j < len(names):
                taken[j] += as_count(n)  # type: ignore[index]
        for i, kind in kinds:
            if kind != "Shuffle" or _stage(state, i).get("fresh"):
                continue
            shuffle = _stage(state, i)
            table = {e[0]: e for e in shuffle.get("urls") or () if isinstance(e, list) and len(e) == 4}
            for ref, first, blocks in shuffle.get("buffer") or ():
                _, text, compressed, url_id = table[ref]
                outer.setdefault(ref % len(names), {}).setdefault(url_id, [text, bool(compressed), []])[2].append(
                    (first, blocks)
                )
    if names is None:
        return {"fresh": True, "epoch": epoch}
    sources = []
    for j in range(len(names)):
        level = _merge_level(
            [(slot, held[j] if held is not None else None) for slot, held in per_slot], world_size, workers, epoch
        )
        extra = outer.get(j)
        if extra:
            if level.get("fresh"):
                raise StateMismatchError(
                    "a shuffle after the mix holds samples of a source that never started: the states were changed",
                    field="buffer",
                )
            merged = {e[0]: [e[1], e[2], decode_ranges(e[3])] for e in level["buffered"]}
            for url_id, (text, compressed, ranges) in extra.items():
                merged.setdefault(url_id, [text, compressed, []])[2].extend(ranges)
            level["buffered"] = encode_buffered(merged, level["shards"].get("kind") == "ResampledShards")
            level["outer"] = sum(len(v[2]) for v in extra.values())
            level["delivered"] -= level["outer"]  # held after the mix: not delivered yet
        sources.append(level)
    out = {"names": names, "pass": mix_pass, "count": count, "taken": taken, "sources": sources}
    if quotas:
        out["quota"] = sum(quotas)
    return {
        "kinds": [list(k) for k in kinds],
        "configs": configs,
        "epoch": epoch,
        "pass": pass_number,
        "items": items,
        "slots": len(entries),
        "mix": out,
    }
