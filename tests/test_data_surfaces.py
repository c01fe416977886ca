"""Files and answers that come from data are input: indexes, wids descriptions, manifests, specs, job records,
documents, part answers.  Each is bounded, checked field by field, and its URLs stay where they belong."""

import io
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

import wds_cloud as wds
from wds_cloud import index as wds_index
from wds_cloud.errors import (
    ConfigError,
    CorruptIndexError,
    MalformedDataError,
    ObjectChangedError,
    SecurityError,
    StateMismatchError,
)
from wds_cloud.io.security import UntrustedURL, check_pipe, resolve, untrusted
from wds_cloud.manifest import load_manifest
from wds_cloud.testing.objects import HTTPObjectHandler, Server, Store, http_server, parse_range

from .conftest import make_shards


def write_tar(path, samples):
    with tarfile.open(path, "w") as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "wds_cloud", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


# code from data
def test_a_description_shard_url_that_is_a_command_never_runs(tmp_path, monkeypatch):
    """A wids description's pipe: shard URL is untrusted: refused when opened, the command never runs."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    desc = tmp_path / "d.json"
    desc.write_text(
        json.dumps({"wids_version": 1, "shardlist": [{"url": f"pipe:touch {marker}; echo", "nsamples": 1}]})
    )
    ds = wds.ShardListDataset(str(desc), transformations=[])
    with pytest.raises(SecurityError, match="WDS_ALLOW_UNTRUSTED_PIPES"):
        ds[0]
    assert not marker.exists()


def test_a_description_base_that_is_a_command_is_refused(tmp_path):
    """A 'base' of pipe: would turn every relative shard name into a command: refused at once."""
    desc = tmp_path / "d.json"
    desc.write_text(
        json.dumps({"wids_version": 1, "base": "pipe:touch X; cat ", "shardlist": [{"url": "a.tar", "nsamples": 1}]})
    )
    with pytest.raises(SecurityError, match="never a command"):
        wds.ShardListDataset(str(desc))


def test_the_untrusted_mark_survives_derivations():
    """Appending, slicing, replacing and formatting an untrusted URL give untrusted URLs."""
    url = untrusted("pipe:cat x.tar")
    for derived in (
        url + ".index.json",
        "x" + url,
        url[:-4],
        url.replace("x", "y"),
        url.strip(),
        wds_index.index_url(url),
        wds_index.dali_url(url),
        url.split(" ")[0],
        "%s" % url,
    ):
        assert isinstance(derived, UntrustedURL), derived
        with pytest.raises(SecurityError):
            check_pipe(derived if derived.startswith("pipe:") else "pipe:" + derived, wds.Settings())


def test_urls_from_remote_files_stay_remote_and_inside_their_folder(tmp_path):
    """Local paths named by a remote file are refused; relative names never climb out of their folder."""
    origin = "https://host/data/spec.json"
    assert resolve("a/b.tar", origin) == "https://host/data/a/b.tar"
    for bad in ("/etc/passwd", "file:///etc/passwd", "../secret.tar", "a/../../x.tar", "//evil/x.tar"):
        with pytest.raises(SecurityError):
            resolve(bad, origin)
    local = str(tmp_path / "spec.json")
    assert resolve("x.tar", local) == str(tmp_path / "x.tar")
    with pytest.raises(SecurityError, match="leaves"):
        resolve("../x.tar", local)
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(SecurityError, match="link"):
        resolve("link/passwd", local)
    allowed = wds.Settings(allow_untrusted_local=True)
    assert resolve("/data/x.tar", origin, settings=allowed) == "/data/x.tar"


def test_a_spec_file_over_http_may_not_name_local_files(tmp_path):
    """A dataset spec served over HTTP that names a local path is refused, naming the setting that allows it."""
    server, store = http_server()
    try:
        store.put(
            "/spec.json",
            json.dumps({"version": 1, "sources": [{"name": "a", "urls": [str(tmp_path / "x.tar")]}]}).encode(),
        )
        with pytest.raises(SecurityError, match="WDS_ALLOW_UNTRUSTED_LOCAL"):
            wds.from_spec(f"{server.url}/spec.json")
    finally:
        server.stop()


# files read from outside their folder
def test_mmc4_image_names_never_leave_the_images_folder(tmp_path):
    """An image_name with '..' is refused (exit 1); the file outside is not copied into a shard."""
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "id_rsa.jpg").write_bytes(b"PRIVATE KEY")
    (tmp_path / "images").mkdir()
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        json.dumps(
            {"text_list": ["hi"], "image_info": [{"image_name": "../secret/id_rsa.jpg", "matched_text_index": 0}]}
        )
        + "\n"
    )
    run = cli("convert", "mmc4", docs, "--images", tmp_path / "images", "--dest", tmp_path / "out" / "m-%03d.tar")
    assert run.returncode == 1 and "leaves" in run.stderr and "Traceback" not in run.stderr
    out = tmp_path / "out"
    assert not out.exists() or not any(p.suffix == ".tar" for p in out.iterdir())


# stale indexes
@pytest.fixture
def indexed_shard(tmp_path):
    path = write_tar(tmp_path / "s.tar", [(f"{i:03d}", {"txt": f"sample {i}".encode(), "cls": b"1"}) for i in range(5)])
    assert cli("index", path).returncode == 0
    return path


def test_a_replaced_local_shard_is_noticed_before_a_byte(indexed_shard, tmp_path):
    """A shard replaced after indexing (another size) raises ObjectChangedError in ShardListDataset and cat."""
    ds = wds.ShardListDataset([indexed_shard], transformations=[])
    assert ds[1][".txt"] == b"sample 1"
    write_tar(indexed_shard, [(f"x{i:04d}", {"txt": b"other " * 100}) for i in range(5)])
    with pytest.raises(ObjectChangedError, match="wds-cloud index"):
        wds.ShardListDataset([indexed_shard], transformations=[])[1]
    run = cli("cat", indexed_shard, "--key", "001", "--field", "txt")
    assert run.returncode == 1 and "changed since it was indexed" in run.stderr


def test_a_touched_local_shard_of_the_same_size_is_noticed(indexed_shard):
    """Same size, another modification time: the index's version (mtime and size) no longer matches."""
    later = os.stat(indexed_shard).st_mtime + 10
    os.utime(indexed_shard, (later, later))
    with pytest.raises(ObjectChangedError):
        wds.ShardListDataset([indexed_shard], transformations=[])[0]


