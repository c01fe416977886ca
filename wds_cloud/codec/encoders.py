"""Encoding sample fields to bytes by their extension, for the writers.

``cls txt json npy npz pyd pth ten mp cbor jpg png ppm tiff`` (and aliases) are
known; a ``.gz`` suffix gzips the encoding of the inner extension.  Text (``str``)
is always written as its UTF-8 bytes and bytes-likes as they are, whatever the
extension, as webdataset does; only other values use the extension's encoder.  Writing pickle (``pyd``) is safe: only reading it
is refused by default.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import tenbin
from ..errors import ConfigError, MissingExtraError
from .extensions import WRITTEN_IMAGES, WRITTEN_KINDS

__all__ = [
    "imageencoder",
    "bytestr",
    "numpy_dumps",
    "numpy_npz_dumps",
    "torch_dumps",
    "tenbin_dumps",
    "cbor_dumps",
    "mp_dumps",
    "default_handlers",
    "make_handlers",
    "encode_based_on_extension1",
    "encode_based_on_extension",
    "make_encoder",
]


def bytestr(data: Any) -> bytes:
    """Bytes as they are; text as UTF-8; anything else through ``str``."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, str):
        return data.encode("utf-8")
    return str(data).encode("utf-8")


def imageencoder(image: Any, format: str = "PNG") -> bytes:
    """Encode a numpy array (HWC or HW; uint8, or floats in [0, 1]), a CHW tensor, or a PIL image."""
    try:
        import PIL.Image
    except ImportError:
        raise MissingExtraError(
            "encoding images needs Pillow: pip install 'wds_cloud[image]' (in a clone: pip install -e '.[image]')"
        ) from None
    if not isinstance(image, PIL.Image.Image):
        if hasattr(image, "detach"):  # a torch tensor: CHW -> HWC
            image = image.detach().cpu().numpy()
            if image.ndim == 3:
                image = image.transpose(1, 2, 0)
        image = np.asarray(image)
        if image.ndim == 3 and image.shape[2] == 1:
            image = image[:, :, 0]
        if image.dtype in (np.float16, np.float32, np.float64):
            image = _float_pixels(image)
        elif image.dtype != np.uint8:
            raise ValueError(f"images are encoded from uint8 or float arrays, not {image.dtype}")
        image = PIL.Image.fromarray(image)
    format = format.upper()
    if format == "JPG":
        format = "JPEG"
    elif format in ("PGM", "PBM", "PNM"):
        format = "PPM"
    elif format == "TIF":
        format = "TIFF"
    out = io.BytesIO()
    options = {"quality": 95} if format == "JPEG" else {}
    if format == "JPEG" and image.mode not in ("RGB", "L", "CMYK"):
        if image.mode not in _JPEG_SAFE or "transparency" in image.info:
            # JPEG has no alpha and 8 bits a channel: converting would drop the alpha or the depth unseen
            raise ValueError(
                f"a {image.mode} image cannot be written as {format} without losing data (its alpha channel "
                "or bit depth): write it as .png or .tiff, or convert it yourself (image.convert('RGB'))"
            )
        image = image.convert("RGB")
    image.save(out, format=format, **options)
    return out.getvalue()


#: modes JPEG cannot hold that convert to RGB without loss (1-bit, and palette images with no transparency)
_JPEG_SAFE = ("1", "P")


def _float_pixels(image: np.ndarray) -> np.ndarray:
    """Float pixels in [0, 1] as uint8.  Values outside it (webdataset allows 0.001 of rounding slack) or NaN
    are refused, as webdataset refuses them, rather than clipped into a different image."""
    if image.size:
        low, high = float(np.min(image)), float(np.max(image))
        if not (low > -0.001 and high < 1.001):  # NaN fails both
            raise ValueError(
                f"float image values must lie in [0, 1], but they span [{low}, {high}]"
                f"{' (NaN or inf among them)' if not np.isfinite(image).all() else ''}: scale them, or pass uint8"
            )
    return np.clip(image * 255.0 + 0.5, 0, 255).astype(np.uint8)


def numpy_dumps(data: np.ndarray) -> bytes:
    """An array as a ``.npy`` file."""
    out = io.BytesIO()
    np.save(out, np.asarray(data), allow_pickle=False)
    return out.getvalue()


def numpy_npz_dumps(data: Any) -> bytes:
    """A dict of arrays (or one array) as a ``.npz`` file."""
    out = io.BytesIO()
    if isinstance(data, dict):
        arrays: dict[str, Any] = {k: np.asarray(v) for k, v in data.items()}
        np.savez(out, **arrays)
    else:
        np.savez(out, np.asarray(data))
    return out.getvalue()


def torch_dumps(data: Any) -> bytes:
    """``torch.save`` into bytes."""
    try:
        import torch
    except ImportError:
        raise MissingExtraError(
            "encoding .pth needs torch: pip install 'wds_cloud[torch]' (in a clone: pip install -e '.[torch]')"
        ) from None
    out = io.BytesIO()
    torch.save(data, out)
    return out.getvalue()


