"""Everything the loader machinery hands to DataLoader workers pickles (``spawn`` and ``forkserver`` workers get
it pickled): ``PackingCollate``, the collate wrappers that keep views, and what ``WebLoader`` gives torch."""

from __future__ import annotations

import pickle

import pytest

import wds_cloud as wds
from wds_cloud.loader.transport import BytesCollate, PackingCollate
from wds_cloud.resume.views import KeepingViews, default_collate, keeping_views

from .test_views_nested import dataset, plain, write_shards

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("pickling"))


def _again(obj):
    """``obj`` through pickle, as a spawned worker receives it."""
    return pickle.loads(pickle.dumps(obj))


def test_the_collate_functions_pickle_and_work_after():
    """PackingCollate (default and with torch's default_collate), BytesCollate, the view-keeping wrappers of torch's
    default_convert and default_collate: each pickles and collates the same after."""
    from torch.utils.data import default_collate as torch_collate
    from torch.utils.data import default_convert

    view = memoryview(b"abc")
    sample = {"a": [{"b": view}], "n": 1}
    for collate, data in (
        (PackingCollate(), sample),
        (PackingCollate(torch_collate, min_bytes=5), [sample, sample]),
        (BytesCollate(default_convert), sample),
        (keeping_views(default_convert, True), sample),
        (KeepingViews(torch_collate, False), [sample, sample]),
        (KeepingViews(default_convert, True, to_bytes=True), sample),
        (default_collate(True), sample),
        (default_collate(False), [sample, sample]),
    ):
        copied = _again(collate)
        assert type(copied) is type(collate)
        assert plain(copied(data), True) == plain(collate(data), True)
    assert PackingCollate(torch_collate).inner is default_collate(False)  # torch's own, made to keep views


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_workers": 2},
        {"num_workers": 2, "pack_bytes": False},
        {"num_workers": 2, "pack_bytes": True, "batch_size": 2},
        {"num_workers": 0, "pin_memory": True},
    ],
)
def test_what_a_webloader_gives_torch_pickles(urls, kwargs):
    """The collate function and dataset a WebLoader hands torch's DataLoader pickle (before any pass), for a
    resumable pipeline and for a user's own dataset that takes no states."""
    kwargs.setdefault("batch_size", None)
    for ds in (dataset(urls, True), OwnSamples(urls)):
        inner = wds.WebLoader(ds, **kwargs).pipeline[0]
        assert isinstance(inner, torch.utils.data.DataLoader)
        collate = _again(inner.collate_fn)
        assert type(collate) is type(inner.collate_fn)
        _again(inner.dataset)


class OwnSamples(torch.utils.data.IterableDataset):
    """A user's own dataset (the loader takes no states of it): samples of the shards, nested."""

    def __init__(self, urls):
        super().__init__()
        self.urls = urls

    def __iter__(self):
        return iter(dataset(self.urls, True))


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_packing_collate_with_torchs_dataloader_in_spawned_workers(urls, context):
    """The documented recipe, DataLoader(..., collate_fn=wds.transport.PackingCollate()), starts spawn and
    forkserver workers (it failed: a local function could not be pickled); views one level down (a list of
    sample dicts) arrive as bytes.  Only the library's own stages, so the worker imports no test module."""
    expected = {s["__key__"]: s for s in wds.WebDataset(urls, shardshuffle=False)}
    loader = torch.utils.data.DataLoader(
        wds.WebDataset(urls, shardshuffle=False, zero_copy=True).batched(4, collation_fn=None),
        batch_size=None,
        num_workers=1,
        collate_fn=wds.transport.PackingCollate(),
        multiprocessing_context=context,
    )
    got = {sample["__key__"]: sample for batch in loader for sample in batch}
    assert got.keys() == expected.keys()
    for key, sample in got.items():
        assert type(sample["txt"]) is bytes and sample["txt"] == expected[key]["txt"] == b"xxxxx"
        assert sample["bin"] == expected[key]["bin"]
