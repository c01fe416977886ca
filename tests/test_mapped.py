"""Issue 44: plain local shards read through a memory mapping, and ``zero_copy=True`` views.

The mapped reader must behave exactly as the streamed one (the same samples, the same errors naming the same
offsets), so most tests here are differential: one shard, read both ways."""

from __future__ import annotations

import gc
import io
import json
import pickle
import tarfile

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud.errors import CorruptShardError
from wds_cloud.io.open import gopen
from wds_cloud.tar.members import TarMembers
from wds_cloud.tariterators import shard_samples

from .strategies import FORMATS, sample_lists, write_tar


@pytest.fixture(autouse=True)
def tables_kept_at_once(monkeypatch):
    """Files written by a test are seconds old: here their tables are kept at once (the rule that keeps none for
    a file changed in the last seconds has tests of its own, which put it back)."""
    from wds_cloud.tar import table

    monkeypatch.setattr(table, "SETTLED", -1.0)


def _read(stream, url, chunk, views=False, max_sample=None):
    """(samples as plain dicts of bytes, the error's text and offset or None, whether it was mapped)."""
    members = TarMembers(stream, url, chunk=chunk, views=views)
    out, error = [], None
    try:
        members.begin()
        for sample in shard_samples(url, stream, members=members, max_sample=max_sample):
            out.append({k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()})
    except CorruptShardError as exc:
        error = (str(exc), exc.offset)
    finally:
        mapped = members.mapped
        members.close()
    return out, error, mapped


def _both(tmp_path, data, chunk=4096, **kw):
    path = tmp_path / "s.tar"
    path.write_bytes(data)
    url = str(path)
    streamed = _read(io.BytesIO(data), url, chunk, **kw)
    mapped = _read(gopen(url), url, chunk, **kw)
    return streamed, mapped


@settings(max_examples=60, deadline=None)
@given(
    items=sample_lists(max_size=12),
    fmt=st.sampled_from(sorted(FORMATS)),
    cut=st.one_of(st.none(), st.floats(0, 1)),
    flip=st.one_of(st.none(), st.tuples(st.floats(0, 1), st.integers(1, 255))),
    views=st.booleans(),
)
def test_a_mapped_shard_reads_exactly_as_a_streamed_one(tmp_path_factory, items, fmt, cut, flip, views):
    """Any shard (every tar format, long names, PAX records, links and directories mixed in), cut anywhere or
    with a byte changed anywhere: the same samples and the same error, at the same offset, mapped or streamed;
    windows of 4 KiB make members cross them."""
    data = bytearray(write_tar(items, fmt))
    if flip is not None:
        at = int(flip[0] * (len(data) - 1))
        data[at] ^= flip[1]
    if cut is not None:
        data = data[: int(len(data) * cut)]
    tmp_path = tmp_path_factory.mktemp("m")
    (samples, error, was_mapped), (samples2, error2, mapped) = _both(tmp_path, bytes(data), views=views)
    assert not was_mapped
    assert mapped == bool(data)  # an empty file is read as a stream (nothing to map)
    assert samples2 == samples
    assert error2 == error


@pytest.mark.parametrize("size", [0, 1, 511, 512, 4095, 4096, 4097, 3 << 20])
def test_members_of_every_size_and_a_sample_limit(tmp_path, size):
    """Members smaller and larger than a window (and than the reader's chunk); the sample limit is enforced on
    a mapped shard as on a streamed one (members sharing one key)."""
    items = [("a", {"bin": b"x" * size, "txt": b"t"}), ("b", {"bin": bytes(range(256)) * 3})]
    (samples, error, _), (samples2, error2, mapped) = _both(tmp_path, write_tar(items, extras=False))
    assert mapped and error is None and samples2 == samples and len(samples) == 2
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(200):
            info = tarfile.TarInfo(f"k.f{i}")
            info.size = 1000
            tar.addfile(info, io.BytesIO(b"y" * 1000))
    (s1, e1, _), (s2, e2, mapped) = _both(tmp_path, raw.getvalue(), max_sample=50_000)
    assert mapped and e1 is not None and e2 is not None and "grows past the limit" in e1[0]
    # where the limit is noticed (checked once per window or chunk read, not per member) may differ
    # the same message whichever path noticed it (the 44 adversary found the byte it named differed by mode)
    assert e2 == e1 and "runs on past byte 50000" in e1[0]


def _settled(path) -> None:
    """Made an hour ago: a file modified in the last seconds keeps no member table (see wds_cloud.tar.table)."""
    import os
    import time

    old = time.time() - 3600
    os.utime(path, (old, old))