def test_cat_key_over_http_notices_a_new_version(tmp_path):
    """Over HTTP, an index whose ETag is not the object's is refused by cat --key too."""
    write_tar(tmp_path / "s.tar", [(f"{i:03d}", {"txt": b"x" * 100}) for i in range(3)])
    server, store = http_server()
    try:
        store.put("/s.tar", (tmp_path / "s.tar").read_bytes())
        assert cli("index", f"{server.url}/s.tar").returncode == 0
        data = bytearray(store.objects["/s.tar"])
        data[600:610] = b"y" * 10  # same size, other bytes: another ETag
        store.put("/s.tar", bytes(data))
        run = cli("cat", f"{server.url}/s.tar", "--key", "000", "--field", "txt")
        assert run.returncode == 1 and "changed since it was indexed" in run.stderr
    finally:
        server.stop()


def index_json(shard, mutate):
    from pathlib import Path

    path = Path(shard + ".index.json")
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["samples"][0][1].reverse(), "where a tar member's data can begin"),
        (lambda d: d["samples"][0][1][0].__setitem__(2, 10**12), "WDS_MAX_MEMBER_SIZE"),
        (lambda d: d["samples"][-1][1][-1].__setitem__(1, 10**12 // 512 * 512), "past the end"),
        (lambda d: d["samples"][1][1][0].__setitem__(1, 512), "where a tar member's data can begin"),
        (lambda d: d.__setitem__("samples", [["k", [["txt", 513, 1]]]]), "where a tar member's data can begin"),
        (lambda d: d.__setitem__("size", -1), "'size'"),
        (lambda d: d.__setitem__("samples", {"a": 1}), "'samples'"),
        (lambda d: d["samples"].__setitem__(0, 5), r"samples\[0\]"),
    ],
)
def test_an_index_that_cannot_describe_its_shard_is_refused(indexed_shard, mutate, message):
    """Fields out of offset order, claims beyond the shard or the limits: CorruptIndexError naming the field."""
    index_json(indexed_shard, mutate)
    with pytest.raises(CorruptIndexError, match=message):
        wds.ShardListDataset([indexed_shard], transformations=[])[0]
    run = cli("cat", indexed_shard, "--key", "001")
    assert run.returncode == 1 and "Traceback" not in run.stderr


