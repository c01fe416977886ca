"""`wds-cloud ls FOLDER/` lists a folder or a store's prefix with sizes, the total and a brace spec of the shards."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest

import wds_cloud as wds
from wds_cloud.cli import main

from .cloud import moto_endpoint, unique  # noqa: F401 (fixtures)


def run(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def folder(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for s in range(3):
        with wds.TarWriter(str(data / f"train-{s:04d}.tar")) as writer:
            writer.write({"__key__": f"k{s}", "txt": b"x" * (s + 1)})
    (data / "notes.txt").write_bytes(b"hello")
    (data / "sub").mkdir()
    return data


def test_a_local_folder_is_listed_with_sizes_total_and_spec(folder, capsys):
    """`ls data/` said "is a directory": it lists the objects, the total and the shards' brace spec."""
    for given in (str(folder) + "/", str(folder), "file://" + str(folder) + "/"):
        code, out, err = run(capsys, "ls", given)
        assert code == 0, err
        assert re.search(r"^\s+5  notes\.txt$", out, re.M) and "DIR  sub/" in out, out
        assert "total: 4 objects" in out and "3 shards" in out, out
        assert "shards: " + given.rstrip("/") + "/train-{0000..0002}.tar" in out, out
    code, out, _ = run(capsys, "ls", str(folder) + "/", "--json")
    data = json.loads(out)
    assert data["total"]["objects"] == 4 and data["total"]["shards"] == 3
    assert [e["name"] for e in data["entries"]][:2] == ["notes.txt", "sub/"]  # in name order
    assert data["shard_specs"] == [str(folder) + "/train-{0000..0002}.tar"]
    assert data["total"]["bytes"] == sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def test_the_spec_names_the_shards_it_found(folder, capsys):
    """The brace spec printed is one every shard command takes: it names exactly the shards listed."""
    code, out, _ = run(capsys, "ls", str(folder) + "/", "--json")
    spec = json.loads(out)["shard_specs"][0]
    code, out, err = run(capsys, "stat", spec, "--json")
    assert code == 0 and json.loads(out)["total"]["shards"] == 3, err


def test_a_shard_is_still_listed_by_member(folder, capsys):
    code, out, _ = run(capsys, "ls", str(folder / "train-0001.tar"))
    assert code == 0 and "k1.txt" in out


def test_links_out_of_the_folder_are_not_followed(folder, tmp_path, capsys):
    """A link leading out of the folder (or up through '..') is counted, never listed or sized."""
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "big.bin").write_bytes(b"s" * 1000)
    os.symlink(tmp_path / "secret" / "big.bin", folder / "out.bin")
    os.symlink("../secret", folder / "up")
    os.symlink("train-0000.tar", folder / "alias.tar")
    code, out, _ = run(capsys, "ls", str(folder) + "/", "--json")
    data = json.loads(out)
    names = [e["name"] for e in data["entries"]]
    assert "out.bin" not in names and "up/" not in names and "alias.tar" in names
    assert data["links_outside_not_listed"] == 2


@pytest.mark.parametrize(
    "given, said, code",
    [("nosuch/", "no such folder", 1), ("{folder}/train-0000.tar/", "a file, not a folder", 2)],
)
def test_local_errors_name_the_path_and_the_fix(folder, capsys, monkeypatch, given, said, code):
    monkeypatch.chdir(folder.parent)
    got, _, err = run(capsys, "ls", given.format(folder=folder))
    assert got == code and said in err and given.format(folder=folder) in err, err


def test_an_http_folder_without_an_index_page_says_http_has_no_listing(capsys):
    from . import servers

    server, store = servers.http_server()
    try:
        code, _, err = run(capsys, "ls", server.url + "/data/")
    finally:
        server.stop()
    assert code == 2 and "has no listing" in err and "/data/" in err and "brace spec" in err, err


def moto_bucket(endpoint, tmp_path, monkeypatch, name, keys, scope=""):
    """A fresh bucket on the moto server holding ``keys`` ({key: body}), and a profile (for ``s3://`` URLs
    under ``scope``, or all) pointing wds_cloud at it; (bucket, boto3 client)."""
    boto3 = pytest.importorskip("boto3")
    bucket = unique(name)
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)
    for key, body in keys.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
    profiles = tmp_path / "profiles.toml"
    where = f"{bucket}/" if scope == "bucket" else ""
    profiles.write_text(
        f'["s3://{where}"]\nendpoint_url = "{endpoint}"\nkey = "testing"\n'
        'secret = "testing"\nclient_kwargs = {region_name = "us-east-1"}\n'
    )
    monkeypatch.setenv("WDS_CLOUD_CONFIG", str(profiles))
    return bucket, client


