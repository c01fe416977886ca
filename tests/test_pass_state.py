"""A stage is a recipe and a pass owns its state: stages shared by pipelines, and pickling, copying and sending
datasets to workers before, during and after a pass."""

import copy
import os
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud import DataPipeline, SimpleShardList

from .conftest import make_shards


@pytest.fixture
def two_sets(tmp_path):
    """A training set (two shards of nine samples) and a validation set (one shard of five)."""
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    return make_shards(tmp_path / "train", nshards=2, per_shard=9), make_shards(tmp_path / "val", 1, 5)


def keys(items):
    return [s["__key__"] for s in items]


def test_a_reader_shared_by_two_pipelines_resumes_its_own_pass(two_sets):
    """A reader in a training and a validation pipeline: a validation pass does not move the training state."""
    train_urls, val_urls = two_sets
    reader = wds.tarfile_to_samples()
    train = DataPipeline(SimpleShardList(train_urls), reader)
    val = DataPipeline(SimpleShardList(val_urls), reader)
    it = iter(train)
    first = keys(next(it) for _ in range(7))
    assert len(list(val)) == 5
    state = train.state_dict()
    resumed = DataPipeline(SimpleShardList(train_urls), wds.tarfile_to_samples())
    resumed.load_state_dict(state)
    rest = keys(resumed)
    assert len(rest) == 11 and first + rest == keys(DataPipeline(SimpleShardList(train_urls), reader))
    assert keys(it) == rest  # and the training pass itself goes on where it stood


def test_a_shuffle_shared_by_two_pipelines_resumes_exactly(two_sets):
    """A seeded shuffle (and reader) shared by two pipelines: each state resumes its own buffer exactly."""
    train_urls, val_urls = two_sets
    reader, shuffle = wds.tarfile_to_samples(), wds.shuffle(5, seed=3)
    train = DataPipeline(SimpleShardList(train_urls), reader, shuffle)
    val = DataPipeline(SimpleShardList(val_urls), reader, shuffle)
    whole = keys(train)
    it = iter(train)
    first = keys(next(it) for _ in range(6))
    list(val)
    resumed = DataPipeline(SimpleShardList(train_urls), wds.tarfile_to_samples(), wds.shuffle(5, seed=3))
    resumed.load_state_dict(train.state_dict())
    assert first + keys(resumed) == whole


def test_pipelines_composed_from_one_dataset_have_passes_of_their_own(shards):
    """Two fluent pipelines built on one WebDataset, iterated side by side, each resume exactly."""
    ds = wds.WebDataset(shards, shardshuffle=False)
    a, b = ds.shuffle(4, seed=1), ds.batched(3)
    whole_a = keys(a)
    ia, ib = iter(a), iter(b)
    first = [next(ia)["__key__"], next(ib), next(ia)["__key__"], next(ib), next(ia)["__key__"]]
    state = a.state_dict()
    list(ib)
    resumed = wds.WebDataset(shards, shardshuffle=False).shuffle(4, seed=1)
    resumed.load_state_dict(state)
    assert [first[0], first[2], first[4]] + keys(resumed) == whole_a
    assert ds.state_dict()["progress"] == [0, 0]  # the dataset they came from ran no pass


def test_the_stage_object_the_user_holds_keeps_no_pass(shards):
    """After passes through pipelines, the user's reader and shuffle objects pickle and describe no pass."""
    reader, shuffle = wds.tarfile_to_samples(), wds.shuffle(5, seed=1)
    pipe = DataPipeline(SimpleShardList(shards), reader, shuffle)
    it = iter(pipe)
    next(it)
    for stage in (reader, shuffle):
        pickle.loads(pickle.dumps(stage))
        copy.deepcopy(stage)
    assert reader.state_dict() == {"fresh": True}
    assert pipe.pipeline[1] is not reader and pipe.pipeline[2] is not shuffle


def _webdataset(shards):
    return wds.WebDataset(shards, shardshuffle=False)


def _shuffled(shards):
    return wds.WebDataset(shards, shardshuffle=True, seed=5).shuffle(6, seed=2).decode()


def _as_bytes(sample):
    return dict(sample, txt=bytes(sample["txt"]))


def _views(shards):
    return wds.WebDataset(shards, shardshuffle=False, zero_copy=True).map(_as_bytes)


