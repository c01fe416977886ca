"""Growth benchmark: each cost of a job at cluster size, at sizes spaced by 10x, each size in a fresh process.

A test runs at the size of a test; our users run at cluster size (10^5-10^7 shards, 4,096 ranks x 8 workers,
10^4 shards in a node's cache, 10^5-10^6 outputs of a tool job: docs/performance.md, "Scale").  This script runs
each row below at three or more sizes, every cell in its own child process (``--child ROW SIZE``, the same
file), and prints the figures with the slope of log(cost) on log(size): about 1 is linear, 2 quadratic, 0 a
cost that does not grow (a bound).  A cell that runs past its row's timeout prints ``> T s`` and the larger
sizes of that row are skipped; a size the code refuses prints ``refused``.

The rows use the public API (``import wds_cloud as wds``, the ``wds-cloud`` command); where one must reach
into a module, it does so in one small function named for it (``_job_record``, ``_tables_held``,
``_worker``).  Which ``wds_cloud`` is measured is the one Python imports: run it with
``PYTHONPATH=/path/to/another/tree`` to measure another tree (the header names the one imported).

Inputs are made once under ``--data`` (``bench/_data/scale``) and reused: tiny shards of one sample, one
shard of many members, shards of 1,000 samples, and simulated loader states (made by the code measured the
first time, then read by every later run, as a checkpoint would be).

    python bench/bench_scale.py                       # every row, default sizes
    python bench/bench_scale.py --rows rerun,cache-miss --sizes 10,100,1000
    python bench/bench_scale.py --quick               # small sizes: a smoke test (a few minutes on 2 cores)
    python bench/bench_scale.py --json bench/_data/scale-after.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import math
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "_data", "scale")
#: a member table is kept only for a file neither modified nor changed in the last 5 s (tar/table.py's
#: SETTLED): inputs of the table rows wait that long after they are written
SETTLED = 5.5
TINY_SAMPLE = {"txt": b"x"}


# inputs -------------------------------------------------------------------------------------------------
def _settle(paths: list[str]) -> None:
    """Wait until the newest of ``paths`` changed more than SETTLED seconds ago (its ctime cannot be set back)."""
    newest = max((os.stat(p).st_ctime for p in paths[-1:] + paths[:1]), default=0.0)
    wait = newest + SETTLED - time.time()
    if wait > 0:
        time.sleep(wait)


def tiny_shards(data: str, count: int) -> list[str]:
    """Paths of ``count`` shards of one tiny sample each, written once under ``data/tiny``."""
    import wds_cloud as wds

    folder = os.path.join(data, "tiny")
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"t-{i:06d}.tar") for i in range(count)]
    for i, path in enumerate(paths):
        if not os.path.exists(path):
            with wds.TarWriter(path + ".tmp") as sink:
                sink.write({"__key__": f"s{i:06d}", **TINY_SAMPLE})
            os.replace(path + ".tmp", path)
    _settle(paths)
    return paths


def big_shard(data: str, members: int) -> str:
    """One shard of ``members`` one-member samples (written once)."""
    import wds_cloud as wds

    path = os.path.join(data, f"members-{members}.tar")
    if not os.path.exists(path):
        with wds.TarWriter(path + ".tmp") as sink:
            for i in range(members):
                sink.write({"__key__": f"m{i:07d}", **TINY_SAMPLE})
        os.replace(path + ".tmp", path)
    _settle([path])
    return path


def thousand_shards(data: str, samples: int) -> list[dict]:
    """``{"url", "nsamples"}`` of shards of 1,000 samples (fewer if ``samples`` is smaller) holding ``samples``."""
    import wds_cloud as wds

    folder = os.path.join(data, "thousand")
    os.makedirs(folder, exist_ok=True)
    per = min(samples, 1000)
    rows = []
    for i in range(max(1, samples // per)):
        path = os.path.join(folder, f"k{per}-{i:05d}.tar")
        if not os.path.exists(path):
            with wds.TarWriter(path + ".tmp") as sink:
                for j in range(per):
                    sink.write({"__key__": f"k{i:05d}_{j:05d}", **TINY_SAMPLE})
            os.replace(path + ".tmp", path)
        rows.append({"url": path, "nsamples": per})
    return rows


def _tree_tag() -> str:
    """A short name for the tree measured, so that outputs one tree wrote are not taken for another's."""
    import hashlib

    import wds_cloud

    return hashlib.sha256(os.path.dirname(wds_cloud.__file__).encode()).hexdigest()[:8]


