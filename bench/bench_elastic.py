"""Elastic resume benchmark: what a merged state costs at scale, and what the common path pays for it.

``--scale`` (the default): the states of a job of 64 ranks x 8 DataLoader workers over 8,192 shards, each
worker stopped in its sixth shard with 1,000 samples in its shuffle buffer (512,000 buffered samples in
all), made in the exact format ``WebLoader.state_dict()`` gives (simulated: no job of that size runs on
one machine).  It times ``wds.merge_states`` over the 64 rank states, the merged state's JSON size (per
buffered sample), and loading it into a ``WebLoader`` of another shape (32 ranks x 8 workers: one rank's
load computes its 8 workers' shares), then checks that the 256 shares add up to the work left.

``--common``: plain iteration through ``WebLoader`` (2 workers) and an in-process epoch with
``state_dict()`` every batch, timed in this process; run it on the code before and after a change (the
same command on two checkouts, alternating) to see that nothing changed for users who never merge.

    python bench/bench_elastic.py [--scale] [--common] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

RANKS, WORKERS, SHARDS, BUFFER = 64, 8, 8192, 1000


def simulated_states(wds) -> tuple[list, list]:
    """(the 64 rank states, the shard URLs): every worker in its sixth shard, 1,000 samples buffered."""
    from wds_cloud.resume.state import seal, shown_url, url_id
    from wds_cloud.shardlists import slot_shards

    urls = [f"/data/train-{i:06d}.tar" for i in range(SHARDS)]
    ds = build(wds, urls)
    fresh = ds.state_dict()["stages"]  # the stage kinds and configs of this dataset, as a state gives them
    config = {kind: stage.get("config") for _, kind, stage in fresh}
    index = {kind: i for i, kind, _ in fresh}
    slots = slot_shards(SHARDS, 7, 0, RANKS, WORKERS)
    states = []
    for rank in range(RANKS):
        workers = []
        for worker in range(WORKERS):
            mine = slots[rank * WORKERS + worker]
            current = 5
            table = [[ref, shown_url(urls[mine[ref]]), False, url_id(urls[mine[ref]])] for ref in range(current + 1)]
            buffer = [[i % (current + 1), 2 + 160 * (i // (current + 1)), 160] for i in range(BUFFER)]
            reader = {
                "shard": current,
                "url": shown_url(urls[mine[current]]),
                "url_id": url_id(urls[mine[current]]),
                "offset": 512 * 40_000,
                "samples": 5 * 300 + 250,
                "done": False,
                "identity": {"rank": rank, "world_size": RANKS, "worker": worker, "num_workers": WORKERS},
                "next": "sample-000250.jpg",
            }
            shuffle = {
                "config": config["Shuffle"],
                "rng": [12345, 4000],
                "urls": table,
                "block": 512,
                "buffer": buffer,
                "epoch": 0,
            }
            stages = [
                [index["SimpleShardList"], "SimpleShardList", {"epoch": 0, "config": config["SimpleShardList"]}],
                [index["TarSamples"], "TarSamples", reader],
                [index["CheckEmpty"], "CheckEmpty", {"seen": True}],
                [index["Shuffle"], "Shuffle", shuffle],
            ]
            workers.append(
                [
                    worker,
                    {"format": "wds_cloud.state/1", "progress": [0, 750], "stages": stages, "split": "nodes+workers"},
                ]
            )
        states.append(
            seal(
                {
                    "format": "wds_cloud.loader/1",
                    "num_workers": WORKERS,
                    "next": 0,
                    "exhausted": [],
                    "epoch": 0,
                    "workers": workers,
                    "progress": [0, 190],
                    "rank": rank,
                    "world_size": RANKS,
                }
            )
        )
    return states, urls


def build(wds, urls):
    return wds.WebDataset(urls, shardshuffle=True, seed=7, nodesplitter=wds.split_by_node).shuffle(BUFFER)


def best(fn, repeat):
    times, out = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return min(times), out


def scale(repeat: int) -> None:
    import wds_cloud as wds

    states, urls = simulated_states(wds)
    per_rank = [len(json.dumps(s)) for s in states]
    seconds, merged = best(lambda: wds.merge_states(states), repeat)
    text = json.dumps(merged)
    level = merged["pipeline"]
    buffered = sum(len(entry[3]) // 2 for entry in level["buffered"])
    without = dict(level, buffered=[])
    per_sample = (len(text) - len(json.dumps(dict(merged, pipeline=without)))) / buffered
    print(
        f"job: {RANKS} ranks x {WORKERS} workers, {SHARDS} shards, {BUFFER}-sample buffers "
        f"({RANKS * WORKERS * BUFFER:,} buffered samples)\n"
    )
    print("| what | figure |")
    print("|---|---|")
    print(f"| one rank's WebLoader state (JSON) | {sum(per_rank) / len(per_rank) / 1e6:.2f} MB |")
    print(f"| the 64 rank states together | {sum(per_rank) / 1e6:.1f} MB |")
    print(f"| `merge_states` over them | **{seconds * 1000:.0f} ms** |")
    print(
        f"| merged state (JSON) | **{len(text) / 1e6:.2f} MB**: {buffered:,} buffered samples, "
        f"{len(level['partial'])} partly read shards, {len(level['pending'])} unstarted |"
    )
    print(
        f"| merged state per buffered sample | **{per_sample:.1f} bytes** (a rank state: "
        f"{(sum(per_rank) / (RANKS * WORKERS * BUFFER)):.1f}) |"
    )
    json_seconds, _ = best(lambda: json.loads(json.dumps(merged)), repeat)
    print(f"| JSON dump + load of the merged state (a checkpoint's save and load) | {json_seconds * 1000:.0f} ms |")

    os.environ.update(RANK="3", WORLD_SIZE="32")
    import warnings

    warnings.simplefilter("ignore")
    loader = wds.WebLoader(build(wds, urls), batch_size=None, num_workers=WORKERS)
    load_seconds, _ = best(lambda: loader.load_state_dict(merged), repeat)
    print(
        f"| `load_state_dict(merged)` on one rank of 32 x 8 (checks, and its 8 workers' shares) | "
        f"**{load_seconds * 1000:.0f} ms** |"
    )
    ds = build(wds, urls)
    one_seconds, _ = best(lambda: ds.elastic_start(merged, 3, 32, 1, WORKERS), repeat)
    print(f"| one worker's share | {one_seconds * 1000:.1f} ms |")

    # the 256 shares of the new shape add up to the work left, each piece once
    pieces, replays = [], 0
    for rank in range(32):
        for worker in range(WORKERS):
            share = ds.elastic_start(merged, rank, 32, worker, WORKERS)["start"]["share"]
            pieces += share["pending"] + [p[0] for p in share["partial"]]
            replays += sum(len(e[3]) // 2 for e in share["replay"])
    assert sorted(pieces, key=str) == sorted(level["pending"] + [p[0] for p in level["partial"]], key=str)
    assert replays == buffered
    print(
        f"\nchecked: the 256 shares hold every unstarted shard, partly read shard and buffered sample once "
        f"({replays:,} samples, {replays // 256:,} per worker)"
    )


def common(repeat: int) -> None:
    import warnings

    warnings.simplefilter("ignore")
    import wds_cloud as wds

    sys.path.insert(0, HERE)
    import common as data  # noqa: E402 (bench/common.py: generated shards)

    medium, _ = data.dataset("medium", 8, 1000, data.medium)

    def raw():
        return wds.WebDataset(medium, shardshuffle=True).shuffle(1000).batched(32, collation_fn=list)

    def loader_epoch():
        loader = wds.WebLoader(raw(), batch_size=None, num_workers=2)
        started = time.perf_counter()
        n = sum(1 for _ in loader)
        return time.perf_counter() - started, n

    def stepped_epoch():
        ds = raw()
        started = time.process_time()
        for _ in ds:
            ds.state_dict()
        return time.process_time() - started

    loader_times = [loader_epoch()[0] for _ in range(repeat)]
    stepped = [stepped_epoch() for _ in range(repeat)]
    print(json.dumps({"webloader_epoch_s": sorted(loader_times), "state_dict_every_batch_cpu_s": sorted(stepped)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", action="store_true", help="state size and merge/load times at 64 x 8")
    parser.add_argument("--common", action="store_true", help="the common path, for an A/B against another checkout")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.common:
        common(args.repeat)
    if args.scale or not args.common:
        scale(args.repeat)


if __name__ == "__main__":
    main()