def _plain_tar(members, fmt=tarfile.USTAR_FORMAT) -> tuple[bytes, list]:
    """A tar of ``members``: ``(name, size)`` for a file of ``size`` bytes (each byte the member's number), or a
    name ending in ``/`` for a folder; with the offset of each member's header."""
    raw = io.BytesIO()
    heads = []
    with tarfile.open(fileobj=raw, mode="w", format=fmt) as tar:
        for i, member in enumerate(members):
            heads.append(raw.tell())
            if isinstance(member, str):
                folder = tarfile.TarInfo(member.rstrip("/"))
                folder.type = tarfile.DIRTYPE
                tar.addfile(folder)
                continue
            name, size = member
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes([i % 251]) * size))
    return raw.getvalue(), heads


def _settled_file(factory, data: bytes, folder: str) -> str:
    """``data`` saved as a settled file (see _settled) in a new folder: its path."""
    path = factory.mktemp(folder) / "s.tar"
    path.write_bytes(data)
    _settled(path)
    return str(path)


def _shards(tmp_path, n=3, per=40, size=3000):
    urls = []
    for s in range(n):
        path = tmp_path / f"d-{s}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(per):
                sink.write({"__key__": f"{s}-{i:04d}", "bin": bytes([i % 251]) * size, "json": {"i": i}})
        _settled(path)
        urls.append(str(path))
    return urls


def test_dataset_reads_local_shards_mapped_and_the_same_as_streamed(tmp_path, monkeypatch):
    urls = _shards(tmp_path)
    mapped = list(wds.WebDataset(urls, shardshuffle=False))
    monkeypatch.setenv("WDS_MMAP", "0")
    streamed = list(wds.WebDataset(urls, shardshuffle=False))
    assert mapped == streamed and len(mapped) == 120
    assert all(type(s["bin"]) is bytes for s in mapped)


def test_a_manifest_checked_compressed_or_ranged_read_is_streamed(tmp_path):
    """Only a whole local plain tar is mapped: a stream wrapped to be checked while read, a compressed shard,
    and a byte range keep the streaming path."""
    import gzip

    from wds_cloud.io.integrity import Hashing

    (url,) = _shards(tmp_path, n=1)
    members = TarMembers(Hashing(gopen(url)), url)
    members.begin()
    assert not members.mapped
    members.close()
    gz = tmp_path / "c.tar.gz"
    with open(url, "rb") as f:
        gz.write_bytes(gzip.compress(f.read()))
    members = TarMembers(gopen(str(gz)), str(gz))
    members.begin()
    assert not members.mapped and members.compression == "gzip"
    assert sum(1 for _ in members) == 80
    members.close()
    members = TarMembers(gopen(url), url, ranged=True)
    members.begin()
    assert not members.mapped
    members.close()


def test_zero_copy_views_outlive_their_shard(tmp_path):
    """zero_copy=True: read-only memoryviews, valid after their shard (and the dataset) is finished, with no
    BufferError; bytes(view) is the member."""
    urls = _shards(tmp_path)
    views = list(wds.WebDataset(urls, shardshuffle=False, zero_copy=True))
    plain = list(wds.WebDataset(urls, shardshuffle=False))
    gc.collect()
    assert len(views) == len(plain) == 120
    for v, p in zip(views, plain):
        assert type(v["bin"]) is memoryview and v["bin"].readonly
        assert bytes(v["bin"]) == p["bin"] and json.loads(bytes(v["json"])) == json.loads(p["json"])
    with pytest.raises(TypeError):
        v["bin"][0] = 1  # read-only
    with pytest.raises(TypeError):
        pickle.dumps(v["bin"])  # what the docs say: bytes(view) before pickling


def test_zero_copy_streamed_shards_give_views_too(tmp_path, monkeypatch):
    """The type does not depend on where a shard is: a streamed (or compressed) shard gives views as well."""
    monkeypatch.setenv("WDS_MMAP", "0")
    urls = _shards(tmp_path, n=1)
    (first,) = list(wds.WebDataset(urls, shardshuffle=False, zero_copy=True))[:1]
    assert type(first["bin"]) is memoryview and first["bin"].readonly


def test_zero_copy_decodes_as_bytes(tmp_path):
    urls = _shards(tmp_path, n=1)
    sample = next(iter(wds.WebDataset(urls, shardshuffle=False, zero_copy=True).decode()))
    assert sample["json"] == {"i": 0}


def test_zero_copy_refused_unless_a_flag(tmp_path):
    urls = _shards(tmp_path, n=1)
    with pytest.raises(wds.ConfigError, match="zero_copy"):
        wds.WebDataset(urls, zero_copy="yes")


def test_zero_copy_resume_is_exact(tmp_path):
    """A state taken mid-shard with zero_copy=True (buffered samples in a shuffle) resumes to the same samples."""
    urls = _shards(tmp_path)

    def make():
        return wds.WebDataset(urls, shardshuffle=False, zero_copy=True, seed=3).shuffle(20, seed=5)

    full = [s["__key__"] for s in make()]
    ds = make()
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(50)]
    state = ds.state_dict()
    again = make()
    again.load_state_dict(state)
    rest = [s for s in again]
    assert head + [s["__key__"] for s in rest] == full
    assert all(type(s["bin"]) is memoryview for s in rest)


