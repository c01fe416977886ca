"""Byte strings batched in DataLoader workers travel as one shared-memory tensor (WebLoader(pack_bytes=True))."""

import os

import pytest

import wds_cloud as wds

torch = pytest.importorskip("torch")

from wds_cloud.transport import PackedBytes, pack_batch  # noqa: E402


def test_packed_bytes_is_a_sequence_of_the_items():
    items = [b"alpha", b"", b"\x00\xffbytes", os.urandom(3000)]
    packed = PackedBytes.pack(items)
    assert len(packed) == 4 and list(packed) == items and packed == items and packed[-1] == items[-1]
    assert packed[1:3] == items[1:3] and isinstance(packed[0], bytes)
    assert bytes(packed.view(2)) == items[2] and packed.view(2).readonly
    assert packed.tensor(0).tolist() == list(b"alpha") and packed.data.is_shared()
    assert packed + [b"z"] == items + [b"z"]
    with pytest.raises(IndexError):
        packed.view(4)


def test_pack_batch_packs_the_byte_columns_only():
    batch = ([b"a", b"b"], torch.tensor([1, 2]), ["x", "y"], [b"only one"])
    packed = pack_batch(batch)
    assert isinstance(packed[0], PackedBytes) and packed[1] is batch[1] and packed[2] == ["x", "y"]
    assert packed[3] == [b"only one"] and not isinstance(packed[3], PackedBytes)
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
