"""TarWriter and ShardWriter: round trips, reproducibility, crash safety, validation."""

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud.errors import CorruptShardError, SampleError
from wds_cloud.records import RecordWriter, cbors_to_samples, msgpacks_to_samples
from wds_cloud.writer import ShardWriter, TarWriter

from .strategies import sample_lists


def read_back(url, decode=True):
    ds = wds.WebDataset(url, shardshuffle=False, empty_check=False)
    return list(ds.decode("rgb8", allow_pickle=True) if decode else ds)


def test_every_encoder_round_trips(tmp_path):
    """Every default encoder gives back what was written."""
    torch = pytest.importorskip("torch")
    image = (np.arange(8 * 12 * 3) % 256).astype(np.uint8).reshape(8, 12, 3)
    sample = {
        "__key__": "k",
        "cls": 3,
        "txt": "héllo",
        "json": {"a": [1, 2]},
        "npy": np.arange(5, dtype=np.uint32),
        "npz": {"x": np.ones(3)},
        "pyd": {"p": 1},
        "pth": torch.arange(4),
        "ten": np.eye(2, dtype=np.float32),
        "mp": {"m": 1},
        "cbor": {"c": 2},
        "png": image,
        "ppm": image,
        "tiff": image,
        "jpg": image,
        "json.gz": {"z": 1},
        "bin": b"\x00\x01",
    }
    url = str(tmp_path / "all.tar")
    with TarWriter(url) as writer:
        writer.write(sample)
    got = read_back(url)[0]
    assert got["cls"] == 3 and got["txt"] == "héllo" and got["json"] == {"a": [1, 2]}
    assert got["npy"].dtype == np.uint32 and np.array_equal(got["npz"]["x"], np.ones(3))
    assert got["pyd"] == {"p": 1} and torch.equal(got["pth"], torch.arange(4))
    assert np.array_equal(got["ten"][0], np.eye(2)) and got["mp"] == {"m": 1} and got["cbor"] == {"c": 2}
    for ext in ("png", "ppm", "tiff"):  # one image table for writing and reading: tiff is decoded as png is
        assert np.array_equal(got[ext], image), ext
    assert np.abs(got["jpg"].astype(int) - image).mean() < 20
    assert got["json.gz"] == {"z": 1} and got["bin"] == b"\x00\x01"


@pytest.mark.parametrize(
    "name, compress",
    [
        ("a.tar", None),
        ("a.tgz", None),
        ("a.tar.gz", None),
        ("a.tar.bz2", None),
        ("a.tar.xz", None),
        ("a.tar.zst", None),
        ("b.tar", "gz"),
        ("b.tar", True),
        ("b.tar", "xz"),
        ("b.tar", "zstd"),
    ],
)
def test_compression_round_trip(tmp_path, name, compress):
    """Compression by name or by argument; the reader detects it from the bytes."""
    url = str(tmp_path / name)
    with TarWriter(url, compress=compress) as writer:
        for i in range(20):
            writer.write({"__key__": f"{i:04d}", "txt": f"sample {i}" * 20})
    assert [s["txt"] for s in read_back(url)] == [f"sample {i}" * 20 for i in range(20)]
    if name.endswith(".tar") and compress is None:
        with tarfile.open(url) as tar:
            assert tar.getnames()[0] == "0000.txt"


@given(items=sample_lists(max_size=6))
def test_write_then_read_gives_the_same_samples(items):
    """Property: any samples written with encoder=False read back identically."""
    buf = io.BytesIO()
    writer = TarWriter(buf, encoder=False)
    for key, fields in items:
        if len({f.lower() for f in fields}) < len(fields) or any("." in key.rsplit("/", 1)[-1] for _ in [0]):
            continue
        writer.write(dict(fields, __key__=key))
    writer.close()
    from wds_cloud.tariterators import shard_samples

    buf.seek(0)
    written = [(k, f) for k, f in items if not any("." in k.rsplit("/", 1)[-1] for _ in [0])]
    got = list(shard_samples("m", buf))
    assert [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in got] == [
        (k, {f.lower(): v for f, v in sorted(fields.items())}) for k, fields in written
    ]