def _pipeline(shards):
    return DataPipeline(SimpleShardList(shards), wds.tarfile_to_samples(), wds.shuffle(5, seed=9), wds.batched(2))


def _mix(shards):
    return wds.RandomMix([_webdataset(shards), _shuffled(shards)], probs=[1, 2], seed=4)


def _streams(shards):
    return wds.WebDataset(shards, shardshuffle=True, seed=1, streams=3).shuffle(4, seed=1)


def _nested(shards):
    return DataPipeline(_shuffled(shards), wds.batched(3))


def _indexed(shards):
    return wds.WebDataset(shards, shardshuffle=False, write_index=_indexes.append)


_indexes: list = []


def _equal_streams(shards):
    return wds.WebDataset(shards, shardshuffle=True, seed=2, streams=3, equal_work=8)


MAKERS = [_webdataset, _shuffled, _views, _pipeline, _mix, _streams, _nested, _indexed, _equal_streams]


def _plain(items):
    """Items as comparable values (a batch's keys, a sample's key)."""
    out = []
    for item in items:
        if isinstance(item, dict):
            out.append(item["__key__"])
        elif isinstance(item, (list, tuple)) and item and isinstance(item[0], list):
            out.append(tuple(item[0]))
        else:
            out.append(repr(item)[:80])
    return out


COPIERS = {
    "pickle": lambda ds: pickle.loads(pickle.dumps(ds)),
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
}


@pytest.mark.parametrize("make", MAKERS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("how", sorted(COPIERS))
@pytest.mark.parametrize("point", ["before", "during", "after"])
def test_a_dataset_copies_at_any_point_of_a_pass(shards, make, how, point):
    """Pickled, deep-copied or copied before, during or after a pass: the copy runs a whole pass of its own (the
    one the original would run next: a copy counts epochs on from the original's), the original's pass goes on
    untouched, and the original's state loaded into the copy gives exactly the rest."""
    twice = make(shards)
    whole, second = _plain(twice), _plain(twice)
    ds = make(shards)
    it = iter(ds)
    taken = []
    if point != "before":
        taken = _plain(next(it) for _ in range(4 if point == "during" else 0))
    if point == "after":
        taken = _plain(it)
    state = ds.state_dict()
    copied = COPIERS[how](ds)
    assert _plain(copied) == (whole if point == "before" else second)
    assert taken + _plain(it) == whole
    again = COPIERS[how](ds)
    again.load_state_dict(state)
    assert taken + _plain(again) == whole


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from("abs"), min_size=1, max_size=60))
def test_pipelines_sharing_stages_iterate_as_if_alone(tmp_path_factory, steps):
    """Any interleaving of two pipelines sharing a reader and a shuffle (and states taken in between): each
    yields what it yields alone, and its state resumes exactly."""
    root = tmp_path_factory.mktemp("interleave")
    (root / "a").mkdir(exist_ok=True)
    (root / "b").mkdir(exist_ok=True)
    urls_a, urls_b = make_shards(root / "a", 2, 7), make_shards(root / "b", 2, 4)
    reader, shuffle = wds.tarfile_to_samples(), wds.shuffle(4, seed=8)

    def alone(urls):
        return keys(DataPipeline(SimpleShardList(urls), wds.tarfile_to_samples(), wds.shuffle(4, seed=8)))

    pipes = {"a": DataPipeline(SimpleShardList(urls_a), reader, shuffle)}
    pipes["b"] = DataPipeline(SimpleShardList(urls_b), reader, shuffle)
    expected = {"a": alone(urls_a), "b": alone(urls_b)}
    iters = {name: iter(pipe) for name, pipe in pipes.items()}
    got: dict = {"a": [], "b": []}
    for step in steps:
        if step == "s":  # a state of a, checked by resuming it in a fresh pipeline
            fresh = DataPipeline(SimpleShardList(urls_a), wds.tarfile_to_samples(), wds.shuffle(4, seed=8))
            fresh.load_state_dict(pipes["a"].state_dict())
            assert got["a"] + keys(fresh) == expected["a"]
            continue
        item = next(iters[step], None)
        if item is None:
            iters[step] = iter(pipes[step])
            assert got[step] == expected[step]
            got[step] = []
        else:
            got[step].append(item["__key__"])
    for name in "ab":
        assert got[name] + keys(iters[name]) == expected[name]


