"""Adversary findings on job records (issue 50): a killed run's temporary files, unlisted files at output names
and undecodable record lines, each tried as the docs (docs/dask.md) describe them."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from wds_cloud.cli import main
from wds_cloud.errors import MalformedDataError
from wds_cloud.jobs.record import JobRecord, claim_url, record_url

from .test_resume import write_shards


def dead_pid():
    """The pid of a process that has exited (waited for: no longer running on this host)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def reshard(src, dest, capsys, *extra):
    capsys.readouterr()
    rc = main(["reshard", *src, dest, "--maxcount", "2", "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


@pytest.fixture
def done_job(tmp_path, capsys):
    """A finished reshard of 10 shards x 3 samples into 15 outputs (--maxcount 2)."""
    src = write_shards(tmp_path, [3] * 10)
    dest = str(tmp_path / "o1" / "out-%04d.tar")
    rc, result = reshard(src, dest, capsys)
    assert rc == 0 and result["written"] == 15
    return src, dest


def test_a_killed_runs_temporary_files_are_removed_by_the_rerun(done_job, capsys):
    """F4: a rerun taking over a dead job's claim removes that job's .partial files (and reports them), never a
    live writer's nor a file of another naming."""
    src, dest = done_job
    folder = pathlib.Path(dest).parent
    dead = dead_pid()
    claim = json.loads(pathlib.Path(claim_url(dest)).read_text()) if os.path.exists(claim_url(dest)) else None
    assert claim is None  # released at the end of the job: the killed run's is forged below
    leftovers = [folder / f".out-0007.tar.{dead}.a0555803.partial", folder / f".out-0020.tar.{dead}.0badf00d.partial"]
    for path in leftovers:
        path.write_bytes(b"x" * 100)
    live = folder / f".out-0003.tar.{os.getpid()}.12345678.partial"
    other = [folder / f".notours.tar.{dead}.12345678.partial", folder / f".out-0003.tar.{dead}.xyz.partial"]
    for path in [live, *other]:
        path.write_bytes(b"y")
    holder = {
        "format": "wds_cloud.job-claim",
        "version": 1,
        "token": "0" * 32,
        "pid": dead,
        "host": __import__("socket").gethostname(),
        "started": 1.0,
        "tool": "reshard",
        "job": "",
    }
    pathlib.Path(claim_url(dest)).write_text(json.dumps(holder))
    rc, result = reshard(src, dest, capsys)
    assert rc == 0 and result["kept"] == 15
    assert not any(path.exists() for path in leftovers)
    assert sorted(result["removed"]) == sorted(str(path) for path in leftovers)
    assert live.exists() and all(path.exists() for path in other)


def test_unlisted_files_at_output_names_are_removed_and_reported(done_job, capsys):
    """F5: files at output names no record lists and no output of the rerun takes are removed and listed in
    ``removed``; a file not of the job's naming is left alone."""
    src, dest = done_job
    folder = pathlib.Path(dest).parent
    junk = [folder / "out-0015.tar", folder / "out-0200.tar"]
    for path in junk:
        path.write_bytes(b"junk")
    (folder / "out-15.tar").write_bytes(b"not of this pattern")
    rc, result = reshard(src, dest, capsys)
    assert rc == 0 and result["kept"] == 15
    assert not any(path.exists() for path in junk)
    assert sorted(result["removed"]) == sorted(str(path) for path in junk)
    assert (folder / "out-15.tar").exists()


def test_an_unlisted_file_at_a_name_the_rerun_writes_is_written_again(done_job, capsys):
    """F5: an unlisted file at a name this run writes is replaced by the job's output (removed first, reported)."""
    src, dest = done_job
    out = pathlib.Path(dest % 4)
    good = out.read_bytes()
    lines = pathlib.Path(record_url(dest)).read_bytes().splitlines(keepends=True)
    pathlib.Path(record_url(dest)).write_bytes(b"".join(line for line in lines if b'"out-0004.tar"' not in line))
    out.write_bytes(b"junk")
    rc, result = reshard(src, dest, capsys)
    assert rc == 0 and result["kept"] == 14 and result["written"] == 1
    assert out.read_bytes() == good


def test_a_record_line_that_is_not_utf8_says_so(done_job):
    """F7: a record line that is not UTF-8 is named as such, with the byte, not as 'not JSON'."""
    src, dest = done_job
    path = pathlib.Path(record_url(dest))
    lines = path.read_bytes().splitlines(keepends=True)
    lines[-1] = b'{"output": "out-0014.tar", "size": 1, "sha256": "\xff"}\n'
    path.write_bytes(b"".join(lines))
    settings = json.loads(lines[0])["settings"]
    with pytest.raises(MalformedDataError, match=r"line \d+.*not UTF-8 text \(byte 49\)"):
        JobRecord(dest, "reshard", src, settings)
    lines[-1] = b'{"output": "out-0014.tar"}\n'
    lines[11] = b'{"input": "\xc3"}\n'
    path.write_bytes(b"".join(lines))
    with pytest.raises(MalformedDataError, match=r"line 12.*not UTF-8 text \(byte 11\)"):
        JobRecord(dest, "reshard", src, settings)


def test_removing_litter_is_one_listing_whatever_its_amount(done_job, monkeypatch, capsys):
    """F4/F5: loading a record lists the destination's folder once, with 2 or 40 files to remove."""
    import wds_cloud.jobs.record as jobrecord

    src, dest = done_job
    folder = pathlib.Path(dest).parent
    settings = json.loads(pathlib.Path(record_url(dest)).read_bytes().splitlines()[0])["settings"]
    calls = []
    real = os.scandir
    monkeypatch.setattr(jobrecord.os, "scandir", lambda path: calls.append(path) or real(path))
    dead = dead_pid()
    for many in (2, 40):
        for n in range(many):
            (folder / f"out-{100 + n:04d}.tar").write_bytes(b"junk")
            (folder / f".out-{100 + n:04d}.tar.{dead}.0000abcd.partial").write_bytes(b"x")
        calls.clear()
        with JobRecord(dest, "reshard", src, settings) as record:
            assert len(record.removed) == 2 * many
        assert len(calls) == 1
