"""Loader benchmark: what resumability costs while iterating, and WebLoader next to webdataset's.

Plain iteration through ``WebLoader`` and torch's ``DataLoader`` (2 workers) over the
tiny workload (and the decoded medium one), in one run, alternating, best of ``--repeat``:

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


def build(wds, spec: str, kind: str, batch: int = 64):
    if kind == "own-source":
        return wds.DataPipeline(
            wds.SimpleShardList(spec),
            wds.split_by_worker,
            own_source(wds),
            wds.shuffle(1000),
            wds.to_tuple("txt", "cls"),
            wds.batched(batch),
        )
    if kind == "decode":
        return (
            wds.WebDataset(spec, shardshuffle=False).shuffle(1000).decode("rgb8").to_tuple("jpg", "cls").batched(batch)
        )
    ds = wds.WebDataset(spec, shardshuffle=False).shuffle(1000).to_tuple("txt", "cls")
    return ds if kind == "samples" else ds.batched(batch)


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
    medium, _ = common.dataset("medium", 8, 1000, common.medium)
    w = args.workers
    ours, peer_loader, torch_loader = wds_cloud.WebLoader, peer.WebLoader, torch.utils.data.DataLoader

    def loader(make, impl, src, kind, batch=64):
        return lambda: make(build(impl, src, kind, batch), batch_size=None, num_workers=w)

    configs = {
        "tiny, batches of 64, WebLoader": loader(ours, wds_cloud, spec, "batched"),
        "tiny, batches of 64, DataLoader": loader(torch_loader, wds_cloud, spec, "batched"),
        "tiny, batches of 256, WebLoader": loader(ours, wds_cloud, spec, "batched", 256),
        "tiny, batches of 256, DataLoader": loader(torch_loader, wds_cloud, spec, "batched", 256),
        "tiny, own source, WebLoader": loader(ours, wds_cloud, spec, "own-source"),
        "tiny, own source, DataLoader": loader(torch_loader, wds_cloud, spec, "own-source"),
        "tiny, single samples, WebLoader": loader(ours, wds_cloud, spec, "samples"),
        "tiny, single samples, DataLoader": loader(torch_loader, wds_cloud, spec, "samples"),
        "medium decoded, batches of 64, WebLoader": loader(ours, wds_cloud, medium, "decode"),
        "medium decoded, batches of 64, DataLoader": loader(torch_loader, wds_cloud, medium, "decode"),
        "tiny, batches of 64, webdataset 1.0.2 WebLoader": loader(peer_loader, peer, spec, "batched"),
    }
    best: dict[str, float] = {}
    for r in range(args.repeat):
        for name, make in configs.items():
            start = time.perf_counter()
            n = run(make(), "single samples" not in name)
            rate = n / (time.perf_counter() - start)
            best[name] = max(best.get(name, 0.0), rate)
        print(f"round {r + 1}/{args.repeat} done", file=sys.stderr, flush=True)
    rows = [[name, f"{rate:,.0f}"] for name, rate in best.items()]
    print(common.table(rows, [f"configuration ({w} workers)", "samples/s"]))
    print()
    print("WebLoader vs torch DataLoader over the same pipeline (the cost of taking a state with every item):")
    for case in (
        "tiny, batches of 64",
        "tiny, batches of 256",
        "medium decoded, batches of 64",
        "tiny, single samples",
        "tiny, own source",
    ):
        ratio = best[f"{case}, WebLoader"] / best[f"{case}, DataLoader"] - 1
        note = "  (not resumable: no state is taken)" if "own source" in case else ""
        print(f"  {case:32s} {ratio:+.1%}{note}")
    print(
        f"wds_cloud vs webdataset 1.0.2, WebLoader, tiny batches of 64: "
        f"{best['tiny, batches of 64, WebLoader'] / best['tiny, batches of 64, webdataset 1.0.2 WebLoader']:.2f}x"
    )


if __name__ == "__main__":
    main()
