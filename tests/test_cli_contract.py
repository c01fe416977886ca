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
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own refusals (one line, exit 2)
        code = exc.code
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


# issue 41: the command line never shows a traceback for a value a user typed
def files_under(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def run_refused(capsys, argv):
    """``argv`` run in-process: (exit code, stdout, stderr lines)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def assert_refused(code, out, lines, json_wanted):
    assert code == 2, lines
    assert len(lines) == 1 and "Traceback" not in lines[0] and lines[0].startswith("wds-cloud"), lines
    if json_wanted:
        result = json.loads(out)
        assert result["ok"] is False and result["error"] == lines[0] and result["exit_code"] == 2
    else:
        assert out == ""


@pytest.fixture
def tree(tmp_path):
    """A folder with shards and an MMC4 documents file; what every command line below names."""
    folder = tmp_path / "data"
    folder.mkdir()
    spec = make_shards(folder, nshards=2, per_shard=3)
    (folder / "docs.jsonl").write_text(json.dumps({"text_list": ["a"], "image_info": []}) + "\n")
    return folder, spec


#: a valid command line of every subcommand (a bad value of one flag is added to it)
BASE = {
    "backends": [],
    "settings": [],
    "demo": ["--url", "{folder}/demo"],
    "ls": ["{folder}/shard-000.tar"],
    "cat": ["{folder}/shard-000.tar"],
    "stat": ["{spec}"],
    "index": ["{spec}"],
    "verify": ["{spec}"],
    "reshard": ["{spec}", "{folder}/out-%03d.tar"],
    "map": ["wds_cloud.tools.dask:passthrough", "{spec}", "{folder}/out-%03d.tar"],
    "convert mmc4": ["{folder}/docs.jsonl", "--images", "{folder}", "--dest", "{folder}/out-%03d.tar"],
}
SCHEDULERS = ["foo", "tcp://[::1", "tcp://host", "tcp://host:99999", "http://host:8786", "tcp://u:secret@h:1", ""]
PATTERNS = ["out-%d-%d.tar", "out-%%d.tar", "out-%.0s.tar", "out-%s.tar", "out-%x.tar", "out.tar", "out-%", "%d/x.tar"]
#: bad values by the kind of value a flag takes (its argparse type)
BAD = {
    "count": ["x", "-1", "1e999", "nan", "", "1.5"],
    "size": ["x", "nan", "-1", "0", "inf", "1e999"],
    "scheduler": SCHEDULERS,
    "output_pattern": PATTERNS,
    "text": ["", "a\0b"],
}


def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = list(_subparsers(sub))
                yield from ((f"{name} {n}", s) for n, s in nested) if nested else [(name, sub)]


def _flag_cases():
    import argparse

    for command, sub in _subparsers(build_parser()):
        for action in sub._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[-1]
            if action.nargs == 0:  # a switch: it takes no value
                yield command, [f"{flag}=x"]
            elif action.choices:
                yield command, [flag, "nosuch"]
            else:
                for value in BAD[getattr(action.type, "__name__", "untyped")]:
                    yield command, [flag, value]


def test_every_flag_that_takes_a_value_has_a_checked_type():
    """Each flag is checked as the command line is parsed (choices or one of the types of cli/flags.py), so a
    new flag cannot slip through with Python's own int()/float() errors or none."""
    import argparse

    for command, sub in _subparsers(build_parser()):
        assert command in BASE, f"add a valid command line of `{command}` to BASE"
        for action in sub._actions:
            if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction):
                assert action.choices or getattr(action.type, "__name__", None) in BAD, (command, action.dest)


