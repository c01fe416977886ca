"""Fixtures for reading tests: small shard sets written to a temporary directory."""

import importlib
import io
import json
import pathlib
import tarfile

import pytest

from wds_cloud.io import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_shards(directory, nshards=3, per_shard=10, images=False):
    """Write ``nshards`` tar shards of ``per_shard`` samples each; returns the brace spec."""
    if images:
        import numpy as np
        from PIL import Image
    for s in range(nshards):
        with tarfile.open(directory / f"shard-{s:03d}.tar", "w") as tar:
            for i in range(per_shard):
                key = f"s{s}_{i:04d}"
                fields = {
                    "txt": f"text {s} {i}".encode(),
                    "cls": str(s * per_shard + i).encode(),
                    "json": json.dumps({"s": s, "i": i}).encode(),
                }
                if images:
                    rng = np.random.default_rng(s * 1000 + i)
                    pixels = rng.integers(0, 255, (8, 12, 3), dtype=np.uint8)
                    out = io.BytesIO()
                    Image.fromarray(pixels).save(out, format="PNG")
                    fields["png"] = out.getvalue()
                for ext, data in fields.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(directory / f"shard-{{000..{nshards - 1:03d}}}.tar")


@pytest.fixture
def shards(tmp_path):
    """Three shards of ten samples (txt, cls, json)."""
    return make_shards(tmp_path)


@pytest.fixture
def image_shards(tmp_path):
    """Two shards of five samples, each with a small PNG."""
    return make_shards(tmp_path, nshards=2, per_shard=5, images=True)


from .cloud import (  # noqa: E402,F401  (session fixtures for the backend tests)
    ais_servers,
    az_container,
    azurite_endpoint,
    gcs_bucket,
    gcs_endpoint,
    http_store,
    moto_endpoint,
    s3_bucket,
)
from .start_methods import start_method  # noqa: E402,F401  (fork, spawn, forkserver: tests/start_methods.py)


@pytest.fixture
def installed_example(tmp_path, monkeypatch):
    """The docs example plugin made discoverable by a temporary dist-info folder on sys.path."""
    dist = tmp_path / "wds_cloud_memory-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: wds-cloud-memory\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[wds_cloud]\nmemory = wds_cloud_memory\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples" / "wds-cloud-memory"))
    importlib.invalidate_caches()
    registry.reset()
    yield
    registry.reset()
