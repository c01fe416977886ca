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


@pytest.fixture
def linked(project, monkeypatch):
    """project/link -> project/data (a linked folder); the working directory is project/cwd."""
    (project / "project" / "link").symlink_to(project / "project" / "data", target_is_directory=True)
    (project / "project" / "cwd").mkdir()
    monkeypatch.chdir(project / "project" / "cwd")
    return project / "project"


def _copy_and_replace(folder, to):
    """``folder`` copied to ``to``; the copy's shards hold other samples (a read of the original shows)."""
    import shutil

    shutil.copytree(folder, to, symlinks=True)
    make_shards(to, nshards=2, per_shard=3)


def test_shards_reached_through_a_link_to_the_manifest_folder_are_named_relative(linked, monkeypatch):
    """`verify ../link/... --write-manifest <data>/manifest.json`: the shards are in the manifest's folder (through
    a link), so they are named "shard-000.tar" (they were written as absolute paths through the link, and a copy
    of the folder then failed verify against its own manifest)."""
    data = linked / "data"
    assert main(["verify", "../link/shard-{000..001}.tar", "--write-manifest", str(data / "manifest.json")]) == 0
    assert sorted(load_manifest(str(data / "manifest.json")).shards) == ["shard-000.tar", "shard-001.tar"]
    assert main(["verify", "../link/shard-{000..001}.tar", "--write-manifest", "../link/m2.json"]) == 0
    assert sorted(json.loads((data / "m2.json").read_text())["shards"]) == ["shard-000.tar", "shard-001.tar"]
    import shutil

    shutil.copytree(data, linked / "copy", symlinks=True)
    monkeypatch.chdir(linked)
    assert main(["verify", "copy/shard-{000..001}.tar", "--manifest", "copy/manifest.json"]) == 0


def test_a_manifest_finds_its_shards_through_any_spelling_of_their_folder(linked):
    """A manifest written with data/... names the same files given through link/... or with .. (it refused them:
    "not in the manifest"); a file only spelled alike elsewhere is still not in it."""
    data = linked / "data"
    assert main(["verify", str(data / "shard-{000..001}.tar"), "--write-manifest", str(data / "manifest.json")]) == 0
    manifest = str(data / "manifest.json")
    for spec in (
        str(linked / "link" / "shard-{000..001}.tar"),
        "../link/shard-{000..001}.tar",
        "../link/../data/shard-{000..001}.tar",
        "file:" + str(linked / "link" / "shard-{000..001}.tar"),
    ):
        assert sorted(s["__key__"] for s in wds.WebDataset(spec, shardshuffle=False, manifest=manifest)) == KEYS
    assert load_manifest(manifest).find(str(linked / "cwd" / "shard-000.tar")) is None


def test_a_wids_description_in_its_shards_folder_reached_through_a_link_names_them_relative(linked):
    """`index ../link/... --format wids --output <data>/d.json` names the shards "shard-000.tar", so a copy of the
    folder reads its own shards (it named the originals absolutely and a copy silently read them)."""
    data = linked / "data"
    out = str(data / "d.json")
    assert main(["index", "../link/shard-{000..001}.tar", "--format", "wids", "--output", out]) == 0
    assert [row["url"] for row in json.loads((data / "d.json").read_text())["shardlist"]] == [
        "shard-000.tar",
        "shard-001.tar",
    ]
    _copy_and_replace(data, linked / "copy")
    copied = sorted(s["__key__"] for s in wds.WebDataset(str(linked / "copy" / "d.json"), shardshuffle=False))
    assert copied == sorted(f"s{s}_{i:04d}" for s in range(2) for i in range(3))
    assert name_in_file("../link/shard-000.tar", "../data/x.json") == "shard-000.tar"
    assert name_in_file("../data/sub/../shard-000.tar", "../link/x.json") == "shard-000.tar"
    assert name_in_file("../data/shard-000.tar", "../cwd/x.json").startswith("/")  # outside: absolute
