"""Record streams: files of concatenated CBOR or msgpack records, one sample per record.

``cbors_to_samples()`` / ``msgpacks_to_samples()`` are pipeline stages reading
such files named by ``{"url": ...}`` items (the ``cbors_to_samples`` webdataset's
documentation describes); :class:`RecordWriter` writes them, through ``gopen``,
published only when closed without error.  Records that are dicts get
``__url__`` added.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, Optional, Union

from ..errors import ConfigError, CorruptShardError, MissingExtraError, redact
from ..handlers import reraise_exception
from ..io.open import gopen
from ..io.publishing import Publishing
from ..stages import pipelinefilter

__all__ = [
    "RecordWriter",
    "cbors_samples",
    "cbors_to_samples",
    "msgpacks_samples",
    "msgpacks_to_samples",
    "read_records",
]


def _module(fmt: str) -> Any:
    try:
        if fmt == "cbor":
            import cbor2

            return cbor2
        import msgpack

        return msgpack
    except ImportError:
        package = "cbor2" if fmt == "cbor" else "msgpack"
        raise MissingExtraError(f"{fmt} record files need {package}: pip install {package}") from None


def read_records(stream: Any, fmt: str, url: str = "") -> Iterator[Any]:
    """Every record of a CBOR or msgpack record stream (``stream`` must support ``peek``).

    A record cut short by the end of the stream is a CorruptShardError, never a clean end.
    """
    if fmt == "cbor":
        cbor2 = _module("cbor")
        decoder = cbor2.CBORDecoder(stream)
        while stream.peek(1)[:1]:
            try:
                yield decoder.decode()
            except (EOFError, cbor2.CBORDecodeEOF) as exc:
                raise CorruptShardError(f"{redact(url)}: the CBOR record stream is truncated ({exc})", url=url) from exc
            except cbor2.CBORDecodeError as exc:
                raise CorruptShardError(f"{redact(url)}: damaged CBOR record ({exc})", url=url) from exc
        return
    msgpack = _module("msgpack")
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=0)
    fed = end = 0
    while True:
        chunk = stream.read(1 << 20)
        if not chunk:
            break
        unpacker.feed(chunk)
        fed += len(chunk)
        try:
            for record in unpacker:
                end = unpacker.tell()  # the end of the last complete record
                yield record
        except (msgpack.exceptions.UnpackException, ValueError) as exc:
            raise CorruptShardError(f"{redact(url)}: damaged msgpack record ({exc})", url=url) from exc
    if end != fed:
        raise CorruptShardError(
            f"{redact(url)}: the msgpack record stream is truncated: the record at byte {end} is incomplete",
            url=url,
            offset=end,
        )


def _samples(src: Iterable[dict], fmt: str, handler: Callable, opener: Optional[Callable]) -> Iterator[Any]:
    for source in src:
        url = source["url"]
        try:
            stream = source.get("stream") or (opener or gopen)(url)
            stream = (
                stream
                if hasattr(stream, "peek")
                else io.BufferedReader(stream)
                if hasattr(stream, "readinto")
                else stream
            )
            with stream:
                for record in read_records(stream, fmt, url):
                    if isinstance(record, dict):
                        record.setdefault("__url__", url)
                    yield record
        except Exception as exn:
            if handler(exn):
                continue
            return


def cbors_samples(src: Iterable[dict], handler: Callable = reraise_exception, opener: Optional[Callable] = None):
    """Records of CBOR record files."""
    return _samples(src, "cbor", handler, opener)


def msgpacks_samples(src: Iterable[dict], handler: Callable = reraise_exception, opener: Optional[Callable] = None):
    """Records of msgpack record files."""
    return _samples(src, "msgpack", handler, opener)


cbors_to_samples = pipelinefilter(cbors_samples)
msgpacks_to_samples = pipelinefilter(msgpacks_samples)


class RecordWriter(Publishing):
    """Write samples as concatenated CBOR (``fmt="cbor"``) or msgpack records to a URL or stream."""

    def __init__(self, target: Union[str, IO[bytes]], fmt: str = "cbor") -> None:
        if fmt not in ("cbor", "msgpack"):
            raise ConfigError(f"record format must be 'cbor' or 'msgpack', not {fmt!r}")
        self._module = _module(fmt)
        self.fmt = fmt
        if isinstance(target, str):
            self.stream = gopen(target, "wb")
        else:
            self.stream = target
        self.count = 0
        self.closed = False

    def write(self, sample: Any) -> int:
        data = self._module.dumps(sample) if self.fmt == "cbor" else self._module.packb(sample, use_bin_type=True)
        self.stream.write(data)
        self.count += 1
        return len(data)

    def _publish(self) -> None:
        self.stream.close()

    def _discard(self) -> None:
        abort = getattr(self.stream, "abort", None)
        (abort or self.stream.close)()