def test_reproducible(tmp_path):
    """The same samples give byte-identical shards, compressed or not."""

    def write(path, **kw):
        with TarWriter(str(path), **kw) as writer:
            for i in range(10):
                writer.write({"__key__": f"{i}", "json": {"i": i}, "npy": np.arange(i)})
        return path.read_bytes()

    for suffix in ("tar", "tar.gz", "tar.xz"):
        first = write(tmp_path / f"a.{suffix}")
        time.sleep(0.01)
        assert first == write(tmp_path / f"b.{suffix}"), suffix
    assert write(tmp_path / "m1.tar", mtime=1234) != write(tmp_path / "m2.tar")


def test_gnu_tar_lists_what_we_wrote(tmp_path):
    """GNU tar lists our members, long names included, and extracts them."""
    long_key = "dir/" + "x" * 120 + "/" + "y" * 120
    url = str(tmp_path / "g.tar")
    with TarWriter(url) as writer:
        writer.write({"__key__": "a", "txt": "hello"})
        writer.write({"__key__": long_key, "txt": "long"})
    listing = subprocess.run(["tar", "tvf", url], capture_output=True, text=True, check=True).stdout
    assert "a.txt" in listing and f"{long_key}.txt" in listing
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["tar", "xf", url, "-C", str(out)], check=True)
    assert (out / "a.txt").read_text() == "hello" and (out / f"{long_key}.txt").read_text() == "long"
    with tarfile.open(url) as tar:
        assert tar.getnames() == ["a.txt", f"{long_key}.txt"]


def test_format_is_honoured(tmp_path):
    """format='ustar' refuses long names; 'gnu' writes GNU long names; 'pax' PAX headers."""
    long_key = "z" * 300
    with pytest.raises(SampleError, match="does not fit a ustar header"):
        TarWriter(io.BytesIO(), format="ustar").write({"__key__": long_key, "txt": "x"})
    for fmt, _expected in (("gnu", tarfile.GNU_FORMAT), ("pax", tarfile.PAX_FORMAT)):
        buf = io.BytesIO()
        with TarWriter(buf, format=fmt) as writer:
            writer.write({"__key__": long_key, "txt": "x"})
        raw = buf.getvalue()
        assert (b"././@LongLink" in raw) == (fmt == "gnu") and (b"PaxHeader" in raw) == (fmt == "pax")
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            assert tar.getnames() == [f"{long_key}.txt"]


@pytest.mark.parametrize(
    "key, why",
    [("", "empty"), ("/abs/k", "absolute"), ("a/../b", "'..'"), ("a/b.c", "contains a dot"), (7, "must be a string")],
)
def test_invalid_keys_refused(key, why):
    """Keys the reader could not give back are refused, saying why and how to fix it."""
    with pytest.raises(SampleError, match=why):
        TarWriter(io.BytesIO()).write({"__key__": key, "txt": "x"})


def test_duplicate_and_missing_fields_refused():
    """Fields that readers would see as one, a missing key, and non-bytes with encoder=False are refused."""
    with pytest.raises(SampleError, match="same field"):
        TarWriter(io.BytesIO()).write({"__key__": "k", "txt": "a", "TXT": "b"})
    with pytest.raises(SampleError, match="needs a '__key__'"):
        TarWriter(io.BytesIO()).write({"txt": "a"})
    with pytest.raises(SampleError, match="bytes only"):
        TarWriter(io.BytesIO(), encoder=False).write({"__key__": "k", "txt": "a"})


def test_keep_meta_and_custom_encoders(tmp_path):
    """keep_meta writes __ fields; a handler dict and a callable encoder are used."""
    buf = io.BytesIO()
    with TarWriter(buf, keep_meta=True, encoder={"txt": lambda s: "".join(s).upper().encode()}) as writer:
        writer.write({"__key__": "k", "txt": ["a", "bc"], "__note__": b"n"})
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        assert sorted(tar.getnames()) == ["k.__note__", "k.txt"]
        assert tar.extractfile("k.txt").read() == b"ABC"
    buf = io.BytesIO()
    with TarWriter(buf, encoder=lambda s: {"__key__": s["__key__"], "bin": b"custom"}) as writer:
        writer.write({"__key__": "k", "anything": object()})
    assert b"custom" in buf.getvalue()


