"""Module-level functions and tables that webdataset users replace take effect here too (issue 42).

NeMo assigns ``webdataset.tariterators.url_opener``; stable-audio-tools and Lhotse replace ``group_by_keys`` or
``tar_file_expander``; users add decoders to ``autodecode.decoders``. Each test replaces one the way those
projects do (``monkeypatch`` puts it back) and checks it is called as webdataset calls it.
"""

import logging

import pytest

import wds_cloud as wds
from wds_cloud import autodecode, tariterators
from wds_cloud.errors import NotResumableError, StateMismatchError
from wds_cloud.handlers import reraise_exception


def keys_of(samples):
    return [s["__key__"] for s in samples]


def pipeline(shards, *stages, **reader_kw):
    return wds.DataPipeline(wds.SimpleShardList(shards), wds.tarfile_to_samples(**reader_kw), *stages)


def file_opener(opened=None):
    """A url_opener of the kind trainers write (NeMo's shape): opens each shard itself, noting its URL."""

    def opener(data, handler=reraise_exception, **kw):
        for sample in data:
            if opened is not None:
                opened.append(sample["url"])
            sample.update(stream=open(sample["url"], "rb"))
            yield sample

    return opener


def test_a_replaced_url_opener_opens_every_shard_of_tarfile_to_samples(shards, monkeypatch):
    """NeMo's habit: ``tariterators.url_opener = mine``; tarfile_to_samples() then opens the shards through it."""
    opened = []

    nemo_opener = file_opener(opened)

    expected = keys_of(pipeline(shards))
    monkeypatch.setattr(tariterators, "url_opener", nemo_opener)
    assert keys_of(pipeline(shards)) == expected
    assert len(opened) == 3
    assert keys_of(wds.tariterators.tarfile_samples(wds.SimpleShardList(shards))) == expected


def test_the_override_is_looked_up_when_a_pass_begins_not_when_the_stage_is_built(shards, monkeypatch):
    """As in webdataset, a stage built before the assignment uses the replaced function from its next pass on."""
    opened = []

    mine = file_opener(opened)

    ds = pipeline(shards)
    first = keys_of(ds)
    monkeypatch.setattr(tariterators, "url_opener", mine)
    assert keys_of(ds) == first and len(opened) == 3
    monkeypatch.undo()
    assert keys_of(ds) == first and len(opened) == 3  # restored: our reader again


def test_a_replaced_group_by_keys_groups_the_members(shards, monkeypatch):
    """stable-audio-tools' habit: its own group_by_keys, called with the members and handler=."""
    calls = []

    def grouping(data, keys=tariterators.base_plus_ext, lcase=True, suffixes=None, handler=None):
        calls.append(handler)
        current = None
        for item in data:
            if item == {}:  # webdataset's end of a shard
                continue
            prefix, suffix = keys(item["fname"])
            if current is None or current["__key__"] != prefix:
                if current is not None:
                    yield current
                current = {"__key__": prefix, "__url__": item["__url__"]}
            current[suffix.upper()] = item["data"]
        if current is not None:
            yield current

    monkeypatch.setattr(tariterators, "group_by_keys", grouping)
    samples = list(pipeline(shards, handler=wds.warn_and_continue))
    assert len(samples) == 30 and set(samples[0]) == {"__key__", "__url__", "TXT", "CLS", "JSON"}
    assert calls == [wds.warn_and_continue]


def test_a_replaced_tar_file_expander_with_an_older_signature_is_called_as_it_expects(shards, monkeypatch):
    """A replacement written for an older webdataset takes (data, handler) only: no keyword it lacks is passed."""
    seen = []

    def expander(data, handler=reraise_exception):
        for source in data:
            seen.append(source["url"])
            with source["stream"]:
                for member in tariterators.tar_file_iterator(source["stream"]):
                    member["__url__"] = source["url"]
                    yield member
            yield {}

    expected = keys_of(pipeline(shards))
    monkeypatch.setattr(tariterators, "tar_file_expander", expander)
    assert keys_of(pipeline(shards)) == expected and len(seen) == 3


def test_a_replaced_tar_file_iterator_reads_the_members(shards, monkeypatch):
    """webdataset's expander calls the module's tar_file_iterator; replacing it alone takes effect too."""
    names = []

    def iterate(fileobj, handler=reraise_exception, **kw):
        for member in tariterators._OURS["tar_file_iterator"](fileobj, handler=handler, **kw):
            names.append(member["fname"])
            yield member

    expected = keys_of(pipeline(shards))
    monkeypatch.setattr(tariterators, "tar_file_iterator", iterate)
    assert keys_of(pipeline(shards)) == expected and len(names) == 90


