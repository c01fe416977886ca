"""Arguments of any number type (numpy's, floats that are whole, paths, tuples): a dataset built with them gives
its state and resumes exactly; nonsense (nan, inf, negative, True, fractions) is refused when it is built (issue 41)."""

import json
import pathlib

import numpy as np
import pytest

import wds_cloud as wds
from wds_cloud.errors import ConfigError, StateMismatchError
from wds_cloud.resume.state import seal


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("argtypes")
    for s in range(3):
        with wds.TarWriter(str(root / f"s-{s}.tar")) as w:
            for i in range(20):
                w.write({"__key__": f"s{s}-{i:03d}", "txt": f"{s} {i}".encode()})
    return root


def urls(root):
    return [str(root / f"s-{s}.tar") for s in range(3)]


def keys(items):
    out = []
    for item in items:
        out.extend(keys(item) if isinstance(item, list) else [item["__key__"]])
    return out


BUILDS = {
    "numpy seed, shard shuffle": lambda r: wds.WebDataset(urls(r), seed=np.int64(5), shardshuffle=np.int64(3)),
    "numpy seed, sample shuffle": lambda r: wds.WebDataset(urls(r), seed=np.int64(5), shardshuffle=True).shuffle(
        np.int64(4)
    ),
    "numpy shuffle size and initial": lambda r: wds.WebDataset(urls(r), shardshuffle=False).shuffle(
        np.int32(8), initial=np.uint8(3), seed=np.int64(2)
    ),
    "whole float sizes": lambda r: wds.WebDataset(urls(r), shardshuffle=False).shuffle(
        8.0, initial=np.float32(2.0), seed=1.0
    ),
    "detshuffle numpy": lambda r: wds.DataPipeline(
        wds.SimpleShardList(urls(r)),
        wds.tarfile_to_samples(),
        wds.detshuffle(np.int64(6), initial=np.int64(2), seed=np.int64(9), epoch=np.int64(-1)),
    ),
    "shuffle stage numpy": lambda r: wds.DataPipeline(
        wds.SimpleShardList(urls(r)), wds.tarfile_to_samples(), wds.shuffle(np.int64(6), seed=np.uint32(4))
    ),
    "resampled numpy seed": lambda r: wds.WebDataset(urls(r), resampled=True, seed=np.int64(11)).with_epoch(
        np.int64(30)
    ),
    "path urls": lambda r: wds.WebDataset([pathlib.Path(u) for u in urls(r)], shardshuffle=False, seed=3),
    "one path": lambda r: wds.WebDataset(pathlib.Path(urls(r)[0]), shardshuffle=False),
    "tuple urls": lambda r: wds.WebDataset(tuple(urls(r)), shardshuffle=np.bool_(True), seed=np.int16(7)),
    "equal_work numpy": lambda r: wds.WebDataset(urls(r), shardshuffle=False, equal_work=np.int64(50)),
    "batched numpy": lambda r: (
        wds.WebDataset(urls(r), shardshuffle=False).shuffle(5, seed=1).batched(np.int64(4), collation_fn=None)
    ),
    "with_length numpy": lambda r: wds.WebDataset(urls(r), shardshuffle=False).with_length(np.int64(60)),
    "random mix numpy": lambda r: wds.DataPipeline(
        wds.RandomMix(
            [wds.WebDataset(urls(r)[:2], shardshuffle=False), wds.WebDataset(urls(r)[2:], shardshuffle=False)],
            probs=np.array([2.0, 1.0], dtype=np.float32),
            seed=np.int64(3),
            longest=np.bool_(True),
        )
    ),
    "spec mix numpy": lambda r: wds.from_spec(
        {
            "version": 1,
            "seed": np.int64(4),
            "samples_per_epoch": np.int64(40),
            "sources": [
                {"name": "x", "urls": urls(r)[:2], "weight": np.float32(2)},
                {"name": "y", "urls": urls(r)[2:], "weight": np.int64(1), "shuffle": np.int64(4)},
            ],
        },
        seed=np.int64(1),
    ),
}


@pytest.mark.parametrize("name", sorted(BUILDS))
@pytest.mark.parametrize("cut", [0, 7])
def test_a_dataset_built_with_any_number_type_gives_its_state_and_resumes_exactly(shards, name, cut):
    """state_dict() never raises for a dataset that was built; the state is JSON and resumes exactly."""
    expected = keys(BUILDS[name](shards))
    ds = BUILDS[name](shards)
    it = iter(ds)
    head = [next(it) for _ in range(cut)]
    state = ds.state_dict(strict=True)
    state = json.loads(json.dumps(state, allow_nan=False))
    resumed = BUILDS[name](shards)
    resumed.load_state_dict(state)
    assert keys(head) + keys(resumed) == expected


