"""Long fuzzing run of the structured-file readers: indexes (ours and DALI's), wids descriptions,
manifests, dataset specs, job records and resume states, each mutated and read back.

Each case takes a valid file, mutates it (values replaced by hostile ones, keys dropped, numbers nudged;
or its text cut, bytes flipped, nesting deepened) and runs the reader the way a user would
(``ShardListDataset[i]``, ``WebDataset(spec)``, ``load_state_dict`` then iteration).  A case fails if it
raises anything but an error of ours (for a state: anything but a StateMismatchError, or a resumed
iteration that is not exactly the saved one), or takes longer than ``--limit`` seconds.

    python bench/fuzz_datafiles.py [--cases 5000] [--seed 0] [--limit 10]

Prints the cases run per file kind and outcome, and the slowest case.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import wds_cloud as wds  # noqa: E402
from tests.conftest import make_shards  # noqa: E402
from tests.hostile import mutate_json, mutate_text  # noqa: E402
from wds_cloud import index as wds_index  # noqa: E402
from wds_cloud.errors import StateMismatchError, WdsCloudError  # noqa: E402
from wds_cloud.jobs.record import JobRecord  # noqa: E402
from wds_cloud.manifest import Manifest  # noqa: E402
from wds_cloud.resume.state import seal  # noqa: E402


def corpus(root: Path) -> dict:
    urls = wds.shardlists.expand_urls(make_shards(root, nshards=2, per_shard=5))
    for url in urls:
        wds_index.write_index(wds_index.build_index(url))
    manifest = Manifest()
    for url in urls:
        index = wds_index.build_index(url)
        manifest.add(url, index.size, len(index), "0" * 64)

    def build():
        return wds.WebDataset(urls, shardshuffle=True, seed=1).shuffle(4, seed=2)

    ds = build()
    it = iter(ds)
    for _ in range(6):
        next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    fresh = build()
    fresh.load_state_dict(copy.deepcopy(state))
    return {
        "urls": urls,
        "build": build,
        "expected": [s["__key__"] for s in fresh],
        "index": json.loads(Path(urls[0] + ".index.json").read_text()),
        "dali": wds_index.dali_text(wds_index.build_index(urls[0])).encode(),
        "description": {"wids_version": 1, "shardlist": [{"url": Path(u).name, "nsamples": 5} for u in urls]},
        "manifest": manifest.to_json(),
        "spec": {
            "version": 1,
            "seed": 0,
            "sources": [{"name": "a", "urls": [Path(u).name for u in urls], "weight": 1.0, "shuffle": 2}],
        },
        "job": {
            "format": "wds_cloud.job",
            "version": 1,
            "tool": "reshard",
            "inputs": ["in.tar"],
            "settings": {"maxcount": 2},
            "outputs": {str(root / "o-000.tar"): {"size": 10, "sha256": "ab"}},
        },
        "state": state,
    }


def one_case(kind: str, data: dict, root: Path, rng: random.Random) -> str:
    """Run one mutated case; returns its outcome ('ok', 'refused'); raises on a failure."""
    textual = rng.random() < 0.25
    if kind == "dali":
        (root / "c.idx").write_bytes(mutate_text(data["dali"], rng))
        run = lambda: wds_index.read_index(str(root / "c.idx"))  # noqa: E731
    elif kind == "state":
        state = mutate_json(data["state"], rng)
        resealed = isinstance(state, dict) and rng.random() < 0.5
        if resealed:
            seal(state)  # a state changed on purpose, its checksum made again: the fields must hold on their own
        ds = data["build"]()
        try:
            ds.load_state_dict(state)
            got = [s["__key__"] for s in ds]
        except StateMismatchError:
            return "refused"
        if got != data["expected"]:
            if resealed:  # well-formed values chosen on purpose (an RNG count) can only be checked for their form
                return "resealed, resumed otherwise"
            raise AssertionError("a changed state resumed into another iteration")
        return "ok"
    else:
        text = json.dumps(mutate_json(data[kind], rng)).encode()
        if textual:
            text = mutate_text(json.dumps(data[kind]).encode(), rng)
        name = {
            "index": "c.tar.index.json",
            "description": "d.json",
            "manifest": "m.json",
            "spec": "s.json",
            "job": "o-N.tar.wds-job.json",
        }[kind]
        (root / name).write_bytes(text)
        if kind == "index":
            (root / "c.tar").write_bytes(Path(data["urls"][0]).read_bytes())

            def run():
                ds = wds.ShardListDataset([str(root / "c.tar")], transformations=[])
                return [ds[i] for i in range(len(ds))]
        elif kind == "description":

            def run():
                ds = wds.ShardListDataset(str(root / name), transformations=[])
                return ds[0], ds[len(ds) - 1]
        elif kind == "manifest":
            run = lambda: list(wds.WebDataset(data["urls"], shardshuffle=False, manifest=str(root / name)))  # noqa
        elif kind == "spec":
            run = lambda: list(wds.WebDataset(str(root / name)))  # noqa: E731
        else:
            run = lambda: JobRecord(str(root / "o-%03d.tar"), "reshard", ["in.tar"], {"maxcount": 2})  # noqa
    try:
        run()
    except WdsCloudError:
        return "refused"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=float, default=10.0, help="seconds one case may take")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kinds = ["index", "dali", "description", "manifest", "spec", "job", "state"]
    outcomes: collections.Counter = collections.Counter()
    failures: list[str] = []
    slowest = (0.0, "")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        data = corpus(root / "data")
        started = time.perf_counter()
        for case in range(args.cases):
            kind = kinds[case % len(kinds)]
            seed = rng.randrange(1 << 30)
            began = time.perf_counter()
            try:
                outcome = one_case(kind, data, root / "data", random.Random(seed))
            except Exception as exc:  # a failure of the reader: report it with its seed to replay
                outcome = "FAILED"
                failures.append(f"{kind} seed {seed}: {type(exc).__name__}: {str(exc)[:200]}")
            took = time.perf_counter() - began
            if took > args.limit:
                failures.append(f"{kind} seed {seed}: took {took:.1f} s")
            if took > slowest[0]:
                slowest = (took, f"{kind} seed {seed}")
            outcomes[(kind, outcome)] += 1
            if (case + 1) % 500 == 0:
                print(f"{case + 1} cases, {len(failures)} failures", file=sys.stderr)
        elapsed = time.perf_counter() - started
    print(f"{args.cases} cases in {elapsed:.0f} s (seed {args.seed})")
    for kind in kinds:
        row = {o: n for (k, o), n in outcomes.items() if k == kind}
        print(f"  {kind:<12} " + ", ".join(f"{o} {n}" for o, n in sorted(row.items())))
    print(f"slowest case: {slowest[1]} ({slowest[0] * 1000:.1f} ms)")
    for line in failures[:20]:
        print("FAIL", line)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
