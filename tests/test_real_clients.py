"""Call shapes of real trainers and evaluators, written here in our own words: CLIP_benchmark's field lists,
SwissArmyTransformer's tar iterator that yields metadata beside bytes, open_lm's mix seeded through ``random``;
and the neighbours of each (the other argument shapes webdataset 1.0.2 takes, the other values a user's iterator
yields, the other places where seeding ``random`` is webdataset's contract)."""

import io
import random
import tarfile

import numpy as np
import pytest

import wds_cloud as wds
from wds_cloud.errors import SampleError, StateMismatchError
from wds_cloud.resume.state import SEAL, seal
from wds_cloud.tariterators import group_by_keys


def _samples(n=4):
    return [{"__key__": f"k{i}", "png": f"png{i}".encode(), "cls": i, "txt": f"t{i}"} for i in range(n)]


def test_to_tuple_takes_a_list_of_alternatives_per_field():
    """CLIP_benchmark evaluates with to_tuple(["webp", "png", "jpg", "jpeg"], "cls"): a list is one field's
    alternatives, as webdataset's getfirst takes them; tuples and ';'-joined names alike."""
    for spec in (["webp", "png", "jpg", "jpeg"], ("webp", "png"), "webp;png"):
        got = list(wds.DataPipeline(lambda: iter(_samples()), wds.to_tuple(spec, "cls")))
        assert got == [(f"png{i}".encode(), i) for i in range(4)]
    # the fluent form CLIP_benchmark writes
    ds = wds.FluidWrapper(_samples()).to_tuple(["webp", "png"], "txt").map_tuple(None, str.upper)
    assert list(ds) == [(f"png{i}".encode(), f"T{i}") for i in range(4)]


def test_field_arguments_in_shapes_webdataset_refuses_name_the_argument():
    """A field given as a number or an empty list is refused with the argument's position and the shapes taken."""
    with pytest.raises(TypeError, match=r"argument 1 is 3: give a field name"):
        list(wds.DataPipeline(lambda: iter(_samples()), wds.to_tuple("png", 3)))
    with pytest.raises(TypeError, match=r"rename\(x=...\) is \[\]"):
        list(wds.DataPipeline(lambda: iter(_samples()), wds.rename(x=[])))
    with pytest.raises(TypeError, match=r"map_tuple's argument 1 is 'x'"):
        list(wds.DataPipeline(lambda: iter([(1, 2)]), wds.map_tuple(None, "x")))
    with pytest.raises(TypeError, match=r"map_dict\(cls=...\)"):
        list(wds.DataPipeline(lambda: iter(_samples()), wds.map_dict(cls=5)))


def test_rename_takes_lists_and_drops_every_alternative_as_webdataset():
    """rename(image=["jpg", "png"]) takes the first present; keep=True drops every field named as an alternative
    (webdataset's rule), keep=False keeps the renamed fields only."""
    sample = {"__key__": "a", "png": b"p", "jpg": b"j", "cls": 1}
    kept = list(wds.DataPipeline(lambda: iter([dict(sample)]), wds.rename(image=["jpg", "png"])))
    assert kept == [{"__key__": "a", "cls": 1, "image": b"j"}]
    only = list(wds.DataPipeline(lambda: iter([dict(sample)]), wds.rename(image="gif;png", keep=False)))
    assert only == [{"image": b"p"}]


def test_map_tuple_gives_tuples_and_ignores_extra_functions():
    """map_tuple returns tuples for list samples too and calls no function beyond the sample's length, as upstream."""
    got = list(wds.DataPipeline(lambda: iter([[1, 2]]), wds.map_tuple(str, None, len)))
    assert got == [("1", 2)]


def test_shuffle_takes_webdatasets_positional_order():
    """shuffle(bufsize, initial, rng, seed): a fourth positional argument is the seed, as in webdataset."""
    a = list(wds.DataPipeline(lambda: iter(range(50)), wds.shuffle(20, 5, None, 7)))
    b = list(wds.DataPipeline(lambda: iter(range(50)), wds.shuffle(20, 5, seed=7)))
    assert a == b and sorted(a) == list(range(50)) and a != list(range(50))