@contextlib.contextmanager
def _quiet():
    """The CLI prints its summary to stdout, which carries this script's protocol: captured."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        yield out


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn's result, seconds), untraced: tracemalloc slows allocation-heavy code several times over."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _measure_memory(fn: Callable[[], Any]) -> tuple[Any, float, int, int]:
    """(fn's result, seconds, bytes traced at the end above the start, peak bytes traced above the start)."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, seconds, current - base, peak - base


# the rows: each a prepare(size, data) that returns the measurement, run after the parent is told READY ------
def _reshard_job(data: str, n: int) -> tuple[list[str], str, list[str]]:
    """A finished ``wds-cloud reshard`` of n one-sample inputs into n outputs: (argv, destination, inputs)."""
    from wds_cloud.cli import main as cli

    inputs = tiny_shards(data, n)
    folder = os.path.join(data, f"reshard-{_tree_tag()}-{n}")
    dest = os.path.join(folder, "out-%06d.tar")
    argv = ["reshard", "--json", *inputs, dest, "--maxcount", "1"]
    if not os.path.exists(os.path.join(folder, "done")):
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        with _quiet():
            code = cli(argv)
        if code != 0:
            raise SystemExit(f"the first reshard of {n} inputs exited {code}")
        open(os.path.join(folder, "done"), "w").close()
    return argv, dest, inputs


def row_rerun(n: int, data: str) -> Callable[[], dict]:
    from wds_cloud.cli import main as cli

    argv, _, _ = _reshard_job(data, n)

    def measure() -> dict:
        start = time.perf_counter()
        with _quiet() as out:
            code = cli(argv)
        seconds = time.perf_counter() - start
        text = out.getvalue()
        summary = json.loads(text[text.index("{") :])
        if code != 0 or summary.get("written") != 0:
            raise SystemExit(f"the rerun was not a rerun with nothing to do: exit {code}, {summary}")
        return {"seconds": seconds}

    return measure


def _job_record(dest: str, inputs: list[str]) -> Callable[[], Any]:
    """Load (and release) the record the reshard CLI keeps at ``dest``, as its rerun does before any input."""
    from wds_cloud.cli import build_parser
    from wds_cloud.jobs.record import JobRecord

    args = build_parser().parse_args(["reshard", *inputs[:1], dest, "--maxcount", "1"])
    settings = {"maxcount": args.maxcount, "maxsize": args.maxsize, "compress": args.compress}

    def load() -> Any:
        record = JobRecord(dest, "reshard", inputs, settings)
        record.release()
        return record

    return load


def row_record_load(n: int, data: str) -> Callable[[], dict]:
    _, dest, inputs = _reshard_job(data, n)
    load = _job_record(dest, inputs)

    def measure() -> dict:
        record, seconds = _timed(load)
        _, _, _, peak = _measure_memory(load)
        if not record.found:
            raise SystemExit(f"no job record found at {dest}")
        return {"seconds": seconds, "peak_bytes": peak}

    return measure


def _drain(stream: Any) -> int:
    n = 0
    with contextlib.closing(stream):
        while True:
            chunk = stream.read(1 << 16)
            if not chunk:
                return n
            n += len(chunk)


def row_cache_miss(n: int, data: str) -> Callable[[], dict]:
    import wds_cloud as wds

    misses = 20
    urls = tiny_shards(data, n + misses + 1)
    folder = os.path.join(data, f"cache-{_tree_tag()}-{n}")
    shutil.rmtree(folder, ignore_errors=True)
    fill = wds.cache.FileCache(folder, cache_local=True)  # unbounded: filling evicts nothing
    total = sum(_drain(fill.open(url)["stream"]) for url in urls[:n])
    bounded = wds.cache.FileCache(folder, cache_local=True, cache_size=total)  # full: each miss evicts one

    def measure() -> dict:
        times = []
        for url in urls[n:]:
            start = time.perf_counter()
            _drain(bounded.open(url)["stream"])
            times.append(time.perf_counter() - start)
        return {
            "seconds": statistics.median(times[1:]),
            "first_s": times[0],
            "entries": len([name for name in os.listdir(folder) if name.endswith(".tar")]),
        }

    return measure


def _tables_held() -> Optional[int]:
    """How many member tables this process keeps (None if the module no longer says)."""
    try:
        from wds_cloud.tar import table
    except ImportError:
        return None
    return table.held()[0] if hasattr(table, "held") else None


def _first_pass(urls: list[str]) -> int:
    import wds_cloud as wds

    return sum(1 for _ in wds.WebDataset(urls, shardshuffle=False, empty_check=False))


def row_tables_first_pass(n: int, data: str) -> Callable[[], dict]:
    urls = tiny_shards(data, n)

    def measure() -> dict:
        start = time.perf_counter()
        samples = _first_pass(urls)
        return {"seconds": time.perf_counter() - start, "samples": samples, "tables": _tables_held()}

    return measure


def _traced_under(snapshot: Any, folder: str) -> int:
    """Bytes alive in ``snapshot`` allocated by code under ``folder``."""
    return sum(s.size for s in snapshot.statistics("filename") if s.traceback[0].filename.startswith(folder))


def row_tables_bookkeeping(n: int, data: str) -> Callable[[], dict]:
    import wds_cloud

    urls = tiny_shards(data, n)
    tar_folder = os.path.join(os.path.dirname(wds_cloud.__file__), "tar") + os.sep

    def measure() -> dict:
        tracemalloc.start()
        start = time.perf_counter()
        _first_pass(urls)
        seconds = time.perf_counter() - start
        alive = _traced_under(tracemalloc.take_snapshot(), tar_folder)
        tracemalloc.stop()
        return {"tar_bytes": alive, "seconds": seconds, "tables": _tables_held()}

    return measure


def row_tables_one_shard(m: int, data: str) -> Callable[[], dict]:
    path = big_shard(data, m)

    def measure() -> dict:
        samples, seconds, _, peak = _measure_memory(lambda: _first_pass([path]))
        return {"peak_bytes": peak, "seconds": seconds, "samples": samples, "tables": _tables_held()}

    return measure


# simulated ranks and workers
@contextlib.contextmanager
def _worker(rank: int, world_size: int, worker: int, num_workers: int):
    """This process acts as DataLoader worker ``worker`` of ``num_workers`` on rank ``rank`` of ``world_size``:
    torchrun's variables, and torch's worker info answered for the worker."""
    import torch.utils.data

    class Info:
        id, seed, dataset = worker, 0, None

    Info.num_workers = num_workers
    saved = torch.utils.data.get_worker_info, {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    torch.utils.data.get_worker_info = lambda: Info
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.pop("LOCAL_RANK", None)
    try:
        yield
    finally:
        torch.utils.data.get_worker_info = saved[0]
        for key, value in saved[1].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _job_shards(data: str, count: int) -> list[str]:
    """``count`` shard names, each a link to one shard of 256 tiny samples (the states need many shards, not
    many bytes)."""
    import wds_cloud as wds

    folder = os.path.join(data, "links")
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(data, "links-target.tar")
    if not os.path.exists(target):
        with wds.TarWriter(target + ".tmp") as sink:
            for i in range(256):
                sink.write({"__key__": f"b{i:05d}", **TINY_SAMPLE})
        os.replace(target + ".tmp", target)
    paths = [os.path.join(folder, f"l-{i:06d}.tar") for i in range(count)]
    for path in paths:
        if not os.path.lexists(path):
            os.symlink(target, path)
    return paths


def _job_dataset(urls: list[str], bufsize: int) -> Any:
    import wds_cloud as wds

    return wds.WebDataset(urls, shardshuffle=True, seed=1, nodesplitter=wds.split_by_node).shuffle(bufsize)


def _job_states(data: str, ranks: int, workers: int, bufsize: int) -> tuple[list[str], list[dict]]:
    """The dataset state of every worker of every rank, each having delivered one sample with ``bufsize``
    buffered; made once (one shard per worker) and saved as a checkpoint would be."""
    urls = _job_shards(data, ranks * workers)
    path = os.path.join(data, f"states-{ranks}x{workers}-b{bufsize}.json")
    if os.path.exists(path):
        with open(path) as f:
            return urls, json.load(f)
    import copy

    states = []
    recipe = _job_dataset(urls, bufsize)  # copied for each worker: checking the URLs again costs O(shards)
    for r in range(ranks):
        for w in range(workers):
            with _worker(r, ranks, w, workers):
                dataset = copy.deepcopy(recipe)
                next(iter(dataset))
                states.append(dataset.state_dict())
    with open(path + ".tmp", "w") as f:
        json.dump(states, f)
    os.replace(path + ".tmp", path)
    return urls, states


def row_elastic_load(ranks: int, data: str) -> Callable[[], dict]:
    import wds_cloud as wds

    workers = 8
    urls, states = _job_states(data, ranks, workers, 10)
    merged = wds.merge_states(states)
    del states

    def measure() -> dict:
        with _worker(0, ranks, 0, workers):
            dataset = _job_dataset(urls, 10)
            start = time.perf_counter()
            dataset.load_state_dict(merged)
            next(iter(dataset))
            return {"seconds": time.perf_counter() - start}

    return measure


def row_gather_merge(ranks: int, data: str) -> Callable[[], dict]:
    import wds_cloud as wds

    _, states = _job_states(data, ranks, 1, 100)

    def measure() -> dict:
        _, seconds = _timed(lambda: wds.merge_states(states))
        _, _, _, peak = _measure_memory(lambda: wds.merge_states(states))
        return {"seconds": seconds, "peak_bytes": peak}

    return measure


def row_index_memory(samples: int, data: str) -> Callable[[], dict]:
    import wds_cloud as wds

    shards = thousand_shards(data, samples)

    def load_all() -> Any:
        dataset = wds.ShardListDataset(shards, transformations=[])
        at = 0
        for shard in shards:  # one sample of each shard loads its index
            dataset[at]
            at += shard["nsamples"]
        return dataset

    def measure() -> dict:
        dataset, seconds, alive, _ = _measure_memory(load_all)
        del dataset
        return {"index_bytes": alive, "bytes_per_sample": alive / samples, "seconds": seconds}

    return measure


def row_datafile_size(n: int, data: str) -> Callable[[], dict]:
    import wds_cloud as wds

    path = os.path.join(data, f"description-{n}.json")
    if not os.path.exists(path):
        rows = [{"url": f"shards/d-{i:07d}.tar", "nsamples": 100, "filesize": 1024 * 101} for i in range(n)]
        with open(path + ".tmp", "w") as f:
            json.dump({"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": rows}, f)
        os.replace(path + ".tmp", path)

    def measure() -> dict:
        dataset, seconds = _timed(lambda: wds.ShardListDataset(path, transformations=[]))
        _, _, _, peak = _measure_memory(lambda: wds.ShardListDataset(path, transformations=[]))
        if len(dataset) != 100 * n:
            raise SystemExit(f"the description of {n} shards gave {len(dataset)} samples")
        return {"seconds": seconds, "peak_bytes": peak, "file_bytes": os.path.getsize(path)}

    return measure


def row_shardlist_memory(n: int, data: str) -> Callable[[], dict]:
    import wds_cloud as wds

    spec = f"shards/s-{{{0:08d}..{n - 1:08d}}}.tar"  # never opened: only the list is made

    def worker_list(most: Optional[int] = None) -> int:
        with _worker(0, 1, 0, 8):
            pipeline = wds.DataPipeline(wds.SimpleShardList(spec, seed=1), wds.split_by_worker)
            return sum(1 for _ in itertools.islice(pipeline, most))

    def measure() -> dict:
        count, seconds = _timed(worker_list)  # the whole epoch of the worker, untraced
        if count != len(range(0, n, 8)):
            raise SystemExit(f"worker 0 of 8 got {count} of {n} shards")
        # traced: the list made and its first 10^5 URLs walked (tracing every URL of 10^7 takes many minutes);
        # a list made whole at the start has its peak there
        _, _, _, peak = _measure_memory(lambda: worker_list(100_000))
        return {"peak_bytes": peak, "bytes_per_url": peak / count, "seconds": seconds}

    return measure


def _rings_mapped() -> int:
    """Bytes of worker rings this process maps (wds_cloud.loader.frames: the default batch transport)."""
    from wds_cloud.loader import unframe

    return sum(ring.size for ring in unframe.RINGS.values())


def row_loader_rings(workers: int, data: str) -> Callable[[], dict]:
    import wds_cloud as wds

    urls = tiny_shards(data, workers)

    def measure() -> dict:
        # one shard of one 20 kB sample per worker, batches of one: every worker sends a batch, and a ring
        dataset = wds.WebDataset(urls, shardshuffle=False).map(lambda s: (s["__key__"], os.urandom(20_000)))
        loader = wds.WebLoader(dataset.batched(1), batch_size=None, num_workers=workers)
        before = _rings_mapped()
        got, seconds = _timed(lambda: sum(1 for _ in loader))
        if got != workers:
            raise SystemExit(f"{workers} workers sent {got} batches")
        mapped = _rings_mapped() - before
        return {"ring_bytes": mapped, "bytes_per_worker": mapped / workers, "seconds": seconds}

    return measure


# the table of rows --------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    explain: str
    prepare: Callable[[int, str], Callable[[], dict]]
    sizes: list[int]
    quick: list[int]
    #: the figures printed, each with its slope; the first is the row's cost
    metrics: list[str]
    timeout: float = 60.0
    #: the time a child may take to make its inputs before it measures (once; they are kept under --data)
    prepare_timeout: float = 900.0
    env: dict = field(default_factory=dict)


ROWS = [
    Row(
        "rerun",
        "a `wds-cloud reshard` rerun with nothing to do, N one-sample inputs into N outputs (--maxcount 1)",
        row_rerun,
        [10, 100, 1000, 10000],
        [3, 30, 300],
        ["seconds"],
        timeout=240,
    ),
    Row(
        "record-load",
        "loading that reshard's job record (JobRecord) at N outputs, as its rerun does first",
        row_record_load,
        [10, 100, 1000, 10000],
        [3, 30, 300],
        ["seconds", "peak_bytes"],
        timeout=240,
    ),
    Row(
        "cache-miss",
        "one miss of a full size-bounded ShardCache (FileCache, cache_local=True) holding N "
        "entries, which evicts one: the median of 19 misses after the first",
        row_cache_miss,
        [100, 1000, 10000],
        [10, 100, 1000],
        ["seconds", "first_s"],
    ),
    Row(
        "tables-first-pass",
        "first pass over N one-sample local shards, member tables on (default bound)",
        row_tables_first_pass,
        [100, 1000, 10000, 100000],
        [10, 100, 1000],
        ["seconds"],
    ),
    Row(
        "tables-first-pass-off",
        "the same pass with tables off (WDS_TABLE_CACHE=0)",
        row_tables_first_pass,
        [100, 1000, 10000, 100000],
        [10, 100, 1000],
        ["seconds"],
        env={"WDS_TABLE_CACHE": "0"},
    ),
    Row(
        "tables-bookkeeping",
        "bytes alive, allocated by wds_cloud/tar/, after a first pass over N one-sample "
        "shards with WDS_TABLE_CACHE=64KiB (tables and what is kept beside them; tracemalloc)",
        row_tables_bookkeeping,
        [1000, 10000, 100000],
        [10, 100, 1000],
        ["tar_bytes"],
        timeout=400,
        env={"WDS_TABLE_CACHE": "64KiB"},
    ),
    Row(
        "tables-one-shard",
        "peak traced memory of a first pass over one shard of M one-member samples, WDS_TABLE_CACHE=1MiB",
        row_tables_one_shard,
        [1000, 10000, 100000, 1000000],
        [100, 1000, 10000],
        ["peak_bytes", "seconds"],
        timeout=300,
        env={"WDS_TABLE_CACHE": "1MiB"},
    ),
    Row(
        "elastic-load",
        "load_state_dict of a merged state + the first sample, worker 0 of 8 on rank 0 of R "
        "(states of R x 8 workers, shuffle(10), one shard per worker, simulated in one process)",
        row_elastic_load,
        [8, 64, 512],
        [2, 4, 8],
        ["seconds"],
        timeout=300,
        prepare_timeout=2400,
    ),
    Row(
        "gather-merge",
        "merge_states of R rank states, 100 samples buffered each (what every rank merged at state_dict(gather=True) before; now rank 0 alone, once)",
        row_gather_merge,
        [64, 512, 4096],
        [4, 16, 64],
        ["seconds", "peak_bytes"],
        timeout=300,
        prepare_timeout=2400,
    ),
    Row(
        "index-memory",
        "bytes per sample traced after a ShardListDataset loaded the index of every shard "
        "(N samples in shards of 1,000)",
        row_index_memory,
        [1000, 10000, 100000, 1000000],
        [100, 1000, 10000],
        ["index_bytes", "bytes_per_sample", "seconds"],
        timeout=400,
    ),
    Row(
        "datafile-size",
        "reading a wids description (JSON) of N shards: ShardListDataset(path); refused past WDS_MAX_DATA_FILE_SIZE",
        row_datafile_size,
        [10000, 100000, 1000000],
        [10, 100, 1000],
        ["seconds", "peak_bytes"],
        timeout=300,
    ),
    Row(
        "loader-rings",
        "shared memory the main process maps for W workers' rings (the default batch transport) after an "
        "epoch of W one-sample shards through WebLoader(num_workers=W); seconds: that epoch, workers started",
        row_loader_rings,
        [1, 10, 100],
        [1, 2, 4],
        ["ring_bytes", "bytes_per_worker", "seconds"],
        timeout=300,
    ),
    Row(
        "shardlist-memory",
        "peak traced memory of worker 0 of 8 making its list of a seeded brace spec of N shards and "
        "walking its first 10^5 (SimpleShardList(seed=1) + split_by_worker); seconds: its whole epoch, untraced",
        row_shardlist_memory,
        [100000, 1000000, 10000000],
        [100, 1000, 10000],
        ["peak_bytes", "bytes_per_url"],
        timeout=300,
    ),
]
BY_NAME = {row.name: row for row in ROWS}


# the child ----------------------------------------------------------------------------------------------
def child(name: str, size: int, data: str) -> int:
    """Prepare the cell, say READY, measure, say RESULT <json> (or REFUSED <reason>)."""
    import warnings

    warnings.simplefilter("ignore")
    row = BY_NAME[name]
    os.makedirs(data, exist_ok=True)
    try:
        measure = row.prepare(size, data)
        print("READY", flush=True)
        result = measure()
    except (ValueError, MemoryError, OSError) as exc:  # the library's refusals derive from these builtins
        print("REFUSED " + " ".join(f"{type(exc).__name__}: {exc}".split())[:300], flush=True)
        return 0
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# the parent ---------------------------------------------------------------------------------------------
def _lines(stream: Any, out: queue.Queue) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))
    out.put(None)


