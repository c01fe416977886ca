"""Batches cross from DataLoader workers as a small pickle plus their buffers in shared memory
(wds_cloud.loader.frames, WebLoader's default): whatever the collation built arrives with its types."""

import os
import pickle
import signal
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wds_cloud as wds

torch = pytest.importorskip("torch")

from wds_cloud.loader import frames, unframe  # noqa: E402

pytestmark = pytest.mark.skipif(not frames._MEMFD, reason="frames need Linux memfd")


@pytest.fixture(autouse=True)
def fresh_pickler():
    """Each test starts with this process's pickler unmade (no streak of plain batches from another test)."""
    frames._picklers.__dict__.clear()
    yield
    frames._picklers.__dict__.clear()


def cross(batch):
    """``batch`` as a worker's queue sends it and the main process receives it (here, one process plays both)."""
    return pickle.loads(ForkingPickler.dumps(frames.frame(batch)))


def same(a, b):
    """Equal, and of the same types all the way down (a view arrives as bytes)."""
    if type(a) is memoryview:
        return type(b) is bytes and a.tobytes() == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def leaves():
    sizes = st.integers(0, 3000)
    return st.one_of(
        st.integers(),
        st.text(max_size=20),
        sizes.map(lambda n: os.urandom(n)),
        sizes.map(lambda n: bytearray(os.urandom(n))),
        sizes.map(lambda n: memoryview(os.urandom(n))),
        st.tuples(st.sampled_from(["u1", "<f4", ">i4", "i8", "?", "c8"]), st.integers(0, 700)).map(
            lambda d: (
                np.frombuffer(os.urandom(d[1] * np.dtype(d[0]).itemsize), dtype=d[0]).copy()
                if d[0] != "?"
                else np.arange(d[1]) % 3 == 0
            )
        ),
        st.integers(0, 700).map(lambda n: np.arange(2 * n, dtype=np.float64).reshape(2, n)[:, ::2]),  # strided
        st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]), st.integers(0, 600)).map(
            lambda d: (torch.arange(d[1]) % 5).to(d[0])
        ),
        st.integers(1, 600).map(lambda n: torch.arange(3 * n, dtype=torch.float32).reshape(3, n).t()),  # not contiguous
    )


def batches():
    return st.recursive(
        leaves(),
        lambda inner: st.one_of(
            st.lists(inner, max_size=6),
            st.lists(inner, max_size=6).map(tuple),
            st.dictionaries(st.text(max_size=5), inner, max_size=6),
        ),
        max_leaves=25,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_any_batch_arrives_with_its_types_and_values(batch):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(frames, "PLAIN_STREAK", 10**9)  # every batch examined (none sent as torch sends it)
        assert same(batch, cross(batch))


def test_a_batch_of_images_crosses_with_only_its_structure_in_the_pipe():
    jpgs = [os.urandom(20_000 + i) for i in range(64)]
    batch = {"jpg": jpgs, "cls": list(range(64)), "meta": [{"key": f"k{i}", "raw": os.urandom(600)} for i in range(64)]}
    message = ForkingPickler.dumps(frames.frame(batch))
    assert len(message) < 12_000  # the 1.3 MB of jpgs and 38 kB of raw fields are in the ring
    assert same(batch, pickle.loads(message))


def test_an_object_held_twice_is_one_object_after():
    array, blob = np.arange(1000), os.urandom(5000)
    out = cross([array, array, blob, (blob, array)])
    assert out[0] is out[1] is out[3][1] and out[2] is out[3][0]


def test_a_small_tensor_held_twice_is_one_tensor_after():
    """The adversary's finding: a tensor under the size left out of the pickle, met twice in a batch, came as two
    tensors (torch's pickling, and a larger one, keep it one)."""
    small = torch.arange(10)
    out = cross([small, {"again": small}, torch.arange(3)])
    assert out[0] is out[1]["again"] and out[0].tolist() == list(range(10)) and out[2].tolist() == [0, 1, 2]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_sparse_and_nested_tensors_cross_as_torch_sends_them():
    """The adversary's finding: a sparse or nested tensor failed in the worker (its bytes were asked for; it has
    none of its own): torch pickles it, as its DataLoader does."""
    dense = torch.arange(12.0).reshape(3, 4)
    batch = [dense.to_sparse(), dense.to_sparse_csr(), torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])]
    out = cross(batch)
    assert out[0].layout == torch.sparse_coo and torch.equal(out[0].to_dense(), dense)
    assert out[1].layout == torch.sparse_csr and torch.equal(out[1].to_dense(), dense)
    assert out[2].is_nested and [t.tolist() for t in out[2].unbind()] == [[1.0, 1.0], [1.0, 1.0, 1.0]]


def _shared(t):
    return [
        [t, t[1:]],
        [t[1:], t],
        [t, t[::2], t],
        [t, t.view(64, 128)],
        [t, *t.view(8, 1024).unbind(0)],
        {"a": t, "b": {"c": t[1:]}},
    ]


