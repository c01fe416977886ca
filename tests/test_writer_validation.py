"""The writer refuses what would not read back as written, instead of writing a tar tarfile rejects."""

import io
import tarfile

import pytest

import wds_cloud as wds
from wds_cloud.errors import SampleError


@pytest.mark.parametrize("key", ["dir/", "a\udc80b", "x\0y"])
def test_keys_that_would_not_read_back_are_refused(key):
    with pytest.raises(SampleError, match="invalid sample key"):
        with wds.TarWriter(io.BytesIO()) as sink:
            sink.write({"__key__": key, "txt": "x"})


@pytest.mark.parametrize("field", ["t\0xt", "t\udc80", "a/b", ""])
def test_field_names_that_would_not_read_back_are_refused(field):
    with pytest.raises(SampleError, match="invalid field name"):
        with wds.TarWriter(io.BytesIO()) as sink:
            sink.write({"__key__": "k", field: b"x"})


@pytest.mark.parametrize(
    "option", [{"mtime": -1}, {"mtime": 8**11}, {"mode": -5}, {"uid": 8**7}, {"gid": -1}, {"mode": 0o10000000}]
)
def test_header_numbers_out_of_range_are_refused(option):
    with pytest.raises(SampleError, match="does not fit a tar header"):
        wds.TarWriter(io.BytesIO(), **option)


def test_numbers_at_their_limits_read_back_with_tarfile():
    out = io.BytesIO()
    with wds.TarWriter(out, mtime=8**11 - 1, mode=0o644, uid=8**7 - 1, gid=8**7 - 1) as sink:
        sink.write({"__key__": "k", "txt": "x"})
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        info = tar.getmembers()[0]
    assert (info.mtime, info.uid, info.gid) == (8**11 - 1, 8**7 - 1, 8**7 - 1)
