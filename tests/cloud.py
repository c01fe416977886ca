"""Session fixtures that start real storage servers on free loopback ports, and stop them.

moto (S3, in-process), gcp-storage-emulator (GCS, a child process), Azurite
(Azure Blob, from npm, a child process), and our own HTTP and AIS servers
(``tests/servers.py``).  Nothing here talks to anything outside 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from . import servers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HTTP_TOKEN = "http-token-for-tests"
AIS_TOKEN = "ais-token-for-tests"
AZURITE_ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

# Clients must never probe cloud metadata servers or pick up the host's credentials.
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("NO_GCE_CHECK", "true")
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before gcsfs is imported: no gRPC probing
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.path.join(ROOT, "tests", "no-aws-credentials")
os.environ["AWS_CONFIG_FILE"] = os.path.join(ROOT, "tests", "no-aws-config")
for name in (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AZURE_STORAGE_CONNECTION_STRING",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
):
    os.environ.pop(name, None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, name: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} while starting")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not listen on port {port} within {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def moto_endpoint():
    """A moto S3 server in this process; yields its endpoint URL."""
    pytest.importorskip("moto.server")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(moto_endpoint):
    """A fresh bucket on the moto server: (bucket, storage_options)."""
    import boto3

    options = {"key": "testing", "secret": "testing", "endpoint_url": moto_endpoint}
    bucket = unique("bkt")
    boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)
    return bucket, options


@pytest.fixture(scope="session")
def gcs_endpoint():
    """gcp-storage-emulator in a child process; yields its endpoint URL."""
    exe = shutil.which("gcp-storage-emulator", path=os.path.dirname(sys.executable)) or shutil.which(
        "gcp-storage-emulator"
    )
    if exe is None:
        pytest.skip("gcp-storage-emulator is not installed (pip install -e '.[test]')")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port, proc, "gcp-storage-emulator")
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture
def gcs_bucket(gcs_endpoint):
    """A fresh bucket on the GCS emulator: (bucket, storage_options)."""
    import gcsfs

    options = {"token": "anon", "endpoint_url": gcs_endpoint}
    bucket = unique("bkt")
    gcsfs.GCSFileSystem(skip_instance_cache=True, **options).mkdir(bucket)
    return bucket, options


def azurite_executable():
    for candidate in (
        os.path.join(ROOT, "tests", ".node", "node_modules", ".bin", "azurite-blob"),
        shutil.which("azurite-blob"),
    ):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


@pytest.fixture(scope="session")
def azurite_endpoint():
    """Azurite's blob service in a child process; yields (endpoint, connection string)."""
    exe = azurite_executable()
    if exe is None:
        pytest.skip("Azurite is not installed: npm install --prefix tests/.node azurite@3.35.0")
    port = free_port()
    location = tempfile.mkdtemp(prefix="azurite-")
    proc = subprocess.Popen(
        [
            exe,
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
    wait_for_port(port, proc, "Azurite")
    endpoint = f"http://127.0.0.1:{port}/devstoreaccount1"
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_ACCOUNT_KEY};"
        f"BlobEndpoint={endpoint};"
    )
    yield endpoint, connection
    stop(proc)
    shutil.rmtree(location, ignore_errors=True)


@pytest.fixture
def az_container(azurite_endpoint):
    """A fresh container on Azurite: (container, storage_options)."""
    from azure.storage.blob import BlobServiceClient

    endpoint, connection = azurite_endpoint
    container = unique("ctr")
    BlobServiceClient.from_connection_string(connection).create_container(container)
    return container, {"connection_string": connection}


@pytest.fixture(scope="session")
def http_store():
    """Our Range/PUT-capable HTTP server, wanting the bearer token HTTP_TOKEN: (server, store)."""
    server, store = servers.http_server(token=HTTP_TOKEN)
    yield server, store
    server.stop()


@pytest.fixture(scope="session")
def ais_servers():
    """Our AIS gateway and target, wanting the token AIS_TOKEN: (gateway, target, store, buckets)."""
    gateway, target, store, buckets = servers.ais_cluster(token=AIS_TOKEN)
    yield gateway, target, store, buckets
    gateway.stop()
    target.stop()
