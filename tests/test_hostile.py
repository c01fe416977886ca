"""Hostile and broken shards: the reader stays bounded in time and memory and says what is wrong."""

import gzip
import io
import random
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud.errors import CorruptShardError, DecodingError
from wds_cloud.tariterators import group_by_keys, shard_samples, tar_file_expander, url_opener

from .hostile import END, Zeros, bounded, damage, header, insert_pax, member, mutate_header, pax, pax_record, tar_of

GOOD = member("a.txt", b"first") + member("a.cls", b"1")


def read(data: bytes, url: str = "hostile.tar", **kw) -> dict:
    return bounded(lambda: list(shard_samples(url, io.BytesIO(data), **kw)))


def corrupt(data: bytes, **kw) -> CorruptShardError:
    out = read(data, **kw)
    assert isinstance(out.get("error"), CorruptShardError), out
    return out["error"]


# 1. lengths and sizes that would loop forever


@pytest.mark.parametrize(
    "records", [b"0 path=x\n", b"-7 path=x\n", b"99999 path=x\n", b"3 path=x\n", b"x path=y\n", b"9 pathx\n"]
)
def test_malformed_pax_record_lengths_are_corrupt(records):
    """A PAX record whose length is 0, negative, past the header or not a number: an error with the offset."""
    error = corrupt(GOOD + pax(records) + member("b.txt", b"x") + END)
    assert error.offset == len(GOOD) and "PAX" in str(error)


@pytest.mark.parametrize("field", [b"-0000001000\0", b"-1\0\0\0\0\0\0\0\0\0\0", b"\xff" * 12])
def test_negative_size_fields_are_corrupt(field):
    """A size field that parses as a negative number is an error, never a loop."""
    error = corrupt(GOOD + header(b"b.txt", size_field=field) + bytes(512) + END)
    assert error.offset == len(GOOD) and "negative" in str(error)


@pytest.mark.parametrize("value", ["-10", "12abc", "", " 5"])
def test_bad_pax_sizes_are_corrupt(value):
    """A PAX size= that is negative or not a decimal number is CorruptShardError."""
    error = corrupt(GOOD + pax(pax_record("size", value)) + member("b.txt", b"x") + END)
    assert "PAX size" in str(error)


def test_handlers_skip_hostile_shards_and_go_on(tmp_path):
    """With a continuing handler, a hostile shard is skipped and the next one is read."""
    bad = tmp_path / "bad.tar"
    bad.write_bytes(GOOD + pax(b"0 path=x\n") + member("b.txt", b"x") + END)
    good = tmp_path / "good.tar"
    good.write_bytes(member("z.txt", b"ok") + END)
    out = bounded(
        lambda: [
            s["__key__"]
            for s in wds.WebDataset([str(bad), str(good)], shardshuffle=False, handler=wds.ignore_and_continue)
        ]
    )
    assert out["value"] == ["z"]  # "a" was still open (its next member could follow): never half a sample


# 2. allocation by claim


def test_a_claimed_huge_member_allocates_as_the_bytes_arrive():
    """A 2.5 KB shard claiming a 2 GiB member fails at its real end, having allocated little."""
    data = header(b"big.bin", 2 << 30) + bytes(2048)
    out = read(data, members=None)
    assert isinstance(out["error"], CorruptShardError) and "ended inside the member" in str(out["error"])
    assert out["peak"] < 40 << 20


def test_a_member_over_the_limit_is_refused_before_reading():
    """A claim over max_member_size is refused at once, naming the member and the limit."""
    from wds_cloud.tar.members import TarMembers

    data = header(b"big.bin", 64 << 30) + bytes(2048)
    out = bounded(lambda: list(TarMembers(io.BytesIO(data), "x.tar", max_member=1 << 30)))
    error = out["error"]
    assert isinstance(error, CorruptShardError) and "big.bin" in str(error) and str(1 << 30) in str(error)
    assert "WDS_MAX_MEMBER_SIZE" in str(error) and out["peak"] < 8 << 20


