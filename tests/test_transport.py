"""Byte strings batched in DataLoader workers travel as one shared-memory tensor (WebLoader(pack_bytes=...))."""

import copy
import os
import pickle

import pytest

import wds_cloud as wds

torch = pytest.importorskip("torch")

from wds_cloud.loader import transport  # noqa: E402
from wds_cloud.loader.transport import PackedBytes, pack_batch  # noqa: E402


def test_packed_bytes_is_a_sequence_of_the_items():
    items = [b"alpha", b"", b"\x00\xffbytes", os.urandom(3000)]
    packed = PackedBytes.pack(items)
    assert len(packed) == 4 and list(packed) == items and packed == items and packed[-1] == items[-1]
    assert packed[1:3] == items[1:3] and isinstance(packed[0], bytes)
    assert bytes(packed.view(2)) == items[2] and packed.view(2).readonly
    assert packed.tensor(0).tolist() == list(b"alpha")
    assert packed + [b"z"] == items + [b"z"]
    with pytest.raises(IndexError):
        packed.view(4)


def test_pack_batch_packs_the_byte_columns_only():
    batch = ([b"a", b"b"], torch.tensor([1, 2]), ["x", "y"], [b"only one"])
    packed = pack_batch(batch)
    assert isinstance(packed[0], PackedBytes) and packed[1] is batch[1] and packed[2] == ["x", "y"]
    # a column of one (a last batch of one sample) is one too: its type does not hang on its length (it stayed a list)
    assert packed[3] == [b"only one"] and isinstance(packed[3], PackedBytes)
    assert isinstance(pack_batch({"jpg": [b"1", b"2"], "n": 3})["jpg"], PackedBytes)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("transport")
    for s in range(4):
        with wds.TarWriter(str(root / f"t-{s}.tar")) as w:
            for i in range(50):
                w.write({"__key__": f"{s}-{i:03d}", "jpg": os.urandom(100 + i), "cls": b"%d" % (i % 10)})
    return str(root / "t-{0..3}.tar")


@pytest.mark.parametrize("resumable", [True, False])
def test_batches_from_workers_are_the_same_packed_or_pickled(shards, resumable):
    def loader(pack):
        ds = wds.WebDataset(shards, shardshuffle=False).to_tuple("jpg", "cls", "__key__").batched(16)
        if not resumable:
            ds = ds.compose(lambda src: (x for x in src))  # a stage of the user's without a state
        return wds.WebLoader(ds, batch_size=None, num_workers=2, pack_bytes=pack)

    plain = list(loader(False))
    packed = list(loader(True))
    assert len(plain) == len(packed) == 14
    for (jpg0, cls0, key0), (jpg1, cls1, key1) in zip(plain, packed):
        assert isinstance(jpg1, PackedBytes) and isinstance(jpg0, list)
        assert list(jpg1) == jpg0 and list(cls1) == cls0 and key1 == key0


def test_pin_memory_keeps_the_batch_packed():
    packed = PackedBytes.pack([b"ab", b"cd"])
    if not torch.cuda.is_available():
        pytest.skip("pinning memory needs CUDA")
    pinned = packed.pin_memory()
    assert isinstance(pinned, PackedBytes) and pinned.data.is_pinned() and list(pinned) == [b"ab", b"cd"]
    jpg, cls = pack_batch(([b"ab", b"cd"], [b"1", b"2"]))
    assert jpg.pin_memory().data is cls.pin_memory().data  # one buffer per batch, pinned once


def test_a_shared_buffer_is_pinned_once_and_forgotten_with_it():
    """The pinned copy is kept beside the buffer (not written onto it): asked again for the same buffer, the
    same copy; a new buffer, a new copy; the entry goes when its buffer does.  (A buffer that counts its
    pinnings stands in for a tensor: pinning needs CUDA, which CI does not have.)"""
    import gc

    class Buffer:
        pinnings = 0

        def pin_memory(self):
            Buffer.pinnings += 1
            return ("pinned", Buffer.pinnings)

    first, second = Buffer(), Buffer()
    assert transport._pinned(first) is transport._pinned(first) == ("pinned", 1)
    assert transport._pinned(second) == ("pinned", 2) and Buffer.pinnings == 2
    before = len(transport._PINNED)
    del first
    gc.collect()
    assert len(transport._PINNED) == before - 1 and transport._pinned(second) == ("pinned", 2)


