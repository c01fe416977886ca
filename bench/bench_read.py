"""Reading benchmark: wds_cloud against webdataset 1.0.2, side by side in one process.

Generates (once) the workloads of the reading issue under bench/_data, then for
each workload alternates the two readers over the same page-cached shards,
keeps each one's best of ``--repeat`` runs, and prints samples/s, MB/s and the
ratio.  Peak resident memory is measured per (reader, workload) in a child
process (``--peak`` mode), since a process's peak only ever grows; resident
memory after each of three epochs shows whether it stays flat.

    python bench/bench_read.py [--repeat 3] [--only tiny,medium,large,decode]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

WORKLOADS = {
    "tiny": (8, 25000, common.tiny),  # 200,000 samples of (100-byte txt, cls)
    "medium": (8, 1000, common.medium),  # 8,000 samples of (~15.5 KB jpg, json, cls: ~23 KB of tar each)
    "large": (4, 16, common.large),  # 64 samples of 8 MB npy
}


def build(impl: str, workload: str, spec: str):
    if impl == "wds_cloud":
        import wds_cloud as wds
    else:
        wds = common.peer()
    ds = wds.WebDataset(spec, shardshuffle=False)
    if workload == "decode":
        ds = ds.decode("rgb8").to_tuple("jpg", "cls")
    return ds


def count(ds) -> int:
    n = 0
    for _ in ds:
        n += 1
    return n


def readinto_rate(spec: str) -> float:
    """Bytes/s of reading the same files into a preallocated buffer with readinto."""
    import braceexpand

    files = list(braceexpand.braceexpand(spec))
    buf = bytearray(max(os.path.getsize(f) for f in files))
    view = memoryview(buf)
    best = 0.0
    for _ in range(3):
        n, seconds = common.timed(lambda: sum(_readinto(f, view) for f in files))
        best = max(best, n / seconds)
    return best


def _readinto(path: str, view) -> int:
    with open(path, "rb", buffering=0) as f:
        return f.readinto(view)


def peak_child(impl: str, workload: str, spec: str) -> None:
    ds = build(impl, workload, spec)
    flat = []
    for _ in range(3):
        count(ds)
        flat.append(common.rss_mb())
    print(f"{common.peak_rss_mb():.0f} {' '.join(f'{x:.0f}' for x in flat)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="tiny,medium,large,decode")
    parser.add_argument("--peak", nargs=3, metavar=("IMPL", "WORKLOAD", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        peak_child(*args.peak)
        return
    common.peer()
    specs = {}
    for name, (nshards, per_shard, make) in WORKLOADS.items():
        specs[name] = common.dataset(name, nshards, per_shard, make)
    specs["decode"] = specs["medium"]
    rows = []
    for workload in args.only.split(","):
        spec, nbytes = specs[workload]
        best = {}
        for _ in range(args.repeat):
            for impl in ("wds_cloud", "webdataset"):
                n, seconds = common.timed(lambda: count(build(impl, workload, spec)))
                rate = n / seconds
                if rate > best.get(impl, (0,))[0]:
                    best[impl] = (rate, nbytes / seconds / 1e6, n)
        peaks = {}
        for impl in ("wds_cloud", "webdataset"):
            out = subprocess.run(
                [sys.executable, __file__, "--peak", impl, workload, spec], capture_output=True, text=True, check=True
            ).stdout.split()
            peaks[impl] = (out[0], "/".join(out[1:]))
        ours, theirs = best["wds_cloud"], best["webdataset"]
        note = ""
        if workload == "large":
            ceiling = readinto_rate(spec) / 1e6
            note = (
                f"readinto {ceiling:,.0f} MB/s; wds_cloud {100 * ours[1] / ceiling:.0f}%, "
                f"webdataset {100 * theirs[1] / ceiling:.0f}%"
            )
        rows.append(
            [
                workload,
                ours[2],
                f"{ours[0]:,.0f}",
                f"{theirs[0]:,.0f}",
                f"{ours[1]:,.0f}",
                f"{theirs[1]:,.0f}",
                f"{ours[0] / theirs[0]:.2f}x",
                f"{peaks['wds_cloud'][0]} / {peaks['webdataset'][0]}",
                f"{peaks['wds_cloud'][1]} | {peaks['webdataset'][1]}",
                note,
            ]
        )
        print(
            f"{workload}: wds_cloud {ours[0]:,.0f} samples/s, webdataset {theirs[0]:,.0f} samples/s, "
            f"ratio {ours[0] / theirs[0]:.2f}x {note}",
            flush=True,
        )
    print()
    print(
        common.table(
            rows,
            [
                "workload",
                "samples",
                "ours/s",
                "peer/s",
                "ours MB/s",
                "peer MB/s",
                "ratio",
                "peak RSS MB ours/peer",
                "RSS per epoch ours | peer",
                "note",
            ],
        )
    )


if __name__ == "__main__":
    main()
