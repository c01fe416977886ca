"""Feeding a GPU: decode a batch's JPEGs on the device, and copy batches there without stalling the step.

- :func:`gpu_decode` returns a batch transform for the main process (``loader.map(...)``): the encoded
  images of one field of the batch (a list of bytes, or a :class:`~wds_cloud.transport.PackedBytes`
  from ``WebLoader(pack_bytes=True)``) become one ``NCHW`` tensor on the device, decoded by nvJPEG
  through torchvision's batched ``decode_jpeg``, optionally resized (shorter side), center-cropped
  and normalized there.  Images nvJPEG refuses (PNG, CMYK JPEGs, damaged ones) are decoded on the
  CPU, one by one, and moved over.  It never runs in a DataLoader worker (CUDA must not be
  initialized there).
- :func:`to_device` (``WebLoader(device=...)``) copies every tensor of a batch to the device from
  pinned memory with ``non_blocking=True`` on a side stream, and makes the consuming stream wait
  for that copy only: the copy of batch N+1 runs while the GPU still works on step N.

Both need torch; GPU decoding needs torchvision (``pip install 'wds_cloud[gpu]'``).  Without CUDA,
``device="cuda"`` is an error that says so; ``device="cpu"`` decodes on the CPU (torchvision, else
Pillow) with the same output, as an explicit fallback.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from .errors import ConfigError, MissingExtraError

__all__ = ["gpu_decode", "GPUDecode", "to_device"]

_JPEG = b"\xff\xd8\xff"


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MissingExtraError("decoding on a device needs torch: pip install 'wds_cloud[gpu]'") from None
    return torch


def _torchvision_io() -> Any:
    try:
        import torchvision.io
    except Exception as exc:  # ImportError, or a torchvision built for another torch (operator ... does not exist)
        raise MissingExtraError(f"decoding JPEGs on the GPU needs torchvision matching torch ({exc}): "
                                "pip install 'wds_cloud[gpu]'; or pass device='cpu' to decode with Pillow") from None
    return torchvision.io


def _check_device(device: Any) -> Any:
    torch = _torch()
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(device)!r} asked for, but CUDA is not available to this torch "
                          f"({torch.__version__}); install a CUDA build of torch on a machine with a GPU, or pass "
                          "device='cpu' to decode on the CPU")
    return device


def _in_worker() -> bool:
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


class GPUDecode:
    """The batch transform :func:`gpu_decode` returns (see there)."""

    def __init__(self, field: Union[int, str] = 0, device: Any = "cuda", size: Optional[int] = None,
                 crop: Optional[Union[int, tuple]] = None, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None, dtype: Any = None) -> None:
        self.field = field
        self.device = device
        self.size = size
        self.crop = (crop, crop) if isinstance(crop, int) else crop
        self.mean, self.std = mean, std
        self.dtype = dtype
        if (mean is None) != (std is None):
            raise ConfigError("gpu_decode: give mean and std together (per channel), or neither")

    def __call__(self, batch: Any) -> Any:
        if _in_worker():
            raise ConfigError("gpu_decode runs in the main process, on the loader's batches "
                              "(loader.map(wds.gpu_decode(...))), never in a DataLoader worker: CUDA must not be "
                              "initialized there")
        images = self.decode(batch[self.field])
        if isinstance(batch, dict):
            return {**batch, self.field: images}
        out = list(batch)
        out[self.field] = images  # type: ignore[index]
        return tuple(out) if isinstance(batch, tuple) else out

    def decode(self, items: Sequence) -> Any:
        """``items`` (encoded images) as one NCHW tensor on the device (a list where sizes differ and no crop)."""
        torch = _torch()
        device = _check_device(self.device)
        tensors = ([items.tensor(i) for i in range(len(items))] if hasattr(items, "tensor")
                   else [torch.frombuffer(bytearray(item), dtype=torch.uint8) for item in items])
        decoded: list = [None] * len(tensors)
        if device.type == "cuda":
            io = _torchvision_io()
            jpegs = [i for i, t in enumerate(tensors) if bytes(t[:3].tolist()) == _JPEG]
            if jpegs:
                try:
                    out = io.decode_jpeg([tensors[i] for i in jpegs], mode=io.ImageReadMode.RGB, device=device)
                    for i, image in zip(jpegs, out):
                        decoded[i] = image
                except RuntimeError:  # one image nvJPEG refuses fails the batch: those go one by one below
                    pass
        for i, tensor in enumerate(tensors):
            if decoded[i] is None:
                decoded[i] = self._cpu(tensor).to(device, non_blocking=True)
        return self._finish(decoded, torch)

    def _cpu(self, tensor: Any) -> Any:
        """One image decoded on the CPU as a uint8 CHW RGB tensor (torchvision, else Pillow)."""
        torch = _torch()
        try:
            io = _torchvision_io()
        except MissingExtraError:
            io = None
        if io is not None:
            return io.decode_image(tensor, mode=io.ImageReadMode.RGB)
        import numpy as np

        from .autodecode import imagehandler

        array = imagehandler("rgb8").decode_any(tensor.numpy().tobytes())
        return torch.from_numpy(np.array(array)).permute(2, 0, 1)  # a writable copy: Pillow's is read-only

    def _finish(self, images: list, torch: Any) -> Any:
        import torch.nn.functional as F

        out = []
        for image in images:
            if self.size is not None:
                h, w = image.shape[-2:]
                scale = self.size / min(h, w)
                new = (max(1, round(h * scale)), max(1, round(w * scale)))
                image = F.interpolate(image[None].float(), size=new, mode="bilinear", antialias=True,
                                      align_corners=False)[0].round().clamp(0, 255).to(torch.uint8)
            if self.crop is not None:
                ch, cw = self.crop
                h, w = image.shape[-2:]
                if h < ch or w < cw:
                    raise ConfigError(f"gpu_decode: an image of {h}x{w} is smaller than crop={self.crop}; "
                                      "give size= at least the crop")
                top, left = (h - ch) // 2, (w - cw) // 2
                image = image[:, top:top + ch, left:left + cw]
            out.append(image)
        if len({tuple(i.shape) for i in out}) > 1:
            return out  # sizes differ and nothing made them equal: a list, as the images are
        batch = torch.stack(out) if out else torch.empty((0, 3, 0, 0), dtype=torch.uint8)
        dtype = self.dtype or (torch.float32 if self.mean is not None else torch.uint8)
        if dtype != torch.uint8:
            batch = batch.to(dtype) / 255.0
            if self.mean is not None:
                mean = torch.tensor(self.mean, dtype=dtype, device=batch.device).view(1, -1, 1, 1)
                std = torch.tensor(self.std, dtype=dtype, device=batch.device).view(1, -1, 1, 1)
                batch = (batch - mean) / std
        return batch


def gpu_decode(field: Union[int, str] = 0, device: Any = "cuda", size: Optional[int] = None,
               crop: Optional[Union[int, tuple]] = None, mean: Optional[Sequence[float]] = None,
               std: Optional[Sequence[float]] = None, dtype: Any = None) -> GPUDecode:
    """A transform of the loader's batches: the encoded images in ``batch[field]`` decoded on ``device``.

    ``size``: resize so the shorter side is ``size`` (bilinear, antialiased); ``crop``: center crop (an
    int or ``(h, w)``); ``mean``/``std``: normalize per channel (the result is then float32, in units of
    [0, 1] before normalizing); ``dtype``: the output type (default uint8, float32 with mean/std).
    The result is one ``NCHW`` tensor on the device, or a list of ``CHW`` tensors when the images differ
    in size and no crop made them equal.  ``device="cpu"`` is the explicit CPU fallback.

        loader = wds.WebLoader(ds.to_tuple("jpg", "cls").batched(256), batch_size=None, num_workers=8,
                               pack_bytes=True).map(wds.gpu_decode("jpg" if dicts else 0, size=256, crop=224))
    """
    return GPUDecode(field, device, size, crop, mean, std, dtype)


def to_device(batch: Any, device: Any, stream: Any = None) -> Any:
    """Every tensor of ``batch`` (in tuples, lists, dicts) copied to ``device``; encoded bytes
    (:class:`~wds_cloud.transport.PackedBytes`) stay on the host, pinned, for :func:`gpu_decode`.

    To a GPU: from pinned memory (pinned here if the loader did not), ``non_blocking=True``, on
    ``stream`` (a side stream) when given; the current stream then waits for that stream, so the
    copy overlaps the GPU's work on the previous batch and the batch is ready when used.
    """
    torch = _torch()
    device = _check_device(device)
    cuda = device.type == "cuda"

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if cuda and value.device.type == "cpu" and not value.is_pinned():
                value = value.pin_memory()
            return value.to(device, non_blocking=cuda)
        if hasattr(value, "offsets") and hasattr(value, "data") and hasattr(value, "tensor"):  # PackedBytes
            # encoded bytes stay on the host, pinned: the GPU decoder reads them from there in one copy
            return value.pin_memory() if cuda and not value.data.is_pinned() else value
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(move(v) for v in value)
        if isinstance(value, list):
            return [move(v) for v in value]
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        return value

    if cuda and stream is not None:
        with torch.cuda.stream(stream):
            moved = move(batch)
        torch.cuda.current_stream(device).wait_stream(stream)
        return moved
    return move(batch)


class ToDevice:
    """The WebLoader stage of ``device=``: each batch to the device on a side stream (see :func:`to_device`)."""

    # It holds nothing across batches (no prefetch), so a state taken after it is the loader's.

    def __init__(self, device: Any) -> None:
        self.device = device

    def __call__(self, src: Any) -> Any:
        torch = _torch()
        device = _check_device(self.device)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        for batch in src:
            yield to_device(batch, device, stream)
