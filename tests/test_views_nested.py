"""Views (``WebDataset(zero_copy=True)``) nested at any depth of dicts, lists and tuples arrive as ``bytes`` would:
through WebLoader with 0, 1 and 2 workers, through torch's own DataLoader with ``PackingCollate``, through the
packer, never as lists or tensors of numbers; and every walk over a batch is bounded."""

from __future__ import annotations

import collections
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud.errors import MalformedDataError
from wds_cloud.loader.transport import PackedBytes, as_bytes, pack_batch
from wds_cloud.resume.views import MAX_DEPTH, KeepingViews, holds_views

from .conftest import make_shards

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("views"))


def write_shards(root):
    """Two small shards of 4 samples (``txt``: b"xxxxx", ``bin``: a few bytes): their paths."""
    out = []
    for s in range(2):
        path = str(root / f"v-{s}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(4):
                sink.write({"__key__": f"{s}-{i}", "txt": b"xxxxx", "bin": bytes([s * 16 + i]) * (i + 1)})
        out.append(path)
    return out


def nest(sample):
    """Every nesting at once, of the sample's two fields (views, or bytes): a module-level function, so it pickles."""
    t, b = sample["txt"], sample["bin"]
    return {
        "__key__": sample["__key__"],
        "top": t,
        "list_in_dict": {"a": [t, b]},
        "dict_in_list": [{"t": t}, {"b": b}],
        "tuple_in_list_in_dict": {"a": [(t, 1), (b, 2)]},
        "four_levels": {"a": [{"b": ({"c": [t]},)}]},
        "empty": {"a": [], "b": {}, "c": (), "d": [t]},
        "zero_bytes": {"a": [t[:0]], "b": (b[:0],)},
        "numpy_beside": {"a": [np.arange(3), b]},
    }


def plain(value, views_allowed):
    """``value`` in comparable terms (tensors as lists, packed columns as lists of bytes); a view fails the test
    unless ``views_allowed`` (what a loader hands over holds none)."""
    if type(value) is memoryview:
        assert views_allowed, "a loader handed over a view"
        return value.tobytes()
    if isinstance(value, PackedBytes):
        return list(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", value.tolist())
    if isinstance(value, dict):
        return {k: plain(v, views_allowed) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v, views_allowed) for v in value)
    return value


def by_key(items):
    """Loader items keyed by sample key (workers interleave): a batch's keys are a list of them."""
    out = {}
    for item in items:
        keys = item["__key__"]
        out[tuple(keys) if isinstance(keys, list) else keys] = item
    return out


#: a namedtuple of the module (so that it pickles)
point = collections.namedtuple("point", "x y")


def dataset(urls, zero_copy):
    return wds.WebDataset(urls, shardshuffle=False, zero_copy=zero_copy).map(nest)


def test_unit_walks_keep_each_nesting_and_its_types():
    """as_bytes and pack_batch make every nested view bytes and keep container types (namedtuples, dict
    subclasses); a batch holding no view is given back as the same object."""
    data = memoryview(b"abcdefgh").toreadonly()
    batch = {
        "a": [{"b": (data[:2], [data[2:4]])}],
        "n": point(data[:1], 3),
        "o": collections.OrderedDict(k=data[4:6]),
        "e": ([], {}, (), data[:0]),
        "arr": np.arange(2),
    }
    assert holds_views(batch) and not holds_views({"a": [[b"x"], (1, "y")]})
    out = as_bytes(batch)
    assert out["a"] == [{"b": (b"ab", [b"cd"])}] and type(out["a"][0]["b"]) is tuple
    assert out["n"] == point(b"a", 3) and type(out["n"]) is point
    assert type(out["o"]) is collections.OrderedDict and out["o"] == {"k": b"ef"}
    assert out["e"] == ([], {}, (), b"") and type(out["e"][3]) is bytes
    assert out["arr"] is batch["arr"]
    pickle.dumps(out)  # nothing unpicklable is left
    plain_batch = {"a": [[b"x"], (1, "y")], "t": np.arange(3)}
    assert as_bytes(plain_batch) is plain_batch and pack_batch(plain_batch) is plain_batch
    packed = pack_batch({"col": [data[:1], data[1:3]], "deep": [{"v": data[3:5]}]})
    assert isinstance(packed["col"], PackedBytes) and list(packed["col"]) == [b"a", b"bc"]
    assert packed["deep"] == [{"v": b"de"}] and type(packed["deep"][0]["v"]) is bytes
    assert pack_batch([{"txt": data[:3]}, {"txt": data[3:5]}]) == [{"txt": b"abc"}, {"txt": b"de"}]


def test_unit_collate_keeps_views_as_torch_keeps_bytes():
    """torch's default_convert and default_collate, kept from reading views as numbers, give for views exactly
    what they give for the same bytes, at every nesting; a batch without views is exactly torch's."""
    from torch.utils.data import default_collate, default_convert

    view = memoryview(b"xxxxx").toreadonly()
    with_views = [nest({"__key__": str(i), "txt": view, "bin": view[: i + 1]}) for i in range(3)]
    with_bytes = [nest({"__key__": str(i), "txt": b"xxxxx", "bin": b"xxxxx"[: i + 1]}) for i in range(3)]
    convert, collate = KeepingViews(default_convert, True), KeepingViews(default_collate, False)
    for ours, theirs in ((convert, default_convert), (collate, default_collate)):
        got = plain(ours(with_views), views_allowed=True)
        assert got == plain(theirs(with_bytes), views_allowed=True)
        assert plain(ours(with_bytes), views_allowed=True) == plain(theirs(with_bytes), views_allowed=True)
    assert collate(with_views)["top"] == [b"xxxxx"] * 3 and type(collate(with_views)["top"][0]) is memoryview


def test_the_issues_batched_samples_arrive_as_bytes_with_0_1_2_workers(urls):
    """WebLoader(WebDataset(zero_copy=True).batched(4, collation_fn=None), batch_size=None): each sample's field
    is b"xxxxx", bytes with or without workers, never [120, 120, ...]."""
    for workers in (0, 1, 2):
        ds = wds.WebDataset(urls, shardshuffle=False, zero_copy=True).batched(4, collation_fn=None)
        batches = list(wds.WebLoader(ds, batch_size=None, num_workers=workers))
        assert len(batches) == 2 and all(len(b) == 4 for b in batches)
        for sample in (s for b in batches for s in b):
            assert sample["txt"] == b"xxxxx"
            assert type(sample["txt"]) is bytes, workers


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_every_nesting_through_webloader_is_what_bytes_give(urls, workers):
    """Samples and batches (batch_size=None and batch_size=2) with views nested at every depth arrive as the same
    samples read as bytes: the same structure, bytes for views (without workers too), nothing numeric."""
    for batch_size in (None, 2):
        expected = by_key(plain(x, True) for x in wds.WebLoader(dataset(urls, False), batch_size=batch_size))
        got = by_key(
            plain(x, False)
            for x in wds.WebLoader(dataset(urls, True), batch_size=batch_size, num_workers=workers, pack_bytes=True)
        )
        assert got == expected and len(got) == (8 if batch_size is None else 4)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_every_nesting_through_torchs_dataloader_with_packing_collate(urls, workers):
    """torch's own DataLoader with collate_fn=wds.transport.PackingCollate(): views at every depth arrive as the
    bytes would; with torch's default_collate given as inner (the docs' way when the loader batches) too."""
    loader = torch.utils.data.DataLoader
    expected = by_key(plain(x, True) for x in loader(dataset(urls, False), batch_size=None))
    pack = wds.transport.PackingCollate()
    got = by_key(
        plain(x, False) for x in loader(dataset(urls, True), batch_size=None, num_workers=workers, collate_fn=pack)
    )
    assert got == expected
    batched = by_key(plain(x, True) for x in loader(dataset(urls, False), batch_size=2))
    pack = wds.transport.PackingCollate(torch.utils.data.default_collate)
    got = by_key(
        plain(x, False) for x in loader(dataset(urls, True), batch_size=2, num_workers=workers, collate_fn=pack)
    )
    assert got == batched


def test_views_in_the_main_process_are_bytes_where_torch_walks_the_batch(urls):
    """Without workers: a loader that cannot take states (a user's own sample source) hands views over as bytes
    too, and so it does with pin_memory (torch's pinning walk reads a view as numbers)."""
    samples = [nest(s) for s in wds.WebDataset(urls, shardshuffle=False, zero_copy=True)]
    own = wds.WebLoader(Own(samples), batch_size=None)
    assert own.resume_blocker() is not None
    expected = [plain(x, True) for x in wds.WebLoader(dataset(urls, False), batch_size=None)]
    assert [plain(x, False) for x in own] == expected
    with pytest.warns(UserWarning, match="pin_memory|accelerator"):  # no accelerator here: torch says so
        pinned = list(wds.WebLoader(dataset(urls, True), batch_size=None, pin_memory=True))
    assert not any(holds_views(x) for x in pinned)
    assert [plain(x, False) for x in pinned] == expected


class Own(torch.utils.data.IterableDataset):
    """A user's own dataset (no states: the loader iterates it as torch's would)."""

    def __init__(self, samples):
        super().__init__()
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


def _cyclic_with_a_view():
    inner: list = [memoryview(b"ab")]
    inner.append(inner)
    return {"field": inner}


def _deep(levels, leaf):
    value = leaf
    for _ in range(levels):
        value = {"k": [value]}
    return value


def test_a_hostile_batch_is_refused_by_every_walk_with_an_error_naming_where():
    """A batch nested deeper than MAX_DEPTH (or holding itself, with a view) is MalformedDataError (a ValueError)
    naming the path and the fix from the packer, as_bytes and both collate wrappers: never a RecursionError."""
    from torch.utils.data import default_collate, default_convert

    view = memoryview(b"v")
    for hostile in (_deep(5000, view), _cyclic_with_a_view()):
        for walk in (as_bytes, pack_batch, KeepingViews(default_convert, True)):
            with pytest.raises(MalformedDataError, match=rf"more than {MAX_DEPTH} deep.*batch\[") as caught:
                walk(hostile)
            assert caught.value.field == "batch" and "flatter" in str(caught.value)
    with pytest.raises(MalformedDataError, match="deep"):
        KeepingViews(default_collate, False)([_deep(5000, 1), _deep(5000, 1)])
    # finding views goes a level at a time: any depth, no recursion; a deep batch without views passes as it is
    assert holds_views(_deep(5000, view)) and not holds_views(_deep(5000, b"no view"))
    deep = _deep(5000, b"no view")
    assert as_bytes(deep) is deep and pack_batch(deep) is deep


def test_a_batch_that_holds_itself_without_views_or_shares_a_part_is_walked_once():
    """A cycle without views passes through the packer as before (pickle takes cycles); a part held many times
    (2**60 paths through 60 containers) is walked once, not once per path."""
    cyclic: list = [b"x", 1]
    cyclic.append(cyclic)
    assert pack_batch({"c": cyclic}) == {"c": cyclic} and pickle.loads(pickle.dumps(pack_batch(cyclic)))
    shared: list = [memoryview(b"ab")]
    for _ in range(60):
        shared = [shared, shared]
    out = as_bytes({"s": shared})
    leaf = out["s"]
    while type(leaf) is list and len(leaf) == 2:
        assert leaf[0] is leaf[1]  # made once, shared as it was
        leaf = leaf[0]
    assert leaf == [b"ab"]


def _leaves():
    return st.one_of(st.binary(max_size=4), st.text(max_size=3), st.integers(-5, 5), st.none())


def _containers(inner):
    return st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), inner, max_size=3),
    )


