"""Feeding a GPU: decoding a batch's images on a device, copying batches there.

CI has no GPU: the CPU fallback, the errors and the loader wiring are tested here; the tests marked
``gpu`` run only where CUDA (and torchvision) are available.
"""

import io

import pytest

import wds_cloud as wds
from wds_cloud.errors import ConfigError, DecodingError
from wds_cloud.transport import PackedBytes

torch = pytest.importorskip("torch")
PIL = pytest.importorskip("PIL.Image")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def encoded(colour, size=(40, 30), fmt="JPEG"):
    out = io.BytesIO()
    PIL.new("RGB", size, colour).save(out, format=fmt, quality=95)
    return out.getvalue()


BATCH = [encoded((250, 0, 0)), encoded((0, 250, 0), fmt="PNG"), encoded((0, 0, 250), size=(30, 40))]


def test_cpu_fallback_decodes_resizes_crops_and_normalizes():
    decode = wds.gpu_decode(0, device="cpu", size=24, crop=20)
    images, label = decode((BATCH, "label"))
    assert label == "label" and images.shape == (3, 3, 20, 20) and images.dtype == torch.uint8
    assert images[0, 0].float().mean() > 200 and images[1, 1].float().mean() > 200  # JPEG and PNG alike
    normalized = wds.gpu_decode(0, device="cpu", size=24, crop=20, mean=[0.5] * 3, std=[0.5] * 3)((BATCH,))[0]
    assert normalized.dtype == torch.float32 and float(normalized.max()) <= 1.0 + 1e-6
    uneven = wds.gpu_decode(0, device="cpu")((BATCH,))[0]
    assert isinstance(uneven, list) and [tuple(i.shape) for i in uneven] == [(3, 30, 40), (3, 30, 40), (3, 40, 30)]


def test_a_batch_of_one_size_is_resized_at_once_like_each_image_alone():
    same = [encoded((250, 10 * i, 0), size=(48, 36)) for i in range(4)]
    decode = wds.gpu_decode(0, device="cpu", size=24, crop=20)
    together = decode((same,))[0]
    alone = torch.cat([decode(([image],))[0] for image in same])
    assert together.shape == (4, 3, 20, 20) and torch.equal(together, alone)
    floats = wds.gpu_decode(0, device="cpu", size=24, dtype=torch.float32)((same,))[0]
    assert floats.dtype == torch.float32 and floats.shape == (4, 3, 24, 32) and 0 <= float(floats.min())
    empty = wds.gpu_decode(0, device="cpu", crop=20)(([],))[0]
    assert empty.shape == (0, 3, 20, 20)


def test_a_damaged_image_is_an_error_naming_it():
    with pytest.raises(DecodingError, match=r"image 1 of the batch \(15 bytes.*leave damaged images out"):
        wds.gpu_decode(0, device="cpu")(([BATCH[0], b"\xff\xd8\xff damaged...."],))


def test_packed_batches_and_dict_batches_decode_too():
    packed = PackedBytes.pack(BATCH)
    out = wds.gpu_decode("jpg", device="cpu", size=16, crop=16)({"jpg": packed, "cls": [1, 2, 3]})
    assert out["jpg"].shape == (3, 3, 16, 16) and out["cls"] == [1, 2, 3]


def test_no_cuda_is_a_clear_error_naming_the_cpu_fallback():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available.*device='cpu'"):
        wds.gpu_decode(0)((BATCH,))
    with pytest.raises(ConfigError, match="CUDA is not available"):
        wds.to_device((torch.zeros(2),), "cuda")


def test_bad_arguments_and_a_crop_larger_than_the_image():
    with pytest.raises(ConfigError, match="mean and std together"):
        wds.gpu_decode(mean=[0.5] * 3)
    with pytest.raises(ConfigError, match="smaller than crop"):
        wds.gpu_decode(0, device="cpu", crop=64)((BATCH,))


def test_never_in_a_dataloader_worker(tmp_path):
    path = str(tmp_path / "img.tar")
    with wds.TarWriter(path) as w:
        for i in range(4):
            w.write({"__key__": f"{i}", "jpg": BATCH[0]})
    ds = wds.WebDataset(path, shardshuffle=False).to_tuple("jpg").batched(2).map(wds.gpu_decode(0, device="cpu"))
    with pytest.raises(ConfigError, match="never in a DataLoader worker"):
        list(wds.WebLoader(ds, batch_size=None, num_workers=1))


def test_a_loader_with_device_cpu_and_gpu_decode_in_the_main_process(tmp_path):
    for s in range(2):
        with wds.TarWriter(str(tmp_path / f"img-{s}.tar")) as w:
            for i in range(3 * s, 3 * s + 3):
                w.write({"__key__": f"{i}", "jpg": BATCH[i % 3], "cls": b"%d" % i})
    ds = (
        wds.WebDataset(str(tmp_path / "img-{0..1}.tar"), shardshuffle=False)
        .decode(only="cls")
        .to_tuple("jpg", "cls")
        .batched(3)
    )
    loader = wds.WebLoader(ds, batch_size=None, num_workers=2, pack_bytes=True, device="cpu")
    loader = loader.map(wds.gpu_decode(0, device="cpu", size=20, crop=20))
    batches = list(loader)
    assert [tuple(b[0].shape) for b in batches] == [(3, 3, 20, 20)] * 2
    assert sorted(int(c) for b in batches for c in b[1]) == list(range(6))


@cuda
def test_on_the_gpu_equals_the_cpu_decode_within_jpeg_tolerance():
    pytest.importorskip("torchvision")
    on_gpu = wds.gpu_decode(0, size=24, crop=20)((PackedBytes.pack(BATCH),))[0]
    on_cpu = wds.gpu_decode(0, device="cpu", size=24, crop=20)((BATCH,))[0]
    assert on_gpu.device.type == "cuda" and on_gpu.shape == on_cpu.shape
    assert (on_gpu.cpu().int() - on_cpu.int()).abs().float().mean() < 3


@cuda
def test_on_the_gpu_one_refused_image_costs_only_itself():
    pytest.importorskip("torchvision")
    cmyk = io.BytesIO()
    PIL.new("CMYK", (40, 30), (0, 255, 255, 0)).save(cmyk, format="JPEG")
    batch = [encoded((250, 0, 0)), cmyk.getvalue(), b"\xff\xd8\xff damaged", encoded((0, 250, 0))]
    decode = wds.gpu_decode(0, size=24, crop=20)
    with pytest.raises(DecodingError, match="image 2 of the batch"):
        decode((batch,))  # the damaged one cannot be decoded anywhere: an error, not a silent blank
    images = decode(([batch[0], batch[1], batch[3]],))[0]
    assert images.device.type == "cuda" and images.shape == (3, 3, 20, 20)
    assert images[1, 0].float().mean() > 200  # the CMYK image decoded (on the CPU), red


@cuda
def test_to_device_copies_from_pinned_memory_on_a_side_stream():
    stream = torch.cuda.Stream()
    batch = wds.to_device((torch.arange(10), PackedBytes.pack([b"ab", b"c"]), "x"), "cuda", stream)
    assert batch[0].device.type == "cuda" and batch[1].data.is_pinned() and batch[2] == "x"
    assert batch[0].sum().item() == 45