def test_set_epoch_on_the_stage_the_user_holds_reaches_the_pipelines_it_is_in(shards):
    """``set_epoch`` on a shard list or detshuffle object the user holds sets the epoch of the pipelines built
    with it (their copies), as it did when they ran the object itself; a pickle of the stage carries no copies."""
    shard_list, shuffle = SimpleShardList(shards, seed=3), wds.detshuffle(5, seed=2)
    pipe = DataPipeline(shard_list, wds.tarfile_to_samples(), shuffle)
    reference = DataPipeline(SimpleShardList(shards, seed=3), wds.tarfile_to_samples(), wds.detshuffle(5, seed=2))
    reference.set_epoch(4)
    expected = keys(reference)
    list(pipe)
    shard_list.set_epoch(4)
    shuffle.set_epoch(4)
    assert keys(pipe) == expected
    assert "_pipeline_copies" not in pickle.loads(pickle.dumps(shuffle)).__dict__


def test_a_cache_shared_by_two_pipelines_gives_each_its_own_samples(two_sets):
    """One ``Cached()`` put into a training and a validation pipeline: each replays its own first pass."""
    train_urls, val_urls = two_sets
    cache = wds.filters.Cached()
    train = DataPipeline(SimpleShardList(train_urls), wds.tarfile_to_samples(), cache)
    val = DataPipeline(SimpleShardList(val_urls), wds.tarfile_to_samples(), cache)
    first_train, first_val = keys(train), keys(val)
    assert len(first_train) == 18 and len(first_val) == 5
    assert keys(val) == first_val and keys(train) == first_train


def test_a_decoder_with_an_extension_handler_pickles(shards):
    """``decode(wds.handle_extension("txt", f))`` (webdataset's idiom, a closure upstream) pickles, and decodes."""
    ds = wds.WebDataset(shards, shardshuffle=False).decode(wds.handle_extension("txt", _upper))
    copied = pickle.loads(pickle.dumps(ds))
    assert next(iter(copied))["txt"] == next(iter(ds))["txt"] == b"TEXT 0 0"


def _upper(data):
    return data.upper()


def test_a_pipeline_with_a_cache_gives_states_that_say_they_are_inexact(shards):
    """``Cached()`` replays its first pass whatever a state says: a state of its pipeline is inexact (a resumed
    run starts the epoch again, as webdataset's would) and ``strict=True`` refuses it, naming the stage."""
    pipe = DataPipeline(SimpleShardList(shards), wds.tarfile_to_samples(), wds.filters.Cached())
    list(pipe)
    it = iter(pipe)
    next(it)
    assert "inexact" in pipe.state_dict()
    with pytest.raises(wds.NotResumableError, match="Cached"):
        pipe.state_dict(strict=True)


@pytest.mark.parametrize("split", ["unbatched", "unlisted"])
def test_a_state_inside_a_batch_split_again_is_refused_and_exact_at_its_end(shards, split):
    """``batched(3).unbatched()`` (or ``listed``/``unlisted``): a state taken between the parts of a batch would
    resume after the whole batch and lose the rest, so it is inexact (``strict=True`` refuses it, naming the
    stage); a state taken when the batch is used up resumes exactly."""

    def build():
        ds = wds.WebDataset(shards, shardshuffle=False).to_tuple("__key__")
        return ds.batched(3).unbatched() if split == "unbatched" else ds.listed(3).unlisted()

    whole = [item[0] for item in build()]
    ds = build()
    it = iter(ds)
    head = [next(it)[0] for _ in range(4)]
    with pytest.raises(wds.NotResumableError, match=f"{split}.*2 of its parts"):
        ds.state_dict(strict=True)
    assert "inexact" in ds.state_dict()
    head += [next(it)[0] for _ in range(2)]
    again = build()
    again.load_state_dict(ds.state_dict(strict=True))
    assert head + [item[0] for item in again] == whole


