"""Hostile but ordinary input: member names that are not UTF-8 written back byte for byte by every writer, shown
escaped by the command line, and local files that fail when read (EIO) reported with the path and the byte."""

from __future__ import annotations

import errno
import io
import json
import os
import sys
import tarfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud.cli import main
from wds_cloud.errors import SampleError, TransferError

LATIN1 = [b"caf\xe9.txt", b"caf\xe9.cls", b"x.t\xe9xt", b"d/" + b"l" * 130 + b"\xe9.txt", b"p" * 300 + b"\xff.bin"]


def names(data: bytes) -> list:
    """The member names of a tar as the bytes in its headers."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [m.name.encode("utf-8", "surrogateescape") for m in tar]


def latin1_tar(path, fmt=tarfile.GNU_FORMAT, members=LATIN1) -> None:
    """A shard whose member names are latin-1 bytes, as another tool wrote it."""
    with tarfile.open(path, "w", format=fmt, encoding="utf-8", errors="surrogateescape") as tar:
        for raw in members:
            info = tarfile.TarInfo(raw.decode("utf-8", "surrogateescape"))
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))  # a number: .cls decodes


def read(path) -> list:
    return [
        {k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"}
        for s in wds.WebDataset(str(path), shardshuffle=False)
    ]


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_latin1_names_read_then_written_keep_their_bytes(tmp_path, fmt):
    """A shard with latin-1 keys and suffixes (short, GNU/PAX long) is read and written back with the same name bytes."""
    members = LATIN1 if fmt != tarfile.USTAR_FORMAT else LATIN1[:3]  # ustar has no long names
    latin1_tar(tmp_path / "in.tar", fmt, members)
    samples = read(tmp_path / "in.tar")
    assert samples[0]["__key__"] == "caf\udce9" and "t\udce9xt" in samples[1]
    for format in ("pax", "gnu"):
        out = io.BytesIO()
        with wds.TarWriter(out, format=format) as sink:
            for sample in samples:
                sink.write(sample)
        assert sorted(names(out.getvalue())) == sorted(members)
        (tmp_path / "out.tar").write_bytes(out.getvalue())
        assert read(tmp_path / "out.tar") == samples


def test_long_names_not_utf8_say_so_in_their_pax_header():
    """A PAX path that is not UTF-8 is preceded by hdrcharset=BINARY, as tarfile (webdataset's writer) writes it."""
    out = io.BytesIO()
    with wds.TarWriter(out) as sink:
        sink.write({"__key__": "k" * 300 + "\udce9", "txt": b"x"})
        sink.write({"__key__": "u" * 300 + "\u00e9", "txt": b"x"})  # UTF-8: no such record
    data = out.getvalue()
    assert data.count(b"hdrcharset=BINARY") == 1
    assert names(data) == [b"k" * 300 + b"\xe9.txt", ("u" * 300 + "\u00e9.txt").encode()]


def test_shardwriter_writes_the_keys_the_reader_gave(tmp_path):
    """ShardWriter writes a latin-1 key and suffix back as the same bytes."""
    latin1_tar(tmp_path / "in.tar")
    with wds.ShardWriter(str(tmp_path / "o-%02d.tar"), maxcount=2) as sink:
        for sample in wds.WebDataset(str(tmp_path / "in.tar"), shardshuffle=False):
            sink.write(sample)
    got = [
        n
        for name in sorted(os.listdir(tmp_path))
        if name.startswith("o-")
        for n in names((tmp_path / name).read_bytes())
    ]
    assert sorted(got) == sorted(LATIN1)


def test_reshard_writes_latin1_names(tmp_path):
    """`wds-cloud reshard` on a shard with latin-1 names exits 0 and writes every name's bytes unchanged."""
    latin1_tar(tmp_path / "in.tar")
    assert main(["reshard", str(tmp_path / "in.tar"), str(tmp_path / "out" / "o-%03d.tar")]) == 0
    assert sorted(names((tmp_path / "out" / "o-000.tar").read_bytes())) == sorted(LATIN1)


@pytest.mark.parametrize("name", ["a\ud800b", "a\udcc3\udca9"])
def test_names_whose_bytes_would_read_back_otherwise_are_refused(name):
    """Lone surrogates that stand for no byte, or escapes whose bytes spell UTF-8, are refused in keys and fields."""
    for sample in ({"__key__": name, "txt": b"x"}, {"__key__": "k", name: b"x"}):
        with pytest.raises(SampleError, match="invalid"):
            with wds.TarWriter(io.BytesIO()) as sink:
                sink.write(sample)


def part(raw: bytes) -> bool:
    return not raw.startswith(b"_")


def lower(raw: bytes) -> bool:
    text = raw.decode("utf-8", "surrogateescape")
    return text == text.lower()


byte_parts = (
    st.binary(min_size=1, max_size=70)
    .map(lambda b: bytes(c for c in b if c > 0x20 and c not in b"./"))
    .filter(lambda b: b and part(b))
)


@given(
    # a shard starting with a compressor's magic bytes (a key "BZh...") is read as compressed: a separate matter
    key=st.lists(byte_parts, min_size=1, max_size=4).map(b"/".join).filter(lambda b: b[0] not in b"\x1fB\xfd("),
    # readers lower-case a suffix, as webdataset's group_by_keys does: a suffix read back is lower case
    field=byte_parts.filter(lambda b: lower(b) and b.lower() != b"txt"),
    extra=st.binary(min_size=1, max_size=3).map(lambda b: bytes(0x80 | c for c in b)),
)
def test_any_name_bytes_round_trip_write_read_write(key, field, extra):
    """Any key and suffix bytes (UTF-8 or not, short or long) read back as written and write again byte for byte."""
    key += extra  # at least one byte that is not UTF-8 on its own
    text_key = key.decode("utf-8", "surrogateescape")
    text_field = field.decode("utf-8", "surrogateescape")
    first = io.BytesIO()
    with wds.TarWriter(first) as sink:
        sink.write({"__key__": text_key, text_field: b"1", "txt": b"2"})
    assert sorted(names(first.getvalue())) == sorted([key + b"." + field, key + b".txt"])
    samples = list(wds.tariterators.tar_file_expander([{"url": "mem", "stream": io.BytesIO(first.getvalue())}]))
    again = io.BytesIO()
    with wds.TarWriter(again) as sink:
        grouped = next(iter(wds.tariterators.group_by_keys(iter(samples))))
        assert grouped["__key__"] == text_key
        sink.write({k: v for k, v in grouped.items() if not k.startswith("__") or k == "__key__"})
    assert again.getvalue() == first.getvalue()


def strict_stdout(monkeypatch) -> io.BytesIO:
    """stdout as a UTF-8 terminal or pipe whose encoding refuses lone surrogates (PYTHONIOENCODING=utf-8)."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8", errors="strict"))
    return raw


@pytest.mark.parametrize(
    "argv",
    [["ls"], ["ls", "--samples"], ["ls", "--json"], ["ls", "--samples", "--json"], ["stat"], ["stat", "--json"]],
)
def test_cli_shows_names_that_are_not_utf8_escaped(tmp_path, monkeypatch, argv):
    """ls/stat print latin-1 names as \\xe9 escapes (text and valid UTF-8 JSON) on a strict UTF-8 stdout."""
    latin1_tar(tmp_path / "in.tar")
    raw = strict_stdout(monkeypatch)
    assert main([*argv, str(tmp_path / "in.tar")]) == 0
    sys.stdout.flush()
    out = raw.getvalue().decode("utf-8")
    assert "\\xe9" in out and "\udce9" not in out
    if "--json" in argv:
        text = json.dumps(json.loads(out))
        assert "\\ud" not in text  # no lone surrogate a strict JSON parser would refuse


def test_cat_takes_the_key_as_ls_shows_it(tmp_path, monkeypatch):
    """`cat --key 'caf\\xe9' --field 't\\xe9xt'` finds what ls showed, as the shell's bytes do too."""
    latin1_tar(tmp_path / "in.tar")
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8"))
    assert main(["cat", "--key", "x", "--field", "t\\xe9xt", str(tmp_path / "in.tar")]) == 0
    assert main(["cat", "--key", "caf\udce9", "--field", "txt", str(tmp_path / "in.tar")]) == 0
    sys.stdout.flush()
    assert raw.getvalue() == b"11"


def test_a_key_spelled_with_a_backslash_and_a_latin1_key_never_look_alike(tmp_path, monkeypatch):
    """A sample keyed `caf\\xe9` in ASCII beside one keyed with the byte 0xE9: ls shows them apart (a backslash
    of the name doubled, as tar shows it), and cat --key takes the key itself first, then the shown form."""
    path = tmp_path / "amb.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape") as tar:
        for raw, data in [(b"caf\xe9.txt", b"LATIN1"), (b"caf\\xe9.txt", b"BACKSLASH")]:
            info = tarfile.TarInfo(raw.decode("utf-8", "surrogateescape"))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, encoding="utf-8"))
    assert main(["ls", "--samples", "--json", str(path)]) == 0
    sys.stdout.flush()
    text = out.getvalue().decode("utf-8")
    assert "caf\\\\xe9" in text and "caf\\\\\\\\xe9" in text  # JSON of caf\xe9 and of caf\\\\xe9
    for key, expected in [("caf\\xe9", b"BACKSLASH"), ("caf\udce9", b"LATIN1"), ("caf\\\\xe9", b"BACKSLASH")]:
        out.seek(0)
        out.truncate()
        assert main(["cat", "--key", key, "--field", "txt", str(path)]) == 0
        sys.stdout.flush()
        assert out.getvalue() == expected, key


