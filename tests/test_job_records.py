"""Job records and claims, tried as a tampered record, a careless rerun and a second job would: a job claims its
destination before anything expensive, a record's ``done`` map and outputs are checked against the job's own
output names, and checksums read only regular files, no further than the size the record claims."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import threading

import pytest

from wds_cloud.errors import ConfigError, MalformedDataError
from wds_cloud.jobs.record import JobRecord, record_url

from .test_resume import write_shards

ROOT = pathlib.Path(__file__).resolve().parents[1]


def claim_of(destination):
    from wds_cloud.jobs.record import claim_url

    return claim_url(destination)


def shout(sample):
    """A map function (only its name matters here: these tests never reach a cluster)."""
    return sample


def quiet(sample):
    """Another map function."""
    return None


def settings_of(fn, per="sample", maxcount=None, maxsize=None):
    return {"function": f"{fn.__module__}:{fn.__qualname__}", "per": per, "maxcount": maxcount, "maxsize": maxsize}


def entry(path):
    data = pathlib.Path(path).read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_record(dest, urls, done, outputs, tool="map", settings=None):
    doc = {
        "format": "wds_cloud.job",
        "version": 1,
        "tool": tool,
        "inputs": urls,
        "settings": settings if settings is not None else settings_of(shout),
        "outputs": outputs,
    }
    if done is not None:
        doc["done"] = done
    pathlib.Path(record_url(dest)).write_text(json.dumps(doc))


def bounded(call, limit=60.0):
    """Run ``call`` in a thread: its result or its exception; a hang (reading a FIFO or /dev/zero for ever)
    becomes a failure (the limit only turns a hang into a failure, nothing waits on it otherwise)."""
    box = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), "the call never returned (it read something that never ends)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture
def job(tmp_path):
    """Three input shards, a destination, and the first output of input 0 written (as a finished run would)."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    urls = write_shards(tmp_path / "in", [3, 4, 5])
    dest = str(tmp_path / "out" / "o-%03d.tar")
    out0 = dest % 0
    pathlib.Path(out0).write_bytes(pathlib.Path(urls[0]).read_bytes())
    return urls, dest, out0


def map_again(urls, dest, fn=shout):
    from wds_cloud.dask import map_shards

    return bounded(lambda: map_shards(fn, urls, dest, retries=0, workers=1))


# the done map names what is not this input's output


def _foreign_names(tmp_path, dest, out0):
    """Names a tampered record may give input 1 instead of its own (o-001.tar): each exists, with the checksum
    the record claims for it."""
    outside = tmp_path / "elsewhere.tar"
    outside.write_bytes(b"x" * 10)
    sub = tmp_path / "out" / "sub"
    sub.mkdir()
    (sub / "o-001.tar").write_bytes(b"y" * 10)
    later = pathlib.Path(dest % 2)
    later.write_bytes(b"z" * 10)
    part = pathlib.Path(str(tmp_path / "out" / "o-000-001.tar"))
    part.write_bytes(b"w" * 10)
    return {
        "another input's output": out0,
        "a later input's output": str(later),
        "another input's second part": str(part),
        "a file outside the destination": str(outside),
        "a sub-folder's file of the same name": str(sub / "o-001.tar"),
        "a path that climbs back in": str(sub / ".." / ".." / "out" / "o-000.tar"),
        "a relative path": os.path.relpath(out0),
        "/dev/zero": "/dev/zero",
        "/dev/null": "/dev/null",
        "the record itself": record_url(dest),
    }


