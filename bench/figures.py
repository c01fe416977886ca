"""Figures for the documentation: PNGs in docs/img/ and the page that shows them, docs/performance.md.

Runs our code and webdataset 1.0.2 (installed only in the benchmark environment) side by side on the
generated workloads of ``bench_read.py``, on this machine, and draws:

- ``throughput.png``: samples/s per workload, wds_cloud next to webdataset (best of ``--repeat``);
- ``loader_scaling.png``: samples/s through ``WebLoader`` by number of worker processes (tiny samples,
  batches of 64), wds_cloud next to webdataset's ``WebLoader``;
- ``cache_epochs.png``: seconds per epoch over a local HTTP server with a cost per MB, through the shard
  cache: the first epoch fills the cache, the second reads it;
- ``random_access.png``: bytes fetched to read 50 random samples of the medium workload over HTTP: our
  ``ShardListDataset`` with the shards' index files (ranged reads of the samples) against ``wids`` (which
  downloads whole shards), counted by a proxy in between;
- ``faults.png``: MB/s reading shards over HTTP through a proxy that resets every connection after a number
  of bytes (``wds_cloud.testing.faults``), every sample delivered once, against the clean rate.

Each caption says the machine and this command. Needs matplotlib (the ``docs`` extra, or
``pip install matplotlib`` in the benchmark environment)::

    bench/.venv/bin/python bench/figures.py [--repeat 2] [--workers 0,1,2,4] [--only loader_scaling,faults]

``--only`` measures and draws the figures named, and puts their new captions in the page, leaving the others
as they are (a figure whose code changed is made again without a whole run).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_read  # noqa: E402
import common  # noqa: E402

IMG = os.path.join(os.path.dirname(HERE), "docs", "img")
PAGE = os.path.join(os.path.dirname(HERE), "docs", "performance.md")


def machine() -> str:
    return f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"


def best_rate(make, repeat: int) -> float:
    best = 0.0
    for _ in range(repeat):
        n, seconds = common.timed(lambda: bench_read.count(make()))
        best = max(best, n / seconds)
    return best


def throughput(repeat: int) -> dict:
    out = {}
    for workload in ("tiny", "medium", "large", "decode"):
        nshards, per_shard, make = bench_read.WORKLOADS["medium" if workload == "decode" else workload]
        spec, _ = common.dataset("medium" if workload == "decode" else workload, nshards, per_shard, make)
        out[workload] = {
            impl: best_rate(lambda impl=impl: bench_read.build(impl, workload, spec), repeat)
            for impl in ("wds_cloud", "webdataset")
        }
        print(workload, out[workload], file=sys.stderr, flush=True)
    return out


def loader_scaling(workers: list, repeat: int) -> dict:
    import wds_cloud

    spec, _ = common.dataset("tiny", *bench_read.WORKLOADS["tiny"][:2], common.tiny)
    peer = common.peer()
    out: dict = {"wds_cloud": {}, "webdataset": {}}
    for n in workers:
        for impl, wds in (("wds_cloud", wds_cloud), ("webdataset", peer)):

            def run(wds=wds, n=n):
                ds = wds.WebDataset(spec, shardshuffle=False).to_tuple("txt", "cls").batched(64)
                return sum(len(batch[0]) for batch in wds.WebLoader(ds, batch_size=None, num_workers=n))

            best = 0.0
            for _ in range(repeat):
                count, seconds = common.timed(run)
                best = max(best, count / seconds)
            out[impl][n] = best
            print("loader", impl, n, best, file=sys.stderr, flush=True)
    return out


def serve_medium(store, base: str) -> tuple[list, int]:
    """Put the medium workload's shards on the object server ``store``: (their URLs under ``base``, bytes)."""
    import braceexpand

    spec, _ = common.dataset("medium", *bench_read.WORKLOADS["medium"][:2], common.medium)
    urls, total = [], 0
    for path in braceexpand.braceexpand(spec):
        with open(path, "rb") as f:
            data = f.read()
        store.put("/" + os.path.basename(path), data)
        urls.append(f"{base}/{os.path.basename(path)}")
        total += len(data)
    return urls, total


def whole_ticks(axis, values) -> None:
    """Ticks at the counts measured (worker processes, shards), never between them: a tick at 2.5 workers
    reads as a measurement that was never made."""
    axis.set_ticks(sorted(set(values)))


def save(fig, name: str) -> None:
    fig.tight_layout()
    fig.savefig(os.path.join(IMG, f"{name}.png"), dpi=110)