def run_cell(row: Row, size: int, data: str) -> dict:
    """One cell in a fresh process: ``{"size", "status": ok|timeout|refused|error, metrics..., "note"}``."""
    env = dict(os.environ, **row.env)
    command = [sys.executable, os.path.abspath(__file__), "--child", row.name, str(size), "--data", data]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    lines: queue.Queue = queue.Queue()
    errors: list = []
    threading.Thread(target=_lines, args=(process.stdout, lines), daemon=True).start()
    threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True).start()
    deadline = time.monotonic() + row.prepare_timeout
    measuring = False
    cell: dict = {"size": size}
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                limit = row.timeout if measuring else row.prepare_timeout
                cell.update(status="timeout", note=f"> {limit:g} s" + ("" if measuring else " making the inputs"))
                return cell
            if line is None:
                process.wait()
                tail = "".join(errors).strip().splitlines()[-1:] or [f"exit {process.returncode}"]
                cell.update(status="error", note=tail[0][:300])
                return cell
            if line == "READY":
                measuring = True
                deadline = time.monotonic() + row.timeout
            elif line.startswith("RESULT "):
                cell.update(status="ok", **json.loads(line[7:]))
                return cell
            elif line.startswith("REFUSED "):
                cell.update(status="refused", note=line[8:])
                return cell
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
        process.wait()