@pytest.mark.parametrize(
    "case",
    [
        "another input's output",
        "a later input's output",
        "another input's second part",
        "a file outside the destination",
        "a sub-folder's file of the same name",
        "a path that climbs back in",
        "a relative path",
        "/dev/zero",
        "/dev/null",
        "the record itself",
    ],
)
def test_a_done_map_naming_what_is_not_the_inputs_output_is_refused(job, tmp_path, case):
    """A tampered ``done`` entry never makes the rerun skip an input whose outputs are missing: refused by
    our error naming the record, the field and the fix, before anything is read or started."""
    urls, dest, out0 = job
    name = _foreign_names(tmp_path, dest, out0)[case]
    outputs = {out0: entry(out0)}
    if os.path.isfile(name) and not name.startswith("/dev/"):
        outputs[name] = entry(name)
    else:
        outputs[name] = {"size": 10, "sha256": "0" * 64}
    write_record(dest, urls, {"0": [out0], "1": [name]}, outputs)
    with pytest.raises(MalformedDataError) as caught:
        map_again(urls, dest)
    message = str(caught.value)
    assert "'done'" in message and record_url(dest) in message and "remove" in message


@pytest.mark.parametrize(
    "done",
    [
        {"3": ["{o3}"]},  # an input the job does not have
        {"01": ["{o1}"]},  # an input number spelled otherwise
        {"-1": ["{o0}"]},
        {"1": []},  # finished with no output: every input gives at least one
        {"1": ["{o1}", "{o1}"]},  # one output twice
        {"1": ["{o1}", "{o1part2}"]},  # a third part with no second
        {"1": "{o1}"},
        {"1": ["{o1}"], "0": ["{o1}"]},  # one output for two inputs
    ],
)
def test_done_entries_are_checked_against_the_inputs(job, done):
    """Every ``done`` entry is an input of this job, spelled as the job writes it, mapping to that input's
    own outputs in order: anything else is our error, never a skip."""
    urls, dest, out0 = job
    names = {
        "o0": out0,
        "o1": dest % 1,
        "o3": dest % 3,
        "o1part2": str(pathlib.Path(dest % 1).with_name("o-001-002.tar")),
    }
    for key in ("o1", "o3", "o1part2"):
        pathlib.Path(names[key]).write_bytes(b"v" * 10)
    fill = lambda v: [n.format(**names) for n in v] if isinstance(v, list) else v.format(**names)  # noqa: E731
    done = {k: fill(v) for k, v in done.items()}
    outputs = {n: entry(n) for v in done.values() for n in (v if isinstance(v, list) else [v])}
    write_record(dest, urls, done, outputs)
    with pytest.raises(MalformedDataError, match="'done'"):
        map_again(urls, dest)


def test_an_output_listed_by_no_finished_input_is_refused(job):
    """A map record's outputs are exactly the outputs of its finished inputs."""
    urls, dest, out0 = job
    pathlib.Path(dest % 1).write_bytes(b"v" * 10)
    write_record(dest, urls, {"0": [out0]}, {out0: entry(out0), dest % 1: entry(dest % 1)})
    with pytest.raises(MalformedDataError, match="'outputs'"):
        map_again(urls, dest)


@pytest.mark.parametrize(
    "value",
    [
        {"size": 10, "sha256": "ab"},  # not a SHA-256
        {"size": 10, "sha256": "Z" * 64},
        {"size": -1, "sha256": "0" * 64},
        {"size": True, "sha256": "0" * 64},
        {"size": 10.0, "sha256": "0" * 64},
        {"size": 10**30, "sha256": "0" * 64},
        {"size": 10, "sha256": "0" * 64, "extra": 1},
        {"size": 10},
        [],
    ],
)
def test_every_output_entry_is_checked(job, value):
    """An output's size is a count within bounds and its checksum a SHA-256: a tampered entry is our error."""
    urls, dest, out0 = job
    write_record(dest, urls, {"0": [out0]}, {out0: value})
    with pytest.raises(MalformedDataError, match="'outputs'"):
        map_again(urls, dest)


