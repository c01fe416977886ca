"""WebDataset and the fluent API, as webdataset users write them."""

import os
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud import filters, shardlists
from wds_cloud.errors import CorruptShardError, DecodingError, SecurityError


def test_basic_read(shards):
    """All samples, in order, with __key__, __url__ and __local_path__."""
    samples = list(wds.WebDataset(shards, shardshuffle=False))
    assert len(samples) == 30
    assert samples[0]["__key__"] == "s0_0000" and samples[0]["__url__"].endswith("shard-000.tar")
    assert samples[0]["__local_path__"].endswith("shard-000.tar")
    assert samples[-1]["__key__"] == "s2_0009"


def test_the_readme_pipeline(image_shards):
    """shuffle -> decode('rgb') -> to_tuple gives float HWC images in [0, 1] and parsed JSON."""
    ds = wds.WebDataset(image_shards, shardshuffle=True).shuffle(100).decode("rgb").to_tuple("png", "json")
    items = list(ds)
    assert len(items) == 10
    image, meta = items[0]
    assert image.shape == (8, 12, 3) and image.dtype == np.float32 and 0 <= image.min() and image.max() <= 1
    assert set(meta) == {"s", "i"}


@pytest.mark.parametrize(
    "spec, shape, dtype",
    [
        ("l8", (8, 12), np.uint8),
        ("rgb8", (8, 12, 3), np.uint8),
        ("rgba8", (8, 12, 4), np.uint8),
        ("l", (8, 12), np.float32),
        ("rgb", (8, 12, 3), np.float32),
        ("rgba", (8, 12, 4), np.float32),
    ],
)
def test_numpy_image_specs(image_shards, spec, shape, dtype):
    """Every numpy image spec gives the documented shape and dtype."""
    image = next(iter(wds.WebDataset(image_shards, shardshuffle=False).decode(spec).to_tuple("png")))[0]
    assert image.shape == shape and image.dtype == dtype


def test_rgb8_pixels_identical_to_pillow(image_shards):
    """Decoded pixels equal what Pillow gives for the same bytes."""
    import io

    from PIL import Image

    raw = next(iter(wds.WebDataset(image_shards, shardshuffle=False)))["png"]
    image = next(iter(wds.WebDataset(image_shards, shardshuffle=False).decode("rgb8").to_tuple("png")))[0]
    assert np.array_equal(image, np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")))


@pytest.mark.parametrize(
    "spec, shape",
    [
        ("torchl8", (8, 12)),
        ("torchrgb8", (3, 8, 12)),
        ("torchrgba8", (4, 8, 12)),
        ("torchl", (8, 12)),
        ("torchrgb", (3, 8, 12)),
        ("torch", (3, 8, 12)),
        ("torchrgba", (4, 8, 12)),
    ],
)
def test_torch_image_specs(image_shards, spec, shape):
    """Torch image specs give CHW tensors."""
    torch = pytest.importorskip("torch")
    image = next(iter(wds.WebDataset(image_shards, shardshuffle=False).decode(spec).to_tuple("png")))[0]
    assert isinstance(image, torch.Tensor) and tuple(image.shape) == shape


@pytest.mark.parametrize("spec, mode", [("pil", "RGB"), ("pill", "L"), ("pilrgb", "RGB"), ("pilrgba", "RGBA")])
def test_pil_specs(image_shards, spec, mode):
    """PIL specs give PIL images in the right mode."""
    image = next(iter(wds.WebDataset(image_shards, shardshuffle=False).decode(spec).to_tuple("png")))[0]
    assert image.mode == mode


#: webdataset 1.0.2's imagespecs, as its autodecode.py spells them (lowercase modes)
UPSTREAM_IMAGESPECS = {
    "l8": ("numpy", "uint8", "l"),
    "rgb8": ("numpy", "uint8", "rgb"),
    "rgba8": ("numpy", "uint8", "rgba"),
    "l": ("numpy", "float", "l"),
    "rgb": ("numpy", "float", "rgb"),
    "rgba": ("numpy", "float", "rgba"),
    "torchl8": ("torch", "uint8", "l"),
    "torchrgb8": ("torch", "uint8", "rgb"),
    "torchrgba8": ("torch", "uint8", "rgba"),
    "torchl": ("torch", "float", "l"),
    "torchrgb": ("torch", "float", "rgb"),
    "torch": ("torch", "float", "rgb"),
    "torchrgba": ("torch", "float", "rgba"),
    "pill": ("pil", None, "l"),
    "pil": ("pil", None, "rgb"),
    "pilrgb": ("pil", None, "rgb"),
    "pilrgba": ("pil", None, "rgba"),
}


def _png(mode, shape):
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.full(shape, 7, np.uint8), mode=None).convert(mode).save(out, "PNG")
    return out.getvalue()