def cache_epochs(cost: float) -> list:
    import wds_cloud as wds
    from wds_cloud.testing.objects import http_server

    server, store = http_server(range_cost=cost)
    cache = tempfile.mkdtemp(prefix="figures-cache-")
    try:
        names, _ = serve_medium(store, server.url)
        seconds = []
        for _ in range(2):
            started = time.perf_counter()
            bench_read.count(wds.WebDataset(names, shardshuffle=False, cache_dir=cache))
            seconds.append(time.perf_counter() - started)
        return seconds
    finally:
        server.stop()
        shutil.rmtree(cache, ignore_errors=True)


def under_faults(resets: list) -> dict:
    import wds_cloud as wds
    from wds_cloud.testing.faults import FaultProxy
    from wds_cloud.testing.objects import http_server

    server, store = http_server()
    proxy = FaultProxy(server.url)
    out = {}
    try:
        urls, total = serve_medium(store, proxy.url)
        expected = None
        for reset in resets:
            proxy.reset_after = reset
            started = time.perf_counter()
            keys = [sample["__key__"] for sample in wds.WebDataset(urls, shardshuffle=False, concurrency=1)]
            seconds = time.perf_counter() - started
            expected = expected or keys
            assert keys == expected, "a sample lost or repeated under faults"
            out["clean" if reset is None else f"reset / {reset >> 20} MB"] = total / seconds / 1e6
            print("faults", reset, out, file=sys.stderr, flush=True)
    finally:
        proxy.stop()
        server.stop()
    return out


def random_access(n: int = 50) -> dict:
    import random

    import wds_cloud as wds
    import wds_cloud.index as index
    from wds_cloud.testing.faults import FaultProxy
    from wds_cloud.testing.objects import http_server

    server, store = http_server()
    proxy = FaultProxy(server.url)
    cache = tempfile.mkdtemp(prefix="figures-wids-")
    out = {}
    try:
        shards = []
        for url in serve_medium(store, proxy.url)[0]:
            index.write_index(index.build_index(url))  # the sidecar, as `wds-cloud index` writes it
            shards.append({"url": url, "nsamples": bench_read.WORKLOADS["medium"][1]})
        picks = random.Random(0).sample(range(sum(s["nsamples"] for s in shards)), n)
        proxy.bytes_forwarded = 0
        ours = wds.ShardListDataset(shards)
        for i in picks:
            ours[i]
        out["wds_cloud (index files)"] = proxy.bytes_forwarded / 1e6
        try:
            import wids

            proxy.bytes_forwarded = 0
            theirs = wids.ShardListDataset(shards, cache_dir=cache)
            for i in picks:
                theirs[i]
            out["wids (whole shards)"] = proxy.bytes_forwarded / 1e6
        except ImportError:
            print("wids is not installed: its bar is left out", file=sys.stderr)
        print("random access", out, file=sys.stderr, flush=True)
    finally:
        proxy.stop()
        server.stop()
        shutil.rmtree(cache, ignore_errors=True)
    return out


