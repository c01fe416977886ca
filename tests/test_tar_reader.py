"""The tar reader: every tarfile format and compression, damage detection, and never a partial sample."""

import io
import re
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wds_cloud.errors import CorruptShardError, MissingExtraError
from wds_cloud.tar.members import TarMembers
from wds_cloud.tariterators import shard_samples

from .strategies import FORMATS, compress_bytes, expected_samples, sample_lists, write_tar

COMPRESSIONS = [None, "gzip", "bz2", "xz", "zstd"]


def read_samples(data: bytes, url="mem.tar"):
    return list(shard_samples(url, io.BytesIO(data)))


@given(items=sample_lists(), fmt=st.sampled_from(sorted(FORMATS)), compress=st.sampled_from(COMPRESSIONS))
def test_round_trip_every_format_and_compression(items, fmt, compress):
    """Archives written by tarfile (ustar, GNU, PAX; any compression) read back to the same samples."""
    assert read_samples(write_tar(items, fmt, compress=compress)) == expected_samples(items, "mem.tar")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_long_and_unicode_names(fmt):
    """Names beyond 100 bytes (ustar prefix, GNU long names, PAX path) and unicode names survive."""
    key = "dir_" + "ü" * 60 + "/" + "x" * 90 + "/ключ"
    items = [(key, {"txt": b"hello"}), ("short", {"cls": b"1"})]
    if fmt == "ustar":
        items = [("d" * 120 + "/k" * 5, {"txt": b"a"})]
    assert read_samples(write_tar(items, fmt)) == expected_samples(items, "mem.tar")


def test_large_member_and_pax_size():
    """A member larger than the read chunk is returned whole; a PAX size record is honoured."""
    big = bytes(range(256)) * 12000  # ~3 MB, several chunks
    items = [("big", {"npy": big, "txt": b"t"})]
    data = write_tar(items, "pax", extras=False)
    members = list(TarMembers(io.BytesIO(data), chunk=1 << 16))
    assert members == [("big.npy", big), ("big.txt", b"t")]


