"""Shared Hypothesis strategies and helpers for building tar shards."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile

from hypothesis import strategies as st

FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}

# Key parts: no dots (the first-dot rule), no slashes inside a part, no leading "__" (meta members).
key_part = st.text(
    alphabet=st.characters(blacklist_characters="./\x00", blacklist_categories=("Cs",)), min_size=1, max_size=40
).filter(lambda s: not s.startswith("__") and s.strip() == s and s)
keys = st.lists(key_part, min_size=1, max_size=3).map("/".join)
field_names = st.sampled_from(["txt", "cls", "json", "jpg", "seg.png", "bin", "a.b.c"])
payloads = st.binary(max_size=3000)
samples = st.fixed_dictionaries({}, optional={}).flatmap(
    lambda _: st.dictionaries(field_names, payloads, min_size=1, max_size=4)
)


def sample_lists(max_size=8):
    return st.lists(st.tuples(keys, samples), min_size=0, max_size=max_size, unique_by=lambda kv: kv[0])


def write_tar(items, fmt="ustar", extras=True, compress=None) -> bytes:
    """A tar archive of ``items`` ([(key, {field: bytes})]) written by Python's tarfile.

    With ``extras``, directories and symlinks are mixed in (the reader must skip them).  A ustar archive cannot
    hold a name of more than 100 bytes that no slash splits into 155 and 100: such items are written as GNU
    (long-name records), as a writer of ustar would have to.
    """
    try:
        return _write_tar(items, FORMATS[fmt], extras, compress)
    except ValueError as exc:
        if fmt != "ustar" or "too long" not in str(exc):
            raise
        return _write_tar(items, FORMATS["gnu"], extras, compress)


def _write_tar(items, format, extras, compress) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=format) as tar:
        if extras:
            d = tarfile.TarInfo("somedir")
            d.type = tarfile.DIRTYPE
            tar.addfile(d)
        for key, fields in items:
            for field, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size = len(data)
                info.mtime = 1
                tar.addfile(info, io.BytesIO(data))
            if extras:
                link = tarfile.TarInfo(f"{key}-link")
                link.type = tarfile.SYMTYPE
                link.linkname = "elsewhere"
                tar.addfile(link)
    return compress_bytes(buf.getvalue(), compress)


def compress_bytes(data: bytes, compress) -> bytes:
    if compress is None:
        return data
    if compress == "gzip":
        return gzip.compress(data)
    if compress == "bz2":
        return bz2.compress(data)
    if compress == "xz":
        return lzma.compress(data)
    if compress == "zstd":
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    raise ValueError(compress)


def expected_samples(items, url):
    return [
        dict({"__key__": key, "__url__": url}, **{f.lower(): d for f, d in fields.items()}) for key, fields in items
    ]
