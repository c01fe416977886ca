"""Reading shards over an emulated distant link: wds_cloud and webdataset 1.0.2 side by side.

A loopback HTTP server (``tests/servers.py``) sits behind ``wds_cloud.testing.faults.FaultProxy`` in
its own process, which holds each response back by a first-byte latency and paces every connection
to a bandwidth, as a TCP stream to a distant bucket is.  Each reader iterates all shards once (one
process, no DataLoader); printed: MB/s, time to the first sample, and the ratio.  This is the baseline
of the parallel-ranged-read work: one stream is bound by one connection's bandwidth.

    python bench/bench_wan.py                 # links of 30 ms / 50 MB/s and 80 ms / 20 MB/s
    python bench/bench_wan.py --links 30:50   # one link: latency in ms, MB/s per connection
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

SHARDS, PER_SHARD, SIZE = 8, 64, 340_000  # 8 shards of ~22 MB

PROXY = ("import sys, time\nfrom wds_cloud.testing.faults import FaultProxy\n"
         "p = FaultProxy(sys.argv[1], latency=float(sys.argv[2]), rate=float(sys.argv[3]))\n"
         "print(p.port, flush=True)\ntime.sleep(1e9)\n")


def sample(i: int) -> dict:
    return {"jpg": os.urandom(SIZE), "cls": b"%d" % (i % 1000)}


def read(make, url: str) -> tuple[float, float, int]:
    """(seconds for all, seconds to the first sample, bytes of sample data)."""
    started = time.perf_counter()
    first = None
    total = 0
    for s in make(url):
        if first is None:
            first = time.perf_counter() - started
        total += len(s["jpg"])
    return time.perf_counter() - started, first or 0.0, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", default="30:50,80:20", help="latency_ms:MB_per_s pairs, comma separated")
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    import wds_cloud as wds

    peer = common.peer()
    spec, size = common.dataset("wan", SHARDS, PER_SHARD, sample)
    directory = os.path.dirname(spec)
    port = cloud.free_port()
    server = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(HERE), "tests", "servers.py"), "http",
                               str(port), directory], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    readers = {
        "wds_cloud": lambda url: wds.WebDataset(url, shardshuffle=False),
        "webdataset 1.0.2": lambda url: peer.WebDataset(url, shardshuffle=False),
    }
    try:
        cloud.wait_for_port(port, server, "HTTP server", timeout=120)
        print(f"{SHARDS} shards, {size / 1e6:.0f} MB; one process, one pass each\n")
        print("| link | reader | MB/s | first sample | ratio |")
        print("|---|---|---|---|---|")
        for link in args.links.split(","):
            latency_ms, mbps = (float(x) for x in link.split(":"))
            proxy = subprocess.Popen([sys.executable, "-c", PROXY, f"http://127.0.0.1:{port}",
                                      str(latency_ms / 1000), str(mbps * 1e6)], stdout=subprocess.PIPE, text=True)
            try:
                proxy_port = int(proxy.stdout.readline())
                name = os.path.basename(spec)
                url = f"http://127.0.0.1:{proxy_port}/{name}"
                rates = {}
                for reader, make in readers.items():
                    seconds, first, total = read(make, url)
                    rates[reader] = total / seconds / 1e6
                    ratio = rates[reader] / rates["wds_cloud"] if reader != "wds_cloud" else 1.0
                    print(f"| {latency_ms:.0f} ms, {mbps:.0f} MB/s per connection | {reader} | "
                          f"{rates[reader]:.1f} | {first * 1000:.0f} ms | "
                          f"{'' if reader == 'wds_cloud' else f'wds_cloud {1 / ratio:.2f}x'} |", flush=True)
            finally:
                proxy.kill()
                proxy.wait()
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