def test_collation_makes_arrays_of_bools_as_webdataset():
    """A column of bools is a numpy array after batched(), as webdataset's combine_values makes it."""
    (batch,) = list(wds.DataPipeline(lambda: iter([(True, 1), (False, 2)]), wds.batched(2)))
    assert isinstance(batch[0], np.ndarray) and batch[0].tolist() == [True, False]


META = {"txt": "a caption", "score": 0.75, "missing": None, "size": 512, "tags": {"a": [1, 2]}, "arr": np.zeros(3)}


def _members_with_meta(n=3):
    """What SwissArmyTransformer's own tar iterator yields: each sample's bytes, then its metadata values."""
    for i in range(n):
        yield {"fname": f"s{i}.jpg", "data": b"\xff\xd8jpeg", "__url__": "shard-0.tar"}
        for name, value in META.items():
            yield {"fname": f"s{i}.{name}", "data": value, "__url__": "shard-0.tar"}


def test_grouping_stores_any_value_a_users_iterator_yields():
    """SwissArmyTransformer yields str, float, None, int and dict values beside bytes: grouping keeps each, as
    webdataset's does, and every stage after it (decode, to_tuple, batched) passes them on."""
    samples = list(group_by_keys(_members_with_meta()))
    assert [s["__key__"] for s in samples] == ["s0", "s1", "s2"]
    assert samples[0]["score"] == 0.75 and samples[0]["missing"] is None and samples[0]["tags"] == {"a": [1, 2]}
    stages = wds.DataPipeline(
        lambda: iter(_members_with_meta()),
        wds.pipelinefilter(group_by_keys)(),
        wds.decode(partial=True),
        wds.to_tuple("jpg", "txt", "score", "missing", none_is_error=False),
        wds.batched(3),
    )
    (batch,) = list(stages)
    assert batch[1] == ["a caption"] * 3 and batch[2].tolist() == [0.75] * 3 and batch[3] == [None] * 3


def test_grouping_limit_counts_the_bytes_of_bytes_like_values_only(monkeypatch):
    """The sample-size limit still refuses a sample whose bytes (or text, or array bytes) pass it; other values
    count only their member's fixed cost, so a user's iterator of numbers is bounded by count, never refused for
    its type."""
    monkeypatch.setenv("WDS_MAX_SAMPLE_SIZE", "16KiB")
    for value in (b"x" * 4096, bytearray(4096), "x" * 4096, np.zeros(512), memoryview(b"x" * 4096)):
        with pytest.raises(Exception, match="WDS_MAX_SAMPLE_SIZE"):
            list(group_by_keys(iter([{"fname": f"k.f{i}", "data": value, "__url__": "u"} for i in range(8)])))
    numbers = [{"fname": f"k.f{i}", "data": i, "__url__": "u"} for i in range(8)]
    assert len(list(group_by_keys(iter(numbers)))) == 1


def test_grouping_of_any_value_still_refuses_a_repeated_field():
    """A repeated field among metadata values is the usual SampleError naming the member."""
    items = [{"fname": "k.score", "data": 1.0, "__url__": "u"}, {"fname": "k.score", "data": None, "__url__": "u"}]
    with pytest.raises(SampleError, match="k.score"):
        list(group_by_keys(iter(items)))


def _mix(seed=None):
    return wds.RandomMix([list(range(0, 100)), list(range(100, 200))], probs=[1, 3], longest=True, seed=seed)


def test_random_mix_without_seed_follows_the_seeding_of_random():
    """open_lm seeds Python's random in its worker_init_fn and mixes with RandomMix(datasets, probs): two runs
    seeded alike give one order, as with webdataset; unseeded passes still differ."""
    random.seed(1234)
    first = list(_mix())
    random.seed(1234)
    assert list(_mix()) == first
    assert sorted(first) == list(range(200))
    assert list(_mix()) != first  # the next pass draws on from random


def test_random_mix_without_seed_resumes_exactly_from_its_state():
    """A pass seeded from random records its seed in the state: resuming gives exactly the rest, whatever random
    was seeded with meanwhile."""
    random.seed(5)
    mix = wds.RandomMix([_ListSource(range(0, 30)), _ListSource(range(30, 60))], longest=True)
    it = iter(mix)
    head = [next(it) for _ in range(17)]
    state = mix.state_dict()
    rest = list(it)
    random.seed(999)
    again = wds.RandomMix([_ListSource(range(0, 30)), _ListSource(range(30, 60))], longest=True)
    again.load_state_dict(state)
    assert list(again) == rest
    assert sorted(head + rest) == list(range(60))


