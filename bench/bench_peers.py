"""Local disk, side by side with the peers: wds_cloud, webdataset 1.0.2 and LitData, samples/s, in one run.

The same shards (bench/_data, made by ``common.dataset``) for every reader; LitData reads its ``optimize``d
chunks converted once from those shards (bench/_data/litdata/<name>; the conversion is not timed).  Each round
runs every peer once in turn (alternating), each in a fresh process of its environment with one untimed epoch
first (the page cache warm, and whatever a reader keeps for its next pass); the table gives the best of ``--repeat`` rounds, and every peer's
samples are checked against the others' (a digest of the field's bytes, whatever the order).

Where the warm page cache comes from (``--cache``): ``disk`` (the default, and what docs/performance.md shows)
takes the files a peer reads out of the page cache (``fsync`` and ``POSIX_FADV_DONTNEED``) at the start of its
process, so its untimed epoch reads them from disk, as a training job's first epoch does, and its timed epoch
reads what that epoch left in the page cache; ``as-is`` leaves the cache as the run found it (the shards in it
as they were written or last read, by whichever program: in one round webdataset reads the same tar files after
wds_cloud).  The two differ for readers that map files, wds_cloud and LitData: how the pages came into the
page cache sets the size of the pieces the kernel holds them in (on Linux 6.x: larger when they were read with
``read`` in modest pieces than when written in small pieces or brought in by faults on a mapping), and a
mapping's cost per pass is the kernel filling and clearing a page table entry for every piece.  On the 2-core
machine of bench/README.md, wds_cloud's raw row ran 1.1x-1.2x LitData's with ``disk`` and up to 1.5x with
``as-is`` after a webdataset run had read the shards; runs before ``--cache`` existed were ``as-is``.

Rows (``--rows``):

- ``raw``: 8,000 samples (8 shards of ~15.5 KB JPEG + json + cls, ~23 KB of tar each), touch the jpg bytes (its length and first
  byte), one process;
- ``views``: the same, wds_cloud with ``zero_copy=True`` (read-only memoryviews; ``n/a`` where this wds_cloud
  refuses the keyword) against LitData's own loop: LitData 0.2.76 hands out a raw ``bytes`` field as a
  ``memoryview`` of its chunk (indexing and iterating ``StreamingDataset`` alike; ``__key__``, a str, stays a
  str), so its plain loop already copies nothing;
- ``decode``: the same, every JPEG decoded by PIL to RGB in user code (the same code for every peer);
- ``loader``: a DataLoader with 2 workers (``WebLoader`` as it comes: its default transport), batches of 64 made
  by the default collation, the jpg bytes crossing to the main process; the trainer iterates the batch's jpg
  column as plain items (``for jpg in column``, what users write: each a ``bytes``, with every peer) and touches
  each; the rate counts samples the trainer received over the timed epoch (a new loader, its workers started
  in it), and the main process's CPU per sample is that epoch's ``time.process_time()`` (the workers' not
  counted) over its samples;
- ``loader-own``: the same with the user's own collation function (a list of bytes per column); LitData's
  DataLoader rows both use the collation its users write (its fields made ``bytes`` in the workers): torch's
  default collation refuses its ``memoryview`` fields;
- ``loader-views``: wds_cloud only, ``loader`` with ``pack_bytes=True`` (each column a ``PackedBytes``), iterated
  through ``column.views()`` (zero-copy views of the shared batch: a special path, a row of its own);
- ``tiny``: 200,000 tiny samples (txt + cls), touch the txt bytes, one process;
- ``large``: 64 members of 8 MB, wds_cloud against reading each member into its own new buffer
  (``readinto`` a fresh ``bytearray`` at the offsets ``tarfile`` lists: the limit of handing out one object
  per member).

LitData is installed only in its own environment, never a dependency.  Its declared torchvision (0.29) pulls in
a CUDA torch 2.14; it imports torchvision only if present, so it goes in without its dependencies, next to the
same CPU torch 2.13.0 as bench/.venv::

    python3 -m venv bench/.venv-litdata
    bench/.venv-litdata/bin/pip install torch==2.13.0
    bench/.venv-litdata/bin/pip install --no-deps litdata==0.2.76
    bench/.venv-litdata/bin/pip install lightning-utilities filelock numpy boto3 requests urllib3 tifffile obstore pillow
    bench/.venv/bin/python bench/bench_peers.py [--repeat 3] [--rows raw,views,decode,loader,loader-own,loader-views,tiny,large] [--svg]
        [--cache disk|as-is]

Without it the LitData column says ``-``.  ``--json PATH`` writes the figures; ``--svg [PATH]`` the bar chart
(default docs/img/peers.svg); ``--page`` puts the table in docs/performance.md (its section between the markers)
and the figure in docs/img/peers.svg.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LITDATA_PYTHON = os.path.join(HERE, ".venv-litdata", "bin", "python")
ROWS = ("raw", "views", "decode", "loader", "loader-own", "loader-views", "tiny", "large")
#: the rows through a DataLoader: each also reports the main process's CPU per sample (its workers' not counted)
LOADERS = ("loader", "loader-own", "loader-views")
TITLES = {
    "raw": "local, touch the jpg bytes, warm epoch, 1 process",
    "views": "local, touch the jpg bytes, views (zero_copy=True)",
    "decode": "local, PIL decode + RGB, 1 process",
    "loader": "local, DataLoader 2 workers, batch 64, default collation, plain items",
    "loader-own": "local, DataLoader 2 workers, batch 64, the user's collation, plain items",
    "loader-views": "local, DataLoader 2 workers, batch 64, column.views()",
    "tiny": "local, tiny samples, warm, 1 process",
    "large": "local, 8 MB members (against readinto a new buffer)",
}
#: the field each row reads, and the dataset it reads
FIELD = {"raw": "jpg", "views": "jpg", "decode": "jpg", "tiny": "txt", "large": "npy", **{r: "jpg" for r in LOADERS}}
DATA = {"raw": "medium", "views": "medium", "decode": "medium", "tiny": "tiny", "large": "large"}
DATA.update({r: "medium" for r in LOADERS})
SHAPES = {"medium": (8, 1000), "tiny": (8, 25000), "large": (4, 16)}
PAGE = os.path.join(ROOT, "docs", "performance.md")
FIGURE = os.path.join(ROOT, "docs", "img", "peers.svg")
BEGIN, END = "<!-- peers: begin -->", "<!-- peers: end -->"


def shards(name: str) -> list:
    sys.path.insert(0, HERE)
    import common

    nshards, per_shard = SHAPES[name]
    make = {"medium": common.medium, "tiny": common.tiny, "large": common.large}[name]
    spec, _ = common.dataset(name, nshards, per_shard, make)
    directory = os.path.dirname(spec)
    return [os.path.join(directory, f"{name}-{i:04d}.tar") for i in range(nshards)]


class Digest:
    """An order-free digest of the bytes a reader delivered: how many, and the sum of their CRCs."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0

    def add(self, data) -> None:
        self.count += 1
        self.total = (self.total + zlib.crc32(data)) % (1 << 61)

    def value(self) -> str:
        return f"{self.count}:{self.total}"


