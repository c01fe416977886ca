"""Decoding sample fields by their extension: text, numbers, JSON, arrays, images, tensors.

A handler is ``f(key, data)`` returning the decoded value, ``None`` to pass
(the next handler is tried), or :class:`Continue` to hand a changed key/data
to the next handlers (``gzfilter`` un-gzips ``x.json.gz`` into ``x.json``).

Safe by default: pickle (``.pyd``, ``.pkl``, ``.pickle``) and ``torch.load``
without ``weights_only`` are refused unless the user opts in with
``decode(..., allow_pickle=True)`` or ``WDS_ALLOW_PICKLE=1``; ``WDS_SECURE=1``
(or ``utils.enforce_security``) refuses them even then.
"""

from __future__ import annotations

import contextvars
import io
import json
import os
import pickle
import re
import tempfile
import zlib
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from . import config, tenbin
from .codec.extensions import IMAGE_EXTENSIONS, IMAGE_FORMATS, KINDS
from .errors import ConfigError, DecodingError, MissingExtraError, SecurityError, redact
from .io.security import is_secure

__all__ = [
    "call_extension_handler",
    "Continue",
    "Decoder",
    "DecodingError",
    "ImageHandler",
    "imagehandler",
    "imagespecs",
    "IMAGE_EXTENSIONS",
    "handle_extension",
    "basichandlers",
    "decoders",
    "default_decoder",
    "default_pre_handlers",
    "default_post_handlers",
    "gzfilter",
    "unpickle_loads",
    "tenbin_loads",
    "msgpack_loads",
    "npy_loads",
    "npz_loads",
    "cbor_loads",
    "torch_loads",
    "pytorch_weights_only",
    "torch_video",
    "torch_audio",
    "json_loads",
]

_pickle_allowed: contextvars.ContextVar[bool] = contextvars.ContextVar("wds_cloud_pickle_allowed", default=False)


def _pickle_permitted() -> bool:
    if is_secure():
        return False
    return _pickle_allowed.get() or config.current().allow_pickle


_PICKLE_HOW = (
    "pass decode(..., allow_pickle=True) or set WDS_ALLOW_PICKLE=1, and only for data you trust: "
    "unpickling runs code from the file"
)


def _refuse(what: str) -> SecurityError:
    if is_secure():
        # webdataset's own sentence leads, so code that matches it keeps working
        return SecurityError(
            "Unpickling is not allowed for security reasons when enforce_security is set: "
            f"refusing to decode {what}, as WDS_SECURE=1 (or utils.enforce_security) forbids it"
        )
    return SecurityError(f"refusing to decode {what} by default; {_PICKLE_HOW}")


class Continue:
    """Returned by a handler to pass a new key and data on to the following handlers."""

    def __init__(self, key: str, data: Any) -> None:
        self.key = key
        self.data = data


def handle_extension(extensions: str, f: Callable[[Any], Any]) -> Callable:
    """A handler applying ``f(data)`` to fields whose extension is one of ``extensions`` (space separated).

    Extensions may have several parts: ``"seg.png"`` matches ``x.seg.png`` only.
    """
    return ExtensionHandler(extensions, f)


class ExtensionHandler:
    """What :func:`handle_extension` returns: a module-level class, not a closure, so that a dataset decoding
    with it pickles (spawn and forkserver DataLoader workers receive it so; webdataset's closure does not)."""

    def __init__(self, extensions: str, f: Callable[[Any], Any]) -> None:
        self.targets = [e.split(".") for e in extensions.lower().split()]
        self.f = f
        #: the last part of each extension: read by the decoder's planning (which handlers a field can reach)
        self.extensions = {t[-1] for t in self.targets}

    def __call__(self, key: str, data: Any) -> Any:
        parts = key.lower().split(".")
        for target in self.targets:
            if len(target) <= len(parts) and parts[-len(target) :] == target:
                return self.f(data)
        return None

    def __repr__(self) -> str:
        return f"handle_extension({' '.join('.'.join(t) for t in self.targets)!r}, {self.f!r})"


def call_extension_handler(key: str, data: Any, f: Callable[[Any], Any], extensions: list) -> Any:
    """``f(data)`` if ``key`` ends in one of ``extensions`` (each of one or more dotted parts, matched without
    case), else ``None``: webdataset's helper behind :func:`handle_extension`."""
    return handle_extension(" ".join(extensions), f)(key, data)


