"""Interleaved image-text documents (MMC4, OBELICS) in WebDataset shards: read, write, batch, convert.

A document is one sample: a JSON field holding the document, and its images either as members of
the same sample (``KEY.0.jpg``, ``KEY.1.png``: the field name is the image's number) or embedded in
the JSON as base64.  Two layouts are read (``docs/interleaved.md``):

- **MMC4**: ``text_list`` (the passages) and ``image_info`` (one entry per image: ``image_name``,
  ``matched_text_index``, optionally ``image_base64``).  Image ``i`` is field ``i.<ext>``; it is
  placed just before the passage it is matched to (``matched_text_index == len(text_list)``: after
  the last passage); images matched to the same passage keep their order.
- **OBELICS**: ``texts`` and ``images``, parallel lists in document order, each position holding a
  passage or an image (the other one null).  The image at position ``i`` is field ``i.<ext>``, or
  embedded when its entry is a ``data:image/...;base64,`` URI (another string, such as the
  original URL, is kept only as provenance).

:func:`interleaved` turns such samples into ``sample["interleaved"]``: a list of ``{"text": str}``
and ``{"image": decoded}`` items in document order.  :func:`interleaved_sample` builds such a sample
for a writer, :func:`collate_interleaved` batches documents with variable numbers of images, and
:func:`convert_mmc4` (``wds-cloud convert mmc4``) turns MMC4's published layout into shards.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import io
import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, Optional, cast

from ..autodecode import IMAGE_EXTENSIONS, imagehandler
from ..errors import ConfigError, MalformedDataError, SampleError, redact
from ..filters import pipelinefilter
from ..handlers import reraise_exception
from ..io import datafile
from ..io.security import confined
from ..jobs.patterns import check_output_pattern

__all__ = [
    "interleaved",
    "interleaved_sample",
    "collate_interleaved",
    "convert_mmc4",
    "document_items",
    "mmc4_plan",
    "mmc4_shard",
]

_IMAGE_FIELD = re.compile(r"^(\d+)\.([A-Za-z0-9]+)$")
_DATA_URI = re.compile(r"^data:image/([a-z0-9.+-]+);base64,", re.I)


def _layout(doc: Any) -> str:
    if isinstance(doc, dict) and "text_list" in doc and "image_info" in doc:
        return "mmc4"
    if isinstance(doc, dict) and "texts" in doc and "images" in doc:
        return "obelics"
    return ""


def _b64(text: str, key: str, where: str) -> bytes:
    try:
        return base64.b64decode(_DATA_URI.sub("", text), validate=True)
    except (binascii.Error, ValueError):
        raise SampleError(f"sample {key!r}: {where} is not valid base64") from None


def document_items(
    sample: dict, json_key: str = "json", decode: Optional[Callable[[str, Any], Any]] = None
) -> list[dict]:
    """The document of ``sample`` as ``[{"text": ...} | {"image": ...}, ...]`` in document order.

    ``decode(field, data)`` turns an image's bytes into the image (None: bytes as they are); a field
    decoded already (``.decode("pil")`` before) is taken as it is.  A missing image, an image field the
    document does not name, or a malformed document is a :class:`~wds_cloud.errors.SampleError` naming
    the key.
    """
    key = sample.get("__key__", "?")
    raw = sample.get(json_key)
    if raw is None:
        raise SampleError(
            f"sample {key!r} has no {json_key!r} field holding the document (its fields: "
            f"{', '.join(k for k in sample if not k.startswith('__'))})"
        )
    try:
        doc = json.loads(raw) if isinstance(raw, (bytes, bytearray, str)) else raw
    except ValueError as exc:
        raise SampleError(f"sample {key!r}: the {json_key!r} field is not JSON ({exc})") from None
    layout = _layout(doc)
    if not layout:
        raise SampleError(
            f"sample {key!r}: the document has neither MMC4's text_list/image_info nor OBELICS' texts/images"
        )
    fields: dict[int, tuple[str, Any]] = {}
    for name, value in sample.items():
        match = _IMAGE_FIELD.match(name)
        if match and match.group(2).lower() in IMAGE_EXTENSIONS:
            fields[int(match.group(1))] = (name, value)

    def image(number: int, embedded: Optional[bytes], ext: str = "jpg") -> Any:
        if number in fields:
            name, value = fields.pop(number)
        elif embedded is not None:
            name, value = f"{number}.{_sniff(embedded, ext)}", embedded
        else:
            raise SampleError(
                f"sample {key!r}: image {number} of the document is missing (no field "
                f"'{number}.<ext>' and nothing embedded)"
            )
        if decode is not None and isinstance(value, (bytes, bytearray)):
            return decode(name, value)
        return value

    items: list[dict] = []
    if layout == "mmc4":
        texts, infos = doc["text_list"], doc["image_info"]
        if not isinstance(texts, list) or not isinstance(infos, list):
            raise SampleError(f"sample {key!r}: text_list and image_info must be lists")
        before: dict[int, list[int]] = {}
        for number, info in enumerate(infos):
            where = info.get("matched_text_index") if isinstance(info, dict) else None
            if type(where) is not int or not 0 <= where <= len(texts):
                raise SampleError(
                    f"sample {key!r}: image_info[{number}] has matched_text_index {where!r}, not "
                    f"a passage number in 0..{len(texts)}"
                )
            before.setdefault(where, []).append(number)
        for position in range(len(texts) + 1):
            for number in before.get(position, ()):
                info = infos[number]
                embedded = info.get("image_base64")
                items.append(
                    {
                        "image": image(
                            number,
                            _b64(embedded, key, f"image_info[{number}].image_base64")
                            if isinstance(embedded, str)
                            else None,
                        )
                    }
                )
            if position < len(texts):
                items.append({"text": texts[position]})
    else:
        texts, images = doc["texts"], doc["images"]
        if not isinstance(texts, list) or not isinstance(images, list) or len(texts) != len(images):
            raise SampleError(f"sample {key!r}: texts and images must be lists of the same length")
        for position, (text, entry) in enumerate(zip(texts, images)):
            if text is not None and entry is not None:
                raise SampleError(f"sample {key!r}: position {position} holds both a passage and an image")
            if text is not None:
                items.append({"text": text})
            elif entry is not None:
                embedded = None
                ext = "jpg"
                if isinstance(entry, str) and _DATA_URI.match(entry):
                    ext = _DATA_URI.match(entry).group(1).lower().replace("jpeg", "jpg")  # type: ignore[union-attr]
                    embedded = _b64(entry, key, f"images[{position}]")
                items.append({"image": image(position, embedded, ext)})
    if fields:
        extra = ", ".join(name for name, _ in sorted(fields.values()))
        raise SampleError(f"sample {key!r}: image field(s) {extra} are not named by the document")
    return items


def _interleaved(
    data: Iterable[dict],
    json_key: str = "json",
    imagespec: Optional[str] = "pil",
    handler: Callable = reraise_exception,
) -> Iterator[dict]:
    """Interleaved documents of ``data`` to ``sample["interleaved"]``: ``ds.compose(wds.interleaved())`` or
    ``DataPipeline(..., wds.interleaved(imagespec="rgb8"))``; ``imagespec`` as for ``decode`` (None: image
    bytes); ``handler`` decides what a malformed document does (``warn_and_continue`` skips it)."""
    decode = imagehandler(imagespec) if imagespec else None
    for sample in data:
        try:
            items = document_items(sample, json_key, decode)
        except Exception as exn:
            if handler(exn):
                continue
            break
        out = {k: v for k, v in sample.items() if k.startswith("__")}
        out["interleaved"] = items
        yield out


#: the curried stage (see ``_interleaved``)
interleaved = pipelinefilter(_interleaved)


def _sniff(data: bytes, default: str) -> str:
    """The extension encoded image bytes call for (PNG and JPEG told by their signatures), else ``default``."""
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    return default


def _encode_image(image: Any, fmt: str) -> tuple[bytes, str]:
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        return data, _sniff(data, fmt)
    try:
        import PIL.Image
    except ImportError:  # pragma: no cover - the image extra is not installed
        PIL = None  # type: ignore[assignment]
    if PIL is not None and not isinstance(image, PIL.Image.Image):
        import numpy as np

        array = np.asarray(image)
        if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[2] not in (1, 3):
            array = array.transpose(1, 2, 0)  # CHW (torch) to HWC
        if array.dtype != np.uint8:
            array = (np.clip(array, 0, 1) * 255).astype(np.uint8)
        image = PIL.Image.fromarray(array.squeeze())
    out = io.BytesIO()
    image.save(out, format={"jpg": "JPEG"}.get(fmt, fmt.upper()))
    return out.getvalue(), fmt


def interleaved_sample(
    key: str,
    items: Iterable[Any],
    layout: str = "mmc4",
    image_format: str = "jpg",
    embed: bool = False,
    extra: Optional[dict] = None,
) -> dict:
    """A sample for ``TarWriter.write``/``ShardWriter.write`` holding one document.

    ``items`` in document order: a ``str`` is a passage; anything else an image (encoded bytes, kept as
    they are; a PIL image or an HWC/CHW array, encoded as ``image_format``).  ``layout``: ``"mmc4"`` or
    ``"obelics"``; ``embed=True`` puts the images in the JSON as base64 instead of as members.
    ``extra``: more keys for the document's JSON (its URL, similarity scores, ...).
    """
    if layout not in ("mmc4", "obelics"):
        raise SampleError(f"layout {layout!r} is not 'mmc4' or 'obelics'")
    sample: dict = {"__key__": key}
    doc: dict = dict(extra or {})
    texts: list = []
    if layout == "mmc4":
        infos: list = []
        for item in items:
            if isinstance(item, str):
                texts.append(item)
                continue
            data, ext = _encode_image(item, image_format)
            number = len(infos)
            info = {"image_name": f"{number}.{ext}", "matched_text_index": len(texts)}
            if embed:
                info["image_base64"] = base64.b64encode(data).decode("ascii")
            else:
                sample[f"{number}.{ext}"] = data
            infos.append(info)
        doc.update(text_list=texts, image_info=infos)
    else:
        images: list = []
        for item in items:
            if isinstance(item, str):
                texts.append(item)
                images.append(None)
                continue
            data, ext = _encode_image(item, image_format)
            position = len(texts)
            texts.append(None)
            if embed:
                mime = "jpeg" if ext == "jpg" else ext
                images.append(f"data:image/{mime};base64," + base64.b64encode(data).decode("ascii"))
            else:
                sample[f"{position}.{ext}"] = data
                images.append(f"{position}.{ext}")
        doc.update(texts=texts, images=images)
    sample["json"] = json.dumps(doc, ensure_ascii=False).encode("utf-8")
    return sample


def collate_interleaved(samples: list[dict], pad: bool = False) -> dict:
    """A batch of documents (samples from :func:`interleaved`).

    Returns ``{"__key__": [...], "texts": [[str, ...], ...], "images": ..., "order": [["text", "image",
    ...], ...]}`` (``order``: each document's sequence of item kinds).  ``pad=False``: ``images`` is a list
    of lists.  ``pad=True``: ``images`` is one tensor ``[batch, most images, *image shape]``, zeros where
    a document has fewer, with ``image_mask`` (bool ``[batch, most images]``); the images must be tensors
    (or arrays) of one shape, e.g. after a resize in a map stage.
    """
    texts = [[item["text"] for item in s["interleaved"] if "text" in item] for s in samples]
    images = [[item["image"] for item in s["interleaved"] if "image" in item] for s in samples]
    batch: dict = {
        "__key__": [s.get("__key__") for s in samples],
        "texts": texts,
        "order": [["text" if "text" in item else "image" for item in s["interleaved"]] for s in samples],
    }
    if not pad:
        batch["images"] = images
        return batch
    import torch

    most = max((len(i) for i in images), default=0)
    shapes = {tuple(torch.as_tensor(im).shape) for doc in images for im in doc}
    if len(shapes) > 1:
        raise SampleError(
            f"collate_interleaved(pad=True) needs images of one shape, got {sorted(shapes)}; resize "
            "them in a map stage first, or use pad=False (lists)"
        )
    shape = shapes.pop() if shapes else ()
    first = next((im for doc in images for im in doc), None)
    dtype = torch.as_tensor(first).dtype if first is not None else torch.uint8
    out = torch.zeros((len(samples), most) + shape, dtype=dtype)
    mask = torch.zeros((len(samples), most), dtype=torch.bool)
    for b, doc in enumerate(images):
        for j, im in enumerate(doc):
            out[b, j] = torch.as_tensor(im)
            mask[b, j] = True
    batch["images"], batch["image_mask"] = out, mask
    return batch


def _open_text(url: str) -> Iterator[tuple[str, int, str]]:
    """``(url, line number, line)`` of the non-empty lines of a JSON-lines file, each bounded by
    ``WDS_MAX_DATA_FILE_SIZE`` (a line without end never fills memory)."""
    from .. import config
    from ..io.open import gopen

    limit = config.current().max_data_file_size
    with gopen(url) as stream:
        raw: Any = gzip.GzipFile(fileobj=stream) if url.endswith(".gz") else stream
        with io.TextIOWrapper(raw, encoding="utf-8") as text:
            number = 0
            while True:
                number += 1
                try:
                    line = text.readline(limit + 1)
                except UnicodeDecodeError as exc:
                    raise MalformedDataError(
                        f"{redact(url)}: line {number} is not UTF-8 text (byte {exc.start} of its chunk); fix the file",
                        url=url,
                        field=f"line {number}",
                    ) from None
                if not line:
                    return
                if len(line) > limit:
                    raise MalformedDataError(
                        f"{redact(url)}: line {number} is longer than {limit} characters, the "
                        "most read for one document; if it is genuine, raise "
                        "WDS_MAX_DATA_FILE_SIZE",
                        url=url,
                        field=f"line {number}",
                    )
                if line.strip():
                    yield url, number, line


def _mmc4_doc(url: str, number: int, line: str) -> dict:
    """One MMC4 document of a JSON-lines file, its fields checked (a MalformedDataError naming file and line)."""
    where = f"{redact(url)} line {number}"
    doc = datafile.parse_json(line, where, "document")
    if _layout(doc) != "mmc4":
        raise MalformedDataError(f"{where}: no text_list/image_info (not MMC4's layout)", url=url, field="layout")
    datafile.need(
        isinstance(doc["text_list"], list) and all(isinstance(t, str) for t in doc["text_list"]),
        where,
        "text_list",
        "must be a list of strings",
        "fix the document",
    )
    infos = doc["image_info"]
    datafile.need(
        isinstance(infos, list)
        and all(isinstance(i, dict) and isinstance(i.get("image_name"), str) and i["image_name"] for i in infos),
        where,
        "image_info",
        "must be a list of mappings, each with an image_name",
        "fix the document",
    )
    return doc


def _mmc4_sample(
    number: int, doc: dict, url: str, line_number: int, base: str, images: str, missing: str, counts: dict
) -> Optional[dict]:
    """Document ``number`` as a sample (its JSON and its images, image i as field ``i.<ext>``), or None when
    ``missing="skip"`` skips it; ``counts`` gains its documents, images, dropped images and skipped documents."""
    from ..io.open import gopen

    infos, pictures, skip = [], [], False
    for info in doc["image_info"]:
        try:
            # a name from the document never reads outside the folder given (no '..', path, URL, link)
            path = confined(base, info["image_name"], f"{redact(url)} line {line_number}", "image_info[].image_name")
            with gopen(path) as stream:
                pictures.append(stream.read())
            infos.append(info)
        except FileNotFoundError:
            if missing == "error":
                raise SampleError(
                    f"document {number}: image {info['image_name']!r} does not exist (no file {redact(path)}); "
                    "pass missing='drop' (or 'skip') to go on without it"
                ) from None
            if missing == "skip":
                skip = True
                break
            counts["dropped_images"] += 1
    if skip:
        counts["skipped_documents"] += 1
        return None
    sample: dict = {"__key__": f"{number:09d}"}
    for i, (info, data) in enumerate(zip(infos, pictures)):  # image i of the document is field i.<ext>
        named = str(info["image_name"]).rsplit(".", 1)[-1].lower()
        data, ext = _encode_image(data, named if named in IMAGE_EXTENSIONS else "jpg")
        sample[f"{i}.{ext}"] = data
    sample["json"] = json.dumps(dict(doc, image_info=infos), ensure_ascii=False).encode("utf-8")
    counts["documents"] += 1
    counts["images"] += len(infos)
    return sample


def mmc4_plan(docs: list[str], maxcount: int) -> tuple[list[tuple[int, int, int]], int]:
    """Where each output shard of a conversion begins, ``(document number, docs file index, line number)`` per
    shard (shard k holds documents ``k * maxcount`` to ``(k + 1) * maxcount - 1``, as in one process), and the
    number of documents."""
    plan = []
    number = 0
    for index, url in enumerate(docs):
        for _, line_number, _ in _open_text(url):
            if number % maxcount == 0:
                plan.append((number, index, line_number))
            number += 1
    return plan, number


def mmc4_shard(docs: list[str], images: str, dest: str, shard: int, start: tuple, maxcount: int, missing: str) -> dict:
    """Write output shard ``shard`` of a conversion (on a Dask worker): its documents from ``start`` (an entry
    of :func:`mmc4_plan`), published whole.  Returns its name, size, SHA-256 and counts."""
    from ..io.open import gopen
    from ..jobs.record import HashingWriter
    from ..writer import TarWriter

    check_output_pattern(dest, "dest")
    counts = {"documents": 0, "images": 0, "dropped_images": 0, "skipped_documents": 0}
    number, index, first_line = start
    base = images.rstrip("/")
    output = HashingWriter(gopen(dest % shard, "wb"), dest % shard)
    writer = TarWriter(cast(IO[bytes], output))
    taken = 0
    try:
        for url in docs[index:]:
            for found_url, line_number, line in _open_text(url):
                if url == docs[index] and line_number < first_line:
                    continue
                if taken == maxcount:
                    break
                doc = _mmc4_doc(found_url, line_number, line)
                sample = _mmc4_sample(number, doc, found_url, line_number, base, images, missing, counts)
                if sample is not None:
                    writer.write(sample)
                number += 1
                taken += 1
            if taken == maxcount:
                break
        writer.close()
        output.close()
    except BaseException:
        output.abort()
        raise
    return {"name": output.name, "size": output.count, "sha256": output.sha256.hexdigest(), **counts}


def convert_mmc4(
    docs: list[str],
    images: str,
    dest: str,
    maxcount: int = 1000,
    missing: str = "drop",
    progress: Optional[Callable[[Iterable], Iterable]] = None,
) -> dict:
    """MMC4's published layout (JSON lines of documents; image files named by ``image_name`` under
    ``images``, any URL) to shards at ``dest`` (a ``%d`` pattern such as ``out/mmc4-%06d.tar``).

    Documents go to shards in their order, ``maxcount`` per shard, so the plan is the same on every
    run: a shard is written to a temporary name and published whole when complete, and a run after an
    interruption keeps the shards already published (their images are not read again) and writes
    the rest.  ``missing``: what an image file that does not exist does: ``drop`` it from the
    document (MMC4's image links often died), ``skip`` the document, or ``error``.
    Returns counts: documents, images, dropped images, skipped documents, shards written and kept.
    """
    from ..writer import TarWriter

    check_output_pattern(dest, "dest")  # one number field, names that never repeat: before the job record
    if missing not in ("drop", "skip", "error"):
        raise SampleError(f"missing={missing!r} is not one of drop, skip, error")
    if isinstance(maxcount, bool) or not isinstance(maxcount, int) or maxcount < 1:
        raise ConfigError(f"maxcount={maxcount!r}: give the number of documents per shard, 1 or more")
    from ..jobs.record import HashingWriter, JobRecord

    record = JobRecord(
        dest, "convert mmc4", list(docs), {"images": redact(images), "maxcount": maxcount, "missing": missing}
    )
    record.begin()
    counts = {"documents": 0, "images": 0, "dropped_images": 0, "skipped_documents": 0, "written": 0, "kept": 0}
    writer: Optional[TarWriter] = None
    output: Optional[HashingWriter] = None

    shard = -1
    keep = False
    lines: Iterable = (found for url in docs for found in _open_text(url))
    if progress is not None:
        lines = progress(lines)
    base = images.rstrip("/")
    try:
        for number, (url, line_number, line) in enumerate(lines):
            if number // maxcount != shard:
                if writer is not None and output is not None:
                    record.finish(writer, output)  # published whole here
                writer = output = None
                shard = number // maxcount
                keep = record.keep(dest % shard)  # finished by this same job before an interruption, unchanged
                counts["kept" if keep else "written"] += 1
                if not keep:
                    output = record.open(dest % shard)
                    writer = TarWriter(cast(IO[bytes], output))
            doc = _mmc4_doc(url, line_number, line)
            if keep:
                counts["documents"] += 1
                continue
            sample = _mmc4_sample(number, doc, url, line_number, base, images, missing, counts)
            if sample is not None:
                writer.write(sample)  # type: ignore[union-attr]  # set whenever the shard is not kept
    except BaseException:
        if writer is not None:
            writer.abort()  # a partial shard never appears under its name
        raise
    finally:
        record.flush()
    if writer is not None and output is not None:
        record.finish(writer, output)
        record.flush()
    counts["shards"] = shard + 1
    return counts
