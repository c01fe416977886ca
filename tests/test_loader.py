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


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [3, 4, 7, 9, 11, 31])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_and_drop_last_are_torchs(shards, num_workers, batch_size, drop_last):
    """The adversary's finding: the mark a worker sends after its last item was one item of a batch to torch, so
    with ``drop_last=True`` a batch of ``batch_size - 1`` items came as if whole (and a last short batch of 31
    over one worker's 30 samples came at all): the batches are torch's DataLoader's, item for item."""

    def batches(make):
        ds = wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("cls")
        loader = make(ds, batch_size=batch_size, num_workers=num_workers, drop_last=drop_last)
        return [[int(x) for x in batch[0]] for batch in loader]

    ours = batches(wds.WebLoader)
    assert ours == batches(torch.utils.data.DataLoader)
    assert all(len(b) == batch_size for b in ours) or not drop_last


def test_a_worker_whose_last_short_batch_is_dropped_holds_back_no_other_workers_batches(shards):
    """The adversary's finding: with ``drop_last=True`` a worker whose last short batch torch dropped took its end
    mark with it; the loader waited for that worker's turn, holding every later batch of the others until the pass
    ended.  Worker 0 (20 samples) stops before its last batch until the main process has its batch before it."""
    import multiprocessing

    got = multiprocessing.get_context("fork").Event()

    def hold(sample):
        if int(sample[0]) == 26 and not got.wait(60):  # (the first item of worker 0's last batch)
            raise RuntimeError("the batch before this one never reached the main process")
        return sample

    ds = wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("cls").map(hold)
    loader = wds.WebLoader(ds, batch_size=4, num_workers=2, drop_last=True, multiprocessing_context="fork")
    seen = []
    for batch in loader:
        seen.append([int(x) for x in batch[0]])
        if seen[-1][0] == 22:
            got.set()
    assert seen == [[0, 1, 2, 3], [10, 11, 12, 13], [4, 5, 6, 7], [14, 15, 16, 17], [8, 9, 20, 21]] + [
        [22, 23, 24, 25],
        [26, 27, 28, 29],
    ]


@pytest.mark.parametrize("num_workers,batch_size", [(0, 4), (2, 3), (2, 5)])
def test_a_state_taken_at_the_last_batch_starts_the_next_epoch(shards, num_workers, batch_size):
    """The new user's finding: a loop that stops at the epoch's last batch (a step budget) before the iterator says
    it ended got a state naming no worker next, which ``load_state_dict`` refused as edited.  Where every worker's
    last batch was short (its end came with it), that state is the pass's end: it starts the next epoch, as a state
    taken after the loop ended does (and one saved as it stood by the earlier version loads as that).  Where a
    worker's samples filled its last batch, its end comes after it: the state is that worker at its end, and loads
    as an empty rest of the pass, then the next epoch."""
    from wds_cloud.resume.state import seal

    def make():
        ds = wds.WebDataset(shards, shardshuffle=True, seed=1).decode().to_tuple("cls")
        return wds.WebLoader(ds, batch_size=batch_size, num_workers=num_workers)

    def cls(loader):
        return [[int(x) for x in b[0]] for b in loader]

    reference = make()
    first, second = cls(reference), cls(reference)
    assert first != second and sorted(sum(second, [])) == list(range(30))
    loader = make()
    for i, _ in enumerate(loader):
        if i + 1 == len(first):
            break
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    if batch_size == 5:  # 20 and 10 samples: every worker's last batch full
        assert state["epoch"] == 0 and cls(resumed) == []
    else:
        assert state["next"] == 0 and state["epoch"] == 1 and state["workers"] == []
    assert cls(resumed) == second
    # as the earlier version saved it: no worker next, every one exhausted
    legacy = {k: v for k, v in state.items() if not k.startswith("\0")}
    slots = max(1, num_workers)
    legacy = seal(dict(legacy, next=None, exhausted=list(range(slots)), epoch=0, workers=[[0, {}]]))
    resumed = make()
    resumed.load_state_dict(legacy)
    assert cls(resumed) == second


@pytest.mark.parametrize("value", ["false", "no", "0", "auto", 2, 1.0])
def test_pack_bytes_takes_none_true_or_false_only(shards, value):
    """The adversary's finding: any truthy ``pack_bytes`` (``"false"`` among them) meant True."""
    ds = wds.WebDataset(shards, shardshuffle=False)
    with pytest.raises(wds.ConfigError, match=r"pack_bytes='false'|pack_bytes='no'|pack_bytes=.*expected None"):
        wds.WebLoader(ds, batch_size=None, num_workers=2, pack_bytes=value)


class _Jsons(torch.utils.data.IterableDataset):
    """A dataset of the user's own over a WebDataset (no state of its own: the loader takes none; the statistics of
    the dataset inside still ride along with items)."""

    def __init__(self, url):
        self.inner = wds.WebDataset(url, shardshuffle=False).decode()

    @property
    def stats(self):
        return self.inner.stats

    def __iter__(self):
        return (s["json"] for s in self.inner)


def test_an_item_shaped_like_the_loaders_own_message_is_the_users(tmp_path):
    """The adversary's finding: a loader that takes no states knew the message its workers send with their
    statistics by its content (a list of four beginning with a tag): a sample of that shape (a JSON list) was
    dropped, or replaced by its second element."""
    tag = "\0wds_cloud.loaderstats.tag"
    values = [[tag, None, None, True], [tag, "x", None, False], [1, 2]] * 4
    with wds.TarWriter(str(tmp_path / "s.tar")) as sink:
        for i, value in enumerate(values):
            sink.write({"__key__": f"{i:03d}", "json": value})
    loader = wds.WebLoader(_Jsons(str(tmp_path / "s.tar")), batch_size=None, num_workers=1, collate_fn=lambda x: x)
    assert loader.resume_blocker() is not None
    assert list(loader) == values


def test_with_drop_last_a_resume_at_any_batch_gives_exactly_the_rest(tmp_path):
    """Items go on in whole batches and a worker's short rest is dropped in the worker (drop_last): a state after
    any batch resumes to exactly the batches a pass without a stop gives."""
    urls = []
    for s, n in enumerate([13, 7, 11]):
        urls.append(str(tmp_path / f"s{s}.tar"))
        with wds.TarWriter(urls[-1]) as sink:
            for i in range(n):
                sink.write({"__key__": f"{s}_{i:03d}", "cls": s * 100 + i})

    def make():
        ds = wds.WebDataset(urls, shardshuffle=True, seed=3).shuffle(5, seed=1).decode().to_tuple("cls")
        return wds.WebLoader(ds, batch_size=4, num_workers=2, drop_last=True)

    def cls(batches):
        return [[int(x) for x in b[0]] for b in batches]

    reference = cls(make())
    assert all(len(b) == 4 for b in reference) and len(reference) == 7
    for k in (0, 1, 3, 6, 7):
        loader = make()
        it = iter(loader)
        head = cls(next(it) for _ in range(k))
        state = loader.state_dict()
        del it
        resumed = make()
        resumed.load_state_dict(state)
        assert head + cls(resumed) == reference, k
