"""tar/ as rebuilt: each header rule stated once and agreeing with tarfile, the keyed loop of the grouping kernel
against its general loop, large members of a mapped shard read with one pread, the sample position, and the
sizes CONTRIBUTING promises."""

from __future__ import annotations

import ast
import io
import os
import pathlib
import re
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_cloud.errors import CorruptShardError, ObjectChangedError
from wds_cloud.io.open import gopen
from wds_cloud.tar import buffers, format
from wds_cloud.tar.grouping import SKIP_META, SamplePosition, group, member_filter, shard_samples
from wds_cloud.tar.members import TarMembers

from .strategies import FORMATS, sample_lists, write_tar

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def tables_kept_at_once(monkeypatch):
    """Files written by a test are seconds old: here their tables are kept at once."""
    from wds_cloud.tar import table

    monkeypatch.setattr(table, "SETTLED", -1.0)
    table.forget()
    yield
    table.forget()


def _header(size_field: bytes, typeflag: bytes = b"0") -> bytes:
    """A ustar header of ``a.txt`` whose size field is ``size_field``, its checksum right."""
    info = tarfile.TarInfo("a.txt")
    info.size = 10
    block = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    block[124:136] = size_field
    block[156:157] = typeflag
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def _tarfile_size(block: bytes):
    try:
        return tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape").size
    except tarfile.HeaderError:
        return None


@pytest.mark.parametrize("last", range(256))
def test_the_size_field_is_read_by_one_rule_that_tarfile_agrees_with(last):
    """Every byte at the end of the size field: the fast check (plain_header), a header's listing (plain_member)
    and the general reader read the size tarfile reads, or refuse where tarfile refuses (a byte below 32 there
    ended the digits for plain_member and the table's check, so they took a header tarfile refuses)."""
    block = _header(b"00000000012" + bytes([last]))
    expected = _tarfile_size(block)
    fast = format.plain_header(block, memoryview(block), 0, 1 << 62)
    listed = format.plain_member(block)
    try:
        general = format.number(block[124:136])
    except ValueError:
        general = None
    assert general == expected
    assert listed == (("a.txt", expected) if expected is not None else None)
    assert fast is None or fast == ("a.txt", expected)
    assert format.same_header(block, 0, "a.txt", 10) == (expected == 10)  # a table's check: the general rule


@settings(max_examples=200, deadline=None)
@given(field=st.binary(min_size=12, max_size=12))
def test_any_size_field_reads_alike_fast_and_general(field):
    """Whatever the twelve bytes, the fast check takes a member only at the size tarfile's rule gives it."""
    block = _header(field)
    fast = format.plain_header(block, memoryview(block), 0, 1 << 62)
    if fast is not None:
        assert fast[1] == format.number(field) == _tarfile_size(block)


@settings(max_examples=300, deadline=None)
@given(
    edits=st.lists(st.tuples(st.integers(0, 511), st.integers(0, 255)), max_size=6),
    spelling=st.sampled_from([b"%06o\0 ", b"%06o  ", b"%07o\0", b"%o\0"]),
    off=st.sampled_from([0, 0, 65521, -65521, 1, -1]),
)
def test_the_fast_check_takes_a_header_exactly_where_the_general_rules_do(edits, spelling, off):
    """Bytes changed anywhere (high ones too), the checksum written in other spellings or off by adler32's modulus:
    the fast check (one struct call and one sum per header) takes a header only where the checksum rule
    (sum_matches), number() and the type, prefix and folder rules take it, and the usual spellings always."""
    block = bytearray(_header(b"00000000012\0"))
    for at, value in edits:
        block[at] = value
    block[148:156] = b" " * 8
    total = sum(block) + off
    block[148:156] = (spelling % total)[:8].ljust(8, b"\0") if total >= 0 else b"x" * 8
    block = bytes(block)
    fast = format.plain_header(block, memoryview(block), 0, 1 << 62)
    try:
        stored = format.checksum_at(block, 0)
        size = format.number(block[124:136])
    except ValueError:
        assert fast is None
        return
    name = format.header_name(block)
    usual_size = block[135] in (0, 32) or block[124:136].isdigit()
    expected = (
        format.sum_matches(memoryview(block), 0, stored)
        and block[156] in format.PLAIN
        and block[345] == 0
        and 0 <= size
        and usual_size
        and not (name[-1:] == "/" and block[156] == 0)
    )
    if fast is not None:
        assert expected and fast == (name, size)
    elif expected and block[148:156] == b"%06o\0 " % stored and block[124:136] == b"%011o\0" % size:
        raise AssertionError("a header in the usual spellings that every rule takes was left to the general reader")


class _Chunks:
    """A stream that hands over at most ``step`` bytes a read (with ``readinto``, or ``read`` alone)."""

    def __init__(self, data: bytes, step: int, readinto: bool) -> None:
        self._data, self._pos, self._step = data, 0, step
        if readinto:
            self.readinto = self._readinto

    def read(self, size: int = -1) -> bytes:
        size = self._step if size is None or size < 0 else min(size, self._step)
        out = self._data[self._pos : self._pos + size]
        self._pos += len(out)
        return out

    def _readinto(self, buffer) -> int:
        out = self.read(len(buffer))
        memoryview(buffer)[: len(out)] = out
        return len(out)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("readinto", [True, False])