@pytest.mark.parametrize(
    "change",
    [
        {"format": "other"},
        {"version": 2},
        {"version": True},
        {"unknown": 1},
        {"done": []},
        {"outputs": []},
    ],
)
def test_every_field_of_the_record_is_checked(job, change):
    urls, dest, out0 = job
    write_record(dest, urls, {"0": [out0]}, {out0: entry(out0)})
    doc = json.loads(pathlib.Path(record_url(dest)).read_text())
    doc.update(change)
    pathlib.Path(record_url(dest)).write_text(json.dumps(doc))
    with pytest.raises(MalformedDataError):
        map_again(urls, dest)


def test_a_reshard_record_lists_only_names_of_its_pattern(job, tmp_path):
    """Records of the tools without a ``done`` map (reshard, convert, index): each output is one of the
    destination's names."""
    urls, dest, out0 = job
    outside = tmp_path / "x.tar"
    outside.write_bytes(b"x")
    for name in (str(outside), "/dev/zero", dest % 1 + "/../o-000.tar", dest.replace("%03d", "1")):
        write_record(
            dest,
            urls,
            None,
            {out0: entry(out0), name: {"size": 1, "sha256": "0" * 64}},
            tool="reshard",
            settings={"maxcount": 2},
        )
        with pytest.raises(MalformedDataError, match="'outputs'"):
            JobRecord(dest, "reshard", urls, {"maxcount": 2})


# checksums read only regular files, bounded by the size the record claims


def test_a_fifo_at_an_output_name_is_refused_not_read(job):
    """A FIFO planted at one of the job's own output names: our error naming it, never a read that waits for
    ever (a reshard's keep, and a map rerun)."""
    urls, dest, out0 = job
    os.unlink(out0)
    os.mkfifo(out0)
    write_record(dest, urls, {"0": [out0]}, {out0: {"size": 10, "sha256": "0" * 64}})
    with pytest.raises(ConfigError, match="not a regular file") as caught:
        map_again(urls, dest)
    assert out0 in str(caught.value)
    write_record(dest, urls, None, {out0: {"size": 10, "sha256": "0" * 64}}, tool="reshard", settings={})
    with pytest.raises(ConfigError, match="not a regular file"):
        bounded(lambda: JobRecord(dest, "reshard", urls, {}).keep(out0))


def test_a_checksum_reads_no_more_than_the_record_claims(job):
    """An output grown to a terabyte (sparse) since the record was written is found changed without reading
    it: a rerun writes it again."""
    urls, dest, out0 = job
    claimed = entry(out0)
    with open(out0, "r+b") as f:
        f.truncate(1 << 40)
    write_record(dest, urls, None, {out0: claimed}, tool="reshard", settings={})
    record = JobRecord(dest, "reshard", urls, {})
    assert bounded(lambda: record.keep(out0), limit=120) is False


def test_an_unchanged_output_is_still_kept(job):
    urls, dest, out0 = job
    write_record(dest, urls, None, {out0: entry(out0)}, tool="reshard", settings={})
    assert JobRecord(dest, "reshard", urls, {}).keep(out0) is True


def test_a_record_that_is_not_a_regular_file_is_refused(job, tmp_path):
    """The record itself as a FIFO or a link to /dev/zero: our error, never a read for ever."""
    urls, dest, _ = job
    os.mkfifo(record_url(dest))
    with pytest.raises(ConfigError, match="not a regular file"):
        bounded(lambda: JobRecord(dest, "reshard", urls, {}))
    os.unlink(record_url(dest))
    os.symlink("/dev/zero", record_url(dest))
    with pytest.raises(ConfigError, match="not a regular file"):
        bounded(lambda: JobRecord(dest, "reshard", urls, {}))


# claims: one job at a time per destination