# parts pinned to a version
class _Swapping(HTTPObjectHandler):
    """Serves the first version with an ETag, then (after ``swap``) another version without one, ignoring If-Match."""

    swapped = None

    def _send_object(self, key, extra_headers=None):
        if self.swapped is not None and self.headers.get("Range", "").startswith("bytes=0-") is False:
            data = self.swapped
            rng = self.headers.get("Range").split("=")[1].split("-")
            start, end = int(rng[0]), min(int(rng[1]), len(data) - 1)
            body = data[start : end + 1]
            self.send_response(206)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            self.wfile.write(body)
            return
        super()._send_object(key, extra_headers)
        if type(self).swap_after_first:
            type(self).swapped = type(self).swap_after_first


def test_a_part_answered_without_a_version_is_not_the_pinned_version(tmp_path):
    """A server that ignores If-Match and sends another version without an ETag: ObjectChangedError, no splice."""
    first = make_tar_bytes(200, b"A")
    second = make_tar_bytes(200, b"B")
    assert len(first) == len(second)
    store = Store()
    handler = type("H", (_Swapping,), {"store": store, "swap_after_first": second, "swapped": None})
    server = Server(handler)
    try:
        store.put("/s.tar", first)
        ds = wds.WebDataset(f"{server.url}/s.tar", shardshuffle=False, part_size=64 << 10, concurrency=4)
        got = []
        with pytest.raises(ObjectChangedError):
            for sample in ds:
                got.append(sample["txt"][:1])
        assert set(got) <= {b"A"}  # never a sample of the other version
    finally:
        server.stop()


def make_tar_bytes(n, letter):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for i in range(n):
            info = tarfile.TarInfo(f"{i:05d}.txt")
            data = letter * 1000
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


class _Claiming(HTTPObjectHandler):
    """Answers ranges with a Content-Range claiming a petabyte object."""

    def _send_object(self, key, extra_headers=None):
        data = self.store.objects[key]
        start, end = parse_range(self.headers.get("Range"), len(data)) or (0, len(data) - 1)
        body = data[start : end + 1]
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{10**15}")
        self.send_header("ETag", '"v1"')
        self.end_headers()
        self.wfile.write(body)


def test_a_claimed_petabyte_costs_no_memory():
    """A first answer claiming 10^15 bytes: the part plan is lazy; the read ends in an error of ours."""
    import tracemalloc

    store = Store()
    server = Server(type("H", (_Claiming,), {"store": store}))
    try:
        store.put("/s.tar", make_tar_bytes(20, b"A"))
        tracemalloc.start()
        try:
            with pytest.raises((wds.TransferError, wds.CorruptShardError, ObjectChangedError)):
                for _ in wds.WebDataset(f"{server.url}/s.tar", shardshuffle=False):
                    pass
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 200 << 20
    finally:
        server.stop()


def test_the_part_plan_is_arithmetic():
    """part_step covers [start, size) in parts no longer than part_size, whatever size is claimed."""
    from wds_cloud.io.parallel import part_step, plan_parts

    step, count = part_step(100, 10**15, 8 << 20, 8)
    assert step <= 8 << 20 and count * step >= 10**15 - 100
    parts = plan_parts(100, 50 << 20, 8 << 20, 8)
    assert parts[0][0] == 100 and parts[-1][1] == 50 << 20
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


# claims
def test_a_claimed_sample_count_is_checked_before_a_sampler_lists_it(tmp_path):
    """nsamples 10**12 in a description: the sampler asks the shard's index and refuses, listing nothing."""
    path = write_tar(tmp_path / "s.tar", [(f"{i:03d}", {"txt": b"x"}) for i in range(3)])
    desc = tmp_path / "d.json"
    desc.write_text(json.dumps({"wids_version": 1, "shardlist": [{"url": "s.tar", "nsamples": 10**12}]}))
    ds = wds.ShardListDataset(str(desc), transformations=[])
    from wds_cloud.index.dataset import ChunkedSampler, ShardListSampler

    with pytest.raises(CorruptIndexError, match="nsamples"):
        next(iter(ShardListSampler(ds)))
    with pytest.raises(CorruptIndexError, match="nsamples"):
        next(iter(ChunkedSampler(ds, chunksize=2000)))
    assert os.path.exists(path)


