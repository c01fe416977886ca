"""``TarWriter`` and ``ShardWriter``: reproducible, crash-safe WebDataset shards, written anywhere.

Reproducible by default: the same samples give byte-identical shards (every
member has the same fixed mtime, 0, unless ``mtime=`` is given; fields are
written in sorted order; ustar headers, with a PAX header only when a name or a
size needs one).  Output goes through ``gopen``, so any registered backend can
be written to, and a shard appears under its final name only when it is
complete: an exception in a ``with`` block, or a killed process, leaves nothing
under that name.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable
from typing import IO, Any, Optional, Union

from .codec.encoders import (
    bytestr,
    cbor_dumps,
    default_handlers,
    encode_based_on_extension,
    encode_based_on_extension1,
    imageencoder,
    make_encoder,
    make_handlers,
    mp_dumps,
    numpy_dumps,
    numpy_npz_dumps,
    tenbin_dumps,
    torch_dumps,
)
from .errors import ConfigError, SampleError, redact
from .io.open import gopen
from .io.publishing import Publishing
from .tar.format import check_header_numbers
from .tar.write import Compressor, MemberWriter, compression_for

__all__ = [
    "TarWriter",
    "ShardWriter",
    "default_handlers",
    "make_handlers",
    "make_encoder",
    "encode_based_on_extension",
    "encode_based_on_extension1",
    "imageencoder",
    "bytestr",
    "numpy_dumps",
    "torch_dumps",
    "check_key",
    "add_handlers",
    "cbor_dumps",
    "mp_dumps",
    "numpy_npz_dumps",
    "tenbin_dumps",
]

log = logging.getLogger(__name__)


def add_handlers(table: dict, keys: Union[str, Iterable[str]], value: Callable) -> None:
    """Put ``value`` in ``table`` under each of ``keys`` (a list, or names separated by spaces), as webdataset's
    ``add_handlers`` does when it builds its handler table."""
    for key in keys.split() if isinstance(keys, str) else keys:
        table[key] = value


def default_handlers_now() -> dict:
    """This module's ``default_handlers`` as it is now (user code may have assigned a table of its own)."""
    return globals()["default_handlers"]


_GOOD_FIELDS: set = set()  # field names already found valid (the same few recur in every sample)


def _good_field(field: str) -> bool:
    ok = field != "" and "/" not in field and "\0" not in field and (field.isascii() or _reads_back(field))
    if ok and len(_GOOD_FIELDS) < 4096:
        _GOOD_FIELDS.add(field)
    return ok


def _reads_back(text: str) -> bool:
    """Whether the bytes a tar header gets for ``text`` read back as ``text``.

    The reader gives a name that is not UTF-8 (a latin-1 ``caf\\xe9``) with each undecodable byte escaped
    (``'caf\\udce9'``, Python's surrogateescape), and the writer writes such escapes as the bytes they stand
    for, so a name read is written back byte for byte.  Other lone surrogates have no bytes, and escapes of bytes
    that together are UTF-8 (``'\\udcc3\\udca9'``) would read back as the text they spell (``'\\u00e9'``).
    """
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape") == text
    except UnicodeEncodeError:
        return False


def check_key(key: Any) -> str:
    """Refuse keys the reader could not give back unchanged; returns the key."""
    if not isinstance(key, str):
        raise SampleError(f"__key__ must be a string, not {type(key).__name__} ({key!r})")
    why = None
    if key == "":
        why = "it is empty"
    elif key.startswith("/"):
        why = "it is an absolute path; use a relative one such as 'train/000001'"
    elif ".." in key.split("/"):
        why = "it contains a '..' path component"
    elif "." in key.rsplit("/", 1)[-1]:
        why = (
            "its last path component contains a dot, where readers split the key from the field; "
            "replace the dot (e.g. with '_') or read with keys='last_dot'"
        )
    elif "\0" in key:
        why = "it contains a NUL character"
    elif key.endswith("/"):
        why = "it ends in '/', so its members would be read as directory entries"
    elif not key.isascii() and not _reads_back(key):
        why = (
            "it holds a lone surrogate that stands for no byte a tar header could carry (the reader escapes each "
            "byte of a name that is not UTF-8 as U+DC80-U+DCFF, and only such escapes of bytes that are not UTF-8 "
            "together are written back as those bytes); give text, or the key as the reader gave it"
        )
    if why:
        raise SampleError(f"invalid sample key {key!r}: {why}", key=key)
    return key