@pytest.fixture
def free(tmp_path):
    """Inputs and a destination nothing has written yet."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    return write_shards(tmp_path / "in", [3, 4, 5]), str(tmp_path / "out" / "c-%03d.tar"), None


def test_a_second_job_is_refused_while_the_first_holds_the_destination(free):
    """Another tool, another function or the same job again: refused, naming the first (its pid, host, start,
    tool and function), until the first releases its claim."""
    urls, dest, _ = free
    first = JobRecord(dest, "map", urls, settings_of(shout))
    assert os.path.exists(claim_of(dest))
    for tool, settings in (("map", settings_of(quiet)), ("map", settings_of(shout)), ("reshard", {"maxcount": 2})):
        with pytest.raises(ConfigError) as caught:
            JobRecord(dest, tool, urls, settings)
        message = str(caught.value)
        assert f"pid {os.getpid()}" in message and socket.gethostname() in message
        assert "tests.test_job_records:shout" in message and claim_of(dest) in message
    first.release()
    assert not os.path.exists(claim_of(dest))
    JobRecord(dest, "map", urls, settings_of(shout)).release()


def test_a_claim_held_by_another_thread_refuses_this_one(free):
    """Two threads of one process: the second is refused while the first's job runs; after it, it runs."""
    urls, dest, _ = free
    holding, finish = threading.Event(), threading.Event()

    def first():
        with JobRecord(dest, "map", urls, settings_of(shout)):
            holding.set()
            finish.wait()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert holding.wait(120)
        with pytest.raises(ConfigError, match="another job"):
            JobRecord(dest, "map", urls, settings_of(shout))
    finally:
        finish.set()
        thread.join()
    with JobRecord(dest, "map", urls, settings_of(shout)):
        pass


def test_a_dropped_record_gives_its_claim_back(free):
    """A record dropped without release (a tool that returned or raised) releases its claim."""
    urls, dest, _ = free
    JobRecord(dest, "reshard", urls, {})
    JobRecord(dest, "reshard", urls, {}).release()
    assert not os.path.exists(claim_of(dest))


def _claim_in_a_process(dest, urls):
    code = (
        "import sys\nfrom wds_cloud.jobs.record import JobRecord\n"
        f"record = JobRecord({dest!r}, 'map', {urls!r}, {settings_of(shout)!r})\n"
        "print('claimed', flush=True)\nsys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "claimed"  # the event: the claim is made
    return proc


def test_a_claim_of_a_killed_job_is_taken_over_with_a_log_line(free, caplog):
    urls, dest, _ = free
    proc = _claim_in_a_process(dest, urls)
    try:
        with pytest.raises(ConfigError, match=f"pid {proc.pid}"):
            JobRecord(dest, "map", urls, settings_of(shout))
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stdin.close()
    with caplog.at_level(logging.WARNING, logger="wds_cloud"):
        record = JobRecord(dest, "map", urls, settings_of(shout))
    assert any(f"pid {proc.pid}" in r.getMessage() and "stale" in r.getMessage() for r in caplog.records)
    assert json.loads(pathlib.Path(claim_of(dest)).read_text())["pid"] == os.getpid()
    record.release()


def _forge(dest, **fields):
    base = json.loads(pathlib.Path(claim_of(dest)).read_text())
    base.update(fields)
    return base


def test_claims_of_dead_reused_or_unknown_owners(free, caplog):
    """Same host and a dead pid, or a pid now another process (its start differs), or a reboot since: stale,
    taken over.  Another host: refused, naming it, with the fix (nothing here can tell whether it runs)."""
    urls, dest, _ = free
    with JobRecord(dest, "map", urls, settings_of(shout)):
        template = _forge(dest)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    stale = [
        {"pid": dead},
        {"pid": os.getppid(), "process_start": 1},
        {"pid": os.getppid(), "boot": "0" * 32},
    ]
    for change in stale:
        pathlib.Path(claim_of(dest)).write_text(json.dumps(dict(template, **change)))
        with caplog.at_level(logging.WARNING, logger="wds_cloud"):
            JobRecord(dest, "map", urls, settings_of(shout)).release()
        assert "stale" in caplog.records[-1].getMessage()
    pathlib.Path(claim_of(dest)).write_text(json.dumps(dict(template, host="elsewhere.example", pid=os.getpid())))
    with pytest.raises(ConfigError, match="elsewhere.example") as caught:
        JobRecord(dest, "map", urls, settings_of(shout))
    assert f"remove {claim_of(dest)}" in str(caught.value)


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b"[]", b'{"format": "wds_cloud.job-claim", "version": 1, "pid": 0}', b"\xff" * 10],
)
def test_a_malformed_claim_is_refused_with_the_fix(free, content):
    urls, dest, _ = free
    pathlib.Path(claim_of(dest)).write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        JobRecord(dest, "map", urls, settings_of(shout))
    assert claim_of(dest) in str(caught.value) and "remove" in str(caught.value)


