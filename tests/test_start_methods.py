"""Loader and resume under every start method: fork, spawn and forkserver (Python 3.14's default on Linux) workers
read what a fresh dataset gives, a dataset peeked at or loaded with a state included, and resume exactly."""

from __future__ import annotations

import json
import pickle

import pytest

import wds_cloud as wds
from wds_cloud.resume.loader import EndMark

from .start_methods import FORK_AND_PICKLE, program_start_method
from .test_resume import write_shards

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

SIZES = [5, 7, 4, 6]  # 22 samples in 4 shards: two each for two workers


@pytest.fixture
def urls(tmp_path):
    return write_shards(tmp_path, SIZES)


def shuffled(urls):
    """Shuffled shards and samples in batches of three keys: every resumable stage a pass holds."""
    return wds.WebDataset(urls, shardshuffle=True, seed=3).shuffle(4, seed=7).to_tuple("__key__").batched(3)


def batches(loader):
    return [list(keys) for (keys,) in loader]


def webloader(dataset, method, **kw):
    return wds.WebLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=method, **kw)


#: the passes of peeked datasets, left open while their loaders start workers (as a user's ``it`` would be)
OPEN_PASSES: list = []


@pytest.fixture(autouse=True)
def _close_open_passes():
    yield
    OPEN_PASSES.clear()


def peeked(dataset):
    """``dataset`` after one sample was taken from it, its pass left open, as a user checks the data first."""
    it = iter(dataset)
    next(it)
    OPEN_PASSES.append(it)
    return dataset


def stopped_and_resumed(make, method, cut):
    """The items of a pass of ``make(method)`` stopped after ``cut`` (its strict state through JSON), then of a new
    loader loaded with that state."""
    first = make(method)
    it = iter(first)
    head = [next(it) for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict(strict=True)))
    del it
    again = make(method)
    again.load_state_dict(state)
    return head + list(again)


def test_webloader_resumes_exactly(urls, start_method):
    """A WebLoader with two workers, stopped mid-pass, and a new one loaded with its state give exactly the pass a
    fresh forked one gives, the datasets peeked at first (spawn and forkserver workers receive them pickled)."""
    whole = batches(webloader(shuffled(urls), "fork"))
    assert sorted(k for b in whole for k in b) == sorted(
        f"s{s:02d}_{i:04d}" for s, n in enumerate(SIZES) for i in range(n)
    )

    def make(method):
        return webloader(peeked(shuffled(urls)), method)

    assert [list(keys) for (keys,) in stopped_and_resumed(make, start_method, 3)] == whole


def test_a_loaded_dataset_resumes_in_dataloader_workers_with_packing_collate(urls, start_method):
    """ds.load_state_dict(state), then torch's DataLoader(ds, num_workers=1, collate_fn=wds.transport.PackingCollate())
    as the docs write it: the worker gives exactly the rest of the pass, byte strings as bytes."""

    def dataset():
        return wds.WebDataset(urls, shardshuffle=True, seed=5).shuffle(4, seed=1).batched(3, collation_fn=None)

    whole = [(s["__key__"], s["txt"]) for batch in dataset() for s in batch]
    ds = dataset()
    it = iter(ds)
    head = [(s["__key__"], s["txt"]) for _ in range(2) for s in next(it)]
    state = json.loads(json.dumps(ds.state_dict()))
    resumed = dataset()
    resumed.load_state_dict(state)
    loader = torch.utils.data.DataLoader(
        resumed,
        batch_size=None,
        num_workers=1,
        collate_fn=wds.transport.PackingCollate(min_bytes=0),
        multiprocessing_context=start_method,
    )
    rest = [(s["__key__"], s["txt"]) for batch in loader for s in batch]
    assert head + rest == whole and all(type(txt) is bytes for _, txt in rest)


