"""The wds-cloud console script."""

import os
import subprocess
import sys

import pytest

import wds_cloud
from wds_cloud.cli import main


def test_backends_lists_file_and_pipe(capsys):
    """`wds-cloud backends` lists each scheme with its plugin, distribution and status."""
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "file:" in out and "pipe:" in out and "wds_cloud" in out and "ready" in out


def test_help_and_version():
    """The installed console script answers --help and --version."""
    script = os.path.join(os.path.dirname(sys.executable), "wds-cloud")
    help_text = subprocess.run([script, "--help"], capture_output=True, text=True, check=True).stdout
    assert "backends" in help_text
    version = subprocess.run(
        [sys.executable, "-m", "wds_cloud", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert wds_cloud.__version__ in version


def test_no_command_prints_help(capsys):
    """Without a command the usage is printed and the exit status is 2."""
    assert main([]) == 2
    assert "usage" in capsys.readouterr().err


def test_demo_runs_and_cleans_up(tmp_path, capsys, monkeypatch):
    """`wds-cloud demo` writes, reads back every sample, prints one, and removes its temporary data."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo", "--samples", "40", "--shards", "2", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "read 40 samples" in out and "one sample: image uint8 (64, 64, 3)" in out
    assert list(tmp_path.iterdir()) == []


def test_demo_to_a_given_location(tmp_path, capsys):
    """--url writes the dataset where asked and leaves it there."""
    assert main(["demo", "--samples", "10", "--shards", "1", "--workers", "0", "--url", str(tmp_path)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["demo-000000.tar"]


def test_demo_rejects_bad_numbers(capsys):
    """Nonsense counts are refused with a message."""
    with pytest.raises(SystemExit) as refused:  # refused as the command line is parsed
        main(["demo", "--samples", "0"])
    assert refused.value.code == 2
    assert "--samples" in capsys.readouterr().err
    assert main(["demo", "--samples", "2", "--shards", "3"]) == 2
    assert "at most one shard per sample" in capsys.readouterr().err


def test_settings_lists_every_variable_and_marks_those_set_without_their_values(capsys, monkeypatch):
    """A wheel's user has no site: ``wds-cloud settings`` lists the variables config reads (the new user of issue
    44 found no way to see them), marks those set, and never prints a value (a rewrite may hold a password)."""
    import json

    from wds_cloud import config

    monkeypatch.setenv("WDS_REWRITE", "s3://b/=https://user:hunter2@host/")
    assert main(["settings", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["settings"]
    listed = {name for row in rows for name in row["names"]}
    assert {"WDS_MMAP", "WDS_TABLE_CACHE", "WDS_REWRITE"} <= listed and len(rows) == len(config.ENV_DOCS)
    assert [row["set"] for row in rows if "WDS_REWRITE" in row["names"]] == [["WDS_REWRITE"]]
    assert main(["settings", "table"]) == 0
    out = capsys.readouterr().out
    assert "WDS_TABLE_CACHE" in out and "WDS_MMAP" not in out
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "(set: WDS_REWRITE)" in out


def test_settings_lists_a_refused_environment_and_masks_a_credential_in_it(capsys, monkeypatch):
    """The second 44 adversary: a malformed rewrite rule holding a password was printed whole (by every command
    and by the library's ConfigError), and settings, which is where a user looks, refused to run at all."""
    import json

    import wds_cloud as wds

    monkeypatch.setenv("WDS_REWRITE", "https://user:SECRETPW@mirror/")
    assert main(["settings", "rewrite"]) == 2
    out, err = capsys.readouterr()
    assert "WDS_REWRITE  (set: WDS_REWRITE)" in out and "has no '='" in out and "SECRETPW" not in out + err
    assert main(["settings", "--json"]) == 2
    problem = json.loads(capsys.readouterr().out)["problem"]
    assert "user:***@mirror" in problem and "SECRETPW" not in problem
    assert main(["backends"]) == 2
    assert "SECRETPW" not in "".join(capsys.readouterr())
    with pytest.raises(wds.ConfigError) as caught:
        wds.WebDataset("x.tar", shardshuffle=False)
    assert "SECRETPW" not in str(caught.value) and "***" in str(caught.value)


def test_settings_marks_a_family_member_set_and_an_empty_value_not(capsys, monkeypatch):
    """The second 44 adversary: WDS_BUCKET (a WDS_<NAME> substitution) was never marked, and WDS_MMAP= (empty: the
    default) was marked as set."""
    import json

    monkeypatch.setenv("WDS_BUCKET", "my-bucket")
    monkeypatch.setenv("WDS_MMAP", "")
    assert main(["settings", "--json"]) == 0
    rows = {row["names"][0]: row["set"] for row in json.loads(capsys.readouterr().out)["settings"]}
    assert rows["WDS_<NAME>"] == ["WDS_BUCKET"] and rows["WDS_MMAP"] == []