def test_large_members_of_a_stream_in_a_row_read_as_tarfile_reads_them_and_a_cut_anywhere_is_an_error(readinto):
    """Members larger than the chunk one after another (the padding and the next header read alone after each),
    among small ones: streamed, they read as tarfile reads them; cut at any block or inside one before the
    end-of-archive block, an error."""
    sizes = [3000, 5000, 10, 4096, 7000, 2049, 1, 0, 9000]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, size in enumerate(sizes):
            info = tarfile.TarInfo(f"s{i:02d}.bin")
            info.size = size
            tar.addfile(info, io.BytesIO(bytes([i + 1]) * size))
    data = out.getvalue()
    expected = [(f"s{i:02d}.bin", bytes([i + 1]) * size) for i, size in enumerate(sizes)]

    def read(blob: bytes) -> list:
        members = TarMembers(_Chunks(blob, 700, readinto), "s.tar", chunk=1024)
        return [(name, bytes(value)) for name, value in members]

    assert read(data) == expected
    archive_end = sum(512 + format.padded_size(size) for size in sizes)
    # iteration stops at the first zero block: a cut in the second is not seen
    cuts = sorted({c + d for c in range(0, archive_end + 512, 512) for d in (0, 1, 100, 511)})
    for cut in cuts:
        with pytest.raises(CorruptShardError):
            read(data[:cut])


def test_what_is_written_reads_back():
    """The writer's fields are the reader's: octal numbers and PAX records read back as written."""
    for value in (0, 1, 511, 8**11 - 1):
        assert format.number(format.octal(value, 12)) == value
    record = format.pax_record(b"path", "é/x.txt".encode())
    assert format.pax_records(record) == {"path": "é/x.txt"}


def _shard(tmp_path, items, fmt="ustar") -> str:
    path = tmp_path / "s.tar"
    path.write_bytes(write_tar(items, fmt))
    return str(path)


def _outcome(samples, members, position):
    """(samples, positions after each, error) of one read of ``members`` (closed after), views made bytes."""
    out, error = [], None
    try:
        for sample in samples:
            out.append(({k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}, repr(position)))
    except (CorruptShardError, ValueError) as exc:
        error = str(exc)
    finally:
        members.close()
    return out, error


def _grouped(url, keyed, views=False):
    """(samples, positions after each, error) of one read through the kernel, its keyed loop allowed or not."""
    members = TarMembers(gopen(url), url, select=member_filter(SKIP_META, None, None), views=views)
    members.max_sample = 1 << 40
    position = SamplePosition()
    return _outcome(
        group(members.runs(keyed), members, url, position=position, limit=members.max_sample), members, position
    )


@settings(max_examples=60, deadline=None)
@given(items=sample_lists(max_size=12), fmt=st.sampled_from(sorted(FORMATS)), views=st.booleans())
def test_the_keyed_loop_groups_as_the_general_loop_does(tmp_path_factory, items, fmt, views):
    """The kernel's second loop, over a member table's split names, kept for speed: the same samples, positions
    and errors as its general loop over the same table, and as a first pass that reads every header."""
    url = _shard(tmp_path_factory.mktemp("k"), items, fmt)
    first = _grouped(url, keyed=False, views=views)  # reads the headers, keeps the table
    assert _grouped(url, keyed=True, views=views) == first
    assert _grouped(url, keyed=False, views=views) == first


def _large_tar(sizes) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, size in enumerate(sizes):
            info = tarfile.TarInfo(f"{i:03d}.bin")
            info.size = size
            tar.addfile(info, io.BytesIO(bytes([i % 251]) * size))
    return raw.getvalue()


@pytest.mark.parametrize("views", [False, True])
def test_a_large_member_of_a_mapped_shard_is_one_pread_and_no_page_mapping(tmp_path, monkeypatch, views):
    """Members larger than a window come out of a mapped shard with one pread each (no slice of the mapping, no
    pages mapped for them), the same bytes as a streamed read; views stay views of the mapping."""
    sizes = [70_000, 100, 200_000, 5, 90_000]
    data = _large_tar(sizes)
    path = tmp_path / "big.tar"
    path.write_bytes(data)
    monkeypatch.setattr(buffers, "LARGE", 50_000)
    preads: list = []
    populated: list = []
    real_pread, real_populate = os.pread, buffers.populate
    monkeypatch.setattr(os, "pread", lambda fd, n, at: (preads.append(n), real_pread(fd, n, at))[1])
    monkeypatch.setattr(buffers, "populate", lambda m, a, b: (populated.append((a, b)), real_populate(m, a, b))[1])
    members = TarMembers(gopen(str(path)), str(path), chunk=65536, views=views)
    got = [(name, bytes(data_)) for name, data_ in members]
    assert members.mapped
    members.close()
    streamed = [(n, bytes(d)) for n, d in TarMembers(io.BytesIO(data), "s", chunk=65536)]
    assert got == streamed and [len(d) for _, d in got] == sizes
    assert sorted(preads) == ([] if views else [70_000, 90_000, 200_000])
    if not views:  # no window was mapped for a member larger than it
        heads = [512, 512 + 512 + 70_144 + 512 + 512, None]
        assert not any(a <= heads[0] < b for a, b in populated)