def test_exception_in_with_block_leaves_no_shard(tmp_path):
    """An exception inside `with TarWriter(path)` leaves nothing under the name."""
    url = tmp_path / "broken.tar"
    with pytest.raises(RuntimeError):
        with TarWriter(str(url)) as writer:
            writer.write({"__key__": "k", "txt": "x"})
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_shardwriter_limits_and_records(tmp_path):
    """maxcount starts new shards; no empty trailing shard; post runs; shards are recorded."""
    posted = []
    with ShardWriter(str(tmp_path / "s-%06d.tar"), maxcount=4, post=posted.append, start_shard=3) as sink:
        for i in range(10):
            sink.write({"__key__": f"{i:03d}", "txt": "x"})
    names = sorted(os.listdir(tmp_path))
    assert names == ["s-000003.tar", "s-000004.tar", "s-000005.tar"]
    assert [s["samples"] for s in sink.shards] == [4, 4, 2] and posted == [s["name"] for s in sink.shards]
    assert all(s["bytes"] == os.path.getsize(s["name"]) for s in sink.shards)
    assert len(read_back(str(tmp_path / "s-{000003..000005}.tar"), decode=False)) == 10


def test_shardwriter_maxsize_counts_real_bytes(tmp_path):
    """maxsize counts bytes written after compression; {shard:06d} patterns work; opener is used."""
    opened = []

    def opener(name):
        opened.append(name)
        return open(name, "wb")

    with ShardWriter(str(tmp_path / "c-{shard:06d}.tar"), maxcount=10**6, maxsize=30000, opener=opener) as sink:
        for i in range(20):
            sink.write({"__key__": f"{i:03d}", "bin": os.urandom(5000)})
    assert len(sink.shards) >= 3 and opened == [s["name"] for s in sink.shards]
    assert all(s["bytes"] < 30000 + 10240 + 6000 for s in sink.shards)
    with ShardWriter(str(tmp_path / "z-%06d.tar.gz"), maxsize=2000) as sink:
        for i in range(20):
            sink.write({"__key__": f"{i:03d}", "txt": "a" * 5000})
    assert len(sink.shards) < 20  # 5000 compressible bytes count as their compressed size
    assert os.path.getsize(sink.shards[0]["name"]) == sink.shards[0]["bytes"]


def test_shardwriter_exception_keeps_finished_shards(tmp_path):
    """An exception escaping the with block keeps finished shards and discards the one in progress."""
    with pytest.raises(KeyError):
        with ShardWriter(str(tmp_path / "e-%06d.tar"), maxcount=3) as sink:
            for i in range(5):
                sink.write({"__key__": f"{i}", "txt": "x"})
            raise KeyError("boom")
    assert os.listdir(tmp_path) == ["e-000000.tar"]
    sink.close()  # idempotent after abort


def test_shardwriter_error_names_shard_and_key(tmp_path):
    """An encoding error names the shard and the sample key."""
    with ShardWriter(str(tmp_path / "n-%06d.tar")) as sink:
        with pytest.raises(SampleError, match=r"n-000000.tar.*'bad'"):
            sink.write({"__key__": "bad", "weird": object()})


WRITER_SCRIPT = textwrap.dedent("""
    import sys, time, wds_cloud as wds
    sink = wds.ShardWriter(sys.argv[1], maxcount=1000)
    for i in range(100000):
        sink.write({"__key__": "%06d" % i, "txt": "x" * 1000})
        if i == 50:
            print("ready", flush=True)
            time.sleep(60)
""")


@pytest.mark.parametrize("via_pipe", [False, True])
def test_killed_writer_leaves_no_partial_shard(tmp_path, via_pipe):
    """A writer process killed mid-shard leaves nothing under the shard's final name (also through pipe:)."""
    final = tmp_path / "k-000000.tar"
    pattern = str(tmp_path / "k-%06d.tar")
    if via_pipe:  # the command publishes by renaming only after a clean end of its input
        pattern = f"pipe:cat > {tmp_path}/k-%06d.tar.tmp && mv {tmp_path}/k-%06d.tar.tmp {tmp_path}/k-%06d.tar"
        pattern = pattern.replace("%06d", "{shard:06d}")
    proc = subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, pattern], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    wait_until_no_process_mentions(str(tmp_path))  # then nothing can publish the shard any more
    assert not final.exists()