@pytest.mark.parametrize(
    "build, argument",
    [
        (lambda r: wds.WebDataset(urls(r), seed=True), "seed"),
        (lambda r: wds.WebDataset(urls(r), seed=2.5), "seed"),
        (lambda r: wds.WebDataset(urls(r), seed=10**5000), "seed"),
        (lambda r: wds.WebDataset(urls(r), seed=np.float64("nan")), "seed"),
        (lambda r: wds.WebDataset(urls(r), shardshuffle=-3), "shardshuffle"),
        (lambda r: wds.WebDataset(urls(r), equal_work=True), "equal_work"),
        (lambda r: wds.WebDataset(urls(r), equal_work=np.float64(2.5)), "equal_work"),
        (lambda r: wds.WebDataset(urls(r), streams=0), "streams"),
        (lambda r: wds.WebDataset(urls(r), cache_size=float("nan"), cache_dir="/tmp/x"), "cache_size"),
        (lambda r: wds.WebDataset(urls(r), timeout=float("inf")), "timeout"),
        (lambda r: wds.WebDataset(urls(r), timeout=-1), "timeout"),
        (lambda r: wds.WebDataset(urls(r), retries=np.float64("nan")), "retries"),
        (lambda r: wds.WebDataset(urls(r), concurrency=0), "concurrency"),
        (lambda r: wds.WebDataset(urls(r), prefetch=True), "prefetch"),
        (lambda r: wds.WebDataset(urls(r), part_size=1e999), "part_size"),
        (lambda r: wds.WebDataset(urls(r), max_member_size=-5), "max_member_size"),
        (lambda r: wds.WebDataset(urls(r)).shuffle(float("nan")), "shuffle size"),
        (lambda r: wds.WebDataset(urls(r)).shuffle(10, initial=-1), "initial"),
        (lambda r: wds.WebDataset(urls(r)).shuffle(10, seed="abc"), "seed"),
        (lambda r: wds.shuffle(np.float64(2.5)), "bufsize"),
        (lambda r: wds.detshuffle(10, seed=np.float64("inf")), "seed"),
        (lambda r: wds.WebDataset(urls(r)).batched(0), "batchsize"),
        (lambda r: wds.WebDataset(urls(r)).batched(True), "batchsize"),
        (lambda r: wds.batched(np.float64("nan")), "batchsize"),
        (lambda r: wds.rsample(float("nan")), "p"),
        (lambda r: wds.rsample(1.5), "p"),
        (lambda r: wds.WebDataset(urls(r)).with_epoch(float("nan")), "nsamples"),
        (lambda r: wds.WebDataset(urls(r)).with_epoch(np.float64(2.5)), "nsamples"),
        (lambda r: wds.WebDataset(urls(r)).with_length(-1), "with_length"),
        (lambda r: wds.WebDataset(urls(r)).shuffle(-1), "shuffle size"),
        (lambda r: wds.WebDataset(urls(r)).with_epoch(-1), "nsamples"),
        (lambda r: wds.WebDataset(urls(r)).with_epoch(0), "nsamples"),
        (lambda r: wds.WebDataset(urls(r)).batched(None), "batchsize"),
        (lambda r: wds.batched(None), "batchsize"),
        (lambda r: wds.RandomMix([[1], [2]], probs=[float("nan"), 1]), "probs[0]"),
        (lambda r: wds.RandomMix([[1], [2]], probs=[1, -1]), "probs[1]"),
        (lambda r: wds.RandomMix([[1], [2]], probs=[0, 0]), "probs"),
        (lambda r: wds.RandomMix([[1], [2]], probs=[1]), "probs"),
        (lambda r: wds.RandomMix([[1], [2]], probs=[1e308, 1e308]), "probs"),
        (lambda r: wds.RandomMix([[1], [2]], seed=10**5000), "seed"),
        (lambda r: wds.RandomMix([[1], [2]], seed=False), "seed"),
    ],
)
def test_nonsense_numbers_are_refused_when_built_naming_the_argument(shards, build, argument):
    """nan, inf, negative counts, True where a number goes, fractions where a count goes: ConfigError (a
    ValueError) naming the argument, when the dataset or stage is built, never a raw error on the first sample."""
    with pytest.raises(ConfigError) as info:
        build(shards)
    assert f"{argument}=" in str(info.value) or f"{argument} " in str(info.value)


def test_a_shuffle_state_whose_seed_has_thousands_of_digits_is_refused_on_load(shards):
    """A sealed-again state with a seed of 5,000 digits: StateMismatchError naming 'rng' at load, not a raw
    ValueError (int-to-str limit) when the pass begins."""

    def build():
        return wds.WebDataset(urls(shards), shardshuffle=False).shuffle(10, seed=1)

    ds = build()
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = ds.state_dict(strict=True)
    stage = next(entry for entry in state["stages"] if entry[1] == "Shuffle")
    stage[2]["rng"][0] = 10**5000  # no JSON holds it (nor can it be sealed): a pickled or edited dict
    with pytest.raises(StateMismatchError) as info:
        build().load_state_dict(state)
    assert info.value.field == "rng"
    stage[2]["rng"][0] = 1 << 64  # one past the largest seed, sealed again
    with pytest.raises(StateMismatchError) as info:
        build().load_state_dict(seal(state))
    assert info.value.field == "rng"
