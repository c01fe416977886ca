"""Writing benchmark: wds_cloud's TarWriter against webdataset 1.0.2's, side by side in one process.

Writes the same samples to memory (io.BytesIO, so the disk does not decide)
with both writers, best of ``--repeat`` runs each, and prints samples/s, MB/s
and the ratio for tiny (100,000 x 100-byte txt + cls), medium (8,000 x ~23 KB
jpg bytes + json + cls) and large (64 x 8 MB npy bytes) samples.

    python bench/bench_write.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def workloads():
    tiny = [{"__key__": "%08d" % i, "txt": b"x" * 100, "cls": b"%d" % (i % 1000)} for i in range(100000)]
    jpg = common.medium(0)["jpg"]
    medium = [
        {"__key__": "%08d" % i, "jpg": jpg, "json": b'{"i": %d}' % i, "cls": b"%d" % (i % 10)} for i in range(8000)
    ]
    npy = common.large(0)["npy"]
    large = [{"__key__": "%08d" % i, "npy": npy} for i in range(64)]
    return {"tiny": tiny, "medium": medium, "large": large}


def write_all(impl: str, samples: list) -> int:
    if impl == "wds_cloud":
        import wds_cloud as wds
    else:
        wds = common.peer()
    out = io.BytesIO()
    writer = wds.TarWriter(out)
    for sample in samples:
        writer.write(sample)
    writer.close() if impl == "wds_cloud" else writer.tarstream.close()
    return len(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    common.peer()
    rows = []
    for name, samples in workloads().items():
        nbytes = sum(len(v) for s in samples for k, v in s.items() if k != "__key__")
        best = {}
        for _ in range(args.repeat):
            for impl in ("wds_cloud", "webdataset"):
                n, seconds = common.timed(lambda: write_all(impl, samples))
                best[impl] = max(best.get(impl, 0), n / seconds)
        ratio = best["wds_cloud"] / best["webdataset"]
        rows.append(
            [
                name,
                len(samples),
                f"{best['wds_cloud']:,.0f}",
                f"{best['webdataset']:,.0f}",
                f"{best['wds_cloud'] * nbytes / len(samples) / 1e6:,.0f}",
                f"{best['webdataset'] * nbytes / len(samples) / 1e6:,.0f}",
                f"{ratio:.2f}x",
            ]
        )
        print(f"{name}: {ratio:.2f}x", flush=True)
    print()
    print(common.table(rows, ["workload", "samples", "ours/s", "peer/s", "ours MB/s", "peer MB/s", "ratio"]))


if __name__ == "__main__":
    main()