def wait_until_no_process_mentions(text, limit=60.0):
    """Wait for every process whose command line contains ``text`` to end (an event; the limit is a safety net)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        alive = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{entry}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if text.encode() in cmdline and state != b"Z":
                alive = True
                break
        if not alive:
            return
        time.sleep(0.01)
    raise AssertionError(f"processes mentioning {text} still run after {limit} s")


def test_full_disk(tmp_path):
    """A full disk raises OSError saying so, and leaves neither the shard nor a partial file."""
    mount = tmp_path / "small"
    mount.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with pytest.raises(OSError, match="disk is full") as info:
            with TarWriter(str(mount / "big.tar")) as writer:
                for i in range(100):
                    writer.write({"__key__": f"{i}", "bin": os.urandom(50000)})
        assert info.value.errno == 28
        assert os.listdir(mount) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("fmt, stage", [("cbor", cbors_to_samples), ("msgpack", msgpacks_to_samples)])
def test_record_streams(tmp_path, fmt, stage):
    """CBOR and msgpack record files round-trip; a truncated one raises CorruptShardError."""
    url = str(tmp_path / f"r.{fmt}")
    with RecordWriter(url, fmt) as writer:
        for i in range(5):
            writer.write({"i": i, "data": b"x" * i})
    got = list(stage()([{"url": url}]))
    assert [r["i"] for r in got] == list(range(5)) and got[0]["__url__"] == url
    with open(url, "rb") as f:
        data = f.read()
    (tmp_path / f"t.{fmt}").write_bytes(data[:-2])
    with pytest.raises(CorruptShardError, match="truncated"):
        list(stage()([{"url": str(tmp_path / f"t.{fmt}")}]))
    got = list(wds.DataPipeline(wds.SimpleShardList(url), stage()))
    assert len(got) == 5


@given(st.lists(st.binary(max_size=200), max_size=20))
def test_shardwriter_partitions_samples(payloads):
    """Property: ShardWriter with a small maxcount writes every sample exactly once, in order."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with ShardWriter(os.path.join(tmp, "p-%04d.tar"), maxcount=3, encoder=False) as sink:
            for i, payload in enumerate(payloads):
                sink.write({"__key__": f"{i:04d}", "bin": payload})
        assert sum(s["samples"] for s in sink.shards) == len(payloads)
        if payloads:
            spec = os.path.join(tmp, "p-{0000..%04d}.tar" % (len(sink.shards) - 1))
            assert [s["bin"] for s in read_back(spec, decode=False)] == payloads


def test_a_stream_handed_in_stays_open_compressed_or_not():
    """As upstream's TarWriter: closing the writer finishes the archive but leaves the caller's stream open."""
    import io

    for compress in (None, True):
        out = io.BytesIO()
        with wds.TarWriter(out, compress=compress) as writer:
            writer.write({"__key__": "a", "txt": "x"})
        assert not out.closed and len(out.getvalue()) > 0


# Issue 42: webdataset's writer rule (1.0.2), which img2dataset and most user code rely on when they write
# `sample["json"] = json.dumps(meta)`: a str is written as its UTF-8 bytes and bytes as given, for every
# extension, before the extension is looked at; only other values go through the extension's encoder.

TEXT = '{"caption": "h\u00e9llo \u2713", "n": 1}'  # text that is also valid JSON: no encoder may touch it
RAW = b'\x00\xff{"raw": true}'


def _kinds_of_extensions():
    """Every extension the writer encodes, with its kind ("image:FORMAT" for images), from the one table."""
    from wds_cloud.codec import extensions

    kinds = {ext: kind for table in extensions.WRITTEN_KINDS for kind, exts in table.items() for ext in exts}
    kinds.update((ext, f"image:{fmt}") for table in extensions.WRITTEN_IMAGES for ext, fmt in table.items())
    return kinds


KIND_OF = _kinds_of_extensions()


def _image_check(fmt):
    def check(member, image):
        import PIL.Image

        with PIL.Image.open(io.BytesIO(member)) as got:
            assert got.format == fmt and got.size == (image.shape[1], image.shape[0])
            if fmt not in ("JPEG", "WEBP"):  # the lossy ones
                assert np.array_equal(np.asarray(got.convert("RGB")), image)

    return check


