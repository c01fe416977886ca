"""Random access: wds_cloud's ShardListDataset (one ranged read per sample, guided by an index) and
wids 0.1.11 (downloads each shard whole, then reads it mapped) side by side, over a loopback HTTP server
and moto's S3 server (wids reads s3:// with the `aws` command: pip install awscli).

1,000 random samples out of 64 shards x 1,000 samples (~22 KB JPEG-sized fields).  Printed: time to the
first sample (median of 5 cold starts: a new dataset, no kept connection, an empty cache), samples/s, and
bytes that crossed the network (counted by a proxy both readers go through);
then both readers with their local copies warm (our shard cache, wids' download cache); and the rate of
`wds-cloud index` over the local shards next to a plain read of them.  wids is installed only in the
benchmark environment (pip install wids==0.1.11), never as a dependency.

    python bench/bench_index.py [--shards 64] [--samples 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402

from tests import cloud  # noqa: E402

PER_SHARD, SIZE = 1000, 22_000


def sample(i: int) -> dict:
    return {"jpg": os.urandom(SIZE), "cls": b"%d" % (i % 1000)}


def wids_module():
    try:
        import wids
    except ImportError:
        raise SystemExit(
            "this benchmark compares with wids 0.1.11, which is not a dependency of wds_cloud; "
            "install it in the benchmark environment: pip install wids==0.1.11"
        )
    return wids


@contextlib.contextmanager
def quiet_stdout():
    """Child processes' stdout (wids' `aws s3 cp` progress lines) to /dev/null while a reader runs."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def first_sample(make, picks: list[int], repeats: int = 5) -> float:
    """Median seconds from a new dataset to its first sample, each time cold as in a DataLoader worker just
    forked: plugins loaded, but no backend (no credentials, signer or client), no kept connection and no
    cache (``make`` gives each call a new cache directory).  One cold start on a shared 2-core machine
    varies by 2-3x (the servers' threads, the page cache), so one figure alone says little."""
    from wds_cloud.io import registry
    from wds_cloud.io.keepalive import POOL

    times = []
    for i in range(repeats):
        POOL.clear()
        registry._after_fork_in_child()
        started = time.perf_counter()
        assert make()[picks[i]]["__key__"]
        times.append(time.perf_counter() - started)
    POOL.clear()
    return statistics.median(times)


def run(make, picks: list[int], proxy) -> tuple[float, float, int]:
    """(seconds to the first sample, samples/s over all, bytes through the proxy)."""
    before = proxy.bytes_forwarded if proxy is not None else 0
    started = time.perf_counter()
    dataset = make()
    first = None
    for i in picks:
        s = dataset[i]
        assert s["__key__"]
        if first is None:
            first = time.perf_counter() - started
    seconds = time.perf_counter() - started
    if proxy is not None:
        proxy.wait_idle()
    return first or 0.0, len(picks) / seconds, (proxy.bytes_forwarded - before) if proxy is not None else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--no-s3", dest="s3", action="store_false", help="leave out the S3 (moto) run")
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    import wds_cloud as wds
    from wds_cloud.cli import main as cli
    from wds_cloud.index import build_index
    from wds_cloud.testing.faults import FaultProxy

    wids = wids_module()
    spec, size = common.dataset("index", args.shards, PER_SHARD, sample)
    directory = os.path.dirname(spec)
    names = sorted(n for n in os.listdir(directory) if n.endswith(".tar"))[: args.shards]

    # indexing rate, local
    for name in names:
        for stale in (name + ".index.json",):
            if os.path.exists(os.path.join(directory, stale)):
                os.unlink(os.path.join(directory, stale))
    raw = 0.0
    for _ in range(2):  # the second pass reads from the page cache, as the indexing below does
        started = time.perf_counter()
        for name in names:
            with open(os.path.join(directory, name), "rb") as f:
                while f.read(1 << 20):
                    pass
        raw = max(raw, size / (time.perf_counter() - started))
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["index", spec]) == 0  # local shards: one at a time by default
    indexed = size / (time.perf_counter() - started)
    started = time.perf_counter()
    for name in names:
        build_index(os.path.join(directory, name))
    built = size / (time.perf_counter() - started)
    print(f"\n{args.shards} shards, {size / 1e6:.0f} MB; {args.samples} random samples (seed 0)\n")
    print(
        f"plain read of the shards: {raw / 1e6:.0f} MB/s; wds_cloud.index.build_index: {built / 1e6:.0f} MB/s "
        f"({built / raw:.0%}); `wds-cloud index` (sidecars written): {indexed / 1e6:.0f} MB/s "
        f"({indexed / raw:.0%})\n"
    )

    port = cloud.free_port()
    server = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(HERE), "tests", "servers.py"), "http", str(port), directory],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    proxy = None
    picks = random.Random(0).sample(range(args.shards * PER_SHARD), args.samples)
    try:
        cloud.wait_for_port(port, server, "HTTP server", timeout=600)
        proxy = FaultProxy(f"http://127.0.0.1:{port}")
        base = proxy.url
        shardlist = [{"url": f"{base}/{n}", "nsamples": PER_SHARD} for n in names]
        wids_cache = tempfile.mkdtemp(prefix="wids-cache-")
        our_cache = tempfile.mkdtemp(prefix="wds-cache-")
        readers = {
            "wds_cloud": lambda: wds.ShardListDataset(shardlist, transformations=[]),
            "wids 0.1.11": lambda: wids.ShardListDataset(shardlist, cache_dir=wids_cache, transformations=[]),
        }
        print("| store | reader | first sample | samples/s | bytes transferred | ratio |")
        print("|---|---|---|---|---|---|")
        cold = {
            "wds_cloud": readers["wds_cloud"],
            "wids 0.1.11": lambda: wids.ShardListDataset(
                shardlist, cache_dir=tempfile.mkdtemp(dir=wids_cache), transformations=[]
            ),
        }
        results = {}
        for reader, make in readers.items():
            _, rate, moved = run(make, picks, proxy)
            results[reader] = (first_sample(cold[reader], picks[1:]), rate, moved)
        ours, theirs = results["wds_cloud"], results["wids 0.1.11"]
        for reader, (first, rate, moved) in results.items():
            ratio = (
                f"first sample {theirs[0] / ours[0]:.0f}x sooner, {theirs[2] / max(ours[2], 1):.0f}x fewer bytes"
                if reader == "wds_cloud"
                else ""
            )
            print(
                f"| http | {reader} | {first * 1000:.0f} ms | {rate:.0f} | {moved / 1e6:.1f} MB | {ratio} |", flush=True
            )
        # warm local copies: ours in the shard cache, wids' downloads already there
        warm = {
            "wds_cloud (cache_dir, warm)": lambda: wds.ShardListDataset(
                shardlist, transformations=[], cache_dir=our_cache
            ),
            "wids 0.1.11 (cache, warm)": readers["wids 0.1.11"],
        }
        for make in warm.values():  # fill
            run(make, picks, proxy)
        print("\n| local copies | reader | samples/s |")
        print("|---|---|---|")
        rates = {}
        for reader, make in warm.items():
            rates[reader] = max(run(make, picks, None)[1] for _ in range(3))
        ours_warm, theirs_warm = rates.values()
        for reader, rate in rates.items():
            extra = f" ({ours_warm / theirs_warm:.0%} of wids)" if reader.startswith("wds_cloud") else ""
            print(f"| warm | {reader} | {rate:.0f}{extra} |", flush=True)
        shutil.rmtree(wids_cache, ignore_errors=True)
        shutil.rmtree(our_cache, ignore_errors=True)
    finally:
        if proxy is not None:
            proxy.stop()
        server.kill()
        server.wait()
    if args.s3:
        s3(args, names, directory, picks, wds, wids, FaultProxy)