def test_zero_copy_batches_cross_webloader_workers_in_shared_memory(tmp_path):
    """Through WebLoader workers a batch of views travels as any batch of bytes does: as a list of bytes (their
    buffers through shared memory, whatever their size), or packed where pack_bytes=True (the new user found small
    batches of views, always packed, twice as slow as bytes); single samples as bytes; what arrives is the members'
    bytes."""
    pytest.importorskip("torch")
    from wds_cloud.transport import PackedBytes

    for size, pack, packed in ((100, None, False), (100, True, True), (300_000, None, False), (300_000, True, True)):
        (tmp_path / f"{size}{pack}").mkdir()
        urls = _shards(tmp_path / f"{size}{pack}", n=2, per=12, size=size)
        expected = {s["__key__"]: s["bin"] for s in wds.WebDataset(urls, shardshuffle=False)}
        ds = wds.WebDataset(urls, shardshuffle=False, zero_copy=True).to_tuple("__key__", "bin").batched(4)
        got = {}
        for keys, column in wds.WebLoader(ds, batch_size=None, num_workers=2, pack_bytes=pack):
            assert isinstance(column, PackedBytes) if packed else type(column) is list and type(column[0]) is bytes
            got.update(zip(keys, column))
        assert got == expected
    single = wds.WebDataset(urls, shardshuffle=False, zero_copy=True)
    samples = list(wds.WebLoader(single, batch_size=None, num_workers=2))
    assert {s["__key__"]: s["bin"] for s in samples} == expected
    assert all(type(s["bin"]) is bytes for s in samples)


def test_pack_batch_takes_views_and_single_views():
    pytest.importorskip("torch")
    from wds_cloud.transport import PackedBytes, pack_batch

    data = memoryview(b"abcdefgh").toreadonly()
    packed = pack_batch(([data[:3]], [b"x", b"y"]))
    assert isinstance(packed[0], PackedBytes) and list(packed[0]) == [b"abc"]
    assert isinstance(packed[1], PackedBytes)
    small = pack_batch(([data[:3]], [b"x", b"y"]), min_bytes=1 << 20)  # below the threshold: bytes, a list
    assert small == ([b"abc"], [b"x", b"y"]) and type(small[0][0]) is bytes
    assert pack_batch({"a": data[2:4], "n": 1}) == {"a": b"cd", "n": 1}


@pytest.fixture
def no_tables():
    from wds_cloud.tar import table

    table.forget()
    yield table
    table.forget()


def _twice(url, chunk=4096, views=False):
    """Two passes over a mapped shard (the second from the table the first kept), as plain dicts, with whether the
    second had a table."""
    out = []
    for _ in range(2):
        stream = gopen(url)
        members = TarMembers(stream, url, chunk=chunk, views=views)
        members.begin()
        had = members.table is not None
        samples = [
            {k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()}
            for s in shard_samples(url, stream, members=members)
        ]
        members.close()
        out.append((samples, had))
    return out


@settings(max_examples=50, deadline=None)
@given(items=sample_lists(max_size=12), fmt=st.sampled_from(sorted(FORMATS)), views=st.booleans())
def test_a_second_pass_reads_from_the_member_table_exactly(tmp_path_factory, items, fmt, views):
    """Any shard (long names, PAX records, links and directories: the members the table does not hold are read
    from the shard): the second pass takes its members from the table the first kept, with the same samples."""
    from wds_cloud.tar import table

    table.forget()
    path = tmp_path_factory.mktemp("t") / "s.tar"
    data = write_tar(items, fmt)
    path.write_bytes(data)
    _settled(path)
    (first, had_first), (second, had_second) = _twice(str(path), views=views)
    expected, error, _ = _read(io.BytesIO(data), str(path), 4096)
    assert error is None and first == expected and second == expected
    assert not had_first  # (the second has one unless every member needed the general reader)


def test_a_table_is_never_used_for_another_version_of_the_file(tmp_path, no_tables):
    """Replaced (a new inode), rewritten in place (new times), or rewritten in place within the same clock tick (the
    times the same, faked here): the samples are always the file's own."""
    import os

    path = tmp_path / "s.tar"
    a = write_tar([("a", {"txt": b"1" * 700}), ("b", {"txt": b"2"})], extras=False)
    b = write_tar([("c", {"txt": b"3"}), ("d", {"txt": b"4" * 700})], extras=False)
    assert len(a) == len(b)
    path.write_bytes(a)
    _settled(path)
    assert _twice(str(path))[1][1]
    tmp = tmp_path / "new.tar"
    tmp.write_bytes(b)
    os.replace(tmp, path)
    (samples, had), _ = _twice(str(path))
    assert not had and [s["__key__"] for s in samples] == ["c", "d"]
    st_before = os.stat(path)
    with open(path, "r+b") as f:
        f.write(a)
    os.utime(path, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))  # same modification time
    (samples, had), _ = _twice(str(path))
    assert [s["__key__"] for s in samples] == ["a", "b"]


