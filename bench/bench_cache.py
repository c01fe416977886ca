"""Shard cache benchmark: epoch 1 through a cold cache, epoch 2 from it, and time to the first sample; and a cache
half the size of an epoch's shards read for three epochs (its hits per epoch, in a fixed and a shuffled order).

Serves the generated shards from our HTTP server (its own process; unpaced, and paced
to a store's bandwidth per connection, 200 MB/s by default) and reads them
with wds_cloud: without a cache, with a cold cache (epoch 1), from the filled cache
(epoch 2), and straight from the local files (the local-disk rate).  webdataset
1.0.2 does the same with its own cache over ``pipe:curl``.  Runs alternate, best
of ``--repeat``.  The loop rows (``--loop``, on by default) read 16 shards through a cache that holds 8.

    python bench/bench_cache.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402

from tests import cloud  # noqa: E402


def drain(ds, field: str) -> tuple[int, float]:
    """(payload bytes, seconds to the first sample)."""
    start = time.perf_counter()
    first = None
    n = 0
    for sample in ds:
        if first is None:
            first = time.perf_counter() - start
        n += len(sample.get(field, b""))
    return n, first or 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--rates", default="0,200", help="store bandwidth per connection in MB/s, comma-separated; 0 = unpaced loopback"
    )
    parser.add_argument("--data", default="large,tiny", help="the datasets to read, comma-separated")
    parser.add_argument("--loop", type=int, default=1, help="1: also the loop bigger than the cache; 0: skip it")
    parser.add_argument("--only-loop", action="store_true", help="only the loop bigger than the cache")
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    import braceexpand

    import wds_cloud as wds

    peer = common.peer()
    rows = []
    cases = [
        (rate, name, spec_args, field)
        for rate in [float(r) for r in args.rates.split(",")]
        for name, spec_args, field in (
            ("large", ("large", 4, 16, common.large), "npy"),
            ("tiny", ("tiny", 8, 25000, common.tiny), "txt"),
        )
        if name in args.data.split(",")
    ]
    if args.only_loop:
        cases = []
    for store_rate, name, spec_args, field in cases:
        spec, _ = common.dataset(*spec_args)
        paths = list(braceexpand.braceexpand(spec))
        directory = tempfile.mkdtemp(prefix="bench-cache-")
        for path in paths:
            os.symlink(path, os.path.join(directory, os.path.basename(path)))
        port = cloud.free_port()
        server = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(HERE), "tests", "servers.py"), "http", str(port), directory]
            + ([str(store_rate)] if store_rate else []),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        cloud.wait_for_port(port, server, "HTTP server", timeout=120)
        urls = [f"http://127.0.0.1:{port}/{os.path.basename(p)}" for p in paths]
        cache_root = tempfile.mkdtemp(prefix="bench-cache-dir-")
        results: dict[str, list] = {k: [] for k in ("local", "nocache", "epoch1", "epoch2", "peer1", "peer2")}
        for r in range(args.repeat):
            cache_dir = os.path.join(cache_root, f"ours{r}")
            peer_dir = os.path.join(cache_root, f"peer{r}")
            os.makedirs(peer_dir)  # webdataset wants it to exist
            runs = (
                ("local", lambda: wds.WebDataset(paths, shardshuffle=False)),
                ("nocache", lambda: wds.WebDataset(urls, shardshuffle=False)),
                ("epoch1", lambda: wds.WebDataset(urls, shardshuffle=False, cache_dir=cache_dir)),
                ("epoch2", lambda: wds.WebDataset(urls, shardshuffle=False, cache_dir=cache_dir)),
                (
                    "peer1",
                    lambda: peer.WebDataset(
                        [f"pipe:curl -s {u}" for u in urls], shardshuffle=False, cache_dir=peer_dir
                    ),
                ),
                (
                    "peer2",
                    lambda: peer.WebDataset(
                        [f"pipe:curl -s {u}" for u in urls], shardshuffle=False, cache_dir=peer_dir
                    ),
                ),
            )
            for key, make in runs:
                start = time.perf_counter()
                n, first = drain(make(), field)
                results[key].append((n / (time.perf_counter() - start), first))
            shutil.rmtree(cache_dir, ignore_errors=True)
            shutil.rmtree(peer_dir, ignore_errors=True)
        cloud.stop(server)
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(cache_root, ignore_errors=True)

        def rate(key: str) -> float:
            return max(r for r, _ in results[key])

        def ttfs(key: str) -> float:
            return min(f for _, f in results[key])

        rows.append(
            [
                f"{store_rate:.0f} MB/s" if store_rate else "unpaced",
                name,
                f"{rate('local') / 1e6:,.0f}",
                f"{rate('nocache') / 1e6:,.0f}",
                f"{rate('epoch1') / 1e6:,.0f}",
                f"{rate('epoch1') / rate('nocache'):.0%}",
                f"{rate('epoch2') / 1e6:,.0f}",
                f"{rate('epoch2') / rate('local'):.0%}",
                f"{ttfs('nocache') * 1e3:.1f}",
                f"{ttfs('epoch1') * 1e3:.1f}",
                f"{ttfs('epoch1') / ttfs('nocache'):.2f}x",
                f"{rate('peer1') / 1e6:,.0f} / {rate('peer2') / 1e6:,.0f}",
                f"{ttfs('peer1') * 1e3:.1f}",
            ]
        )
        print(f"{name} (store {store_rate or 'unpaced'}): done", flush=True)
    if rows:
        print(
            common.table(
                rows,
                [
                    "store",
                    "data",
                    "local MB/s",
                    "no cache",
                    "epoch 1 cached",
                    "of no cache",
                    "epoch 2",
                    "of local",
                    "TTFS no cache ms",
                    "TTFS cold cache ms",
                    "ratio",
                    "webdataset 1.0.2 epoch 1 / 2 MB/s",
                    "webdataset TTFS ms",
                ],
            )
        )
    if args.loop or args.only_loop:
        print(loop_bigger_than_cache(wds))


def loop_bigger_than_cache(wds) -> str:
    """16 shards through a cache holding 8, three epochs, in a fixed order and shuffled each epoch: hits per epoch
    (least-recently-used eviction gives none in a fixed order), against the best any cache does, (C - 1) / W."""
    import logging

    logging.getLogger("wds_cloud.io.shardcache").setLevel(logging.ERROR)  # the thrashing warning is expected
    shards = 16
    spec, total = common.dataset("loop", shards, 2000, common.tiny)
    import braceexpand

    paths = list(braceexpand.braceexpand(spec))
    directory = tempfile.mkdtemp(prefix="bench-cache-loop-")
    for path in paths:
        os.symlink(path, os.path.join(directory, os.path.basename(path)))
    port = cloud.free_port()
    server = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(HERE), "tests", "servers.py"), "http", str(port), directory],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cloud.wait_for_port(port, server, "HTTP server", timeout=120)
    urls = [f"http://127.0.0.1:{port}/{os.path.basename(p)}" for p in paths]
    limit = max(os.path.getsize(p) for p in paths) * shards // 2
    rows = []
    for order, shuffle in (("fixed", False), ("shuffled", True)):
        cache_dir = tempfile.mkdtemp(prefix="bench-cache-loop-dir-")
        ds = wds.WebDataset(urls, shardshuffle=shuffle, seed=1, cache_dir=cache_dir, cache_size=limit)
        hits, rates = [], []
        for _ in range(3):
            before = ds.stats.cache_hits
            start = time.perf_counter()
            n, _ = drain(ds, "txt")
            rates.append(n / (time.perf_counter() - start))
            hits.append(ds.stats.cache_hits - before)
        rows.append(
            [
                f"{shards} / {shards // 2}",
                order,
                " / ".join(str(h) for h in hits),
                f"{hits[2] / shards:.0%}",
                f"{(shards // 2 - 1) / shards:.0%}",
                str(getattr(ds.stats, "cache_reuse_misses", "-")),
                f"{rates[2] / 1e6:,.1f}",
            ]
        )
        shutil.rmtree(cache_dir, ignore_errors=True)
    cloud.stop(server)
    shutil.rmtree(directory, ignore_errors=True)
    return common.table(
        rows,
        [
            "shards / cache holds",
            "order",
            "hits epoch 1 / 2 / 3",
            "epoch 3 hit rate",
            "best possible",
            "reuse misses",
            "epoch 3 MB/s",
        ],
    )


if __name__ == "__main__":
    main()