def test_imagespecs_table_is_webdatasets():
    """autodecode.imagespecs holds webdataset's entries with its values: code reading imagespecs[x][2] sees 'rgb'."""
    assert wds.autodecode.imagespecs == UPSTREAM_IMAGESPECS


@pytest.mark.parametrize("mode", ["l", "L", "rgb", "RGB", "rgba", "RgBa"])
def test_imagespecs_entry_added_in_either_spelling(monkeypatch, image_shards, mode):
    """An entry added to imagespecs the way webdataset's are written (mode 'l') decodes, as does Pillow's 'L'."""
    monkeypatch.setitem(wds.autodecode.imagespecs, "mine", ("numpy", "float", mode))
    image = next(iter(wds.WebDataset(image_shards, shardshuffle=False).decode("mine").to_tuple("png")))[0]
    assert (
        image.dtype == np.float32 and image.shape == {"l": (8, 12), "rgb": (8, 12, 3), "rgba": (8, 12, 4)}[mode.lower()]
    )


@pytest.mark.parametrize("entry", [("numpy", "float", "nonsense"), ("numpy", "float"), ("jax", "uint8", "rgb"), 3])
def test_imagespecs_entry_that_cannot_work_is_refused_naming_it(monkeypatch, entry):
    """A user's imagespecs entry that could decode no image is refused when the handler is made, naming it."""
    from wds_cloud.errors import ConfigError

    monkeypatch.setitem(wds.autodecode.imagespecs, "broken", entry)
    with pytest.raises(ConfigError, match="imagespecs\\['broken'\\]") as caught:
        wds.imagehandler("broken")
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "source", [("L", (4, 4)), ("P", (4, 4)), ("RGBA", (4, 4, 4)), ("LA", (4, 4, 2)), ("1", (4, 4))]
)
@pytest.mark.parametrize("spec", sorted(UPSTREAM_IMAGESPECS))
def test_every_spec_converts_as_webdataset(spec, source):
    """Every spec converts any image to its mode as webdataset's does: 'pil' of a grey PNG is RGB, 'pill' is L."""
    atype, etype, mode = UPSTREAM_IMAGESPECS[spec]
    if atype == "torch":
        pytest.importorskip("torch")
    out = wds.Decoder([wds.imagehandler(spec)])({"__key__": "a", "png": _png(*source)})["png"]
    channels = {"l": None, "rgb": 3, "rgba": 4}[mode]
    if atype == "pil":
        assert out.mode == mode.upper() and out.size == (4, 4)
        return
    shape = (4, 4) if channels is None else ((channels, 4, 4) if atype == "torch" else (4, 4, channels))
    assert tuple(out.shape) == shape
    assert str(out.dtype).endswith("uint8" if etype == "uint8" else "float32")


