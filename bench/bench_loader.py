"""Loader benchmark: what resumability costs while iterating, and WebLoader next to webdataset's.

Plain iteration through ``WebLoader`` and torch's ``DataLoader`` (2 workers) over the
tiny workload, in one run, alternating, best of ``--repeat``:

- a resumable pipeline (``WebDataset(...).shuffle().to_tuple().batched(64)``) through
  ``WebLoader``, which attaches each worker's state to every batch, and through torch's
  ``DataLoader``, which does not: the difference is the cost of resumability;
- the same shape of pipeline made non-resumable by a generator of the user's own as its
  sample source: ``WebLoader`` takes no state at all for it;
- the resumable pipeline yielding single samples (``batch_size=None``, no batching), the
  worst case: a state per sample;
- webdataset 1.0.2's ``WebLoader`` over the same pipeline, for reference.

    python bench/bench_loader.py [--repeat 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def own_source(wds):
    """A trainer's own sample source, composed from upstream's building blocks (not resumable)."""
    from importlib import import_module

    t = import_module(wds.__name__ + ".tariterators")

    def samples(src):
        return t.group_by_keys(t.tar_file_expander(t.url_opener(src)))

    return samples


def build(wds, spec: str, kind: str):
    if kind == "own-source":
        return wds.DataPipeline(wds.SimpleShardList(spec), wds.split_by_worker, own_source(wds), wds.shuffle(1000),
                                wds.to_tuple("txt", "cls"), wds.batched(64))
    ds = wds.WebDataset(spec, shardshuffle=False).shuffle(1000).to_tuple("txt", "cls")
    return ds if kind == "samples" else ds.batched(64)


def run(loader, batched: bool) -> int:
    n = 0
    for item in loader:
        n += len(item[0]) if batched else 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    import torch

    import wds_cloud

    peer = common.peer()
    spec, _ = common.dataset("tiny", 8, 25000, common.tiny)
    w = args.workers
    configs = {
        "resumable, WebLoader": lambda: wds_cloud.WebLoader(build(wds_cloud, spec, "batched"), batch_size=None,
                                                            num_workers=w),
        "resumable, DataLoader": lambda: torch.utils.data.DataLoader(build(wds_cloud, spec, "batched"),
                                                                     batch_size=None, num_workers=w),
        "own source, WebLoader": lambda: wds_cloud.WebLoader(build(wds_cloud, spec, "own-source"),
                                                             batch_size=None, num_workers=w),
        "own source, DataLoader": lambda: torch.utils.data.DataLoader(build(wds_cloud, spec, "own-source"),
                                                                      batch_size=None, num_workers=w),
        "samples, WebLoader": lambda: wds_cloud.WebLoader(build(wds_cloud, spec, "samples"), batch_size=None,
                                                          num_workers=w),
        "samples, DataLoader": lambda: torch.utils.data.DataLoader(build(wds_cloud, spec, "samples"),
                                                                   batch_size=None, num_workers=w),
        "webdataset 1.0.2, WebLoader": lambda: peer.WebLoader(build(peer, spec, "batched"), batch_size=None,
                                                              num_workers=w),
    }
    best: dict[str, float] = {}
    for r in range(args.repeat):
        for name, make in configs.items():
            loader = make()
            start = time.perf_counter()
            n = run(loader, not name.startswith("samples"))
            rate = n / (time.perf_counter() - start)
            best[name] = max(best.get(name, 0.0), rate)
        print(f"round {r + 1}/{args.repeat} done", file=sys.stderr, flush=True)
    rows = [[name, f"{rate:,.0f}"] for name, rate in best.items()]
    print(common.table(rows, ["configuration (tiny, 2 workers)", "samples/s"]))

    def ratio(a: str, b: str) -> str:
        return f"{best[a] / best[b] - 1:+.1%}"

    print()
    print(f"cost of resumability, batches of 64:   WebLoader vs DataLoader {ratio('resumable, WebLoader', 'resumable, DataLoader')}")
    print(f"cost of resumability, single samples:  WebLoader vs DataLoader {ratio('samples, WebLoader', 'samples, DataLoader')}")
    print(f"non-resumable pipeline (no state taken): WebLoader vs DataLoader {ratio('own source, WebLoader', 'own source, DataLoader')}")
    print(f"wds_cloud vs webdataset 1.0.2, WebLoader: {best['resumable, WebLoader'] / best['webdataset 1.0.2, WebLoader']:.2f}x")


if __name__ == "__main__":
    main()
