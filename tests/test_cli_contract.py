"""What the wds-cloud commands promise a CLI user: exit codes as --help says, --json everywhere results are
printed, messages that name flags, verify against a manifest as a copied or partial dataset needs, and
progress in a job log."""

import json
import shutil
import tarfile

import pytest

from wds_cloud.cli import build_parser, main

from .conftest import make_shards


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def data(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    spec = make_shards(folder, nshards=3, per_shard=4)
    return folder, spec


USAGE_ERRORS = [
    ["verify", "{spec}", "--jobs", "0"],
    ["stat", "{spec}", "--jobs", "-3"],
    ["stat", ""],
    ["cat", "{folder}/shard-000.tar", "--field", "txt"],
    ["cat", "{folder}/shard-000.tar", "--json"],
    ["index", "{spec}", "--format", "wids"],
    ["index", "{spec}", "--output", "{folder}/one.json"],
    ["reshard", "{spec}", "{folder}/out.tar"],
    ["reshard", "{spec}", "{folder}/out-%d.tar", "--maxcount", "0"],
    ["reshard", "{spec}", "{folder}/out-%d.tar", "--maxsize", "0"],
    ["convert", "mmc4", "{folder}/docs.jsonl", "--images", "{folder}", "--dest", "{folder}/x.tar"],
    [
        "convert",
        "mmc4",
        "{folder}/docs.jsonl",
        "--images",
        "{folder}",
        "--dest",
        "{folder}/x-%d.tar",
        "--maxcount",
        "0",
    ],
    ["demo", "--samples", "0"],
    ["verify", "{spec}", "--no-such-flag"],
    ["index", "{spec}", "--format", "xml"],
    ["stat"],
    ["no-such-command"],
    [],
]


@pytest.mark.parametrize("argv", USAGE_ERRORS, ids=lambda a: " ".join(a) or "nothing")
def test_bad_arguments_always_exit_2_and_name_the_flag(data, capsys, argv):
    folder, spec = data
    argv = [a.format(spec=spec, folder=folder) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and ("usage" in err or "--" in err)
    assert not list(folder.glob("out*")) and not list(folder.glob("x*"))  # nothing written


def test_help_says_the_exit_codes(capsys):
    parser = build_parser()
    assert "2 bad arguments" in parser.format_help()
    for command in ("ls", "cat", "stat", "index", "verify", "reshard"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "2 bad arguments" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["backends"],
        ["backends", "--all"],
        ["ls", "{folder}/shard-000.tar"],
        ["ls", "--samples", "{folder}/shard-000.tar"],
        ["stat", "{spec}"],
        ["index", "{spec}"],
        ["verify", "{spec}"],
        ["reshard", "{spec}", "{folder}/r-%02d.tar"],
        ["demo", "--samples", "8", "--shards", "1", "--workers", "0", "--url", "{folder}/demo"],
    ],
    ids=lambda a: a[0] + ("-all" if "--all" in a else ""),
)
def test_every_command_that_prints_results_prints_json(data, capsys, argv):
    pytest.importorskip("PIL")
    folder, spec = data
    code, out, err = run(capsys, *[a.format(spec=spec, folder=folder) for a in argv], "--json")
    assert code == 0, err
    json.loads(out)


def test_backends_json_says_what_each_scheme_needs(capsys):
    code, out, _ = run(capsys, "backends", "--json")
    rows = json.loads(out)["backends"]
    assert {r["scheme"] for r in rows} >= {"file", "pipe", "s3", "gs", "az", "http", "https", "ais"}
    assert all(r["kind"] == "plugin" for r in rows)
    code, out, _ = run(capsys, "backends", "--all", "--json")
    assert any(r["kind"] == "fsspec" for r in json.loads(out)["backends"])


def test_cat_without_json_writes_the_shard(data, capsysbinary):
    folder, _ = data
    assert main(["cat", str(folder / "shard-000.tar")]) == 0
    assert capsysbinary.readouterr().out == (folder / "shard-000.tar").read_bytes()


# verify against a manifest
def test_a_manifest_names_its_shards_relative_to_itself_and_a_copied_dataset_verifies(data, tmp_path, capsys):
    folder, spec = data
    manifest = folder / "manifest.json"
    assert run(capsys, "verify", spec, "--write-manifest", manifest)[0] == 0
    names = set(json.loads(manifest.read_text())["shards"])
    assert names == {"shard-000.tar", "shard-001.tar", "shard-002.tar"}
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(folder, copy)
    code, out, err = run(capsys, "verify", str(copy / "shard-{000..002}.tar"), "--manifest", copy / "manifest.json")
    assert code == 0, out + err
    (copy / "shard-001.tar").write_bytes((folder / "shard-000.tar").read_bytes())  # and the copy is really checked
    code, out, _ = run(capsys, "verify", str(copy / "shard-{000..002}.tar"), "--manifest", copy / "manifest.json")
    assert code == 1 and "FAIL" in out and "shard-001.tar" in out and "sha256" in out


def test_verify_checks_the_shards_given_a_subset_is_not_a_failure(data, capsys):
    folder, spec = data
    manifest = folder / "manifest.json"
    assert run(capsys, "verify", spec, "--write-manifest", manifest)[0] == 0
    code, out, err = run(capsys, "verify", folder / "shard-001.tar", "--manifest", manifest, "--json")
    result = json.loads(out)
    assert code == 0 and result["ok"] and len(result["shards"]) == 1, err
    assert result["manifest_entries_not_given"] == 2


def test_a_shard_the_manifest_does_not_list_names_the_flag(data, capsys):
    folder, spec = data
    manifest = folder / "manifest.json"
    assert run(capsys, "verify", folder / "shard-000.tar", "--write-manifest", manifest)[0] == 0
    code, out, err = run(capsys, "verify", spec, "--manifest", manifest)
    assert code == 1 and "--allow-missing" in out and "allow_missing=" not in out + err
    assert run(capsys, "verify", spec, "--manifest", manifest, "--allow-missing")[0] == 0


def test_the_library_checks_shards_against_a_copied_manifest_too(data, tmp_path, capsys):
    import wds_cloud as wds

    folder, spec = data
    assert run(capsys, "verify", spec, "--write-manifest", folder / "manifest.json")[0] == 0
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    got = list(
        wds.WebDataset(str(copy / "shard-{000..002}.tar"), shardshuffle=False, manifest=str(copy / "manifest.json"))
    )
    assert len(got) == 12


def test_a_damaged_shard_message_names_no_python_argument(data, capsys):
    folder, _ = data
    damaged = folder / "shard-001.tar"
    raw = bytearray(damaged.read_bytes())
    raw[1024:1100] = b"\xff" * 76  # the second header (after 512 of header and 512 of data) no longer sums right
    damaged.write_bytes(bytes(raw))
    for argv in (["stat", str(damaged)], ["ls", str(damaged)], ["reshard", str(damaged), str(folder / "o-%d.tar")]):
        code, out, err = run(capsys, *argv)
        assert code == 1 and "corrupt" in err, err
        assert "handler=" not in err and "max_sample_size=" not in err, err


# progress in a job log
def test_progress_lines_when_stderr_is_not_a_terminal(data, capsys, monkeypatch):
    folder, spec = data
    monkeypatch.setenv("WDS_PROGRESS_INTERVAL", "0")
    code, _, err = run(capsys, "verify", spec)
    assert code == 0
    lines = [line for line in err.splitlines() if line.startswith("verify:")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"] and "shards/s" in lines[-1]
    monkeypatch.setenv("WDS_PROGRESS_INTERVAL", "3600")  # a long interval still ends with a line
    code, _, err = run(capsys, "stat", spec)
    assert [line.split()[1] for line in err.splitlines() if line.startswith("stat:")] == ["3/3"]


def test_progress_of_a_reshard_counts_samples(data, capsys, monkeypatch):
    folder, spec = data
    monkeypatch.setenv("WDS_PROGRESS_INTERVAL", "3600")
    code, _, err = run(capsys, "reshard", spec, str(folder / "r-%02d.tar"), "--maxcount", "5")
    assert code == 0
    assert "reshard: 12 samples" in err
    with tarfile.open(folder / "r-00.tar") as tar:
        assert len(tar.getnames()) == 15