@pytest.mark.parametrize("command,bad", list(_flag_cases()), ids=lambda x: x if isinstance(x, str) else repr(x))
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_malformed_value_of_any_flag_exits_2_in_one_line_and_writes_nothing(tree, capsys, command, bad, as_json):
    """Every flag of every subcommand, with values of the wrong kind: exit 2, one stderr line naming the flag,
    no traceback, nothing written; with --json, that line as JSON on stdout."""
    folder, spec = tree
    before = files_under(folder.parent)
    argv = command.split() + [a.format(folder=folder, spec=spec) for a in BASE[command]] + bad
    json_wanted = as_json and command not in ("cat",) and "--json" not in bad[0]
    if json_wanted:
        argv.append("--json")
    code, out, lines = run_refused(capsys, argv)
    assert_refused(code, out, lines, json_wanted)
    assert bad[0].split("=")[0] in lines[0], lines  # names the flag
    assert "secret" not in lines[0] + out
    assert files_under(folder.parent) == before


#: the commands that take a scheduler or an output pattern, with where the bad value goes
ON_DASK = ["verify", "index", "reshard", "map", "convert mmc4"]
WITH_PATTERN = {"reshard": 1, "map": 2, "convert mmc4": 4}


@pytest.mark.parametrize("command", ON_DASK)
@pytest.mark.parametrize("address", SCHEDULERS)
def test_a_malformed_scheduler_address_is_refused_before_anything(tree, capsys, command, address):
    """--scheduler foo, tcp://[::1, no port, a port past 65535, http://: exit 2 with one line that names the flag,
    the value and the form accepted; no job record, no output (was: distributed's ValueError traceback)."""
    folder, spec = tree
    before = files_under(folder.parent)
    argv = command.split() + [a.format(folder=folder, spec=spec) for a in BASE[command]] + ["--scheduler", address]
    code, out, lines = run_refused(capsys, argv)
    assert_refused(code, out, lines, False)
    assert "--scheduler" in lines[0] and ("tcp://HOST:PORT" in lines[0] or "expected one argument" in lines[0])
    assert files_under(folder.parent) == before


@pytest.mark.parametrize("command", list(WITH_PATTERN))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_an_output_pattern_needs_exactly_one_number_field(tree, capsys, command, pattern):
    """Two fields, only a literal %%, %s/%.0s (names that repeat), %x, none, a field in a folder: exit 2, one
    line, nothing written, no stray job record (was: a TypeError traceback and a record; or, for out-%.0s.tar,
    exit 0 with most samples gone)."""
    folder, spec = tree
    before = files_under(folder.parent)
    argv = command.split() + [a.format(folder=folder, spec=spec) for a in BASE[command]]
    argv[len(command.split()) + WITH_PATTERN[command]] = str(folder / pattern)
    code, out, lines = run_refused(capsys, argv + ["--json"])
    assert_refused(code, out, lines, True)
    assert "%d" in lines[0] and "%06d" in lines[0]
    assert files_under(folder.parent) == before


def test_the_library_refuses_the_same_patterns(tree):
    """convert_mmc4 (and its Dask shard task) check the pattern before anything: the same rule as the CLI."""
    from wds_cloud.errors import ConfigError
    from wds_cloud.jobs.patterns import check_output_pattern
    from wds_cloud.tools.interleaved import convert_mmc4

    folder, _ = tree
    before = files_under(folder.parent)
    for pattern in PATTERNS:
        with pytest.raises(ConfigError, match="one %d field"):
            convert_mmc4([str(folder / "docs.jsonl")], str(folder), str(folder / pattern))
        with pytest.raises(ValueError):
            check_output_pattern(pattern)
    with pytest.raises(ConfigError, match="maxcount=0"):
        convert_mmc4([str(folder / "docs.jsonl")], str(folder), str(folder / "o-%d.tar"), maxcount=0)
    assert files_under(folder.parent) == before
    for good in ("o-%d.tar", "o-%06d.tar", "s3://bucket/o-%04d.tar.gz"):
        names = {check_output_pattern(good) % k for k in range(100)}
        assert len(names) == 100


