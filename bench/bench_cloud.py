"""Cloud benchmark: reading shards from real servers on loopback, against each store's ceiling and the peer.

Starts the servers itself (moto for S3, gcp-storage-emulator for GCS, Azurite
for Azure when installed under tests/.node, and our HTTP server), uploads the
generated shards, and in one run measures:

- large (4 shards of 8 MB samples): wds_cloud against the raw streaming rate of
  the same objects (boto3 ``get_object()["Body"]`` for s3, ``curl`` for http,
  the SDKs' streaming download for gs and az) — the ceiling;
- tiny (8 shards, 200,000 samples of 100-byte txt + cls): wds_cloud against
  webdataset 1.0.2 reading the same objects with ``pipe:aws s3 cp ... -`` (s3)
  and ``pipe:curl`` (http).

    python bench/bench_cloud.py [--only s3,http,gs,az] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

from tests import cloud  # noqa: E402  (the same server recipes as the tests)


def files(spec: str) -> list[str]:
    import braceexpand

    return list(braceexpand.braceexpand(spec))


def count(ds) -> int:
    n = 0
    for _ in ds:
        n += 1
    return n


def best_pair(ours, reference, repeat: int) -> tuple[float, float]:
    """Best rates of two readers run alternately (ours, reference, ours, ...), so drift hits both alike."""
    a, b = [], []
    for _ in range(repeat):
        for fn, rates in ((ours, a), (reference, b)):
            n, seconds = common.timed(fn)
            rates.append(n / seconds)
    return max(a), max(b)


def read_all(stream, chunk: int = 1 << 20) -> int:
    total = 0
    while True:
        data = stream.read(chunk)
        if not data:
            return total
        total += len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="s3,http,gs,az")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    import wds_cloud as wds

    peer = common.peer()
    tiny_spec, _ = common.dataset("tiny", 8, 25000, common.tiny)
    large_spec, large_bytes = common.dataset("large", 4, 16, common.large)
    tiny_files, large_files = files(tiny_spec), files(large_spec)
    rows = []
    only = args.only.split(",")

    def report(scheme, workload, ours, reference, ref_name, unit):
        ratio = ours / reference
        rows.append([scheme, workload, f"{ours:,.0f} {unit}", f"{reference:,.0f} {unit}", ref_name, f"{ratio:.2f}x"])
        print(
            f"{scheme} {workload}: wds_cloud {ours:,.0f} {unit}, {ref_name} {reference:,.0f} {unit} ({ratio:.2f}x)",
            flush=True,
        )

    if "s3" in only:
        import boto3

        # The servers run in their own processes, so they do not share this process's GIL with the readers.
        port = cloud.free_port()
        moto = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        cloud.wait_for_port(port, moto, "moto_server")
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket="bench")
        for path in tiny_files + large_files:
            client.upload_file(path, "bench", os.path.basename(path))
        options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
        large_urls = [f"s3://bench/{os.path.basename(p)}" for p in large_files]

        def raw_boto3():
            return sum(read_all(client.get_object(Bucket="bench", Key=u.split("/", 3)[3])["Body"]) for u in large_urls)

        def ours_large():
            ds = wds.WebDataset(large_urls, shardshuffle=False, storage_options=options)
            return sum(len(s["npy"]) for s in ds)

        report(
            "s3", "large MB/s", *(r / 1e6 for r in best_pair(ours_large, raw_boto3, args.repeat)), "boto3 Body", "MB/s"
        )
        tiny_urls = [f"s3://bench/{os.path.basename(p)}" for p in tiny_files]
        env = dict(
            os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
        )
        os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
        aws = shutil.which("aws") or shutil.which("aws", path=os.path.dirname(sys.executable))

        def ours_tiny():
            return count(wds.WebDataset(tiny_urls, shardshuffle=False, storage_options=options))

        if aws:
            piped = [f"pipe:{aws} --endpoint-url {endpoint} s3 cp {u} -" for u in tiny_urls]
            ours, theirs = best_pair(ours_tiny, lambda: count(peer.WebDataset(piped, shardshuffle=False)), args.repeat)
            report("s3", "tiny samples/s", ours, theirs, "webdataset pipe:aws", "samples/s")
        else:
            print("s3 tiny: the aws command is not installed (pip install awscli); skipping the peer", flush=True)
        cloud.stop(moto)

    if "http" in only:
        directory = tempfile.mkdtemp(prefix="bench-http-")
        for path in tiny_files + large_files:
            os.symlink(path, os.path.join(directory, os.path.basename(path)))
        port = cloud.free_port()
        http = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(HERE), "tests", "servers.py"), "http", str(port), directory],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        cloud.wait_for_port(port, http, "HTTP server", timeout=120)
        base = f"http://127.0.0.1:{port}"
        large_urls = [f"{base}/{os.path.basename(p)}" for p in large_files]
        tiny_urls = [f"{base}/{os.path.basename(p)}" for p in tiny_files]

        def curl_large():
            total = 0
            for u in large_urls:
                out = subprocess.run(
                    ["curl", "-s", "-o", "/dev/null", "-w", "%{size_download}", u],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                total += int(float(out.stdout))
            return total

        def ours_large():
            return sum(len(s["npy"]) for s in wds.WebDataset(large_urls, shardshuffle=False))

        report("http", "large MB/s", *(r / 1e6 for r in best_pair(ours_large, curl_large, args.repeat)), "curl", "MB/s")
        ours, theirs = best_pair(
            lambda: count(wds.WebDataset(tiny_urls, shardshuffle=False)),
            lambda: count(peer.WebDataset([f"pipe:curl -s {u}" for u in tiny_urls], shardshuffle=False)),
            args.repeat,
        )
        report("http", "tiny samples/s", ours, theirs, "webdataset pipe:curl", "samples/s")
        cloud.stop(http)
        shutil.rmtree(directory, ignore_errors=True)

    if "gs" in only:
        exe = shutil.which("gcp-storage-emulator", path=os.path.dirname(sys.executable))
        port = cloud.free_port()
        proc = subprocess.Popen(
            [exe, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "-q"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        cloud.wait_for_port(port, proc, "gcp-storage-emulator")
        import gcsfs

        options = {"token": "anon", "endpoint_url": f"http://127.0.0.1:{port}"}
        fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **options)
        fs.mkdir("bench")
        for path in large_files:
            fs.put_file(path, f"bench/{os.path.basename(path)}")
        large_urls = [f"gs://bench/{os.path.basename(p)}" for p in large_files]

        def raw_gcsfs():
            return sum(read_all(fs.open(u[5:], "rb", block_size=8 << 20, cache_type="readahead")) for u in large_urls)

        def ours_large():
            ds = wds.WebDataset(large_urls, shardshuffle=False, storage_options=options)
            return sum(len(s["npy"]) for s in ds)

        report(
            "gs",
            "large MB/s",
            *(r / 1e6 for r in best_pair(ours_large, raw_gcsfs, args.repeat)),
            "gcsfs readahead 8 MiB",
            "MB/s",
        )
        cloud.stop(proc)

    if "az" in only and cloud.azurite_executable():
        port = cloud.free_port()
        location = tempfile.mkdtemp(prefix="azurite-bench-")
        proc = subprocess.Popen(
            [
                cloud.azurite_executable(),
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(port),
                "--location",
                location,
                "--disableTelemetry",
                "--skipApiVersionCheck",
                "--silent",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        cloud.wait_for_port(port, proc, "Azurite")
        from azure.storage.blob import BlobServiceClient

        connection = (
            f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
            f"AccountKey={cloud.AZURITE_ACCOUNT_KEY};BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"
        )
        service = BlobServiceClient.from_connection_string(connection)
        service.create_container("bench")
        for path in large_files:
            with open(path, "rb") as f:
                service.get_blob_client("bench", os.path.basename(path)).upload_blob(f)
        large_urls = [f"az://bench/{os.path.basename(p)}" for p in large_files]

        def raw_sdk():
            total = 0
            for u in large_urls:
                for chunk in service.get_blob_client("bench", u.rsplit("/", 1)[1]).download_blob().chunks():
                    total += len(chunk)
            return total

        def ours_large():
            ds = wds.WebDataset(large_urls, shardshuffle=False, storage_options={"connection_string": connection})
            return sum(len(s["npy"]) for s in ds)

        report(
            "az",
            "large MB/s",
            *(r / 1e6 for r in best_pair(ours_large, raw_sdk, args.repeat)),
            "azure SDK chunks",
            "MB/s",
        )
        cloud.stop(proc)
        shutil.rmtree(location, ignore_errors=True)

    print()
    print(common.table(rows, ["scheme", "workload", "wds_cloud", "reference", "reference is", "ratio"]))


if __name__ == "__main__":
    main()
