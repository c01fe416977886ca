"""Mixing three sources by weight: a spec mix (``wds.from_spec``) next to reading the same sources one after
another (unmixed), and next to webdataset 1.0.2's ``RandomMix`` over the same three datasets, in one run.

Three local sources (4, 3 and 2 shards; weights 0.5, 0.3, 0.2), every sample of each read once per pass
(``samples_per_epoch`` = all of them: a source that runs out leaves the mix).  Workloads: tiny (100-byte
text) and medium (~15 KB JPEG, JSON, class).  Printed: samples/s, best of 3, and the ratios.  Goal: the mix
at >= 90% of the unmixed rate.  webdataset is installed only in the benchmark environment.

    python bench/bench_mix.py [--workload tiny,medium]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402

SOURCES = (("a", 4, 0.5), ("b", 3, 0.3), ("c", 2, 0.2))  # name, shards, weight
PER_SHARD = {"tiny": 20_000, "medium": 1_000}


def best(run, repeats: int = 3) -> tuple[int, float]:
    results = [common.timed(run) for _ in range(repeats)]
    n = results[0][0]
    return n, max(n / seconds for _, seconds in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="tiny,medium")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import wds_cloud as wds

    webdataset = common.peer()
    rows = []
    for workload in args.workload.split(","):
        make = {"tiny": common.tiny, "medium": common.medium}[workload]
        specs = {
            name: common.dataset(f"mix-{workload}-{name}", shards, PER_SHARD[workload], make)[0]
            for name, shards, _ in SOURCES
        }
        total = sum(shards * PER_SHARD[workload] for _, shards, _ in SOURCES)
        spec = {
            "version": 1,
            "seed": 0,
            "samples_per_epoch": total,
            "sources": [{"name": name, "urls": specs[name], "weight": weight} for name, _, weight in SOURCES],
        }

        def unmixed() -> int:
            return sum(sum(1 for _ in wds.WebDataset(specs[name], shardshuffle=True)) for name, _, _ in SOURCES)

        def mixed() -> int:
            return sum(1 for _ in wds.from_spec(spec))

        def peer_mix() -> int:
            datasets = [webdataset.WebDataset(specs[name], shardshuffle=100) for name, _, _ in SOURCES]
            mix = webdataset.RandomMix(datasets, probs=[w for _, _, w in SOURCES], longest=True)
            return sum(1 for _ in mix)

        n_unmixed, unmixed_rate = best(unmixed)
        n_mixed, mixed_rate = best(mixed)
        n_peer, peer_rate = best(peer_mix)
        assert n_unmixed == n_mixed == n_peer == total, (n_unmixed, n_mixed, n_peer, total)
        rows.append(
            [
                workload,
                f"{total:,}",
                f"{unmixed_rate:,.0f}",
                f"{mixed_rate:,.0f}",
                f"{mixed_rate / unmixed_rate:.0%}",
                f"{peer_rate:,.0f}",
                f"{mixed_rate / peer_rate:.2f}x",
            ]
        )
        print(
            f"{workload}: unmixed {unmixed_rate:,.0f}/s, mixed {mixed_rate:,.0f}/s "
            f"({mixed_rate / unmixed_rate:.0%}), webdataset RandomMix {peer_rate:,.0f}/s",
            flush=True,
        )
    print()
    print(
        common.table(
            rows,
            ["workload", "samples", "unmixed/s", "mixed/s", "mixed/unmixed", "webdataset mix/s", "ours/webdataset"],
        )
    )


if __name__ == "__main__":
    main()