def test_a_mapped_shard_cut_short_before_a_large_member_is_an_error_not_a_crash(tmp_path, monkeypatch):
    """A shard truncated in place after it was mapped, before its large member is read: an error naming the
    change (the pread comes back short), never SIGBUS or a short member."""
    data = _large_tar([100, 300_000, 100])
    path = tmp_path / "cut.tar"
    path.write_bytes(data)
    monkeypatch.setattr(buffers, "LARGE", 50_000)
    members = TarMembers(gopen(str(path)), str(path), chunk=65536)
    iterator = iter(members)
    assert next(iterator)[0] == "000.bin"
    os.truncate(path, 100_000)
    with pytest.raises((ObjectChangedError, CorruptShardError)) as info:
        next(iterator)
    assert str(path) in str(info.value) and "cut short" in str(info.value)
    members.close()


def test_shard_samples_keeps_a_position_and_the_older_list_alike(tmp_path):
    """``position=`` (a SamplePosition) and the list ``where=`` took before it hold the same after each sample."""
    url = _shard(tmp_path, [(f"k{i}", {"txt": b"x" * (i * 100)}) for i in range(5)])
    position, where = SamplePosition(), [0, 0, 0, None]
    with open(url, "rb") as one, open(url, "rb") as two:
        for a, b in zip(shard_samples(url, one, position=position), shard_samples(url, two, where=where)):
            assert a == b
            assert [position.start, position.end, position.samples, position.next_name] == where
    assert where[2] == 5 and where[3] is None


def _kept_whole() -> set:
    """The functions and classes of tar/ that CONTRIBUTING's "Sizes" names as kept whole."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    sizes = text[text.index("## Sizes") :]
    return set(re.findall(r"`tar/(\w+)\.py` `(\w+)`", sizes))


def test_no_class_in_tar_over_400_lines_nor_function_over_80_unless_contributing_says_why():
    """tar/ keeps the sizes the house sets, and what it keeps whole CONTRIBUTING names, with its numbers."""
    over = []
    for path in sorted((ROOT / "wds_cloud" / "tar").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > (400 if isinstance(node, ast.ClassDef) else 80):
                    over.append((path.stem, node.name, lines))
    allowed = _kept_whole()
    assert [(m, n) for m, n, _ in over if (m, n) not in allowed] == []
    text = (ROOT / "CONTRIBUTING.md").read_text()
    for module, name, lines in over:
        assert f"`tar/{module}.py` `{name}` ({lines} lines)" in text  # the true number


def _block(name: bytes, size: int, flag: bytes = b"0", prefix: bytes = b"", magic: bytes = b"ustar\x0000") -> bytes:
    """One header, crafted field by field (what tarfile's writer would not write), its checksum right."""
    h = bytearray(512)
    h[0:100] = name[:100].ljust(100, b"\0")
    h[100:124] = b"0000644\x000000000\x000000000\x00"
    h[124:136] = b"%011o\0" % size
    h[136:148] = b"00000000000\0"
    h[156:157] = flag
    h[257:265] = magic
    h[345:500] = prefix.ljust(155, b"\0")
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def _entry(name: bytes, data: bytes, flag: bytes = b"0", **kw) -> bytes:
    return _block(name, len(data), flag, **kw) + data + bytes(-len(data) % 512)


def _pax(records: dict, flag: bytes = b"x") -> bytes:
    return _entry(b"PaxHeader", b"".join(format.pax_record(k.encode(), v.encode()) for k, v in records.items()), flag)


NAMING = {
    "two long names": _entry(b"././@LongLink", b"a/s1.txt\0", b"L") + _entry(b"././@LongLink", b"b/s1\0", b"L"),
    "a PAX path, then a long name": _pax({"path": "pax/s1.txt"}) + _entry(b"././@LongLink", b"gnu/s1\0", b"L"),
    "a long name, then a PAX path": _entry(b"././@LongLink", b"gnu/s1.txt\0", b"L") + _pax({"path": "pax/s1"}),
    "a Solaris extended header": _pax({"path": "p/s1.txt"}, b"X"),
    "a PAX path with a trailing slash": _pax({"path": "p.q/"}),
    "a prefix without ustar's magic": b"",
}


@pytest.mark.parametrize("case", sorted(NAMING))
@pytest.mark.parametrize("mapped", [False, True])
def test_names_are_tarfiles_whatever_headers_give_them(tmp_path, case, mapped):
    """Nested metadata headers, Solaris' X, a PAX path's trailing slash and a prefix in a header without ustar's
    magic name a member as tarfile (and so webdataset 1.0.2) names it (the last long name won, a Solaris header
    was skipped, the slash kept a sample from grouping, the prefix was dropped: adversary findings)."""
    if case == "a prefix without ustar's magic":
        data = _entry(b"s1.txt", b"hello", prefix=b"pre", magic=bytes(8))
    else:
        data = NAMING[case] + _entry(b"s1.txt", b"hello")
    data += _entry(b"s2.txt", b"world") + bytes(1024)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        expected = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isreg()]
    path = tmp_path / "names.tar"
    path.write_bytes(data)
    stream = gopen(str(path)) if mapped else io.BytesIO(data)
    members = TarMembers(stream, str(path))
    assert [(name, bytes(d)) for name, d in members] == expected
    assert members.mapped == mapped
    members.close()


