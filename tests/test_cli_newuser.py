"""What a new user meets walking the README with `wds-cloud` (issue 41/42 new-user findings): limits and settings
applied alike by every command, advice in flags and environment variables, help that shows examples."""

import json

import pytest

from wds_cloud.cli import main

from .conftest import make_shards


def run(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def shard(tmp_path):
    make_shards(tmp_path, nshards=1, per_shard=4)
    return str(next(tmp_path.glob("*.tar")))


def test_an_indexed_shard_over_the_member_limit_says_raise_the_limit(shard, capsys, monkeypatch):
    """stat/cat of an indexed shard with a member over WDS_MAX_MEMBER_SIZE: raise the limit, not re-index."""
    assert run(capsys, "index", shard)[0] == 0
    monkeypatch.setenv("WDS_MAX_MEMBER_SIZE", "1")
    for argv in (["stat", shard], ["cat", shard, "--key", "000"], ["ls", shard]):
        code, _, err = run(capsys, *argv)
        assert code == 1 and "Traceback" not in err, err
        assert "raise" in err and "WDS_MAX_MEMBER_SIZE" in err and "index again" not in err, err


@pytest.mark.parametrize("command", ["verify", "index", "stat", "ls"])
def test_every_command_applies_the_member_limit(shard, capsys, monkeypatch, command):
    """A member over WDS_MAX_MEMBER_SIZE is refused by every command (verify reports it as a problem)."""
    monkeypatch.setenv("WDS_MAX_MEMBER_SIZE", "1")
    code, _, err = run(capsys, command, shard)
    assert code == 1, err
    assert "WDS_MAX_MEMBER_SIZE" in err or command == "verify"


@pytest.mark.parametrize("variable, value", [("WDS_MAX_MEMBER_SIZE", "lots"), ("WDS_RETRIES", "abc")])
@pytest.mark.parametrize("command", [["ls", "{shard}"], ["stat", "{shard}"], ["backends"], ["verify", "{shard}"]])
def test_a_bad_setting_is_refused_by_every_command(shard, capsys, monkeypatch, variable, value, command):
    """Every subcommand checks the WDS_* settings at start: exit 2 naming the variable."""
    monkeypatch.setenv(variable, value)
    code, _, err = run(capsys, *[a.format(shard=shard) for a in command])
    assert code == 2 and variable in err and "Traceback" not in err, err


def test_a_job_record_conflict_is_said_in_flags_and_exits_2(shard, tmp_path, capsys):
    """A reshard rerun with another --maxcount: the flags recorded and given, exit 2, no Python dict."""
    dest = str(tmp_path / "out" / "r-%03d.tar")
    (tmp_path / "out").mkdir()
    assert run(capsys, "reshard", shard, dest, "--maxcount", "70")[0] == 0
    code, _, err = run(capsys, "reshard", shard, dest, "--maxcount", "80")
    assert code == 2, err
    assert "--maxcount 70 was recorded" in err and "--maxcount 80 given now" in err and "{" not in err, err
    assert "new destination" in err


def test_shared_messages_lead_with_environment_variables():
    """Credential hints name the environment first and Python arguments only in '(in Python: ...)'."""
    from wds_cloud.cli.console import for_cli
    from wds_cloud_plugins import az, gs, s3

    for hint in (s3.CREDENTIALS_HINT, gs.CREDENTIALS_HINT, az.CREDENTIALS_HINT):
        assert hint.startswith("set ") and "(in Python: storage_options=" in hint
        assert "storage_options" not in for_cli(hint) and "pass" not in for_cli(hint), for_cli(hint)


def test_secure_refusal_names_no_python_module(capsys, monkeypatch):
    monkeypatch.setenv("WDS_SECURE", "1")
    code, _, err = run(capsys, "ls", "pipe:cat x.tar")
    assert code != 0 and "WDS_SECURE" in err and "wds_cloud.utils" not in err and "unsafe_gopen" not in err, err


def test_a_missing_manifest_names_the_flag(shard, capsys):
    code, _, err = run(capsys, "verify", shard, "--manifest", "nosuch.json")
    assert code == 1 and "--manifest" in err and "brace" not in err, err


def test_demo_to_an_unwritable_folder_is_one_line_naming_url(capsys):
    code, _, err = run(capsys, "demo", "--url", "/proc/x", "--samples", "4", "--shards", "1", "--workers", "0")
    assert code == 2 and "--url" in err and "Errno" not in err and "writing" not in err, err


def test_cat_does_not_offer_json(capsys):
    with pytest.raises(SystemExit):
        main(["cat", "--help"])
    assert "--json" not in capsys.readouterr().out


def test_backends_all_says_install_lines_or_unavailable(capsys):
    """No 'needs <sentence>': an install line in backticks, or 'unavailable: reason'."""
    code, out, _ = run(capsys, "backends", "--all", "--json")
    assert code == 0
    json.loads(out)
    code, out, _ = run(capsys, "backends", "--all")
    for line in out.splitlines():
        if " needs " in line:
            assert "needs `pip install " in line or "needs `conda install" in line, line


@pytest.mark.parametrize("command", ["demo", "backends"])
def test_demo_and_backends_help_show_examples_and_exit_codes(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "example" in out and "exit codes" in out and "2 bad arguments" in out


def _commands(parser, path=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


def test_every_commands_help_shows_an_example_and_the_exit_codes():
    """Each command and subcommand (``convert`` had none, only ``convert mmc4``), now and as commands are added."""
    from wds_cloud.cli import build_parser

    parser = build_parser()
    assert "example" in parser.format_help()  # the top level too (new-user finding)
    missing = [
        " ".join(path)
        for path, sub in _commands(parser)
        if not all(word in sub.format_help() for word in ("example", "exit codes", "2 bad arguments"))
    ]
    assert missing == []


def test_an_unknown_flag_points_to_the_help_of_the_command_it_was_given_to(capsys):
    """'wds-cloud verify --bogus x' pointed to 'wds-cloud --help', which does not list verify's flags (adversary)."""
    for argv, prog in (
        (["verify", "x.tar", "--bogus"], "wds-cloud verify"),
        (["convert", "mmc4", "a.jsonl", "--images", "i", "--dest", "o-%d.tar", "--zzz"], "wds-cloud convert mmc4"),
        (["--zzz"], "wds-cloud"),
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1
            and err[0].startswith(f"{prog}: error: unrecognized arguments")
            and f"'{prog} --help'" in err[0]
        )