@pytest.fixture
def s3_prefix(moto_endpoint, tmp_path, monkeypatch):  # noqa: F811
    keys = {f"train/part-{s:03d}.tar": b"t" * (s + 1) for s in range(12)}
    keys["train/deep/x.tar"] = b"x"
    return moto_bucket(moto_endpoint, tmp_path, monkeypatch, "ls", keys, scope="bucket")[0]


def test_an_s3_prefix_is_listed(s3_prefix, capsys):
    """`ls s3://bucket/prefix/` failed "corrupt tar at byte 0": it lists as `aws s3 ls` does, with the spec."""
    code, out, err = run(capsys, "ls", f"s3://{s3_prefix}/train/")
    assert code == 0, err
    assert "total: 12 objects, 78 bytes, 1 folder, 12 shards" in out and "DIR  deep/" in out, out
    assert f"shards: s3://{s3_prefix}/train/part-{{000..011}}.tar" in out, out


def test_a_missing_remote_shard_hint_is_a_command_that_works(s3_prefix, capsys):
    """The missing-shard message says `wds-cloud ls FOLDER/`: that command now lists the folder."""
    code, _, err = run(capsys, "ls", f"s3://{s3_prefix}/train/part-999.tar")
    assert code == 1
    hint = re.search(r"`wds-cloud ls ([^`]+)`", err).group(1)
    code, out, err = run(capsys, "ls", hint)
    assert code == 0 and "part-000.tar" in out, err


def test_a_missing_prefix_names_the_url(s3_prefix, capsys):
    code, _, err = run(capsys, "ls", f"s3://{s3_prefix}/nosuch/")
    assert code == 1 and f"s3://{s3_prefix}/nosuch/" in err and "check the name" in err, err


def test_settings_say_what_each_default_means(capsys):
    """`settings` showed `WDS_CACHE_SIZE ... default: none` without saying it means no limit: a default that is
    not a plain amount says what it means in words (none, a switch's 0 or 1, "measured", "see below")."""
    code, out, _ = run(capsys, "settings", "--json")
    rows = {name: row for row in json.loads(out)["settings"] for name in row["names"]}
    assert "no limit" in rows["WDS_CACHE_SIZE"]["default"]
    for name, row in rows.items():
        default = row["default"]
        assert default not in ("none", "0", "1", "see below", "measured", "the system's"), (name, default)
        if row["format"].startswith("boolean"):
            assert default.endswith(("(on)", "(off)")), (name, default)
    code, out, _ = run(capsys, "settings", "cache_size")
    assert "default: none (no limit" in out, out