def test_the_tables_stay_within_their_bound(tmp_path, no_tables, monkeypatch):
    urls = _shards(tmp_path, n=4, per=50, size=10)
    monkeypatch.setenv("WDS_TABLE_CACHE", "0")
    list(wds.WebDataset(urls, shardshuffle=False))
    assert not no_tables.CACHE.tables
    monkeypatch.setenv("WDS_TABLE_CACHE", "6000")
    list(wds.WebDataset(urls, shardshuffle=False))
    assert 0 < no_tables.CACHE.nbytes <= 6000 and len(no_tables.CACHE.tables) < 4
    monkeypatch.setenv("WDS_TABLE_CACHE", "1e999")
    with pytest.raises(wds.ConfigError, match="WDS_TABLE_CACHE"):
        list(wds.WebDataset(urls, shardshuffle=False))


def test_resume_is_exact_in_a_pass_read_from_the_tables(tmp_path, no_tables):
    urls = _shards(tmp_path)

    def make():
        return wds.WebDataset(urls, shardshuffle=False, seed=3).shuffle(20, seed=5)

    full = [s["__key__"] for s in make()]  # this pass keeps the tables
    assert len(no_tables.CACHE.tables) == 3
    for at in (1, 39, 40, 77):
        ds = make()
        it = iter(ds)
        head = [next(it)["__key__"] for _ in range(at)]
        state = ds.state_dict()
        again = make()
        again.load_state_dict(state)
        assert head + [s["__key__"] for s in again] == full


def test_a_table_that_does_not_match_its_file_is_dropped(tmp_path, no_tables):
    """The guard for a file rewritten in place within its clock's tick (device, inode, size and times all the same,
    forged here): each run's first header is checked against the table, a mismatch drops the table, and the
    samples are the file's own."""
    import os

    a_path, b_path = tmp_path / "a.tar", tmp_path / "b.tar"
    a_path.write_bytes(write_tar([("a", {"txt": b"1" * 700}), ("b", {"txt": b"2"})], extras=False))
    _settled(a_path)
    b_path.write_bytes(write_tar([("c", {"txt": b"3"}), ("d", {"txt": b"4" * 700})], extras=False))
    _twice(str(a_path))
    ((identity, table),) = no_tables.CACHE.tables.items()
    st = os.stat(b_path)
    no_tables.CACHE.tables[(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)] = table
    (samples, had), _ = _twice(str(b_path))
    assert had and [s["__key__"] for s in samples] == ["c", "d"]


def test_webloader_workers_hand_their_tables_to_the_main_process(tmp_path, no_tables):
    """The tables DataLoader workers keep go to the main process as each ends its pass, so the next epoch's
    workers (forked again) start with them; the samples are the same."""
    pytest.importorskip("torch")
    urls = _shards(tmp_path, n=4, per=20, size=50)
    ds = wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__", "bin").batched(8)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=2)
    first = sorted(k for keys, _ in loader for k in keys)
    assert len(no_tables.CACHE.tables) == 4  # two from each worker
    second = sorted(k for keys, _ in loader for k in keys)
    assert first == second and len(first) == 80


def test_a_shard_cut_short_in_place_while_read_is_an_error_not_a_crash(tmp_path):
    """Truncated in place between two windows of the read: ObjectChangedError naming the file and the sizes, not
    SIGBUS (a child process, so that a crash would fail the test rather than end the run)."""
    import subprocess
    import sys

    path = tmp_path / "s.tar"
    path.write_bytes(write_tar([(f"k{i}", {"bin": bytes([i]) * 3000}) for i in range(40)], extras=False))
    child = f"""
import os
from wds_cloud.errors import ObjectChangedError
from wds_cloud.io.open import gopen
from wds_cloud.tar.members import TarMembers
path = {str(path)!r}
members = TarMembers(gopen(path), path, chunk=4096)
members.begin()
assert members.mapped
try:
    for i, (name, data) in enumerate(members):
        if i == 2:
            os.truncate(path, os.path.getsize(path) // 2)
except ObjectChangedError as exc:
    print("refused:", exc)
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "cut short while it was read" in done.stdout and "s.tar" in done.stdout


@pytest.mark.parametrize("claimed", [20_000, 3 << 20, 1_121_644_593])
def test_a_member_claiming_more_than_the_file_holds_is_reported_as_the_stream_reports_it(tmp_path, claimed):
    """Found by bench/fuzz_reader.py: a header claiming more bytes than the file holds (more than a window, or a
    chunk) was reported as "expected a further N bytes, got 0" when mapped; it is the streamed read's message."""
    data = bytearray(write_tar([("a", {"bin": b"x" * 2000}), ("b", {"txt": b"y"})], extras=False))
    field = b"%011o" % claimed
    data[124:135] = field
    data[148:156] = b" " * 8
    data[148:156] = b"%06o\0 " % sum(data[:512])
    (samples, error, _), (samples2, error2, mapped) = _both(tmp_path, bytes(data))
    assert mapped and error is not None and error2 == error and "expected" in error[0]


