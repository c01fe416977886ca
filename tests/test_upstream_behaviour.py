"""webdataset 1.0.2 behaviours that code relies on, each written from its description."""

import bz2
import gzip
import importlib
import io
import lzma
import os
import sys
import tarfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud import autodecode, cache, filters, shardlists, tenbin, utils
from wds_cloud.errors import CorruptShardError, SecurityError

gopen_module = importlib.import_module("wds_cloud.gopen")  # the package attribute is the function, as upstream


def tar_bytes(n=100, payload=2048):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(n):
            for ext, data in (("txt", f"sample {i}".encode()), ("bin", os.urandom(payload))):
                info = tarfile.TarInfo(f"k{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# damaged shards


def test_a_damaged_shard_raises_tarfile_read_error(tmp_path):
    """CorruptShardError is also tarfile.ReadError (and ValueError), so upstream's except clauses work."""
    path = tmp_path / "cut.tar"
    path.write_bytes(tar_bytes(10)[:5000])
    with pytest.raises(tarfile.ReadError) as info:
        list(wds.WebDataset(str(path), shardshuffle=False))
    assert isinstance(info.value, CorruptShardError) and isinstance(info.value, ValueError)


def _zstd(data):
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize(
    "suffix,compress",
    [
        (".tgz", lambda b: gzip.compress(b, mtime=0)),
        (".tar.bz2", lambda b: bz2.compress(b, 1)),  # 100 kB blocks: bz2 recovers whole blocks only
        (".tar.xz", lzma.compress),
        (".tar.zst", _zstd),
    ],
)
def test_a_cut_compressed_shard_keeps_its_complete_samples(tmp_path, suffix, compress):
    """A compressed shard cut at 70% yields the complete samples before the cut, then the error."""
    raw = tar_bytes(100, payload=12000)  # random payload: the cut falls at about 70% of the tar too
    data = compress(raw)
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(data[: int(len(data) * 0.7)])
    # what a decompressor can recover from the cut stream: the samples wholly inside it
    got = []
    with pytest.raises(tarfile.ReadError):
        for sample in wds.WebDataset(str(path), shardshuffle=False):
            got.append(sample["__key__"])
    assert 60 <= len(got) <= 70
    assert got == [f"k{i:04d}" for i in range(len(got))]
    seen = []
    handled = []
    for sample in wds.WebDataset(str(path), shardshuffle=False, handler=lambda exn: handled.append(exn) or True):
        seen.append(sample["__key__"])
    assert seen == got and len(handled) == 1


# xdecode


def test_xdecode_passes_streams_and_keeps_upstream_precedence():
    """Decoders get a stream; keyword decoders first, then later positional pairs, then earlier, then defaults."""
    sample = {"__key__": "a", "jpg": b"JPG", "txt": b"hello", "cls": b"7", "n": 5}
    out = next(
        filters._xdecode(
            [sample],
            ("*.jpg", lambda stream: ("earlier", stream.read())),
            ("*.jpg", lambda stream: ("later", stream.read())),
            ("*.txt", lambda stream: ("positional", stream.read())),
            txt=lambda stream: ("keyword", stream.read()),
            n=lambda value: value * 2,
        )
    )
    assert out["jpg"] == ("later", b"JPG")
    assert out["txt"] == ("keyword", b"hello")
    assert out["cls"] == 7  # the default table
    assert out["n"] == 10  # a value that is not bytes is passed as it is


def test_default_decoders_take_streams_too():
    """The public default_decoders table decodes a stream as well as bytes."""
    decode = filters.find_decoder(filters.default_decoders, "x.json")
    assert decode(io.BytesIO(b'{"a": 1}')) == {"a": 1} == decode(b'{"a": 1}')


def test_xdecode_still_refuses_pickle():
    """The pickle decoders in the default table stay refused unless allowed."""
    import pickle

    with pytest.raises(ValueError, match="refusing to decode field 'pyd' \\(pickle\\)"):
        list(filters._xdecode([{"__key__": "a", "pyd": pickle.dumps(1)}]))


# extract_keys


def test_extract_keys_alternatives_lists_and_every_key():
    """Patterns are ';' alternatives or lists; a match is the key or '.'+key; __key__ is a candidate."""
    sample = {"__key__": "k", "__url__": "u", "png": b"P", "cls": b"1", "seg.png": b"S"}
    assert next(filters._extract_keys([sample], "__key__", "jpg;png", ("cls",))) == ("k", b"P", b"1")
    assert next(filters._extract_keys([sample], "*.png", duplicate_is_error=False)) == (b"P",)  # first in order
    with pytest.raises(ValueError):
        next(filters._extract_keys([sample], "*png"))  # png and seg.png both match
    with pytest.raises(ValueError):
        next(filters._extract_keys([sample], "jpg"))
    assert next(filters._extract_keys([sample], "jpg", "cls", ignore_missing=True)) == (b"1",)


# collation


def test_default_collation_gives_a_tuple_of_columns():
    """Tuples and lists give a tuple of columns; dicts give a dict."""
    batch = filters.default_collation_fn([(1, "a"), (2, "b")])
    assert isinstance(batch, tuple) and batch[1] == ["a", "b"] and list(batch[0]) == [1, 2]
    assert isinstance(filters.default_collation_fn([[1, "a"], [2, "b"]]), tuple)
    assert set(filters.default_collation_fn([{"x": 1}, {"x": 2}])) == {"x"}


def test_batched_to_tuple_gives_tuples(tmp_path):
    """`.to_tuple(...).batched(n)` batches are tuples, as upstream."""
    from .conftest import make_shards

    spec = make_shards(tmp_path, nshards=1, per_shard=4)
    batch = next(iter(wds.WebDataset(spec, shardshuffle=False).to_tuple("txt", "cls").batched(2)))
    assert isinstance(batch, tuple) and len(batch) == 2


# resampling


def test_resampled_is_a_curried_stage_with_a_fresh_seed_each_pass():
    """resampled(n) collects its input and yields n picks; the direct generator stays as resampled_."""
    urls = [f"u{i}" for i in range(5)]
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls), wds.resampled(27))
    first, second = list(pipeline), list(pipeline)
    assert len(first) == len(second) == 27
    assert {item["url"] for item in first} <= set(urls)
    assert len(list(shardlists.resampled_(iter(urls), 4))) == 4
    assert wds.shardlists.resampled is wds.resampled