def test_a_description_claiming_more_samples_than_bytes_is_refused(tmp_path):
    desc = tmp_path / "d.json"
    desc.write_text(json.dumps({"wids_version": 1, "shardlist": [{"url": "s.tar", "nsamples": 10, "filesize": 1024}]}))
    with pytest.raises(MalformedDataError, match="nsamples"):
        wds.ShardListDataset(str(desc))


def test_a_yaml_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    """A 600-byte billion-laughs spec: refused in well under a second, the message stays short."""
    pytest.importorskip("yaml")
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i, name in enumerate("bcdefghi"):
        prev = "abcdefghi"[i]
        lines.append(f"{name}: &{name} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]")
    lines.append("version: 1\nsources: [{name: s, urls: *i}]")
    spec = tmp_path / "bomb.yaml"
    spec.write_text("\n".join(lines))
    with pytest.raises(MalformedDataError) as info:
        wds.from_spec(str(spec))
    assert len(str(info.value)) < 600


@pytest.mark.parametrize(
    "name, load",
    [
        ("spec.json", lambda p: wds.from_spec(p)),
        ("desc.json", lambda p: wds.ShardListDataset(p)),
        ("manifest.json", lambda p: load_manifest(p)),
        ("s.tar.index.json", lambda p: wds_index.read_index(p)),
        ("list.json", lambda p: wds.WebDataset(p)),
    ],
)
def test_json_nested_deep_is_an_error_of_ours(tmp_path, name, load):
    """JSON nested 100,000 deep: MalformedDataError, never RecursionError."""
    path = tmp_path / name
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(MalformedDataError):
        load(str(path))


def test_a_data_file_past_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setenv("WDS_MAX_DATA_FILE_SIZE", "1KiB")
    path = tmp_path / "desc.json"
    path.write_text(
        json.dumps({"wids_version": 1, "shardlist": [{"url": f"s{i}.tar", "nsamples": 1} for i in range(100)]})
    )
    with pytest.raises(MalformedDataError, match="WDS_MAX_DATA_FILE_SIZE"):
        wds.ShardListDataset(str(path))


@pytest.mark.parametrize("weight", [float("inf"), 1e308, float("nan"), 0, -1, True])
def test_weights_must_be_finite_and_bounded(weight, shards):
    with pytest.raises(ConfigError, match="weight"):
        wds.from_spec(
            {
                "version": 1,
                "sources": [
                    {"name": "a", "urls": shards, "weight": 1},
                    {"name": "b", "urls": shards, "weight": weight},
                ],
            }
        )


def test_a_mix_state_whose_draws_the_pass_cannot_hold_is_refused(shards):
    spec = {"version": 1, "seed": 1, "sources": [{"name": "a", "urls": shards}, {"name": "b", "urls": shards}]}
    ds = wds.from_spec(spec)
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = ds.state_dict()
    mix = next(s[2] for s in state["stages"] if s[1] == "MixSource")
    mix["draws"] = 10**12
    other = wds.from_spec(spec)
    with pytest.raises(StateMismatchError, match="draws"):  # refused on load: nothing is replayed
        other.load_state_dict(state)


# raw errors
@pytest.mark.parametrize("entry", [5, [1, 2], {"size": "big"}, {"samples": -1}, {"sha256": "zz"}])
def test_a_malformed_manifest_entry_is_refused_before_a_shard_is_read(shards, tmp_path, entry):
    first = shards.replace("{000..002}", "000")  # (shards is a brace spec: its first character named the root)
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"format": "wds_cloud.manifest", "version": 1, "shards": {first: entry}}))
    with pytest.raises(MalformedDataError, match="manifest"):
        list(wds.WebDataset(first, manifest=str(manifest)))


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe{",
        b"{" * 50_000,
        b'{"format": 5}',
        b"v1.2 x\n",
        b"v1.2 1\ntxt a b c\n",
        b'{"format":"wds_cloud.index","version":1,"samples":[["k",[["t",0,1]]]]}',
    ],
)
def test_malformed_sidecars_give_our_errors_and_no_tracebacks(tmp_path, content):
    path = write_tar(tmp_path / "s.tar", [("000", {"txt": b"x"})])
    (tmp_path / "s.tar.index.json").write_bytes(content)
    with pytest.raises(MalformedDataError):
        wds_index.read_index(path)
    run = cli("cat", path, "--key", "000")
    assert run.returncode == 1 and "Traceback" not in run.stderr and "wds-cloud cat: error" in run.stderr