@pytest.mark.parametrize("size", [0, 5])
def test_an_old_style_member_named_like_a_folder_is_a_folder(tmp_path, size):
    """A type-NUL member whose name ends with ``/`` is a directory, as tarfile reads it (no data of its own), in
    the fast path and the general reader alike (it was a member named ``d/``)."""
    data = _entry(b"s1.txt", b"one") + _block(b"d/", size, b"\0") + _entry(b"s2.txt", b"two") + bytes(1024)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        expected = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isreg()]
    path = tmp_path / "dir.tar"
    path.write_bytes(data)
    for stream in (io.BytesIO(data), gopen(str(path))):
        members = TarMembers(stream, str(path))
        try:
            got = [(name, bytes(d)) for name, d in members]
        except CorruptShardError:
            got = None  # a directory's data read as headers: tarfile ends the archive there, we refuse it
        members.close()
        assert got == expected or (size and got is None)


@pytest.mark.parametrize(
    "members",
    [
        [("s0.txt", b"a"), ("s1.__key__", b"x"), ("s1.txt", b"b")],
        [("s1.TXT", b"a"), ("s1.txt", b"b")],
        [("s1.txt", b"a"), ("s1.txt", b"b")],
    ],
)
def test_verify_and_index_refuse_what_the_reader_refuses(tmp_path, capsys, members):
    """A member repeating a field of its sample (a metadata field, or one that differs only in case): the reader
    refuses the shard, and so do `wds-cloud verify` and `index` (they passed it, and indexed a field twice or
    left the member out: adversary finding)."""
    from wds_cloud.cli import main as cli_main

    path = tmp_path / "dup.tar"
    data = b"".join(_entry(name.encode(), body) for name, body in members) + bytes(1024)
    path.write_bytes(data)
    with pytest.raises(ValueError, match="repeats the field"):
        list(__import__("wds_cloud").WebDataset(str(path), shardshuffle=False))
    assert cli_main(["verify", str(path)]) != 0
    assert cli_main(["index", str(path)]) != 0
    assert "repeats the field" in capsys.readouterr().err + capsys.readouterr().out
    assert not (tmp_path / "dup.tar.index.json").exists()


def test_a_field_named_gz_is_gunzipped_as_webdataset_does():
    """``decode()`` un-gzips a field named exactly ``gz`` (webdataset matches ``.gz`` after a dot it puts before
    the field's name); it was left compressed (adversary finding)."""
    import gzip

    import wds_cloud as wds

    sample = {"__key__": "a", "gz": gzip.compress(b"hello"), "txt.gz": gzip.compress(b"text")}
    (decoded,) = wds.DataPipeline(lambda: iter([dict(sample)]), wds.decode()).__iter__()
    assert decoded["gz"] == b"hello" and decoded["txt.gz"] == "text"


def test_the_last_sample_of_a_shard_is_yielded_without_fields_as_every_other_is(tmp_path):
    """A sample none of whose members is kept (``suffixes``, or a repeat the handler skipped) is yielded as
    ``{__key__, __url__}`` at the end of a shard as anywhere else, as webdataset's grouping yields it (the last
    one was dropped: adversary finding)."""
    data = _entry(b"a.txt", b"1") + _entry(b"b.cls", b"2") + _entry(b"c.txt", b"3") + _entry(b"d.cls", b"4")
    path = tmp_path / "s.tar"
    path.write_bytes(data + bytes(1024))
    with open(path, "rb") as stream:
        samples = list(shard_samples(str(path), stream, suffixes=["txt"]))
    assert [sorted(s) for s in samples] == [["__key__", "__url__", "txt"], ["__key__", "__url__"]] * 2


def _two_shards(tmp_path) -> list:
    urls = []
    for s in range(2):
        data = b"".join(_entry(f"k{s}_{i}.txt".encode(), f"{s}-{i}".encode()) for i in range(5)) + bytes(1024)
        path = tmp_path / f"s{s}.tar"
        path.write_bytes(data)
        urls.append(str(path))
    return urls


def _gen():
    for i in range(6):
        yield {"__key__": f"g{i}"}


class _Counted:
    """A user's source that keeps its place (state_dict/load_state_dict)."""

    def __init__(self):
        self.n = 0

    def __call__(self):
        while self.n < 6:
            self.n += 1
            yield {"__key__": f"c{self.n - 1}"}

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_a_pipeline_without_a_reader_takes_no_state_that_claims_to_be_exact(tmp_path, caplog):
    """url_opener -> tar_file_expander -> group_by_keys, a generator, a list or a shard list alone keep no place in
    the pass: a state taken inside it is refused with strict=True, and is inexact (loading it starts the pass again,
    said in the log) without it; they each claimed to be exact and started the pass again (adversary finding).
    Where the pass begins, and where a nested shard list feeds a reader, states stay exact."""
    import wds_cloud as wds

    T = wds.tariterators
    urls = _two_shards(tmp_path)
    unplaced = {
        "stages": lambda: wds.DataPipeline(
            wds.SimpleShardList(urls), T.url_opener, T.tar_file_expander, T.group_by_keys
        ),
        "generator": lambda: wds.DataPipeline(_gen, wds.map(dict)),
        "list": lambda: wds.DataPipeline(lambda: iter([{"__key__": f"l{i}"} for i in range(6)])),
        "shard list": lambda: wds.DataPipeline(wds.SimpleShardList(urls), wds.split_by_worker),
    }
    for name, build in unplaced.items():
        ds = build()
        assert ds.state_dict(strict=True)["progress"] == [0, 0], name  # no pass begun: exact
        it = iter(ds)
        first = [next(it) for _ in range(2)]
        with pytest.raises(wds.NotResumableError, match="no stage keeps where its pass stands"):
            ds.state_dict(strict=True)
        state = ds.state_dict()
        again = build()
        with pytest.warns(wds.InexactResumeWarning, match="starts again"):
            again.load_state_dict(state)
        assert list(again)[:2] == first, name  # the pass starts again, as the state says it will
    placed = {
        "nested shard list": lambda: wds.DataPipeline(
            wds.DataPipeline(wds.SimpleShardList(urls), wds.split_by_worker), wds.tarfile_to_samples()
        ),
        "resumable source": lambda: wds.DataPipeline(_Counted(), wds.map(dict)),
        "reader": lambda: wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples()),
    }
    for name, build in placed.items():
        whole = [s["__key__"] for s in build()]
        ds = build()
        it = iter(ds)
        for _ in range(3):
            next(it)
        again = build()
        again.load_state_dict(ds.state_dict(strict=True))
        assert [s["__key__"] for s in again] == whole[3:], name