def test_a_claim_that_is_not_a_regular_file_is_refused(free):
    urls, dest, _ = free
    os.mkfifo(claim_of(dest))
    with pytest.raises(ConfigError, match="not a regular file"):
        bounded(lambda: JobRecord(dest, "map", urls, settings_of(shout)))
    os.unlink(claim_of(dest))
    os.symlink("/dev/zero", claim_of(dest))
    with pytest.raises(ConfigError, match="not a regular file"):
        bounded(lambda: JobRecord(dest, "map", urls, settings_of(shout)))


def test_a_refused_job_leaves_the_first_jobs_claim_and_record_alone(job):
    urls, dest, out0 = job
    write_record(dest, urls, {"0": [out0]}, {out0: entry(out0)})
    before = pathlib.Path(record_url(dest)).read_bytes()
    with JobRecord(dest, "map", urls, settings_of(shout)):
        claim = pathlib.Path(claim_of(dest)).read_bytes()
        with pytest.raises(ConfigError):
            JobRecord(dest, "map", urls, settings_of(quiet))
        assert pathlib.Path(claim_of(dest)).read_bytes() == claim
    assert pathlib.Path(record_url(dest)).read_bytes() == before


def test_a_job_of_other_settings_is_refused_and_gives_its_claim_back(job):
    urls, dest, out0 = job
    write_record(dest, urls, {"0": [out0]}, {out0: entry(out0)})
    with pytest.raises(ConfigError, match="another job"):
        JobRecord(dest, "map", urls, settings_of(quiet))
    assert not os.path.exists(claim_of(dest))


