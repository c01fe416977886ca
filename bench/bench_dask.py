"""Dask benchmark: a CPU-bound function over 64 shards, one process against a LocalCluster, and the engine's cost.

64 generated shards of 24 JPEGs (512 x 512) each; the function decodes every image and encodes it again
at quality 60 (Pillow).  Timed in ``--repeat`` alternating pairs (plain loop, then map_shards); each pair
gives a speed-up and the median of the pairs is the figure (a shared machine's speed drifts between runs,
a pair sees the same machine):

- one process: a plain loop doing the same work (read each shard with ``WebDataset``, re-encode, write
  with ``TarWriter``), what a script without a cluster would do;
- ``wds_cloud.dask.map_shards`` on the ``LocalCluster`` of ``--workers`` processes that ``map_shards`` and
  the CLI start (``cluster_client``; started before timing, as a cluster already running), goal >= 1.7x on 2
  cores;
- for comparison, the plain loop split over ``--workers`` processes with no engine (the most the machine
  gives);
- the engine's cost per shard: ``map_shards`` with a function that does nothing over 64 tiny shards on a
  1-worker cluster, less the same plain loop, per shard (goal < 50 ms).

    python bench/bench_dask.py [--repeat 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SHARDS, IMAGES, SIDE = 64, 24, 512


def reencode(sample: dict) -> dict:
    from PIL import Image

    image = Image.open(io.BytesIO(sample["jpg"]))
    image.load()
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=60)
    return {"__key__": sample["__key__"], "jpg": out.getvalue(), "cls": sample["cls"]}


def nothing(sample: dict) -> dict:
    return sample


def make_shards(folder: str, shards: int, images: int, side: int) -> list:
    import random

    from PIL import Image

    import wds_cloud as wds

    rng = random.Random(0)
    urls = []
    for s in range(shards):
        path = os.path.join(folder, f"in-{s:04d}.tar")
        with wds.TarWriter(path) as writer:
            for i in range(images):
                row = bytes(rng.getrandbits(8) for _ in range(side * 3))
                pixels = b"".join(row[k:] + row[:k] for k in range(0, side * 3 * side, side * 3 + 3))[: side * side * 3]
                pixels = pixels.ljust(side * side * 3, b"\x80")
                image = Image.frombytes("RGB", (side, side), pixels)
                out = io.BytesIO()
                image.save(out, format="JPEG", quality=90)
                writer.write({"__key__": f"{s:04d}_{i:04d}", "jpg": out.getvalue(), "cls": str(i % 10)})
        urls.append(path)
    return urls


def plain_loop(fn, urls: list, folder: str) -> float:
    import wds_cloud as wds

    started = time.perf_counter()
    for i, url in enumerate(urls):
        with wds.TarWriter(os.path.join(folder, f"out-{i:04d}.tar")) as writer:
            for sample in wds.WebDataset(url, shardshuffle=False):
                writer.write(fn({k: v for k, v in sample.items() if k == "__key__" or not k.startswith("__")}))
    return time.perf_counter() - started


def on_cluster(fn, urls: list, folder: str, client) -> float:
    from wds_cloud.dask import map_shards

    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    started = time.perf_counter()
    summary = map_shards(fn, urls, os.path.join(folder, "out-%04d.tar"), client=client)
    assert summary["done"] == len(urls) and not summary["failures"], summary
    return time.perf_counter() - started


def two_processes(pool, fn, urls: list, folder: str, workers: int) -> float:
    """The plain loop split over ``workers`` processes already started (no engine): the machine's ceiling."""
    shutil.rmtree(folder, ignore_errors=True)
    parts = [(fn, urls[k::workers], os.path.join(folder, str(k))) for k in range(workers)]
    for _, _, out in parts:
        os.makedirs(out)
    started = time.perf_counter()
    pool.starmap(plain_loop, parts)
    return time.perf_counter() - started


def alternate(fn, urls: list, folder: str, client, repeat: int, pool=None, workers: int = 2) -> tuple:
    """``repeat`` alternating runs of the plain loop, of map_shards and (with ``pool``) of the plain loop in
    ``workers`` processes, after one untimed run of each (the workers import our code once, as on a cluster
    already running): (plain seconds, cluster seconds, processes seconds)."""
    on_cluster(fn, urls, os.path.join(folder, "dask"), client)
    if pool is not None:
        two_processes(pool, fn, urls, os.path.join(folder, "procs"), workers)
    plain, cluster, procs = [], [], []
    for _ in range(repeat):
        out = os.path.join(folder, "plain")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        plain.append(plain_loop(fn, urls, out))
        cluster.append(on_cluster(fn, urls, os.path.join(folder, "dask"), client))
        if pool is not None:
            procs.append(two_processes(pool, fn, urls, os.path.join(folder, "procs"), workers))
    return plain, cluster, procs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("distributed").setLevel(logging.ERROR)
    root = tempfile.mkdtemp(prefix="bench-dask-")
    try:
        data, tiny = os.path.join(root, "data"), os.path.join(root, "tiny")
        os.makedirs(data)
        os.makedirs(tiny)
        urls = make_shards(data, SHARDS, IMAGES, SIDE)
        tiny_urls = make_shards(tiny, SHARDS, 2, 16)
        import multiprocessing

        from wds_cloud.dask import cluster_client

        with (
            cluster_client(workers=args.workers) as client,
            multiprocessing.get_context("spawn").Pool(args.workers) as pool,
        ):  # the cluster map_shards starts
            one, many, procs = alternate(
                reencode, urls, os.path.join(root, "big"), client, args.repeat, pool, args.workers
            )
        with cluster_client(workers=1) as client:
            base, engine, _ = alternate(nothing, tiny_urls, os.path.join(root, "tiny-out"), client, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{SHARDS} shards of {IMAGES} JPEGs ({SIDE} x {SIDE}), each decoded and encoded again; "
        f"{os.cpu_count()} cores; {args.repeat} pairs\n"
    )
    paired = statistics.median(p / c for p, c in zip(one, many))
    print("| run | best seconds | shards/s | speed-up |")
    print("|---|---|---|---|")
    print(f"| one process (plain loop) | {min(one):.2f} | {SHARDS / min(one):.1f} | 1.00x |")
    print(
        f"| map_shards, LocalCluster of {args.workers} workers | {min(many):.2f} | {SHARDS / min(many):.1f} | "
        f"**{paired:.2f}x** median of the paired runs, {min(one) / min(many):.2f}x best against best "
        "(goal >= 1.7x) |"
    )
    print(
        f"| for comparison: the plain loop in {args.workers} processes, no engine | {min(procs):.2f} | "
        f"{SHARDS / min(procs):.1f} | {statistics.median(p / c for p, c in zip(one, procs)):.2f}x (the machine's "
        "ceiling) |"
    )
    print(
        "\nall runs (s), one process/cluster/processes: "
        + ", ".join(f"{p:.2f}/{c:.2f}/{q:.2f}" for p, c, q in zip(one, many, procs))
    )
    per_shard = (min(engine) - min(base)) / SHARDS
    print(
        f"\nengine cost: {SHARDS} tiny shards, a function that does nothing, 1 worker: map_shards "
        f"{min(engine):.2f} s, plain loop {min(base):.2f} s: **{per_shard * 1000:.1f} ms per shard** (goal < 50 ms)"
    )


if __name__ == "__main__":
    main()