def decode(data) -> int:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image = image.convert("RGB")
    image.load()
    return image.size[0]


# one pass of each row, for the readers of this environment: (samples, seconds, digest or None)
def _touch(samples, field, digest):
    n = 0
    if digest is None:
        for sample in samples:
            value = sample[field]
            len(value)
            value[0]
            n += 1
    else:
        for sample in samples:
            digest.add(sample[field])
            n += 1
    return n


def own_collate(samples):
    """A user's own collation function: the batch's columns as lists (of bytes, and of the cls bytes)."""
    return [s[0] for s in samples], [s[1] for s in samples]


def _run_pass(make, row, digest):
    """(items, seconds, the main process's CPU seconds) of one pass."""
    field = FIELD[row]
    started, cpu = time.perf_counter(), time.process_time()
    if row == "decode":
        n = 0
        for sample in make():
            decode(sample[field])
            if digest is not None:
                digest.add(sample[field])
            n += 1
    elif row in LOADERS:
        n = 0
        for batch in make():
            column = batch[0] if isinstance(batch, (tuple, list)) else batch[field]
            items = column.views() if row == "loader-views" and hasattr(column, "views") else column
            for value in items:
                if digest is not None:
                    digest.add(value)
                else:
                    value[0]
                n += 1
    else:
        n = _touch(make(), field, digest)
    return n, time.perf_counter() - started, time.process_time() - cpu