def test_the_documented_packing_collate_takes_views_through_torchs_own_loader(tmp_path):
    """reading.md's way for torch's own DataLoader (a new user found `wds.transport` missing after a plain
    `import wds_cloud as wds`): views packed, bytes out, nothing read as numbers."""
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    done = subprocess.run([sys.executable, "-c", "import wds_cloud as wds; wds.transport.PackingCollate"], timeout=120)
    assert done.returncode == 0
    urls = _shards(tmp_path, n=2, per=10, size=30)
    expected = {s["__key__"]: s["bin"] for s in wds.WebDataset(urls, shardshuffle=False)}
    ds = wds.WebDataset(urls, shardshuffle=False, zero_copy=True).to_tuple("__key__", "bin").batched(4)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, collate_fn=wds.transport.PackingCollate())
    got = {k: v for keys, column in loader for k, v in zip(keys, column)}
    assert got == expected


def test_views_through_webloader_workers_with_packing_off_arrive_as_bytes(tmp_path):
    """A new user's finding: WebLoader(pack_bytes=False) over zero_copy=True hung for ever (the workers could not
    pickle the views; torch's loader waited).  Views now cross as bytes; run in a child with a timeout."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    urls = _shards(tmp_path, n=2, per=10, size=30)
    child = f"""
import wds_cloud as wds
urls = {urls!r}
ds = wds.WebDataset(urls, shardshuffle=False, zero_copy=True).to_tuple("__key__", "bin").batched(4)
got = {{k: v for keys, col in wds.WebLoader(ds, batch_size=None, num_workers=2, pack_bytes=False) for k, v in zip(keys, col)}}
assert len(got) == 20 and all(type(v) is bytes for v in got.values()), got
own = wds.DataPipeline(lambda: iter(list(wds.WebDataset(urls, shardshuffle=False, zero_copy=True))))
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_a_file_written_in_the_last_seconds_keeps_no_table(tmp_path, no_tables):
    """The states adversary's finding (issue 44): on a file system whose clock ticks once a second, a rewrite in
    place of the same size within the tick of the write leaves the file's identity as it was, and a table kept of
    the first version gave the second's samples the first's keys.  A file modified in the last seconds keeps none."""
    no_tables.SETTLED = 5.0
    path = tmp_path / "s.tar"
    path.write_bytes(write_tar([("a", {"txt": b"1" * 700}), ("b", {"txt": b"2"})], extras=False))
    (_, had), (_, had_again) = _twice(str(path))
    assert not had and not had_again and not no_tables.CACHE.tables
    no_tables.SETTLED = -1.0  # the rule alone kept it from being kept
    assert _twice(str(path))[1][1]


def test_the_table_time_rule_reads_the_change_time_and_an_empty_mmap_setting_is_the_default(tmp_path, no_tables):
    """The 44 adversary's findings: a file written in place with its modification time set back (``cp -p``,
    ``touch -d``) kept a table at once (only the modification time was read); WDS_MMAP="" turned mapping off (an
    empty value is the default for every variable)."""
    import os

    no_tables.SETTLED = 5.0
    path = tmp_path / "s.tar"
    path.write_bytes(write_tar([("a", {"txt": b"1" * 700}), ("b", {"txt": b"2"})], extras=False))
    _settled(path)  # modification time an hour ago; the change time is now
    st = os.stat(path)
    if st.st_ctime_ns <= st.st_mtime_ns:  # a file system whose change time follows the modification time
        pytest.skip("ctime follows mtime here")
    (_, had), (_, had_again) = _twice(str(path))
    assert not had and not had_again and not no_tables.CACHE.tables
    os.environ["WDS_MMAP"] = ""
    try:
        members = TarMembers(gopen(str(path)), str(path))
        members.begin()
        assert members.mapped
        members.close()
    finally:
        del os.environ["WDS_MMAP"]


# any member names: upper-case fields, names without a key, metadata names, slashes, dots after slashes, a field
# repeated in its sample, keys that come back after another
def _names_from(stems, tails):
    return st.lists(st.tuples(st.sampled_from(stems), st.sampled_from(tails), st.integers(0, 1500)), max_size=14)