def draw(results: dict, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(IMG, exist_ok=True)
    where = f"{machine()}; `{command}`"
    captions = {}

    if "throughput" in results:
        draw_throughput(plt, results, where, captions)
    if "loader" in results:
        draw_loader(plt, results, where, captions)
    if "cache" in results:
        draw_cache(plt, results, where, captions)
    if "faults" in results:
        draw_faults(plt, results, where, captions)
    if "random_access" in results:
        draw_random_access(plt, results, where, captions)
    plt.close("all")
    write_page(captions)


def draw_throughput(plt, results: dict, where: str, captions: dict) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    workloads = list(results["throughput"])
    for k, impl in enumerate(("wds_cloud", "webdataset")):
        ax.bar(
            [i + 0.4 * k for i in range(len(workloads))],
            [results["throughput"][w][impl] for w in workloads],
            width=0.4,
            label=impl,
        )
    ax.set_xticks([i + 0.2 for i in range(len(workloads))], workloads)
    ax.set_yscale("log")
    ax.set_ylabel("samples/s (log)")
    ax.legend()
    save(fig, "throughput")
    captions["throughput"] = (
        "Reading local shards, samples/s per workload (tiny: 100-byte samples; medium: ~15.5 KB "
        "JPEGs; large: 8 MB arrays; decode: medium decoded to arrays), best of the runs. " + where
    )


def draw_loader(plt, results: dict, where: str, captions: dict) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for impl, rates in results["loader"].items():
        ax.plot(list(rates), list(rates.values()), marker="o", label=impl)
    whole_ticks(ax.xaxis, [n for rates in results["loader"].values() for n in rates])
    ax.set_xlabel("DataLoader worker processes")
    ax.set_ylabel("samples/s")
    ax.legend()
    save(fig, "loader_scaling")
    captions["loader_scaling"] = (
        "WebLoader over tiny samples in batches of 64, by number of workers (0: in the "
        "main process). Tiny samples cost the workers so little that the main process, which receives "
        "every batch, sets the pace: on a machine with few cores more workers are no faster than none. " + where
    )


def draw_cache(plt, results: dict, where: str, captions: dict) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(["epoch 1 (fills the cache)", "epoch 2 (reads it)"], results["cache"])
    ax.set_ylabel("seconds")
    save(fig, "cache_epochs")
    captions["cache_epochs"] = (
        "The medium workload over a local HTTP server that charges a cost per MB sent, "
        "read twice through the shard cache (cache_dir=). " + where
    )


def draw_faults(plt, results: dict, where: str, captions: dict) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(list(results["faults"]), list(results["faults"].values()))
    ax.set_ylabel("MB/s")
    save(fig, "faults")
    captions["faults"] = (
        "The medium workload (8 shards of ~15.5 KB JPEGs) over HTTP through a proxy that resets every connection "
        "after the given bytes, one connection per shard; each read delivered every sample exactly once "
        "(checked). " + where
    )


def draw_random_access(plt, results: dict, where: str, captions: dict) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    values = list(results["random_access"].values())
    ax.bar(list(results["random_access"]), values)
    for x, value in enumerate(values):
        ax.text(x, value, f"{value:.1f} MB", ha="center", va="bottom")
    ax.set_ylabel("MB fetched")
    save(fig, "random_access")
    captions["random_access"] = (
        "Reading 50 random samples (of 8,000 samples of ~15.5 KB JPEGs in 8 shards) over HTTP: the MB the server sent, "
        "counted by a proxy; ours reads each shard's index file and the samples' byte ranges, wids downloads "
        "every shard it touches. " + where
    )


TITLES = {
    "throughput": "Throughput against webdataset 1.0.2",
    "loader_scaling": "Loader scaling with workers",
    "cache_epochs": "The shard cache: epoch 1 against epoch 2",
    "faults": "Throughput under dropped connections",
    "random_access": "Random access: bytes fetched against wids",
}


def write_page(captions: dict) -> None:
    """docs/performance.md: the whole page when every figure was made, else the new captions put in place."""
    if set(captions) != set(TITLES) and os.path.exists(PAGE):
        with open(PAGE) as f:
            text = f.read()
        for name, caption in captions.items():
            image = f"![{TITLES[name]}](img/{name}.png)\n\n"
            start = text.index(image) + len(image)
            end = text.index("\n", start)
            text = text[:start] + f"*{caption}*" + text[end:]
        with open(PAGE, "w") as f:
            f.write(text)
        return
    lines = [
        "# Performance",
        "",
        "Generated by `bench/figures.py` (do not edit by hand: run it again). The benchmarks behind the "
        "figures, and more, are in `bench/`; their figures are in `bench/README.md`. They run in the benchmark "
        "environment `bench/README.md` sets up (webdataset 1.0.2 beside wds_cloud, and matplotlib: "
        "`bench/.venv/bin/pip install matplotlib`), and write the figures in `docs/img/` anew.",
        "",
    ]
    for name, caption in captions.items():
        lines += [f"## {TITLES[name]}", "", f"![{TITLES[name]}](img/{name}.png)", "", f"*{caption}*", ""]
    kept = ""
    if os.path.exists(PAGE):  # the sections other benchmarks write (between their markers) stay
        with open(PAGE) as f:
            old = f.read()
        for section in ("peers", "scale"):  # bench_peers.py, bench_scale.py
            begin, end = f"<!-- {section}: begin -->", f"<!-- {section}: end -->"
            if begin in old and end in old:
                kept += ("\n" if kept else "") + old[old.index(begin) : old.index(end) + len(end)] + "\n"
    with open(PAGE, "w") as f:
        f.write("\n".join(lines) + ("\n" + kept if kept else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workers", default="0,1,2,4")
    parser.add_argument("--cost", type=float, default=0.02, help="seconds per MB the HTTP server charges")
    parser.add_argument("--only", default=",".join(TITLES), help="the figures to make, by name: " + ", ".join(TITLES))
    args = parser.parse_args()
    only = args.only.split(",")
    unknown = sorted(set(only) - set(TITLES))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: no such figure; the figures are {', '.join(TITLES)}")
    command = "python bench/figures.py " + " ".join(sys.argv[1:])
    measures = {
        "throughput": ("throughput", lambda: throughput(args.repeat)),
        "loader_scaling": ("loader", lambda: loader_scaling([int(w) for w in args.workers.split(",")], args.repeat)),
        "cache_epochs": ("cache", lambda: cache_epochs(args.cost)),
        "faults": ("faults", lambda: under_faults([None, 16 << 20, 4 << 20, 1 << 20])),
        "random_access": ("random_access", random_access),
    }
    results = {measures[name][0]: measures[name][1]() for name in TITLES if name in only}
    draw(results, command.strip())
    print(f"wrote {IMG}/*.png and {PAGE}")


if __name__ == "__main__":
    main()