def _native_cases():
    """kind -> (a native value, a check that the member holds that value in the kind's own encoding)."""
    import pickle

    import cbor2
    import msgpack

    from wds_cloud import tenbin

    array = np.arange(6, dtype=np.int16).reshape(2, 3)
    image = (np.arange(6 * 5 * 3) * 7 % 256).astype(np.uint8).reshape(6, 5, 3)
    doc = {"a": [1, "\u00e9"], "b": None}

    def torch_check(member, value):
        torch = pytest.importorskip("torch")
        assert torch.equal(torch.load(io.BytesIO(member)), value)

    def torch_value():
        return pytest.importorskip("torch").arange(4)

    cases = {
        "int": (np.int64(7), lambda m, v: m == b"7"),
        "text": (12, lambda m, v: m == b"12"),
        "json": (doc, lambda m, v: m == json.dumps(v).encode("utf-8")),
        "pickle": (doc, lambda m, v: pickle.loads(m) == v),
        "tenbin": (array, lambda m, v: np.array_equal(tenbin.decode_buffer(m)[0], v)),
        "msgpack": (doc, lambda m, v: msgpack.unpackb(m) == v),
        "cbor": (doc, lambda m, v: cbor2.loads(m) == v),
        "npy": (array, lambda m, v: (lambda a: a.dtype == v.dtype and np.array_equal(a, v))(np.load(io.BytesIO(m)))),
        "npz": ({"x": array}, lambda m, v: np.array_equal(np.load(io.BytesIO(m))["x"], v["x"])),
        "torch": (None, torch_check),
    }
    for kind in set(KIND_OF.values()):
        if kind.startswith("image:"):
            cases[kind] = (image, _image_check(kind.split(":", 1)[1]))
    return cases, torch_value


def test_the_extension_table_is_what_the_writer_encodes():
    """Every extension of the one table has an encoder, and every default encoder comes from the table."""
    from wds_cloud.codec.encoders import make_handlers

    assert set(KIND_OF) == set(make_handlers())
    cases, _ = _native_cases()
    assert set(KIND_OF.values()) <= set(cases), "a new kind of extension needs a native case in this test"


@pytest.mark.parametrize("writer", ["TarWriter", "ShardWriter"])
@pytest.mark.parametrize("ext", sorted(KIND_OF))
def test_str_is_utf8_and_bytes_as_given_for_every_extension(tmp_path, ext, writer):
    """For every extension (and its .gz): str -> its UTF-8 bytes, bytes-likes -> as given, anything else ->
    the extension's encoding; read back with Python's tarfile (webdataset 1.0.2's rule)."""
    import gzip

    cases, torch_value = _native_cases()
    native, check = cases[KIND_OF[ext]]
    if KIND_OF[ext] == "torch":
        native = torch_value()
    values = {"s": TEXT, "b": RAW, "ba": bytearray(RAW), "mv": memoryview(RAW), "n": native}
    if writer == "TarWriter":
        path = tmp_path / "x.tar"
        with TarWriter(str(path)) as sink:
            for key, value in values.items():
                sink.write({"__key__": key, ext: value, f"{ext}.gz": value})
    else:
        path = tmp_path / "x-000000.tar"
        with ShardWriter(str(tmp_path / "x-%06d.tar")) as sink:
            for key, value in values.items():
                sink.write({"__key__": key, ext: value, f"{ext}.gz": value})
    with tarfile.open(path) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert len(members) == 2 * len(values)
    for key in ("s", "b", "ba", "mv"):
        expected = TEXT.encode("utf-8") if key == "s" else RAW
        assert members[f"{key}.{ext}"] == expected, (key, ext)
        assert gzip.decompress(members[f"{key}.{ext}.gz"]) == expected, (key, ext)
    for name in (f"n.{ext}", f"n.{ext}.gz"):
        member = members[name]
        if name.endswith(".gz"):
            member = gzip.decompress(member)
        assert check(member, native) is not False, (name, member[:60])


def test_json_dumps_in_a_sample_reads_back_as_the_dict(tmp_path):
    """img2dataset's `sample["json"] = json.dumps(meta)`, and the same text under .jsn, .json.gz, .cls and
    .txt, decode to what the text says, through TarWriter and ShardWriter alike."""
    meta = {"url": "http://x/1.jpg", "caption": "h\u00e9llo", "width": 640, "nsfw": None}
    sample = {
        "json": json.dumps(meta),
        "jsn": json.dumps(meta),
        "json.gz": json.dumps(meta),
        "cls": "3",
        "txt": "h\u00e9llo",
    }
    with TarWriter(str(tmp_path / "t.tar")) as sink:
        sink.write({"__key__": "000000", **sample})
    with ShardWriter(str(tmp_path / "s-%06d.tar")) as sink:
        sink.write({"__key__": "000001", **sample})
    for url in (str(tmp_path / "t.tar"), str(tmp_path / "s-000000.tar")):
        (got,) = list(wds.WebDataset(url, shardshuffle=False).decode())
        assert got["json"] == meta and got["jsn"] == meta and got["json.gz"] == meta
        assert got["cls"] == 3 and got["txt"] == "h\u00e9llo"


