"""Faults benchmark: throughput while every connection is reset after 4 MB, against the clean rate.

Serves the generated large shards (4 x 8 MB samples) from our HTTP server and
moto, each in its own process, behind the fault-injecting proxy of
``wds_cloud.testing.faults``; reads them with wds_cloud cleanly and with a
reset every 4 MB, and reports what webdataset 1.0.2 does under the same faults
(``pipe:curl`` and ``pipe:aws s3 cp``): its samples, and whether the read
completed.

    python bench/bench_faults.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

import common  # noqa: E402

from tests import cloud  # noqa: E402
from wds_cloud.testing.faults import FaultProxy  # noqa: E402

RESET = 4 << 20


def read(ds) -> tuple[int, int]:
    samples = nbytes = 0
    for sample in ds:
        samples += 1
        nbytes += len(sample.get("npy", b""))
    return samples, nbytes


def peer_read(peer, urls) -> str:
    try:
        samples, _ = read(peer.WebDataset(urls, shardshuffle=False, handler=peer.warn_and_continue))
        return f"{samples} samples"
    except Exception as exc:  # whatever the peer does under faults is the figure
        return f"failed: {type(exc).__name__}: {str(exc)[:60]}"


def main() -> None:
    import warnings

    warnings.simplefilter("ignore")
    import wds_cloud as wds

    peer = common.peer()
    spec, total = common.dataset("large", 4, 16, common.large)
    paths = common_files(spec)
    rows = []

    directory = tempfile.mkdtemp(prefix="bench-faults-")
    for path in paths:
        os.symlink(path, os.path.join(directory, os.path.basename(path)))
    port = cloud.free_port()
    http = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(HERE), "tests", "servers.py"), "http", str(port), directory],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cloud.wait_for_port(port, http, "HTTP server", timeout=120)
    proxy = FaultProxy(f"http://127.0.0.1:{port}")
    urls = [f"{proxy.url}/{os.path.basename(p)}" for p in paths]
    clean = best(lambda: read(wds.WebDataset(urls, shardshuffle=False)))
    proxy.reset_after = RESET
    faulty_ds = wds.WebDataset(urls, shardshuffle=False)
    faulty = best(lambda: read(faulty_ds))
    theirs = peer_read(peer, [f"pipe:curl -s {u}" for u in urls])
    rows.append(
        [
            "http",
            f"{clean / 1e6:,.0f}",
            f"{faulty / 1e6:,.0f}",
            f"{faulty / clean:.0%}",
            *recovery(faulty_ds.stats),
            theirs,
        ]
    )
    proxy.stop()
    cloud.stop(http)
    shutil.rmtree(directory, ignore_errors=True)

    import boto3

    port = cloud.free_port()
    moto = subprocess.Popen(
        [shutil.which("moto_server", path=os.path.dirname(sys.executable)), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cloud.wait_for_port(port, moto, "moto_server")
    client = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket="bench")
    for path in paths:
        client.upload_file(path, "bench", os.path.basename(path))
    proxy = FaultProxy(f"http://127.0.0.1:{port}")
    options = {"key": "testing", "secret": "testing", "endpoint_url": proxy.url}
    urls = [f"s3://bench/{os.path.basename(p)}" for p in paths]
    clean = best(lambda: read(wds.WebDataset(urls, shardshuffle=False, storage_options=options)))
    proxy.reset_after = RESET
    faulty_ds = wds.WebDataset(urls, shardshuffle=False, storage_options=options)
    faulty = best(lambda: read(faulty_ds))
    aws = shutil.which("aws") or shutil.which("aws", path=os.path.dirname(sys.executable))
    if aws:
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        theirs = peer_read(peer, [f"pipe:{aws} --endpoint-url {proxy.url} s3 cp {u} -" for u in urls])
    else:
        theirs = "aws command not installed"
    rows.append(
        [
            "s3",
            f"{clean / 1e6:,.0f}",
            f"{faulty / 1e6:,.0f}",
            f"{faulty / clean:.0%}",
            *recovery(faulty_ds.stats),
            theirs,
        ]
    )
    proxy.stop()
    cloud.stop(moto)

    print(
        common.table(
            rows,
            [
                "scheme",
                "clean MB/s",
                "reset/4MB MB/s",
                "of clean",
                "retries",
                "refetched MB",
                "ms lost/retry",
                "webdataset 1.0.2 under the same faults (64 samples expected)",
            ],
        )
    )


def recovery(stats) -> list:
    """Retries, bytes received twice, and the time each recovery cost (reconnect + the store's answer)."""
    per_retry = stats.time_lost / stats.retries * 1e3 if stats.retries else 0.0
    return [stats.retries, f"{stats.bytes_refetched / 1e6:.1f}", f"{per_retry:.1f}"]


def best(fn, repeat: int = 2) -> float:
    rates = []
    for _ in range(repeat):
        (_, nbytes), seconds = common.timed(fn)
        rates.append(nbytes / seconds)
    return max(rates)


def common_files(spec: str) -> list[str]:
    import braceexpand

    return list(braceexpand.braceexpand(spec))


if __name__ == "__main__":
    main()