def test_webdataset_and_environment_set_the_member_limit(tmp_path, monkeypatch):
    """WebDataset(max_member_size=) and WDS_MAX_MEMBER_SIZE (with units) set the limit."""
    path = tmp_path / "s.tar"
    path.write_bytes(member("a.bin", bytes(3000)) + END)
    with pytest.raises(CorruptShardError, match="limit of 2048 bytes"):
        list(wds.WebDataset(str(path), shardshuffle=False, max_member_size="2KiB"))
    monkeypatch.setenv("WDS_MAX_MEMBER_SIZE", "2KiB")
    with pytest.raises(CorruptShardError, match="limit of 2048 bytes"):
        list(wds.WebDataset(str(path), shardshuffle=False))
    assert len(list(wds.WebDataset(str(path), shardshuffle=False, max_member_size="1MB"))) == 1
    monkeypatch.setenv("WDS_MAX_MEMBER_SIZE", "lots")
    with pytest.raises(ValueError, match="WDS_MAX_MEMBER_SIZE"):
        list(wds.WebDataset(str(path), shardshuffle=False))


def test_a_pax_size_claim_allocates_as_the_bytes_arrive():
    """A PAX size= claiming 2 GiB in a short stream costs little memory before failing."""
    data = pax(pax_record("size", str(2 << 30))) + header(b"big.bin", 10) + bytes(4096)
    out = read(data)
    assert isinstance(out["error"], CorruptShardError) and out["peak"] < 40 << 20


@pytest.mark.parametrize("typeflag", [b"L", b"x", b"g"])
def test_metadata_records_are_capped(typeflag):
    """A GNU long name or PAX header claiming more than MAX_META_SIZE is refused before reading it."""
    data = header(b"././@LongLink", 2 << 30, typeflag=typeflag) + bytes(4096)
    out = read(data)
    assert isinstance(out["error"], CorruptShardError) and "metadata record" in str(out["error"])
    assert out["peak"] < 8 << 20


# 3. decompression bombs


