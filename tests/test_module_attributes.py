"""webdataset 1.0.2's public module attributes exist at the same module paths (without importing webdataset)."""

import importlib
import pathlib

import pytest

import wds_cloud as wds

#: the public names (dir(), no leading "_") of webdataset 1.0.2's modules that are its own (functions, classes,
#: constants), beyond those tests/test_layout.py pins; found by comparing the two libraries' dir() once
ADDED = {
    "autodecode": "call_extension_handler",
    "cache": "default_cache_dir default_cache_size verbose_cache islocal magic_filetype obsolete",
    "compat": "DataLoader DataPipeline group_by_keys pipelinefilter reraise_exception tar_file_expander",
    "filters": "TorchTensor",
    "multi": "EOF the_protocol",
    "pytorch": "TorchTensor",
    "shardlists": "IterableDataset MSSource check_pid_is_running default_rng envlookup get_pid_from_filename "
    "is_iterable obsolete without_last_extension",
    "tariterators": "trace shardlist",
    "utils": "PipelineStage compute_sample_weights guess_batchsize lookup_sym",
    "writer": "add_handlers cbor_dumps mp_dumps numpy_npz_dumps tenbin_dumps",
}

#: webdataset's own names deliberately not given, each listed with its reason in docs/migrating.md (the names of
#: modules, of the standard library and of typing that its modules import are not its API and are not listed)
LEFT_OUT = {
    "cache": "get_filetype",
    "filters": "combine_values compose2 decode_bin decode_pickle decode_text dict2tuple parse_field_spec pick "
    "tuple2dict",
    "gopen": "gopen_ais gopen_gsutil gopen_hf gopen_htgs info set_options",
    "multi": "all_pids reader",
    "shardlists": "expand",
    "tenbin": "bytedata bytelen check_acceptable_input_type check_infos decode_chunks decode_header encode_chunks "
    "encode_header long_to_short short_to_long magic magic_bytes magic_str read_chunk write_chunk roundup str64 "
    "unstr64",
    "utils": "safe_eval",
}


@pytest.mark.parametrize("module", sorted(ADDED))
def test_webdatasets_module_attributes_exist(module):
    """Each name webdataset 1.0.2 has at a module path is there in ours, and public (no AttributeError)."""
    mod = importlib.import_module(f"wds_cloud.{module}")
    assert [n for n in ADDED[module].split() if not hasattr(mod, n)] == []
    assert [n for n in ADDED[module].split() if n not in getattr(mod, "__all__", ())] == []


def test_names_left_out_are_documented_with_their_reason():
    """Every webdataset name we do not give is named in docs/migrating.md."""
    text = (pathlib.Path(__file__).parent.parent / "docs" / "migrating.md").read_text()
    missing = [
        f"{m}.{n}"
        for m, names in LEFT_OUT.items()
        for n in names.split()
        if f"`{n}`" not in text and f"`{m}.{n}`" not in text
    ]
    assert missing == []


def test_a_replaced_group_by_keys_reading_trace_works(tmp_path):
    """stable-audio-tools' replacement group_by_keys reads tariterators.trace (False, as webdataset's) and
    valid_sample; the pipeline reads through it."""
    from wds_cloud.writer import TarWriter

    with TarWriter(str(tmp_path / "a.tar")) as sink:
        for i in range(3):
            sink.write({"__key__": f"s{i}", "txt": f"t{i}"})
    seen = []

    def group_by_keys(data, keys=wds.tariterators.base_plus_ext, lcase=True, suffixes=None, handler=None):
        current = None
        for filesample in data:
            if not filesample:  # the end-of-shard marker tar_file_expander yields, as webdataset's does
                continue
            prefix, suffix = keys(filesample["fname"])
            if wds.tariterators.trace:
                seen.append(prefix)
            if current is None or prefix != current["__key__"]:
                if wds.tariterators.valid_sample(current):
                    yield current
                current = {"__key__": prefix, "__url__": filesample["__url__"]}
            current[suffix] = filesample["data"]
        if wds.tariterators.valid_sample(current):
            yield current

    assert wds.tariterators.trace is False
    saved = wds.tariterators.group_by_keys
    wds.tariterators.group_by_keys = group_by_keys
    try:
        pipe = wds.DataPipeline(wds.SimpleShardList([str(tmp_path / "a.tar")]), wds.tarfile_to_samples())
        assert [s["txt"] for s in pipe] == [b"t0", b"t1", b"t2"] and seen == []
        wds.tariterators.trace = True
        assert len(list(pipe)) == 3 and seen == ["s0", "s1", "s2"]
    finally:
        wds.tariterators.group_by_keys = saved
        wds.tariterators.trace = False


def test_webdatasets_small_helpers_mean_what_they_do_there(tmp_path):
    """The helpers added at webdataset's paths behave as there."""
    from wds_cloud import autodecode, cache, multi, shardlists, tariterators, utils, writer

    assert autodecode.call_extension_handler("x.SEG.png", b"abc", len, ["seg.png"]) == 3
    assert autodecode.call_extension_handler("x.png", b"abc", len, ["jpg", "seg.png"]) is None
    assert cache.islocal("/a/b.tar") and cache.islocal("file:///a.tar") and not cache.islocal("s3://b/a.tar")
    (tmp_path / "x.gz").write_bytes(b"\x1f\x8b\x08rest")
    assert cache.magic_filetype(str(tmp_path / "x.gz")).endswith("gzip compressed data")
    assert isinstance(cache.default_cache_dir, str) and cache.default_cache_size > 0
    assert multi.EOF(index=2).index == 2 and isinstance(multi.the_protocol, int)
    assert shardlists.get_pid_from_filename("shard.tar._4242_") == 4242
    assert shardlists.get_pid_from_filename("shard.tar") is None
    assert shardlists.without_last_extension("a/b.c.tar") == "a/b.c"
    assert shardlists.MSSource(name="a").perepoch == -1
    assert list(tariterators.shardlist("s-{0..2}.tar")) == [{"url": f"s-{i}.tar"} for i in range(3)]
    assert sorted(x["url"] for x in tariterators.shardlist(["a", "b"], shuffle=True)) == ["a", "b"]
    assert utils.guess_batchsize(([1, 2, 3], [4, 5, 6])) == 3
    assert list(utils.compute_sample_weights([(10, 1.0), (5, 4.0)])) == [0.5, 1.0]
    assert utils.lookup_sym("shuffle", [".filters"]) is wds.filters.shuffle
    table: dict = {}
    writer.add_handlers(table, "a b", len)
    assert table == {"a": len, "b": len}