def test_resampled_shards_signature_and_epochs():
    """ResampledShards(urls, nshards, seed, worker_seed, deterministic, ...): attributes and seeding per pass."""
    import inspect

    names = list(inspect.signature(wds.ResampledShards).parameters)
    assert names == ["urls", "nshards", "seed", "worker_seed", "deterministic", "max_urls", "empty_check"]
    urls = [f"u{i:02d}" for i in range(20)]
    shards = wds.ResampledShards(urls, 10, 3, lambda: 0, True)
    assert (shards.urls, shards.nshards, shards.seed, shards.deterministic, shards.epoch) == (urls, 10, 3, True, -1)
    epoch0 = [x["url"] for x in shards]
    assert shards.epoch == 0
    epoch1 = [x["url"] for x in shards]
    assert shards.epoch == 1 and epoch0 != epoch1
    again = wds.ResampledShards(urls, 10, 3, lambda: 0, True)
    assert [x["url"] for x in again] == epoch0
    other_worker = wds.ResampledShards(urls, 10, 3, lambda: 1, True)
    assert [x["url"] for x in other_worker] != epoch0
    assert wds.ResampledShards(urls).worker_seed is utils.pytorch_worker_seed


# DirectoryShardList


@pytest.mark.filterwarnings("ignore:DirectoryShardList.*work queue:UserWarning")  # the warning: test_torch_habits
def test_directory_shard_list_claims_and_recycles(tmp_path):
    """Each item is a claimed file; asking for the next recycles the previous by mode."""
    for name in ("a.tar", "b.tar", "c.tgz"):
        (tmp_path / name).write_bytes(b"x")
    listing = shardlists.DirectoryShardList(str(tmp_path), poll=None, mode="unlink", select="oldest")
    it = iter(listing)
    first = next(it)["url"]
    assert first.endswith(f"._{os.getpid()}_") and os.path.exists(first)
    second = next(it)["url"]
    assert not os.path.exists(first) and os.path.exists(second)
    rest = list(it)
    assert len(rest) == 1 and not any(tmp_path.iterdir())


