"""Feeding a GPU: decode a batch's JPEGs on the device, and copy batches there without stalling the step.

- :func:`gpu_decode` returns a batch transform for the main process (``loader.map(...)``): the encoded
  images of one field of the batch (a list of bytes, or a :class:`~wds_cloud.transport.PackedBytes`
  from ``WebLoader``, which packs big byte batches by default) become one ``NCHW`` tensor on the
  device, decoded by nvJPEG through torchvision's batched ``decode_jpeg`` on a side stream (so that it
  overlaps the training step already queued), optionally resized (shorter side), center-cropped and
  normalized there.  Images nvJPEG refuses (PNG, CMYK JPEGs) are decoded on the CPU, one by one, and
  moved over; one that nothing can read is a ``DecodingError``.  It never runs in a DataLoader worker
  (CUDA must not be initialized there).
- :func:`to_device` (``WebLoader(device=...)``) copies every tensor of a batch to the device from
  pinned memory with ``non_blocking=True`` on a side stream, and makes the consuming stream wait
  for that copy only: the copy of batch N+1 runs while the GPU still works on step N.

Both need torch; GPU decoding needs torchvision (``pip install 'wds_cloud[gpu]' (in a clone: pip install -e '.[gpu]')``).  Without CUDA,
``device="cuda"`` is an error that says so; ``device="cpu"`` decodes on the CPU (torchvision, else
Pillow) with the same output, as an explicit fallback.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

from ..errors import ConfigError, DecodingError, MalformedDataError, MissingExtraError
from ..resume.views import MAX_DEPTH
from .transport import PackedBytes

__all__ = ["gpu_decode", "GPUDecode", "to_device"]

_JPEG = b"\xff\xd8\xff"


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MissingExtraError(
            "decoding on a device needs torch: pip install 'wds_cloud[gpu]' (in a clone: pip install -e '.[gpu]')"
        ) from None
    return torch


def _torchvision_io() -> Any:
    try:
        import torchvision.io
    except Exception as exc:  # ImportError, or a torchvision built for another torch (operator ... does not exist)
        raise MissingExtraError(
            f"decoding JPEGs on the GPU needs torchvision matching torch ({exc}): "
            "pip install 'wds_cloud[gpu]' (in a clone: pip install -e '.[gpu]'); or pass device='cpu' to decode with Pillow"
        ) from None
    return torchvision.io


def _check_device(device: Any) -> Any:
    torch = _torch()
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {str(device)!r} asked for, but CUDA is not available to this torch "
            f"({torch.__version__}); install a CUDA build of torch on a machine with a GPU, or pass "
            "device='cpu' to decode on the CPU"
        )
    return device


def _in_worker() -> bool:
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


class GPUDecode:
    """The batch transform :func:`gpu_decode` returns (see there)."""

    def __init__(
        self,
        field: Union[int, str] = 0,
        device: Any = "cuda",
        size: Optional[int] = None,
        crop: Optional[Union[int, tuple]] = None,
        mean: Optional[Sequence[float]] = None,
        std: Optional[Sequence[float]] = None,
        dtype: Any = None,
    ) -> None:
        self.field = field
        self.device = device
        self.size = size
        self.crop = (crop, crop) if isinstance(crop, int) else crop
        self.mean, self.std = mean, std
        self.dtype = dtype
        if (mean is None) != (std is None):
            raise ConfigError("gpu_decode: give mean and std together (per channel), or neither")
        self._streams: dict = {}  # device -> the side stream decoding runs on
        self._moments: dict = {}  # (device, dtype) -> mean and std as tensors there

    def __call__(self, batch: Any) -> Any:
        if _in_worker():
            raise ConfigError(
                "gpu_decode runs in the main process, on the loader's batches "
                "(loader.map(wds.gpu_decode(...))), never in a DataLoader worker: CUDA must not be "
                "initialized there"
            )
        images = self.decode(batch[self.field])
        if isinstance(batch, dict):
            return {**batch, self.field: images}
        out = list(batch)
        out[self.field] = images  # type: ignore[index]
        return tuple(out) if isinstance(batch, tuple) else out

    def decode(self, items: Sequence) -> Any:
        """``items`` (encoded images) as one NCHW tensor on the device (a list where sizes differ and no crop).

        On a GPU the work runs on a side stream of this decoder's, which the current stream then waits
        for: nothing waits for the training step already queued, so decoding batch N+1 overlaps step N.
        """
        torch = _torch()
        device = _check_device(self.device)
        if isinstance(items, PackedBytes):  # views of one (pinned) buffer
            tensors = items.tensors()
        else:
            tensors = [
                torch.frombuffer(bytearray(item), dtype=torch.uint8) if len(item) else torch.empty(0, dtype=torch.uint8)
                for item in items
            ]
        if device.type != "cuda":
            return self._finish([self._cpu(t, i) for i, t in enumerate(tensors)], torch, device)
        current = torch.cuda.current_stream(device)
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            out = self._finish(self._on_gpu(tensors, device), torch, device)
        current.wait_stream(side)
        for tensor in out if isinstance(out, list) else [out]:
            tensor.record_stream(current)  # its memory is not reused before the current stream is done with it
        return out

    def _on_gpu(self, tensors: list, device: Any) -> list:
        """Every image decoded onto ``device``: the JPEGs by nvJPEG in one batched call, what it refuses
        (PNG, CMYK, damaged) on the CPU one by one."""
        io = _torchvision_io()
        decoded: list = [None] * len(tensors)
        jpegs = [i for i, t in enumerate(tensors) if len(t) > 3 and bytes(t[:3].tolist()) == _JPEG]
        if jpegs:
            try:
                with _quiet():
                    out = io.decode_jpeg([tensors[i] for i in jpegs], mode=io.ImageReadMode.RGB, device=device)
                for i, image in zip(jpegs, out):
                    decoded[i] = image
            except RuntimeError:  # one image nvJPEG refuses fails the whole call: then one by one
                for i in jpegs:
                    try:
                        with _quiet():
                            decoded[i] = io.decode_jpeg(tensors[i], mode=io.ImageReadMode.RGB, device=device)
                    except RuntimeError:
                        pass
        for i, tensor in enumerate(tensors):
            if decoded[i] is None:
                decoded[i] = self._cpu(tensor, i).to(device, non_blocking=True)
        return decoded

    def _cpu(self, tensor: Any, index: int) -> Any:
        """Image ``index`` decoded on the CPU as a uint8 CHW RGB tensor (torchvision, else Pillow)."""
        torch = _torch()
        try:
            io = _torchvision_io()
        except MissingExtraError:
            io = None
        try:
            if io is not None:
                with _quiet():
                    return io.decode_image(tensor, mode=io.ImageReadMode.RGB)
            import numpy as np

            from ..autodecode import imagehandler

            array = imagehandler("rgb8").decode_any(tensor.numpy().tobytes())
            return torch.from_numpy(np.array(array)).permute(2, 0, 1)  # a writable copy: Pillow's is read-only
        except Exception as exc:
            head = bytes(tensor[:8].tolist())
            raise DecodingError(
                f"gpu_decode: image {index} of the batch ({len(tensor)} bytes, starting {head!r}) is not an image "
                f"that nvJPEG or the CPU decoders can read ({exc}); leave damaged images out before batching, "
                "e.g. check them in the workers with .map(...) under handler=wds.warn_and_continue"
            ) from exc

    def _finish(self, images: list, torch: Any, device: Any) -> Any:
        """Resize, crop, convert and normalize: the whole batch at once where the images are one size."""
        dtype = self.dtype or (torch.float32 if self.mean is not None else torch.uint8)
        if not images:
            return torch.empty((0, 3) + (self.crop or (0, 0)), dtype=dtype, device=device)
        if len({tuple(i.shape) for i in images}) == 1:
            out = self._resize_crop(torch.stack(images), torch, dtype)
        else:
            each = [self._resize_crop(image[None], torch, dtype)[0] for image in images]
            if len({tuple(i.shape) for i in each}) > 1:
                return [self._convert(i[None], torch, dtype)[0] for i in each]  # sizes differ: a list
            out = torch.stack(each)
        return self._convert(out, torch, dtype)

    def _resize_crop(self, batch: Any, torch: Any, dtype: Any) -> Any:
        """``batch`` (N x C x H x W) resized (shorter side to ``size``) and center-cropped."""
        import torch.nn.functional as F

        if self.size is not None:
            h, w = batch.shape[-2:]
            scale = self.size / min(h, w)
            new = (max(1, round(h * scale)), max(1, round(w * scale)))
            if new != (h, w):
                batch = F.interpolate(
                    batch.float(), size=new, mode="bilinear", antialias=True, align_corners=False
                ).clamp_(0, 255)
                if dtype == torch.uint8:
                    batch = batch.round_().to(torch.uint8)
        if self.crop is not None:
            ch, cw = self.crop
            h, w = batch.shape[-2:]
            if h < ch or w < cw:
                raise ConfigError(
                    f"gpu_decode: an image of {h}x{w} is smaller than crop={self.crop}; give size= at least the crop"
                )
            top, left = (h - ch) // 2, (w - cw) // 2
            batch = batch[:, :, top : top + ch, left : left + cw]
        return batch

    def _convert(self, batch: Any, torch: Any, dtype: Any) -> Any:
        """``batch`` in ``dtype``: uint8 as it is; floating point in [0, 1], normalized with mean/std."""
        if dtype == torch.uint8:
            return batch.to(torch.uint8)
        batch = batch.to(dtype) / 255.0
        if self.mean is not None:
            key = (batch.device, dtype)
            if key not in self._moments:
                self._moments[key] = tuple(
                    torch.tensor(v, dtype=dtype).view(1, -1, 1, 1).to(batch.device) for v in (self.mean, self.std)
                )
            mean, std = self._moments[key]
            batch = (batch - mean) / std
        return batch


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torchvision 0.29 deprecated its image decoders (for TorchCodec) and warns on every call: the user
    asked us to decode, so the warning is ours to keep, not theirs to read once per batch."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torchvision\.")
        warnings.filterwarnings("ignore", message=".*(TorchCodec|torchcodec).*")
        yield


def gpu_decode(
    field: Union[int, str] = 0,
    device: Any = "cuda",
    size: Optional[int] = None,
    crop: Optional[Union[int, tuple]] = None,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    dtype: Any = None,
) -> GPUDecode:
    """A transform of the loader's batches: the encoded images in ``batch[field]`` decoded on ``device``.

    ``size``: resize so the shorter side is ``size`` (bilinear, antialiased); ``crop``: center crop (an
    int or ``(h, w)``); ``mean``/``std``: normalize per channel (the result is then float32, in units of
    [0, 1] before normalizing); ``dtype``: the output type (default uint8, float32 with mean/std).
    The result is one ``NCHW`` tensor on the device, or a list of ``CHW`` tensors when the images differ
    in size and no crop made them equal.  ``device="cpu"`` is the explicit CPU fallback.

        loader = wds.WebLoader(ds.to_tuple("jpg", "cls").batched(256), batch_size=None, num_workers=8)
        loader = loader.map(wds.gpu_decode(0, size=256, crop=224))
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
    # the stream that will use the batch: tensors made on the side stream are recorded as used by it, so
    # that the caching allocator does not hand their memory to the next copy while a step still reads them
    consumer = torch.cuda.current_stream(device) if cuda and stream is not None else None

    def move(value: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:  # a batch holding itself, or nested past what any sample needs: never a crash
            raise MalformedDataError(
                f"to_device: the batch nests tuples, lists or dicts more than {MAX_DEPTH} deep (or holds itself): "
                "make the sample flatter (or encode its deep part, e.g. as JSON bytes)",
                field="batch",
            )
        if isinstance(value, torch.Tensor):
            if cuda and value.device.type == "cpu" and not value.is_pinned():
                value = value.pin_memory()
            moved = value.to(device, non_blocking=cuda)
            if consumer is not None and moved is not value:
                moved.record_stream(consumer)
            return moved
        if isinstance(value, PackedBytes):
            # encoded bytes stay on the host, pinned: the GPU decoder reads them from there in one copy
            return value.pin_memory() if cuda and not value.data.is_pinned() else value
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(move(v, depth + 1) for v in value)
        if isinstance(value, list):
            return [move(v, depth + 1) for v in value]
        if isinstance(value, dict):
            return {k: move(v, depth + 1) for k, v in value.items()}
        return value

    if consumer is not None:
        with torch.cuda.stream(stream):
            moved = move(batch)
        consumer.wait_stream(stream)
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