def _upstream_picks(lengths, probs, longest, seed):
    """The sources a mix without seed= takes its items from, pick by pick, as webdataset 1.0.2 makes them: each
    pick is one draw of Python's random, placed among the cumulated shares (numpy's arithmetic) of the sources
    still in the mix; a source found ended is dropped (longest) or ends the mix."""
    random.seed(seed)
    left, weights, alive, picks = list(lengths), list(probs), list(range(len(lengths))), []
    while alive:
        shares = np.cumsum(np.array(weights, dtype=float) / np.sum(weights))
        k = min(int(np.searchsorted(shares, random.random())), len(alive) - 1)
        if left[alive[k]]:
            left[alive[k]] -= 1
            picks.append(alive[k])
        elif longest:
            del alive[k], weights[k]
        else:
            break
    return picks


@pytest.mark.parametrize("probs", [[1, 3], [0.2, 0.3, 0.5], [5, 0.001, 2]])
@pytest.mark.parametrize("longest", [True, False])
def test_random_mix_without_seed_makes_webdataset_picks(probs, longest):
    """open_lm compares runs pick by pick with webdataset's: a mix without seed= takes each item from the source
    webdataset's RandomMix takes it from, for the same seeding of random."""
    lengths = [37 * (i + 1) for i in range(len(probs))]
    sources = [[(i, j) for j in range(n)] for i, n in enumerate(lengths)]
    random.seed(1234)
    got = [i for i, _ in wds.RandomMix(sources, probs=probs, longest=longest)]
    assert got == _upstream_picks(lengths, probs, longest, 1234)


def test_random_mix_without_seed_resumes_where_random_stood():
    """A worker that restarts seeds random again in its worker_init_fn; the resumed pass puts random back where
    the state stood, so its picks, and the user's own draws after it, are the uninterrupted run's."""
    random.seed(7)
    mix = wds.RandomMix([_ListSource(range(0, 40)), _ListSource(range(40, 80))], probs=[1, 2], longest=True)
    it = iter(mix)
    [next(it) for _ in range(25)]
    state = mix.state_dict()
    rest, after = list(it), random.random()
    random.seed(7)  # the restarted worker's seeding
    again = wds.RandomMix([_ListSource(range(0, 40)), _ListSource(range(40, 80))], probs=[1, 2], longest=True)
    again.load_state_dict(state)
    assert list(again) == rest and random.random() == after


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.update(random=["AAAA", None]),  # not 625 words
        lambda s: s.update(random=[s["random"][0], "x"]),  # a gauss draw that is not a number
        lambda s: s.pop("random"),  # a mix drawing from random that does not say where random stood
        lambda s: s["rng"].__setitem__(0, 3),  # a seed, beside the recorded random
    ],
)
def test_a_forged_random_in_a_mix_state_is_refused(change):
    """The recorded state of random is checked on load (its words, its gauss draw, its agreement with 'rng')."""
    random.seed(3)
    mix = wds.RandomMix([_ListSource(range(10)), _ListSource(range(10, 20))], longest=True)
    it = iter(mix)
    [next(it) for _ in range(5)]
    state = {k: v for k, v in mix.state_dict().items() if k != SEAL}
    change(state)
    fresh = wds.RandomMix([_ListSource(range(10)), _ListSource(range(10, 20))], longest=True)
    with pytest.raises(StateMismatchError) as info:
        fresh.load_state_dict(seal(state))
    assert info.value.field in ("random", "rng")


class _ListSource:
    """A resumable list: its state is how many items it gave."""

    def __init__(self, items):
        self.items, self.given, self.start = list(items), 0, 0

    def __iter__(self):
        self.given = self.start
        self.start = 0
        while self.given < len(self.items):
            self.given += 1
            yield self.items[self.given - 1]

    def state_dict(self):
        return {"given": self.given}

    def load_state_dict(self, state):
        self.start = state["given"]