def test_state_dict_names_the_override_and_strict_refuses(shards, monkeypatch, caplog):
    """A pass read through a replaced function has no exact state: state_dict() never raises (an inexact
    state, logged, naming the function); strict=True raises NotResumableError naming it."""

    mine = file_opener()

    monkeypatch.setattr(tariterators, "url_opener", mine)
    ds = pipeline(shards, wds.shuffle(5, seed=1))
    it = iter(ds)
    for _ in range(7):
        next(it)
    with caplog.at_level(logging.WARNING, logger="wds_cloud"):
        state = ds.state_dict()
    assert state.get("inexact")
    assert "tariterators.url_opener" in repr(state) + caplog.text
    with pytest.raises(NotResumableError, match="tariterators.url_opener"):
        ds.state_dict(strict=True)
    assert len(list(it)) == 23  # iteration itself is untouched


def test_a_loaded_state_is_refused_when_the_reader_is_replaced(shards, monkeypatch):
    """A resume is exact or refused: a state loaded into a pass that the replaced functions would read."""
    ds = pipeline(shards)
    it = iter(ds)
    for _ in range(4):
        next(it)
    state = ds.state_dict()
    again = pipeline(shards)
    again.load_state_dict(state)

    def mine(data, handler=reraise_exception, **kw):
        yield from data

    monkeypatch.setattr(tariterators, "url_opener", mine)
    with pytest.raises(StateMismatchError, match="url_opener"):
        next(iter(again))


def test_restored_functions_give_exact_states_again(shards, monkeypatch):
    """Once the library's own function is put back, the reader resumes exactly."""
    monkeypatch.setattr(tariterators, "url_opener", lambda data, handler=None, **kw: iter(()))
    monkeypatch.undo()
    ds = pipeline(shards)
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(11)]
    state = ds.state_dict()
    again = pipeline(shards)
    again.load_state_dict(state)
    assert head + keys_of(again) == keys_of(pipeline(shards))


def test_the_override_reaches_dataloader_workers(shards, monkeypatch):
    """Assigned before the loader starts, the replacement is what forked workers call (plain iteration never
    raises from resume machinery the user did not ask for)."""
    torch = pytest.importorskip("torch")  # noqa: F841

    mine = file_opener()

    monkeypatch.setattr(tariterators, "url_opener", mine)
    ds = wds.DataPipeline(
        wds.SimpleShardList(shards), wds.split_by_worker, wds.tarfile_to_samples(), wds.to_tuple("__key__")
    )
    loader = wds.WebLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert sorted(k for (k,) in loader) == sorted(keys_of(pipeline(shards)))


def test_webdataset_reads_with_its_own_opener_as_webdataset_1_0_2_does(shards, monkeypatch):
    """webdataset 1.0.2's WebDataset opens shards with its own opener (not tariterators.url_opener), so a
    process that replaced url_opener (NeMo does it on import) keeps WebDataset's exact resume."""
    monkeypatch.setattr(tariterators, "url_opener", lambda data, handler=None, **kw: iter(()))
    ds = wds.WebDataset(shards, shardshuffle=False)
    it = iter(ds)
    next(it)
    assert not ds.state_dict().get("inexact")
    assert len(list(it)) == 29


def test_a_decoder_added_to_the_table_after_decoding_began_is_used(shards, monkeypatch):
    """``autodecode.decoders["ext"] = fn`` takes effect even for a Decoder that already planned that field."""
    decoder = autodecode.Decoder()
    sample = {"__key__": "k", "foo": b"abc"}
    assert decoder(sample)["foo"] == b"abc"
    monkeypatch.setitem(autodecode.decoders, "foo", lambda data: data.decode().upper())
    assert decoder(sample)["foo"] == "ABC"
    monkeypatch.setitem(autodecode.decoders, "json", lambda data: "mine")
    assert autodecode.Decoder()({"__key__": "k", "json": b"{}"})["json"] == "mine"


def test_a_scheme_assigned_in_gopen_schemes_opens_the_shards(shards, monkeypatch):
    """``gopen_schemes["myscheme"] = fn``: webdataset's way to add a scheme; the reader opens through it."""
    calls = []

    def opener(url, mode="rb", bufsize=8192, **kw):
        calls.append(url)
        return open(url[len("myscheme://") :], "rb")

    monkeypatch.setitem(wds.gopen_schemes, "myscheme", opener)
    urls = [f"myscheme://{u}" for u in wds.shardlists.expand_urls(shards)]
    assert len(list(pipeline(urls))) == 30 and len(calls) >= 3


def test_a_table_assigned_to_writer_default_handlers_encodes(tmp_path, monkeypatch):
    """``writer.default_handlers = mine`` (a table of one's own, as webdataset's make_encoder reads it) is what
    TarWriter(encoder=True) encodes with; a handler added to the table is heard too."""
    import tarfile

    from wds_cloud import writer

    table = dict(writer.default_handlers)
    table["xyz"] = lambda value: b"<" + bytes(value) + b">"
    monkeypatch.setattr(writer, "default_handlers", table)
    with wds.TarWriter(str(tmp_path / "a.tar")) as sink:
        sink.write({"__key__": "k", "xyz": [1, 2], "cls": 3})
    with tarfile.open(tmp_path / "a.tar") as tar:
        assert tar.extractfile("k.xyz").read() == b"<\x01\x02>" and tar.extractfile("k.cls").read() == b"3"


