"""A shard list of 10^7 shards costs each worker what its spec costs: brace names computed when asked (exactly
braceexpand's), URL lists packed into one buffer, the epoch's order a seeded permutation computed position by
position, and a worker's share a stride over it."""

import hashlib
import itertools
import pickle
import subprocess
import sys
import tracemalloc
from itertools import islice

import braceexpand
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud.resume.order import ShardOrder
from wds_cloud.shardlists import ShardPass, SimpleShardList, _urls_digest, shard_sequence, slot_shards
from wds_cloud.utils import BraceNames, PackedStrings

HUGE = "s3://bucket/train/shard-{0000000..9999999}.tar"


def _share(shards, rank, world, worker, workers):
    """The URLs one rank and worker read of one pass, split as split_by_node and split_by_worker split it."""
    return shards.run().split(lambda: (rank, world)).split(lambda: (worker, workers))


def test_a_worker_of_ten_million_shards_holds_a_few_kilobytes():
    """Building a 10^7-name shard list and taking one worker's slice of a shuffled epoch stays under 2 MB."""
    tracemalloc.start()
    try:
        shards = SimpleShardList(HUGE, seed=7)
        mine = list(islice(_share(shards, 1234, 4096, 5, 8), 50))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(shards.urls) == 10**7 and len(mine) == 50 and peak < 2 * 2**20, peak
    assert all(u["url"].startswith("s3://bucket/train/shard-") for u in mine)


def test_a_worker_computes_only_its_own_positions(monkeypatch):
    """split_by_node then split_by_worker compute one order position and one name per shard the worker yields."""
    calls = {"order": 0, "name": 0}
    at, name = ShardOrder._at, BraceNames.__getitem__

    def counted_at(self, i):
        calls["order"] += 1
        return at(self, i)

    def counted_name(self, i):
        calls["name"] += 1
        return name(self, i)

    monkeypatch.setattr(ShardOrder, "_at", counted_at)
    monkeypatch.setattr(BraceNames, "__getitem__", counted_name)
    monkeypatch.setattr(wds.utils, "pytorch_worker_info", lambda group=None: (3, 16, 1, 4))
    shards = SimpleShardList("t-{00000..99999}.tar", seed=3)
    mine = list(wds.split_by_worker(wds.split_by_node(shards.run())))
    assert len(mine) == len(range(100_000)[3::16][1::4]) and calls == {"order": len(mine), "name": len(mine)}


def test_a_split_pass_gives_what_islice_gives():
    """ShardPass.split yields exactly what islice(pass, first, None, step) would; a pass under way is islice()d."""
    for seed in (None, 5):
        shards = SimpleShardList("t-{000..122}.tar", seed=seed)
        shards.set_epoch(2)
        whole = [u["url"] for u in shards.run()]
        for world, workers in ((1, 1), (3, 1), (4, 5), (200, 1)):
            for rank in range(world):
                for worker in range(workers):
                    shards.set_epoch(2)
                    got = [u["url"] for u in _share(shards, rank, world, worker, workers)]
                    assert got == whole[rank::world][worker::workers]
        shards.set_epoch(2)
        started = shards.run()
        first = [next(started)["url"] for _ in range(4)]
        assert first + [u["url"] for u in wds.split_by_node(started)] == whole
    assert isinstance(SimpleShardList(["a", "b"]).run(), ShardPass)


def test_split_by_node_and_worker_stride_the_pass(monkeypatch):
    """split_by_node/split_by_worker take a ShardPass's share by stride: the shares partition the epoch."""
    shards = SimpleShardList("t-{000..099}.tar", seed=1)
    seen = []
    for rank in range(3):
        for worker in range(2):
            monkeypatch.setattr(wds.utils, "pytorch_worker_info", lambda group=None, r=rank, w=worker: (r, 3, w, 2))
            shards.set_epoch(0)
            seen += [u["url"] for u in wds.split_by_worker(wds.split_by_node(shards.run()))]
    assert sorted(seen) == list(braceexpand.braceexpand("t-{000..099}.tar"))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2000), st.integers(-(2**70), 2**70), st.integers(0, 10**6))
def test_the_order_is_a_permutation(n, seed, epoch):
    """ShardOrder(n, seed, epoch) holds every index of range(n) once; index() is its inverse."""
    order = ShardOrder(n, seed, epoch)
    values = list(order)
    assert sorted(values) == list(range(n)) and len(order) == n
    assert all(order.index(v) == i for i, v in enumerate(values[:50]))
    if n:
        assert order[-1] == values[-1] and list(order[1::3]) == values[1::3]
        with pytest.raises(IndexError):
            order[n]


def test_the_order_is_the_same_in_every_process():
    """A seed gives one order whatever the process and its hash seed (positions of a 10^7-shard order)."""
    code = (
        "from wds_cloud.resume.order import ShardOrder; o = ShardOrder(10**7, 42, 3); print([o[i] for i in range(20)])"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "12345"}
    ).stdout
    here = ShardOrder(10**7, 42, 3)
    assert there == str([here[i] for i in range(20)]) + "\n"
    assert list(ShardOrder(50, 42, 3)) != list(ShardOrder(50, 42, 4)) != list(ShardOrder(50, 43, 3))


def test_the_order_looks_uniform():
    """Over 3,000 seeds each of the 6 orders of 3 shards comes up about equally often (a weak shuffle would not)."""
    counts = {}
    for seed in range(3000):
        key = tuple(ShardOrder(3, seed, 0))
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 6 and min(counts.values()) > 400


