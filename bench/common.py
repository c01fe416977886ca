"""Shared helpers for the benchmarks: data generation, timing, memory, tables."""

from __future__ import annotations

import io
import json
import os
import resource
import tarfile
import time
from collections.abc import Callable, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.environ.get("BENCH_DATA", os.path.join(HERE, "_data"))


def peer():
    """webdataset 1.0.2, installed only in the benchmark environment."""
    try:
        import webdataset
    except ImportError:
        raise SystemExit(
            "the benchmarks compare with webdataset 1.0.2, which is not a dependency of wds_cloud; "
            "install it in the benchmark environment: pip install webdataset==1.0.2"
        )
    if webdataset.__version__ != "1.0.2":
        print(f"note: comparing with webdataset {webdataset.__version__}, not 1.0.2")
    return webdataset


def write_tar(path: str, samples: Iterable[tuple[str, dict]]) -> None:
    """A plain ustar shard written with tarfile (the same bytes for both readers)."""
    tmp = path + ".partial"
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mtime = 0
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)


def dataset(name: str, nshards: int, per_shard: int, make: Callable[[int], dict]) -> tuple[str, int]:
    """Generate (once) ``nshards`` shards under bench/_data/name; returns (brace spec, total bytes)."""
    directory = os.path.join(DATA, name)
    os.makedirs(directory, exist_ok=True)
    for s in range(nshards):
        path = os.path.join(directory, f"{name}-{s:04d}.tar")
        if not os.path.exists(path):
            print(f"generating {path}", flush=True)
            write_tar(path, ((f"{s:04d}{i:08d}", make(s * per_shard + i)) for i in range(per_shard)))
    total = sum(os.path.getsize(os.path.join(directory, f"{name}-{s:04d}.tar")) for s in range(nshards))
    return os.path.join(directory, f"{name}-{{0000..{nshards - 1:04d}}}.tar"), total


def tiny(i: int) -> dict:
    return {"txt": (b"%08d" % i) * 12 + b"abcd", "cls": b"%d" % (i % 1000)}


def medium(i: int) -> dict:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(i)
    small = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((256, 256), Image.BILINEAR)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=85)
    return {"jpg": out.getvalue(), "json": json.dumps({"i": i, "caption": "x" * 40}).encode(), "cls": b"%d" % (i % 10)}


def large(i: int) -> dict:
    import numpy as np

    out = io.BytesIO()
    np.save(out, np.full(8 * 2**20 // 4 - 32, i, dtype=np.float32))
    return {"npy": out.getvalue()}


def timed(run: Callable[[], int]) -> tuple[int, float]:
    start = time.perf_counter()
    n = run()
    return n, time.perf_counter() - start


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited across fork+exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(widths[i]) if i else c.ljust(widths[i]) for i, c in enumerate(r)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