def test_a_webloader_state_inside_a_batch_it_splits_again_is_refused(shards):
    """``WebLoader(ds.batched(4), batch_size=None).unbatched()``: a state taken inside a batch the workers gave is
    refused (strict) instead of losing the batch's other samples; at the batch's end it is exact."""
    ds = wds.WebDataset(shards, shardshuffle=False).to_tuple("__key__").batched(5)
    whole = [key for (key,) in wds.WebLoader(ds, batch_size=None, num_workers=0).unbatched()]
    loader = wds.WebLoader(ds, batch_size=None, num_workers=0).unbatched()
    it = iter(loader)
    head = [next(it)[0] for _ in range(3)]
    with pytest.raises(wds.NotResumableError, match="unbatched"):
        loader.state_dict(strict=True)
    head += [next(it)[0] for _ in range(2)]
    again = wds.WebLoader(wds.WebDataset(shards, shardshuffle=False).to_tuple("__key__").batched(5), batch_size=None)
    again = again.unbatched()
    again.load_state_dict(loader.state_dict(strict=True))
    assert head + [key for (key,) in again] == whole


def test_a_mix_over_a_dataset_used_elsewhere_resumes_its_own_pass(tmp_path):
    """A dataset in a RandomMix and also peeked at on its own: the mix's state describes the mix's pass (the mix
    holds copies of its datasets), and resumes exactly."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    urls_a, urls_b = make_shards(tmp_path / "a", 4, 6), make_shards(tmp_path / "b", 3, 5)

    def mix(dataset=None):
        dataset = dataset if dataset is not None else wds.WebDataset(urls_a, shardshuffle=True, seed=5)
        return wds.RandomMix([dataset, wds.WebDataset(urls_b, shardshuffle=False)], [1, 1], seed=1)

    whole = keys(mix())
    shared = wds.WebDataset(urls_a, shardshuffle=True, seed=5)
    train = mix(shared)
    it = iter(train)
    first = keys(next(it) for _ in range(7))
    peek = iter(shared)
    for _ in range(4):
        next(peek)
    resumed = mix()
    resumed.load_state_dict(train.state_dict())
    assert first + keys(resumed) == whole


@pytest.mark.parametrize("stage", ["shard list", "detshuffle"])
def test_set_epoch_during_a_pass_is_for_the_next_one_and_leaves_this_passs_state_exact(shards, stage):
    """``set_epoch(9)`` called while epoch 2 runs (a callback setting the next epoch early): the state still
    describes epoch 2 and resumes exactly; the next pass is epoch 9."""

    def build():
        if stage == "shard list":
            return wds.WebDataset(shards, shardshuffle=True, seed=3)
        return DataPipeline(SimpleShardList(shards), wds.tarfile_to_samples(), wds.detshuffle(6, seed=4))

    reference = build()
    reference.set_epoch(2)
    epoch2 = keys(reference)
    reference.set_epoch(9)
    epoch9 = keys(reference)
    ds = build()
    ds.set_epoch(2)
    it = iter(ds)
    first = keys(next(it) for _ in range(13))
    ds.set_epoch(9)
    resumed = build()
    resumed.load_state_dict(ds.state_dict())
    assert first + keys(resumed) == epoch2
    assert first + keys(it) == epoch2 and keys(ds) == epoch9


def test_a_state_taken_at_the_end_of_a_pass_resumes_into_the_next_epoch(shards):
    """A dataset's state taken once its pass ended: the resumed pass gives that pass's (empty) rest, and the
    pass after it is the next epoch, as the uninterrupted dataset's is (it was the same epoch again)."""
    epochs = wds.WebDataset(shards, shardshuffle=True, seed=2)
    order = [keys(epochs) for _ in range(3)]
    ds = wds.WebDataset(shards, shardshuffle=True, seed=2)
    list(ds)
    resumed = wds.WebDataset(shards, shardshuffle=True, seed=2)
    resumed.load_state_dict(ds.state_dict())
    assert keys(resumed) == [] and keys(resumed) == order[1] and keys(resumed) == order[2]


@pytest.mark.parametrize("how", sorted(COPIERS))
def test_a_copys_state_before_its_first_pass_starts_the_pass_it_will_run(shards, how):
    """A copy made mid-pass runs the original's next epoch; a state taken from it before it iterates says so."""
    twice = wds.WebDataset(shards, shardshuffle=True, seed=2)
    list(twice)
    second = keys(twice)
    ds = wds.WebDataset(shards, shardshuffle=True, seed=2)
    it = iter(ds)
    for _ in range(5):
        next(it)
    copied = COPIERS[how](ds)
    resumed = wds.WebDataset(shards, shardshuffle=True, seed=2)
    resumed.load_state_dict(copied.state_dict())
    assert keys(resumed) == second == keys(copied)