# half of them names the table can split (it splits a table's names only when it can split every one)
_member_names = st.one_of(
    _names_from(["a", "b", "B", "d/x", "d.e/y", "k"], [".txt", ".jpg", ".seg.png", ".7"]),
    _names_from(
        ["a", "b", "B", "d/x", "d.e/y", "__m", "k"], [".txt", ".TXT", ".Jpg", ".seg.png", "", ".", "/.hid", "__"]
    ),
)


def _where_read(stream, url, chunk, select, on_repeat):
    """(each sample with the cursor's (start, end, count, next name) as it is yielded, the error or None)."""
    from wds_cloud.tar.grouping import member_filter

    members = TarMembers(stream, url, chunk=chunk, select=member_filter(*select) if select else None)
    where = [0, 0, 0, None]
    out, error = [], None
    try:
        members.begin()
        for sample in shard_samples(url, stream, members=members, where=where, on_repeat=on_repeat):
            out.append((sample, tuple(where)))
    except (CorruptShardError, ValueError) as exc:
        error = str(exc)
    finally:
        members.close()
    return out, error


@settings(max_examples=150, deadline=None)
@given(
    names=_member_names,
    select=st.sampled_from([None, ("__[^/]*__", None, None), (None, None, None), ("xx", None, None)]),
    skip=st.booleans(),
    chunk=st.sampled_from([1024, 4096, 1 << 20]),
)
def test_a_pass_from_a_kept_table_keeps_every_offset_name_and_error(tmp_path_factory, names, select, skip, chunk):
    """Passes over an unchanged shard (the first keeps its table, the later ones read keys and fields from it)
    give the streamed read's samples, the same cursor (start, end, count and the next sample's first name) at each
    sample, and the same errors, whatever the names (those the table cannot split go through the names)."""
    from wds_cloud.tar import table

    table.forget()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for stem, tail, size in names:
            info = tarfile.TarInfo(stem + tail)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes([size % 251]) * size))
    data = raw.getvalue()
    path = tmp_path_factory.mktemp("k") / "s.tar"
    path.write_bytes(data)
    _settled(path)
    url = str(path)
    on_repeat = (lambda exn: True) if skip else None
    expected = _where_read(io.BytesIO(data), url, chunk, select, on_repeat)
    for _ in range(3):
        assert _where_read(gopen(url), url, chunk, select, on_repeat) == expected


def test_a_kept_table_splits_its_names_once_and_counts_that_in_its_bound(tmp_path, no_tables, monkeypatch):
    """The keys and fields a table keeps for the default rule are split once, when the table is kept, and counted
    in WDS_TABLE_CACHE; with no room for them, a pass reads the names as before (the same samples)."""
    urls = _shards(tmp_path, n=2, per=30, size=10)
    first = list(wds.WebDataset(urls, shardshuffle=False))
    tables = list(no_tables.CACHE.tables.values())
    assert len(tables) == 2 and all(t._keyed for t in tables)
    assert no_tables.CACHE.nbytes == sum(t.nbytes for t in tables)
    bare = sum(pickle.loads(pickle.dumps(t)).nbytes for t in tables)  # the tables without their keyed parts
    assert bare < no_tables.CACHE.nbytes
    assert list(wds.WebDataset(urls, shardshuffle=False)) == first
    no_tables.forget()
    monkeypatch.setenv("WDS_TABLE_CACHE", str(bare + 100))  # room for the tables, not for their keyed parts
    assert list(wds.WebDataset(urls, shardshuffle=False)) == first
    assert len(no_tables.CACHE.tables) == 2 and not any(t._keyed for t in no_tables.CACHE.tables.values())
    assert list(wds.WebDataset(urls, shardshuffle=False)) == first
    moved = pickle.loads(pickle.dumps(tables[0]))  # a worker hands its tables over without the keyed part
    assert moved._keyed is None and moved.nbytes < tables[0].nbytes and len(moved) == len(tables[0])


def test_a_table_without_room_for_its_split_names_is_asked_once_a_pass(tmp_path, no_tables, monkeypatch):
    """The 44 adversary's finding: a table that fits the bound while its split names do not was asked for them
    (and split all its names) once per run: a pass over it cost quadratic time in its members."""
    from wds_cloud.tar.table import MemberTable

    urls = _shards(tmp_path, n=1, per=400, size=1)
    list(wds.WebDataset(urls, shardshuffle=False))
    (table,) = no_tables.CACHE.tables.values()
    bare = pickle.loads(pickle.dumps(table)).nbytes
    no_tables.forget()
    monkeypatch.setenv("WDS_TABLE_CACHE", str(bare + 100))
    expected = list(wds.WebDataset(urls, shardshuffle=False))  # keeps the table, without its split names
    asked = []
    keyed = MemberTable.keyed

    def counting(self):
        asked.append(1)
        return keyed(self)

    monkeypatch.setattr(MemberTable, "keyed", counting)
    stream = gopen(urls[0])
    members = TarMembers(stream, urls[0], chunk=1024)  # a run per KiB: hundreds of runs
    members.begin()
    assert members.table is not None
    got = list(shard_samples(urls[0], stream, members=members))
    members.close()
    assert len(asked) == 1 and len(got) == len(expected) == 400