def test_a_resume_after_a_skipped_metadata_repeat_is_exact(tmp_path):
    """A buffered sample followed by a member repeating a metadata field (``cd.__key__``, which the handler lets
    pass): the state resumes the 7 samples left (the shuffle's buffered samples were fetched again past where
    the pass had ended them, and the resume refused as if the shard had changed: adversary finding; the
    fieldless sample ``cd`` ends its shard's part as the pass ended it)."""
    import wds_cloud as wds

    names = "a0.txt a1.txt a2.txt a3.txt b.txt cd.__key__ e.txt f.txt g.txt h.txt i.txt".split()
    data = b"".join(_entry(n.encode(), b"" if n.endswith("__key__") else b"x" * 100) for n in names)
    path = tmp_path / "min.tar"
    path.write_bytes(data + bytes(1024))

    def build():
        return wds.WebDataset(
            [str(path)], shardshuffle=False, seed=7, handler=wds.ignore_and_continue, empty_check=False
        ).shuffle(7)

    ds = build()
    it = iter(ds)
    for _ in range(4):
        next(it)
    state = ds.state_dict()
    again = build()
    again.load_state_dict(state)
    assert len(list(again)) == 7


def _read_all(url, *, stream=None, views=False, rename=None):
    """(samples, positions after each, error) of shard_samples over ``url`` (mapped) or ``stream``."""
    position = SamplePosition()
    source = gopen(url) if stream is None else stream
    members = TarMembers(source, url, select=member_filter(SKIP_META, None, rename), views=views)
    return _outcome(
        shard_samples(url, source, members=members, position=position, rename_files=rename), members, position
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    items=sample_lists(max_size=10),
    fmt=st.sampled_from(sorted(FORMATS)),
    views=st.booleans(),
    mapped=st.booleans(),
    rename=st.sampled_from([None, str.upper, lambda n: "x/" + n]),
    cut=st.one_of(st.none(), st.floats(0.0, 1.0)),
)
def test_a_sample_handed_over_before_a_large_members_data_is_the_same_sample(
    tmp_path_factory, monkeypatch, items, fmt, views, mapped, rename, cut
):
    """Large members are read only once the sample before them is handed over (tar.members' ``defer``): with every
    member counted large, the same samples, positions and errors as with none, on whole shards and on shards cut
    anywhere (a cut inside a large member delivered the sample before it, a cut inside a small one did not:
    adversary finding)."""
    data = write_tar(items, fmt)
    if cut is not None:
        data = data[: int(len(data) * cut)]
    url = str(tmp_path_factory.mktemp("d") / "s.tar")
    pathlib.Path(url).write_bytes(data)
    with monkeypatch.context() as m:
        m.setattr(buffers, "LARGE", 1 << 62)
        plain = _read_all(url, stream=None if mapped else io.BytesIO(data), views=views, rename=rename)
    with monkeypatch.context() as m:
        m.setattr(buffers, "LARGE", 1)
        deferred = _read_all(url, stream=None if mapped else io.BytesIO(data), views=views, rename=rename)
    assert deferred == plain


@pytest.mark.parametrize("mapped", [True, False])
def test_a_large_sample_is_handed_over_before_the_next_one_is_read(tmp_path, mapped):
    """While a loop holds the sample it was given, reading the next one from a mapped shard holds that one and the
    new member's bytes, not a third buffer (the sample being grouped): peak memory of two large members, not
    three.  A stream, whose bytes are not known to be there until read, hands the sample over after (as
    webdataset does: damage in the member stops the shard before it)."""
    import tracemalloc

    size = 2 << 20
    data = _large_tar([size] * 6)
    path = tmp_path / "big.tar"
    path.write_bytes(data)
    stream = gopen(str(path)) if mapped else io.BytesIO(data)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        n = 0
        for _sample in shard_samples(str(path), stream):
            n += 1
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        stream.close()
    del _sample
    assert n == 6
    assert peak < (2.5 if mapped else 4.0) * size, f"peak {peak / size:.2f} members alive"