def json_loads(data: Any) -> Any:
    return json.loads(data)


def _text(data: Any) -> str:
    return bytes(data).decode("utf-8") if not isinstance(data, bytes) else data.decode("utf-8")


def _int(data: Any) -> int:
    return int(bytes(data))


def npy_loads(data: Any) -> np.ndarray:
    """A ``.npy`` array (pickled object arrays are refused)."""
    return np.load(io.BytesIO(data), allow_pickle=False)


def npz_loads(data: Any) -> dict:
    """The arrays of a ``.npz`` file as a dict."""
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return dict(archive)


def tenbin_loads(data: Any) -> Any:
    """A tenbin buffer: the list of its arrays (a list of one for a single array), as webdataset gives."""
    return list(tenbin.decode_buffer(data))


def msgpack_loads(data: Any) -> Any:
    try:
        import msgpack
    except ImportError:
        raise MissingExtraError("decoding .mp/.msgpack needs msgpack: pip install msgpack") from None
    return msgpack.unpackb(data, raw=False)


def cbor_loads(data: Any) -> Any:
    try:
        import cbor2
    except ImportError:
        raise MissingExtraError("decoding .cbor needs cbor2: pip install cbor2") from None
    return cbor2.loads(data)


def unpickle_loads(data: Any) -> Any:
    """Unpickle a field: refused unless pickle is allowed (see the module docstring)."""
    if not _pickle_permitted():
        raise _refuse("a pickle (.pyd/.pkl/.pickle)")

    return pickle.loads(data)


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MissingExtraError(
            "this decoder needs torch: pip install 'wds_cloud[torch]' (in a clone: pip install -e '.[torch]')"
        ) from None
    return torch


#: webdataset's flag: True makes ``torch_loads`` use ``weights_only=True`` even when pickle is allowed.
#: (Without it, wds_cloud already loads with ``weights_only=True`` unless pickle is allowed.)
pytorch_weights_only = False


def torch_loads(data: Any) -> Any:
    """A ``.pth`` field, loaded onto the CPU: ``weights_only`` loading, or a full ``torch.load`` when
    pickle is allowed (and ``pytorch_weights_only`` is not set).  Always refused under ``WDS_SECURE``."""
    if is_secure():
        raise _refuse("a .pth file (torch.loads is not allowed for security reasons when enforce_security is set)")
    torch = _torch()
    stream = io.BytesIO(data) if not hasattr(data, "read") else data
    if _pickle_permitted() and not pytorch_weights_only:
        return torch.load(stream, map_location="cpu", weights_only=False)
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            raise _refuse("a .pth file that needs full torch.load (it holds objects, not only tensors)") from exc
        raise


def _via_tempfile(data: Any, extension: str, load: Callable[[str], Any]) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"file.{extension}")
        with open(path, "wb") as f:
            f.write(data)
        return load(path)


def torch_video(key: str, data: Any) -> Any:
    """Decode video fields (mp4, ogv, mjpeg, avi, mov, h264, mpg, webm, wmv) with torchvision."""
    extension = re.sub(r".*[.]", "", key).lower()
    if extension not in "mp4 ogv mjpeg avi mov h264 mpg webm wmv".split():
        return None
    try:
        import torchvision.io
    except ImportError:
        raise MissingExtraError("decoding video needs torchvision: pip install torchvision") from None
    return _via_tempfile(data, extension, lambda p: torchvision.io.read_video(p, pts_unit="sec"))


def torch_audio(key: str, data: Any) -> Any:
    """Decode audio fields (flac, mp3, sox, wav, m4a, ogg, wma) with torchaudio."""
    extension = re.sub(r".*[.]", "", key).lower()
    if extension not in "flac mp3 sox wav m4a ogg wma".split():
        return None
    try:
        import torchaudio
    except ImportError:
        raise MissingExtraError("decoding audio needs torchaudio: pip install torchaudio") from None
    return _via_tempfile(data, extension, torchaudio.load)


