"""Random access at cluster size: the indexes a ShardListDataset holds stay within WDS_INDEX_CACHE, its shards and
counts are compact, and descriptions and manifests of more shards than one document holds are written one
record a line and read back as a stream, every line checked; the document forms written before still read."""

from __future__ import annotations

import io
import json
import tarfile
from contextlib import redirect_stdout

import pytest

import wds_cloud as wds
from wds_cloud.cli import main as cli
from wds_cloud.errors import MalformedDataError, SecurityError
from wds_cloud.index import build_index, wids_description, write_index
from wds_cloud.index.held import IndexCache, index_bytes
from wds_cloud.io.descriptions import LINES_FORMAT, write_description
from wds_cloud.manifest import Manifest, load_manifest

SHA = "ab" * 32


def _shards(folder, n, per_shard=2):
    """``n`` tiny plain shards (one field a sample) with sidecar indexes; their paths."""
    paths = []
    for s in range(n):
        path = folder / f"s-{s:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(per_shard):
                info = tarfile.TarInfo(f"k{s}_{i}.cls")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"1"))
        write_index(build_index(str(path)))
        paths.append(str(path))
    return paths


def test_indexes_held_never_exceed_the_bound_over_500_shards(tmp_path, monkeypatch):
    """Iterating 500 shards keeps at most as many indexes as WDS_INDEX_CACHE holds, and loads each once."""
    paths = _shards(tmp_path, 500)
    one = index_bytes(build_index(paths[0]))
    monkeypatch.setenv("WDS_INDEX_CACHE", str(5 * one))
    ds = wds.ShardListDataset([{"url": p, "nsamples": 2} for p in paths], transformations=[])
    most = 0
    for i in range(len(ds)):
        assert ds[i]["__shard__"] == paths[i // 2]
        most = max(most, len(ds._indexes))
        assert ds._indexes.bytes <= 5 * one
    assert most == 5
    assert ds._indexes.loads == 500  # a pass in order never loads an index twice


def test_a_zero_bound_keeps_the_index_used_last():
    """With a bound of 0 the index used last stays, so the samples of one shard load it once."""
    cache = IndexCache(0)
    a, b = wds.index.ShardIndex("a", []), wds.index.ShardIndex("b", [])
    cache.put(0, a)
    cache.put(1, b)
    assert len(cache) == 1 and cache.get(1) is b and cache.get(0) is None


def test_lengths_and_shards_are_compact(tmp_path):
    """Counts are 8-byte arrays, shards a table (rows built when asked), not a list of dicts and ints."""
    rows = [
        {"url": f"s-{i}.tar", "nsamples": 3, "md5sum": "x"} if i == 1 else {"url": f"s-{i}.tar", "nsamples": 3}
        for i in range(4)
    ]
    ds = wds.ShardListDataset(rows, base=str(tmp_path), transformations=[])
    assert ds.lengths.typecode == "q" and list(ds.lengths) == [3, 3, 3, 3] and len(ds) == 12
    assert ds.shards[1] == {"url": str(tmp_path / "s-1.tar"), "nsamples": 3, "md5sum": "x"}
    assert ds.shards.extras.keys() == {1}
    assert ds.locate(7) == (2, 1)


def test_a_description_larger_than_the_cap_is_written_one_shard_a_line_and_reads_back(tmp_path, monkeypatch):
    """Past WDS_MAX_DATA_FILE_SIZE a description is written one shard a line and read with the cap on a line."""
    monkeypatch.setenv("WDS_MAX_DATA_FILE_SIZE", "4096")
    rows = [{"url": f"s-{i:05d}.tar", "nsamples": 2, "filesize": 4096} for i in range(500)]
    path = str(tmp_path / "big.json")
    assert write_description(path, rows, name="big") is True
    ds = wds.ShardListDataset(path, transformations=[])
    assert len(ds.shards) == 500 and len(ds) == 1000 and ds.dataset_name == "big"
    assert ds.shards.url(499) == str(tmp_path / "s-00499.tar")
    assert wds.shardlists.expand_source(path)[-1] == str(tmp_path / "s-00499.tar")
    assert len(wds.shardlists.index_counts(path)) == 500
    document = tmp_path / "doc.json"
    document.write_text(json.dumps(wids_description(rows)))
    with pytest.raises(MalformedDataError, match="WDS_MAX_DATA_FILE_SIZE"):
        wds.ShardListDataset(str(document))


def test_a_manifest_larger_than_the_cap_is_written_one_shard_a_line_and_reads_back(tmp_path, monkeypatch):
    """Past WDS_MAX_DATA_FILE_SIZE a manifest is written one shard a line and loads the same entries."""
    monkeypatch.setenv("WDS_MAX_DATA_FILE_SIZE", "4096")
    manifest = Manifest()
    for i in range(500):
        manifest.add(str(tmp_path / f"s-{i:05d}.tar"), 1024, 2, SHA)
    path = str(tmp_path / "manifest.json")
    assert manifest.write(path) is True
    loaded = load_manifest(path)
    assert len(loaded) == 500 and loaded.find(str(tmp_path / "s-00007.tar")) == {
        "size": 1024,
        "samples": 2,
        "sha256": SHA,
    }
    with pytest.raises(MalformedDataError, match="WDS_MAX_DATA_FILE_SIZE"):
        manifest.write(str(tmp_path / "doc.json"), lines=False)
        load_manifest(str(tmp_path / "doc.json"))


def test_document_forms_written_today_still_load(tmp_path):
    """A description and a manifest in the one-document form (indented or on one line) read as before."""
    paths = _shards(tmp_path, 2)
    rows = [{"url": p, "nsamples": 2, "filesize": 10240} for p in paths]
    for i, text in enumerate(
        [
            json.dumps(wids_description(rows, at=str(tmp_path / "d.json")), indent=1),
            json.dumps({"wids_version": 1, "shardlist": rows}),
        ]
    ):
        (tmp_path / f"d{i}.json").write_text(text)
        ds = wds.ShardListDataset(str(tmp_path / f"d{i}.json"), transformations=[])
        assert len(ds) == 4 and ds[3]["__key__"] == "k1_1"
    manifest = Manifest()
    for p in paths:
        manifest.add(p, 10240, 2, SHA)
    assert manifest.write(str(tmp_path / "m.json")) is False
    assert json.loads((tmp_path / "m.json").read_text())["format"] == "wds_cloud.manifest"
    assert len(load_manifest(str(tmp_path / "m.json"))) == 2


def test_the_index_command_writes_a_jsonl_description_one_shard_a_line(tmp_path):
    """`index --format wids --output X.jsonl` writes the lines form, which ShardListDataset reads."""
    _shards(tmp_path, 3)
    out = str(tmp_path / "d.jsonl")
    with redirect_stdout(io.StringIO()) as printed:
        assert cli(["index", str(tmp_path / "s-{0000..0002}.tar"), "--format", "wids", "--output", out]) == 0
    assert "one shard a line" in printed.getvalue()
    with open(out) as f:
        assert json.loads(f.readline())["format"] == LINES_FORMAT
    assert len(wds.ShardListDataset(out, transformations=[])) == 6


HEADER = {"format": LINES_FORMAT, "version": 1, "wids_version": 1, "records": 2}
ROW = {"url": "a.tar", "nsamples": 1}


def _text(*records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.mark.parametrize(
    ("body", "error", "words"),
    [
        (_text(HEADER, ROW, {"url": "../x.tar", "nsamples": 1}), SecurityError, ""),
        (_text(HEADER, ROW, {"url": "%2e%2e/x.tar", "nsamples": 1}), SecurityError, ""),
        (_text(HEADER, ROW, {"url": "..\\..\\x.tar", "nsamples": 1}), (SecurityError, MalformedDataError), ""),
        (_text(dict(HEADER, records=3), ROW, {"url": "b.tar", "nsamples": 1}), MalformedDataError, "holds 2"),
        (_text(dict(HEADER, records=1), ROW, {"url": "b.tar", "nsamples": 1}), MalformedDataError, "line 3"),
        (_text(dict(HEADER, records=-1), ROW), MalformedDataError, "'records'"),
        (_text(HEADER, ROW, ROW), MalformedDataError, "line 3 lists the shard"),
        (_text(HEADER, ROW, {"url": "b.tar", "nsamples": "7"}), MalformedDataError, "line 3.nsamples"),
        (_text(HEADER, ROW, {"url": "b.tar", "nsamples": 5, "filesize": 512}), MalformedDataError, "line 3.nsamples"),
        (_text(HEADER, ROW, ["b.tar"]), MalformedDataError, "line 3 must be a JSON object"),
        (_text(HEADER, ROW) + b'{"url": "b.tar", "nsa', MalformedDataError, "line 3"),
        (_text(HEADER, ROW) + b'{"url": "b\xff.tar", "nsamples": 1}\n', MalformedDataError, "line 3"),
        (_text(HEADER, ROW, {"url": "b" * 5000 + ".tar", "nsamples": 1}), MalformedDataError, "line 3 of the"),
        (_text(dict(HEADER, datasets=[]), ROW, ROW), MalformedDataError, "line 1"),
    ],
    ids=[
        "dotdot",
        "percent-dotdot",
        "backslashes",
        "fewer-than-announced",
        "more-than-announced",
        "negative-count",
        "listed-twice",
        "count-as-text",
        "count-beyond-size",
        "not-an-object",
        "truncated-last-line",
        "not-utf8",
        "huge-line",
        "components-in-header",
    ],
)
def test_every_line_of_a_lines_description_is_checked(tmp_path, monkeypatch, body, error, words):
    """A hostile line (a URL leaving the folder, a lying count, a repeat, a cut or huge line, bad bytes) is refused
    with our error naming the file and the line."""
    monkeypatch.setenv("WDS_MAX_DATA_FILE_SIZE", "4096")
    path = tmp_path / "d.json"
    path.write_bytes(body)
    with pytest.raises(error) as caught:
        ds = wds.ShardListDataset(str(path), transformations=[])
        ds._index(1)
    assert words in str(caught.value) and "d.json" in str(caught.value)
    with pytest.raises(error):
        wds.shardlists.expand_source(str(path))


MHEADER = {"format": "wds_cloud.manifest-lines", "version": 1, "records": 2}
MROW = {"shard": "a.tar", "size": 1, "samples": 1, "sha256": SHA}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (_text(MHEADER, MROW, MROW), "line 3 names the shard"),
        (_text(MHEADER, MROW, dict(MROW, shard="b.tar", sha256="zz")), "line 3.sha256"),
        (_text(MHEADER, MROW, dict(MROW, shard=7)), "line 3 'shard'"),
        (_text(dict(MHEADER, records=3), MROW, dict(MROW, shard="b.tar")), "holds 2"),
        (_text(MHEADER, MROW) + b'{"shard": "b\xfe"}\n', "line 3"),
        (_text(MHEADER, MROW, dict(MROW, shard="b.tar", samples=-1)), "line 3.samples"),
    ],
    ids=["listed-twice", "bad-sha", "name-not-text", "fewer-than-announced", "not-utf8", "negative-count"],
)
def test_every_line_of_a_lines_manifest_is_checked(tmp_path, body, words):
    """A hostile manifest line is refused with our error naming the file and the line."""
    path = tmp_path / "m.json"
    path.write_bytes(body)
    with pytest.raises(MalformedDataError) as caught:
        load_manifest(str(path))
    assert words in str(caught.value) and "m.json" in str(caught.value)


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.jsonl.gz"])
def test_webdataset_reads_a_description_of_any_spelling(tmp_path, name):
    """WebDataset and the shard lists take a description named .jsonl (or gzipped) as a spec, not as a shard."""
    _shards(tmp_path, 3)
    out = str(tmp_path / name)
    with redirect_stdout(io.StringIO()):
        assert cli(["index", str(tmp_path / "s-{0000..0002}.tar"), "--format", "wids", "--output", out]) == 0
    assert len(list(wds.WebDataset(out, shardshuffle=False))) == 6
    assert len(wds.SimpleShardList(out)) == 3