@pytest.mark.parametrize("big", [256 * 1024 - 1, 256 * 1024])
@pytest.mark.parametrize("mapped", [True, False])
def test_a_cut_inside_a_member_stops_before_the_sample_before_it_whatever_its_size(tmp_path, big, mapped):
    """webdataset's reader raises on a member cut short before its grouping sees the member's key, so the sample
    before it is not delivered: the same at every size (a large member, read after the hand-over, let it through:
    adversary finding)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, n in [("a.txt", 10), ("b.txt", 5), ("c.bin", big), ("c.txt", 3)]:
            info = tarfile.TarInfo(name)
            info.size = n
            tar.addfile(info, io.BytesIO(b"x" * n))
    data = raw.getvalue()
    at = tarfile.open(fileobj=io.BytesIO(data)).getmember("c.bin").offset_data
    path = tmp_path / "cut.tar"
    path.write_bytes(data[: at + 1])
    got = []
    stream = gopen(str(path)) if mapped else io.BytesIO(data[: at + 1])
    with stream, pytest.raises(CorruptShardError):
        for sample in shard_samples(str(path), stream):
            got.append(sample["__key__"])
    assert got == ["a"]


def test_a_resume_between_large_samples_is_exact(tmp_path, monkeypatch):
    """A state taken after each sample of a shard of large members (each handed over before the next is read)
    resumes exactly the samples left."""
    import wds_cloud as wds

    monkeypatch.setattr(buffers, "LARGE", 1000)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(5):
            for ext, size in (("bin", 3000 + i), ("json", 10), ("npy", 2000)):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = size
                tar.addfile(info, io.BytesIO(bytes([i]) * size))
    path = tmp_path / "large.tar"
    path.write_bytes(raw.getvalue())
    whole = [s["__key__"] for s in wds.WebDataset([str(path)], shardshuffle=False)]
    assert whole == [f"s{i}" for i in range(5)]
    for k in range(6):
        ds = wds.WebDataset([str(path)], shardshuffle=False)
        it = iter(ds)
        for _ in range(k):
            next(it)
        state = ds.state_dict(strict=True)
        again = wds.WebDataset([str(path)], shardshuffle=False)
        again.load_state_dict(state)
        assert [s["__key__"] for s in again] == whole[k:]


@pytest.mark.parametrize("count", [4, 40, 400])
def test_large_plain_members_are_handed_over_by_the_fast_path_at_a_bounded_cost_each(tmp_path, monkeypatch, count):
    """A plain member larger than the window of a mapped shard comes from the fast path as a run whose read()
    reads it (after the sample before it is handed over), not from the general reader; per member, on a first
    pass and on one from the kept member table alike: one pread, one size check of the file (the table's runs
    and the scan ask for the window at the same position), and the pages given back at most once per 64 windows
    (a madvise per member cost more than the pages of the headers it gave back)."""
    from wds_cloud.tar import table as tables

    monkeypatch.setattr(tables, "SETTLED", -1.0)  # a file written just now keeps its table here
    monkeypatch.setattr(buffers, "LARGE", 50_000)
    sizes = [70_000 + i for i in range(count)]
    path = tmp_path / "large.tar"
    path.write_bytes(_large_tar(sizes))
    counts = dict.fromkeys(("slow", "pread", "size checks", "drops"), 0)

    def counted(name, real):
        def call(*args):
            counts[name] += 1
            return real(*args)

        return call

    monkeypatch.setattr(TarMembers, "_next_slow", counted("slow", TarMembers._next_slow))
    monkeypatch.setattr(os, "pread", counted("pread", os.pread))
    monkeypatch.setattr(buffers.MappedBuffer, "_check_size", counted("size checks", buffers.MappedBuffer._check_size))
    monkeypatch.setattr(buffers, "drop", counted("drops", buffers.drop))
    st = os.stat(path)
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    window = 65536
    for first in (True, False):
        assert (tables.lookup(identity) is None) == first
        counts.update(dict.fromkeys(counts, 0))
        members = TarMembers(gopen(str(path)), str(path), chunk=window)
        members.begin()
        assert members.mapped
        got = [sample["bin"] for sample in group(members.runs(False, defer=True), members, str(path))]
        members.close()
        assert got == [bytes([i % 251]) * size for i, size in enumerate(sizes)]
        assert counts["slow"] == 1, counts  # the end of the archive alone
        assert counts["pread"] == count, counts
        assert counts["size checks"] == count + 1, counts
        assert counts["drops"] <= sum(sizes) // (64 * window), counts


def _shard_of(path, members) -> str:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, size in members:
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(b"z" * size))
    then = os.stat(path).st_mtime - 100  # settled: a member table is kept after a first pass
    os.utime(path, (then, then))
    return str(path)


def test_a_sample_the_user_let_go_is_not_held_while_the_next_large_one_is_read(tmp_path):
    """Adversary finding: the pipeline's generators (and the kernel's last member) still held the sample before,
    so reading a large member after handing that sample over saved no memory: two large samples alive."""
    import gc
    import tracemalloc

    import wds_cloud as wds

    mb = 1 << 20
    url = _shard_of(tmp_path / "big.tar", [("a.x", 100), ("b.x", 8 * mb), ("c.x", 8 * mb), ("d.x", 10)])
    tracemalloc.start()
    try:
        it = iter(wds.WebDataset(url, shardshuffle=False))
        peaks = {}
        while True:
            gc.collect()
            tracemalloc.reset_peak()
            try:
                sample = next(it)
            except StopIteration:
                break
            peaks[sample["__key__"]] = tracemalloc.get_traced_memory()[1] / mb
            del sample  # the user holds nothing while the next sample is read
    finally:
        tracemalloc.stop()
    assert peaks["c"] < 12, peaks


def test_zero_copy_hands_a_large_member_out_without_a_copy(tmp_path):
    """Adversary finding: a member larger than the window of a mapped shard was sliced out of the mapping as
    bytes (a copy of the whole member), then thrown away for the view."""
    import tracemalloc

    import wds_cloud as wds

    mb = 1 << 20
    url = _shard_of(tmp_path / "big.tar", [("a.x", 100), ("b.x", 16 * mb), ("c.x", 10)])
    for _ in range(2):  # a first pass, then one from the member table
        tracemalloc.start()
        try:
            kinds = [type(s["x"]) for s in wds.WebDataset(url, shardshuffle=False, zero_copy=True)]
            peak = tracemalloc.get_traced_memory()[1] / mb
        finally:
            tracemalloc.stop()
        assert kinds == [memoryview] * 3 and peak < 4, peak


_CUT_LARGE = r"""
import io, os, sys, tarfile
import wds_cloud as wds
path, zero_copy = sys.argv[1], sys.argv[2] == "1"
mb = 1 << 20
with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
    for name, size in [("s0.a", 100), ("s1.a", 2 * mb), ("s2.a", 2 * mb)]:
        info = tarfile.TarInfo(name); info.size = size
        tar.addfile(info, io.BytesIO(b"x" * size))