def slope(cells: list[dict], metric: str) -> Optional[float]:
    """Least-squares slope of log(metric) on log(size) over the cells that measured it (two at least)."""
    points = [
        (math.log(c["size"]), math.log(c[metric]))
        for c in cells
        if c.get("status") == "ok" and isinstance(c.get(metric), (int, float)) and c[metric] > 0
    ]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def last_slope(cells: list[dict], metric: str) -> Optional[str]:
    """The slope over the last step measured (the growth where it is largest, fixed costs mattering least), or
    a lower bound ``"> x"`` when the next size ran past its timeout (its cost is at least the timeout)."""
    ok = [c for c in cells if c.get("status") == "ok" and isinstance(c.get(metric), (int, float)) and c[metric] > 0]
    late = [
        c
        for c in cells
        if c.get("status") == "timeout" and "foreseen" not in c.get("note", "") and ok and c["size"] > ok[-1]["size"]
    ]
    if late and metric.endswith(("seconds", "_s")):
        limit = float(late[0]["note"].split()[1])
        bound = math.log(limit / ok[-1][metric]) / math.log(late[0]["size"] / ok[-1]["size"])
        return f"> {bound:.2f}"
    if len(ok) < 2:
        return None
    a, b = ok[-2], ok[-1]
    return f"{math.log(b[metric] / a[metric]) / math.log(b['size'] / a['size']):.2f}"