def test_the_environment_table_never_breaks_a_name():
    """The generated table let the theme wrap WDS_MAX_CONCURRENCY mid-name: names are unbreakable code."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "_hooks" / "generated.py"
    spec = importlib.util.spec_from_file_location("generated", path)
    generated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generated)
    page = generated.environment_page()
    assert '<code style="white-space: nowrap">WDS_MAX_CONCURRENCY</code>' in page
    assert '<code style="white-space: nowrap">WDS_&lt;NAME&gt;</code>' in page


@pytest.fixture
def s3_odd_keys(moto_endpoint, tmp_path, monkeypatch):  # noqa: F811
    keys = ("train/s-0000.tar", "train/s-0001.tar", "train//dbl.tar", "train/../esc.tar", "train//s-0007.tar")
    return moto_bucket(moto_endpoint, tmp_path, monkeypatch, "odd", {key: b"x" for key in keys})


def test_s3_keys_with_empty_and_dot_segments_are_listed_as_the_store_has_them(s3_odd_keys, capsys):
    """`ls s3://b/train/` showed a `DIR train/` that does not exist and hid `train//` and `train/../`;
    `ls s3://b/train//` listed train/ and printed a spec of names that do not exist."""
    bucket, client = s3_odd_keys
    code, out, err = run(capsys, "ls", f"s3://{bucket}/train/", "--json")
    assert code == 0, err
    names = [e["name"] for e in json.loads(out)["entries"]]
    assert names == ["../", "/", "s-0000.tar", "s-0001.tar"], names
    code, text, _ = run(capsys, "ls", f"s3://{bucket}/train/")
    assert "DIR  train/" not in text and f"`wds-cloud ls s3://{bucket}/train/../`" in text, text
    for prefix, expected in (("train//", ["dbl.tar", "s-0007.tar"]), ("train/../", ["esc.tar"])):
        code, out, err = run(capsys, "ls", f"s3://{bucket}/{prefix}", "--json")
        assert code == 0, err
        listing = json.loads(out)
        assert [e["name"] for e in listing["entries"]] == expected, listing
        for spec in listing["shard_specs"]:  # every name a printed spec expands to exists
            for name in wds.shardlists.expand_urls(spec):
                client.head_object(Bucket=bucket, Key=name.split("/", 3)[3])


def test_a_missing_bucket_is_said_to_be_missing(s3_odd_keys, capsys):
    """`ls s3://nobucket/` said "nothing under this prefix": it says the bucket does not exist."""
    for given in ("s3://nobucket1/", "s3://nobucket1/train/"):
        code, _, err = run(capsys, "ls", given)
        assert code == 1 and "'nobucket1' does not exist" in err and given in err, err


def test_local_entries_not_listed_are_counted_and_names_escaped(folder, capsys):
    """FIFOs, dangling links and link loops were dropped without a word; a newline in a name broke the text;
    unnumbered shards were counted as shards but were in no spec."""
    os.mkfifo(folder / "pipe")
    os.symlink("nothing-there", folder / "dangling")
    os.symlink("loop", folder / "loop")
    (folder / "two\nlines.tar").write_bytes(b"")
    (folder / "extra.tar").write_bytes(b"")
    code, out, err = run(capsys, "ls", str(folder) + "/")
    assert code == 0, err
    assert "3 entries not listed (not a file or a folder): 1 FIFO, 1 dangling link, 1 link loop" in out, out
    assert "two\\nlines.tar" in out and not any(line.startswith("lines.tar") for line in out.splitlines()), out
    assert "2 shards outside any spec" in out and "extra.tar" in out, out
    code, out, _ = run(capsys, "ls", str(folder) + "/", "--json")
    data = json.loads(out)
    assert data["not_listed"] == {"FIFO": 1, "dangling link": 1, "link loop": 1}
    assert data["shards_outside_specs"] == 2 and data["total"]["shards"] == 5


def test_a_reshard_on_dask_stopped_part_way_keeps_what_it_finished(tmp_path, monkeypatch, capsys):
    """F7: a Dask reshard stopped part-way recorded no output of a task that had not ended (the rerun kept 0 and
    wrote everything again): each output is recorded as it is published, and the rerun keeps it."""
    distributed = pytest.importorskip("distributed")
    import contextlib

    from wds_cloud.cli import shardtools
    from wds_cloud.jobs import record as jobrecord

    source = str(tmp_path / "in.tar")
    with wds.TarWriter(source) as writer:
        for i in range(10):
            writer.write({"__key__": f"s{i:02d}", "txt": b"x" * i})
    dest = str(tmp_path / "out" / "re-%03d.tar")
    (tmp_path / "out").mkdir()

    @contextlib.contextmanager
    def in_process(args):  # a cluster of threads in this process, so that the stop below reaches its worker
        with distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=None) as client:
            yield client

    close = jobrecord.HashingWriter.close

    def stops_at_the_fourth(self):  # the job stops as the fourth output is published: three are finished
        if self.name.endswith("re-003.tar"):
            raise OSError("stopped here by the test")
        close(self)

    monkeypatch.setattr(shardtools, "_cluster", in_process)
    monkeypatch.setattr(jobrecord.HashingWriter, "close", stops_at_the_fourth)
    code, out, err = run(capsys, "reshard", source, dest, "--maxcount", "2", "--workers", "1")
    assert code != 0 and "stopped here" in err, err
    monkeypatch.setattr(jobrecord.HashingWriter, "close", close)
    code, out, err = run(capsys, "reshard", source, dest, "--maxcount", "2", "--workers", "1", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["kept"] == 3 and summary["written"] == 2, summary


def test_gs_without_credentials_fails_at_once_and_says_how_to_give_them(tmp_path, monkeypatch, capsys, caplog):
    """F7: `ls --json gs://b/` without credentials asked the GCE metadata server (over a minute of retries), then
    retried a refused endpoint for 90 s: no JSON.  Now: anonymous at once, said with how to give credentials, and
    one request to the endpoint, whose refusal is the JSON error."""
    pytest.importorskip("gcsfs")
    import socket

    with socket.socket() as sock:  # a loopback port nothing listens on: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(f'["gs://"]\nendpoint_url = "http://127.0.0.1:{port}"\n')
    monkeypatch.setenv("WDS_CLOUD_CONFIG", str(profiles))
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    from google.auth.compute_engine import _metadata

    monkeypatch.setattr(_metadata, "detect_gce_residency_linux", lambda: False)  # not a Google Cloud VM
    caplog.set_level(logging.WARNING)
    code, out, err = run(capsys, "ls", "--json", "gs://b/")
    assert code == 1 and "connection refused" in json.loads(out)["error"], out
    said = [r.getMessage() for r in caplog.records if "no Google credentials found" in r.getMessage()]
    assert said and "GOOGLE_APPLICATION_CREDENTIALS" in said[0] and 'token = "anon"' in said[0], said


def test_stat_of_several_shards_reports_each_and_the_one_that_failed(tmp_path, capsys):
    """`stat 'train-{0098..0100}.tar'` with 0100 missing: the two that exist are reported, the missing one is
    named with its error, and the exit code says a shard could not be read (it printed only the error)."""
    import json as _json

    from wds_cloud.cli import main as cli_main

    from .test_resume import write_shards

    write_shards(tmp_path, [3, 4])
    spec = str(tmp_path / "p{00..02}.tar")
    assert cli_main(["stat", "--json", spec]) == 1
    out = _json.loads(capsys.readouterr().out)
    assert out["total"]["shards"] == 2 and out["total"]["samples"] == 7 and out["total"]["failed"] == 1
    assert out["failed"][0]["url"].endswith("p02.tar")
    assert cli_main(["stat", spec]) == 1
    text = capsys.readouterr().out
    assert "p02.tar: could not be read" in text and "1 could not be read" in text


def test_the_reading_commands_help_says_their_own_exit_codes(capsys):
    """ls, cat and stat have no job or destination: their --help does not speak of recorded flags."""
    from wds_cloud.cli import main as cli_main

    for command in ("ls", "cat", "stat"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        text = capsys.readouterr().out
        assert "exit codes: 0 done" in text and "recorded at the destination" not in text, command


@pytest.mark.parametrize("samples_flag", [[], ["--samples"], ["--json"]])
def test_a_damaged_shard_is_listed_up_to_the_damage_then_the_error(tmp_path, capsys, samples_flag):
    """As `tar tv` lists a cut archive: the samples whole before the damage, then the error (exit 1); the
    listing showed nothing at all (new user finding).  With --json, the one document is the error's."""
    path = tmp_path / "cut.tar"
    with wds.TarWriter(str(path)) as writer:
        for i in range(50):
            writer.write({"__key__": f"s{i:03d}", "txt": b"x" * 1000, "cls": b"%d" % i})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 + 100])  # cut inside a member
    code, out, err = run(capsys, "ls", *samples_flag, str(path))
    whole = len(data) // 2 // (1536 + 1024)  # each sample: members of 512 + 1024 and 512 + 512 bytes
    if samples_flag == ["--json"]:
        error = json.loads(out)
        assert code == 1 and error["ok"] is False and "truncated" in error["error"]
        return
    assert code == 1 and "truncated" in err and str(path) in err
    if samples_flag:
        keys = [line.split()[0] for line in out.splitlines()]
        assert keys == [f"s{i:03d}" for i in range(len(keys))] and len(keys) >= whole - 2
    else:
        names = [line.split()[-1] for line in out.splitlines()]
        assert names[:2] == ["s000.cls", "s000.txt"] and len(names) >= 2 * (whole - 2)