# Local files that fail when read: real ones of this Linux machine, never mocks
MEM = "/proc/self/mem"  # a regular file of size 0 whose read at byte 0 fails with EIO
SYSFS = "/sys/devices/system/cpu/power/autosuspend_delay_ms"  # 4096 bytes by stat, EIO when read


def failing(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        if exc.errno == errno.EIO:
            return path
    pytest.skip(f"{path} does not fail with EIO here")


def check(exc: BaseException, path: str) -> None:
    assert isinstance(exc, TransferError) and isinstance(exc, OSError)
    assert exc.errno == errno.EIO and path in str(exc) and "at byte 0" in str(exc) and "regular file" in str(exc)


@pytest.mark.parametrize("path", [MEM, SYSFS])
def test_a_shard_failing_with_eio_names_the_path_and_byte(path):
    """WebDataset, gopen and the tar iterator over a file failing with EIO raise our OSError naming it and the byte."""
    path = failing(path)
    with pytest.raises(OSError) as got:
        list(wds.WebDataset(path, shardshuffle=False))
    check(got.value, path)
    with pytest.raises(OSError) as got, wds.gopen(path) as stream:
        stream.read(512)
    check(got.value, path)
    with open(path, "rb", buffering=0) as stream, pytest.raises(OSError) as got:  # a stream of the user's own
        list(wds.tariterators.tar_file_iterator(stream))
    assert isinstance(got.value, TransferError) and got.value.errno == errno.EIO and "at byte 0" in str(got.value)


@pytest.mark.parametrize("path", [MEM, SYSFS])
@pytest.mark.parametrize("command", [["ls"], ["stat"], ["cat"], ["index", "--format", "wids"], ["ls", "--json"]])
def test_cli_on_a_file_failing_with_eio_says_which(tmp_path, capsys, path, command):
    """Every command reading a file that fails with EIO exits 1 with one line naming the file, not a bare errno."""
    path = failing(path)
    args = [*command, path] + (["--output", str(tmp_path / "d.json")] if "index" in command else [])
    assert main(args) == 1
    err = capsys.readouterr().err
    assert path in err and "reading failed at byte 0" in err and "Traceback" not in err


def test_cached_read_of_a_file_failing_with_eio_names_it(tmp_path):
    """Reading through the shard cache reports the failing file and byte, as an OSError."""
    path = failing(MEM)
    with pytest.raises(OSError) as got:
        list(wds.WebDataset(path, shardshuffle=False, cache_dir=str(tmp_path / "cache")))
    check(got.value, path)


@pytest.mark.parametrize("fmt", ["json", "dali", "wids"])
def test_indexes_keep_names_that_are_not_utf8(tmp_path, fmt):
    """`wds-cloud index` in every format writes latin-1 names and they read back as the reader gives them."""
    from wds_cloud.index.sidecar import read_index

    latin1_tar(tmp_path / "in.tar", members=LATIN1[:4])
    shard = str(tmp_path / "in.tar")
    extra = ["--output", str(tmp_path / "d.json")] if fmt == "wids" else []
    assert main(["index", "--format", fmt, shard, *extra]) == 0
    want = {s["__key__"] for s in read(tmp_path / "in.tar")}
    if fmt == "wids":
        from wds_cloud.wids import ShardListDataset

        data = ShardListDataset(str(tmp_path / "d.json"))
        assert {data[i]["__key__"] for i in range(len(data))} == want
    else:
        index = read_index(str(tmp_path / ("in.idx" if fmt == "dali" else "in.tar.index.json")), shard_url=shard)
        assert {s.key for s in index.samples} == want
        assert b"caf\xe9.txt" in (tmp_path / "in.idx").read_bytes() if fmt == "dali" else True


@pytest.mark.parametrize("first", [b"BZh91AY&SY.txt", b"\x1f\x8b\x08.txt", b"\xfd7zXZ", b"(\xb5/\xfd.bin"])
def test_a_first_member_named_like_a_compressor_magic_is_a_plain_tar(tmp_path, first):
    """A plain tar whose first member's name begins with a compressor's magic bytes (xz's NUL is the name's
    padding) is read as a tar (its first block is a tar header whose checksum holds): streamed, mapped, indexed."""
    members = [first, b"k.txt"]
    latin1_tar(tmp_path / "magic.tar", tarfile.GNU_FORMAT, members)
    mapped = read(tmp_path / "magic.tar")
    expected = 2 if b"." in first else 1  # a member without a suffix is no field (upstream drops it too)
    assert len(mapped) == expected
    with open(tmp_path / "magic.tar", "rb") as stream:
        streamed = list(wds.tariterators.tar_file_iterator(stream))
    assert [m["fname"].encode("utf-8", "surrogateescape") for m in streamed] == members
    index = wds.ShardListDataset([str(tmp_path / "magic.tar")], transformations=[])
    assert len(index) == expected