_DECODERS_BY_KIND: dict[str, Callable[[Any], Any]] = {
    "text": _text,
    "int": _int,
    "json": json_loads,
    "pickle": unpickle_loads,
    "torch": torch_loads,
    "tenbin": tenbin_loads,
    "msgpack": msgpack_loads,
    "npy": npy_loads,
    "npz": npz_loads,
    "cbor": cbor_loads,
}

#: field extension -> decoder of its bytes (the extensions come from :mod:`wds_cloud.codec.extensions`)
decoders: dict[str, Callable[[Any], Any]] = {
    ext: _DECODERS_BY_KIND[kind] for kind, exts in KINDS.items() for ext in exts
}


def basichandlers(key: str, data: Any) -> Any:
    """Decode by the last extension of ``key`` with the :data:`decoders` table; None if unknown."""
    extension = key[key.rfind(".") + 1 :].lower()
    f = decoders.get(extension)
    return f(data) if f is not None else None


# name -> (result type, pixel type, image mode): webdataset's table, values and all.  Modes are written in
# lowercase there ("rgb") and upper-cased when handed to Pillow; code that reads imagespecs[x][2] or adds
# entries the upstream way relies on that, so a mode here is matched case-insensitively.
imagespecs = {
    "l8": ("numpy", "uint8", "l"),
    "rgb8": ("numpy", "uint8", "rgb"),
    "rgba8": ("numpy", "uint8", "rgba"),
    "l": ("numpy", "float", "l"),
    "rgb": ("numpy", "float", "rgb"),
    "rgba": ("numpy", "float", "rgba"),
    "torchl8": ("torch", "uint8", "l"),
    "torchrgb8": ("torch", "uint8", "rgb"),
    "torchrgba8": ("torch", "uint8", "rgba"),
    "torchl": ("torch", "float", "l"),
    "torchrgb": ("torch", "float", "rgb"),
    "torch": ("torch", "float", "rgb"),
    "torchrgba": ("torch", "float", "rgba"),
    "pill": ("pil", None, "l"),
    "pil": ("pil", None, "rgb"),
    "pilrgb": ("pil", None, "rgb"),
    "pilrgba": ("pil", None, "rgba"),
}

_PIL_FORMATS = {ext: [fmt] for ext, fmt in IMAGE_FORMATS.items()}


class ImageHandler:
    """Decode image fields with Pillow into numpy (HWC), torch (CHW) or PIL, as ``imagespec`` says.

    Floats are in [0, 1].  Grey images are HxW.
    """

    def __init__(self, imagespec: str, extensions: Any = None) -> None:
        if imagespec not in imagespecs:
            raise ConfigError(f"unknown image spec {imagespec!r}; known: {' '.join(imagespecs)}")
        self.imagespec = imagespec
        self.atype, self.etype, mode = _imagespec(imagespec)
        # the Pillow mode ("RGB"): tables spell it in lowercase, as webdataset's does; None keeps the image's own
        self.mode = mode.upper() if mode is not None else None
        if self.atype == "torch":
            _torch()
        self.extensions = set(extensions if extensions is not None else IMAGE_EXTENSIONS)

    def __call__(self, key: str, data: Any) -> Any:
        extension = key[key.rfind(".") + 1 :].lower()
        if extension not in self.extensions:
            return None
        return self.decode_any(data, extension)

    def decode_any(self, data: Any, extension: Optional[str] = None) -> Any:
        try:
            import PIL.Image
        except ImportError:
            raise MissingExtraError(
                "decoding images needs Pillow: pip install 'wds_cloud[image]' (in a clone: pip install -e '.[image]')"
            ) from None
        image = PIL.Image.open(io.BytesIO(data), formats=_PIL_FORMATS.get(extension or "", None))
        image.load()
        if self.mode is not None and image.mode != self.mode:
            image = image.convert(self.mode)  # type: ignore[assignment]  # an Image either way
        if self.atype == "pil":
            return image
        # A read-only view of Pillow's pixel bytes, as webdataset returns: copying a large image
        # to make it writable costs a fair share of the decoding time (batching copies anyway).
        array = np.asarray(image)
        if self.etype == "float":
            array = array.astype(np.float32) / 255.0
        if self.atype == "numpy":
            return array
        torch = _torch()
        if array.ndim == 3:
            array = array.transpose(2, 0, 1)
        array = np.ascontiguousarray(array)
        if not array.flags.writeable:
            array = array.copy()  # torch tensors must own writable memory
        return torch.from_numpy(array)


