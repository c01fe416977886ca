"""``wds-cloud demo``: write a small synthetic image dataset, then stream it back for training.

The dataset (real JPEG and PNG images made with Pillow, with ``.json`` and
``.cls`` fields) goes to a temporary directory by default, or under any URL
given with ``--url``.  It is read back through
``WebDataset -> shuffle -> decode -> to_tuple -> batched -> DataLoader`` with worker
processes, with a progress bar and the throughput, and one decoded sample is
printed.  A temporary directory is removed afterwards.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from typing import Any, Optional

import numpy as np

from .. import WebDataset, WebLoader
from ..errors import MissingExtraError, redact
from ..io.open import gopen
from ..pytorch import HAVE_TORCH
from .flags import MAX_PARALLEL, count, text

__all__ = ["add_parser", "run_demo", "write_demo_dataset"]

LABELS = ["circle", "square", "stripes", "noise"]


def _image(index: int, size: int) -> Any:
    from PIL import Image

    rng = np.random.default_rng(index)
    label = index % len(LABELS)
    y, x = np.mgrid[0:size, 0:size]
    base = rng.integers(0, 256, 3)
    if label == 0:
        mask = (x - size / 2) ** 2 + (y - size / 2) ** 2 < (size / 3) ** 2
    elif label == 1:
        mask = (abs(x - size / 2) < size / 4) & (abs(y - size / 2) < size / 4)
    elif label == 2:
        mask = (x // 4) % 2 == 0
    else:
        mask = rng.random((size, size)) < 0.5
    pixels = np.zeros((size, size, 3), dtype=np.uint8)
    pixels[mask] = base
    pixels[~mask] = 255 - base
    return Image.fromarray(pixels), label


def write_demo_dataset(url: str, samples: int, shards: int, size: int = 64, progress: Optional[Any] = None) -> str:
    """Write ``samples`` samples in ``shards`` shards under ``url``; returns the shard spec."""
    per_shard = -(-samples // shards)
    index = 0
    for shard in range(shards):
        target = f"{url.rstrip('/')}/demo-{shard:06d}.tar"
        with gopen(target, "wb") as stream, tarfile.open(fileobj=stream, mode="w|") as tar:
            for _ in range(min(per_shard, samples - index)):
                image, label = _image(index, size)
                fmt = "jpg" if index % 2 == 0 else "png"
                encoded = io.BytesIO()
                image.save(encoded, format="JPEG" if fmt == "jpg" else "PNG", quality=90)
                fields = {
                    fmt: encoded.getvalue(),
                    "cls": str(label).encode(),
                    "json": json.dumps({"index": index, "label": LABELS[label], "format": fmt}).encode(),
                }
                for ext, data in fields.items():
                    info = tarfile.TarInfo(f"sample{index:07d}.{ext}")
                    info.size = len(data)
                    info.mtime = 0
                    tar.addfile(info, io.BytesIO(data))
                index += 1
                if progress:
                    progress(index)
    return f"{url.rstrip('/')}/demo-{{000000..{shards - 1:06d}}}.tar"


class _Progress:
    """A progress bar on stderr (tqdm), fed the number of samples done so far."""

    def __init__(self, label: str, total: int, stream: Any = None) -> None:
        from tqdm import tqdm

        stream = stream or sys.stderr
        tty = getattr(stream, "isatty", lambda: False)()
        self._bar = tqdm(
            total=total, desc=label, unit=" samples", file=stream, mininterval=0.1 if tty else 2.0, dynamic_ncols=True
        )
        self._done = 0

    def __call__(self, done: int) -> None:
        self._bar.update(done - self._done)
        self._done = done
        if done >= (self._bar.total or 0):
            self._bar.close()


def run_demo(
    url: Optional[str] = None,
    samples: int = 2000,
    workers: int = 2,
    shards: int = 4,
    batch_size: int = 32,
    keep: bool = False,
    out: Any = None,
) -> dict:
    """Run the demo; returns the figures it printed."""
    out = out or sys.stdout
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise MissingExtraError(
            "the demo makes images with Pillow: pip install 'wds_cloud[image]' (in a clone: pip install -e '.[image]')"
        ) from None
    temporary = url is None
    location = tempfile.mkdtemp(prefix="wds-cloud-demo-") if url is None else url
    try:
        print(f"writing {samples} samples in {shards} shards to {location}", file=out)
        started = time.perf_counter()
        spec = write_demo_dataset(location, samples, shards, progress=_Progress("writing", samples))
        write_seconds = time.perf_counter() - started

        dataset = (
            WebDataset(spec, shardshuffle=True, seed=0)
            .shuffle(500, seed=0)
            .decode("rgb8")
            .to_tuple("jpg;png", "json", "cls")
            .batched(batch_size, partial=True)
        )
        if not HAVE_TORCH:
            print(
                "torch is not installed: reading in this process (pip install 'wds_cloud[torch]' (in a clone: pip install -e '.[torch]') for workers)",
                file=out,
            )
            workers = 0
        loader = WebLoader(dataset, batch_size=None, num_workers=min(workers, shards))
        print(
            f"reading with {min(workers, shards)} DataLoader workers: "
            "WebDataset -> shuffle -> decode('rgb8') -> to_tuple -> batched -> DataLoader",
            file=out,
        )
        progress = _Progress("reading", samples)
        started = time.perf_counter()
        count = 0
        nbytes = 0
        first = None
        for images, metas, labels in loader:  # the workers send whole batches, not single samples
            count += len(images)
            nbytes += images.nbytes
            if first is None:
                first = (images[0], metas[0], labels[0])
            progress(count)
        seconds = time.perf_counter() - started
        rate = count / max(seconds, 1e-9)
        print(
            f"read {count} samples in {seconds:.2f} s: {rate:,.0f} samples/s, "
            f"{nbytes / max(seconds, 1e-9) / 1e6:,.1f} MB/s of decoded pixels",
            file=out,
        )
        if first is not None:
            image, meta, label = first
            array = np.asarray(image)
            print(
                f"one sample: image {array.dtype} {tuple(array.shape)} (mean {array.mean():.1f}), "
                f"cls {int(label)} ({LABELS[int(label)]}), json {json.dumps(meta)}",
                file=out,
            )
        if count != samples:
            raise RuntimeError(f"the demo read {count} samples but wrote {samples}")
        return {"samples": count, "seconds": seconds, "rate": rate, "write_seconds": write_seconds}
    finally:
        if temporary and not keep:
            shutil.rmtree(location, ignore_errors=True)
        elif temporary:
            print(f"kept the dataset in {location}", file=out)


def _check_folder(url: str, error: type) -> None:
    """A local ``--url`` is a folder this process can write (made when absent), checked before a shard is begun:
    one line naming the flag, not an OSError after a progress bar."""
    from ..io.urls import is_local, local_path

    if not is_local(url):
        return
    path = local_path(url)
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise error(
            f"--url {redact(url)}: cannot write there ({reason.lower()}); give a folder you can write to, or leave "
            "out --url for a temporary one"
        ) from None


def _main(args: argparse.Namespace) -> int:
    from .console import UsageError, emit

    if args.shards > args.samples:  # each shard gets at least one sample
        raise UsageError(
            f"--shards {args.shards} is more than --samples {args.samples}: give at most one shard per sample"
        )
    if args.url is not None:
        _check_folder(args.url, UsageError)
    # with --json the narrative goes to stderr and stdout carries only the figures
    figures = run_demo(
        args.url, args.samples, args.workers, args.shards, keep=args.keep, out=sys.stderr if args.json else None
    )
    if args.json:
        emit(args, figures, str)
    return 0


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "demo",
        help="write a small image dataset and stream it back through a DataLoader",
        description="Write a synthetic image dataset (JPEG and PNG with .json and .cls) and stream it back "
        "through WebDataset -> shuffle -> decode -> to_tuple -> DataLoader, showing progress and "
        "throughput.  By default it uses a temporary directory, removed afterwards.  It needs Pillow to make and "
        "decode the images (pip install 'wds_cloud[image]' (in a clone: pip install -e '.[image]'); the README's install line has it) and uses torch's "
        "DataLoader where torch is installed.",
        epilog="examples:\n  wds-cloud demo\n  wds-cloud demo --url data --samples 200 --shards 2 --workers 0\n\n"
        "exit codes: 0 done (every sample written and read back), 1 a shard could not be written or read, 2 bad "
        "arguments (a flag, a WDS_* environment variable)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--url",
        type=text("URL or path"),
        default=None,
        help="where to write the shards: a directory or any URL gopen can write (default: a temporary directory)",
    )
    parser.add_argument("--samples", type=count(1), default=2000, help="number of samples, 1 or more (default: 2000)")
    parser.add_argument("--shards", type=count(1), default=4, help="number of shards, 1 or more (default: 4)")
    parser.add_argument(
        "--workers", type=count(0, MAX_PARALLEL), default=2, help="DataLoader worker processes (default: 2)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary dataset and print where it is")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the figures (samples, seconds, rate) as JSON on stdout; the rest goes to stderr",
    )
    parser.set_defaults(func=_main)