def test_str_skips_even_a_handler_given_for_its_extension():
    """As in webdataset, a handler dict sees only values that are neither str nor bytes; encoder=False (bytes
    only) still refuses str, as webdataset's writer does."""
    seen = []

    def shout(value):
        seen.append(value)
        return repr(value).upper().encode()

    buf = io.BytesIO()
    with TarWriter(buf, encoder={"txt": shout}) as writer:
        writer.write({"__key__": "a", "txt": "abc"})
        writer.write({"__key__": "b", "txt": ["abc"]})
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        assert tar.extractfile("a.txt").read() == b"abc" and tar.extractfile("b.txt").read() == b"['ABC']"
    assert seen == [["abc"]]
    with pytest.raises(SampleError, match="bytes only"):
        TarWriter(io.BytesIO(), encoder=False).write({"__key__": "k", "json": "{}"})


def test_text_that_is_not_utf8_is_refused_naming_the_field():
    """A str holding a lone surrogate cannot be written as UTF-8: the error names the sample and the field."""
    with pytest.raises(SampleError, match=r"'bad'.*'json'|'json'.*'bad'"):
        TarWriter(io.BytesIO()).write({"__key__": "bad", "json": "x\udc80y"})


def test_ints_arrays_and_images_encode_as_before():
    """Native values through the same path: class ints (numpy and bool too, as str() writes them), arrays, PIL
    images."""
    import PIL.Image

    image = PIL.Image.fromarray((np.arange(4 * 3 * 3) % 256).astype(np.uint8).reshape(4, 3, 3))
    buf = io.BytesIO()
    with TarWriter(buf) as writer:
        writer.write(
            {
                "__key__": "k",
                "cls": 5,
                "index": np.int32(9),
                "count": True,
                "npy": np.arange(3, dtype=np.float32),
                "png": image,
                "jpg": image,
            }
        )
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert got["k.cls"] == b"5" and got["k.index"] == b"9" and got["k.count"] == b"True"
    assert np.array_equal(np.load(io.BytesIO(got["k.npy"])), np.arange(3, dtype=np.float32))
    with PIL.Image.open(io.BytesIO(got["k.png"])) as png:
        assert png.format == "PNG" and np.array_equal(np.asarray(png), np.asarray(image))
    with PIL.Image.open(io.BytesIO(got["k.jpg"])) as jpg:
        assert jpg.format == "JPEG" and jpg.size == image.size


@pytest.mark.parametrize("compress", [None, "gz"])
def test_write_returns_the_payload_bytes_as_webdataset(tmp_path, compress):
    """TarWriter.write() and ShardWriter.write() return the sum of the encoded fields' bytes (webdataset 1.0.2's
    value, which lhotse's ShardWriter sums to cut shards), not the bytes taken in the tar stream."""
    import pickle

    record = pickle.dumps({"text": "hello", "n": list(range(20))})
    sample = {"__key__": "k0", "data": record, "txt": "héllo", "npy": np.arange(6, dtype=np.int32), "_meta": "x"}
    encoded = TarWriter(io.BytesIO(), encoder=True).encoder(dict(sample))
    expected = sum(len(v) for k, v in encoded.items() if not k.startswith("_"))
    with TarWriter(str(tmp_path / "a.tar"), compress=compress) as writer:
        assert writer.write(dict(sample)) == expected
        assert writer.write({"__key__": "k1", "data": memoryview(np.arange(4, dtype=np.int64))}) == 32
        assert writer.size > 2 * 512 or compress  # what the stream took is still counted, apart
    with TarWriter(io.BytesIO(), keep_meta=True) as writer:
        assert writer.write({"__key__": "k", "_meta": b"abc", "bin": b"x" * 106}) == 109
    with ShardWriter(str(tmp_path / "s-%03d.tar"), maxcount=5) as sink:
        assert sink.write({"__key__": "k", "data": record}) == len(record)