def test_tensors_sharing_a_storage_arrive_whole_and_still_sharing_it(tmp_path):
    """Adversary: a tensor and a view of it in one batch ([t, t[1:]]) gave the tensor's bytes from memory already
    freed (torch moved the storage into shared memory as it pickled the view, after the tensor's bytes were
    noted and before they were copied); tensors that share a storage now all cross as torch sends them."""

    def check(batch, got):
        assert same(batch, got)
        tensors = [v for v in (got if isinstance(got, list) else [got["a"], got["b"]["c"]])]
        addresses = {x.untyped_storage().data_ptr() for x in tensors}
        assert len(addresses) == 1  # one storage, as sent

    for batch in _shared(torch.arange(8192, dtype=torch.float32)):
        check(batch, cross(batch))
    urls = make_shards(tmp_path / "d", n=1, per=4)
    ds = wds.WebDataset(urls, shardshuffle=False).map(lambda s: _shared(torch.arange(8192.0) + len(s["bin"])))
    for batches in wds.WebLoader(ds, batch_size=None, num_workers=1):
        expected = _shared(torch.arange(8192.0) + float(batches[0][0][0]))
        _ = [bytearray(32768) for _ in range(50)]  # what frees and reuses memory, as a trainer's step does
        for batch, got in zip(expected, batches):
            check(batch, got)


def test_each_column_of_bytes_is_made_in_one_call(monkeypatch):
    """The main process's work per batch: one call per column of byte strings, not one per item."""
    calls = []
    made = unframe.Unpickler.persistent_load
    monkeypatch.setattr(unframe.Unpickler, "persistent_load", lambda self, pid: calls.append(pid[0]) or made(self, pid))
    for n in (8, 80, 800):
        calls.clear()
        batch = ([os.urandom(600) for _ in range(n)], [os.urandom(700) for _ in range(n)], list(range(n)))
        assert same(batch, cross(batch))
        assert calls == [unframe.KIND_LIST, unframe.KIND_LIST]


def test_small_buffers_and_what_cannot_be_left_out_stay_in_the_pickle():
    small = [b"x" * (frames.MIN_ITEM_BYTES - 1), np.zeros(3), torch.zeros(2), memoryview(b"ab")]
    message = ForkingPickler.dumps(frames.frame(small))  # nothing to leave out: the pickle crosses, once
    assert same(small, pickle.loads(message)) and len(message) < 3 * frames.MIN_ITEM_BYTES
    assert b"DupFd" not in message and b"rebuild_storage" not in message  # no shared memory for a small tensor
    grad = torch.zeros(1000, requires_grad=True)
    out = cross([grad, os.urandom(1000)])
    assert out[0].requires_grad and torch.equal(out[0], grad)


def test_after_batches_with_nothing_large_a_few_go_as_they_are_then_one_is_examined_again():
    tiny = [b"t" * 100, 7]
    assert all(isinstance(frames.frame(tiny), frames._Pickled) for _ in range(frames.PLAIN_STREAK))
    assert all(frames.frame(tiny) is tiny for _ in range(frames.PLAIN_SKIP))
    large = [os.urandom(5000), b"x"]
    assert isinstance(frames.frame(large), frames._Framed)  # examined again: left out
    assert frames.frame(large) is not large and same(large, cross(large))  # a large batch resets the streak
    assert frames.frame(tiny) is not tiny


def test_a_full_ring_grows_and_a_batch_too_large_for_any_ring_gets_a_segment(monkeypatch):
    monkeypatch.setattr(frames, "RING_BYTES", 1 << 16)
    monkeypatch.setattr(frames, "MAX_RING_BYTES", 1 << 18)
    monkeypatch.setattr(frames, "_ring", None)
    monkeypatch.setattr(frames, "_retired", [])
    batches = [[os.urandom(10_000) for _ in range(3)] for _ in range(12)]  # 30 kB each: the main process is behind
    sent = [ForkingPickler.dumps(frames.frame(b)) for b in batches]
    # the first ring holds four such batches (128 kB), the next twice that, the largest; the rest have segments
    assert frames._ring.size == 1 << 18 and len(frames._retired) == 1
    assert [pickle.loads(m) for m in sent] == batches
    huge = [os.urandom(70_000), os.urandom(70_000)]  # 4 x 140 kB does not fit the largest ring
    assert pickle.loads(ForkingPickler.dumps(frames.frame(huge))) == huge
    later = [os.urandom(9000) for _ in range(2)]
    assert cross(later) == later
    assert not frames._retired  # the main process took what the old rings held: the worker let them go
    assert frames._ring.token in unframe.RINGS


def test_rings_replaced_are_dropped_by_the_main_process(monkeypatch):
    monkeypatch.setattr(frames, "RING_BYTES", 1 << 16)
    monkeypatch.setattr(frames, "_ring", None)
    monkeypatch.setattr(frames, "_retired", [])
    first = cross([os.urandom(20_000), os.urandom(20_000)])
    old = frames._ring.token
    pending = [ForkingPickler.dumps(frames.frame([os.urandom(20_000), os.urandom(20_000)])) for _ in range(8)]
    assert frames._ring.token != old and old in unframe.RINGS  # grown while batches on the old one are on their way
    for message in pending:
        assert len(pickle.loads(message)) == 2
    assert old not in unframe.RINGS and len(first) == 2


