"""The field extensions wds_cloud knows, in one table: what kind of value each names.

Decoding (``autodecode.decoders``, the image handlers, ``xdecode``'s defaults) and
encoding (``writer.default_handlers``) both build their tables from these, so a new
extension is added here once and is then read and written alike.  The writers also
encode the few extensions webdataset writes but never decodes (``WRITE_ONLY_*``).
"""

from __future__ import annotations

__all__ = [
    "KINDS",
    "IMAGE_FORMATS",
    "IMAGE_EXTENSIONS",
    "WRITE_ONLY_KINDS",
    "WRITE_ONLY_IMAGES",
    "WRITTEN_KINDS",
    "WRITTEN_IMAGES",
]

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

#: extensions webdataset's writer encodes that no reader decodes (they read back as bytes, as upstream's do):
#: kind -> extensions, and image extension -> format (upstream writes ``img``/``image`` as JPEG)
WRITE_ONLY_KINDS: dict[str, tuple[str, ...]] = {"text": ("html", "htm"), "tenbin": ("tenbin",)}
WRITE_ONLY_IMAGES: dict[str, str] = {"img": "JPEG", "image": "JPEG"}

#: what the writers encode: every table above
WRITTEN_KINDS: tuple[dict[str, tuple[str, ...]], ...] = (KINDS, WRITE_ONLY_KINDS)
WRITTEN_IMAGES: tuple[dict[str, str], ...] = (IMAGE_FORMATS, WRITE_ONLY_IMAGES)