try:
    for i, sample in enumerate(wds.WebDataset(path, shardshuffle=False, zero_copy=zero_copy)):
        bytes(sample["a"])
        if i == 0:
            os.truncate(path, 1_500_000)
    print("no error")
except Exception as exc:
    print(type(exc).__name__)
"""


@pytest.mark.parametrize("zero_copy", ["0", "1"])
def test_a_file_cut_in_place_inside_a_large_member_not_read_yet_is_an_error_with_views_too(tmp_path, zero_copy):
    """Adversary finding: with zero_copy, a shard cut in place after a sample was handed over, inside the next
    large member (past the window being read), ended the process with SIGBUS; bytes gave ObjectChangedError."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _CUT_LARGE, str(tmp_path / "cut.tar"), zero_copy], capture_output=True, text=True
    )
    assert (run.returncode, run.stdout.strip()) == (0, "ObjectChangedError"), run.stderr[-2000:]


@pytest.mark.parametrize("field,at", [("mode", 100), ("uid", 108), ("gid", 116), ("mtime", 136), ("devminor", 337)])
def test_a_numeric_field_no_reader_uses_is_not_read_in_any_mode(tmp_path, field, at):
    """hostile-shards.md: mode, uid, gid, mtime, devmajor and devminor are not read (tarfile refuses a header where
    one is not a number): such a member is taken alike by the fast path (mapped and streamed), the general
    reader, views and webdataset's stages, its data untouched (adversary finding, documented)."""
    from wds_cloud.tar.samples import tar_file_expander

    data = bytearray(_large_tar([10, 20, 30]))
    head = 512 + 512  # the second member's header
    data[head + at : head + at + 3] = b"zz9"
    data[head + 148 : head + 156] = b"        "
    data[head + 148 : head + 156] = b"%06o\0 " % sum(data[head : head + 512])
    path = tmp_path / "odd.tar"
    path.write_bytes(bytes(data))
    expected = [(f"{i:03d}.bin", bytes([i]) * size) for i, size in enumerate([10, 20, 30])]
    for views in (False, True):
        mapped = TarMembers(gopen(str(path)), str(path), views=views)
        assert [(n, bytes(d)) for n, d in mapped] == expected
        mapped.close()
        assert [(n, bytes(d)) for n, d in TarMembers(io.BytesIO(bytes(data)), "s", views=views)] == expected
    expanded = tar_file_expander([{"url": str(path), "stream": io.BytesIO(bytes(data))}])
    assert [(s["fname"], s["data"]) for s in expanded if "fname" in s] == expected


def test_a_sample_limit_taken_from_the_member_limit_says_so(tmp_path):
    """New user finding: with only max_member_size= given, the sample limit (which defaults to it) named only
    WDS_MAX_SAMPLE_SIZE and max_sample_size=, settings the user never set."""
    import wds_cloud as wds

    url = _shard_of(tmp_path / "s.tar", [("k.a", 600_000), ("k.b", 600_000), ("k.c", 10)])
    with pytest.raises(CorruptShardError) as info:
        list(wds.WebDataset(url, shardshuffle=False, max_member_size=1_000_000))
    message = str(info.value)
    assert "max_sample_size=" in message and "max_member_size=" in message and url in message


def _headers(members):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, size in members:
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(b"x" * size))
    return out.getvalue()