def test_no_shard_stays_mapped_after_its_pass_or_an_abandoned_iterator(tmp_path):
    """The second 44 new user: after an epoch the last shard stayed mapped (and open) until the dataset was
    deleted, and the current one after an iterator was dropped."""
    import os

    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc")
    urls = _shards(tmp_path, n=2, per=5, size=10)

    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if str(tmp_path) in line)

    ds = wds.WebDataset(urls, shardshuffle=False)
    assert len(list(ds)) == 10 and mapped() == 0
    it = iter(ds)
    next(it)
    assert mapped() == 1
    del it
    gc.collect()
    assert mapped() == 0
    views = list(wds.WebDataset(urls, shardshuffle=False, zero_copy=True))
    assert mapped() == 2  # views keep their shards' mappings while they live
    del views
    gc.collect()
    assert mapped() == 0


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9000), min_size=1, max_size=40),
    chunk=st.sampled_from([1024, 4096, 8192]),
    views=st.booleans(),
)
def test_a_first_pass_records_every_plain_member_and_maps_each_page_once(tmp_path_factory, sizes, chunk, views):
    """Plain members of any size, across window ends or larger than a window: the table the first pass keeps
    holds every member (a member running past a window's end starts the next window; it was read by the general
    reader and left out of the table, which sent every later pass to the general reader once a window), and no
    page of the shard is asked to be mapped twice in a pass (each window maps what the one before did not)."""
    import wds_cloud.tar.buffers as reader_module
    from wds_cloud.tar import table

    table.forget()
    path = _settled_file(tmp_path_factory, _plain_tar([(f"{i:05d}.bin", size) for i, size in enumerate(sizes)])[0], "w")
    asked: list = []
    real = reader_module.populate
    reader_module.populate = lambda mapping, start, end: (asked.append((start, end)), real(mapping, start, end))
    try:
        (first, _), (second, had) = _twice(path, chunk=chunk, views=views)
    finally:
        reader_module.populate = real
    assert first == second and [int(s["__key__"]) for s in first] == list(range(len(sizes)))
    fits = [size for size in sizes if 512 + (size + 511) // 512 * 512 <= chunk]
    assert had == bool(fits)
    if fits:  # a member larger than a window is read by the general reader, in every pass
        kept = next(iter(table.CACHE.tables.values()))
        assert list(kept.sizes) == fits
        kinds = "".join("f" if size in fits else "L" for size in sizes).strip("L")
        assert len(kept.gaps) == len([run for run in kinds.split("f") if run])  # only where a large one lies
    for one_pass in (asked[: len(asked) // 2], asked[len(asked) // 2 :]):
        ends = sorted(one_pass)
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no range asked twice


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 511, 512, 513, 1000, 1536, 3000, 5000]), min_size=2, max_size=12),
    bad=st.integers(0, 11),
    tail=st.sampled_from([b"77", b"7\0", b" 7", b"\0\0", b"  ", b"7 "]),
    chunk=st.sampled_from([1024, 2048, 4096, 1 << 20]),
)
def test_a_checksum_field_with_more_than_six_digits_reads_alike_mapped_and_streamed(
    tmp_path_factory, sizes, bad, tail, chunk
):
    """The header checksum is read up to its first NUL, as tarfile reads it, by every path: digits where the NUL
    and the space usually stand were ignored by the fast path and counted by the general reader, so a read
    refused or took the header by where a window or a read ended (adversary finding)."""
    written, heads = _plain_tar([(f"k{i}.bin", size) for i, size in enumerate(sizes)])
    data = bytearray(written)
    head = heads[bad % len(sizes)]
    data[head + 154 : head + 156] = tail
    (s1, e1, _), (s2, e2, mapped) = _both(tmp_path_factory.mktemp("c"), bytes(data), chunk=chunk)
    assert mapped and (s2, e2) == (s1, e1)