def _predicted_past(cells: list[dict], row: Row, sizes: list[int]) -> Optional[tuple[int, float]]:
    """(next size, seconds foreseen) when the row's next size would run past its timeout at the slope so far
    (at least linear): a cell known to time out is not run, which would only spend the timeout."""
    done = [c for c in cells if c.get("status") == "ok" and isinstance(c.get("seconds"), (int, float))]
    if "seconds" not in row.metrics or not done:
        return None
    last = done[-1]
    larger = sorted(s for s in sizes if s > last["size"])
    if not larger:
        return None
    grow = max(1.0, slope(done, "seconds") or 1.0)
    foreseen = last["seconds"] * (larger[0] / last["size"]) ** grow
    return (larger[0], foreseen) if foreseen > 2 * row.timeout else None


def show(value: Any, metric: str) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    if metric.endswith("bytes"):
        return f"{value / 1e6:.3g} MB" if value >= 1e5 else f"{value / 1e3:.3g} kB"
    if metric == "bytes_per_sample" or metric == "bytes_per_url":
        return f"{value:.0f} B"
    if metric.endswith("seconds") or metric.endswith("_s"):
        return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"
    return f"{value:g}"


def table(results: dict) -> str:
    lines = ["| row | figure | sizes and figures | slope | slope, last 10x |", "|---|---|---|---|---|"]
    for name, cells in results.items():
        for metric in BY_NAME[name].metrics:
            figures = []
            for c in cells:
                shown = show(c.get(metric), metric) if c["status"] == "ok" else c.get("note", c["status"])
                if c["status"] == "refused":
                    shown = "refused"
                figures.append(f"{c['size']:,}: {shown}")
            s = slope(cells, metric)
            shown_slope = "-" if s is None else f"{s:.2f}"
            lines.append(
                f"| {name} | {metric} | {'; '.join(figures)} | {shown_slope} | {last_slope(cells, metric) or '-'} |"
            )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    epilog = "rows:\n" + "\n".join(
        f"  {row.name:22} {row.explain}\n  {'':22} sizes {row.sizes}, --quick {row.quick}, timeout {row.timeout:g} s"
        for row in ROWS
    )
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", help="comma-separated rows (default: all)")
    parser.add_argument("--sizes", help="comma-separated sizes for every row chosen (default: each row's own)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes: a smoke test (a few minutes on 2 cores, inputs made included)",
    )
    parser.add_argument("--timeout", type=float, help="seconds a cell may measure for (default: each row's own)")
    parser.add_argument("--json", help="also write the figures as JSON to this path")
    parser.add_argument("--data", default=DATA, help=f"where inputs are made and kept (default {DATA})")
    parser.add_argument("--child", nargs=2, metavar=("ROW", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # a parent stopped by SIGTERM still ends the child it is waiting on (run_cell's finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.child:
        return child(args.child[0], int(args.child[1]), args.data)
    names = args.rows.split(",") if args.rows else [row.name for row in ROWS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"--rows: no row {', '.join(unknown)}; the rows are {', '.join(BY_NAME)}")
    try:
        sizes = [int(float(s)) for s in args.sizes.split(",")] if args.sizes else None
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: give whole numbers, comma-separated (10,100,1000)")
    import importlib.util

    spec = importlib.util.find_spec("wds_cloud")  # not imported here: the parent measures nothing
    where = os.path.dirname(spec.origin) if spec is not None and spec.origin else "(wds_cloud not found)"
    print(f"wds_cloud from {where}; inputs under {args.data}", flush=True)
    results: dict = {}
    for name in names:
        row = BY_NAME[name]
        if args.timeout:
            row.timeout = args.timeout
        results[name] = []
        plan = sizes or (row.quick if args.quick else row.sizes)
        for size in plan:
            cell = run_cell(row, size, args.data)
            results[name].append(cell)
            print(f"{name} {size:,}: {json.dumps(cell)}", flush=True)
            if cell["status"] in ("timeout", "error"):
                break  # larger sizes would take longer still
            late = _predicted_past(results[name], row, plan)
            if late:
                results[name].append({"size": late[0], "status": "timeout", "note": f"> {row.timeout:g} s (foreseen)"})
                print(f"{name} {late[0]:,}: skipped, {late[1]:.0f} s foreseen at the slope so far", flush=True)
                break
    print(table(results))
    if args.json:
        out = {
            "wds_cloud": where,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": {
                name: {
                    "explain": BY_NAME[name].explain,
                    "cells": cells,
                    "slopes": {m: slope(cells, m) for m in BY_NAME[name].metrics},
                    "last_slopes": {m: last_slope(cells, m) for m in BY_NAME[name].metrics},
                }
                for name, cells in results.items()
            },
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