def test_the_columns_of_a_batch_share_one_buffer_and_survive_pickling_and_copies():
    batch = pack_batch(([b"abc", b"de"], [b"x", b"yz"], ["k1", "k2"]))
    assert batch[0].data is batch[1].data and batch[2] == ["k1", "k2"]
    for copied in (pickle.loads(pickle.dumps(batch)), copy.deepcopy(batch)):
        assert list(copied[0]) == [b"abc", b"de"] and list(copied[1]) == [b"x", b"yz"]
    # code that rebuilds a sequence as type(seq)(items) (Lightning's apply_to_collection) gets one back
    rebuilt = type(batch[0])([bytes(v) for v in batch[0].views()])
    assert isinstance(rebuilt, PackedBytes) and rebuilt == batch[0] and list(PackedBytes()) == []
    assert [b"0"] + batch[1] == [b"0", b"x", b"yz"] and batch[1] + [b"1"] == [b"x", b"yz", b"1"]


def test_the_default_keeps_each_columns_type_and_pack_bytes_true_packs(shards):
    """pack_bytes=None (the default) sends a batch's buffers through shared memory (wds_cloud.loader.frames) and
    the batch arrives as the collation built it: lists of bytes, at any size; pack_bytes=True packs."""

    def first(**kw):
        ds = wds.WebDataset(shards, shardshuffle=False).to_tuple("jpg", "__key__").batched(kw.pop("n"))
        return next(iter(wds.WebLoader(ds, batch_size=None, num_workers=1, **kw)))

    for n in (4, 16):
        batch = first(n=n)
        assert type(batch[0]) is list and all(type(item) is bytes for item in batch[0]) and len(batch[0]) == n
        assert type(first(n=n, pack_bytes=False)[0]) is list
        assert isinstance(first(n=n, pack_bytes=True)[0], PackedBytes)
    assert first(n=16)[0] == first(n=16, pack_bytes=False)[0] == list(first(n=16, pack_bytes=True)[0])


def test_batches_kept_alive_hold_no_open_files(shards):
    """torch's shared tensors each keep a descriptor open in the receiving process, so a program that keeps
    ~1,000 batches fails with "Too many open files"; packed batches are mapped and their descriptors closed."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("counts this process's descriptors in /proc")
    ds = wds.WebDataset(shards, shardshuffle=False, resampled=True).to_tuple("jpg", "cls").batched(2)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=2, pack_bytes=True, persistent_workers=True)
    kept, it = [], iter(loader)
    kept.extend(next(it) for _ in range(10))
    before = len(os.listdir("/proc/self/fd"))
    kept.extend(next(it) for _ in range(300))
    assert len(os.listdir("/proc/self/fd")) - before < 50
    assert all(isinstance(b[0], PackedBytes) and len(b[0]) == 2 for b in kept)
    del it


def test_a_received_batch_can_be_sent_on_to_another_process(shards):
    mp = pytest.importorskip("torch.multiprocessing")
    ds = wds.WebDataset(shards, shardshuffle=False).to_tuple("jpg", "cls").batched(8)
    batch = next(iter(wds.WebLoader(ds, batch_size=None, num_workers=1, pack_bytes=True)))
    ctx = mp.get_context("fork")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_echo, args=(inbox, outbox))
    child.start()
    inbox.put(batch)
    assert outbox.get(timeout=60) == [list(batch[0]), list(batch[1])]
    child.join(timeout=60)


def _echo(inbox, outbox):
    batch = inbox.get()
    outbox.put([list(batch[0]), list(batch[1])])


def test_torchs_own_dataloader_packs_with_the_packing_collate(shards):
    from torch.utils.data import DataLoader

    ds = wds.WebDataset(shards, shardshuffle=False).to_tuple("jpg", "cls").batched(8)
    batches = list(DataLoader(ds, batch_size=None, num_workers=1, collate_fn=transport.PackingCollate()))
    assert all(isinstance(b[0], PackedBytes) for b in batches) and sum(len(b[0]) for b in batches) == 200


def test_without_memfd_batches_travel_in_torchs_shared_memory(shards, monkeypatch):
    monkeypatch.setattr(transport, "_MEMFD", False)
    ds = wds.WebDataset(shards, shardshuffle=False).to_tuple("jpg", "cls").batched(16)
    plain = list(wds.WebLoader(ds, batch_size=None, num_workers=2, pack_bytes=False))
    packed = list(wds.WebLoader(ds, batch_size=None, num_workers=2, pack_bytes=True))
    assert all(isinstance(b[0], PackedBytes) for b in packed)
    assert [(list(a), list(b)) for a, b in packed] == [(a, b) for a, b in plain]


def test_packed_bytes_rebuilt_from_a_buffer_of_bytes_reads_its_items():
    """The second 44 new user: PackedBytes(b"abcde", [0, 2, 5]) was accepted, and raised AttributeError on its
    first item (only a uint8 tensor worked, which docs/gpu.md did not say)."""
    from wds_cloud.transport import PackedBytes

    for data in (b"abcde", bytearray(b"abcde"), memoryview(b"abcde")):
        packed = PackedBytes(data, [0, 2, 5])
        assert list(packed) == [b"ab", b"cde"] and packed[1] == b"cde" and packed.view(0).tobytes() == b"ab"