def test_a_one_letter_scheme_assigned_in_gopen_schemes_opens_the_shards(shards, monkeypatch):
    """webdataset reads ``x://path`` as the scheme ``x``: once user code assigns ``gopen_schemes["x"]``, gopen,
    tarfile_to_samples and WebDataset open through it (unassigned, a one-letter prefix stays a drive letter)."""
    calls = []

    def opener(url, mode="rb", bufsize=8192, **kw):
        calls.append(url)
        return open(url[len("x://") :], "rb")

    monkeypatch.setitem(wds.gopen_schemes, "x", opener)
    urls = [f"x://{u}" for u in wds.shardlists.expand_urls(shards)]
    with wds.gopen(urls[0]) as stream:
        assert stream.read(1)
    assert len(list(pipeline(urls))) == 30
    assert len(list(wds.WebDataset(urls, shardshuffle=False))) == 30
    assert len(calls) >= 7


def test_webdataset_reads_members_through_a_replaced_tar_file_iterator(shards, monkeypatch):
    """webdataset 1.0.2's WebDataset expands shards with tariterators.tar_file_iterator as it is when it runs: a
    replacement takes effect there too (only url_opener is WebDataset's own)."""
    ours = tariterators.tar_file_iterator

    def marked(fileobj, handler=reraise_exception, **kw):
        for member in ours(fileobj, handler=handler, **kw):
            member["data"] = member["data"] + b"!"
            yield member

    monkeypatch.setattr(tariterators, "tar_file_iterator", marked)
    sample = next(iter(wds.WebDataset(shards, shardshuffle=False)))
    assert sample["txt"].endswith(b"!")


def test_webdataset_groups_with_a_replaced_compat_group_by_keys_and_expander(shards, monkeypatch):
    """webdataset's WebDataset takes group_by_keys and tar_file_expander from its compat module: replacing them
    there reaches it."""
    from wds_cloud import compat

    def grouping(data, handler=None, **kw):
        for sample in tariterators.group_by_keys(data, handler=handler, **kw):
            sample["G"] = True
            yield sample

    def expander(data, handler=reraise_exception, **kw):
        for member in tariterators.tar_file_expander(data, handler=handler, **kw):
            if member:
                member["data"] = member["data"] + b"E"
            yield member

    monkeypatch.setattr(compat, "group_by_keys", grouping)
    monkeypatch.setattr(compat, "tar_file_expander", expander)
    sample = next(iter(wds.WebDataset(shards, shardshuffle=False)))
    assert sample["G"] is True and sample["txt"].endswith(b"E")


@pytest.mark.parametrize("make", ["pipeline", "webdataset"])
def test_a_replaced_valid_sample_decides_which_samples_come(shards, monkeypatch, make):
    """group_by_keys asks tariterators.valid_sample of each sample (webdataset looks it up when it runs)."""
    monkeypatch.setattr(tariterators, "valid_sample", lambda sample: sample["__key__"].endswith("1"))
    ds = pipeline(shards) if make == "pipeline" else wds.WebDataset(shards, shardshuffle=False)
    assert keys_of(ds) == ["s0_0001", "s1_0001", "s2_0001"]


def test_a_replaced_meta_prefix_is_refused_when_the_pass_begins(shards, monkeypatch):
    """The reader skips __...__ members by its own rule; replacing meta_prefix would be ignored, so it is refused
    loudly, naming it and the fix."""
    from wds_cloud.errors import ConfigError

    monkeypatch.setattr(tariterators, "meta_prefix", "##")
    with pytest.raises(ConfigError, match="meta_prefix.*select_files"):
        next(iter(pipeline(shards)))


def test_gopen_schemes_default_opens_schemes_nothing_claims_never_local_paths(shards, tmp_path, monkeypatch):
    """As in webdataset: gopen_schemes["__default__"] (unassigned: gopen_error) opens URLs of a scheme no backend or
    assignment claims; local paths are opened as files, never through it."""
    from wds_cloud.io.open import gopen_error

    assert wds.gopen_schemes["__default__"] is gopen_error
    first = wds.shardlists.expand_urls(shards)[0]
    calls = []

    def fallback(url, mode="rb", bufsize=8192, **kw):
        calls.append(url)
        return open(first, "rb")

    monkeypatch.setitem(wds.gopen_schemes, "__default__", fallback)
    with wds.gopen("zzz://anything") as stream:
        assert stream.read(1)
    second = wds.shardlists.expand_urls(shards)[1]
    with wds.gopen(second) as stream, open(second, "rb") as direct:
        assert stream.read() == direct.read()
    assert calls == ["zzz://anything"]