def reader(wds, row: str, files: list, **options):
    """How ``wds`` (wds_cloud or webdataset, the same API) reads ``row``: a function that makes the iterable
    (``options`` go to the WebLoader in the DataLoader rows, else to the WebDataset)."""
    if row in LOADERS:
        collation = {"collation_fn": own_collate} if row == "loader-own" else {}
        return lambda: wds.WebLoader(
            wds.WebDataset(files, shardshuffle=False).to_tuple("jpg", "cls").batched(64, **collation),
            batch_size=None,
            num_workers=2,
            **options,
        )
    return lambda: wds.WebDataset(files, shardshuffle=False, **options)


def ours(row: str, files: list):
    import wds_cloud

    options = {"views": {"zero_copy": True}, "loader-views": {"pack_bytes": True}}.get(row, {})
    return reader(wds_cloud, row, files, **options)


def webdataset(row: str, files: list):
    import webdataset

    return reader(webdataset, row, files)


def one(make, row):
    """A warm-up pass (with the digest), then the timed pass: (rate, digest, main-process CPU microseconds per
    item)."""
    digest = Digest()
    _run_pass(make, row, digest)
    n, seconds, cpu = _run_pass(make, row, None)
    return n / seconds, digest.value(), cpu / n * 1e6


def large_baseline(files: list):
    """Every member read into its own new buffer at the offsets tarfile lists: (rate, digest)."""
    offsets = []
    for path in files:
        with tarfile.open(path) as tar:
            offsets += [(path, m.offset_data, m.size) for m in tar.getmembers() if m.isfile()]

    def run(digest):
        n = 0
        handles = {path: open(path, "rb", buffering=0) for path in files}
        try:
            for path, offset, size in offsets:
                f = handles[path]
                f.seek(offset)
                buf = bytearray(size)
                f.readinto(buf)
                if digest is not None:
                    digest.add(buf)
                n += 1
        finally:
            for f in handles.values():
                f.close()
        return n

    digest = Digest()
    run(digest)
    started = time.perf_counter()
    n = run(None)
    return n / (time.perf_counter() - started), digest.value()


CACHES = ("disk", "as-is")
CACHE_NOTE = {
    "disk": "Each reader's files left the page cache as its process began: its untimed epoch read them from disk, "
    "its timed epoch what that left in the page cache (`--cache disk`).",
    "as-is": "The page cache as the run found it (`--cache as-is`).",
}