@pytest.mark.filterwarnings("ignore:DirectoryShardList.*work queue:UserWarning")  # the warning: test_torch_habits
def test_directory_shard_list_keep_and_resample(tmp_path):
    """mode='keep' renames to <file>._done_; mode='resample' renames back; an abandoned iterator gives its claim
    its name back."""
    (tmp_path / "a.tar").write_bytes(b"x")
    kept = iter(shardlists.DirectoryShardList(str(tmp_path), poll=None, mode="keep"))
    claimed = next(kept)["url"]
    assert list(kept) == []
    assert os.path.exists(str(tmp_path / "a.tar._done_")) and not os.path.exists(claimed)
    (tmp_path / "b.tar").write_bytes(b"x")
    resample = iter(shardlists.DirectoryShardList(str(tmp_path), poll=None, mode="resample"))
    claimed = next(resample)["url"]
    assert claimed.endswith(f"b.tar._{os.getpid()}_")
    next(resample)  # the previous claim went back and is claimed again
    del resample
    assert not os.path.exists(claimed) and os.path.exists(str(tmp_path / "b.tar"))  # abandoned: name given back


@pytest.mark.filterwarnings("ignore:DirectoryShardList.*work queue:UserWarning")  # the warning: test_torch_habits
def test_an_abandoned_iterators_claim_stays_where_webdataset_leaves_it(tmp_path):
    """mode='unlink': a consumer that stopped in the middle of a shard gets its name back, never deleted (it was:
    the shard was gone, unread to its end); a new iterator of the same list offers it again."""
    for name in ("a.tar", "b.tar"):
        (tmp_path / name).write_bytes(b"x")
    listing = shardlists.DirectoryShardList(str(tmp_path), poll=None, mode="unlink", select="oldest")
    first = iter(listing)
    abandoned = next(first)["url"]
    del first
    assert not os.path.exists(abandoned) and (tmp_path / "a.tar").exists()  # its name back, not deleted
    again = iter(listing)
    assert len(list(again)) == 2 and not any(tmp_path.iterdir())  # both read to their end, then deleted


@pytest.mark.filterwarnings("ignore:DirectoryShardList.*work queue:UserWarning")  # the warning: test_torch_habits
def test_directory_shard_list_rejects_unknown_select_and_cleans_dead_claims(tmp_path):
    """Unknown select values are a ValueError; claims of processes that are gone are recycled."""
    with pytest.raises(ValueError, match="select"):
        shardlists.DirectoryShardList(str(tmp_path), select="newest")
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    (tmp_path / f"a.tar._{proc.pid}_").write_bytes(b"x")
    assert shardlists.cleanup_files_without_processes(str(tmp_path)) == [str(tmp_path / f"a.tar._{proc.pid}_")]
    assert (tmp_path / "a.tar").exists()


@pytest.mark.filterwarnings("ignore:DirectoryShardList.*work queue:UserWarning")  # the warning: test_torch_habits
def test_webdataset_reads_a_directory(tmp_path):
    """WebDataset("dir/") reads the shards found in the directory (resampled forever)."""
    (tmp_path / "s.tar").write_bytes(tar_bytes(3, payload=10))
    keys = [s["__key__"] for _, s in zip(range(7), wds.WebDataset(str(tmp_path) + "/", shardshuffle=False))]
    assert len(keys) == 7 and set(keys) <= {"k0000", "k0001", "k0002"}


# cache openers


def test_cache_openers_accept_bare_urls(tmp_path):
    """StreamingOpen and FileCache take URL strings as well as dicts; local_path is set for local files."""
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes(2, payload=10))
    for stage in (cache.StreamingOpen(), cache.FileCache(str(tmp_path / "cache"))):
        for item in (str(path), "file://" + str(path), {"url": str(path)}):
            opened = next(iter(stage.run([item])))
            assert opened["url"] == (item if isinstance(item, str) else item["url"])
            assert opened["local_path"] == str(path)
            assert opened["stream"].read(5)
            opened["stream"].close()


# security


@pytest.fixture
def secure():
    utils.enforce_security = True
    yield
    utils.enforce_security = False


