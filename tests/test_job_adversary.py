"""Adversary findings on job records (issue 50): a killed run's temporary files, unlisted files at output names
and undecodable record lines, each tried as the docs (docs/dask.md) describe them."""

from __future__ import annotations

import json
import pathlib

import pytest

from wds_cloud.cli import main
from wds_cloud.errors import MalformedDataError
from wds_cloud.io.jobrecord import JobRecord, record_url

from .test_resume import write_shards


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
