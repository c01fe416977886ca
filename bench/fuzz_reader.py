"""Long fuzzing run of the tar reader: structure-aware mutations, only documented errors allowed.

Each case takes a valid shard, then mutates tar headers with recomputed checksums, inserts PAX
headers with wrong records, or cuts / flips bits in a compressed stream, and reads it.  A case
fails if the reader raises anything but CorruptShardError, takes longer than --limit seconds,
allocates more than 64 MiB, or (for a cut compressed stream) delivers a sample that is not whole.  A plain
tar case is read again four times from a file, mapped: a first pass with views (which keeps the member table if
it reads to the end), then from the table with views, and with bytes through the grouping kernel's general
loop and its keyed loop, and with every member read late (as a large one is, once the sample before it is handed
over): each must give the same samples and the same error as the streamed read.

    python bench/fuzz_reader.py [--cases 20000] [--seed 0] [--limit 10] [--no-mapped]   (from the clone's root)
"""

from __future__ import annotations

import argparse
import bz2
import collections
import gzip
import io
import lzma
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.hostile import bounded, damage, insert_pax, mutate_header, tar_of  # noqa: E402
from wds_cloud import config  # noqa: E402
from wds_cloud.errors import CorruptShardError  # noqa: E402
from wds_cloud.io.open import gopen  # noqa: E402
from wds_cloud.tar import buffers, table  # noqa: E402
from wds_cloud.tar.grouping import SKIP_META, group, member_filter, sample_limit  # noqa: E402
from wds_cloud.tar.members import TarMembers  # noqa: E402
from wds_cloud.tariterators import shard_samples  # noqa: E402


def result_of(out: dict) -> tuple:
    """What a read gave, comparable across readers: the samples (views as bytes, no URL) and the error's text."""
    samples = [
        {k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items() if k != "__url__"}
        for s in out.get("value", ())
    ]
    error = out.get("error")
    return samples, (type(error).__name__, str(error).replace(out.get("url", ""), "URL")) if error else None


#: the mapped reads of a plain case, each compared with the streamed read: (views, the kernel's keyed loop allowed,
#: every member counted large: read by pread once the sample before it was handed over)
MAPPED_READS = (
    (True, True, False),  # first pass (reads the headers, keeps the table), views
    (True, True, False),  # from the table, views: the keyed loop where the names split
    (False, False, False),  # from the table, bytes, the general loop only
    (False, True, False),  # from the table, bytes, the keyed loop
    (False, False, True),  # from the table, bytes, the general loop, each member read late with pread
)


def mapped_reads(path: str, data: bytes, seconds: float) -> list:
    """Passes over ``data`` written to ``path``, mapped (:data:`MAPPED_READS`): the first reads the headers and keeps
    the member table, the others read from it, with views and bytes, through either loop of the kernel."""
    with open(path, "wb") as f:
        f.write(data)
    table.SETTLED = -1.0  # a file changed in the last seconds keeps no member table: here it does, at once
    large_default = buffers.LARGE
    outs = []
    for views, keyed, large in MAPPED_READS:

        def read():
            members = TarMembers(  # as shard_samples makes it, but over the mapped file
                gopen(path),
                path,
                select=member_filter(SKIP_META, None, None),
                max_member=config.current().max_member_size,
                views=views,
            )
            try:
                members.begin()
                if keyed:
                    return list(shard_samples(path, None, members=members))
                members.max_sample = sample_limit(None, members.max_member)
                buffers.LARGE = 1 if large else large_default
                return list(group(members.runs(False, defer=True), members, path, limit=members.max_sample))
            finally:
                buffers.LARGE = large_default
                members.close()

        out = bounded(read, seconds=seconds)
        out["url"] = path
        outs.append(out)
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=20000, help="cases to read (default 20000)")
    parser.add_argument("--seed", type=int, default=0, help="the random seed of the cases (default 0)")
    parser.add_argument("--limit", type=float, default=10.0, help="seconds one case may take")
    parser.add_argument("--no-mapped", action="store_true", help="do not read plain cases again mapped")
    args = parser.parse_args()
    import tempfile

    scratch = tempfile.mkdtemp(prefix="fuzz-reader-")
    rng = random.Random(args.seed)
    expected = {f"s{i}": {"txt": f"text {i}".encode(), "bin": bytes([i]) * (i * 300)} for i in range(6)}
    valid = tar_of([(k, v) for k, v in expected.items()])
    compressors = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}
    try:
        import zstandard

        compressors["zstd"] = zstandard.ZstdCompressor().compress
    except ImportError:
        pass
    outcomes: collections.Counter = collections.Counter()
    failures = []
    slowest = 0.0
    started = time.perf_counter()
    for case in range(args.cases):
        kind = rng.choice(["header", "header", "pax", "compressed"])
        url, cut = "fuzz.tar", False
        if kind == "header":
            data = valid
            for _ in range(rng.randint(1, 3)):
                data = mutate_header(data, rng)
        elif kind == "pax":
            data = insert_pax(mutate_header(valid, rng) if rng.random() < 0.3 else valid, rng)
        else:
            name = rng.choice(sorted(compressors))
            data, cut = damage(compressors[name](valid), rng)
            url = f"fuzz.tar.{name}"
        t0 = time.perf_counter()
        out = bounded(lambda: list(shard_samples(url, io.BytesIO(data))), seconds=max(args.limit, 60))
        took = time.perf_counter() - t0
        slowest = max(slowest, took)
        error = out.get("error")
        problem = None
        if error is not None and not isinstance(error, CorruptShardError):
            problem = f"undocumented {type(error).__name__}: {error}"
        elif took > args.limit:
            problem = f"took {took:.1f} s"
        elif out["peak"] > 64 << 20:
            problem = f"allocated {out['peak'] >> 20} MiB"
        elif cut and any(
            {k: v for k, v in s.items() if not k.startswith("__")} != expected.get(s["__key__"])
            for s in out.get("value", ())
        ):
            problem = "a sample that is not whole"
        if problem is None and not args.no_mapped and kind != "compressed" and data:
            out["url"] = url
            streamed = result_of(out)
            for n, again in enumerate(mapped_reads(os.path.join(scratch, "fuzz.tar"), data, max(args.limit, 60))):
                if result_of(again) != streamed:
                    views, keyed = MAPPED_READS[n]
                    how = f"{'from the table' if n else 'first pass'}, {'views' if views else 'bytes'}, "
                    problem = f"read mapped ({how}{'keyed' if keyed else 'general'} loop) differs from the stream"
                    break
            table.forget()
        outcomes[(kind, "error" if error is not None else "read")] += 1
        if problem:
            failures.append((case, kind, problem))
        if (case + 1) % 2000 == 0:
            print(
                f"{case + 1} cases, {len(failures)} failures, {time.perf_counter() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"{args.cases} cases (seed {args.seed}) in {time.perf_counter() - started:.0f} s; slowest case "
        f"{slowest * 1000:.1f} ms"
    )
    for (kind, outcome), n in sorted(outcomes.items()):
        print(f"  {kind:10s} {outcome:5s} {n}")
    print(f"failures: {len(failures)}")
    for case, kind, problem in failures[:20]:
        print(f"  case {case} ({kind}): {problem}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
