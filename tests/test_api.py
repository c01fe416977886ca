"""The public API: __all__ is curated; the package imports and reads data without torch."""

import subprocess
import sys
import textwrap

import wds_cloud

BLOCK_TORCH = textwrap.dedent("""
    import sys, importlib.abc
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
    sys.meta_path.insert(0, _Block())
    import importlib.util
    _find = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "torch" else _find(name, *a)
""")


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)], capture_output=True, text=True)


def test_all_matches_public_names():
    """__all__ lists exactly the public names of the package (submodules aside)."""
    public = {n for n in dir(wds_cloud) if not n.startswith("_")}
    submodules = {n for n in public if type(getattr(wds_cloud, n)).__name__ == "module"}
    declared = set(wds_cloud.__all__)
    assert len(declared) == len(wds_cloud.__all__), "duplicates in __all__"
    missing = public - declared - submodules
    assert not missing, f"public but not in __all__: {sorted(missing)}"
    assert not (declared - public - {"__version__"}), "names in __all__ that do not exist"


def test_compat_names_exist():
    """Every package-level name webdataset 1.0.2 code uses is importable from wds_cloud."""
    names = """DataPipeline WebDataset WebLoader FluidInterface FluidWrapper PipelineStage MockDataset with_epoch
    with_length repeatedly SimpleShardList ResampledShards MultiShardSample shardspec resampled non_empty
    single_node_only split_by_node split_by_worker tarfile_samples tarfile_to_samples associate batched unbatched
    decode xdecode detshuffle shuffle extract_keys getfirst info map map_dict map_tuple pipelinefilter rename
    rename_keys rsample select slice to_tuple transform_with Cached LMDBCached Continue Decoder DecodingError
    gzfilter handle_extension imagehandler torch_audio torch_video torch_loads pytorch_weights_only
    reraise_exception warn_and_continue ignore_and_continue warn_and_stop ignore_and_stop RandomMix RoundRobin
    gopen gopen_schemes LRUCleanup pipe_cleaner tenbin utils __version__""".split()
    assert [n for n in names if not hasattr(wds_cloud, n)] == []


def test_submodule_names_exist():
    """Names downstream code imports from submodules exist at the same module paths."""
    import importlib

    wanted = {
        "tariterators": "base_plus_ext valid_sample url_opener tar_file_iterator tar_file_expander group_by_keys "
        "meta_prefix meta_suffix",
        "filters": "_shuffle _select _map _to_tuple _batched _rsample _extract_keys _rename_keys _xdecode "
        "default_collation_fn unlisted log_keys FilterFunction RestCurried compose pipeline "
        "default_decoders find_decoder",
        "autodecode": "ImageHandler imagespecs IMAGE_EXTENSIONS decoders basichandlers default_decoder "
        "unpickle_loads tenbin_loads msgpack_loads npy_loads npz_loads cbor_loads "
        "default_pre_handlers default_post_handlers",
        "shardlists": "expand_urls expand_source envsubst ResampledShardList DirectoryShardList",
        "cache": "FileCache StreamingOpen url_to_cache_name download check_tar_format",
        "gopen": "Pipe rewrite_url reader gopen_file gopen_pipe gopen_curl gopen_error",
        "utils": "enforce_security pytorch_worker_info pytorch_worker_seed make_seed is_iterable identity obsolete "
        "ObsoleteException deprecated glob_with_braces fnmatch_with_braces",
        "tenbin": "encode_buffer decode_buffer read write save load",
        "compat": "check_empty",
        "pipeline": "add_length_method",
    }
    missing = []
    for module, names in wanted.items():
        mod = importlib.import_module(f"wds_cloud.{module}")
        missing += [f"{module}.{n}" for n in names.split() if not hasattr(mod, n)]
    assert missing == []


def test_import_loads_no_plugin_and_works_without_torch(tmp_path):
    """Without torch the package imports, loads no plugin at import, and reads and batches a dataset."""
    import io
    import tarfile

    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tar:
        for i in range(5):
            for ext, data in (("txt", f"t{i}".encode()), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{i:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    out = run_without_torch(f"""
        import wds_cloud as wds, wds_cloud.io.registry as r
        assert not r._registries
        ds = wds.WebDataset({str(shard)!r}, shardshuffle=False).decode().to_tuple("txt", "cls").batched(2)
        batches = list(wds.WebLoader(ds, batch_size=None, num_workers=0))
        # resume works without torch too
        first = wds.WebDataset({str(shard)!r}, shardshuffle=False).shuffle(3, seed=1)
        it = iter(first)
        head = [next(it)["__key__"] for _ in range(2)]
        again = wds.WebDataset({str(shard)!r}, shardshuffle=False).shuffle(3, seed=1)
        again.load_state_dict(first.state_dict())
        keys = head + [s["__key__"] for s in again]
        assert sorted(keys) == ["000", "001", "002", "003", "004"], keys
        # the loader batching without torch: the columns batched() makes (it gave a list of samples: the new
        # user's finding, `keys, cls = batch` failed)
        ds = wds.WebDataset({str(shard)!r}, shardshuffle=False).decode().to_tuple("txt", "cls")
        for txt, cls in wds.WebLoader(ds, batch_size=2, num_workers=2):
            assert type(txt) is list and cls.tolist() == [int(t[1:]) for t in txt], (txt, cls)
        assert "torch" not in sys.modules
        print([b[1].tolist() for b in batches])
    """)
    assert out.stdout.strip() == "[[0, 1], [2, 3], [4]]", out.stderr


def test_torch_image_spec_without_torch():
    """A torch image spec without torch raises MissingExtraError with the install line."""
    out = run_without_torch("""
        import wds_cloud as wds
        try:
            wds.WebDataset("x.tar", shardshuffle=False).decode("torchrgb")
        except wds.MissingExtraError as e:
            print("missing:", e)
    """)
    assert "missing:" in out.stdout and "pip install 'wds_cloud[torch]'" in out.stdout, out.stderr