@pytest.mark.parametrize("start_method", FORK_AND_PICKLE, indirect=True)
def test_stateful_dataloader_resumes_exactly(urls, start_method):
    """torchdata's StatefulDataLoader with two workers (a state per worker, taken in the workers and sent back to
    new ones) resumes exactly, forked and forkserver-started (spawn pickles the same: the WebLoader's test pays)."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make(method):
        ds = wds.WebDataset(urls, shardshuffle=True, seed=2).shuffle(3, seed=4).to_tuple("__key__")
        return sdl.StatefulDataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context=method)

    whole = [list(keys) for (keys,) in make("fork")]
    first = make(start_method)
    it = iter(first)
    head = [list(next(it)[0]) for _ in range(3)]
    state = first.state_dict()
    del it
    again = make(start_method)
    again.load_state_dict(state)
    assert head + [list(keys) for (keys,) in again] == whole


def random_mix(urls):
    sources = [wds.WebDataset(urls[:2], shardshuffle=False), wds.WebDataset(urls[2:], shardshuffle=True, seed=6)]
    return wds.DataPipeline(wds.RandomMix(sources, [2, 1], seed=4, longest=True), wds.to_tuple("__key__"))


def streams(urls):
    return wds.WebDataset(urls, shardshuffle=True, seed=11, streams=2).shuffle(3, seed=1).to_tuple("__key__")


def equal_work(urls):
    return wds.WebDataset(urls, shardshuffle=True, seed=9, equal_work=7).shuffle(3, seed=9).to_tuple("__key__")


RECIPES = [random_mix, streams, equal_work]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("start_method", FORK_AND_PICKLE, indirect=True)
def test_mixes_streams_and_equal_work_resume_exactly_with_workers(urls, recipe, start_method):
    """RandomMix, streams= and equal_work= in a WebLoader with two workers, peeked at, stopped and resumed: exactly
    the pass a fresh forked loader gives (spawn pickles what forkserver does: the tests above pay for it)."""
    whole = [key for (key,) in webloader(recipe(urls), "fork")]
    if recipe is equal_work:
        assert len(whole) == 2 * 7

    def make(method):
        return webloader(peeked(recipe(urls)), method)

    assert [key for (key,) in stopped_and_resumed(make, start_method, 5)] == whole


def test_a_program_whose_start_method_is_forkserver_starts_webloader_workers(urls):
    """A program whose own start method is forkserver (Python 3.14's default on Linux) and a WebLoader given no
    context: a dataset peeked at starts the workers and yields what a fresh one does, and resumes exactly."""
    whole = batches(webloader(shuffled(urls), "fork"))
    with program_start_method("forkserver"):

        def make(_):
            return wds.WebLoader(peeked(shuffled(urls)), batch_size=None, num_workers=2)

        assert make(None).pipeline[0].multiprocessing_context.get_start_method() == "forkserver"
        assert batches(make(None)) == whole
        assert [list(keys) for (keys,) in stopped_and_resumed(make, None, 4)] == whole


@pytest.mark.parametrize(
    "start_method",
    ["fork", "forkserver"],
    indirect=True,
)  # spawn: a spawned worker gets the program's environment as it is when the loader starts
def test_a_setting_made_before_the_dataset_is_built_holds_in_its_workers(urls, tmp_path, monkeypatch, start_method):
    """WDS_MAX_MEMBER_SIZE, set by the program before it builds a dataset, holds in the dataset's workers, those of
    a forkserver started before the variable was set included (the environment is read when a dataset is built)."""
    list(wds.WebLoader(wds.WebDataset(urls[:1]), batch_size=None, num_workers=1, multiprocessing_context=start_method))
    monkeypatch.setenv("WDS_MAX_MEMBER_SIZE", "1000")
    (tmp_path / "large").mkdir()
    large = write_shards(tmp_path / "large", [2], payload=5000)
    loader = wds.WebLoader(wds.WebDataset(large), batch_size=None, num_workers=1, multiprocessing_context=start_method)
    with pytest.raises(wds.CorruptShardError, match="WDS_MAX_MEMBER_SIZE"):
        list(loader)


def _upper(data):
    return data.upper()


def _keys(items):
    return [
        item[0] if isinstance(item, (list, tuple)) else item["__key__"]
        for item in items
        if not isinstance(item, EndMark)
    ]


@pytest.mark.parametrize(
    "recipe",
    [
        shuffled,
        *RECIPES,
        lambda urls: wds.WebDataset(urls, shardshuffle=True, seed=4).to_tuple("__key__").with_epoch(9).with_length(9),
        lambda urls: wds.WebDataset(urls, resampled=True, seed=1).decode().with_epoch(9),
        lambda urls: wds.from_spec({"version": 1, "seed": 3, "sources": [{"name": "a", "urls": urls}]}),
        lambda urls: wds.WebDataset(urls, shardshuffle=False).decode(wds.handle_extension("txt", _upper)),
    ],
    ids=["shuffled", "random_mix", "streams", "equal_work", "with_epoch", "resampled", "spec", "handle_extension"],
)
def test_what_a_webloader_gives_its_workers_pickles_mid_pass(urls, recipe):
    """For every recipe, peeked at, and again loaded with a state: what a WebLoader hands torch to start a worker
    (its dataset, collate function and worker_init_fn) pickles; the copy runs the pass the original runs next, or
    exactly the loaded rest."""
    original = peeked(recipe(urls))
    inner = webloader(original, "spawn").pipeline[0]
    dataset, collate, _ = pickle.loads(pickle.dumps((inner.dataset, inner.collate_fn, inner.worker_init_fn)))
    assert callable(collate) and _keys(dataset) == _keys(original)
    ds = recipe(urls)
    it = iter(ds)
    head = _keys(next(it) for _ in range(5))
    state = ds.state_dict()
    whole = _keys(recipe(urls))
    loaded = recipe(urls)
    loaded.load_state_dict(state)
    inner = webloader(loaded, "spawn").pipeline[0]
    assert head + _keys(pickle.loads(pickle.dumps(inner.dataset))) == whole


# torch's map-style datasets: wids


def wids_dataset(urls):
    return wds.ShardListDataset([{"url": url, "nsamples": n} for url, n in zip(urls, SIZES)])


def test_a_wids_dataset_pickles_before_and_after_reading(urls):
    """wds.ShardListDataset with its default transformations ("PIL", as wids's) pickles before and after samples
    were read by index (its open shards are left behind), and the copy reads the same samples."""
    ds = wids_dataset(urls)
    pickle.dumps(ds)
    first = [ds[i]["__key__"] for i in (3, 10, 21)]
    copied = pickle.loads(pickle.dumps(ds))
    assert [copied[i]["__key__"] for i in (3, 10, 21)] == first


@pytest.mark.parametrize("start_method", FORK_AND_PICKLE, indirect=True)  # spawn pickles as forkserver does
def test_a_wids_dataset_read_by_index_reaches_dataloader_workers(urls, start_method):
    """A ShardListDataset read by index first, then given to torch's DataLoader with two workers and wids's
    ChunkedSampler: every sample once, under fork and the start methods that pickle."""
    from wds_cloud import wids

    ds = wids_dataset(urls)
    ds[3]
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=None,
        num_workers=2,
        sampler=wids.ChunkedSampler(ds, chunksize=5, seed=0),
        multiprocessing_context=start_method,
    )
    keys = sorted(sample["__key__"] for sample in loader)
    assert keys == sorted(f"s{s:02d}_{i:04d}" for s, n in enumerate(SIZES) for i in range(n))
