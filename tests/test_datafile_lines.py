"""Files of one record a line (job records, descriptions, manifests) read as a stream, each line bounded."""

from __future__ import annotations

import gzip

import pytest

from wds_cloud.errors import MalformedDataError
from wds_cloud.io import datafile


def test_lines_skip_blanks_and_number_from_one(tmp_path):
    """Every line that is not blank comes with its line number; a last line without a newline counts."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"a":1}\n\n  \n{"b":2}\n{"c":3}')
    assert list(datafile.iter_lines(str(path), "record")) == [(1, b'{"a":1}\n'), (4, b'{"b":2}\n'), (5, b'{"c":3}')]
    assert datafile.first_line(str(path), "record") == b'{"a":1}\n'


def test_empty_file_has_no_first_line(tmp_path):
    """An empty file's first line is b''."""
    path = tmp_path / "e.jsonl"
    path.write_bytes(b"")
    assert datafile.first_line(str(path), "record") == b""


def test_cap_applies_to_a_record_not_the_file(tmp_path):
    """A file far larger than the cap reads when each line is within it; a longer line is refused by number."""
    path = tmp_path / "big.jsonl.gz"
    lines = [b'{"n":%d}\n' % i for i in range(5000)]
    path.write_bytes(gzip.compress(b"".join(lines)))
    assert sum(1 for _ in datafile.iter_lines(str(path), "record", max_record=12)) == 5000
    with pytest.raises(MalformedDataError, match=r"line 101 of the record is longer than 8 bytes"):
        for _ in datafile.iter_lines(str(path), "record", max_record=8):
            pass


def test_exact_fit_line(tmp_path):
    """A line exactly as long as the cap (its newline not counted) reads; one byte more is refused."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"1234567\n12345678")
    with pytest.raises(MalformedDataError, match="line 2"):
        list(datafile.iter_lines(str(path), "record", max_record=7))
    assert [n for n, _ in datafile.iter_lines(str(path), "record", max_record=8)] == [1, 2]


def test_damaged_gzip_is_named(tmp_path):
    """A .gz file that is not gzip fails with MalformedDataError naming the file."""
    path = tmp_path / "r.jsonl.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(MalformedDataError, match="not valid gzip"):
        list(datafile.iter_lines(str(path), "job record"))


def test_reading_a_small_data_file_sets_aside_a_piece_not_the_cap(tmp_path):
    """A 10-byte file read under the 64 MiB cap costs a piece of a MiB or two, not the cap (it cost 67 MB)."""
    import tracemalloc

    path = tmp_path / "i.json"
    path.write_text('{"a": 1}')
    tracemalloc.start()
    try:
        assert datafile.read_bytes(str(path), "index") == b'{"a": 1}'
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_a_gz_name_is_written_gzipped_and_reads_back(tmp_path):
    """datafile.writing gzips a .gz name, as every reader of data files reads one."""
    path = str(tmp_path / "d.jsonl.gz")
    with datafile.writing(path) as out:
        out.write(b'{"a":1}\n{"b":2}\n')
    assert gzip.decompress((tmp_path / "d.jsonl.gz").read_bytes()) == b'{"a":1}\n{"b":2}\n'
    assert [n for n, _ in datafile.iter_lines(path, "record")] == [1, 2]