def evict(paths: list) -> None:
    """Take ``paths`` (files, or folders: every file under them) out of the page cache: written back first, then
    dropped, so the next read of them comes from disk."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += [os.path.join(d, name) for d, _, names in os.walk(path) for name in names]
        else:
            files.append(path)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def peer_worker(peer: str, row: str, cache: str = "as-is") -> None:
    """Run in a fresh process of this environment: one warm-up and one timed pass of ``peer``; print JSON."""
    files = shards(DATA[row])
    if cache == "disk":
        evict(files)
    try:
        cpu = None
        if peer == "readinto":
            rate, digest = large_baseline(files)
        else:
            rate, digest, cpu = one((ours if peer == "wds_cloud" else webdataset)(row, files), row)
    except TypeError as error:  # a wds_cloud without zero_copy
        if row != "views" or "zero_copy" not in str(error):
            raise
        rate, digest = None, None
    print(json.dumps({"rate": rate, "digest": digest, "cpu": cpu}))


def fresh(peer: str, row: str, cache: str):
    """(rate, digest, main CPU per item) of ``peer`` on ``row``, measured in a fresh process (as LitData's are: no
    peer runs in a process another has run in, whose memory makes its DataLoader workers slower to fork); None for
    n/a."""
    out = _child(sys.executable, ["--peer-worker", f"{peer},{row},{cache}"], f"{peer}'s run of {row!r}")
    return None if out["rate"] is None else (out["rate"], out["digest"], out.get("cpu"))


def _child(python: str, args: list, what: str) -> dict:
    """The JSON line a run of this script (``args``) under ``python`` printed last."""
    done = subprocess.run([python, os.path.abspath(__file__), *args], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# LitData, in its own environment
def litdata_dir(name: str) -> str:
    return os.path.join(HERE, "_data", "litdata", name)


def litdata_worker(row: str, cache: str = "as-is") -> None:
    """Run in bench/.venv-litdata: convert the shards once, then one warm-up and one timed pass; print JSON."""
    os.environ.setdefault("DATA_OPTIMIZER_CACHE_FOLDER", os.path.join(HERE, "_data", "litdata", ".cache"))
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
    name = DATA[row]
    files = [os.path.join(HERE, "_data", name, f"{name}-{i:04d}.tar") for i in range(SHAPES[name][0])]
    output = litdata_dir(name)
    if not os.path.exists(os.path.join(output, "index.json")):
        convert(files, output)
    if cache == "disk":
        evict([output])
    from litdata import StreamingDataLoader, StreamingDataset

    if row in LOADERS:
        # torch's default collation refuses LitData's memoryview fields ("each element in list of batch should be
        # of equal size"): both rows use the collation its users write, the fields made bytes in the workers

        def make():
            return StreamingDataLoader(
                StreamingDataset(output), batch_size=64, num_workers=2, collate_fn=_collate_bytes
            )
    else:

        def make():
            return StreamingDataset(output)

    rate, digest, cpu = one(make, row)
    sample = next(iter(StreamingDataset(output)))
    print(json.dumps({"rate": rate, "digest": digest, "type": type(sample[FIELD[row]]).__name__, "cpu": cpu}))


def _collate_bytes(items):
    """LitData hands out its raw bytes fields as memoryviews, which cannot cross to the main process: its users
    make them bytes (the copy this row pays)."""
    return {"jpg": [bytes(item["jpg"]) for item in items], "cls": [bytes(item["cls"]) for item in items]}


def _samples_of(path: str):
    """The samples of one shard as dicts of bytes (keys as the tar names them), read with tarfile."""
    current, key = None, None
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            base, _, ext = member.name.partition(".")
            if base != key:
                if current is not None:
                    yield current
                current, key = {"__key__": base}, base
            current[ext] = tar.extractfile(member).read()
    if current is not None:
        yield current


def convert(files: list, output: str) -> None:
    from litdata import optimize

    started = time.perf_counter()
    optimize(fn=_samples_of, inputs=files, output_dir=output, chunk_bytes="64MB", num_workers=1)
    print(f"converted {len(files)} shards for LitData in {time.perf_counter() - started:.1f} s", file=sys.stderr)


def litdata(row: str, cache: str):
    """(rate, digest, type of the field) from the LitData environment, or None where it is not installed."""
    if not os.path.exists(LITDATA_PYTHON) or row == "large":
        return None
    # against views, LitData's own loop (what it hands out is its own: see --help)
    what = {"views": "raw", "loader-views": "loader"}.get(row, row)
    out = _child(LITDATA_PYTHON, ["--litdata-worker", f"{what},{cache}"], f"LitData's run of {row!r}")
    return out["rate"], out["digest"], out["type"], out.get("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--cache",
        choices=CACHES,
        default="disk",
        help="disk (default; the published figures): each peer's files leave the page cache before its run, so its "
        "untimed epoch reads them from disk and its timed epoch what that left; as-is: the page cache as the run "
        "finds it (faster or slower for the readers that map files, by how the pages came in: see above)",
    )
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--page", action="store_true", help="put the table in docs/performance.md, the figure in docs/img"
    )
    parser.add_argument(
        "--svg", nargs="?", const=FIGURE, metavar="PATH", help="write the bar chart (default: docs/img/peers.svg)"
    )
    parser.add_argument(
        "--from-json", metavar="PATH", help="print (and with --page or --svg, write) the figures of an earlier run"
    )
    parser.add_argument("--litdata-worker", help=argparse.SUPPRESS)
    parser.add_argument("--peer-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.litdata_worker:
        litdata_worker(*args.litdata_worker.split(","))
        return
    if args.peer_worker:
        import warnings

        warnings.simplefilter("ignore")
        peer_worker(*args.peer_worker.split(","))
        return
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        print(f"--cache {saved.get('_cache', 'as-is')}: {CACHE_NOTE[saved.get('_cache', 'as-is')]}")
        print(render(saved))
        if args.svg:
            svg({k: v for k, v in saved.items() if not k.startswith("_")}, args.svg)
        if args.page:
            page(saved, saved.get("_command", "bench/.venv/bin/python bench/bench_peers.py"))
        return
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"--rows: no row {', '.join(unknown)} (choose from {', '.join(ROWS)})")
    import warnings

    warnings.simplefilter("ignore")
    sys.path.insert(0, HERE)
    import common

    common.peer()
    if not os.path.exists(LITDATA_PYTHON):
        print(f"note: LitData is not installed in {LITDATA_PYTHON}: its column stays empty (see --help)")
    results = {}
    for row in rows:
        shards(DATA[row])  # made here once, before the processes that read them
        best: dict = {}
        digests: dict = {}
        kinds: dict = {}
        cpus: dict = {}
        for _ in range(args.repeat):
            ours_only = row in ("views", "loader-views")
            peers = ["wds_cloud", "readinto" if row == "large" else "webdataset"] if not ours_only else ["wds_cloud"]
            for peer in peers:
                got = fresh(peer, row, args.cache)
                if got is None:  # a wds_cloud without zero_copy: the row says n/a
                    best.setdefault(peer, None)
                    continue
                rate, digest, cpu = got
                best[peer] = max(best.get(peer) or 0.0, rate)
                digests.setdefault(peer, digest)
                if cpu is not None and row in LOADERS:
                    cpus[peer] = min(cpus.get(peer, cpu), cpu)
            got = litdata(row, args.cache)
            if got is not None:
                rate, digest, kind, cpu = got
                best["LitData"] = max(best.get("LitData", 0.0), rate)
                digests.setdefault("LitData", digest)
                kinds["LitData"] = kind
                if cpu is not None and row in LOADERS:
                    cpus["LitData"] = min(cpus.get("LitData", cpu), cpu)
        if len(set(digests.values())) > 1:
            raise SystemExit(f"{row}: the peers delivered different bytes: {digests}")
        results[row] = {"rates": best, "digest": next(iter(digests.values())), "litdata_type": kinds.get("LitData")}
        if cpus:
            results[row]["main_cpu_us"] = cpus
        print(
            f"{row}: "
            + ", ".join(f"{p} {_rate(r)}" + ("/s" if r is not None else "") for p, r in best.items())
            + (
                "; main-process CPU per sample: " + ", ".join(f"{p} {c:.1f} us" for p, c in cpus.items())
                if cpus
                else ""
            ),
            flush=True,
        )
    print()
    print(f"--cache {args.cache}: {CACHE_NOTE[args.cache]}")
    print(render(results))
    command = " ".join(["bench/.venv/bin/python bench/bench_peers.py"] + sys.argv[1:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "_command": command, "_cache": args.cache}, f, indent=1)
    if args.svg:
        svg(results, args.svg)
        print(f"wrote {args.svg}")
    if args.page:
        page({**results, "_cache": args.cache}, command)


def _rate(rate) -> str:
    return "n/a" if rate is None else f"{rate:,.0f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def render(results: dict) -> str:
    """The table, in Markdown."""
    lines = [
        "| workload | webdataset | wds_cloud | LitData | wds_cloud / LitData | wds_cloud / webdataset |",
        "|---|---|---|---|---|---|",
    ]
    for row, result in results.items():
        if row.startswith("_"):
            continue
        rates = result["rates"]
        ours_rate = rates.get("wds_cloud", 0.0)
        if row == "large":
            base = rates.get("readinto", 0.0)
            lines.append(
                f"| {TITLES[row]} | readinto: {base:,.0f} | {ours_rate:,.0f} | - | - | {_ratio(ours_rate, base)} of readinto |"
            )
            continue
        cells = [rates.get(p, 0.0) for p in ("webdataset", "wds_cloud", "LitData")]
        shown = [_rate(c) if c is None or c else "-" for c in cells]
        lines.append(
            f"| {TITLES[row]} | {shown[0]} | {shown[1]} | {shown[2]} | {_ratio(ours_rate, rates.get('LitData'))} "
            f"| {_ratio(ours_rate, rates.get('webdataset'))} |"
        )
    cpu_rows = [(row, r["main_cpu_us"]) for row, r in results.items() if not row.startswith("_") and "main_cpu_us" in r]
    if cpu_rows:
        lines += [
            "",
            "Main-process CPU per sample received (microseconds; the DataLoader workers' CPU not counted; lower is "
            "better):",
            "",
            "| workload | webdataset | wds_cloud | LitData | wds_cloud / webdataset |",
            "|---|---|---|---|---|",
        ]
        for row, cpu in cpu_rows:
            cells = [f"{cpu[p]:.1f}" if p in cpu else "-" for p in ("webdataset", "wds_cloud", "LitData")]
            share = f"{cpu['wds_cloud'] / cpu['webdataset']:.2f}" if "wds_cloud" in cpu and "webdataset" in cpu else "-"
            lines.append(f"| {TITLES[row]} | {cells[0]} | {cells[1]} | {cells[2]} | {share} |")
    return "\n".join(lines)


def svg(results: dict, path: str) -> None:
    """Bars of samples/s per workload and reader, each workload scaled to its fastest reader."""
    peers = ("webdataset", "wds_cloud", "LitData")
    colors = {"webdataset": "#999999", "wds_cloud": "#1f77b4", "LitData": "#ff7f0e"}
    rows = [r for r in results if r != "large" and not r.startswith("_")]
    width, row_height, left = 640, 70, 250
    height = 40 + row_height * len(rows)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for k, peer in enumerate(peers):
        out.append(f'<rect x="{left + 120 * k}" y="8" width="10" height="10" fill="{colors[peer]}"/>')
        out.append(f'<text x="{left + 14 + 120 * k}" y="17">{peer}</text>')
    for i, row in enumerate(rows):
        rates = results[row]["rates"]
        top = max((r or 0.0 for r in rates.values()), default=0.0)
        y = 30 + i * row_height
        out.append(f'<text x="4" y="{y + 30}">{TITLES[row].replace("local, ", "")}</text>')
        for k, peer in enumerate(peers):
            rate = rates.get(peer) or 0.0
            bar = (width - left - 90) * (rate / top if top else 0)
            out.append(f'<rect x="{left}" y="{y + 4 + 20 * k}" width="{bar:.1f}" height="16" fill="{colors[peer]}"/>')
            label = f"{rate:,.0f}/s" if rate else "-"
            out.append(f'<text x="{left + bar + 4:.1f}" y="{y + 16 + 20 * k}">{label}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def page(results: dict, command: str) -> None:
    """The table and figure in docs/performance.md, between its markers (the rest of the page is figures.py's)."""
    svg({k: v for k, v in results.items() if not k.startswith("_")}, os.path.join(ROOT, "docs", "img", "peers.svg"))
    sys.path.insert(0, HERE)
    import figures

    note = ""
    kind = next((r["litdata_type"] for r in results.values() if isinstance(r, dict) and r.get("litdata_type")), None)
    if kind:
        note = f" LitData's raw bytes fields come out as `{kind}`."
    shown = {k: v for k, v in results.items() if not k.startswith("_")}
    cache = CACHE_NOTE[results.get("_cache", "as-is")]  # runs written before --cache left the page cache as it was
    section = peers_section(render(shown), f"{cache} {figures.machine()}; `{command}`.{note}")
    with open(PAGE) as f:
        text = f.read()
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {PAGE} and docs/img/peers.svg")


def peers_section(table: str, where: str) -> str:
    return "\n".join(
        [
            BEGIN,
            "## Local disk: wds_cloud, webdataset 1.0.2 and LitData",
            "",
            "![samples/s on local disk, wds_cloud, webdataset and LitData](img/peers.svg)",
            "",
            table,
            "",
            "*The same shards for every reader (LitData: its `optimize`d chunks of them), best of the rounds, "
            "each reader in a fresh process after one untimed epoch, alternating; every reader's bytes checked against the others'. "
            f"Written by `bench/bench_peers.py` (see `bench/README.md`). {where}*",
            END,
        ]
    )


if __name__ == "__main__":
    main()