def test_summing_write_cuts_shards_as_webdataset(tmp_path):
    """A writer of its own that sums write()'s return value against maxsize (lhotse's ShardWriter) cuts 10
    samples of 300 bytes at maxsize=2000 into 7 + 3, as with webdataset 1.0.2 (not 2 + 2 + 2 + 2 + 2)."""
    counts, size, writer = [], 0, None
    for i in range(10):
        if writer is None or size >= 2000:
            if writer is not None:
                writer.close()
            writer, size = TarWriter(str(tmp_path / f"l-{len(counts):03d}.tar")), 0
            counts.append(0)
        size += writer.write({"__key__": f"k{i}", "data": b"x" * 300})
        counts[-1] += 1
    writer.close()
    assert counts == [7, 3]


def test_shardwriter_maxsize_bounds_the_real_shard_size(tmp_path):
    """ShardWriter cuts by its own count of the bytes a shard really holds (headers and padding too), whatever
    write() returns: 10 samples of 300 bytes (1024 tar bytes each) at maxsize=2000 make shards of 2 samples."""
    with ShardWriter(str(tmp_path / "w-%03d.tar"), maxcount=1000, maxsize=2000) as sink:
        for i in range(10):
            assert sink.write({"__key__": f"k{i}", "data": b"x" * 300}) == 300
    assert [s["samples"] for s in sink.shards] == [2, 2, 2, 2, 2]
    assert all(os.path.getsize(s["name"]) == s["bytes"] for s in sink.shards)


INT_EXTENSIONS = ["cls", "cls2", "class", "count", "index", "inx", "id"]


@pytest.mark.parametrize("extension", INT_EXTENSIONS)
@pytest.mark.parametrize(
    "value",
    [3.5, -0.9, np.float64(2.7), np.float32(0.1), True, False, float("nan"), float("inf"), -float("inf"), 1e300]
    + [7, -2, np.int64(3), np.uint8(255), 10**30],
)
def test_int_fields_are_written_as_str_of_the_value(extension, value):
    """Under cls, index, id, ... a value is written as str(value), as webdataset writes it: 3.5 stays b'3.5'
    (never b'3'), True is b'True', NaN b'nan'; nothing is converted to int on the way."""
    buf = io.BytesIO()
    with TarWriter(buf) as sink:
        sink.write({"__key__": "k", extension: value})
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        assert tar.extractfile(f"k.{extension}").read() == str(value).encode()


@pytest.mark.parametrize("extension", ["png", "jpg", "ppm", "tiff", "webp"])
@pytest.mark.parametrize("bad", [1.5, -0.5, float("nan"), float("inf"), 255.0])
def test_float_images_outside_0_1_are_refused_not_clipped(extension, bad):
    """A float image with a value outside [0, 1] (or NaN/inf) is refused naming the range, as webdataset refuses
    it, instead of being clipped into another image; values within 0.001 of the range still write."""
    image = np.full((4, 4, 3), 0.5, np.float32)
    image[1, 2, 0] = bad
    with pytest.raises(SampleError, match="must lie in \\[0, 1\\]"):
        with TarWriter(io.BytesIO()) as sink:
            sink.write({"__key__": "k", extension: image})
    image[1, 2, 0] = 1.0005
    with TarWriter(io.BytesIO()) as sink:
        sink.write({"__key__": "k", extension: image})


@pytest.mark.parametrize("mode", ["RGBA", "LA", "I", "F", "I;16", "PA"])
@pytest.mark.parametrize("extension", ["jpg", "jpeg", "img", "image"])
def test_jpeg_refuses_images_it_would_lose_data_of(mode, extension):
    """An image with alpha or more than 8 bits a channel is refused under a JPEG extension (its alpha or depth
    would be dropped unseen); webdataset's Pillow refuses it too."""
    from PIL import Image

    with pytest.raises(SampleError, match=f"a {mode} image cannot be written as JPEG"):
        with TarWriter(io.BytesIO()) as sink:
            sink.write({"__key__": "k", extension: Image.new(mode, (4, 4))})


def test_jpeg_converts_images_it_holds_without_loss():
    """1-bit and palette images without transparency are written as JPEG (RGB); a palette with a transparent
    colour is refused."""
    from PIL import Image

    for image in (Image.new("1", (4, 4)), Image.new("P", (4, 4)), np.zeros((4, 4, 4), np.uint8)[..., :3]):
        with TarWriter(io.BytesIO()) as sink:
            sink.write({"__key__": "k", "jpg": image})
    transparent = Image.new("P", (4, 4))
    transparent.info["transparency"] = 0
    with pytest.raises(SampleError, match="cannot be written as JPEG"):
        with TarWriter(io.BytesIO()) as sink:
            sink.write({"__key__": "k", "jpg": transparent})