def test_index_says_which_shards_it_indexed_when_one_among_them_is_damaged(tmp_path, capsys):
    """New user finding: one damaged shard among good ones printed only its error, though the others' indexes
    were written; now each shard's line, the failure, and a count (exit 1), as stat and verify say it."""
    good = []
    for name in ("g1", "g2"):
        path = tmp_path / f"{name}.tar"
        with wds.TarWriter(str(path)) as writer:
            for i in range(5):
                writer.write({"__key__": f"s{i}", "txt": b"x"})
        good.append(str(path))
    cut = tmp_path / "cut.tar"
    cut.write_bytes((tmp_path / "g1.tar").read_bytes()[:3000])
    code, out, err = run(capsys, "index", good[0], str(cut), good[1])
    assert code == 1
    assert f"{good[0]}: 5 samples -> {good[0]}.index.json" in out and f"{good[1]}: 5 samples" in out
    assert f"{cut}: could not be read:" in out and "2 of 3 shards indexed; 1 could not be read" in out
    assert os.path.exists(good[0] + ".index.json") and not os.path.exists(str(cut) + ".index.json")
    code, out, _ = run(capsys, "index", "--json", good[0], str(cut), good[1])
    data = json.loads(out)
    assert code == 1 and data["ok"] is False and len(data["shards"]) == 2 and data["failed"][0]["url"] == str(cut)


def test_verify_names_a_failing_shard_once(tmp_path, capsys):
    """New user finding: a failure line read `FAIL cut.tar: cut.tar: corrupt tar ...`."""
    path = tmp_path / "cut.tar"
    with wds.TarWriter(str(path)) as writer:
        for i in range(5):
            writer.write({"__key__": f"s{i}", "txt": b"x" * 1000})
    path.write_bytes(path.read_bytes()[:3000])
    code, out, _ = run(capsys, "verify", str(path))
    line = next(line for line in out.splitlines() if line.startswith("FAIL"))
    assert code == 1 and line.count(str(path)) == 1 and "corrupt tar" in line
