"""Any fsspec protocol that no plugin claims opens through fsspec ("fsspec (fallback)")."""

import threading
import warnings

import pytest

import wds_cloud as wds
from wds_cloud.cli import main
from wds_cloud.errors import MissingExtraError, ShardNotFoundError
from wds_cloud.io import registry

from .hostile import tar_of


def shard_bytes(n=5):
    return tar_of([(f"k{i}", {"txt": f"text {i}".encode()}) for i in range(n)])


@pytest.fixture
def memory_shard():
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    with fs.open("/bucket/train-0.tar", "wb") as f:
        f.write(shard_bytes())
    yield "memory://bucket/train-0.tar"
    fs.rm("/bucket", recursive=True)


def test_memory_protocol_reads_through_fsspec(memory_shard):
    """memory:// (claimed by no plugin) reads through fsspec, with offsets."""
    samples = list(wds.WebDataset(memory_shard, shardshuffle=False).decode())
    assert [s["txt"] for s in samples] == [f"text {i}" for i in range(5)]
    with wds.gopen(memory_shard, offset=512) as stream:
        assert stream.read(7) == b"text 0\0"[:7]


def test_missing_object_and_missing_driver_are_clear(memory_shard):
    """A missing object is ShardNotFoundError; a protocol without its driver names fsspec's install hint."""
    with pytest.raises(ShardNotFoundError, match="memory://bucket/nope.tar"):
        wds.gopen("memory://bucket/nope.tar")
    with pytest.raises(MissingExtraError, match="huggingface_hub"):
        wds.gopen("hf://datasets/someone/data/train-0.tar")


def test_plugins_take_precedence_over_the_fallback():
    """A scheme a plugin claims is never given to fsspec."""
    reg = registry.get_registry(wds.config.current())
    assert reg.claim("s3").plugin == "s3"
    assert reg.claim("memory").plugin == "fsspec (fallback)"
    assert "s3" not in reg.fallback_claims()


def test_backends_lists_fallback_protocols(capsys):
    """`wds-cloud backends --all` adds fsspec's protocols as 'fsspec (fallback)', with fsspec's install hint;
    without --all only our plugins and installed ones are listed."""
    assert main(["backends"]) == 0
    plain = capsys.readouterr().out
    assert "s3:" in plain and "memory:" not in plain and "--all" in plain
    assert main(["backends", "--all"]) == 0
    out = capsys.readouterr().out
    memory = next(line for line in out.splitlines() if line.startswith("memory:"))
    assert "fsspec (fallback)" in memory and "ready" in memory
    hf = next(line for line in out.splitlines() if line.startswith("hf:"))
    assert "needs" in hf and "huggingface_hub" in hf


@pytest.fixture
def ftp_server(tmp_path):
    """An FTP server (pyftpdlib) on a free loopback port, serving tmp_path read/write to user/secret."""
    with warnings.catch_warnings():  # pyftpdlib imports asyncore, deprecated in Python 3.11
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("pyftpdlib")
        from pyftpdlib.authorizers import DummyAuthorizer
        from pyftpdlib.handlers import FTPHandler
        from pyftpdlib.servers import FTPServer

    authorizer = DummyAuthorizer()
    authorizer.add_user("user", "secret", str(tmp_path), perm="elradfmw")
    handler = type("Handler", (FTPHandler,), {"authorizer": authorizer})
    server = FTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"timeout": 0.1, "blocking": True}, daemon=True)
    thread.start()
    try:
        yield server.address[1], tmp_path
    finally:
        server.close_all()
        thread.join()


def test_ftp_on_loopback_through_fsspec(ftp_server):
    """A real protocol served on loopback (FTP) reads through fsspec with storage_options."""
    port, root = ftp_server
    (root / "shard-0.tar").write_bytes(shard_bytes(3))
    options = {"host": "127.0.0.1", "port": port, "username": "user", "password": "secret"}
    ds = wds.WebDataset("ftp:///shard-0.tar", shardshuffle=False, storage_options=options).decode()
    assert [s["txt"] for s in ds] == ["text 0", "text 1", "text 2"]