def test_without_memfd_the_batch_is_pickled_whole(monkeypatch):
    monkeypatch.setattr(frames, "_MEMFD", False)
    batch = [os.urandom(5000)]
    assert frames.frame(batch) is batch


def test_a_region_outside_the_frame_is_refused():
    body = frames._Pickler().pickle([os.urandom(4000)])
    with pytest.raises(pickle.UnpicklingError, match="outside its 100 bytes"):
        unframe.Unpickler(body, memoryview(bytearray(100))).load()
    unpickler = unframe.Unpickler(b"", memoryview(bytearray(100)))
    for pid in (
        (unframe.KIND_LIST, 0, 10, "20s"),
        (unframe.KIND_TUPLE, 0, 30, "20s"),
        (unframe.KIND_LIST, 0, 20, "20q"),
    ):
        with pytest.raises(pickle.UnpicklingError, match="does not fit"):
            unpickler.persistent_load(pid)
    with pytest.raises(pickle.UnpicklingError, match="unknown kind"):
        unpickler.persistent_load((99, 0, 10))


# --- through WebLoader's workers ---------------------------------------------------------------------------------


def make_shards(directory, n=2, per=20, size=3000):
    directory.mkdir(exist_ok=True)
    for s in range(n):
        with wds.TarWriter(str(directory / f"f-{s}.tar")) as sink:
            for i in range(per):
                sink.write({"__key__": f"{s}-{i:03d}", "bin": bytes([i]) * (size + i), "cls": str(i).encode()})
    return str(directory / f"f-{{0..{n - 1}}}.tar")


def collate(samples):
    """A user's own collation: a dict of a list, a tuple of bytearrays, an array and a tensor."""
    return {
        "bin": [s[1] for s in samples],
        "pair": tuple(bytearray(s[1][:600]) for s in samples),
        "array": np.stack([np.frombuffer(s[1][:1000], dtype=np.uint8) for s in samples]),
        "tensor": torch.stack([torch.frombuffer(bytearray(s[1][:800]), dtype=torch.uint8) for s in samples]),
        "keys": [s[0] for s in samples],
    }


def read(urls, zero_copy=False, **kw):
    ds = (
        wds.WebDataset(urls, shardshuffle=False, zero_copy=zero_copy)
        .to_tuple("__key__", "bin")
        .batched(5, collation_fn=collate)
    )
    return wds.WebLoader(ds, batch_size=None, num_workers=2, **kw)


def test_a_users_collation_arrives_as_it_built_the_batch(tmp_path):
    urls = make_shards(tmp_path / "d")
    plain = list(read(urls, pack_bytes=False))
    for framed in (list(read(urls)), list(read(urls, zero_copy=True))):
        assert len(framed) == 8 and all(map(same, plain, framed))


def test_persistent_workers_keep_their_rings_over_epochs(tmp_path):
    urls = make_shards(tmp_path / "d", per=60)
    loader = read(urls, persistent_workers=True)
    before = set(unframe.RINGS)
    first = list(loader)
    tokens = set(unframe.RINGS) - before
    assert len(tokens) == 2
    for _ in range(3):
        assert all(map(same, first, list(loader)))
    assert set(unframe.RINGS) - before == tokens  # the same workers, the same rings: nothing new mapped
    assert all(unframe.RINGS[t].size == frames.RING_BYTES for t in tokens)  # kept up with: never grown


def test_spawned_workers_frame_too(tmp_path):
    urls = make_shards(tmp_path / "d", per=10)
    plain = list(read(urls, pack_bytes=False))
    assert all(map(same, plain, list(read(urls, multiprocessing_context="spawn"))))


def test_the_rings_of_workers_that_exited_are_dropped_as_a_pass_ends(tmp_path):
    """Adversary: a loader's rings (grown to 64 MiB) stayed mapped after the loader was gone, until another ring
    arrived; they go as the pass that made them ends."""
    urls = make_shards(tmp_path / "d")
    before = set(unframe.RINGS)
    for _ in range(3):
        assert len(list(read(urls))) == 8
        assert not set(unframe.RINGS) - before
    loader = read(urls, persistent_workers=True)
    list(loader)
    assert len(set(unframe.RINGS) - before) == 2  # its workers live on, with their rings


def _dies_at(sample, key="0-050"):
    if sample["__key__"] == key:  # (in a worker: the worker dies mid-pass, after sending batches)
        os.kill(os.getpid(), signal.SIGKILL)
    return sample


def test_a_worker_killed_mid_pass_is_an_error_not_a_hang(tmp_path):
    urls = make_shards(tmp_path / "d", per=200)
    ds = wds.WebDataset(urls, shardshuffle=False).map(_dies_at).to_tuple("__key__", "bin").batched(5)
    with pytest.raises(RuntimeError, match="(?i)worker"):  # (torch's own error, from its SIGCHLD handler or next)
        for _ in wds.WebLoader(ds, batch_size=None, num_workers=2, timeout=120):
            pass