def _imagespec(name: str) -> tuple:
    """The entry ``imagespecs[name]``, checked: a user's entry that cannot work is refused when the handler is
    made, naming it, rather than on every image."""
    spec = imagespecs[name]
    ok = isinstance(spec, (tuple, list)) and len(spec) == 3
    if ok:
        atype, etype, mode = spec
        ok = (
            atype in ("numpy", "torch", "pil")
            and (atype == "pil" or etype in ("uint8", "float"))
            and (mode is None or (isinstance(mode, str) and mode != ""))
        )
    if ok and mode is not None:
        try:
            import PIL.ImageMode
        except ImportError:  # refused when an image is decoded, with the install hint
            pass
        else:
            try:
                PIL.ImageMode.getmode(mode.upper())
            except KeyError:
                ok = False
    if not ok:
        raise ConfigError(
            f"imagespecs[{name!r}] is {spec!r}: an image spec is (result type, pixel type, mode), with a result "
            "type of 'numpy', 'torch' or 'pil', a pixel type of 'uint8' or 'float' (None for 'pil') and a "
            "Pillow mode such as 'l', 'rgb' or 'rgba'"
        )
    return tuple(spec)


def imagehandler(imagespec: str, extensions: Any = None) -> ImageHandler:
    """An :class:`ImageHandler` for ``imagespec`` (``"rgb8"``, ``"torchrgb"``, ``"pil"``, ...)."""
    return ImageHandler(imagespec, extensions)


def gzfilter(key: str, data: Any) -> Any:
    """Un-gzip ``*.gz`` fields and pass them on without the ``.gz``."""
    if not key.endswith(".gz"):
        return None
    return Continue(key[:-3], gunzip_bounded(data, key))


def gunzip_bounded(data: Any, key: str = "", limit: Optional[int] = None) -> bytes:
    """``gzip.decompress`` that stops at ``limit`` bytes (default ``WDS_MAX_MEMBER_SIZE``): a field that
    inflates beyond it is an error naming the field and the limit, never an allocation of its claim."""
    limit = config.current().max_member_size if limit is None else limit
    out = io.BytesIO()  # grows in place; getvalue() hands its buffer over without a copy
    have = 0
    rest = bytes(data)
    while rest:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        pending = rest
        while pending:
            chunk = d.decompress(pending, min(1 << 24, limit + 1 - have))
            out.write(chunk)
            have += len(chunk)
            if have > limit:
                raise ValueError(
                    f"field {key!r} inflates to more than {limit} bytes, the limit on one decoded "
                    "field; raise WDS_MAX_MEMBER_SIZE (such as 8GiB) if the data is trusted"
                )
            pending = d.unconsumed_tail
            if d.eof:
                break
        if not d.eof:
            raise ValueError(f"field {key!r}: the gzip stream ended before its end-of-stream marker")
        rest = d.unused_data
    return out.getvalue()


default_pre_handlers = [gzfilter]
default_post_handlers = [basichandlers]


def _by_extension(handler: Any) -> Optional[frozenset]:
    """For our own handlers: the extensions they claim (lets the Decoder plan per field name)."""
    if handler is basichandlers:
        return frozenset(decoders)
    if isinstance(handler, ImageHandler):
        return frozenset(handler.extensions)
    return None


