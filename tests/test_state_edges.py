"""States a trainer's own code or a hand-edited checkpoint brings (adversary findings, issue 41): each resumes
exactly or is refused with StateMismatchError naming the field, never a raw error or other samples."""

import copy
import json
import pathlib
import random

import pytest

import wds_cloud as wds
from wds_cloud.errors import ConfigError, StateMismatchError
from wds_cloud.resume.state import seal


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    directory = tmp_path_factory.mktemp("edges")
    for s in range(6):
        with wds.TarWriter(str(directory / f"s-{s:04d}.tar")) as sink:
            for i in range(10):
                sink.write({"__key__": f"sh{s}_i{i:02d}", "txt": f"{s}/{i}"})
    return str(directory / "s-{0000..0005}.tar")


def _taken(make, n):
    ds = make()
    it = iter(ds)
    head = [next(it) for _ in range(n)]
    return head, ds.state_dict()


def _resealed(state):
    return seal({k: v for k, v in state.items() if k != "checksum"})


def _stage(state, kind):
    return next(entry[2] for entry in state["stages"] if entry[1] == kind)


def test_a_resumed_shuffle_gives_the_same_samples_and_batches_collate(urls):
    """Samples fetched again for a shuffle buffer carry every field (``__local_path__`` was missing, and a
    batch mixing them with fresh ones raised KeyError in collation)."""

    def make():
        return wds.WebDataset(urls, shardshuffle=True, seed=7).shuffle(5).batched(3)

    full = list(make())
    head, state = _taken(make, 5)
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [b["__key__"] for b in head + rest] == [b["__key__"] for b in full]
    assert [b["__local_path__"] for b in head + rest] == [b["__local_path__"] for b in full]


def test_a_shuffle_given_its_own_generator_loads_its_state_in_memory(urls):
    """``shuffle(rng=random.Random(3))``: the state as returned (not only after a trip through JSON) loads."""

    def make():
        return wds.WebDataset(urls, shardshuffle=False).shuffle(5, rng=random.Random(3))

    head, state = _taken(make, 7)
    full = [s["__key__"] for s in make()]
    for given in (state, json.loads(json.dumps(state))):
        resumed = make()
        resumed.load_state_dict(copy.deepcopy(given))
        assert [s["__key__"] for s in head] + [s["__key__"] for s in resumed] == full


@pytest.mark.parametrize("streams", [7, 100])
def test_more_streams_than_shards_resume_exactly(urls, streams):
    """A stream given no shard takes a state with no URL; that state loads (was refused as 'url' None)."""

    def make():
        return wds.WebDataset(urls, shardshuffle=True, seed=1, streams=streams).shuffle(5)

    full = [s["__key__"] for s in make()]
    head, state = _taken(make, 7)
    resumed = make()
    resumed.load_state_dict(state)
    assert [s["__key__"] for s in head] + [s["__key__"] for s in resumed] == full


def test_a_changed_seed_in_a_resealed_shuffle_state_is_refused(urls):
    def make():
        return wds.WebDataset(urls, shardshuffle=True, seed=7).shuffle(5)

    _, state = _taken(make, 17)
    _stage(state, "Shuffle")["rng"][0] += 1
    with pytest.raises(StateMismatchError, match="seeded") as info:
        make().load_state_dict(_resealed(state))
    assert info.value.field == "rng"


@pytest.mark.parametrize("where", ["top", "reader", "shuffle"])
def test_unknown_fields_are_refused(urls, where):
    def make():
        return wds.WebDataset(urls, shardshuffle=True, seed=7).shuffle(5)

    _, state = _taken(make, 17)
    target = {"top": state, "reader": _stage(state, "TarSamples"), "shuffle": _stage(state, "Shuffle")}[where]
    target["extra"] = 1
    with pytest.raises(StateMismatchError, match="extra") as info:
        make().load_state_dict(_resealed(state))
    assert info.value.field == "extra"


def test_a_stage_listed_twice_is_refused(urls):
    def make():
        return wds.WebDataset(urls, shardshuffle=True, seed=7).shuffle(5)

    _, state = _taken(make, 17)
    reader = next(entry for entry in state["stages"] if entry[1] == "TarSamples")
    state["stages"].insert(0, copy.deepcopy(reader))
    with pytest.raises(StateMismatchError, match="twice"):
        make().load_state_dict(_resealed(state))


def test_more_items_yielded_than_the_epoch_holds_is_refused(urls):
    def make():
        return wds.WebDataset(urls, shardshuffle=True, seed=7).shuffle(5).with_epoch(30)

    _, state = _taken(make, 10)
    state["progress"][1] = 10**12
    with pytest.raises(StateMismatchError, match="with_epoch") as info:
        make().load_state_dict(_resealed(state))
    assert info.value.field == "progress"


def test_a_state_nested_too_deep_is_refused_not_a_recursion_error(urls):
    def make():
        return wds.WebDataset(urls, shardshuffle=True, seed=7).shuffle(5)

    _, state = _taken(make, 17)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    state["progress"] = deep
    with pytest.raises(StateMismatchError):
        ds = make()
        ds.load_state_dict(state)
        next(iter(ds))
    with pytest.raises(StateMismatchError):
        wds.merge_states([dict(state)])


def test_random_mix_draws_are_exactly_the_samples_given(urls):
    """A RandomMix state whose draw count does not match what its datasets gave (plus those that ended) is
    refused: one draw more, sealed again, would skip a sample."""
    a, b = urls.replace("0005", "0002"), urls.replace("{0000", "{0003")

    def source(u, s):
        return wds.DataPipeline(wds.SimpleShardList(u, seed=s), wds.tarfile_to_samples(), wds.shuffle(3, seed=s))

    def make():
        return wds.DataPipeline(wds.RandomMix([source(a, 1), source(b, 2)], [1, 2]))

    _, state = _taken(make, 13)
    mix = _stage(state, "RandomMix")
    mix["rng"][1] += 1
    state["stages"][0][2] = _resealed(mix)
    with pytest.raises(StateMismatchError, match="draws") as info:
        make().load_state_dict(_resealed(state))
    assert info.value.field == "rng"


def test_urls_as_bytes_are_paths_and_other_types_are_refused(urls, tmp_path):
    first = urls.replace("{0000..0005}", "0000")
    assert len(list(wds.WebDataset(first.encode(), shardshuffle=False))) == 10
    assert len(list(wds.WebDataset([pathlib.Path(first), first.encode()], shardshuffle=False))) == 20
    with pytest.raises(ConfigError, match=r"urls\[1\] is int"):
        wds.WebDataset([first, 3], shardshuffle=False)