def test_security_refusals_are_value_errors_with_upstream_wording(secure, tmp_path):
    """With enforce_security, pipe:, local paths and file: URLs are refused with a ValueError."""
    path = tmp_path / "x"
    path.write_bytes(b"data")
    with pytest.raises(ValueError, match="cannot open pipe URLs"):
        wds.gopen("pipe:cat " + str(path))
    for url in (str(path), "file://" + str(path)):
        with pytest.raises(ValueError, match="cannot open local files") as info:
            wds.gopen(url)
        assert isinstance(info.value, SecurityError) and isinstance(info.value, PermissionError)


def test_security_refuses_rewriting_and_torch_loads(secure, monkeypatch):
    """With enforce_security, rewrite_url refuses while rules are set, and torch_loads always refuses."""
    monkeypatch.setenv("GOPEN_REWRITE", "a/=b/")
    with pytest.raises(ValueError, match="cannot rewrite URLs"):
        gopen_module.rewrite_url("a/x")
    monkeypatch.delenv("GOPEN_REWRITE")
    assert gopen_module.rewrite_url("a/x") == "a/x"
    monkeypatch.setenv("WDS_ALLOW_PICKLE", "1")
    with pytest.raises(ValueError, match="enforce_security"):
        autodecode.torch_loads(b"anything")


def test_security_off_changes_nothing(tmp_path, monkeypatch):
    """Without enforce_security, local files open and rewriting works."""
    path = tmp_path / "x"
    path.write_bytes(b"data")
    with wds.gopen(str(path)) as stream:
        assert stream.read() == b"data"
    monkeypatch.setenv("GOPEN_REWRITE", "a/=b/")
    assert gopen_module.rewrite_url("a/x") == "b/x"