class Decoder:
    """Decode the fields of a sample with ``pre + handlers + post`` (first non-None result wins).

    ``only`` limits decoding to the named fields; fields starting with ``_`` are
    never decoded.  ``allow_pickle=True`` opts in to pickle and full ``torch.load``.
    """

    def __init__(
        self,
        handlers: Any = None,
        pre: Optional[list] = None,
        post: Optional[list] = None,
        only: Any = None,
        partial: bool = False,
        allow_pickle: Optional[bool] = None,
    ) -> None:
        handlers = list(handlers or [])
        handlers = [imagehandler(h) if isinstance(h, str) else h for h in handlers]
        for h in handlers:
            if not callable(h):
                raise TypeError(f"decoder handlers are callables or image specs, not {h!r}")
        self.handlers = (
            (default_pre_handlers if pre is None else pre)
            + handlers
            + (default_post_handlers if post is None else post)
        )
        if isinstance(only, str):
            only = only.split()
        self.only = set(only) if only is not None else None
        self.partial = partial
        self.allow_pickle = allow_pickle
        self._plans: dict[str, Optional[Callable]] = {}
        #: the ``decoders`` table (and its size) the plans were made with: user code adds to it or replaces it
        #: (``autodecode.decoders["xyz"] = fn``, as in webdataset) at any time, and plans made before are dropped
        self._planned_with: tuple[int, int] = (0, -1)  # (id of the table, its size): a Decoder pickles without it
        self._plannable = all(h is gzfilter or _by_extension(h) is not None for h in self.handlers)

    def _plan(self, field: str) -> Optional[Callable]:
        """The single handler that will decode ``field`` (only when every handler is one of ours)."""
        if ("." + field).endswith(".gz"):  # a field named ``gz`` is gzipped too, as webdataset reads it
            return None
        extension = field[field.rfind(".") + 1 :].lower()
        for h in self.handlers:
            if h is gzfilter:
                continue
            if extension in (_by_extension(h) or ()):
                return h
        return _NOTHING

    def decode1(self, key: str, data: Any) -> Any:
        """Decode one field named ``key``; undecodable data is returned as is."""
        for f in self.handlers:
            result = f(key, data)
            if isinstance(result, Continue):
                key, data = result.key, result.data
                continue
            if result is not None:
                return result
        return data

    def __call__(self, sample: dict) -> dict:
        token = _pickle_allowed.set(True) if self.allow_pickle else None
        try:
            return self._decode(sample)
        finally:
            if token is not None:
                _pickle_allowed.reset(token)

    def _decode(self, sample: dict) -> dict:
        result = {}
        plannable = self._plannable
        plans = self._plans
        table, size = self._planned_with
        if table != id(decoders) or size != len(decoders):
            plans.clear()
            self._planned_with = (id(decoders), len(decoders))
        for field, value in sample.items():
            if (
                field[:1] == "_"
                or not isinstance(value, (bytes, bytearray, memoryview))
                or (self.only is not None and field not in self.only)
            ):
                result[field] = value
                continue
            try:
                if plannable:
                    plan = plans.get(field, _unplanned)
                    if plan is _unplanned:
                        plan = plans[field] = self._plan(field)
                    if plan is _NOTHING:
                        result[field] = value
                        continue
                    if type(value) is memoryview:  # a view (zero_copy=True): decoders are given bytes
                        value = value.tobytes()
                    if plan is not None:
                        decoded = plan("." + field, value)
                        result[field] = value if decoded is None else decoded
                        continue
                elif type(value) is memoryview:
                    value = value.tobytes()
                result[field] = self.decode1("." + field, value)
            except SecurityError as exc:
                raise _decoding_error(sample, field, exc, str(exc)) from exc
            except MissingExtraError:
                raise
            except Exception as exc:
                raise _decoding_error(sample, field, exc, f"{type(exc).__name__}: {exc}") from exc
        return result


def _unplanned(key: str, data: Any) -> Any:
    """A sentinel: no plan made yet for this field (never called)."""
    raise AssertionError("the unplanned sentinel was called")


def _NOTHING(key: str, data: Any) -> Any:
    """A sentinel: no handler decodes this field (never called)."""
    raise AssertionError("the no-handler sentinel was called")


def _decoding_error(sample: dict, field: str, exc: Exception, why: str) -> DecodingError:
    url = sample.get("__url__")
    return DecodingError(
        f"{redact(url) if url else '<no url>'}: cannot decode field {field!r} of sample "
        f"{sample.get('__key__')!r}: {why}",
        url=url,
        key=sample.get("__key__"),
        field=field,
    )


def refuse_if_unsafe(path: str, decoder: Callable, sample: dict) -> None:
    """Used by ``xdecode``: refuse pickle decoders unless allowed."""
    if decoder in (unpickle_loads, torch_loads) and not _pickle_permitted():
        exc = _refuse(f"field {path!r} (pickle)")
        raise _decoding_error(sample, path, exc, str(exc))


default_decoder = Decoder()