def _viewed(value):
    """``value`` with every bytes leaf a view of the same bytes."""
    if type(value) is bytes:
        return memoryview(value)
    if type(value) is dict:
        return {k: _viewed(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_viewed(v) for v in value)
    return value


@settings(deadline=None)
@given(data=st.recursive(_leaves(), _containers, max_leaves=10))
def test_any_nesting_collates_and_packs_as_its_bytes_do(data):
    """Whatever the nesting, the collate wrappers give for views what torch gives for the same bytes, and the
    packer and as_bytes then give exactly what they give for the bytes."""
    from torch.utils.data import default_collate, default_convert

    views = _viewed(data)
    assert plain(KeepingViews(default_convert, True)(views), True) == plain(default_convert(data), True)
    assert plain(KeepingViews(default_convert, True, to_bytes=True)(views), False) == plain(default_convert(data), True)
    try:
        expected = plain(default_collate([data, data]), True)
    except (TypeError, RuntimeError):  # what torch cannot collate (None, ragged lists) it cannot with views either
        with pytest.raises((TypeError, RuntimeError)):
            KeepingViews(default_collate, False)([views, views])
    else:
        assert plain(KeepingViews(default_collate, False)([views, views]), True) == expected
        assert plain(KeepingViews(default_collate, False, to_bytes=True)([views, views]), False) == expected
    assert as_bytes(views) == data and not holds_views(as_bytes(views))
    assert plain(pack_batch(views), False) == plain(pack_batch(data), False)


def test_to_device_refuses_a_batch_that_holds_itself():
    """``to_device`` walks a batch to a bounded depth: a batch that holds itself is a MalformedDataError naming the
    batch, not a RecursionError."""
    torch = pytest.importorskip("torch")
    from wds_cloud.loader.gpu import to_device

    batch: list = [torch.zeros(2)]
    batch.append(batch)
    with pytest.raises(wds.MalformedDataError, match="holds itself"):
        to_device(batch, "cpu")
    assert to_device({"a": [torch.ones(1)]}, "cpu")["a"][0].item() == 1.0


def _in_a_set(sample):
    return {"__key__": sample["__key__"], "fs": frozenset([sample["txt"]]), "keyed": {sample["cls"]: 1}}


def test_a_view_where_no_walk_looks_crosses_from_a_worker_as_bytes(tmp_path):
    """A view in a frozenset or a dict's key (where the walks do not look) crosses from a worker as bytes: it
    could not be pickled, and torch's worker, failing in its queue's thread, left the main process waiting."""
    urls = make_shards(tmp_path, 1, 3)
    ds = wds.WebDataset(urls, zero_copy=True, shardshuffle=False).map(_in_a_set)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=1, timeout=60)
    sample = next(iter(loader))
    assert [type(x) for x in sample["fs"]] == [bytes] and [type(k) for k in sample["keyed"]] == [bytes]