def test_stdin_reads_with_security_on_and_after_replacement(secure, monkeypatch):
    """gopen('-') reads the current sys.stdin, also when security is on."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"from a pipe")))
    assert wds.gopen("-").read() == b"from a pipe"


# tensors


def test_ten_fields_decode_to_a_list_of_arrays():
    """.ten / .tb decoding returns a list of arrays, a list of one for a single array."""
    one = tenbin.encode_buffer([np.arange(3)])
    two = tenbin.encode_buffer([np.arange(3), np.ones((2, 2))])
    for key in ("x.ten", "x.tb"):
        decoded = autodecode.default_decoder({"__key__": "k", key: one})[key]
        assert isinstance(decoded, list) and len(decoded) == 1
        assert len(autodecode.default_decoder({"__key__": "k", key: two})[key]) == 2


def test_torch_loads_maps_to_cpu_and_weights_only_is_a_flag():
    """torch_loads loads tensors onto the CPU; pytorch_weights_only is a flag, as upstream."""
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    loaded = autodecode.torch_loads(buf.getvalue())
    assert loaded["w"].device.type == "cpu"
    assert autodecode.pytorch_weights_only is False and wds.pytorch_weights_only is False


# module paths


def test_upstream_module_paths_import():
    """webdataset.multi and webdataset.typecheck exist as module paths."""
    multi = importlib.import_module("wds_cloud.multi")
    typecheck = importlib.import_module("wds_cloud.typecheck")
    assert "filters" in typecheck.modules
    items = list(multi.MultiLoader(wds.DataPipeline(lambda: iter(range(5))), workers=0))
    assert items == list(range(5))


def test_group_by_keys_runs_the_shard_readers_grouping_with_webdatasets_rules():
    """group_by_keys (over member dicts) keeps upstream's rules on the one grouping loop: markers end a shard,
    a shard that ended in an error drops its cut-short sample, a key-only last sample is kept, a repeated field
    goes to the handler, and a sample never spans two URLs even without markers."""
    from wds_cloud.tariterators import group_by_keys, tar_file_expander

    def m(url, name, data=b"x"):
        return {"fname": name, "data": data, "__url__": url}

    stream = [
        m("a", "k1.txt"),
        m("a", "k1.cls"),
        m("a", "k2.txt"),
        {},  # shard a ends cleanly
        m("c", "k4.txt"),
        m("c", "k5.json"),
        m("d", "k5.txt"),
    ]  # no markers: the URL changes
    samples = list(group_by_keys(iter(stream), suffixes={"txt", "cls"}))
    assert [(s["__key__"], s["__url__"], sorted(k for k in s if not k.startswith("__"))) for s in samples] == [
        ("k1", "a", ["cls", "txt"]),
        ("k2", "a", ["txt"]),
        ("k4", "c", ["txt"]),
        ("k5", "c", []),
        ("k5", "d", ["txt"]),
    ]
    # a shard that ended in an error: the expander yields its members only (no marker, as webdataset), and
    # group_by_keys, told through a channel user code never sees, drops the sample it cut short
    whole = io.BytesIO()
    with tarfile.open(fileobj=whole, mode="w") as tar:
        for name in ("k3.txt", "k3.cls", "k4.txt"):
            info = tarfile.TarInfo(name)
            info.size = 600
            tar.addfile(info, io.BytesIO(b"y" * 600))
    cut = whole.getvalue()[: 512 + 1024 + 512 + 100]  # k3.txt whole, k3.cls cut short
    sources = [{"url": "b", "stream": io.BytesIO(cut)}, {"url": "e", "stream": io.BytesIO(whole.getvalue())}]
    members = list(
        tar_file_expander(
            iter([dict(s, stream=io.BytesIO(s["stream"].getvalue())) for s in sources]),
            handler=lambda e: True,
            eof_value=None,
        )
    )
    assert all(set(x) == {"fname", "data", "__url__"} for x in members)
    grouped = list(group_by_keys(tar_file_expander(iter(sources), handler=lambda e: True)))
    assert [(s["__key__"], s["__url__"]) for s in grouped] == [("k3", "e"), ("k4", "e")]
    with pytest.raises(ValueError, match="repeats the field 'txt'"):  # a SampleError: the tar is sound
        list(group_by_keys([m("a", "k1.txt"), m("a", "k1.txt")]))
    seen = []
    assert [
        s["txt"]
        for s in group_by_keys(
            [m("a", "k1.txt", b"1"), m("a", "k1.txt", b"2")], handler=lambda e: seen.append(e) or True
        )
    ] == [b"1"]
    assert len(seen) == 1


def test_url_to_cache_name_refuses_a_non_string_as_webdataset_does():
    """webdataset asserts a string (AssertionError); ours is also a TypeError naming the type."""
    with pytest.raises(AssertionError, match="not int"):
        cache.url_to_cache_name(5)
    with pytest.raises(TypeError):
        cache.url_to_cache_name(None)


def test_the_pickle_refusal_under_enforce_security_carries_webdatasets_sentence(monkeypatch):
    import pickle

    monkeypatch.setattr(utils, "enforce_security", True)
    with pytest.raises(ValueError, match="Unpickling is not allowed for security reasons when enforce_security"):
        autodecode.Decoder([])({"__key__": "k", "pyd": pickle.dumps(1)})


def _first_dot_key(name):
    """webdataset 1.0.2's key rule, as its documentation states it: the key is a run of characters without a dot,
    after a folder prefix ending in a slash (the longest one that works, or none), then a dot, and the field is
    the rest, which holds no slash."""
    for start in [i + 1 for i in reversed(range(len(name))) if name[i] == "/"] + [0]:
        dot = name.find(".", start)
        if dot <= start or "/" in name[dot + 1 :]:
            continue
        return name[:dot], name[dot + 1 :]
    return None, None


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="ab./", max_size=9))
def test_the_key_rule_is_webdatasets_for_any_name(name):
    """The 44 adversary found ``d/.hidden`` skipped where webdataset makes it key ``d/``, field ``hidden``."""
    from wds_cloud.tar.samples import base_plus_ext

    assert base_plus_ext(name) == _first_dot_key(name)


@pytest.mark.parametrize("mapped", [False, True])
def test_a_dot_name_in_a_folder_is_a_field_of_the_folders_key_in_every_reader(tmp_path, mapped, monkeypatch):
    import io
    import tarfile

    from wds_cloud.tar import table

    monkeypatch.setattr(table, "SETTLED", -1.0)
    monkeypatch.setenv("WDS_MMAP", "1" if mapped else "0")
    path = tmp_path / "d.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name in ("d/.hidden", "d/..x", "e.f/.g", "k.txt"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))
    for _ in range(3):  # the first pass, and (mapped) those from the member table
        got = [
            {k: v for k, v in s.items() if k[:2] != "__" or k == "__key__"}
            for s in wds.WebDataset(str(path), shardshuffle=False)
        ]
        assert got == [{"__key__": "d/", "hidden": b"1", ".x": b"1"}, {"__key__": "k", "txt": b"1"}]