def test_default_decoders(tmp_path):
    """txt, cls, json, npy, npz, ten, mp, cbor and .gz fields decode by extension."""
    import gzip
    import io
    import json
    import tarfile

    import cbor2
    import msgpack

    arr = np.arange(6, dtype=np.uint32).reshape(2, 3)
    npy = io.BytesIO()
    np.save(npy, arr)
    npz = io.BytesIO()
    np.savez(npz, a=arr)
    fields = {
        "txt": b"hi",
        "cls": b"7",
        "json": b'{"a": 1}',
        "npy": npy.getvalue(),
        "npz": npz.getvalue(),
        "ten": bytes(wds.tenbin.encode_buffer([arr])),
        "mp": msgpack.packb({"m": 1}),
        "cbor": cbor2.dumps({"c": 2}),
        "json.gz": gzip.compress(json.dumps([1, 2]).encode()),
        "bin": b"\x00raw",
    }
    with tarfile.open(tmp_path / "d.tar", "w") as tar:
        for ext, data in fields.items():
            info = tarfile.TarInfo(f"k.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    s = next(iter(wds.WebDataset(str(tmp_path / "d.tar"), shardshuffle=False).decode()))
    assert s["txt"] == "hi" and s["cls"] == 7 and s["json"] == {"a": 1}
    assert np.array_equal(s["npy"], arr) and np.array_equal(s["npz"]["a"], arr) and np.array_equal(s["ten"][0], arr)
    assert s["mp"] == {"m": 1} and s["cbor"] == {"c": 2} and s["json.gz"] == [1, 2] and s["bin"] == b"\x00raw"


def write_pickle_shard(path):
    import io
    import tarfile

    data = pickle.dumps({"x": 1})
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("k.pyd")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_pickle_refused_by_default(tmp_path, monkeypatch):
    """Pickle fields are refused unless allow_pickle=True or WDS_ALLOW_PICKLE=1; WDS_SECURE always refuses."""
    url = write_pickle_shard(tmp_path / "p.tar")
    with pytest.raises(DecodingError, match="allow_pickle=True.*WDS_ALLOW_PICKLE=1") as info:
        list(wds.WebDataset(url, shardshuffle=False).decode())
    assert "'pyd'" in str(info.value) and "'k'" in str(info.value) and "p.tar" in str(info.value)
    assert list(wds.WebDataset(url, shardshuffle=False).decode(allow_pickle=True))[0]["pyd"] == {"x": 1}
    monkeypatch.setenv("WDS_ALLOW_PICKLE", "1")
    assert list(wds.WebDataset(url, shardshuffle=False).decode())[0]["pyd"] == {"x": 1}
    monkeypatch.setenv("WDS_SECURE", "1")  # local files are refused then: read the shard from a store
    with pytest.raises(DecodingError, match="WDS_SECURE"):
        list(wds.WebDataset(in_memory(url), shardshuffle=False).decode(allow_pickle=True))


def test_xdecode_honours_security(tmp_path, monkeypatch):
    """xdecode refuses pickle by default and under utils.enforce_security."""
    url = write_pickle_shard(tmp_path / "p.tar")
    with pytest.raises(DecodingError):
        list(wds.WebDataset(url, shardshuffle=False).xdecode())
    monkeypatch.setenv("WDS_ALLOW_PICKLE", "1")
    assert list(wds.WebDataset(url, shardshuffle=False).xdecode())[0]["pyd"] == {"x": 1}
    wds.utils.enforce_security = True
    with pytest.raises(DecodingError, match="WDS_SECURE"):
        list(wds.WebDataset(in_memory(url), shardshuffle=False).xdecode())


def in_memory(path):
    """A copy of the file at ``path`` in fsspec's memory store (a remote scheme, allowed under WDS_SECURE)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    name = "/secure-tests/" + os.path.basename(path)
    with open(path, "rb") as src, fs.open(name, "wb") as dst:
        dst.write(src.read())
    return "memory:/" + name


def test_decoding_error_names_url_key_field(tmp_path):
    """A DecodingError names the URL, the sample key and the field."""
    import io
    import tarfile

    with tarfile.open(tmp_path / "bad.tar", "w") as tar:
        info = tarfile.TarInfo("sample7.json")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"{nope"))
    with pytest.raises(DecodingError) as info:
        list(wds.WebDataset(str(tmp_path / "bad.tar"), shardshuffle=False).decode())
    message = str(info.value)
    assert "bad.tar" in message and "'sample7'" in message and "'json'" in message
    assert info.value.key == "sample7" and info.value.field == "json"


def test_handler_skips_damaged_shard(tmp_path, shards):
    """With warn_and_continue a truncated shard is skipped and the rest is read; no partial sample appears."""
    path = shards.replace("{000..002}", "001")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CorruptShardError):
        list(wds.WebDataset(shards, shardshuffle=False))
    with pytest.warns(UserWarning):
        got = list(wds.WebDataset(shards, shardshuffle=False, handler=wds.warn_and_continue))
    assert all(len(s) == 6 for s in got)  # __key__ __url__ __local_path__ txt cls json: whole samples only
    keys = [s["__key__"] for s in got]
    assert keys[:10] == [f"s0_{i:04d}" for i in range(10)] and keys[-10:] == [f"s2_{i:04d}" for i in range(10)]
    stopped = list(wds.WebDataset(shards, shardshuffle=False, handler=wds.ignore_and_stop))
    assert [s["__key__"] for s in stopped][:10] == keys[:10] and all(s["__key__"] < "s2" for s in stopped)


def test_shard_specs(tmp_path, shards, monkeypatch):
    """'::' joins specs, braces keep padding, ${NAME} comes from WDS_NAME."""
    directory = os.path.dirname(shards)
    monkeypatch.setenv("WDS_DIR", directory)
    spec = "${DIR}/shard-{000..001}.tar::" + directory + "/shard-002.tar"
    assert shardlists.expand_urls(spec)[0] == f"{directory}/shard-000.tar"
    assert len(list(wds.WebDataset(spec, shardshuffle=False))) == 30
    assert len(list(wds.WebDataset([f"{directory}/shard-000.tar"], shardshuffle=False))) == 10


def test_json_spec(tmp_path, shards):
    """A wids-style JSON index names the shards (relative to its location)."""
    import json

    directory = os.path.dirname(shards)
    (tmp_path / "index.json").write_text(
        json.dumps({"shardlist": [{"url": f"shard-{i:03d}.tar", "nsamples": 10} for i in range(3)]})
    )
    assert len(list(wds.WebDataset(str(tmp_path / "index.json"), shardshuffle=False))) == 30
    assert directory == str(tmp_path)


def test_pipe_from_json_spec_is_untrusted(tmp_path, shards):
    """A pipe: URL read from a spec file does not run unless allowed."""
    import json

    (tmp_path / "evil.json").write_text(
        json.dumps({"shardlist": [{"url": "pipe:cat " + shards.replace("{000..002}", "000")}]})
    )
    with pytest.raises(SecurityError, match="WDS_ALLOW_UNTRUSTED_PIPES"):
        list(wds.WebDataset(str(tmp_path / "evil.json"), shardshuffle=False))


def test_shardshuffle_changes_per_epoch_and_is_deterministic(tmp_path):
    """With shardshuffle the shard order differs between epochs and is the same for the same seed."""
    from tests.conftest import make_shards

    spec = make_shards(tmp_path, nshards=8, per_shard=1)

    def orders(seed):
        ds = wds.WebDataset(spec, shardshuffle=True, seed=seed)
        return [tuple(s["__key__"] for s in ds) for _ in range(3)]

    first = orders(5)
    assert first == orders(5) and len(set(first)) > 1


def test_resampled(shards):
    """resampled=True draws shards forever; with_epoch bounds an epoch."""
    ds = wds.WebDataset(shards, resampled=True, seed=1).with_epoch(25)
    assert len(list(ds)) == 25


def test_repeat_is_honoured(shards):
    """repeat=True (ignored upstream) repeats the dataset."""
    ds = wds.WebDataset(shards, shardshuffle=False, repeat=True)
    assert len(list(filters._slice(iter(ds), 75))) == 75


def test_select_and_rename_files(shards):
    """select_files and rename_files apply to member names."""
    ds = wds.WebDataset(
        shards,
        shardshuffle=False,
        select_files=lambda n: not n.endswith(".json"),
        rename_files=lambda n: n.replace(".txt", ".text"),
    )
    s = next(iter(ds))
    assert "json" not in s and "text" in s and "cls" in s


def test_url_to_name_is_honoured(tmp_path, shards):
    """url_to_name decides cache file names (ignored upstream); local shards are read in place."""
    ds = wds.WebDataset(shards, shardshuffle=False, cache_dir=str(tmp_path / "cache"), url_to_name=lambda u: "x")
    assert len(list(ds)) == 30
    assert not os.listdir(tmp_path / "cache")


def test_cache_with_pipe_urls(tmp_path, shards):
    """A non-local shard is streamed and cached; the second epoch reads the cache."""
    spec = "pipe:cat " + shards.replace("{000..002}", "000")
    ds = wds.WebDataset(spec, shardshuffle=False, cache_dir=str(tmp_path / "c"))
    first = list(ds)
    files = [f for f in os.listdir(tmp_path / "c") if f.endswith(".tar")]
    assert len(first) == 10 and len(files) == 1
    assert [s["__key__"] for s in ds] == [s["__key__"] for s in first]


def test_empty_check(tmp_path):
    """An empty dataset raises a ValueError that says why and how to turn the check off."""
    import tarfile

    with tarfile.open(tmp_path / "empty.tar", "w"):
        pass
    with pytest.raises(ValueError, match="empty_check=False"):
        list(wds.WebDataset(str(tmp_path / "empty.tar"), shardshuffle=False))
    assert list(wds.WebDataset(str(tmp_path / "empty.tar"), shardshuffle=False, empty_check=False)) == []


def test_fluent_methods_return_new_objects(shards):
    """Each fluent method returns a new pipeline; the original is unchanged."""
    base = wds.WebDataset(shards, shardshuffle=False)
    batched = base.decode().to_tuple("cls", "txt").batched(4)
    assert batched is not base and len(base.pipeline) < len(batched.pipeline)
    first = next(iter(batched))
    assert list(first[0]) == [0, 1, 2, 3] and first[1][0] == "text 0 0"


def test_fluent_surface(shards):
    """map, select, rename, map_dict, map_tuple, slice, rsample, listed/unlisted, unbatched, keys, mcached."""
    ds = wds.WebDataset(shards, shardshuffle=False).decode()
    assert len(list(ds.select(lambda s: s["cls"] % 2 == 0))) == 15
    assert next(iter(ds.rename(label="cls", text="txt;text", keep=False)))["label"] == 0
    assert next(iter(ds.map_dict(cls=lambda c: c + 100)))["cls"] == 100
    assert next(iter(ds.to_tuple("cls txt").map_tuple(str, len))) == ("0", 8)
    assert len(list(ds.slice(5))) == 5
    assert 0 < len(list(ds.rsample(0.5))) < 30
    assert len(list(ds.listed(7).unlisted())) == 30
    rows = list(ds.to_tuple("cls", "txt").batched(4).unbatched())
    assert [int(r[0]) for r in rows] == list(range(30))
    assert list(ds.extract_keys("*.cls"))[0] == (0,)
    assert set(next(iter(ds.rename_keys(label="cls", text="txt")))) >= {"label", "text"}
    cached = ds.mcached()
    assert [s["__key__"] for s in cached] == [s["__key__"] for s in cached]
    assert next(iter(ds.map(lambda s: {"only": s["cls"]}))) == {"only": 0, "__key__": "s0_0000"}


def test_to_tuple_missing_field(shards):
    """to_tuple names the missing field and the fields present."""
    with pytest.raises(ValueError, match="none of the fields.*nope.*present"):
        next(iter(wds.WebDataset(shards, shardshuffle=False).to_tuple("nope")))


@given(st.lists(st.integers(), max_size=200), st.integers(1, 50), st.integers(1, 60), st.integers(0, 2**31))
def test_shuffle_is_a_permutation(items, bufsize, initial, seed):
    """shuffle yields every item exactly once, whatever the buffer sizes."""
    out = list(filters._shuffle(iter(items), bufsize, initial, seed=seed))
    assert sorted(out) == sorted(items)


@given(
    st.lists(st.tuples(st.integers(-1000, 1000), st.floats(allow_nan=False, width=32)), max_size=60),
    st.integers(1, 9),
    st.booleans(),
)
def test_batched_unbatched_identity(rows, batchsize, partial):
    """unbatched(batched(x)) == x (the short last batch kept when partial)."""
    out = list(filters._unbatched(filters._batched(iter(rows), batchsize, partial=partial)))
    expected = rows if partial else rows[: len(rows) // batchsize * batchsize]
    assert [(int(a), float(b)) for a, b in out] == expected


def test_with_length_and_with_epoch_pickle(shards):
    """with_length and with_epoch results pickle (spawn-started workers receive them)."""
    ds = wds.WebDataset(shards, shardshuffle=False).decode().with_length(30)
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone) == 30 and len(list(clone)) == 30
    ep = wds.with_epoch(wds.WebDataset(shards, shardshuffle=False), 12)
    clone = pickle.loads(pickle.dumps(ep))
    assert len(list(clone)) == 12 and len(clone) == 12
    assert len(wds.with_length(ds, 5)) == 5


def test_with_epoch_on_pipeline(shards):
    """with_epoch(n) makes an epoch exactly n items, repeating as needed."""
    assert len(list(wds.WebDataset(shards, shardshuffle=False).with_epoch(45))) == 45


def test_datapipeline_functional_form(shards):
    """DataPipeline with shard list, splitters, tarfile_to_samples and filters."""
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(shards),
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.shuffle(10, seed=1),
        wds.decode(),
        wds.to_tuple("cls"),
        wds.batched(10),
    )
    batches = list(pipeline)
    assert sorted(int(x) for b in batches for x in b[0]) == list(range(30))


def test_compat_stage_composition(shards):
    """url_opener + tar_file_expander + group_by_keys compose as in webdataset."""
    from wds_cloud.tariterators import group_by_keys, tar_file_expander, url_opener

    urls = [{"url": u} for u in shardlists.expand_urls(shards)]
    samples = list(group_by_keys(tar_file_expander(url_opener(urls))))
    assert len(samples) == 30 and samples[10]["__key__"] == "s1_0000"


def test_mock_and_mixing():
    """MockDataset, RoundRobin and a seeded RandomMix."""
    a, b = wds.MockDataset("a", 3), wds.MockDataset("b", 5)
    assert list(wds.RoundRobin([a, b])) == ["a", "b"] * 3
    assert list(wds.RoundRobin([a, b], longest=True)).count("b") == 5
    mix1 = list(wds.RandomMix([a, b], probs=[1, 1], longest=True, seed=3))
    assert (
        mix1 == list(wds.RandomMix([a, b], probs=[1, 1], longest=True, seed=3))
        and sorted(mix1) == ["a"] * 3 + ["b"] * 5
    )


def test_detshuffle_with_string_seed():
    """detshuffle accepts a seed given as text (upstream crashes with WDS_SEED)."""
    stage = wds.detshuffle(10, seed="42")
    a = list(stage.run(iter(range(20))))
    stage2 = wds.detshuffle(10, seed=42)
    assert a == list(stage2.run(iter(range(20)))) and sorted(a) == list(range(20))


def test_single_node_only_message(monkeypatch, shards):
    """Several ranks meeting single_node_only get an error naming the fix."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="nodesplitter=wds.split_by_node"):
        list(wds.WebDataset(shards, shardshuffle=False))
    got = list(wds.WebDataset(shards, shardshuffle=False, nodesplitter=wds.split_by_node))
    assert {s["__url__"][-7:-4] for s in got} == {"001"}


def test_lmdbcached_needs_lmdb(monkeypatch, tmp_path):
    """LMDBCached without the lmdb module says how to install it; under WDS_SECURE it is refused."""
    import sys

    from wds_cloud.errors import MissingExtraError

    monkeypatch.setitem(sys.modules, "lmdb", None)
    with pytest.raises(MissingExtraError, match="pip install lmdb"):
        wds.LMDBCached(str(tmp_path / "db"))
    monkeypatch.setenv("WDS_SECURE", "1")
    with pytest.raises(SecurityError):
        wds.LMDBCached(str(tmp_path / "db"))


def test_tenbin_every_dtype():
    """tenbin round-trips every numeric dtype, uint32 and bool included."""
    for dtype in [
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
    ]:
        a = (np.arange(12) % 2).astype(dtype).reshape(3, 4)
        b = np.zeros((2,), dtype=dtype)
        out = wds.tenbin.decode_buffer(wds.tenbin.encode_buffer([a, b], infos=["x", "y"]), infos=True)
        assert out[1] == ["x", "y"] and np.array_equal(out[0][0], a) and out[0][0].dtype == a.dtype


def test_read_options_group_the_transfer_and_safety_keywords(tmp_path):
    """WebDataset's transfer and safety keywords feed one ReadOptions: either way gives the same dataset; a
    setting given twice with two values is refused; a mix passes the options to every source."""
    from wds_cloud.errors import ConfigError

    urls = []
    for s in range(2):
        urls.append(str(tmp_path / f"o-{s}.tar"))
        with wds.TarWriter(urls[-1]) as sink:
            for i in range(4):
                sink.write({"__key__": f"{s}_{i}", "txt": b"x" * 100})
    options = wds.ReadOptions(retries=3, max_member_size="1KB")
    by_object = wds.WebDataset(urls, shardshuffle=False, options=options)
    by_keywords = wds.WebDataset(urls, shardshuffle=False, retries=3, max_member_size="1KB")
    assert by_object.options == by_keywords.options == options
    assert [s["__key__"] for s in by_object] == [s["__key__"] for s in by_keywords]
    assert wds.WebDataset(urls, options=options, retries=3).options.retries == 3  # the same value twice: fine
    with pytest.raises(ConfigError, match="retries is given twice"):
        wds.WebDataset(urls, options=options, retries=4)
    with pytest.raises(wds.CorruptShardError):  # the limit in the object is the limit applied
        list(wds.WebDataset(urls, shardshuffle=False, options=wds.ReadOptions(max_member_size=64)))
    spec = {"version": 1, "sources": [{"name": "a", "urls": urls}]}
    mixed = wds.WebDataset(spec, options=options)
    assert all(source.options.retries == 3 for source in mixed.sources)
