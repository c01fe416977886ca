"""Elastic resume at cluster size, pinned by counting: a worker's share of a merged state costs work linear in
that share (not in the ranks of the job), the whole job is dealt once per process, and ``state_dict(gather=True)``
merges once for all ranks.  The jobs are simulated (states in the exact format ``WebLoader.state_dict()`` gives,
as ``bench/bench_elastic.py`` makes them); no shard is read."""

from __future__ import annotations

import contextlib
import copy
import heapq
import threading

import pytest

import wds_cloud as wds
from wds_cloud.errors import NotResumableError, StateMismatchError
from wds_cloud.loader import webloader
from wds_cloud.resume import consistency, elastic, share_out
from wds_cloud.resume.state import seal, shown_url, url_id
from wds_cloud.shardlists import slot_shards

# torch's advice when a loader asks for more workers than this machine's cores (none is started here)
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

WORKERS = 4  # DataLoader workers per rank, in the job that stopped and in the one that loads its state
PER_SLOT = 4  # shards per rank and worker: one done, one partly read, two unstarted
BUFFERED = 6  # samples in each worker's shuffle buffer


def build(urls):
    return wds.WebDataset(urls, shardshuffle=True, seed=7, nodesplitter=wds.split_by_node).shuffle(100)


def rank_states(ranks: int) -> tuple[list, list]:
    """(the WebLoader state of each of ``ranks`` ranks x WORKERS workers, each worker in its second shard with
    BUFFERED samples buffered; the shard URLs)."""
    urls = [f"/data/train-{i:06d}.tar" for i in range(ranks * WORKERS * PER_SLOT)]
    fresh = build(urls).state_dict()["stages"]
    config = {kind: stage.get("config") for _, kind, stage in fresh}
    index = {kind: i for i, kind, _ in fresh}
    slots = slot_shards(len(urls), 7, 0, ranks, WORKERS)
    states = []
    for rank in range(ranks):
        workers = []
        for worker in range(WORKERS):
            mine = [urls[i] for i in slots[rank * WORKERS + worker]]
            table = [[ref, shown_url(mine[ref]), False, url_id(mine[ref])] for ref in range(2)]
            reader = {
                "shard": 1,
                "url": shown_url(mine[1]),
                "url_id": url_id(mine[1]),
                "offset": 512 * 400,
                "samples": 12,
                "done": False,
                "identity": {"rank": rank, "world_size": ranks, "worker": worker, "num_workers": WORKERS},
                "next": "sample-000007.jpg",
            }
            shuffle = {
                "config": config["Shuffle"],
                "rng": [12345, 40],
                "urls": table,
                "block": 512,
                "buffer": [[i % 2, 2 + 20 * (i // 2), 20] for i in range(BUFFERED)],
                "epoch": 0,
            }
            stages = [
                [index["SimpleShardList"], "SimpleShardList", {"epoch": 0, "config": config["SimpleShardList"]}],
                [index["TarSamples"], "TarSamples", reader],
                [index["CheckEmpty"], "CheckEmpty", {"seen": True}],
                [index["Shuffle"], "Shuffle", shuffle],
            ]
            workers.append([worker, {"format": "wds_cloud.state/1", "progress": [0, 6], "stages": stages}])
            workers[-1][1]["split"] = "nodes+workers"
        states.append(
            seal(
                {
                    "format": "wds_cloud.loader/1",
                    "num_workers": WORKERS,
                    "next": 0,
                    "exhausted": [],
                    "epoch": 0,
                    "workers": workers,
                    "progress": [0, 6 * WORKERS],
                    "rank": rank,
                    "world_size": ranks,
                }
            )
        )
    return states, urls


@contextlib.contextmanager
def as_rank(monkeypatch, rank: int, world_size: int):
    with monkeypatch.context() as m:
        m.setenv("RANK", str(rank))
        m.setenv("WORLD_SIZE", str(world_size))
        m.delenv("LOCAL_RANK", raising=False)
        yield


class Counter:
    """Wraps a function and counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0
        self.lock = threading.Lock()

    def __call__(self, *args, **kw):
        with self.lock:
            self.calls += 1
        return self.fn(*args, **kw)


def count(monkeypatch, *where) -> Counter:
    """One counter over the function ``name`` of each ``(module, name)`` given (they are the same function)."""
    counter = Counter(getattr(*where[0]))
    for module, name in where:
        monkeypatch.setattr(module, name, counter)
    return counter


def worker_costs(monkeypatch, ranks: int) -> dict:
    """What one worker of rank 1 of ``ranks`` x WORKERS pays for its share of the merged state of a job of that
    shape, after its rank's process loaded it: the whole-job deals and units dealt for its start, and the URLs
    hashed as it takes the start."""
    states, urls = rank_states(ranks)
    merged = wds.merge_states(states)
    with as_rank(monkeypatch, 1, ranks):
        ds = build(urls)
        wds.WebLoader(ds, batch_size=None, num_workers=WORKERS).load_state_dict(merged)  # its workers' starts
        deals = count(monkeypatch, (elastic, "rank_share"))
        pops = count(monkeypatch, (heapq, "heappop"))
        start = ds.elastic_start(merged, 1, ranks, 2, WORKERS)  # worker 2's start, again: from the rank's part
        hashed = count(monkeypatch, (share_out, "url_id"), (consistency, "url_id"))
        build(urls).apply_level_start(start["start"])  # as the worker takes it
    share = start["start"]["share"]
    return {
        "deals": deals.calls,
        "pops": pops.calls,
        "hashed": hashed.calls,
        "held": len(share["pending"]) + len(share["partial"]) + len(share["replay"]),
    }


def test_a_workers_share_costs_work_linear_in_it_not_in_the_ranks(monkeypatch):
    """One worker's share of a merged state of 8 and of 64 ranks (the same work per worker): the same units dealt
    and URLs hashed (its own shards only), and no deal of the whole job."""
    small, large = worker_costs(monkeypatch, 8), worker_costs(monkeypatch, 64)
    assert small["held"] == large["held"] > 0
    assert small["deals"] == large["deals"] == 0  # the rank's process dealt the job; the worker takes its share
    assert small["pops"] == large["pops"] == 0  # no heap of every slot, no unit of another worker's
    assert small["hashed"] == large["hashed"] <= small["held"]  # one hash per shard it names, at most


def test_the_whole_job_is_dealt_once_per_process(monkeypatch):
    """Loading a merged state on a rank of 8 x 4: the job dealt once and every URL hashed once, for its 4 workers'
    starts together; the starts add up to the rank's part."""
    states, urls = rank_states(8)
    merged = wds.merge_states(states)
    with as_rank(monkeypatch, 3, 8):
        deals = count(monkeypatch, (elastic, "rank_share"))
        hashed = count(monkeypatch, (share_out, "url_id"), (consistency, "url_id"))
        loader = wds.WebLoader(build(urls), batch_size=None, num_workers=WORKERS)
        loader.load_state_dict(merged)
        assert deals.calls == 1
        assert hashed.calls == len(urls)
        ds = build(urls)
        ds.load_state_dict(merged)  # another pipeline: dealt again for it, once
        starts = [ds.elastic_start(merged, 3, 8, w, WORKERS)["start"]["share"] for w in range(WORKERS)]
        assert deals.calls == 2
    part = elastic.rank_share(merged["pipeline"], 3, 8, WORKERS)
    assert sum(len(s["pending"]) + len(s["partial"]) for s in starts) == sum(len(u) for u in part.units)
    assert sum(sum(len(e[3]) // 2 for e in s["replay"]) for s in starts) == len(part.buffered)


def test_the_shares_are_those_of_one_deal_over_every_slot():
    """The shares cut from a rank's part are the ones dealt over all the job's slots at once (the deal the shares
    were always made by), and together hold every unit and buffered sample once."""
    states, _ = rank_states(4)
    level = wds.merge_states(states)["pipeline"]
    slots, per = 3 * 2, 2
    flat = [elastic.share(level, slot, slots) for slot in range(slots)]  # per=1: each slot dealt on its own
    cut = [elastic.share(level, slot, slots, per=per) for slot in range(slots)]
    assert [dict(s, replay=None) for s in flat] == [dict(s, replay=None) for s in cut]
    assert flat == cut
    pending = sorted(i for s in cut for i in s["pending"])
    assert pending == sorted(level["pending"])
    assert sorted(e[0] for s in cut for e in s["partial"]) == sorted(e[0] for e in level["partial"])
    assert sum(sum(len(e[3]) // 2 for e in s["replay"]) for s in cut) == sum(len(e[3]) // 2 for e in level["buffered"])


def start_of(monkeypatch, ranks=4):
    states, urls = rank_states(ranks)
    merged = wds.merge_states(states)
    with as_rank(monkeypatch, 1, ranks):
        ds = build(urls)
        ds.load_state_dict(merged)
        return ds.elastic_start(merged, 1, ranks, 0, WORKERS), urls


def test_a_share_made_before_its_hints_still_loads(monkeypatch):
    """A share without ``partial_at``/``replay_at`` (saved by an earlier version) is applied as before: its shards
    found by hashing the shard list's URLs."""
    start, urls = start_of(monkeypatch)
    share = start["start"]["share"]
    del share["partial_at"], share["replay_at"]
    hashed = count(monkeypatch, (share_out, "url_id"), (consistency, "url_id"))
    build(urls).apply_level_start(start["start"])
    assert hashed.calls == len(urls)


@pytest.mark.parametrize(
    "field, value",
    [
        ("partial_at", "x"),
        ("partial_at", [0, 1, 2]),
        ("partial_at", [-1]),
        ("partial_at", [True]),
        ("replay_at", [10**9]),
    ],
)
def test_a_share_whose_hints_are_not_indices_is_refused(monkeypatch, field, value):
    """Hints of the wrong type, length or range are refused naming the field."""
    start, urls = start_of(monkeypatch)
    share = start["start"]["share"]
    if field == "replay_at":
        value = [value[0]] * len(share["replay"])
    share[field] = value
    with pytest.raises(StateMismatchError) as refused:
        build(urls).apply_level_start(start["start"])
    assert refused.value.field == field


def test_a_share_whose_hint_names_another_shard_is_refused(monkeypatch):
    """A hint pointing at another shard of the list (a state edited and sealed again) is refused, naming it."""
    start, urls = start_of(monkeypatch)
    share = start["start"]["share"]
    share["partial_at"] = [(i + 1) % len(urls) for i in share["partial_at"]]
    with pytest.raises(StateMismatchError, match="holds another URL there") as refused:
        build(urls).apply_level_start(start["start"])
    assert refused.value.field == "partial_at"


class Group:
    """What the ranks of a simulated process group share: their threads meet at a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)  # a safety net against a hang, not a wait
        self.slots: list = [None] * size


class Rank:
    """``torch.distributed``'s gather_object and broadcast_object_list for one rank of a :class:`Group` (objects
    are copied, as sending them would)."""

    def __init__(self, group: Group, rank: int) -> None:
        self.group, self.rank = group, rank

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.group.size

    def gather_object(self, obj, gathered, dst=0):
        self.group.slots[self.rank] = copy.deepcopy(obj)
        self.group.barrier.wait()
        if self.rank == dst:
            gathered[:] = copy.deepcopy(self.group.slots)
        self.group.barrier.wait()

    def broadcast_object_list(self, objects, src=0):
        if self.rank == src:
            self.group.slots[0] = copy.deepcopy(objects)
        self.group.barrier.wait()
        if self.rank != src:
            objects[:] = copy.deepcopy(self.group.slots[0])
        self.group.barrier.wait()


def gather_on_every_rank(states: list) -> list:
    """What gather_merged gives (or raises) on each rank of a group of len(states) simulated ranks."""
    group = Group(len(states))
    out: list = [None] * len(states)

    def run(rank):
        try:
            out[rank] = webloader.gather_merged(states[rank], dist=Rank(group, rank))
        except Exception as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(states))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def test_gather_merges_once_for_every_rank(monkeypatch):
    """state_dict(gather=True) on 4 ranks: the states are merged once in all, and every rank gets the same merged
    state, the one merge_states gives."""
    states, _ = rank_states(4)
    expected = wds.merge_states(states)
    merges = count(monkeypatch, (webloader, "merge_states"))
    results = gather_on_every_rank(states)
    assert merges.calls == 1
    assert all(result == expected for result in results)


def test_gather_tells_every_rank_why_there_is_no_merged_state(monkeypatch):
    """A rank that could not take its state, or states that do not merge: every rank raises, none waits."""
    states, _ = rank_states(4)
    states[2] = {"format": webloader.UNAVAILABLE, "reason": "a shuffle after the workers holds items"}
    results = gather_on_every_rank(states)
    assert all(isinstance(r, NotResumableError) and "rank 2 could not take its state" in str(r) for r in results)
    states, _ = rank_states(4)
    states[1] = states[0]  # rank 0 given twice, rank 1 left out
    results = gather_on_every_rank(states)
    assert all(isinstance(r, StateMismatchError) and not isinstance(r, NotResumableError) for r in results)
    assert {r.field for r in results} == {"states"}


def test_a_level_changed_in_place_is_dealt_again(monkeypatch):
    """The per-process memo of a rank's part is kept by the level's identity and a fingerprint of it: a level
    changed in place (its last unstarted shard taken out) is dealt again, not served the old part."""
    states, urls = rank_states(4)
    merged = wds.merge_states(states)
    with as_rank(monkeypatch, 1, 4):
        ds = build(urls)
        ds.load_state_dict(merged)
        deals = count(monkeypatch, (elastic, "rank_share"))
        ds.elastic_start(merged, 1, 4, 0, WORKERS)
        ds.elastic_start(merged, 1, 4, 1, WORKERS)
        assert deals.calls == 1
        gone = merged["pipeline"]["pending"].pop()
        shares = [
            ds.elastic_start(merged, rank, 4, w, WORKERS)["start"]["share"] for rank in range(4) for w in range(2)
        ]
        assert deals.calls == 5  # once more for rank 1, once for each other rank
    assert all(gone not in share["pending"] for share in shares)


@pytest.mark.parametrize(
    "flat",
    [
        [0, True],
        [0, 1, -1, 1],
        [0, 0],
        [0, 1.0],
        [2**41, 1],
        [0, 2**42],
        [2**40, 2**40, 1, 1],
        [0, 1, "1", 1],
        [0, 1, 5],
    ],
)
def test_buffered_ranges_checked_in_bulk_refuse_what_the_loop_refuses(flat):
    """The bulk check of a shard's buffered ranges (taken when every pair is valid) lets nothing through that the
    pair-by-pair check refuses: a bool, a negative gap, an empty or fractional length, samples past any shard."""
    with pytest.raises(StateMismatchError) as refused:
        elastic._check_buffered(["id", "s3://b/x.tar", False, flat])
    assert refused.value.field == "buffered"
    elastic._check_buffered(["id", "s3://b/x.tar", False, [0, 1, 3, 2]])  # and takes a valid one
    assert consistency._end([0, 1, 3, 2]) == 6