def bomb(size: int, compression: str) -> bytes:
    """A shard holding one member of ``size`` zero bytes, compressed."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("bomb.bin")
        info.size = size
        tar.addfile(info, Zeros(size))
        info = tarfile.TarInfo("bomb.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    data = raw.getvalue()
    if compression == "gz":
        return gzip.compress(data, 1)
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize("compression", ["gz", "zstd"])
def test_a_bomb_over_the_limit_is_refused(compression, monkeypatch):
    """A member inflating past WDS_MAX_MEMBER_SIZE is an error naming it and the limit, with little memory."""
    data = bomb(64 << 20, compression)
    monkeypatch.setenv("WDS_MAX_MEMBER_SIZE", "8MiB")
    out = read(data, url=f"bomb.tar.{compression}")
    assert isinstance(out["error"], CorruptShardError)
    assert "bomb.bin" in str(out["error"]) and str(8 << 20) in str(out["error"])
    assert out["peak"] < 16 << 20


@pytest.mark.parametrize("compression", ["gz", "zstd"])
def test_a_large_compressed_member_costs_its_size_once(compression):
    """A member under the limit is read with memory near its size, not a multiple of it."""
    size = 48 << 20
    out = read(bomb(size, compression), url=f"bomb.tar.{compression}")
    assert "error" not in out and len(out["value"][0]["bin"]) == size
    assert out["peak"] < size * 1.4


def test_a_gzipped_field_is_inflated_up_to_the_limit(tmp_path, monkeypatch):
    """decode() of a .txt.gz field inflating past the limit is a DecodingError naming the field and limit."""
    path = tmp_path / "s.tar"
    path.write_bytes(
        member("a.txt.gz", gzip.compress(bytes(32 << 20))) + member("b.txt.gz", gzip.compress(b"ok")) + END
    )
    monkeypatch.setenv("WDS_MAX_MEMBER_SIZE", "8MiB")
    out = bounded(lambda: list(wds.WebDataset(str(path), shardshuffle=False).decode()))
    error = out["error"]
    assert isinstance(error, DecodingError) and "txt.gz" in str(error) and str(8 << 20) in str(error)
    assert out["peak"] < 24 << 20
    monkeypatch.delenv("WDS_MAX_MEMBER_SIZE")
    samples = list(wds.WebDataset(str(path), shardshuffle=False).decode())
    assert samples[1]["txt.gz"] == "ok" and len(samples[0]["txt.gz"]) == 32 << 20  # the key is kept, as upstream


# 4. size encodings


def test_twelve_octal_digits_without_terminator():
    """A size field of twelve octal digits and no terminator is read as tarfile reads it."""
    data = header(b"a.bin", size_field=b"000000002000") + bytes(1024) + member("a.txt", b"t") + END
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getmembers()[0].size == 1024
    out = read(data)
    assert "error" not in out and len(out["value"][0]["bin"]) == 1024


# 4b. memory that piles up over many members


@pytest.mark.parametrize("typeflag", [b"x", b"g"])
def test_pax_records_piling_up_over_headers_are_capped(typeflag):
    """Consecutive (or global) PAX headers, each under the cap, cannot pile up records past it."""
    headers = b"".join(pax(pax_record(f"key{i}", "v" * (400 << 10)), typeflag) for i in range(4))
    out = read(GOOD + headers + member("b.txt", b"x") + END)
    error = out.get("error")
    assert isinstance(error, CorruptShardError) and "PAX records in force" in str(error)
    assert error.offset > len(GOOD) and out["peak"] < 8 << 20


def one_key_shard(fields: int, size: int) -> bytes:
    return b"".join(member(f"a.f{i}", bytes(size)) for i in range(fields)) + member("b.txt", b"ok") + END


def test_a_sample_growing_past_the_limit_is_refused(monkeypatch):
    """Members sharing one key cannot fill memory: past WDS_MAX_SAMPLE_SIZE the sample is an error naming
    where it began and the limit, read with memory near the limit."""
    monkeypatch.setenv("WDS_MAX_SAMPLE_SIZE", "1MiB")
    out = read(one_key_shard(64, 64 << 10))
    error = out["error"]
    assert isinstance(error, CorruptShardError) and error.offset == 0 and str(1 << 20) in str(error)
    assert "WDS_MAX_SAMPLE_SIZE" in str(error) and "beginning at byte 0" in str(error)
    assert out["peak"] < 4 << 20


def test_empty_members_under_one_key_count_towards_the_sample_limit(monkeypatch):
    """A stream of empty (or tiny) members of one key is bounded too: each field costs its name and more."""
    monkeypatch.setenv("WDS_MAX_SAMPLE_SIZE", "64KiB")
    out = read(one_key_shard(5000, 0))
    assert isinstance(out["error"], CorruptShardError) and "grows past the limit" in str(out["error"])


def test_the_sample_limit_follows_the_member_limit_and_the_dataset(tmp_path, monkeypatch):
    """Unset, the sample limit is the member limit (the dataset's own when given); max_sample_size= sets it;
    upstream's grouping stage applies it too; a handler skips the shard.  (The reader checks it as it reads
    on, each MiB or large member, so a sample may pass the limit by that much before it is refused.)"""
    path = tmp_path / "s.tar"
    path.write_bytes(one_key_shard(40, 64 << 10))  # one sample of 2.5 MiB, then "b"
    with pytest.raises(CorruptShardError, match=f"grows past the limit of {1 << 20} bytes"):
        list(wds.WebDataset(str(path), shardshuffle=False, max_member_size="1MiB"))
    with pytest.raises(CorruptShardError, match=f"grows past the limit of {512 << 10} bytes"):
        list(wds.WebDataset(str(path), shardshuffle=False, max_sample_size="512KiB"))
    assert [s["__key__"] for s in wds.WebDataset(str(path), shardshuffle=False)] == ["a", "b"]
    skipped = wds.WebDataset(
        str(path), shardshuffle=False, max_sample_size="512KiB", handler=wds.ignore_and_continue, empty_check=False
    )
    assert list(skipped) == []
    monkeypatch.setenv("WDS_MAX_SAMPLE_SIZE", "512KiB")
    with pytest.raises(CorruptShardError, match=f"grows past the limit of {512 << 10} bytes.*'a.f"):
        list(group_by_keys(tar_file_expander(url_opener([{"url": str(path)}]))))


# 4c. shard lists that go round for ever


def broken_shards(tmp_path, data: bytes, n: int = 3) -> list:
    paths = []
    for i in range(n):
        path = tmp_path / f"b{i}.tar"
        path.write_bytes(data)
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("data", [b"not a tar" * 100, END], ids=["damaged", "empty"])
def test_resampled_shards_that_never_give_a_sample_end_in_an_error(tmp_path, data):
    """Resampling damaged or empty shards with a skipping handler would spin for ever: it raises, naming the
    shards and the last error."""
    paths = broken_shards(tmp_path, data)
    out = bounded(lambda: list(wds.WebDataset(paths, resampled=True, handler=wds.ignore_and_continue)))
    error = out["error"]
    assert isinstance(error, ValueError) and "gave no sample" in str(error) and paths[0] in str(error)
    assert ("not a tar archive" in str(error)) == (data != END)


def test_upstream_stages_over_resampled_broken_shards_end_in_an_error(tmp_path):
    """url_opener and tar_file_expander with skipping handlers (OpenCLIP's reader) end too, for shards that
    cannot be opened and for damaged ones."""
    missing = [str(tmp_path / f"missing{i}.tar") for i in range(3)]
    damaged = broken_shards(tmp_path, b"not a tar" * 100)
    for paths in (missing, damaged):
        skip = wds.ignore_and_continue
        pipeline = wds.DataPipeline(
            wds.ResampledShards(paths),
            wds.pipelinefilter(url_opener)(handler=skip),
            wds.pipelinefilter(tar_file_expander)(handler=skip),
            group_by_keys,
        )
        out = bounded(lambda: list(pipeline))  # noqa: B023 (called in this iteration)
        assert isinstance(out["error"], ValueError) and "gave no sample" in str(out["error"])


def test_a_long_finite_list_of_empty_shards_is_read_to_its_end(tmp_path):
    """Many empty shards in a finite list are not a loop: the list ends, and the good shard is read."""
    paths = broken_shards(tmp_path, END, 150)
    good = tmp_path / "good.tar"
    good.write_bytes(GOOD + END)
    assert [s["__key__"] for s in wds.WebDataset(paths + [str(good)], shardshuffle=False)] == ["a"]


# 5. what follows the archive


class Trickle(io.RawIOBase):
    """A tar archive followed by endless zeros; notes whether a read began past the archive too early."""

    def __init__(self, archive: bytes) -> None:
        self.archive, self.pos, self.early, self.delivered = archive, 0, False, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.pos >= len(self.archive) and not self.delivered:
            self.early = True
        chunk = (self.archive[self.pos :] + bytes(len(buffer)))[: len(buffer)]
        buffer[: len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


def test_the_last_sample_comes_at_the_marker_and_the_trailer_is_bounded():
    """The last sample is delivered at the end-of-archive marker; what trickles after it is read only boundedly."""
    archive = member("a.txt", b"1") + member("b.txt", b"2") + END
    stream = Trickle(archive)

    def run():
        keys = []
        for sample in shard_samples("https://host/x.tar", stream):
            keys.append(sample["__key__"])
            if sample["__key__"] == "b":
                stream.delivered = True
        return keys

    out = bounded(run)
    assert out["value"] == ["a", "b"] and not stream.early
    assert stream.pos < len(archive) + (4 << 20)


def test_a_pipe_with_endless_output_after_the_archive_does_not_hang(tmp_path):
    """A pipe: command that goes on writing after the archive (cat shard /dev/zero): its samples come, the
    trailer is read boundedly, the command is stopped, and the next shard is read."""
    path = tmp_path / "a.tar"
    path.write_bytes(GOOD + END)
    other = tmp_path / "b.tar"
    other.write_bytes(member("z.txt", b"z") + END)
    urls = [f"pipe:cat {path} /dev/zero", str(other)]
    out = bounded(lambda: [s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False)])
    assert out.get("value") == ["a", "z"], out


# 6. malformed inputs and their classes


def test_an_empty_field_name_decodes(tmp_path):
    """Members named 'k.' (an empty field name) decode without an internal error."""
    path = tmp_path / "s.tar"
    path.write_bytes(member("k..txt", b"x") + member("k.", b"y") + END)
    samples = list(wds.WebDataset(str(path), shardshuffle=False).decode())
    assert samples[0][""] == b"y" and samples[0][".txt"] == "x"


def test_a_malformed_content_length_is_a_transfer_error():
    """An HTTP Content-Length that is not a number is a TransferError naming the header, not a ValueError."""
    import http.server
    import threading

    from wds_cloud.errors import TransferError

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "abc")
            self.end_headers()
            self.wfile.write(b"x" * 10)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(TransferError, match="Content-Length"):
            wds.gopen(f"http://127.0.0.1:{server.server_port}/x.tar", retries=1).read()
    finally:
        server.shutdown()
        server.server_close()


# 7. the composable stages


def test_composed_stages_never_yield_a_partial_sample(tmp_path):
    """url_opener + tar_file_expander + group_by_keys drop the sample a truncation cut short."""
    data = tar_of([(f"k{i}", {"txt": b"t" * 100, "bin": b"b" * 3000}) for i in range(5)])
    cut = data[: data.index(b"k3.bin") + 1000]  # inside sample k3, after its txt member
    path = tmp_path / "cut.tar"
    path.write_bytes(cut)
    for handler in (wds.ignore_and_continue, wds.ignore_and_stop):
        stages = group_by_keys(
            tar_file_expander(url_opener([{"url": str(path)}], handler=handler), handler=handler), handler=handler
        )
        samples = list(stages)
        assert [s["__key__"] for s in samples] == ["k0", "k1", "k2"]
        assert all(set(s) >= {"txt", "bin"} for s in samples)


# the fuzzing harness (a short run; bench/fuzz_reader.py runs a long one)

VALID = tar_of([(f"s{i}", {"txt": f"text {i}".encode(), "bin": bytes([i]) * (i * 300)}) for i in range(6)])
EXPECTED = {f"s{i}": {"txt": f"text {i}".encode(), "bin": bytes([i]) * (i * 300)} for i in range(6)}


def check_case(data: bytes, url: str = "fuzz.tar") -> None:
    """Only documented errors, bounded time and memory; samples from the original are whole."""
    out = read(data, url=url)
    assert out["peak"] < 64 << 20
    error = out.get("error")
    assert error is None or isinstance(error, CorruptShardError), repr(error)
    for sample in out.get("value", ()):
        original = EXPECTED.get(sample["__key__"])
        if original is not None and sample.get("txt") == original["txt"] and "bin" in sample:
            assert sample["bin"] == original["bin"] or len(sample["bin"]) != len(original["bin"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 3), pax_too=st.booleans())
def test_fuzz_header_mutations(seed, rounds, pax_too):
    """Header fields mutated with recomputed checksums, and bad PAX records inserted: only documented errors."""
    rng = random.Random(seed)
    data = VALID
    for _ in range(rounds):
        data = mutate_header(data, rng)
    if pax_too:
        data = insert_pax(data, rng)
    check_case(data)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), compression=st.sampled_from(["gz", "bz2", "xz", "zstd"]))
def test_fuzz_compressed_streams(seed, compression):
    """Compressed shards cut or damaged anywhere: documented errors only, and never a partial sample."""
    import bz2
    import lzma

    rng = random.Random(seed)
    if compression == "zstd":
        zstandard = pytest.importorskip("zstandard")
        data = zstandard.ZstdCompressor().compress(VALID)
    else:
        data = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[compression](VALID)
    data, cut = damage(data, rng)
    out = read(data, url=f"fuzz.tar.{compression}")
    error = out.get("error")
    assert error is None or isinstance(error, CorruptShardError), repr(error)
    assert out["peak"] < 64 << 20
    for sample in out.get("value", ()):
        if cut:  # what a cut stream delivers is exactly the samples before the cut, whole
            assert {k: v for k, v in sample.items() if not k.startswith("__")} == EXPECTED[sample["__key__"]]
        else:  # a flipped bit may change bytes unnoticed (zstd keeps no checksum by default), never the shape
            assert set(sample) - {"__key__", "__url__"} <= {"txt", "bin"}


# local paths that are not regular files: a device, a FIFO, a socket, a directory, a file that grows


def _hostile_path(kind, tmp_path):
    import os
    import socket

    if kind == "device":
        return "/dev/zero", None
    if kind == "fifo":
        path = tmp_path / "fifo.tar"
        os.mkfifo(path)
        return str(path), os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a writer: opening it never blocks
    if kind == "socket":
        path = tmp_path / "socket.tar"
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        return str(path), sock
    path = tmp_path / "folder.tar"
    path.mkdir()
    return str(path), None


@pytest.mark.parametrize("kind", ["device", "fifo", "socket", "directory"])
def test_a_local_path_that_is_not_a_regular_file_is_refused_by_every_reader(kind, tmp_path):
    """/dev/zero used to be read for ever (index building drained it; ShardListDataset over a description naming
    it hung), a FIFO waited for a writer: each is refused, naming the path, before a byte is read."""
    import json
    import os

    from wds_cloud.errors import ShardNotFoundError
    from wds_cloud.index import ShardListDataset, build_index
    from wds_cloud.io import datafile
    from wds_cloud.io.manifest import load_manifest

    path, holder = _hostile_path(kind, tmp_path)
    try:
        for attempt in (
            lambda: wds.gopen(path).read(1),
            lambda: wds.gopen("file:" + path).read(1),
            lambda: build_index(path),
            lambda: datafile.load(path, "description"),
            lambda: load_manifest(path),
            lambda: list(wds.WebDataset(path, shardshuffle=False)),
        ):
            with pytest.raises(ShardNotFoundError, match="not a regular file") as info:
                attempt()
            assert path in str(info.value)
        description = tmp_path / "d.json"
        description.write_text(
            json.dumps(
                {"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": [{"url": path, "nsamples": 3}]}
            )
        )
        with pytest.raises(ShardNotFoundError, match="not a regular file"):
            ShardListDataset(str(description))[0]
    finally:
        if isinstance(holder, int):
            os.close(holder)
        elif holder is not None:
            holder.close()


def test_a_local_file_that_grows_while_read_is_an_error_not_an_endless_read(tmp_path):
    """A read (or a drain to the end, as index building and manifest checks do) stops at the size the file had
    when opened: more bytes mean it is being written or was swapped, ObjectChangedError."""
    from wds_cloud.errors import ObjectChangedError
    from wds_cloud.io.integrity import Hashing

    path = tmp_path / "growing.tar"
    for finish in (lambda s: s.read(), lambda s: Hashing(s).drain(), lambda s: s.read(1 << 20)):
        path.write_bytes(bytes(2048))
        with wds.gopen(str(path)) as stream:
            assert stream.size == 2048 and stream.read(10) == bytes(10)
            with open(path, "ab") as more:
                more.write(bytes(1 << 16))
            with pytest.raises(ObjectChangedError, match="grew while it was read"):
                finish(stream)
    with wds.gopen(str(path), offset=100) as stream:  # opened after it grew: its new size is the bound
        assert len(stream.read()) == 2048 + (1 << 16) - 100