def test_a_detshuffle_of_shard_names_is_named_so_with_the_fix_that_fits(shards):
    """detshuffle before the reader (webdataset's idiom for shuffling shards) blocks an exact state: the message
    names detshuffle and says to seed the shard list instead."""
    pipe = DataPipeline(SimpleShardList(shards), wds.detshuffle(3, seed=4), wds.tarfile_to_samples())
    next(iter(pipe))
    with pytest.raises(wds.NotResumableError, match=r"detshuffle\(bufsize=3\).*SimpleShardList\(urls, seed="):
        pipe.state_dict(strict=True)


def test_the_settings_a_worker_is_given_are_the_programs_and_hold_no_credential(monkeypatch):
    """What a dataset carries to a starting worker: the settings' variables, never a credential."""
    from wds_cloud import config

    monkeypatch.setenv("WDS_MAX_MEMBER_SIZE", "1000")
    monkeypatch.setenv("AIS_AUTHN_TOKEN", "secret-token")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-key")
    carried = config.carried_environ()
    assert carried["WDS_MAX_MEMBER_SIZE"] == "1000"
    assert not any("secret" in value for value in carried.values())
    monkeypatch.setenv("WDS_SEED", "7")
    config.take_carried_environ(carried)
    assert "WDS_SEED" not in os.environ and config.current().max_member_size == 1000


def test_a_webloader_says_when_every_worker_would_read_every_shard(shards):
    """A DataPipeline over a fixed shard list without split_by_worker, given to a WebLoader with 2 workers: each
    sample would come twice, silently (as under webdataset); the loader warns once, naming the fix."""
    pipe = DataPipeline(SimpleShardList(shards), wds.tarfile_to_samples(), wds.batched(4))
    with pytest.warns(UserWarning, match="split_by_worker"):
        wds.WebLoader(pipe, batch_size=None, num_workers=2)
    split = DataPipeline(SimpleShardList(shards), wds.split_by_worker, wds.tarfile_to_samples(), wds.batched(4))
    wds.WebLoader(split, batch_size=None, num_workers=2)  # no warning (warnings are errors here)
    wds.WebLoader(wds.WebDataset(shards), batch_size=None, num_workers=2)
    wds.WebLoader(pipe, batch_size=None, num_workers=1)


def test_a_loader_refuses_another_pipelines_state_when_it_is_loaded(two_sets):
    """A training loader's state loaded into a validation loader of other stages: refused by load_state_dict,
    naming the stage, not at the first item inside a worker."""
    train_urls, val_urls = two_sets
    train = wds.WebLoader(wds.WebDataset(train_urls, shardshuffle=False).shuffle(5, seed=1), batch_size=None)
    it = iter(train)
    next(it)
    val = wds.WebLoader(wds.WebDataset(val_urls, shardshuffle=False), batch_size=None)
    with pytest.raises(wds.StateMismatchError, match="stages differ.*Shuffle.*another pipeline"):
        val.load_state_dict(train.state_dict())


@pytest.mark.parametrize("n", [10, 100, 1000])
def test_a_stage_holds_no_more_than_the_pipelines_that_live(shards, n):
    """A stage put into n pipelines that are dropped keeps no copy of them (its copies are weak references), and a
    fluent chain of n steps copies each stateful stage once per step (never all earlier steps' copies again)."""
    import gc

    reader = wds.tarfile_to_samples()
    for _ in range(n):
        DataPipeline(SimpleShardList(shards), reader)
    gc.collect()
    assert reader.pipeline_copies() == []
    made = [0]
    original = wds.tar.shardreader.TarSamples.__copy__

    def counted(self):
        made[0] += 1
        return original(self)

    ds = wds.WebDataset(shards)
    try:
        wds.tar.shardreader.TarSamples.__copy__ = counted
        for _ in range(n):
            ds = ds.map(_upper)
    finally:
        del wds.tar.shardreader.TarSamples.__copy__  # the inherited one again
    assert made[0] == n