class TarWriter(Publishing):
    """Write samples (dicts with ``__key__``) as a tar shard to a file object or a URL.

    ``encoder``: True (encode by extension), False (bytes only), a dict of
    extension handlers, or a callable on the sample.  ``compress``: True/"gz",
    "bz2", "xz", "zstd", or None to follow the name (``.tgz``, ``.tar.gz``,
    ``.tar.bz2``, ``.tar.xz``, ``.tar.zst``).  ``format``: "pax" (default: ustar,
    PAX only when needed), "gnu" or "ustar" (strict).
    """

    def __init__(
        self,
        fileobj: Union[str, IO[bytes]],
        user: str = "bigdata",
        group: str = "bigdata",
        mode: int = 0o0444,
        compress: Optional[Union[bool, str]] = None,
        encoder: Any = True,
        keep_meta: bool = False,
        mtime: Optional[float] = None,
        format: Any = None,
        storage_options: Optional[dict] = None,
        uid: int = 0,
        gid: int = 0,
    ) -> None:
        check_header_numbers(mode=mode, uid=uid, gid=gid, mtime=mtime if mtime is not None else 0)
        name = fileobj if isinstance(fileobj, str) else getattr(fileobj, "name", None)
        self.name = name if isinstance(name, str) else None
        if compress is None and self.name:
            compress = compression_for(self.name)
        elif compress is True:
            compress = "gz"
        if isinstance(fileobj, str):
            stream = gopen(fileobj, "wb", storage_options=storage_options)
            #: closing the writer closes the stream (it opened it, or was handed it to own)
            self.owns_stream = True
        else:
            stream = fileobj
            self.owns_stream = False
        self._raw = stream
        self.compression = compress or None
        self._compressor = Compressor(stream, compress) if compress else None
        self.stream = self._compressor if self._compressor is not None else stream
        # encoder=True encodes with this module's default_handlers as it is now: user code that assigns a table of its
        # own here (``writer.default_handlers = mine``, as webdataset allows) is heard, as is one that adds to it
        self.encoder = make_encoder(default_handlers_now() if encoder is True else encoder)
        self.keep_meta = keep_meta
        self.members = MemberWriter(
            self.stream,
            mtime=int(mtime) if mtime is not None else 0,
            mode=mode,
            uid=uid,
            gid=gid,
            user=user,
            group=group,
            format=format,
        )
        self.written = 0  # tar bytes (before compression)
        self.count = 0
        self.closed = False

    @property
    def size(self) -> int:
        """Bytes written so far: compressed bytes when compressing, tar bytes otherwise."""
        return self.stream.tell() if self.compression else self.written

    def write(self, obj: dict) -> int:
        """Write one sample; returns the bytes of its encoded fields' payload (as webdataset 1.0.2: no headers or
        padding; :attr:`size` counts what the shard really holds)."""
        if self.closed:
            raise ValueError(f"{self._where()}: write() after close()")
        if "__key__" not in obj:
            raise SampleError(f"{self._where()}: a sample needs a '__key__' (fields: {sorted(obj)})")
        key = check_key(obj["__key__"])
        try:
            encoded = self.encoder(obj)
        except SampleError:
            raise
        except Exception as exc:
            raise SampleError(f"{self._where()}: cannot encode sample {key!r}: {exc}", key=key) from exc
        seen: dict[str, str] = {}
        members = []
        for field in sorted(encoded):
            if field == "__key__" or (field.startswith("_") and not self.keep_meta):
                continue
            value = encoded[field]
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise SampleError(
                    f"{self._where()}: field {field!r} of sample {key!r} is {type(value).__name__} "
                    "after encoding; the encoder must return bytes",
                    key=key,
                )
            lowered = field.lower()
            if lowered in seen:
                raise SampleError(
                    f"{self._where()}: sample {key!r} has fields {seen[lowered]!r} and {field!r}, "
                    "which readers see as the same field",
                    key=key,
                )
            seen[lowered] = field
            if field not in _GOOD_FIELDS and not _good_field(field):
                raise SampleError(
                    f"{self._where()}: invalid field name {field!r} in sample {key!r}: a field name "
                    "is non-empty text without '/' or NUL (undecodable bytes escaped as the reader gives them), "
                    "or it would not read back as written",
                    key=key,
                )
            members.append((f"{key}.{field}", value))
        if not members:
            raise SampleError(f"{self._where()}: sample {key!r} has no fields to write", key=key)
        taken = payload = 0
        for name, value in members:
            taken += self.members.add(name, value)
            payload += value.nbytes if isinstance(value, memoryview) else len(value)
        self.written += taken
        self.count += 1
        # webdataset 1.0.2 returns the fields' payload bytes, and code that sums this return value to cut its own
        # shards (lhotse's ShardWriter) relies on that; the bytes the sample took in the stream are in .size
        return payload

    def _where(self) -> str:
        return redact(self.name) if self.name else "TarWriter"

    def _publish(self) -> None:
        """Finish the archive and publish it."""
        self.written += self.members.finish(self.written)
        if self._compressor is not None:
            self._compressor.finish()  # a stream handed in stays open, compressed or not (as upstream's)
        if self.owns_stream:
            self._raw.close()
        else:
            flush = getattr(self._raw, "flush", None)
            if flush:
                flush()

    def _discard(self) -> None:
        """Discard the shard: nothing appears under its name (for a URL or an atomic stream)."""
        abort = getattr(self._raw, "abort", None)
        if abort is not None:
            abort()
        elif self.owns_stream:
            self._raw.close()