def test_the_library_refuses_a_malformed_scheduler_with_our_error():
    """cluster_client checks the address before it needs dask (a ConfigError, a ValueError, naming it)."""
    from wds_cloud.errors import ConfigError
    from wds_cloud.tools.dask import cluster_client, scheduler_problem

    for address in SCHEDULERS:
        with pytest.raises(ConfigError, match="not a Dask scheduler address"):
            with cluster_client(address):
                pass
    for good in ("tcp://10.0.0.5:8786", "10.0.0.5:8786", "tls://sched.example.org:8786", "tcp://[::1]:8786"):
        assert scheduler_problem(good) is None


@pytest.mark.parametrize(
    "positional",
    [
        ["stat", "{{0.."],
        ["stat", "a\0b"],
        ["verify", ""],
        ["index", "{folder}/shard-{{000..001.tar"],
        ["reshard", "{{0..", "{folder}/o-%d.tar"],
        ["ls", ""],
        ["map", "nomodule", "{spec}", "{folder}/o-%d.tar"],
        ["map", "wds_cloud.tools.dask:no_such_function", "{spec}", "{folder}/o-%d.tar"],
        ["stat", "nosuch://bucket/x.tar"],
        ["demo", "--samples", "2", "--shards", "3", "--url", "{folder}/demo"],
    ],
    ids=lambda a: " ".join(a),
)
def test_malformed_positional_arguments_exit_2_in_one_line(tree, capsys, positional):
    """Unbalanced braces, NUL, empty names, a FUNCTION that names nothing, an unknown scheme: exit 2, one line,
    JSON with --json, nothing written."""
    folder, spec = tree
    before = files_under(folder.parent)
    code, out, lines = run_refused(capsys, [a.format(folder=folder, spec=spec) for a in positional] + ["--json"])
    assert_refused(code, out, lines, True)
    assert files_under(folder.parent) == before