def test_meta_members_skipped():
    """Members named __*__ at the top level are skipped, as in webdataset."""
    items = [("__meta__", {}), ("a", {"txt": b"x"})]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("__index__", b"meta"), ("a.txt", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert read_samples(buf.getvalue()) == expected_samples(items[1:], "mem.tar")


def test_grouping_rules():
    """First-dot rule by default; only adjacent members group; a repeated field is an error."""
    items = [("a/b", {"seg.png": b"1", "txt": b"2"}), ("c", {"TXT": b"3"})]
    got = read_samples(write_tar(items, extras=False))
    assert got[0]["seg.png"] == b"1" and got[1]["txt"] == b"3"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("k.txt", "k.txt"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match="repeats the field 'txt'"):
        read_samples(buf.getvalue())


def test_last_dot_rule():
    """keys='last_dot' keeps periods inside the key."""
    from wds_cloud.tariterators import key_rule, last_dot_split

    items = [("img.v1", {"png": b"1", "json": b"2"}), ("img.v2", {"png": b"3"})]
    data = write_tar([(k, f) for k, f in items], extras=False)
    got = list(shard_samples("u", io.BytesIO(data), keys=key_rule("last_dot")))
    assert [s["__key__"] for s in got] == ["img.v1", "img.v2"]
    assert last_dot_split("a/b.c/d.e.f") == ("a/b.c/d.e", "f")
    with pytest.raises(ValueError, match="unknown key rule"):
        key_rule("middle_dot")


@pytest.mark.parametrize("compress", [None, "gzip"])
def test_truncation_at_every_offset(compress):
    """Cutting an archive anywhere gives CorruptShardError or the samples before the cut, never more, never a hang."""
    items = [(f"k{i}", {"txt": bytes([65 + i]) * (100 + 300 * i), "cls": b"%d" % i}) for i in range(4)]
    full = write_tar(items, extras=False, compress=compress)
    expected = expected_samples(items, "mem.tar")
    step = 1 if compress else 7
    for cut in range(0, len(full), step):
        try:
            got = read_samples(full[:cut])
        except CorruptShardError as exc:
            assert "mem.tar" in str(exc) and "byte" in str(exc)
            continue
        # Only a cut inside the trailing zero padding may read cleanly, and then everything is there.
        assert got == expected, cut


def test_corrupt_header_names_offset():
    """A damaged header raises CorruptShardError naming the URL and the byte offset."""
    data = bytearray(write_tar([("a", {"txt": b"x" * 600}), ("b", {"txt": b"y"})], extras=False))
    second = 512 + 1024  # header of b.txt
    data[second + 10] ^= 0xFF
    with pytest.raises(CorruptShardError, match=f"mem.tar: corrupt tar at byte {second}.*checksum") as info:
        read_samples(bytes(data))
    assert info.value.offset == second and isinstance(info.value, ValueError)


def test_not_a_tar_and_empty():
    """Garbage and empty streams are named as such."""
    with pytest.raises(CorruptShardError, match="not a tar archive"):
        read_samples(b"hello world" * 100)
    with pytest.raises(CorruptShardError, match="empty"):
        read_samples(b"")


def test_damaged_gzip_is_corrupt():
    """A gzip stream with flipped bytes raises CorruptShardError, not zlib.error."""
    data = bytearray(write_tar([("a", {"txt": b"x" * 5000})], extras=False, compress="gzip"))
    data[len(data) // 2] ^= 0xFF
    data[len(data) // 2 + 1] ^= 0xFF
    with pytest.raises(CorruptShardError, match="gzip"):
        read_samples(bytes(data))


@pytest.mark.parametrize("compress", ["bz2", "xz", "zstd"])
def test_truncated_compressed_streams(compress):
    """A compressed stream cut short is truncation, never a clean end."""
    full = write_tar([(f"k{i}", {"txt": b"z" * 2000}) for i in range(5)], extras=False, compress=compress)
    with pytest.raises(CorruptShardError):
        read_samples(full[: len(full) // 2])


def test_detection_is_by_magic_not_name(tmp_path):
    """A gzip shard named .tar is read, and a plain shard named .tar.gz too."""
    import wds_cloud as wds

    items = [("a", {"txt": b"x"})]
    (tmp_path / "g.tar").write_bytes(compress_bytes(write_tar(items), "gzip"))
    (tmp_path / "p.tar.gz").write_bytes(write_tar(items))
    for name in ("g.tar", "p.tar.gz"):
        ds = wds.WebDataset(str(tmp_path / name), shardshuffle=False)
        assert [s["txt"] for s in ds] == [b"x"]


def test_select_skips_without_reading():
    """A member the selector rejects is skipped."""
    data = write_tar([("a", {"txt": b"x", "jpg": b"y" * 10000})], extras=False)
    members = list(TarMembers(io.BytesIO(data), select=lambda n: n.endswith(".txt")))
    assert members == [("a.txt", b"x")]


def test_zstd_without_module(monkeypatch):
    """Without zstandard, a zstd shard raises MissingExtraError with the install line."""
    import sys

    data = write_tar([("a", {"txt": b"x"})], compress="zstd")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(MissingExtraError, match="pip install zstandard"):
        read_samples(data)


@settings(max_examples=30)
@given(items=sample_lists(max_size=5), cut=st.floats(0, 1))
def test_truncated_property(items, cut):
    """Any truncation yields a prefix of the samples or CorruptShardError."""
    full = write_tar(items, extras=False)
    data = full[: int(len(full) * cut)]
    expected = expected_samples(items, "mem.tar")
    try:
        got = read_samples(data)
    except CorruptShardError:
        return
    assert got == expected[: len(got)] and (len(got) == len(expected) or not items)


def _two_members(second: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, size in (("a.bin", 1), ("b.bin", second)):
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(b"x" * size))
    return out.getvalue()


# (where the stream is cut, what the message must say); the second member's data starts at 1536
CUTS = {
    "in the first header": (300, ["not a tar archive", "only 300 bytes"]),
    "in the first member's data": (512, ["'a.bin'", "expected 1 byte of data, got 0 bytes"]),
    "at the start of the padding": (513, ["'a.bin'", "padding after the member's 1 byte of data", "got 0 bytes"]),
    "inside the padding": (700, ["'a.bin'", "expected 511 bytes of zeros", "got 187 bytes"]),
    "between members": (1024, ["without the tar end-of-archive marker"]),
    "inside the second header": (1324, ["inside a member's header", "expected a 512-byte header", "got 300 bytes"]),
    "in the second member's data": (1541, ["'b.bin'", "expected {size} bytes of data, got 5 bytes"]),
    "inside the second padding": (1536 + 10, ["'b.bin'", "padding after the member's {size} bytes", "got {pad}"]),
    "inside the end marker": (None, ["inside the end-of-archive marker", "expected 1024 zero bytes, got 100 bytes"]),
}


@pytest.mark.parametrize("second", [1000, 3_000_000], ids=["small", "larger-than-a-chunk"])
@pytest.mark.parametrize("where", list(CUTS))
@pytest.mark.parametrize("select", [None, lambda name: False], ids=["read", "skipped"])
def test_a_cut_names_the_member_what_was_expected_and_what_arrived(where, second, select):
    """Issue 41: a shard cut anywhere (header, data, padding, end blocks) is reported as what it is, with the
    member, the bytes expected and the bytes that arrived: never "expected 1 bytes of data, got 1"."""
    raw = _two_members(second)
    cut, wanted = CUTS[where]
    pad = (-second) % 512
    end = 1536 + second + pad
    if where == "inside the second padding":
        cut = 1536 + second + 10
    elif where == "inside the end marker":
        cut = end + 100
    if select is not None and "data" in where:  # a skipped member: its data and padding are one run of bytes
        wanted = [w for w in wanted if "'" in w]
    with pytest.raises(CorruptShardError) as caught:
        list(TarMembers(io.BytesIO(raw[:cut]), "cut.tar", select=select))
    message = str(caught.value)
    for text in wanted:
        assert text.format(size=second, pad="10 bytes") in message, message
    assert not re.search(r"\b1 bytes\b", message), message


def _members_tar(path, names_data):
    """A tar of the given ``(name, bytes)`` members, in that order (a name may repeat)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in names_data:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return str(path)


@pytest.fixture
def repeat_shards(tmp_path):
    """Shard a repeats the field 'json' of x/s1 (stable-audio-tools' case); shard b is sound."""
    a = _members_tar(
        tmp_path / "a.tar",
        [
            ("x/s0.json", b"0"),
            ("x/s1.flac.json", b"f"),
            ("x/s1.json", b"1"),
            ("x/s1.JSON", b"repeat"),  # lower-cased, the same field
            ("x/s1.flac", b"F"),
            ("x/s2.wav", b"W"),
            ("x/s2.json", b"3"),
        ],
    )
    b = _members_tar(tmp_path / "b.tar", [("x/s3.json", b"4"), ("x/s4.json", b"5")])
    return [a, b]


def _shown(samples):
    return [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in samples]


EXPECTED_AFTER_SKIP = [
    ("x/s0", {"json": b"0"}),
    ("x/s1", {"flac.json": b"f", "json": b"1", "flac": b"F"}),
    ("x/s2", {"wav": b"W", "json": b"3"}),
    ("x/s3", {"json": b"4"}),
    ("x/s4", {"json": b"5"}),
]


@pytest.mark.parametrize("how", ["WebDataset", "DataPipeline", "tarfile_samples", "group_by_keys"])
def test_a_repeated_field_goes_to_the_handler_and_the_shard_goes_on(repeat_shards, how):
    """A member repeating a field is not damage: the handler gets a ValueError naming URL, member and byte once;
    when it lets it pass only that member is skipped (the sample keeps the first), as webdataset 1.0.2 does."""
    import wds_cloud as wds
    from wds_cloud.errors import SampleError
    from wds_cloud.tariterators import group_by_keys, tar_file_expander, url_opener

    seen = []

    def handler(exn):
        seen.append(exn)
        return True

    src = [{"url": u} for u in repeat_shards]
    if how == "WebDataset":
        samples = list(wds.WebDataset(repeat_shards, shardshuffle=False, handler=handler))
    elif how == "DataPipeline":
        samples = list(wds.DataPipeline(wds.SimpleShardList(repeat_shards), wds.tarfile_to_samples(handler=handler)))
    elif how == "tarfile_samples":
        samples = list(wds.tarfile_samples(iter(src), handler=handler))
    else:
        files = tar_file_expander(url_opener(iter(src), handler=handler), handler=handler)
        samples = list(group_by_keys(files, handler=handler))
    assert _shown(samples) == EXPECTED_AFTER_SKIP
    assert len(seen) == 1
    exn = seen[0]
    assert isinstance(exn, ValueError) and isinstance(exn, SampleError) and not isinstance(exn, CorruptShardError)
    assert "a.tar" in str(exn) and "'x/s1.JSON'" in str(exn) and "repeats the field 'json'" in str(exn)
    if how != "group_by_keys":  # member dicts carry no byte offsets
        assert "at byte 3072" in str(exn) and exn.offset == 3072  # 4th member: header + 1 block each
    assert exn.member == "x/s1.JSON" and exn.key == "x/s1" and exn.field == "json"


@pytest.mark.parametrize("how", ["WebDataset", "group_by_keys"])
def test_a_repeated_field_not_let_pass_is_raised_or_stops_once(repeat_shards, how):
    """reraise_exception (the default) raises the ValueError; a handler returning False stops the pass, called
    once; neither yields the sample the repeat was in."""
    import wds_cloud as wds
    from wds_cloud.tariterators import group_by_keys, tar_file_expander, url_opener

    def read(handler):
        got = []
        src = [{"url": u} for u in repeat_shards]
        if how == "WebDataset":
            it = iter(wds.WebDataset(repeat_shards, shardshuffle=False, handler=handler))
        else:
            it = group_by_keys(
                tar_file_expander(url_opener(iter(src), handler=handler), handler=handler), handler=handler
            )
        try:
            for sample in it:
                got.append(sample)
        except ValueError as exn:
            return _shown(got), exn
        return _shown(got), None

    got, raised = read(wds.reraise_exception)
    assert got == EXPECTED_AFTER_SKIP[:1]
    assert isinstance(raised, ValueError) and "repeats the field 'json'" in str(raised)
    seen = []
    got, raised = read(lambda exn: seen.append(exn) or False)
    assert raised is None and got == EXPECTED_AFTER_SKIP[:1] and len(seen) == 1


@pytest.mark.parametrize("after", range(6))
@pytest.mark.parametrize("bufsize", [0, 3])
def test_resume_is_exact_across_a_skipped_repeat(repeat_shards, after, bufsize):
    """A state taken after any sample (right after the one holding the repeat included) resumes at exactly the
    next sample, counted right; a shuffle's buffered samples are fetched again as first read."""
    import json

    import wds_cloud as wds

    def build():
        ds = wds.WebDataset(repeat_shards, shardshuffle=False, handler=lambda exn: True)
        return ds.shuffle(bufsize, initial=bufsize, seed=7) if bufsize else ds

    whole = list(build())
    assert sorted(_shown(whole)) == sorted(EXPECTED_AFTER_SKIP)
    ds = build()
    it = iter(ds)
    head = [next(it) for _ in range(after)]
    state = json.loads(json.dumps(ds.state_dict()))
    resumed = build()
    resumed.load_state_dict(state)
    assert _shown(head + list(resumed)) == _shown(whole)


class _TrickleRead:
    """A stream giving at most ``most`` bytes a read, with ``read`` only (as some streams have)."""

    def __init__(self, data: bytes, most: int) -> None:
        self._data, self._at, self._most = data, 0, most

    def read(self, size: int = -1) -> bytes:
        size = self._most if size is None or size < 0 else min(size, self._most)
        out = self._data[self._at : self._at + size]
        self._at += len(out)
        return out

    def close(self) -> None:
        pass


class _Trickle(_TrickleRead):
    """The same, with ``readinto``."""

    def readinto(self, buffer) -> int:
        out = self.read(len(buffer))
        buffer[: len(out)] = out
        return len(out)


def _samples_and_error(stream, chunk, views):
    members = TarMembers(stream, "mem.tar", chunk=chunk, views=views)
    where = [0, 0, 0, None]
    out, error = [], None
    try:
        for sample in shard_samples("mem.tar", stream, members=members, where=where):
            out.append(({k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}, tuple(where)))
    except CorruptShardError as exc:
        error = (str(exc), exc.offset)
    return out, error


@settings(max_examples=80, deadline=None)
@given(
    items=sample_lists(max_size=10),
    fmt=st.sampled_from(sorted(FORMATS)),
    compress=st.sampled_from([None, "gzip"]),
    cut=st.one_of(st.none(), st.floats(0, 1)),
    most=st.sampled_from([1, 7, 512, 1000, 70_000]),
    chunk=st.sampled_from([1024, 4096, 1 << 20]),
    readinto=st.booleans(),
    views=st.booleans(),
)
def test_a_streamed_read_in_any_pieces_is_the_same_read(items, fmt, compress, cut, most, chunk, readinto, views):
    """The streamed reader reads into one buffer it reuses (views: joins what it reads): a stream that gives a
    few bytes at a time, with or without readinto, is read to the same samples, cursor and error (offset and
    message) as the same bytes at once.  (It found the compression's magic bytes read with one read: a stream
    giving one byte was taken for a plain tar.)"""
    data = write_tar(items, fmt, compress=compress)
    if cut is not None:
        data = data[: int(len(data) * cut)]
    whole = _samples_and_error(io.BytesIO(data), 1 << 20, False)
    stream = _Trickle(data, most) if readinto else _TrickleRead(data, most)
    assert _samples_and_error(stream, chunk, views) == whole


@settings(max_examples=80, deadline=None)
@given(
    items=sample_lists(max_size=6),
    compress=st.sampled_from(["gzip", "bz2", "xz", "zstd"]),
    damage=st.one_of(st.none(), st.tuples(st.sampled_from(["cut", "flip"]), st.floats(0, 1), st.integers(0, 7))),
    most=st.sampled_from([1, 5, 4096, 70_000]),
    readinto=st.booleans(),
)
def test_a_damaged_compressed_stream_reads_the_same_however_it_is_delivered(items, compress, damage, most, readinto):
    """The second 44 adversary: a cut zstd, a flipped xz or bz2 stream gave other samples or another error when its
    source handed over a byte at a time (the decompressor was fed the source's own pieces); it is now given
    whole pieces of what it asks for."""
    pytest.importorskip("zstandard")
    data = bytearray(write_tar(items, "gnu", compress=compress))
    if damage is not None:
        how, where, bit = damage
        at = int(len(data) * where) % max(len(data), 1)
        if how == "cut":
            del data[at:]
        elif data:
            data[at] ^= 1 << bit
    data = bytes(data)
    whole = _samples_and_error(io.BytesIO(data), 1 << 20, False)
    stream = _Trickle(data, most) if readinto else _TrickleRead(data, most)
    assert _samples_and_error(stream, 1 << 20, False) == whole


@pytest.mark.parametrize("cut", [None, 512 + 5000 + 10])
def test_a_member_larger_than_a_small_chunk_already_read_whole(cut):
    """The second 44 adversary: with chunk=4096 a 5000-byte member that the first (64 KiB) read brought whole with
    part of its padding raised a bare ValueError (its bytes copied into a buffer sized for the member)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("a.bin")
        info.size = 5000
        tar.addfile(info, io.BytesIO(b"x" * 5000))
    data = out.getvalue()[:cut]
    for stream in (io.BytesIO(data), _Trickle(data, 5600)):
        if cut is None:
            assert [(n, len(d)) for n, d in TarMembers(stream, "t.tar", chunk=4096)] == [("a.bin", 5000)]
        else:
            with pytest.raises(CorruptShardError, match="inside the padding after the member's 5000 bytes"):
                list(TarMembers(stream, "t.tar", chunk=4096))
