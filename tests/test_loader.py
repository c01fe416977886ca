"""Real DataLoader workers: forked, spawned and forkserver-started, each reading its own shards."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wds_cloud as wds

from .start_methods import FORK_AND_PICKLE

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("start_method", FORK_AND_PICKLE, indirect=True)  # spawn: test_start_methods.py's resume
def test_webloader_two_workers(shards, start_method):
    """Two workers split the shards: every sample exactly once, in the order a fresh dataset gives, forked and
    forkserver-started, for a dataset peeked at whose pass is still open (a forkserver's workers get it pickled)."""

    def cls(loader):
        return [int(x[0]) for x in loader]

    def dataset():
        return wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("cls")

    fresh = cls(wds.WebLoader(dataset(), batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert sorted(fresh) == list(range(30))
    ds = dataset()
    peek = iter(ds)
    assert int(next(peek)[0]) == 0
    loader = wds.WebLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=start_method)
    assert cls(loader) == fresh
    assert int(next(peek)[0]) == 1  # the peek's own pass goes on where it stood


def test_dataloader_workers_receive_the_pipeline(shards, start_method):
    """with_length pipelines with shuffled shards, peeked at first, reach torch's DataLoader workers under every
    start method and yield what forked workers yield (the pass after the peek's, as webdataset counts epochs)."""

    def cls(method):
        ds = wds.WebDataset(shards, shardshuffle=True, seed=2).decode().to_tuple("cls").with_length(30)
        next(iter(ds))
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=method)
        return [int(x[0]) for x in loader]

    got = cls(start_method)
    assert got == cls("fork") and sorted(got) == list(range(30))


def test_webloader_fluent_and_epoch(shards):
    """WebLoader has the fluent methods and passes set_epoch to its dataset."""
    ds = wds.WebDataset(shards, shardshuffle=True).decode().to_tuple("cls").batched(5)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=0).unbatched().shuffle(10).batched(6)
    loader.set_epoch(3)
    assert ds.pipeline[0].epoch == 3
    assert sorted(int(x) for b in loader for x in b[0]) == list(range(30))


_leaves = st.one_of(
    st.binary(max_size=4), st.text(max_size=3), st.integers(), st.floats(allow_nan=False), st.booleans(), st.none()
)


def _containers(inner):
    # a function, not a lambda: hypothesis reads an extend's source to check it uses its argument, and a lambda's
    # source it cannot always find (it then warned, which the suite makes an error)
    return st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
    )


@settings(max_examples=300, deadline=None)
@given(
    data=st.recursive(
        _leaves,
        _containers,
        max_leaves=12,
    )
)
def test_the_item_conversion_of_workers_is_torchs_default_convert(data):
    """A batch made in a worker (``batch_size=None``) is converted as torch's ``default_convert`` converts it: the
    shortcut for columns of byte strings, texts and numbers gives what torch's walk gives (a tuple becomes a
    list, lists are copied), whatever the batch holds."""
    torch = pytest.importorskip("torch")
    from wds_cloud.resume.loader import default_collate

    ours, theirs = default_collate(True)(data), torch.utils.data.default_convert(data)
    assert repr(ours) == repr(theirs) and type(ours) is type(theirs)
    if isinstance(data, (list, tuple)) and data:
        assert ours is not data  # a new container, as torch's