def s3(args, names, directory, picks, wds, wids, FaultProxy) -> None:
    """The same over moto's S3 server (its own process); wids reads s3:// with `aws s3 cp`."""
    import boto3

    if shutil.which("aws") is None:
        print("\n(s3 skipped: wids needs the `aws` command; pip install awscli)")
        return
    port = cloud.free_port()
    moto = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "moto_server"), "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    proxy = None
    saved = {
        k: os.environ.get(k)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")
    }
    try:
        cloud.wait_for_port(port, moto, "moto", timeout=120)
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
        )
        client.create_bucket(Bucket="bench")
        for name in names:
            client.upload_file(os.path.join(directory, name), "bench", name)
            client.upload_file(os.path.join(directory, name + ".index.json"), "bench", name + ".index.json")
        proxy = FaultProxy(endpoint)
        os.environ.update(
            AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_ENDPOINT_URL=proxy.url, AWS_DEFAULT_REGION="us-east-1"
        )
        shardlist = [{"url": f"s3://bench/{n}", "nsamples": PER_SHARD} for n in names]
        wids_cache = tempfile.mkdtemp(prefix="wids-cache-")
        readers = {
            "wds_cloud": lambda: wds.ShardListDataset(shardlist, transformations=[]),
            "wids 0.1.11": lambda: wids.ShardListDataset(shardlist, cache_dir=wids_cache, transformations=[]),
        }
        cold = {
            "wds_cloud": readers["wds_cloud"],
            "wids 0.1.11": lambda: wids.ShardListDataset(
                shardlist, cache_dir=tempfile.mkdtemp(dir=wids_cache), transformations=[]
            ),
        }
        results = {}
        with quiet_stdout():
            for reader, make in readers.items():
                _, rate, moved = run(make, picks, proxy)
                results[reader] = (first_sample(cold[reader], picks[1:]), rate, moved)
        ours, theirs = results["wds_cloud"], results["wids 0.1.11"]
        print()
        for reader, (first, rate, moved) in results.items():
            ratio = (
                f"first sample {theirs[0] / ours[0]:.0f}x sooner, {theirs[2] / max(ours[2], 1):.0f}x fewer bytes"
                if reader == "wds_cloud"
                else ""
            )
            print(
                f"| s3 (moto) | {reader} | {first * 1000:.0f} ms | {rate:.0f} | {moved / 1e6:.1f} MB | {ratio} |",
                flush=True,
            )
        shutil.rmtree(wids_cache, ignore_errors=True)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if proxy is not None:
            proxy.stop()
        moto.kill()
        moto.wait()


if __name__ == "__main__":
    main()
