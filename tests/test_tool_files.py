"""Every file a tool writes that names other files names them relative to itself (issue 42): written from one
working directory with relative arguments, as a new user types them, each reads back through every reader
from another working directory."""

import json
import os

import pytest

import wds_cloud as wds
from wds_cloud.cli import main
from wds_cloud.index import ShardListDataset, read_index
from wds_cloud.io.manifest import load_manifest
from wds_cloud.io.urls import name_in_file

from .conftest import make_shards

KEYS = sorted(f"s{s}_{i:04d}" for s in range(2) for i in range(4))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder holding data/shard-000.tar, data/shard-001.tar; the working directory is the project."""
    (tmp_path / "project" / "data").mkdir(parents=True)
    make_shards(tmp_path / "project" / "data", nshards=2, per_shard=4)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "project")
    return tmp_path


def test_a_wids_description_written_with_relative_names_reads_back_from_anywhere(project, monkeypatch):
    """`wds-cloud index 'data/...' --format wids --output data/train.wids.json` names the shards relative to the
    description (it used to store "data/shard-000.tar", which readers looked for as data/data/shard-000.tar)."""
    assert main(["index", "data/shard-{000..001}.tar", "--format", "wids", "--output", "data/train.wids.json"]) == 0
    description = json.loads((project / "project" / "data" / "train.wids.json").read_text())
    assert [row["url"] for row in description["shardlist"]] == ["shard-000.tar", "shard-001.tar"]
    for cwd in (project / "project", project / "elsewhere"):
        monkeypatch.chdir(cwd)
        path = str(project / "project" / "data" / "train.wids.json")
        dataset = ShardListDataset(path)
        assert sorted(dataset[i]["__key__"] for i in range(len(dataset))) == KEYS
        assert sorted(s["__key__"] for s in wds.WebDataset(path, shardshuffle=False)) == KEYS


def test_an_index_written_beside_its_shard_names_it_relative_to_itself(project, monkeypatch):
    """`wds-cloud index data/shard-000.tar` writes data/shard-000.tar.index.json naming "shard-000.tar"."""
    assert main(["index", "data/shard-{000..001}.tar"]) == 0
    written = json.loads((project / "project" / "data" / "shard-000.tar.index.json").read_text())
    assert written["url"] == "shard-000.tar"
    monkeypatch.chdir(project / "elsewhere")
    index = read_index(str(project / "project" / "data" / "shard-000.tar.index.json"))
    assert os.path.samefile(index.url, project / "project" / "data" / "shard-000.tar")
    assert index.version is not None  # the index was made for exactly this file: its version is still checked
    assert len(index) == 4


def test_an_index_written_elsewhere_names_its_shard_absolutely(project, monkeypatch):
    """--output outside the shard's folder: a relative name would climb out of the index's folder (refused by
    readers), so the shard is named by its absolute path."""
    assert main(["index", "data/shard-000.tar", "--output", "indexes/one.index.json"]) == 0
    written = json.loads((project / "project" / "indexes" / "one.index.json").read_text())
    assert written["url"] == str(project / "project" / "data" / "shard-000.tar")
    monkeypatch.chdir(project / "elsewhere")
    assert len(read_index(str(project / "project" / "indexes" / "one.index.json"))) == 4


def test_a_manifest_written_with_relative_names_verifies_from_anywhere(project, monkeypatch):
    """`wds-cloud verify 'data/...' --write-manifest data/manifest.json`, then a read against it elsewhere."""
    assert main(["verify", "data/shard-{000..001}.tar", "--write-manifest", "data/manifest.json"]) == 0
    monkeypatch.chdir(project / "elsewhere")
    manifest = str(project / "project" / "data" / "manifest.json")
    assert len(load_manifest(manifest)) == 2
    shards = str(project / "project" / "data" / "shard-{000..001}.tar")
    assert sorted(s["__key__"] for s in wds.WebDataset(shards, shardshuffle=False, manifest=manifest)) == KEYS
    assert main(["verify", shards, "--manifest", manifest]) == 0


@pytest.mark.parametrize(
    ("url", "at", "named"),
    [
        ("/d/a.tar", "/d/x.json", "a.tar"),
        ("/d/sub/a.tar", "/d/x.json", "sub/a.tar"),
        ("/e/a.tar", "/d/x.json", "/e/a.tar"),
        ("s3://b/d/a.tar", "s3://b/d/x.json", "a.tar"),
        ("s3://b/e/a.tar", "s3://b/d/x.json", "s3://b/e/a.tar"),
        ("s3://b/d/a.tar", "/d/x.json", "s3://b/d/a.tar"),
        ("https://h/d/a.tar", "s3://b/d/x.json", "https://h/d/a.tar"),
    ],
)
def test_name_in_file(url, at, named):
    """Relative where the target lies in or below the file's folder, absolute otherwise."""
    assert name_in_file(url, at) == named