def test_the_cli_refuses_a_second_job_in_flag_terms(free):
    """``wds-cloud reshard`` into a destination a job holds: one line naming the job, no traceback, nothing written."""
    urls, dest, _ = free
    with JobRecord(dest, "map", urls, settings_of(shout)):
        out = subprocess.run(
            [sys.executable, "-m", "wds_cloud", "reshard", *urls, dest, "--maxcount", "2"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
    assert out.returncode == 1, out.stderr  # not a bad argument: the destination is busy
    assert (
        "Traceback" not in out.stderr
        and len(out.stderr.strip().splitlines()) == 1
        and f"pid {os.getpid()}" in out.stderr
    )
    assert not os.path.exists(dest % 1)


@pytest.fixture
def profiled_bucket(s3_bucket, moto_endpoint, monkeypatch, tmp_path):
    """A fresh moto bucket whose credentials come from a profiles file (as a job's workers would read them)."""
    bucket, _ = s3_bucket
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(
        f'["s3://{bucket}/"]\nendpoint_url = "{moto_endpoint}"\nkey = "testing"\n'
        'secret = "testing"\nclient_kwargs = {region_name = "us-east-1"}\n'
    )
    monkeypatch.setenv("WDS_CLOUD_CONFIG", str(profiles))
    return bucket


def test_claims_on_an_object_store(profiled_bucket):
    """An object store has no create-if-absent here: the claim is written, read back and released by marking
    it; a second job is refused while the first holds it."""
    bucket = profiled_bucket
    dest = f"s3://{bucket}/out/o-%03d.tar"
    urls = [f"s3://{bucket}/in/a.tar"]
    first = JobRecord(dest, "map", urls, settings_of(shout))
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
        JobRecord(dest, "map", urls, settings_of(quiet))
    first.release()
    JobRecord(dest, "map", urls, settings_of(quiet)).release()


# adversary findings, issue 41


def test_a_record_of_another_pattern_names_that_pattern_not_a_malformed_record(job):
    """``o-%03d.tar`` and ``o-%d.tar`` share ``o-N.tar.wds-job.json``: a job of the other pattern is refused as
    a bad argument naming the recorded pattern, its record and outputs left alone."""
    urls, dest, out0 = job
    os.unlink(out0)  # the fixture's output, which no record lists: this test's first job writes it
    with JobRecord(dest, "reshard", urls, {"maxcount": 2}) as first:
        pathlib.Path(out0).write_bytes(pathlib.Path(urls[0]).read_bytes())
        first.begin()
        first.written(out0)
    before = pathlib.Path(record_url(dest)).read_bytes()
    other = dest.replace("%03d", "%d")
    with pytest.raises(ConfigError) as caught:
        JobRecord(other, "reshard", urls, {"maxcount": 2})
    assert not isinstance(caught.value, MalformedDataError) and caught.value.bad_argument
    assert dest in str(caught.value) and "remove" not in str(caught.value)
    assert pathlib.Path(record_url(dest)).read_bytes() == before and os.path.exists(out0)
    assert not os.path.exists(claim_of(dest))


def test_an_unknown_scheme_or_profile_is_refused_before_the_claim(job):
    """A source or destination no backend serves, or a profile the profiles file lacks: refused before the job
    claims its destination or writes its record (no cluster is started: none is given or needed)."""
    from wds_cloud.dask import map_shards
    from wds_cloud.errors import UnknownSchemeError

    urls, dest, out0 = job
    with pytest.raises(UnknownSchemeError):
        JobRecord(dest, "reshard", urls + ["nosuch://x/y.tar"], {})
    with pytest.raises(UnknownSchemeError):
        map_shards(shout, ["nosuch://x/y.tar"], dest)
    with pytest.raises(ConfigError, match="profile='nonexistent'") as caught:
        map_shards(shout, urls, dest, profile="nonexistent")
    assert caught.value.bad_argument
    assert not os.path.exists(record_url(dest)) and not os.path.exists(claim_of(dest))


@pytest.mark.parametrize("spec", ["../mypkg:f", ".mypkg.filters:ident", "..:f", "mypkg/filters:f", "json:du mps"])
def test_a_relative_or_path_like_function_name_is_our_error(spec):
    """importlib's TypeError for relative names became a traceback: now ConfigError saying what is accepted."""
    from wds_cloud.dask import load_function

    with pytest.raises(ConfigError, match="MODULE:NAME"):
        load_function(spec)


def test_a_dropped_remote_claim_is_given_back_without_reentering_locks(profiled_bucket):
    """A claim nothing refers to is given back by the garbage collector, which may run while this thread holds
    the plugin registry's lock (seen in a full run: a later test building the registry hung forever). A remote
    claim is given back on a thread of its own, which waits for the lock instead of re-entering it."""
    import faulthandler
    import gc
    import threading

    from wds_cloud.io import registry

    bucket = profiled_bucket
    dest = f"s3://{bucket}/out/o-%03d.tar"
    urls = [f"s3://{bucket}/in/a.tar"]
    dropped = JobRecord(dest, "map", urls, settings_of(shout))
    faulthandler.dump_traceback_later(300, exit=True)  # the old code deadlocked here: end the run, not hang it
    try:
        with registry._lock:  # as while a registry is being built
            del dropped
            gc.collect()
        for thread in threading.enumerate():
            if thread.name == "wds_cloud job claim release":
                thread.join()
    finally:
        faulthandler.cancel_dump_traceback_later()
    JobRecord(dest, "map", urls, settings_of(quiet)).release()  # the dropped claim was given back