# --json is JSON whatever happens
def _damage(path):
    raw = bytearray(path.read_bytes())
    path.write_bytes(bytes(raw[:700]))  # cut inside the first member's padding


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "{spec}", "--write-manifest", "{folder}/manifest.json"],
        ["verify", "{spec}"],
        ["stat", "{spec}"],
        ["ls", "{folder}/shard-000.tar"],
        ["index", "{spec}"],
        ["stat", "{folder}/absent.tar"],
        ["verify", "{spec}", "--manifest", "{folder}/absent.json"],
        ["reshard", "{spec}", "{folder}/r-%d.tar"],
        ["convert", "mmc4", "{folder}/absent.jsonl", "--images", "{folder}", "--dest", "{folder}/c-%d.tar"],
        ["cat", "{folder}/shard-000.tar", "--json"],
        ["no-such-command"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_json_output_is_json_even_when_the_command_fails(tree, capsys, argv):
    """Over a damaged shard, a missing file or a refused argument, --json still prints one JSON object on stdout
    (with an error field when the command failed); no advice names a Python argument."""
    folder, spec = tree
    _damage(folder / "shard-000.tar")
    code, out, err = run(capsys, *[a.format(folder=folder, spec=spec) for a in argv], "--json")
    assert code in (1, 2), err
    result = json.loads(out)
    assert result["ok"] is False and ("error" in result or "shards" in result), result
    assert "Traceback" not in err and "handler=" not in out + err
    assert not (folder / "manifest.json").exists()


def test_verify_json_with_write_manifest_over_a_damaged_shard(tree, capsys):
    """The rows come as JSON with the refusal to write the manifest in it; the row names the member cut, and
    what was expected and what arrived."""
    folder, spec = tree
    _damage(folder / "shard-001.tar")
    code, out, err = run(capsys, "verify", spec, "--write-manifest", folder / "manifest.json", "--json")
    result = json.loads(out)
    assert code == 1 and result["ok"] is False and result["manifest_written"] is False
    assert "not writing" in result["error"] and "shard-001.tar" in result["error"]
    bad = [r for r in result["shards"] if not r["ok"]]
    assert len(bad) == 1 and "padding" in bad[0]["problems"][0] and "got 180 bytes" in bad[0]["problems"][0]
    assert "handler=" not in out + err and "wds-cloud verify SPEC" not in out  # no pointer to itself either
    assert not (folder / "manifest.json").exists() and err.splitlines()[-1].startswith(
        "wds-cloud verify: error: not writing"
    )


def test_a_damaged_shard_outside_verify_points_at_verify(tree, capsys):
    folder, _ = tree
    _damage(folder / "shard-000.tar")
    code, out, err = run(capsys, "ls", folder / "shard-000.tar")
    assert code == 1 and "wds-cloud verify" in err and "handler=" not in err


# issue 42's messages
def test_backends_all_tells_ready_from_not_installed(capsys):
    """Ready means the driver imports here; otherwise the row says what to install (was: sftp, smb, hdfs, git
    "ready" without their drivers)."""
    import importlib

    from wds_cloud.io.fsbackend import fsspec_protocols

    code, out, _ = run(capsys, "backends", "--all", "--json")
    rows = {r["scheme"]: r for r in json.loads(out)["backends"] if r["kind"] == "fsspec"}
    assert rows
    for scheme, row in rows.items():
        module, _, name = fsspec_protocols()[scheme][0].rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
            importable = True
        except Exception:
            importable = False
        assert row["ready"] == importable, row
        assert (row["install"] is None) == importable, row
    assert rows["memory"]["ready"]
    not_ready = [s for s, r in rows.items() if not r["ready"]]
    assert not_ready  # some protocol's driver is always missing (git's pygit2, box's boxfs, ...)
    code, text, _ = run(capsys, "backends", "--all")
    line = next(line for line in text.splitlines() if line.startswith(f"{not_ready[0]}:"))
    assert ("needs `" in line or "unavailable: " in line) and "ready" not in line


def test_an_unknown_scheme_points_at_backends_all(capsys):
    code, _, err = run(capsys, "stat", "nosuch://bucket/x.tar")
    assert code == 2 and "wds-cloud backends --all" in err


def test_reshard_compress_help_names_every_compression(capsys):
    with pytest.raises(SystemExit):
        main(["reshard", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for suffix in (".tar.gz", ".tar.bz2", ".tar.xz", ".tar.zst"):
        assert suffix in help_text


def test_reshard_compresses_as_asked(tree, capsys):
    folder, spec = tree
    assert run(capsys, "reshard", spec, folder / "b-%d.tar", "--compress", "bz2")[0] == 0
    assert (folder / "b-0.tar").read_bytes()[:3] == b"BZh"


def test_convert_messages_a_missing_image_and_count_in_words(tmp_path, capsys):
    """An absent image is said to be absent (not "not under images", which reads like a refused path) with the
    flag that goes on; one missing image is "1 missing image"."""
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    doc = {"text_list": ["t"], "image_info": [{"image_name": "gone.png", "matched_text_index": 0}]}
    (tmp_path / "docs.jsonl").write_text(json.dumps(doc) + "\n")
    argv = ["convert", "mmc4", tmp_path / "docs.jsonl", "--images", tmp_path / "images"]
    code, out, err = run(capsys, *argv, "--dest", tmp_path / "e-%d.tar", "--missing", "error")
    assert code == 1 and "'gone.png' does not exist" in err and "--missing drop" in err and "missing=" not in err
    assert "is not under" not in err
    code, out, err = run(capsys, *argv, "--dest", tmp_path / "d-%d.tar")
    assert code == 0 and "1 missing image dropped" in out and "1 document," in out and "1 shard " in out


# adversary findings, issue 41: bad arguments that exited 1, printed a traceback or were accepted


REFUSED_AT_ONCE = {
    "a credential in reshard's DEST": ["reshard", "{spec}", "{folder}/out-%d.tar?token=abc"],
    "a credential in map's DEST": ["map", "json:dumps", "{spec}", "https://u:p@127.0.0.1:1/out-%d.tar"],
    "a credential in map's source": ["map", "json:dumps", "https://127.0.0.1:1/x.tar?X-Amz-Signature=abc", "{out}"],
    "a credential in convert's --dest": [
        "convert",
        "mmc4",
        "{folder}/docs.jsonl",
        "--images",
        "{folder}",
        "--dest",
        "{folder}/out-%d.tar?sig=abc",
    ],
    "a path as FUNCTION": ["map", "../mypkg:f", "{spec}", "{out}"],
    "a relative module": ["map", ".mypkg.filters:ident", "{spec}", "{out}"],
    "dots as FUNCTION": ["map", "..:f", "{spec}", "{out}"],
    "an unknown scheme for map": ["map", "json:dumps", "nosuch://x/y.tar", "{out}"],
    "an unknown scheme for map's DEST": ["map", "json:dumps", "{spec}", "nosuch://x/out-%d.tar"],
    "an unknown scheme for reshard": ["reshard", "nosuch://x/y.tar", "{out}"],
    "an unknown scheme for verify on Dask": ["verify", "nosuch://x/y.tar", "--workers", "1"],
    "a profile the profiles file lacks": ["map", "json:dumps", "{spec}", "{out}", "--profile", "nonexistent"],
    "map --maxsize 0.5": ["map", "json:dumps", "{spec}", "{out}", "--maxsize", "0.5"],
    "reshard --maxsize 0.5": ["reshard", "{spec}", "{out}", "--maxsize", "0.5"],
    "reshard --maxsize 1.5": ["reshard", "{spec}", "{out}", "--maxsize", "1.5"],
    "reshard over its own input": ["reshard", "{spec}", "{folder}/shard-%03d.tar"],
    "index --name without --format wids": ["index", "{spec}", "--name", "foo"],
}


@pytest.mark.parametrize("argv", REFUSED_AT_ONCE.values(), ids=REFUSED_AT_ONCE.keys())
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_bad_destinations_sources_functions_and_sizes_exit_2_before_anything(data, capsys, argv, as_json):
    """Credentials in URLs, a relative FUNCTION, an unknown scheme, a missing --profile, a fraction of a byte, an
    output that is an input, --name without wids: exit 2 in one line (JSON on stdout with --json), no record,
    claim, output or cluster."""
    folder, spec = data
    before = sorted(p.name for p in folder.iterdir())
    argv = [a.format(spec=spec, folder=folder, out=folder / "out-%d.tar") for a in argv]
    if as_json and argv[0] != "convert":
        argv.append("--json")
    code, out, err = run(capsys, *argv)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    if as_json and argv[0] != "convert":
        assert json.loads(out)["exit_code"] == 2
    assert sorted(p.name for p in folder.iterdir()) == before  # no record, claim or output


@pytest.mark.parametrize(
    "text, size", [("3e9", 3_000_000_000), ("500M", 500_000_000), ("2GiB", 2 << 30), ("1.5k", 1500), ("7", 7)]
)
def test_a_size_flag_takes_whole_bytes_with_a_suffix(text, size):
    """--maxsize of reshard and map: one rule, whole bytes (1 or more) with an optional suffix."""
    from wds_cloud.cli.flags import size as parse

    assert parse(text) == size


def test_another_patterns_record_is_another_jobs_destination_not_a_malformed_one(data, capsys):
    """``out-%04d.tar`` and ``out-%06d.tar`` share one record name: the second job is refused (exit 2) naming the
    first's pattern and the fix, never told to remove that job's outputs; the first job's files stay."""
    folder, spec = data
    assert run(capsys, "reshard", spec, folder / "out-%04d.tar", "--maxcount", "5")[0] == 0
    kept = {p.name: p.read_bytes() for p in folder.glob("out-*")}
    for other in ("out-%06d.tar", "out-%d.tar"):
        code, out, err = run(capsys, "reshard", spec, folder / other, "--maxcount", "5")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "out-%04d.tar" in err and "another folder" in err and "remove" not in err
    assert {p.name: p.read_bytes() for p in folder.glob("out-*")} == kept
