"""Reading shards over an emulated distant link: wds_cloud and webdataset 1.0.2 side by side.

A loopback HTTP server (``tests/servers.py``) sits behind ``wds_cloud.testing.faults.FaultProxy`` in
its own process, which holds each response back by a first-byte latency and paces every connection
to a bandwidth, as a TCP stream to a distant bucket is.  Each reader iterates all shards once; printed:
MB/s, time to the first sample, and the ratio to webdataset.  wds_cloud reads each shard as parallel
ranged parts and requests the next shard ahead (connections measured per host, the defaults);
webdataset reads one stream per shard.  Also printed: throughput against a fixed concurrency (and the
default's first pass on a new host against the best of them), and through resets.

    python bench/bench_wan.py                        # everything below
    python bench/bench_wan.py --links 30:50 --sets small --modes process
    python bench/bench_wan.py --only curve           # one table: main, curve or resets
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402

from tests import cloud  # noqa: E402

#: name -> (shards, samples per shard, bytes per sample): 8 x ~22 MB and 4 x ~128 MB of JPEG-sized samples
SETS = {"small": (8, 64, 340_000), "large": (4, 376, 340_000)}

PROXY = (
    "import sys, time\nfrom wds_cloud.testing.faults import FaultProxy\n"
    "p = FaultProxy(sys.argv[1], latency=float(sys.argv[2]), rate=float(sys.argv[3]),"
    " reset_after=int(sys.argv[4]) or None)\n"
    "print(p.port, flush=True)\ntime.sleep(1e9)\n"
)


def sample(i: int) -> dict:
    return {"jpg": os.urandom(SETS["small"][2]), "cls": b"%d" % (i % 1000)}


def read(make, url: str, workers: int) -> tuple[float, float, int]:
    """(seconds for all, seconds to the first sample, bytes of sample data)."""
    started = time.perf_counter()
    first = None
    total = 0
    dataset = make(url)
    if workers:
        import torch.utils.data

        dataset = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    for s in dataset:
        if first is None:
            first = time.perf_counter() - started
        total += len(s["jpg"])
    return time.perf_counter() - started, first or 0.0, total


class Link:
    """The emulated link (a proxy process) in front of the server, as a context manager."""

    def __init__(self, port: int, latency_ms: float, mbps: float, reset_after: int = 0) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                PROXY,
                f"http://127.0.0.1:{port}",
                str(latency_ms / 1000),
                str(mbps * 1e6),
                str(reset_after),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )

    def __enter__(self) -> int:
        assert self.proc.stdout is not None
        return int(self.proc.stdout.readline())

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", default="30:50,80:20", help="latency_ms:MB_per_s pairs, comma separated")
    parser.add_argument("--sets", default="small,large", help=f"datasets among {', '.join(SETS)}")
    parser.add_argument(
        "--modes", default="process,loader", help="process (one process), loader (DataLoader, 2 workers)"
    )
    parser.add_argument("--only", choices=["main", "curve", "resets"], help="print one table only")
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    import wds_cloud as wds

    peer = common.peer()
    readers = {
        "wds_cloud": lambda url: wds.WebDataset(url, shardshuffle=False),
        "webdataset 1.0.2": lambda url: peer.WebDataset(url, shardshuffle=False),
    }
    links = [tuple(float(x) for x in link.split(":")) for link in args.links.split(",")]
    for set_name in args.sets.split(","):
        shards, per_shard, _ = SETS[set_name]
        spec, size = common.dataset(f"wan-{set_name}" if set_name != "small" else "wan", shards, per_shard, sample)
        directory = os.path.dirname(spec)
        port = cloud.free_port()
        server = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(HERE), "tests", "servers.py"), "http", str(port), directory],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        name = os.path.basename(spec)
        try:
            cloud.wait_for_port(port, server, "HTTP server", timeout=300)
            for make in readers.values():  # imports and plugins loaded before any clock starts
                next(iter(make(f"http://127.0.0.1:{port}/{name.split('{')[0]}0000.tar")))
            if "loader" in args.modes:  # worker start-up machinery warmed, not in the first loader run's figures
                import torch.utils.data

                list(torch.utils.data.DataLoader(list(range(4)), batch_size=None, num_workers=2))
            from wds_cloud.io import concurrency

            concurrency.forget()  # the warm-up read above was on the server itself, not through a link
            print(f"\n### {set_name}: {shards} shards, {size / 1e6:.0f} MB\n", flush=True)
            if args.only in (None, "main"):
                print("| link | mode | reader | MB/s | first sample | ratio |")
                print("|---|---|---|---|---|---|")
                for latency_ms, mbps in links:
                    for mode in args.modes.split(","):
                        workers = 2 if mode == "loader" else 0
                        with Link(port, latency_ms, mbps) as proxy_port:
                            url = f"http://127.0.0.1:{proxy_port}/{name}"
                            rates = {}
                            for reader, make in readers.items():
                                seconds, first, total = read(make, url, workers)
                                rates[reader] = total / seconds / 1e6
                                shown = "one process" if not workers else "DataLoader, 2 workers"
                                ratio = (
                                    f"{rates['wds_cloud'] / rates[reader]:.2f}x (wds_cloud / webdataset)"
                                    if reader != "wds_cloud"
                                    else ""
                                )
                                print(
                                    f"| {latency_ms:.0f} ms, {mbps:.0f} MB/s per connection | {shown} | {reader} | "
                                    f"{rates[reader]:.1f} | {first * 1000:.0f} ms | {ratio} |",
                                    flush=True,
                                )
            latency_ms, mbps = links[0]
            if args.only in (None, "curve"):
                print(f"\nThroughput against parts in flight (one process, {latency_ms:.0f} ms, {mbps:.0f} MB/s):\n")
                print("| concurrency | MB/s | first sample |")
                print("|---|---|---|")
                rates = {}
                with Link(port, latency_ms, mbps) as proxy_port:  # a new host: the default starts from nothing
                    url = f"http://127.0.0.1:{proxy_port}/{name}"
                    for level in (1, 2, 4, 8, 12, 16, None):
                        seconds, first, total = read(
                            lambda u: wds.WebDataset(u, shardshuffle=False, concurrency=level), url, 0
                        )
                        rates[level] = total / seconds / 1e6
                        label = level if level is not None else "measured (default), first pass on this host"
                        print(f"| {label} | {rates[level]:.1f} | {first * 1000:.0f} ms |", flush=True)
                    seconds, first, total = read(lambda u: wds.WebDataset(u, shardshuffle=False), url, 0)
                    print(
                        f"| measured (default), second pass (level learned) | {total / seconds / 1e6:.1f} | "
                        f"{first * 1000:.0f} ms |",
                        flush=True,
                    )
                best = max((level for level in rates if level is not None), key=rates.get)
                print(
                    f"\nmeasured, first pass: {rates[None] / rates[best]:.2f}x of the best fixed level "
                    f"({best}: {rates[best]:.1f} MB/s)",
                    flush=True,
                )
            if args.only in (None, "resets"):
                print(f"\nEvery connection reset after 4 MB ({latency_ms:.0f} ms, {mbps:.0f} MB/s, one process):\n")
                print("| reader | clean MB/s | with resets MB/s | share of clean |")
                print("|---|---|---|---|")
                make = readers["wds_cloud"]
                with Link(port, latency_ms, mbps) as proxy_port:
                    seconds, _, total = read(make, f"http://127.0.0.1:{proxy_port}/{name}", 0)
                    clean = total / seconds / 1e6
                with Link(port, latency_ms, mbps, reset_after=4_000_000) as proxy_port:
                    seconds, _, total = read(make, f"http://127.0.0.1:{proxy_port}/{name}", 0)
                    faulty = total / seconds / 1e6
                print(f"| wds_cloud | {clean:.1f} | {faulty:.1f} | {faulty / clean:.0%} |", flush=True)
        finally:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