def test_random_samples_and_rsample_draw_from_random_as_webdataset():
    """random_samples without rng and rsample without seed draw each pick from Python's random, as webdataset's:
    seeding random alike gives the same picks, and the same ones webdataset makes (a draw below p keeps)."""
    random.seed(42)
    picks = list(wds.mix.random_samples([iter("aaaaaaaaaa"), iter("bbbbbbbbbb")], [1, 1]))
    random.seed(42)
    draws = [random.random() for _ in range(len(picks))]
    assert picks == ["a" if d <= 0.5 else "b" for d in draws][: len(picks)]
    random.seed(7)
    kept = list(wds.DataPipeline(lambda: iter(range(100)), wds.rsample(0.3)))
    random.seed(7)
    assert kept == [i for i in range(100) if random.random() < 0.3]


def test_meta_values_in_a_tar_pipeline_with_a_replaced_expander(tmp_path):
    """The whole SwissArmyTransformer shape: tarfile samples through a user's expander that adds a metadata member
    per sample (a float, None, text) and webdataset's group_by_keys."""
    path = tmp_path / "shard-0.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(3):
            info = tarfile.TarInfo(f"s{i}.id")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))

    def expander(data, handler=None):
        for source in data:
            with source["stream"] as raw, tarfile.open(fileobj=raw, mode="r|*") as stream:
                for member in stream:
                    yield {"fname": member.name, "data": stream.extractfile(member).read(), "__url__": source["url"]}
                    yield {
                        "fname": member.name[:-3] + ".score",
                        "data": None if member.name < "s1" else 0.5,
                        "__url__": source["url"],
                    }

    def samples(src):
        return group_by_keys(expander(wds.tariterators.url_opener(src)))

    got = list(wds.DataPipeline(wds.SimpleShardList([str(path)]), wds.pipelinefilter(samples)()))
    assert [(s["__key__"], s["id"], s["score"]) for s in got] == [
        ("s0", b"x", None),
        ("s1", b"x", 0.5),
        ("s2", b"x", 0.5),
    ]


def test_members_a_replaced_expander_adds_without_every_tag_join_their_sample(tmp_path, monkeypatch):
    """A user's expander replacing compat.tar_file_expander (the documented habit) adds a metadata member that
    carries __url__ but not __local_path__: it joins its sample, as webdataset groups by key alone."""
    from wds_cloud import compat, tariterators

    from .conftest import make_shards

    spec = make_shards(tmp_path, nshards=2, per_shard=3)
    ours = tariterators.tar_file_expander

    def with_scores(data, handler=wds.reraise_exception, select_files=None, rename_files=None, **kw):
        for member in ours(data, handler=handler, select_files=select_files, rename_files=rename_files):
            yield member
            if member and member["fname"].endswith(".cls"):
                yield {"fname": member["fname"][:-4] + ".score", "data": None, "__url__": member["__url__"]}

    monkeypatch.setattr(compat, "tar_file_expander", with_scores)
    samples = list(wds.WebDataset(spec, shardshuffle=False))
    assert len(samples) == 6 and all(set(s) >= {"txt", "cls", "json", "score"} for s in samples)


def test_webdataset_without_seed_draws_from_random_as_webdataset(tmp_path):
    """webdataset's WebDataset draws its default seed from random when built without seed=: the draw is made here
    too, so a script that seeds random, builds its datasets, then mixes them (RandomMix) gets webdataset's picks."""
    from .test_resume import write_shards

    urls = write_shards(tmp_path, [3])
    expected = random.Random(5)
    expected.randint(0, 1000000)
    random.seed(5)
    wds.WebDataset(urls, shardshuffle=False)
    assert random.random() == expected.random()
    random.seed(5)
    wds.WebDataset(urls, shardshuffle=False, seed=1)  # a seed given: nothing drawn
    assert random.random() == random.Random(5).random()


def test_a_batch_of_samples_with_other_fields_names_them():
    """Samples with different fields batched together are refused as webdataset refuses them, naming the sample,
    both field sets and the fix (a bare KeyError: 'jpg' came out, and extra fields of later samples were dropped)."""
    batch = wds.filters.default_collation_fn
    with pytest.raises(SampleError, match=r"sample 1 .*'png'.*key 'b'.*'jpg'.*to_tuple"):
        batch([{"__key__": "a", "jpg": 1}, {"__key__": "b", "png": 2}])
    with pytest.raises(SampleError, match="sample 2"):
        batch([{"a": 1}, {"a": 2}, {"a": 3, "b": 4}])
    with pytest.raises(SampleError, match="1 values, the first has 2"):
        batch([(1, 2), (3,)])
