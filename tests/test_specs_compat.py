"""webdataset 1.0.2's ``datasets:`` specs (YAML or dict, NeMo's ``WebDataset(dict)``) through MultiShardSample:
``resample`` draws with replacement, ``choose`` without, iteration works, and a state resumes exactly."""

import collections
import json

import pytest

import wds_cloud as wds
from wds_cloud.errors import MalformedDataError


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    """Four shards of four samples each: mm_{s}.tar holds keys s{s}_00 .. s{s}_03."""
    root = tmp_path_factory.mktemp("mm")
    for s in range(4):
        with wds.TarWriter(str(root / f"mm_{s}.tar")) as sink:
            for i in range(4):
                sink.write({"__key__": f"s{s}_{i:02d}", "txt": b"x"})
    return str(root) + "/"


def spec_of(mm, **fields):
    return {"prefix": mm, "datasets": [{"name": "a", "shards": "mm_{0..1}.tar", **fields}, {"shards": "mm_2.tar"}]}


def shard_names(stage):
    return [item["url"].rsplit("/", 1)[-1] for item in stage]


def test_resample_draws_that_many_shards_with_replacement(mm):
    """resample: 3 over two shards gives 3 shards of that source per epoch (with repeats), as upstream: 16 samples."""
    ds = wds.WebDataset(spec_of(mm, resample=3), shardshuffle=False)
    keys = [s["__key__"] for s in ds]
    assert len(keys) == 16
    assert collections.Counter(k.split("_")[0] for k in keys)["s2"] == 4
    m = wds.MultiShardSample(spec_of(mm, resample=5))
    for _ in range(5):
        names = shard_names(m)
        assert len(names) == 6 and names.count("mm_2.tar") == 1
    assert len(set(names) - {"mm_2.tar"}) <= 2


@pytest.mark.parametrize("key", ["choose", "perepoch"])
def test_choose_draws_without_replacement(mm, key):
    """choose: N (and our perepoch: N) gives N different shards of the source every epoch."""
    spec = {"prefix": mm, "datasets": [{"name": "a", "shards": "mm_{0..3}.tar", key: 3}]}
    pipeline = wds.DataPipeline(wds.MultiShardSample(spec))
    seen = set()
    for _ in range(30):  # 30 epochs of one pipeline (a new pipeline around the same list starts at epoch 0)
        names = shard_names(pipeline)
        assert len(names) == 3 and len(set(names)) == 3, names
        seen.add(tuple(sorted(names)))
    assert len(seen) > 1  # another choice in another epoch


def test_multishardsample_is_iterable(mm):
    """iter(MultiShardSample(spec)) yields {'url': ...} items, as upstream's IterableDataset does."""
    m = wds.shardlists.MultiShardSample(spec_of(mm))
    items = list(iter(m))
    assert all(set(item) == {"url"} for item in items)
    assert sorted(shard_names(items)) == ["mm_0.tar", "mm_1.tar", "mm_2.tar"]


def test_draws_are_a_function_of_seed_and_epoch(mm):
    """The same seed and epoch give the same shards; set_epoch picks the epoch."""
    a, b = wds.MultiShardSample(spec_of(mm, resample=4), seed=3), wds.MultiShardSample(spec_of(mm, resample=4), seed=3)
    epochs = [shard_names(a) for _ in range(4)]
    assert epochs == [shard_names(b) for _ in range(4)]
    b.set_epoch(2)
    assert shard_names(b) == epochs[2]


@pytest.mark.parametrize("fields", [{"resample": 3}, {"choose": 2}, {}])
def test_resume_is_exact(mm, fields):
    """A state taken after any sample of a spec dataset (first and second epoch) resumes at exactly the rest."""

    def build():
        return wds.WebDataset(spec_of(mm, **fields), shardshuffle=False, seed=11)

    def keyed(samples):
        return [(s["__key__"], s["__url__"]) for s in samples]

    ds = build()
    first, second = keyed(ds), keyed(ds)
    for epoch, whole in ((0, first), (1, second)):
        for after in range(len(whole) + 1):
            ds = build()
            if epoch:
                list(ds)
            it = iter(ds)
            head = [next(it) for _ in range(after)]
            state = json.loads(json.dumps(ds.state_dict()))
            resumed = build()
            resumed.load_state_dict(state)
            assert keyed(head) + keyed(resumed) == whole, (epoch, after)


def test_a_yaml_file_with_resample(mm, tmp_path):
    """The YAML form reads resample the same way."""
    pytest.importorskip("yaml")
    path = tmp_path / "mix.yaml"
    path.write_text(f"prefix: {mm}\ndatasets:\n  - name: a\n    shards: mm_{{0..1}}.tar\n    resample: 3\n")
    assert len(list(wds.WebDataset(str(path), shardshuffle=False))) == 12


def test_numpy_counts_are_whole_numbers(mm):
    """A count given as a numpy integer (a dict built in code) is accepted."""
    np = pytest.importorskip("numpy")
    assert len(shard_names(wds.MultiShardSample(spec_of(mm, resample=np.int64(3))))) == 4


@pytest.mark.parametrize(
    "fields,words",
    [
        ({"choose": 3}, "datasets[0].choose is 3, more than the 2 shard(s)"),
        ({"perepoch": 5}, "datasets[0].perepoch is 5"),
        ({"choose": 1, "resample": 2}, "gives 'resample' and 'choose'"),
        ({"resample": 2.5}, "datasets[0].resample must be a whole number"),
        ({"resample": True}, "datasets[0].resample must be a whole number"),
        ({"resmaple": 2}, "unknown field(s) 'resmaple'"),
    ],
)
def test_malformed_counts_are_refused(mm, fields, words):
    """Counts that cannot be drawn, two kinds of draw, non-integers and misspelt fields: MalformedDataError
    (a ValueError, as upstream's) naming the field."""
    with pytest.raises(MalformedDataError) as info:
        wds.MultiShardSample(spec_of(mm, **fields))
    assert isinstance(info.value, ValueError) and words in str(info.value)