_ATOMS = [
    "a",
    "-",
    ".",
    "x/",
    "0",
    "07",
    "-3",
    "Z",
    "..",
    ",",
    "{",
    "}",
    "\\",
    "\\{",
    "\\,",
    "{1..3}",
    "{a,b}",
    "{,x}",
    "{05..-2..3}",
    "{-4..4..-2}",
    "{9..7}",
    "{z..B..2}",
    "{A..c}",
    "{1{2,3}}",
    "{p{0..2},q}",
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(_ATOMS), max_size=8))
def test_brace_names_are_braceexpands(atoms):
    """BraceNames gives braceexpand's names in its order (nesting, alternatives, stepped, padded, negative and
    descending ranges, letters, escapes, literal and unbalanced braces), by index and by iteration."""
    spec = "".join(atoms)
    try:
        expected = list(islice(braceexpand.braceexpand(spec), 5000))
    except braceexpand.UnbalancedBracesError:
        with pytest.raises(braceexpand.UnbalancedBracesError):
            BraceNames(spec)
        return
    names = BraceNames(spec)
    if len(names) <= 5000:
        assert list(names) == expected and len(names) == len(expected)
    assert [names[i] for i in range(min(len(names), 1000))] == expected[:1000]


def test_long_specs_by_index_and_iteration():
    """A spec iterated chunk by chunk and by index gives braceexpand's names, across chunk boundaries."""
    spec = "s3://b/{x,y\\,z}/t-{0000..9999..3}{.tar,.tgz}"
    expected = list(braceexpand.braceexpand(spec))
    names = BraceNames(spec)
    assert list(names) == expected and [names[i] for i in range(len(names))] == expected
    assert list(names[5::7]) == expected[5::7] and names[-1] == expected[-1]
    assert list(shard_sequence("a{0..2}::b{x,y}")) == ["a0", "a1", "a2", "bx", "by"]


def test_url_lists_are_packed():
    """A list of URLs is kept as one buffer and an offsets array (about 9 bytes a URL over its own), pickled so."""
    urls = [f"s3://bucket/train/shard-{i:07d}.tar" for i in range(100_000)]
    shards = SimpleShardList(urls)
    assert isinstance(shards.urls, PackedStrings) and list(shards.urls) == urls
    assert shards.urls[123] == urls[123] and list(shards.urls[::999]) == urls[::999]
    size = len(pickle.dumps(shards.urls))
    assert size < sum(len(u) + 10 for u in urls), size
    odd = ["é/x", "a\nb", "\udcff.tar", ""]
    packed = PackedStrings(odd)
    assert list(packed) == odd and [packed[i] for i in range(4)] == odd and pickle.loads(pickle.dumps(packed)) == odd


def test_a_dataset_pickles_without_its_names():
    """A 10^7-shard dataset pickles (to a spawned worker) as its spec, not its names."""
    dataset = wds.WebDataset(HUGE, shardshuffle=True, seed=1)
    assert len(pickle.dumps(dataset)) < 50_000
    shards = pickle.loads(pickle.dumps(SimpleShardList(HUGE, seed=2)))
    assert shards.urls[9_999_999] == "s3://bucket/train/shard-9999999.tar"


@pytest.mark.parametrize(
    "urls",
    [
        "t-{000..099}.tar::u-{a..e}.tar",
        [f"/d/ü-{i}.tar" for i in range(5000)],
        [f"/d/{i}.tar" for i in range(9000)],
        ["/d/\udcff.tar", "/d/b.tar"],
    ],
)
def test_the_state_digest_is_unchanged(urls):
    """A state's urls_sha256 is what earlier versions computed (one string of every URL), so their states load."""
    shards = SimpleShardList(urls, seed=1)
    old = hashlib.sha256("\n".join(list(shards.urls)).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    assert shards.state_dict()["config"]["urls_sha256"] == old == _urls_digest(list(shards.urls))


def test_slots_are_views_of_the_order():
    """slot_shards gives every slot a view of the order; together they hold every shard once."""
    slots = slot_shards(10_007, 9, 1, 7, 3)
    assert sorted(itertools.chain.from_iterable(slots)) == list(range(10_007))
    assert list(slots[4]) == list(ShardOrder(10_007, 9, 1))[1::7][1::3]


def test_the_urls_behave_as_a_sequence():
    """``.urls`` of a brace spec: len, indexing, negative indexes, slices, iteration, list() and ``in`` work."""
    urls = SimpleShardList("d/t-{0..9}.tar").urls
    assert len(urls) == 10 and urls[3] == "d/t-3.tar" and urls[-1] == "d/t-9.tar" and "d/t-4.tar" in urls
    assert list(urls[2:5]) == ["d/t-2.tar", "d/t-3.tar", "d/t-4.tar"] and list(urls)[0] == "d/t-0.tar"
    with pytest.raises(IndexError):
        urls[10]


def test_lazy_url_sequences_index_as_lists_do():
    """A brace spec's names, a packed list and a shard order refuse a float index with TypeError and an index out of
    range with an IndexError naming the index given (a negative one was quoted as normalised)."""
    names = wds.SimpleShardList("a-{0000000..9999999}.tar").urls
    packed = wds.SimpleShardList(["a.tar", "b.tar"]).urls
    for seq, size in ((names, 10**7), (packed, 2), (ShardOrder(10, 1, 0), 10)):
        with pytest.raises(TypeError, match="not float"):
            seq[2.0]
        with pytest.raises(IndexError, match=f" {-size - 1} out of range"):
            seq[-size - 1]
        with pytest.raises(IndexError, match=f" {size} out of range"):
            seq[size]
        assert seq[-1] == seq[size - 1]
    assert "view of 3 items" in repr(names[3:6])