def _check_limit(name: str, value: Any, rule: str) -> None:
    """A shard limit is None (no limit) or a finite number within its rule: NaN compares false with every count,
    so ``maxcount=nan`` would never cut a shard; a bool is a slip, not a count."""
    if value is None:
        return
    good = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if good:
        good = value >= 1 if name == "maxcount" else value > 0
    if not good:
        raise ConfigError(f"ShardWriter({name}={value!r}): {name} is {rule}, or None for no limit")


class ShardWriter(Publishing):
    """Write samples to a numbered series of shards: ``ShardWriter("out-%06d.tar", maxcount=10000)``.

    A new shard starts when the current one holds ``maxcount`` samples or
    ``maxsize`` bytes (None for either: no limit; webdataset raises TypeError) (real bytes written: headers, padding, after compression; webdataset 1.0.2 counts
    only the fields' payload, docs/migrating.md says why this differs).
    ``pattern`` uses ``%06d`` or ``{shard:06d}``.  ``post(fname)`` runs after each
    shard is closed; ``opener(fname)`` opens it (default ``gopen(fname, "wb")``).
    ``shards`` records (name, samples, bytes) of every finished shard.  No empty
    shard is ever written.  If an exception leaves the ``with`` block, finished
    shards stay and the shard in progress is discarded.
    """

    def __init__(
        self,
        pattern: str,
        maxcount: Optional[int] = 100000,
        maxsize: Optional[float] = 3e9,
        post: Optional[Callable] = None,
        start_shard: int = 0,
        verbose: int = 0,
        opener: Optional[Callable] = None,
        **kw: Any,
    ) -> None:
        _check_limit("maxcount", maxcount, "a number of samples, at least 1")
        _check_limit("maxsize", maxsize, "a number of bytes, more than 0")
        self.pattern = pattern
        self.maxcount = maxcount
        self.maxsize = maxsize
        self.post = post
        self.opener = opener
        self.verbose = verbose
        self.kw = kw
        self.shard = start_shard
        self.tarstream: Optional[TarWriter] = None
        self.fname: Optional[str] = None
        self.count = 0
        self.total = 0
        self.shards: list[dict] = []
        self.closed = False

    def _name(self, shard: int) -> str:
        if "{" in self.pattern:
            return self.pattern.format(shard=shard)
        return self.pattern % shard

    def next_stream(self) -> None:
        """Finish the current shard and start the next one."""
        self.finish()
        self.fname = self._name(self.shard)
        if self.verbose:
            log.info(
                "writing shard %s (%d samples and %d bytes so far)",
                redact(self.fname),
                self.total,
                sum(s["bytes"] for s in self.shards),
            )
        self.shard += 1
        stream = self.opener(self.fname) if self.opener else self.fname
        self.tarstream = TarWriter(stream, **self.kw)
        if self.opener:  # the writer owns what the opener gave it: closing the shard closes the stream
            self.tarstream.name = self.fname
            self.tarstream.owns_stream = True
        self.count = 0

    def write(self, obj: dict) -> int:
        """Write one sample, starting a new shard when the current one is full (by its own count of the real bytes
        written, not by the payload bytes this returns, as :meth:`TarWriter.write` does)."""
        if self.closed:
            raise ValueError("ShardWriter.write() after close()")
        if (
            self.tarstream is None
            or (self.maxcount is not None and self.count >= self.maxcount)
            or (self.maxsize is not None and self.tarstream.size >= self.maxsize)
        ):
            self.next_stream()
        tarstream = self.tarstream
        assert tarstream is not None  # next_stream() just made one
        payload = tarstream.write(obj)
        self.count += 1
        self.total += 1
        return payload

    def finish(self) -> None:
        """Close the current shard, record it, and run ``post``."""
        if self.tarstream is None:
            return
        stream, self.tarstream = self.tarstream, None
        stream.close()
        self.shards.append({"name": self.fname, "samples": stream.count, "bytes": stream.size})
        if self.post is not None:
            self.post(self.fname)

    def _publish(self) -> None:
        """Finish the last shard."""
        self.finish()

    def _discard(self) -> None:
        """Discard the shard in progress; finished shards stay."""
        if self.tarstream is not None:
            self.tarstream.abort()
            self.tarstream = None