def tenbin_dumps(data: Any) -> bytes:
    """One array or a list of arrays as a tenbin buffer."""
    arrays = list(data) if isinstance(data, (list, tuple)) else [data]
    return bytes(tenbin.encode_buffer([np.asarray(a) for a in arrays]))


def cbor_dumps(data: Any) -> bytes:
    try:
        import cbor2
    except ImportError:
        raise MissingExtraError("encoding .cbor needs cbor2: pip install cbor2") from None
    return cbor2.dumps(data)


def mp_dumps(data: Any) -> bytes:
    try:
        import msgpack
    except ImportError:
        raise MissingExtraError("encoding .mp/.msgpack needs msgpack: pip install msgpack") from None
    return msgpack.packb(data, use_bin_type=True)


def _image(fmt: str) -> Callable[[Any], bytes]:
    def encode(data: Any) -> bytes:
        return imageencoder(data, fmt)

    return encode


def make_handlers() -> dict[str, Callable[[Any], bytes]]:
    """A fresh copy of the default extension -> encoder table."""
    by_kind: dict[str, Callable[[Any], bytes]] = {
        "int": _int_dumps,
        "text": bytestr,
        "json": _json_dumps,
        "pickle": pickle.dumps,
        "torch": torch_dumps,
        "tenbin": tenbin_dumps,
        "msgpack": mp_dumps,
        "cbor": cbor_dumps,
        "npy": numpy_dumps,
        "npz": numpy_npz_dumps,
    }
    handlers = {ext: by_kind[kind] for table in WRITTEN_KINDS for kind, exts in table.items() for ext in exts}
    handlers.update((ext, _image(fmt)) for table in WRITTEN_IMAGES for ext, fmt in table.items())
    return handlers


def _int_dumps(x: Any) -> bytes:
    # webdataset writes str(x) under cls, index, ...: 3.5 stays b"3.5" (and True b"True"); int(x) would turn
    # 3.5 into b"3" and -0.9 into b"0", losing data without a word
    return bytestr(x)


def _json_dumps(x: Any) -> bytes:
    return json.dumps(x).encode("utf-8")


default_handlers = make_handlers()


def encode_based_on_extension1(data: Any, tname: str, handlers: dict) -> bytes:
    """Encode one value for the field ``tname``: text as UTF-8 and bytes as given, whatever the extension.

    Only other values go through the extension's handler (``x.gz`` gzips what ``x`` would hold).  This is
    webdataset's rule, which trainers rely on: img2dataset writes ``sample["json"] = json.dumps(meta)``,
    and encoding that text as JSON again would make readers get a string back instead of the dict.
    """
    if tname.startswith("__"):
        return bytestr(data)
    gz = tname.endswith(".gz")
    inner = tname[:-3] if gz else tname
    if isinstance(data, (bytes, bytearray, memoryview)):
        encoded = bytes(data)
    elif isinstance(data, str):
        encoded = _utf8(data, tname)
    else:
        extension = inner[inner.rfind(".") + 1 :].lower()
        handler = handlers.get(extension)
        if handler is None:
            raise ValueError(
                f"no encoder for the field {tname!r} ({type(data).__name__}): give str or bytes, "
                "use a known extension, or pass encoder= with a handler for it"
            )
        encoded = handler(data)
    # mtime 0 (upstream: the time of writing) keeps shards byte-reproducible
    return gzip.compress(encoded, mtime=0) if gz else encoded


def _utf8(text: str, tname: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"field {tname!r} holds text that cannot be written as UTF-8 ({exc.reason} at index {exc.start}: "
            f"{text[exc.start : exc.end]!r}); pass bytes, or text without lone surrogates"
        ) from None


def encode_based_on_extension(sample: dict, handlers: dict) -> dict:
    """Encode every field of ``sample``."""
    return {k: encode_based_on_extension1(v, k, handlers) if k != "__key__" else v for k, v in sample.items()}


def make_encoder(spec: Any) -> Callable[[dict], dict]:
    """The encoder for ``spec``: False (bytes only), True (defaults), a dict of handlers, or a callable."""
    if spec is False or spec is None:
        return _bytes_only
    if callable(spec):
        return spec
    if isinstance(spec, dict):
        handlers = spec
    elif spec is True:
        handlers = default_handlers
    else:
        raise ConfigError(f"encoder must be True, False, a dict of handlers or a callable, not {spec!r}")
    return lambda sample: encode_based_on_extension(sample, handlers)


def _bytes_only(sample: dict) -> dict:
    for k, v in sample.items():
        if k != "__key__" and not k.startswith("__") and not isinstance(v, (bytes, bytearray, memoryview)):
            raise ValueError(
                f"encoder=False writes bytes only, but field {k!r} of sample {sample.get('__key__')!r} "
                f"is {type(v).__name__}: encode it first or use encoder=True"
            )
    return sample
