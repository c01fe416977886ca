"""The field extensions wds_cloud knows, in one table: what kind of value each names.

Decoding (``autodecode.decoders``, the image handlers, ``xdecode``'s defaults) and
encoding (``writer.default_handlers``) both build their tables from these, so a new
extension is added here once and is then read and written alike.
"""

from __future__ import annotations

__all__ = ["KINDS", "IMAGE_FORMATS", "IMAGE_EXTENSIONS"]

#: kind of value -> the field extensions that hold it (a sample's ``x.txt``, ``x.cls``, ...)
KINDS: dict[str, tuple[str, ...]] = {
    "text": ("txt", "text", "transcript"),
    "int": ("cls", "cls2", "class", "count", "index", "inx", "id"),
    "json": ("json", "jsn"),
    "pickle": ("pyd", "pickle", "pkl"),
    "torch": ("pth",),
    "tenbin": ("ten", "tb"),
    "msgpack": ("mp", "msgpack", "msg"),
    "npy": ("npy",),
    "npz": ("npz",),
    "cbor": ("cbor",),
}

#: image extension -> the Pillow format it is read and written as (a file is opened only as its own format)
IMAGE_FORMATS: dict[str, str] = {
    "jpg": "JPEG",
    "jpeg": "JPEG",
    "png": "PNG",
    "ppm": "PPM",
    "pgm": "PPM",
    "pbm": "PPM",
    "pnm": "PPM",
    "tif": "TIFF",
    "tiff": "TIFF",
    "webp": "WEBP",
    "bmp": "BMP",
}

#: the image extensions, as webdataset's ``autodecode.IMAGE_EXTENSIONS`` lists them
IMAGE_EXTENSIONS: list[str] = list(IMAGE_FORMATS)
