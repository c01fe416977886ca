"""The writer refuses what would not read back as written, instead of writing a tar tarfile rejects."""

import io
import tarfile

import pytest

import wds_cloud as wds
from wds_cloud.errors import SampleError


# a surrogate that stands for no byte, and escapes whose bytes together spell UTF-8 (they would read back as "\xe9")
@pytest.mark.parametrize("key", ["dir/", "a\ud800b", "a\udcc3\udca9", "x\0y"])
def test_keys_that_would_not_read_back_are_refused(key):
    with pytest.raises(SampleError, match="invalid sample key"):
        with wds.TarWriter(io.BytesIO()) as sink:
            sink.write({"__key__": key, "txt": "x"})


@pytest.mark.parametrize("field", ["t\0xt", "t\ud800", "t\udcc3\udca9", "a/b", ""])
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


@pytest.mark.parametrize("name", ["maxcount", "maxsize"])
@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), -float("inf"), 0, -1, 0.0, -0.5, True, False, "1000", [5], 1e999]
)
def test_shard_limits_that_cannot_cut_are_refused_naming_the_argument(tmp_path, name, value):
    """maxcount/maxsize of NaN (compares false, never cuts), inf, 0, negatives, bools or text are refused with a
    ConfigError (a ValueError) naming the argument, before any shard is opened."""
    from wds_cloud.errors import ConfigError

    with pytest.raises(ConfigError, match=f"ShardWriter\\({name}=") as caught:
        wds.ShardWriter(str(tmp_path / "s-%03d.tar"), **{name: value})
    assert isinstance(caught.value, ValueError)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["maxcount", "maxsize"])
def test_shard_limit_none_means_no_limit(tmp_path, name):
    """maxcount=None (or maxsize=None) puts no limit of that kind: the other still cuts the shards."""
    other = {"maxcount": {"maxsize": 3000}, "maxsize": {"maxcount": 4}}[name]
    with wds.ShardWriter(str(tmp_path / "s-%03d.tar"), **{name: None}, **other) as sink:
        for i in range(10):
            sink.write({"__key__": f"{i:04d}", "bin": bytes(600)})
    assert len(sink.shards) > 1
    with wds.ShardWriter(str(tmp_path / "one-%03d.tar"), maxcount=None, maxsize=None) as sink:
        for i in range(10):
            sink.write({"__key__": f"{i:04d}", "bin": bytes(600)})
    assert sorted(p.name for p in tmp_path.glob("one-*")) == ["one-000.tar"]


@pytest.mark.parametrize("name, value", [("maxcount", 3.0), ("maxcount", 1e1), ("maxsize", 2500), ("maxsize", 2.5e3)])
def test_shard_limits_of_any_real_type_work(tmp_path, name, value):
    """A limit given as a float (maxcount=1e1) or an int (maxsize=2500), or as numpy numbers, cuts shards."""
    import numpy as np

    for given in (value, np.float64(value), np.int64(int(value))):
        out = tmp_path / f"{name}-{type(given).__name__}"
        out.mkdir()
        with wds.ShardWriter(str(out / "s-%03d.tar"), **{name: given}) as sink:
            for i in range(12):
                sink.write({"__key__": f"{i:04d}", "bin": bytes(600)})
        assert len(list(out.iterdir())) > 1