@settings(max_examples=80, deadline=None)
@given(
    samples=st.lists(
        st.lists(st.sampled_from([0, 1, 511, 513, 1500, 3000, 6000]), min_size=1, max_size=4), min_size=1, max_size=8
    ),
    keyless=st.sets(st.integers(0, 40), max_size=3),
    dirs=st.sets(st.integers(0, 40), max_size=4),
    limit=st.sampled_from([1000, 3000, 5000, 9000, 20000]),
    chunk=st.sampled_from([1024, 3000, 4096, 1 << 20]),
    views=st.booleans(),
)
# a sample begun by the general reader (members larger than a window) going on in a table run
@example(samples=[[0, 6000], [6000, 6000, 0]], keyless=set(), dirs=set(), limit=20000, chunk=1024, views=False)
def test_the_sample_limit_refuses_the_same_sample_in_every_read(
    tmp_path_factory, samples, keyless, dirs, limit, chunk, views
):
    """The sample limit is checked at every member a sample takes (and at every keyless member within it): a
    streamed read, a mapped one and the passes from its member table deliver the same samples and refuse the
    same one with the same message. It was checked only each window or chunk, so how many samples over the
    limit came first depended on where those fell (adversary finding: 9 oversized samples mapped, 0 streamed)."""
    from wds_cloud.tar import table

    table.forget()
    members: list = []
    for s, sizes in enumerate(samples):
        for f, size in enumerate(sizes):
            n = len([m for m in members if not isinstance(m, str)])
            if n in dirs:  # a member the table leaves out: a sample may begin in the general reader and go on
                members.append(f"d{n}/")
            members.append((f".hidden{n}" if n in keyless else f"s{s:03d}.f{f}", size))
    data = _plain_tar(members)[0]
    path = _settled_file(tmp_path_factory, data, "l")
    expected = _read(io.BytesIO(data), path, chunk, views=views, max_sample=limit)[:2]
    for _ in range(3):  # the first pass keeps the table the next two read from
        assert _read(gopen(path), path, chunk, views=views, max_sample=limit)[:2] == expected
    streamed_large_chunk = _read(io.BytesIO(data), path, 1 << 20, views=views, max_sample=limit)[:2]
    assert streamed_large_chunk == expected


@pytest.mark.parametrize("views", [False, True])
def test_members_the_filter_drops_never_count_against_the_sample_before_them(tmp_path_factory, views):
    """A 100-byte sample followed by 1.3 MB of metadata members (which the default filter drops) and then the next
    sample: no read refuses it under a 200 kB sample limit (a pass from the member table, or with views, moved
    the reader's offset to the last member of a run before the filter dropped it; adversary finding)."""
    from wds_cloud.tar import table
    from wds_cloud.tar.grouping import SKIP_META, member_filter

    table.forget()
    members = [("a.txt", 100)] + [(f"__pad{i}__", 10_000) for i in range(130)] + [("b.txt", 100)]
    data = _plain_tar(members)[0]
    path = _settled_file(tmp_path_factory, data, "m")

    def read(stream):
        got = []
        reader = TarMembers(stream, path, views=views, select=member_filter(SKIP_META, None, None))
        try:
            reader.begin()
            for sample in shard_samples(path, stream, members=reader, max_sample=200_000):
                got.append(sample["__key__"])
        finally:
            reader.close()
        return got

    assert read(io.BytesIO(data)) == ["a", "b"]
    for _ in range(3):
        assert read(gopen(path)) == ["a", "b"]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 511, 513, 1500, 3000]), min_size=2, max_size=10),
    bad=st.integers(0, 9),
    last=st.sampled_from([0, 1, 9, 10, 0x1C, 0x1F, 32, 0x37]),
    chunk=st.sampled_from([1024, 2048, 4096, 1 << 20]),
)
def test_a_size_field_with_any_last_byte_reads_alike_mapped_and_streamed(tmp_path_factory, sizes, bad, last, chunk):
    """The fast path took the size's first eleven digits whenever its last byte was at most a space; the general
    reader refused a control byte there: which a header got depended on where a window or read ended
    (adversary finding). The checksum is made right for the changed field."""
    written, heads = _plain_tar([(f"k{i}.bin", size) for i, size in enumerate(sizes)])
    data = bytearray(written)
    head = heads[bad % len(sizes)]
    data[head + 135] = last
    data[head + 148 : head + 156] = b" " * 8
    data[head + 148 : head + 156] = b"%06o\0 " % sum(data[head : head + 512])
    (s1, e1, _), (s2, e2, mapped) = _both(tmp_path_factory.mktemp("z"), bytes(data), chunk=chunk)
    assert mapped and (s2, e2) == (s1, e1)


@pytest.mark.parametrize(
    "field",
    [b"0000001\0", b"000012\0 ", b" 12345 ", b"0001234\x1c", b"\x1c00012 \0", b"\x80\0\0\0\0\0\x01\0", b"\xff" * 8]
    + [b"\x81\0\0\0\0\0\x01\0", b"00012\x01\0\0", b"\0" * 8, b"1_2\0    ", b"+12\0    "],
)
def test_a_numeric_header_field_is_read_as_tarfile_reads_it(field):
    """Base-256 only with the lead bytes tarfile takes (0x80, 0xff), and the white space str.strip removes
    (\\x1c-\\x1f too) around octal digits (adversary finding)."""
    from wds_cloud.tar.format import number as _octal

    try:
        expected = tarfile.nti(field)
    except tarfile.InvalidHeaderError:
        expected = None
    try:
        got = _octal(field)
    except ValueError:
        got = None
    assert got == expected