def test_the_memos_of_header_numbers_are_bounded_and_change_no_verdict(monkeypatch):
    """The usual spellings of sizes and checksums are read from memos (a shard of small samples repeats them): at
    most ``_KNOWN`` spellings each, whatever the shards, and a header read from them gets the verdict it gets
    parsed (a corrupted checksum is refused the second time as the first)."""
    monkeypatch.setattr(format, "_KNOWN_SIZES", {})
    monkeypatch.setattr(format, "_KNOWN_SUMS", {})
    monkeypatch.setattr(format, "_KNOWN", 50)
    members = [(f"{i:06d}.bin", i % 300) for i in range(400)]  # 300 sizes, many checksums
    buf = _headers(members)
    for _ in range(2):  # the second pass reads from the memos
        names, heads, sizes = [], [], []
        end = format.plain_headers(buf, 0, len(buf), 1 << 62, names, heads, sizes)
        assert list(zip(names, sizes)) == members
        assert end == sum(512 + (size + 511) // 512 * 512 for _, size in members)
        assert len(format._KNOWN_SIZES) <= 50 and len(format._KNOWN_SUMS) <= 50
    # a header whose checksum is one off is refused, memo or not
    one = bytearray(_headers([("000001.bin", 3)]))
    stored = int(bytes(one[148:154]), 8)
    for _ in range(2):
        bad = bytearray(one)
        bad[148:154] = b"%06o" % (stored + 1)
        assert format.plain_headers(bytes(bad), 0, len(bad), 1 << 62, [], [], []) == 0
        assert format.plain_headers(bytes(one), 0, len(one), 1 << 62, [], [], []) > 0
    # and one whose stored value is out of range (memoized as such)
    bad = bytearray(one)
    bad[148:154] = b"000001"
    assert format.plain_headers(bytes(bad), 0, len(bad), 1 << 62, [], [], []) == 0
    assert format.plain_headers(bytes(bad), 0, len(bad), 1 << 62, [], [], []) == 0


# the errors of the general reader for a damaged header: the field, the bytes found and what was expected
_URL = "http://example.com/bad.tar?token=secret"
_GOOD = _entry(b"good.txt", b"x")


def _resealed(block: bytes, at: int, field: bytes, checksum: int = 0) -> bytes:
    """``block`` with ``field`` written at ``at``, its checksum made right again, ``checksum`` off."""
    h = bytearray(block)
    h[at : at + len(field)] = field
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % (sum(h) + checksum)
    return bytes(h)


def _refused(data: bytes) -> str:
    with pytest.raises(CorruptShardError) as info:
        list(shard_samples(_URL, io.BytesIO(data + bytes(1024))))
    message = str(info.value)
    assert message.startswith("http://example.com/bad.tar?token=***: corrupt tar at byte ") and "secret" not in message
    assert "Re-create or re-download the shard (handler=warn_and_continue" in message  # the fix, as before
    return message


def test_a_checksum_one_off_says_what_the_header_stores_and_what_its_bytes_sum_to():
    """A header checksum one off names the value stored (decimal, octal and the field's bytes) and the sum the
    header's bytes give, the value it should be, at the header's byte."""
    bad = _resealed(_block(b"a.txt", 0), 0, b"a.txt", checksum=1)
    stored = int(bad[148:154], 8)
    message = _refused(_GOOD + bad)
    assert f"corrupt tar at byte {len(_GOOD)}: the header checksum does not match: " in message
    assert f"the header stores {stored} (octal {stored:06o}, the field {bad[148:156]!r})" in message
    assert f"its bytes sum to {stored - 1} (octal {stored - 1:06o}" in message


def test_a_size_field_that_is_not_octal_shows_its_bytes_and_the_spelling_expected():
    """A size field with an 8 in it shows the field's bytes, escaped, and says a size is octal digits."""
    message = _refused(_GOOD + _resealed(_block(b"a.txt", 0), 124, b"00000000008\0"))
    assert f"corrupt tar at byte {len(_GOOD)}: the size field b'00000000008\\x00' is not an octal number" in message
    assert "expected octal digits ended by a NUL or a space" in message


_HOSTILE = b"\x1b[2J\x1b]0;owned\x07\r\n\x08\x7f\x9b\x00" * 100
HOSTILE_FIELDS = {
    # the checksum field, and a name of control bytes (which the error does not show: the header is damaged)
    "checksum": (_GOOD + _block(_HOSTILE, 0)[:148] + _HOSTILE[:8] + _block(_HOSTILE, 0)[156:], repr(_HOSTILE[:8])),
    "size": (_GOOD + _resealed(_block(_HOSTILE, 0), 124, _HOSTILE[:12]), repr(_HOSTILE[:12])),
    # a GNU long name of 64 KiB of control bytes, naming a member the stream ends inside
    "long name": (
        _GOOD + _entry(b"././@LongLink", _HOSTILE.replace(b"\0", b"") * 50 + b"\0", b"L") + _block(b"a", 1 << 20),
        r"'\x1b[2J\x1b]0;owned\x07\r\n\x08\x7f\udc9b\x1b[2J",
    ),
}


@pytest.mark.parametrize("field", list(HOSTILE_FIELDS))
def test_a_field_of_control_bytes_is_shown_escaped_and_cut(field):
    """A header whose field is full of terminal control bytes (escapes, a bell, CR/LF, DEL, C1): the error shows
    them escaped, never raw, and a bounded part of them, whatever their length."""
    data, shown = HOSTILE_FIELDS[field]
    message = _refused(data)
    assert message.isprintable() and "\x1b" not in message and "\r" not in message and "\n" not in message
    assert shown in message
    assert len(message) < 1600  # 64 KiB of name or not: at most a few hundred characters of it