# the tools own their outputs
def test_reshard_refuses_an_output_that_is_its_input(tmp_path):
    make_shards(tmp_path, nshards=2, per_shard=5)
    run = cli("reshard", tmp_path / "shard-{000..001}.tar", tmp_path / "shard-%03d.tar")
    assert run.returncode == 2 and "both an input and an output" in run.stderr  # a bad argument: exit 2


def test_reshard_rerun_with_other_settings_is_refused_and_the_same_job_keeps_its_outputs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    make_shards(src, nshards=2, per_shard=10)
    spec, dest = src / "shard-{000..001}.tar", tmp_path / "out" / "o-%03d.tar"
    assert cli("reshard", spec, dest, "--maxcount", "6").returncode == 0
    again = cli("reshard", spec, dest, "--maxcount", "6", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["kept"] == 4
    other = cli("reshard", spec, dest, "--maxcount", "4")
    assert other.returncode == 2 and "another job" in other.stderr
    assert sum(1 for _ in wds.WebDataset(str(tmp_path / "out" / "o-{000..003}.tar"), shardshuffle=False)) == 20


def test_a_file_the_job_did_not_write_is_refused_not_kept(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    make_shards(src, nshards=1, per_shard=4)
    out = tmp_path / "out"
    out.mkdir()
    (out / "o-001.tar").symlink_to(src / "shard-000.tar")  # a planted link at an output name
    run = cli("reshard", src / "shard-000.tar", out / "o-%03d.tar", "--maxcount", "2")
    assert run.returncode == 1 and "o-001.tar" in run.stderr and "no record" in run.stderr
    assert not (out / "o-000.tar").exists()  # refused before anything was written


def test_a_changed_output_is_written_again(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    make_shards(src, nshards=1, per_shard=4)
    dest = tmp_path / "out" / "o-%03d.tar"
    assert cli("reshard", src / "shard-000.tar", dest, "--maxcount", "2").returncode == 0
    (tmp_path / "out" / "o-000.tar").write_bytes(b"damaged")
    run = cli("reshard", src / "shard-000.tar", dest, "--maxcount", "2", "--json")
    assert run.returncode == 0 and json.loads(run.stdout)["written"] == 1
    assert len(list(wds.WebDataset(str(tmp_path / "out" / "o-{000..001}.tar"), shardshuffle=False))) == 4


def test_what_an_interrupted_run_published_unrecorded_is_written_again_but_a_link_is_refused(tmp_path):
    """The record is saved before the first output and then about once a second: a run stopped between an
    output's publication and the next save leaves a file the record does not list.  With this job's record
    there, such a regular file is the job's own (written again); a link is never the job's (refused)."""
    from wds_cloud.jobs.record import record_url

    src = tmp_path / "src"
    src.mkdir()
    make_shards(src, nshards=1, per_shard=6)
    dest = tmp_path / "out" / "o-%03d.tar"
    assert cli("reshard", src / "shard-000.tar", dest, "--maxcount", "2").returncode == 0
    record = pathlib.Path(record_url(str(dest)))

    def unlist(name: str) -> None:  # the record's line of that output gone: published, then the run died
        lines = record.read_text().splitlines(keepends=True)
        record.write_text("".join(line for line in lines if f'"output":"{name}"' not in line))

    unlist("o-002.tar")
    (tmp_path / "out" / "o-002.tar").write_bytes(b"half of an earlier attempt")
    run = cli("reshard", src / "shard-000.tar", dest, "--maxcount", "2", "--json")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert [pathlib.Path(p).name for p in summary.pop("removed")] == ["o-002.tar"]  # removed, then written again
    assert summary == {"samples": 6, "shards": 3, "written": 1, "kept": 2}
    assert len(list(wds.WebDataset(str(tmp_path / "out" / "o-{000..002}.tar"), shardshuffle=False))) == 6
    unlist("o-001.tar")
    (tmp_path / "out" / "o-001.tar").unlink()
    (tmp_path / "out" / "o-001.tar").symlink_to(src / "shard-000.tar")
    run = cli("reshard", src / "shard-000.tar", dest, "--maxcount", "2")
    assert run.returncode == 1 and "o-001.tar" in run.stderr and "no record" in run.stderr


def test_index_output_refuses_a_strangers_file(tmp_path):
    make_shards(tmp_path, nshards=1, per_shard=3)
    stranger = tmp_path / "idx.json"
    stranger.write_text("mine")
    run = cli("index", tmp_path / "shard-000.tar", "--output", stranger)
    assert run.returncode == 1 and "no record" in run.stderr and stranger.read_text() == "mine"


# packed batches
def test_packed_bytes_offsets_are_checked():
    torch = pytest.importorskip("torch")
    from wds_cloud.transport import PackedBytes

    data = torch.zeros(10, dtype=torch.uint8)
    assert list(PackedBytes(data, [0, 4, 10])) == [bytes(4), bytes(6)]
    for offsets in ([0, 4, 11], [0, 5, 4], [-1, 2], [0, 2.0], [], "0,1"):
        with pytest.raises(ValueError, match="offsets"):
            PackedBytes(data, offsets)


# requests
def test_a_url_with_a_space_or_control_character_is_refused_before_any_request():
    server, store = http_server()
    try:
        store.put("/a b.tar", b"x")
        for url in (f"{server.url}/a b.tar?sig=SECRET", f"{server.url}/a\nb.tar?sig=SECRET"):
            with pytest.raises(ConfigError) as info:
                wds.gopen(url).read()
            assert "SECRET" not in str(info.value) and "position" in str(info.value)
        assert store.requests == []
    finally:
        server.stop()


def test_a_header_ending_in_a_newline_is_refused_without_its_value():
    server, store = http_server()
    try:
        store.put("/a.tar", b"x")
        with pytest.raises(ConfigError) as info:
            wds.gopen(f"{server.url}/a.tar", storage_options={"headers": {"Authorization": "Bearer TOKEN\n"}}).read()
        assert "TOKEN" not in str(info.value) and "Authorization" in str(info.value)
        assert store.requests == []
    finally:
        server.stop()


def _small_tar(n=3):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            data = f"sample {i}".encode()
            info = tarfile.TarInfo(f"k{i}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_shard_named_beyond_ascii_is_read_over_http():
    """A shard whose name is not ASCII (日本.tar), named in a URL or by a wids description served over HTTP, is
    requested percent-encoded as UTF-8, as browsers and curl do, and read; a name already percent-encoded goes as
    given, never encoded twice (adversary finding, issue 41: a bare UnicodeEncodeError naming nothing)."""
    server, store = http_server()
    try:
        store.put("/d/日本.tar", _small_tar())
        store.put("/d/100%.tar", _small_tar())
        description = {"wids_version": 1, "shardlist": [{"url": "日本.tar", "nsamples": 3}]}
        store.put("/d/desc.json", json.dumps(description).encode())
        for url in (f"{server.url}/d/日本.tar", f"{server.url}/d/%E6%97%A5%E6%9C%AC.tar", f"{server.url}/d/100%25.tar"):
            keys = [s["__key__"] for s in wds.WebDataset(url, shardshuffle=False)]
            assert keys == ["k0", "k1", "k2"], url
        assert wds.ShardListDataset(f"{server.url}/d/desc.json", transformations=[])[2]["__key__"] == "k2"
    finally:
        server.stop()


def test_a_url_or_header_http_cannot_carry_is_our_error_naming_it():
    """A URL holding a lone surrogate (not text) and a header that is not Latin-1 are ConfigErrors naming the URL
    (or the header, never its value), before any request; not a bare UnicodeEncodeError."""
    server, store = http_server()
    try:
        store.put("/a.tar", b"x")
        with pytest.raises(ConfigError, match="not text") as info:
            wds.gopen(f"{server.url}/a\ud800.tar?sig=SECRET").read()
        assert "/a" in str(info.value) and "SECRET" not in str(info.value)
        with pytest.raises(ConfigError) as info:
            headers = {"Authorization": "Bearer \u201cTOKEN\u201d"}
            wds.gopen(f"{server.url}/a.tar", storage_options={"headers": headers}).read()
        assert "Authorization" in str(info.value) and "TOKEN" not in str(info.value)
        assert store.requests == []
    finally:
        server.stop()


class _Recording(HTTPObjectHandler):
    def do_GET(self):
        self.store.requests.append(("AUTH", self.headers.get("Authorization")))
        super().do_GET()


class _Bouncing(HTTPObjectHandler):
    """A target that sends the read on to a third host."""

    third = ""

    def do_GET(self):
        self.store.requests.append(("AUTH", self.headers.get("Authorization")))
        self.send_response(302)
        self.send_header("Location", self.third + self.path.split("?")[0])
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_an_aistore_token_goes_to_the_gateway_and_its_target_never_further(monkeypatch):
    from .servers import ais_cluster

    gateway, target, store, buckets = ais_cluster(token="TOK")
    third_store = Store()
    third = Server(type("Third", (_Recording,), {"store": third_store}))
    bouncer_store = Store()
    bouncer = Server(type("Bounce", (_Bouncing,), {"store": bouncer_store, "third": third.url}))
    try:
        buckets.add(("ais", "b"))
        third_store.put("/v1/objects/b/x.tar", b"data")
        gateway.httpd.RequestHandlerClass.target = bouncer.url  # the gateway's target bounces on
        monkeypatch.setenv("AIS_ENDPOINT", gateway.url)
        monkeypatch.setenv("AIS_AUTHN_TOKEN", "TOK")
        with wds.gopen("ais://b/x.tar") as stream:
            assert stream.read() == b"data"
        assert ("AUTH", "Bearer TOK") in bouncer_store.requests  # the target the gateway named: trusted
        seen = [r[1] for r in third_store.requests if r[0] == "AUTH"]
        assert seen and all(auth is None for auth in seen)  # a third host: never
    finally:
        for s in (gateway, target, third, bouncer):
            s.stop()


def test_an_index_built_locally_serves_the_uploaded_copy(tmp_path):
    """Shards indexed on local disk and uploaded with their indexes: the local version is not the store's, so
    the size and layout are checked, and reads work; a copy of another size is still refused."""
    path = write_tar(tmp_path / "s.tar", [(f"{i:03d}", {"txt": b"x" * 100}) for i in range(3)])
    assert cli("index", path).returncode == 0
    server, store = http_server()
    try:
        store.put("/s.tar", (tmp_path / "s.tar").read_bytes())
        store.put("/s.tar.index.json", (tmp_path / "s.tar.index.json").read_bytes())
        assert wds.ShardListDataset([f"{server.url}/s.tar"], transformations=[])[2][".txt"] == b"x" * 100
        store.put("/s.tar", (tmp_path / "s.tar").read_bytes() + bytes(512))
        with pytest.raises(ObjectChangedError):
            wds.ShardListDataset([f"{server.url}/s.tar"], transformations=[])[2]
    finally:
        server.stop()


def test_a_held_shard_replaced_under_its_name_keeps_giving_the_indexed_version(indexed_shard):
    """A local shard read by index is held open: replaced by another file under its name, the held one (the
    version indexed) keeps giving its own bytes; a dataset opened afterwards refuses the new file."""
    ds = wds.ShardListDataset([indexed_shard], transformations=[])
    assert ds[1][".txt"] == b"sample 1"
    with open(indexed_shard, "rb") as f:
        original = f.read()
    with open(indexed_shard + ".new", "wb") as f:
        f.write(original.replace(b"sample 1", b"SAMPLE 1") + bytes(512))
    os.replace(indexed_shard + ".new", indexed_shard)
    assert ds[1][".txt"] == b"sample 1"
    ds.close()
    with pytest.raises(ObjectChangedError):
        wds.ShardListDataset([indexed_shard], transformations=[])[1]


def test_a_held_shard_changed_in_place_is_noticed_before_the_next_read(indexed_shard):
    ds = wds.ShardListDataset([indexed_shard], transformations=[])
    assert ds[1][".txt"] == b"sample 1"
    with open(indexed_shard, "r+b") as f:  # the same file, rewritten in place
        data = f.read()
        f.seek(0)
        f.write(data.replace(b"sample 1", b"SAMPLE 1"))
    later = os.stat(indexed_shard).st_mtime + 5
    os.utime(indexed_shard, (later, later))
    with pytest.raises(ObjectChangedError):
        ds[1]
    ds.close()
