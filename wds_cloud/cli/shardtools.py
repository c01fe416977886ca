"""The ``wds-cloud`` shard tools: ``ls``, ``cat``, ``stat``, ``index``, ``verify``, ``reshard``.

Every command takes any URL the registry opens (local paths, ``s3://``, ``https://``, ...) and brace
specs (``shard-{0000..0099}.tar``), prints ``--json`` for scripts, shows a progress bar on stderr
when it is a terminal, and exits 0 (done, all good), 1 (a shard could not be read or did not pass
a check: the message names the URL and the fix) or 2 (bad arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import multiprocessing
import os
import queue
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import IO, Any, Optional, Union, cast

from ..errors import ConfigError, CorruptShardError, ShardNotFoundError, WdsCloudError, redact
from ..index.formats import group_members, index_stream
from ..index.sidecar import build_index, index_of, read_index, read_range, wids_description, write_index
from ..io.descriptions import write_description
from ..io.integrity import Hashing
from ..io.manifest import Manifest, load_manifest
from ..io.open import check_schemes, gopen
from ..io.urls import is_local
from ..jobs.record import HashingWriter, JobRecord
from ..shardlists import expand_urls
from . import flags
from .console import EXIT_CODES, EXIT_OK, EXIT_PROBLEM, READ_EXIT_CODES, UsageError, emit, for_cli, progress, shown
from .flags import MAX_PARALLEL, count, output_pattern, scheduler, text
from .listing import is_folder, list_folder

__all__ = ["add_parsers"]


@contextlib.contextmanager
def _cluster(args: argparse.Namespace) -> Iterator[Any]:
    """A Dask client when ``--scheduler`` or ``--workers`` was given (without the extra: MissingExtraError with
    the install line, at once), else None: the tool runs in this machine's processes."""
    if not (getattr(args, "scheduler", None) or getattr(args, "workers", None)):
        yield None
        return
    from ..tools.dask import cluster_client

    manager = cluster_client(args.scheduler, args.workers)
    try:
        client = manager.__enter__()
    except ConfigError as exc:
        if getattr(exc, "field", None) == "scheduler":  # the address typed names no scheduler: a bad argument
            raise UsageError(str(exc)) from None
        raise
    with contextlib.ExitStack() as stack:
        stack.push(manager)
        yield client


def _jobs(args: argparse.Namespace, urls: list[str]) -> int:
    """``--jobs``, or by default 8 for remote shards (waiting on the network) and 1 for local ones (reading
    local headers is CPU work, which threads in one interpreter only slow down; ``index`` spreads local
    shards over one process per core instead)."""
    if args.jobs is not None:
        if args.jobs < 1:
            raise UsageError("--jobs must be at least 1")
        return args.jobs
    return 1 if all(is_local(u) for u in urls) else 8


def _urls(spec: list[str]) -> list[str]:
    urls: list[str] = []
    for item in spec:
        try:
            urls.extend(expand_urls(item))
        except (ValueError, TypeError) as exc:  # unbalanced or huge brace specs
            raise UsageError(
                f"{redact(item)[:200]!r} is not a shard spec ({exc}): give URLs, paths or brace specs"
            ) from None
    if any("\0" in url for url in urls):
        raise UsageError("a shard name holds a NUL character: give URLs, paths or brace specs")
    if any(not url.strip() for url in urls):
        raise UsageError(f"an empty shard name in {' '.join(map(repr, spec))}: give URLs, paths or brace specs")
    if not urls:
        raise UsageError("no shards named: give URLs, paths or brace specs such as 'shard-{0000..0009}.tar'")
    check_schemes(urls)  # an unknown scheme is a bad argument (exit 2), refused before a cluster or a job starts
    return urls


def _cli_failures(summary: dict) -> None:
    """A Dask job's failures as a command line user reads them: advice in flags, not Python arguments."""
    for failure in summary.get("failures", ()):
        failure["error"] = for_cli(str(failure.get("error", "")))


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


# ls
def _ls(args: argparse.Namespace) -> int:
    if is_folder(args.url):  # a folder or a store's prefix: its objects with their sizes, as `aws s3 ls` lists
        list_folder(args.url, args.json)
        return EXIT_OK
    damage: Optional[CorruptShardError] = None
    try:
        samples = build_index(args.url, storage_options=None).samples
    except ShardNotFoundError as exc:
        if is_local(args.url):  # its message names the path looked for
            raise
        raise ShardNotFoundError(f"{exc}; {_look_beside(args.url)}", url=args.url) from None
    except CorruptShardError as exc:  # as `tar tv` does: what lies before the damage is listed, then the error
        if args.json:  # (one JSON document: the error's)
            raise
        samples, damage = _before_damage(args.url), exc
    if args.samples:
        data = [
            {
                "key": s.key,
                "fields": {ext: size for ext, _, size, _ in s.fields},
                "bytes": sum(size for _, _, size, _ in s.fields),
            }
            for s in samples
        ]
        emit(
            args,
            data,
            lambda rows: "\n".join(
                f"{r['key']}  {r['bytes']:>10}  " + " ".join(f"{e}={n}" for e, n in r["fields"].items()) for r in rows
            ),
        )
    else:
        data = [{"name": name, "size": size, "offset": offset} for s in samples for _, offset, size, name in s.fields]
        emit(args, data, lambda rows: "\n".join(f"{r['size']:>10}  {r['name']}" for r in rows))
    if damage is not None:
        raise damage
    return EXIT_OK


def _before_damage(url: str) -> list:
    """The whole samples of a damaged shard that lie before the damage (its last sample read is left out: the
    damage may have cut it short)."""
    read: list = []
    try:
        with gopen(url, "rb") as stream:
            index_stream(stream, url, read=read)
    except (WdsCloudError, OSError):
        pass  # the error the index gave is the one reported
    try:
        samples = group_members(read, None, url)
    except CorruptShardError:  # a repeated field: the index's error says it
        return []
    return samples[:-1]


def _look_beside(url: str) -> str:
    """The fix for a remote shard that is not there: list its folder (or bucket) to check the name."""
    folder = url.rstrip("/").rpartition("/")[0] + "/"
    return f"check the name with `wds-cloud ls {redact(folder)}`"


# cat
def _cat(args: argparse.Namespace) -> int:
    out = sys.stdout.buffer  # bytes, never JSON: cat has no --json (`wds-cloud ls --json` lists a shard)
    if args.key is None:
        if args.field is not None:
            raise UsageError("--field needs --key: name the sample whose field to print")
        with gopen(args.url, "rb") as stream:
            while True:
                chunk = stream.read(1 << 20)
                if not chunk:
                    break
                out.write(chunk)
        return EXIT_OK
    index = index_of(args.url)
    # a key is typed as the shell gives it (its bytes) or as `ls` shows it (bytes not UTF-8 escaped as \\xe9)
    # the key itself first: a key spelled with a backslash in ASCII is never taken for another shown so
    found = [s for s in index.samples if s.key == args.key] or [s for s in index.samples if shown(s.key) == args.key]
    if not found:
        raise ShardNotFoundError(
            f"{redact(args.url)}: no sample with key {args.key!r} ({len(index)} samples; "
            "list them with `wds-cloud ls --samples URL`)",
            url=args.url,
        )
    sample = found[0]
    fields = [f for f in sample.fields if args.field is None or f[0] == args.field]
    fields = fields or [f for f in sample.fields if shown(f[0]) == args.field]
    if not fields:
        raise ShardNotFoundError(
            f"{redact(args.url)}: sample {args.key!r} has no field {args.field!r} (it has "
            f"{', '.join(f[0] for f in sample.fields)})",
            url=args.url,
        )
    if index.compression is not None:
        data = _whole_member_bytes(args.url, {f[3] for f in fields})
        blobs = [(f[3], data[f[3]]) for f in fields]
    else:
        blobs = [(name, read_range(index, args.url, offset, offset + size)) for _, offset, size, name in fields]
    if args.field is not None:
        out.write(blobs[0][1])
        return EXIT_OK
    from ..writer import TarWriter

    buffer = io.BytesIO()
    with TarWriter(buffer, encoder=False) as writer:
        for name, blob in blobs:
            writer.write({"__key__": sample.key, name[len(sample.key) + 1 :]: blob})
    out.write(buffer.getvalue())
    return EXIT_OK


def _whole_member_bytes(url: str, names: set) -> dict:
    got: dict = {}

    def keep(name: str, data: bytes) -> None:
        if name in names:
            got[name] = bytes(data)

    with gopen(url, "rb") as stream:
        index_stream(stream, url, on_member=keep)
    return got


# stat
def _stat_one(url: str) -> dict:
    index = build_index(url)
    fields: dict = {}
    for sample in index.samples:
        for ext, _, size, _ in sample.fields:
            entry = fields.setdefault(ext, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += size
    try:
        read_index(url, shard_url=url)
        indexed = True
    except ShardNotFoundError:
        indexed = False
    return {
        "url": redact(url),
        "samples": len(index),
        "size": index.size,
        "compression": index.compression,
        "fields": fields,
        "index": indexed,
    }


def _row_or_error(one: Any, url: str, *args: Any) -> Any:
    """``one(url, *args)``: one shard's row, or the error that kept it from being read (reported beside the others'
    rows)."""
    try:
        return one(url, *args)
    except (OSError, ValueError) as error:  # ours are rooted in these: a missing, unreadable or damaged shard
        return error


def _stat(args: argparse.Namespace) -> int:
    urls = _urls(args.spec)
    with ThreadPoolExecutor(max_workers=_jobs(args, urls)) as pool:
        results = list(progress(pool.map(_row_or_error, [_stat_one] * len(urls), urls), len(urls), "stat"))
    errors = [(url, r) for url, r in zip(urls, results) if isinstance(r, BaseException)]
    if errors and len(urls) == 1:
        raise errors[0][1]  # one shard named: its error is the command's, as before
    rows = [r for r in results if not isinstance(r, BaseException)]
    failed = [{"url": redact(url), "error": for_cli(str(error))} for url, error in errors]
    total = {
        "shards": len(rows),
        "samples": sum(r["samples"] for r in rows),
        "bytes": sum(r["size"] or 0 for r in rows),
        "shards_indexed": sum(r["index"] for r in rows),
        "failed": len(failed),
    }

    def text(data: dict) -> str:
        lines = []
        for r in data["shards"]:
            lines.append(
                f"{r['url']}: {r['samples']} samples, {r['size']} bytes, "
                f"{r['compression'] or 'uncompressed'}, index {'present' if r['index'] else 'absent'}"
            )
            for ext, f in sorted(r["fields"].items()):
                lines.append(f"  {ext:<12} {f['count']:>8} fields {f['bytes']:>14} bytes")
        for f in data["failed"]:
            lines.append(f"{f['url']}: could not be read: {f['error']}")
        t = data["total"]
        lines.append(
            f"total: {t['shards']} shards, {t['samples']} samples, {t['bytes']} bytes, {t['shards_indexed']} indexed"
            + (f"; {t['failed']} could not be read" if t["failed"] else "")
        )
        return "\n".join(lines)

    result: dict = {"shards": rows, "failed": failed, "total": total}
    if failed:  # the shape every command's --json takes when it fails
        result = {"ok": False, "error": f"{len(failed)} of {len(urls)} shards could not be read", **result}
    emit(args, result, text)
    return EXIT_PROBLEM if failed else EXIT_OK


# index
def _index_one(url: str, output: Optional[str], fmt: Optional[str]) -> dict:
    """Index one shard and write its index (``fmt`` None: only the row of a wids description); in a worker
    thread or process."""
    index = build_index(url)
    row = {"url": url, "nsamples": len(index), "filesize": index.size}
    if fmt is not None:
        row["index"] = write_index(index, output, fmt)
    return row


def _index(args: argparse.Namespace) -> int:
    urls = _urls(args.spec)
    if args.name is not None and args.format != "wids":  # ignored silently, it would look as if it named the index
        raise UsageError(
            "--name is the dataset's name in a wids description: give it with --format wids, or leave it out"
        )
    if args.format == "wids" and not args.output:
        raise UsageError("--format wids writes one dataset description: give its URL or path with --output")
    if args.output and args.format != "wids" and len(urls) > 1:
        raise UsageError(
            "--output names one index file: with several shards, leave it out (each index is written beside its shard)"
        )

    record = None
    if args.output:  # an index file or description the tool owns: never over an input or a stranger's file
        record = JobRecord(args.output, "index", urls, {"format": args.format, "name": args.name})
        if record.keep(args.output):  # written by this same job and unchanged since: kept, as every job keeps
            record.release()
            emit(
                args,
                [{"url": redact(u), "kept": True} for u in urls],
                lambda rs: (
                    f"nothing to do: {redact(args.output)} is already complete (this job wrote it and it is "
                    f"unchanged); kept it (the index of {_plural(len(rs), 'shard')})"
                ),
            )
            return EXIT_OK
        record.begin()
    jobs = _jobs(args, urls)
    local = all(is_local(u) for u in urls)
    if args.jobs is None and local:  # headers only: CPU work, spread over processes where fork makes them cheap
        jobs = min(os.cpu_count() or 1, len(urls))
    output = args.output if args.format != "wids" else None
    fmt = args.format if args.format != "wids" else None
    fork = multiprocessing.get_all_start_methods()[0] == "fork" if local and jobs > 1 else False
    with _cluster(args) as client:
        pool: Executor = (
            client.get_executor()
            if client is not None
            else ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork"))
            if fork
            else ThreadPoolExecutor(max_workers=jobs)
        )
        with pool:
            results = list(
                progress(
                    pool.map(_row_or_error, [_index_one] * len(urls), urls, [output] * len(urls), [fmt] * len(urls)),
                    len(urls),
                    "index",
                )
            )
    errors = [(url, r) for url, r in zip(urls, results) if isinstance(r, BaseException)]
    if errors and (len(urls) == 1 or args.format == "wids"):
        raise errors[0][1]  # one shard named, or one description of them all: its error is the command's
    rows = [r for r in results if not isinstance(r, BaseException)]
    if errors:  # each shard's own index: those written are said, and those that could not be read
        failed = [{"url": redact(url), "error": for_cli(str(error))} for url, error in errors]
        said = [{**r, "url": redact(r["url"]), "index": redact(r["index"])} for r in rows]
        emit(
            args,
            {
                "ok": False,
                "error": f"{len(failed)} of {len(urls)} shards could not be read",
                "shards": said,
                "failed": failed,
            },
            lambda d: "\n".join(
                [f"{r['url']}: {r['nsamples']} samples -> {r['index']}" for r in d["shards"]]
                + [f"{f['url']}: could not be read: {f['error']}" for f in d["failed"]]
                + [f"{len(d['shards'])} of {len(urls)} shards indexed; {len(d['failed'])} could not be read"]
            ),
        )
        return EXIT_PROBLEM
    lines = False
    if args.format == "wids":  # the document wids reads, or one shard a line past what a document holds
        lines = write_description(args.output, wids_description(rows, at=args.output)["shardlist"], name=args.name)
    if record is not None:
        record.written(args.output)
    emit(
        args,
        rows,
        lambda rs: (
            "\n".join(
                f"{redact(r['url'])}: {r['nsamples']} samples" + (f" -> {redact(r['index'])}" if "index" in r else "")
                for r in rs
            )
            + (f"\nwrote {redact(args.output)}" if args.format == "wids" else "")
            + (" (one shard a line: wds_cloud reads it, upstream wids does not)" if lines else "")
        ),
    )
    return EXIT_OK


# verify
def _verify_one(url: str, manifest: Optional[Manifest]) -> dict:
    sha, md5 = hashlib.sha256(), hashlib.md5()
    row: dict = {"url": url, "ok": True, "problems": []}
    try:
        with gopen(url, "rb") as stream:
            tee = Hashing(stream, sha, md5)
            samples, members = index_stream(tee, url)  # type: ignore[arg-type]
            if members.archive_end is None:
                raise CorruptShardError(f"{redact(url)}: no end-of-archive marker (truncated)", url=url)
            tee.drain()
        keys = [s.key for s in samples]
        if len(set(keys)) != len(keys):
            row["problems"].append("a sample key appears in two places (its fields are not together)")
        row.update(size=tee.count, samples=len(samples), sha256=sha.hexdigest(), md5=md5.hexdigest())
        if manifest is not None:
            entry = manifest.find(url)
            if entry is None and not manifest.allow_missing:
                row["problems"].append(
                    "not in the manifest (write it again with --write-manifest, or pass "
                    "--allow-missing to check only the shards it lists)"
                )
            for field in ("size", "samples", "sha256", "md5"):
                if entry is not None and field in entry and entry[field] != row[field]:
                    row["problems"].append(f"{field} {row[field]!r}, the manifest says {entry[field]!r}")
    except (WdsCloudError, OSError) as exc:
        problem = for_cli(str(exc), "verify")
        named = f"{redact(url)}: "  # the row names its shard already
        row["problems"].append(problem[len(named) :] if problem.startswith(named) else problem)
    row["ok"] = not row["problems"]
    return row


def _verify(args: argparse.Namespace) -> int:
    urls = _urls(args.spec)
    manifest = None
    if args.manifest:
        try:
            manifest = load_manifest(args.manifest, allow_missing=args.allow_missing)
        except ShardNotFoundError:
            raise ShardNotFoundError(
                f"--manifest {redact(args.manifest)}: no such file; check the path (a manifest is written by "
                "`wds-cloud verify SPEC --write-manifest PATH`)",
                url=args.manifest,
            ) from None
    with _cluster(args) as client:
        pool: Executor = (
            client.get_executor() if client is not None else ThreadPoolExecutor(max_workers=_jobs(args, urls))
        )
        with pool:
            rows = list(progress(pool.map(_verify_one, urls, [manifest] * len(urls)), len(urls), "verify"))
    # the shards given are checked: a manifest's other entries (a subset verified) are not failures
    given = {manifest.name_of(u) for u in urls} if manifest is not None else set()
    not_given = len(manifest.shards.keys() - given) if manifest is not None else 0
    ok = all(r["ok"] for r in rows)
    result: dict[str, Any] = {"ok": ok, "shards": [dict(r, url=redact(r["url"])) for r in rows]}
    if manifest is not None:
        result["manifest_entries_not_given"] = not_given
    refused = None
    if args.write_manifest:
        bad = [r for r in rows if not r["ok"]]
        if bad:  # the rows are still printed (as JSON with --json): the refusal is one more fact of the result
            refused = (
                f"not writing {redact(args.write_manifest)}: {_plural(len(bad), 'shard')} failed (first: "
                f"{redact(bad[0]['url'])}: {bad[0]['problems'][0]}); fix or leave out the failed shards"
            )
            result["error"] = refused
        else:
            out = Manifest()
            for r in rows:
                out.shards[r["url"]] = {k: r[k] for k in ("size", "samples", "sha256", "md5")}
            out.write(args.write_manifest)
        result["manifest_written"] = not bad
    emit(
        args,
        result,
        lambda d: "\n".join(
            [
                f"{'ok  ' if r['ok'] else 'FAIL'} {r['url']}" + ("" if r["ok"] else ": " + "; ".join(r["problems"]))
                for r in d["shards"]
            ]
            + [
                f"{sum(r['ok'] for r in d['shards'])} of {len(d['shards'])} shards passed"
                + (f" ({not_given} more in the manifest, not given)" if not_given else "")
                + (f"; wrote {redact(args.write_manifest)}" if d.get("manifest_written") else "")
            ]
        ),
    )
    if refused is not None:
        print(f"wds-cloud verify: error: {refused}", file=sys.stderr)
    return EXIT_OK if ok else EXIT_PROBLEM


# reshard
def _reshard_record(args: argparse.Namespace, urls: list[str]) -> JobRecord:
    """The job record of a reshard: one for the job in one process and on Dask (either run continues the other)."""
    return JobRecord(
        args.dest, "reshard", urls, {"maxcount": args.maxcount, "maxsize": args.maxsize, "compress": args.compress}
    )


def _reshard(args: argparse.Namespace) -> int:
    from ..compat import WebDataset
    from ..tools.dask import OutputCut, sample_weight, written_fields
    from ..writer import TarWriter

    urls = _urls(args.source)  # DEST, --maxcount and --maxsize were checked when the command line was parsed
    choices: dict[str, Union[bool, str, None]] = {"none": False, "keep": None, "gz": "gz", "bz2": "bz2", "xz": "xz"}
    choices["zstd"] = "zstd"
    compress = choices[args.compress]
    if getattr(args, "scheduler", None) or getattr(args, "workers", None):
        return _reshard_on_dask(args, urls, compress)
    record = _reshard_record(args, urls)
    record.begin()
    written = skipped = samples = 0
    plan = OutputCut(args.maxcount, args.maxsize)
    current: Optional[Any] = None
    stream: Optional[HashingWriter] = None
    shard_no = -1
    dataset = WebDataset(urls, shardshuffle=False, empty_check=False)

    try:
        for sample in progress(dataset, None, "reshard", unit="samples"):
            number = plan.shard_for(sample_weight(sample))
            if number != shard_no:
                if current is not None and stream is not None:
                    record.finish(current, stream)  # published whole here
                current = stream = None
                shard_no = number
                target = args.dest % number
                if record.keep(target):  # finished by this same job before an interruption: kept
                    skipped += 1
                else:
                    stream = record.open(target)
                    current = TarWriter(cast(IO[bytes], stream), compress=compress)
                    written += 1
            samples += 1
            if current is not None:
                current.write(written_fields(sample))
        if current is not None and stream is not None:
            record.finish(current, stream)
            current = None
    except BaseException:
        if current is not None:
            current.abort()  # a partial shard never appears under its name
        raise
    finally:
        record.flush()
    result = {"samples": samples, "shards": shard_no + 1, "written": written, "kept": skipped}
    return _reshard_summary(args, record, result)


def _reshard_summary(args: argparse.Namespace, record: JobRecord, result: dict[str, Any]) -> int:
    """Print what a reshard did; a rerun of a finished job says that it was complete and what it kept."""
    if record.removed:  # unlisted files at output names, litter: listed only when any were (--json keeps its shape)
        result["removed"] = [redact(name) for name in record.removed]

    def text(r: dict) -> str:
        removed = f"; removed {_plural(len(r['removed']), 'file')} no record listed" if r.get("removed") else ""
        if r["shards"] and not r["written"]:
            return (
                f"nothing to do: the job was already complete; kept all {_plural(r['shards'], 'shard')} "
                f"({_plural(r['samples'], 'sample')}){removed}"
            )
        return (
            f"{_plural(r['samples'], 'sample')} into {_plural(r['shards'], 'shard')} ({r['written']} written, "
            f"{r['kept']} already complete and kept{removed})"
        )

    emit(args, result, text)
    return EXIT_OK


def _map(args: argparse.Namespace) -> int:
    from .. import config, handlers
    from ..tools.dask import distributed_module, load_function, map_shards

    distributed_module()  # without the extra: at once, with the install line
    # MODULE:FUNCTION is looked for in the working directory first, as `python -m` and most tools that take one do
    # (the console script's sys.path holds only its own folder); workers of a local cluster inherit sys.path
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = load_function(args.function)
    except ConfigError as exc:  # the FUNCTION typed names nothing importable: a bad argument
        raise UsageError(f"FUNCTION: {exc}") from None
    if args.profile is not None:  # a profile the profiles file lacks: refused before the job claims anything
        from ..io.profiles import named_profile

        try:
            named_profile(args.profile, config.current())
        except ConfigError as exc:
            raise UsageError(f"--profile {args.profile}: {exc}") from None
    chosen = {
        "reraise": handlers.reraise_exception,
        "warn": handlers.warn_and_continue,
        "ignore": handlers.ignore_and_continue,
    }[args.handler]
    urls = _urls(args.source)
    interval = config.current().progress_interval
    state = {"done": 0, "last": time.monotonic()}

    def report(result: dict) -> None:
        state["done"] += 1
        now = time.monotonic()
        if not args.json and now - state["last"] >= interval:
            done = state["done"]
            print(
                f"map: {done} shard{'' if done == 1 else 's'} written so far, of {len(urls)} inputs (inputs a "
                "job already completed are kept, not written again)",
                file=sys.stderr,
                flush=True,
            )
            state["last"] = now

    with _cluster(args) if args.scheduler else contextlib.nullcontext() as client:
        summary = map_shards(
            fn,
            urls,
            args.dest,
            per=args.per,
            client=client,
            maxcount=args.maxcount,
            maxsize=args.maxsize,
            handler=chosen,
            retries=args.retries,
            profile=args.profile,
            workers=args.workers,
            on_progress=report,
        )
    _cli_failures(summary)
    emit(
        args,
        summary,
        lambda r: (
            f"{r['shards']} shards: {r['done']} done, {r['skipped']} already complete and kept; {r['samples_in']} "
            f"samples in, {r['samples_out']} out, {r['bytes']:,} bytes written in {r['outputs']} outputs, "
            f"{r['seconds']:.1f} s"
            + (
                f"; removed {_plural(len(r['removed']), 'file')} at output names no record listed"
                if r["removed"]
                else ""
            )
            + "".join(f"\n  failed: {f.get('input')} {f.get('key') or ''}: {f['error']}" for f in r["failures"][:20])
        ),
    )
    return EXIT_OK if not any("key" not in f for f in summary["failures"]) else EXIT_PROBLEM


def _reshard_on_dask(args: argparse.Namespace, urls: list[str], compress: Union[bool, str, None]) -> int:
    """reshard on Dask, writing what one process writes (the same names, the same samples in each shard, the same
    bytes), so that the job's output does not depend on how many workers ran it and either run continues the
    other: a first parallel pass measures each input's samples (8 bytes each travel back), the cut is planned
    here in input order as one process cuts it, then each task writes the outputs that start in one input
    (reading on into the next for the last), so every input is read at most three times whatever the cut."""
    from ..tools.dask import distributed_module, measure_shard, plan_outputs, reshard_part, sweep_partials

    distributed_module()  # without the extra: at once, with the install line
    record = _reshard_record(args, urls)
    result: dict[str, Any] = {"samples": 0, "shards": 0, "written": 0, "kept": 0}
    todo: list[int] = []
    try:
        with _cluster(args) as client:
            measured = client.map(measure_shard, urls, pure=False, retries=2)
            weights = (future.result() for future in progress(measured, len(urls), "reshard: measure", unit="inputs"))
            groups: list[tuple[int, int, list[tuple[str, int, bool]]]] = []  # input, first sample, outputs
            for span in plan_outputs(weights, args.maxcount, args.maxsize):
                name = args.dest % span.number
                write = not record.keep(name)  # finished by this same job before an interruption: kept
                if write:
                    todo.append(span.number)
                result["samples"] += span.count
                result["shards"] += 1
                if not groups or groups[-1][0] != span.start:
                    groups.append((span.start, span.first, []))
                groups[-1][2].append((name, span.count, write))
            del measured
            record.begin()
            # a group's outputs end at most where the next group starts; its reader stops where they end
            ends = [start for start, _, _ in groups[1:]] + [len(urls) - 1]
            # each output is recorded as it is published (its task tells it as an event), not when its whole task
            # ends: a job stopped part-way keeps, on its rerun, every output it finished
            told: queue.SimpleQueue = queue.SimpleQueue()
            topic = f"wds-cloud-reshard-{uuid.uuid4().hex}"
            client.subscribe_topic(topic, lambda event: told.put(event[1]))
            recorded: set[str] = set()  # one name per output written: the record holds as much

            def finished(output: dict) -> None:
                if output["name"] in recorded:  # told by its event, then again by its task's result
                    return
                recorded.add(output["name"])
                record.add(output["name"], output["size"], output["sha256"])
                result["written"] += 1
                record.save_soon()

            futures = [
                client.submit(
                    reshard_part, urls[start : end + 1], first, outputs, compress, topic, pure=False, retries=2
                )
                for (start, first, outputs), end in zip(groups, ends)
                if any(write for _, _, write in outputs)
            ]
            for future in futures:
                future.add_done_callback(told.put)
            try:
                for future in progress(
                    _tasks_done(told, len(futures), finished), len(futures), "reshard: write", unit="tasks"
                ):
                    for output in future.result():
                        finished(output)
            finally:
                while True:  # what tasks told before the job stopped (a failed task's finished outputs among it)
                    try:
                        item = told.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(item, dict):
                        finished(item)
                client.unsubscribe_topic(topic)
    finally:
        record.flush()
        sweep_partials(args.dest, todo)
    result["kept"] = result["shards"] - result["written"]
    return _reshard_summary(args, record, result)


def _tasks_done(told: queue.SimpleQueue, tasks: int, finished: Any) -> Iterator[Any]:
    """The futures of ``tasks`` tasks as each ends, and on the way each output a task tells (a dict) handed to
    ``finished``: both come through ``told``, in the order they happened."""
    while tasks:
        item = told.get()
        if isinstance(item, dict):
            finished(item)
            continue
        tasks -= 1
        yield item


def _convert_mmc4(args: argparse.Namespace) -> int:
    from ..tools.interleaved import convert_mmc4

    if getattr(args, "scheduler", None) or getattr(args, "workers", None):
        counts = _convert_on_dask(args, _urls(args.docs))
    else:
        counts = convert_mmc4(
            _urls(args.docs),
            args.images,
            args.dest,
            maxcount=args.maxcount,
            missing=args.missing,
            progress=lambda lines: progress(lines, None, "convert", unit="documents"),
        )
    emit(
        args,
        counts,
        lambda c: (
            f"{_plural(c['documents'], 'document')}, {_plural(c['images'], 'image')} into "
            f"{_plural(c['shards'], 'shard')} ({c['written']} written, {c['kept']} already complete and kept); "
            f"{_plural(c['dropped_images'], 'missing image')} dropped, "
            f"{_plural(c['skipped_documents'], 'document')} skipped"
        ),
    )
    return EXIT_OK


def _convert_on_dask(args: argparse.Namespace, docs: list[str]) -> dict:
    """convert mmc4 on Dask: the documents are counted here, then each output shard is one task writing the
    same documents under the same name as one process would (so the two runs are one job: either continues
    the other)."""
    from ..tools.dask import distributed_module, sweep_partials
    from ..tools.interleaved import mmc4_plan, mmc4_shard

    distributed = distributed_module()
    record = JobRecord(
        args.dest,
        "convert mmc4",
        list(docs),
        {"images": redact(args.images), "maxcount": args.maxcount, "missing": args.missing},
    )
    plan, total = mmc4_plan(docs, args.maxcount)
    todo = [k for k in range(len(plan)) if not record.keep(args.dest % k)]
    record.begin()
    counts = {
        "documents": total,
        "images": 0,
        "dropped_images": 0,
        "skipped_documents": 0,
        "written": len(todo),
        "kept": len(plan) - len(todo),
        "shards": len(plan),
    }
    try:
        with _cluster(args) as client:
            futures = {
                client.submit(
                    mmc4_shard,
                    docs,
                    args.images,
                    args.dest,
                    k,
                    plan[k],
                    args.maxcount,
                    args.missing,
                    pure=False,
                    retries=2,
                ): k
                for k in todo
            }
            for future in progress(distributed.as_completed(futures), len(todo), "convert"):
                result = future.result()
                record.add(result["name"], result["size"], result["sha256"])
                record.save_soon()
                for key in ("images", "dropped_images", "skipped_documents"):
                    counts[key] += result[key]
    finally:
        record.flush()
        sweep_partials(args.dest, todo)
    counts["documents"] = total - counts["skipped_documents"]
    return counts


def add_parsers(commands: Any) -> None:
    """Add the shard tools to the ``wds-cloud`` subcommands."""

    def add(name: str, help: str, example: str, json: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help,
            description=help[0].upper() + help[1:] + ".",
            epilog=f"example:\n  {example}\n\n{READ_EXIT_CODES if name in ('ls', 'cat', 'stat') else EXIT_CODES}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if json:
            sub.add_argument("--json", action="store_true", help="print JSON for scripts")
        return sub

    def jobs(sub: argparse.ArgumentParser, what: str, local: str = "1 for local ones") -> None:
        sub.add_argument(
            "--jobs",
            type=count(1, MAX_PARALLEL),
            default=None,
            help=f"shards {what} at once, 1 to {MAX_PARALLEL} (default: 8 for remote shards, {local})",
        )

    def on_dask(sub: argparse.ArgumentParser, extra: str = "") -> None:
        where = sub.add_mutually_exclusive_group()
        where.add_argument(
            "--scheduler",
            type=scheduler,
            help="run on the Dask cluster of this scheduler (tcp://host:8786; needs wds_cloud[dask])" + extra,
        )
        where.add_argument(
            "--workers",
            type=count(1, MAX_PARALLEL),
            help="run on a local Dask cluster of this many worker processes (needs wds_cloud[dask])" + extra,
        )

    ls = add(
        "ls",
        "list a shard's members (or samples) with their sizes, or a folder's or prefix's objects (FOLDER/)",
        "wds-cloud ls s3://bucket/train-0000.tar\n  wds-cloud ls s3://bucket/train/    (the objects, sizes, total "
        "and a brace spec of the shards)",
    )
    ls.add_argument(
        "url",
        type=text("shard URL"),
        help="a shard (any URL), or a folder or prefix to list: a local folder, or a URL ending in '/' "
        "(s3://bucket/prefix/, gs://, az://, file://)",
    )
    ls.add_argument("--samples", action="store_true", help="one line per sample, with its fields")
    ls.set_defaults(func=_ls)

    cat = add(
        "cat",
        "write a shard, one sample (as a tar) or one field of it to stdout",
        "wds-cloud cat s3://bucket/train-0000.tar --key 000123 --field jpg > 000123.jpg",
        json=False,  # it writes bytes; `wds-cloud ls --json` lists a shard's members for scripts
    )
    cat.add_argument("url", type=text("shard URL"), help="the shard (any URL)")
    cat.add_argument("--key", type=text("sample key"), help="the sample's key")
    cat.add_argument("--field", type=text("field name"), help="one field of the sample (its extension, such as jpg)")
    cat.set_defaults(func=_cat)

    stat = add(
        "stat",
        "count samples, fields and bytes of shards; say whether each is compressed and indexed",
        "wds-cloud stat 'https://host/data/train-{0000..0099}.tar'",
    )
    stat.add_argument("spec", nargs="+", help="shards: URLs, paths or brace specs")
    jobs(stat, "read")
    stat.set_defaults(func=_stat)

    index = add(
        "index",
        "write member indexes (ours or DALI's .idx beside each shard) or a wids description",
        "wds-cloud index 's3://bucket/train-{0000..0099}.tar' --format dali",
    )
    index.add_argument("spec", nargs="+", help="shards: URLs, paths or brace specs")
    index.add_argument(
        "--format",
        choices=["json", "dali", "wids"],
        default="json",
        help="json (the default): ours (SHARD.index.json); dali: SHARD.idx; wids: one dataset description (the JSON document "
        "upstream wids reads; one shard a line when --output ends .jsonl or the document would be larger than "
        "WDS_MAX_DATA_FILE_SIZE, as for 10^6 shards and more)",
    )
    index.add_argument(
        "--output", type=text("URL or path"), help="where to write (one shard's index, or the wids description)"
    )
    index.add_argument("--name", type=text("name"), help="the dataset's name in a wids description")
    jobs(index, "indexed", "one process per core for local ones")
    on_dask(index)
    index.set_defaults(func=_index)

    verify = add(
        "verify",
        "read every shard completely: tar structure, samples, checksums against a manifest",
        "wds-cloud verify 'data/train-{0000..0099}.tar' --write-manifest data/manifest.json",
    )
    verify.add_argument("spec", nargs="+", help="shards: URLs, paths or brace specs")
    verify.add_argument("--manifest", type=text("URL or path"), help="check against this manifest (URL or path)")
    verify.add_argument(
        "--allow-missing",
        action="store_true",
        help="shards given that the manifest does not list are not errors (the shards it lists "
        "are checked; its entries not given are never errors)",
    )
    verify.add_argument(
        "--write-manifest",
        type=text("URL or path"),
        help="write a manifest of the shards (only when every one passes); one shard a line when the name ends "
        ".jsonl or one JSON document would be larger than WDS_MAX_DATA_FILE_SIZE",
    )
    jobs(verify, "read")
    on_dask(verify)
    verify.set_defaults(func=_verify)

    reshard = add(
        "reshard",
        "rewrite a dataset with another maxcount/maxsize/compression (resumable)",
        "wds-cloud reshard 'data/train-{0000..0099}.tar' 's3://bucket/big/train-%04d.tar' --maxcount 10000",
    )
    reshard.add_argument("source", nargs="+", help="input shards: URLs, paths or brace specs")
    reshard.add_argument(
        "dest",
        metavar="DEST",
        type=output_pattern,
        help="output pattern with one %%d (or %%06d) field for the shard number, such as out/train-%%06d.tar",
    )
    reshard.add_argument(
        "--maxcount", type=count(1), default=10000, help="samples per output shard, 1 or more (default 10000)"
    )
    reshard.add_argument(
        "--maxsize",
        type=flags.size,
        default=3_000_000_000,
        help="bytes per output shard: whole bytes, 1 or more, suffix optional (3e9, 500M, 2GiB; default 3e9)",
    )
    reshard.add_argument(
        "--compress",
        choices=["keep", "none", "gz", "bz2", "xz", "zstd"],
        default="keep",
        help="keep (default): as the output name says (.tar.gz/.tgz gzip, .tar.bz2 bzip2, .tar.xz xz, .tar.zst "
        "zstd; else none); none; or gz, bz2, xz, zstd whatever the name",
    )
    on_dask(reshard, " (the same shards as one process: the samples are counted first, then the shards written)")
    reshard.set_defaults(func=_reshard)

    mapper = add(
        "map",
        "run a function of yours over every shard on Dask (resumable; needs wds_cloud[dask])",
        "wds-cloud map mypkg.filters:keep_long 's3://bucket/train-{0000..0999}.tar' "
        "'s3://bucket/long/train-%04d.tar' --workers 8",
    )
    mapper.add_argument(
        "function",
        metavar="FUNCTION",
        type=text("MODULE:FUNCTION"),
        help="MODULE:FUNCTION, importable here and on every Dask worker",
    )
    mapper.add_argument("source", nargs="+", help="input shards: URLs, paths or brace specs")
    mapper.add_argument(
        "dest",
        metavar="DEST",
        type=output_pattern,
        help="output pattern with one %%d (or %%06d) field (input shard i gives output i)",
    )
    mapper.add_argument(
        "--per",
        choices=["sample", "shard"],
        default="sample",
        help="sample: the function takes a sample and returns a sample, a list or None; shard: it "
        "takes the shard's sample iterator and yields samples (default: sample)",
    )
    on_dask(mapper, " (default: a local cluster, one worker per core)")
    mapper.add_argument(
        "--maxcount", type=count(1), help="samples per output shard, 1 or more (an input then gives several)"
    )
    mapper.add_argument(
        "--maxsize",
        type=flags.size,
        help="bytes per output shard: whole bytes, 1 or more, suffix optional (500M, 2GiB)",
    )
    mapper.add_argument(
        "--handler",
        choices=["reraise", "warn", "ignore"],
        default="reraise",
        help="a sample the function raises on: fail its shard (default), or skip it (warn: with a "
        "warning) and name it in the summary",
    )
    mapper.add_argument(
        "--retries", type=count(0, 100), default=2, help="times a failed shard is run again, 0 to 100 (default 2)"
    )
    mapper.add_argument(
        "--profile",
        type=text("profile name"),
        help="the storage profile (WDS_CLOUD_CONFIG) the workers use: credentials never travel in the task graph",
    )
    mapper.set_defaults(func=_map)

    convert = commands.add_parser(
        "convert",
        help="convert a published dataset layout to shards (mmc4)",
        description="Convert a published dataset layout to WebDataset shards. Each LAYOUT has its own options: "
        "wds-cloud convert LAYOUT --help.",
        epilog="example:\n  wds-cloud convert mmc4 'docs/docs_shard_{0..9}_v2.jsonl' --images s3://bucket/mmc4-images "
        f"--dest out/mmc4-%06d.tar\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kinds = convert.add_subparsers(dest="kind", metavar="LAYOUT")
    kinds.required = True
    mmc4 = kinds.add_parser(
        "mmc4",
        help="MMC4: JSON lines of documents plus image files, to interleaved-document shards (resumable)",
        description="Convert MMC4's published layout (JSON lines of documents, .jsonl or .jsonl.gz, and the image "
        "files their image_info names) to shards: one sample per document, its JSON and its images "
        "(image i as field i.<ext>), read back with wds.interleaved(). Shards are published whole; a "
        "run after an interruption keeps the shards already written and does the rest.",
        epilog="example:\n  wds-cloud convert mmc4 'docs/docs_shard_{0..9}_v2.jsonl' --images s3://bucket/mmc4-images "
        f"--dest out/mmc4-%06d.tar --maxcount 1000\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mmc4.add_argument("docs", nargs="+", help="the documents: JSON-lines files (any URL, brace specs, .gz read too)")
    mmc4.add_argument(
        "--images",
        required=True,
        type=text("directory or URL prefix"),
        help="where the image files are (a directory or URL prefix)",
    )
    mmc4.add_argument(
        "--dest",
        required=True,
        type=output_pattern,
        help="output pattern with one %%d (or %%06d) field, such as out/mmc4-%%06d.tar",
    )
    mmc4.add_argument("--maxcount", type=count(1), default=1000, help="documents per shard, 1 or more (default 1000)")
    mmc4.add_argument(
        "--missing",
        choices=["drop", "skip", "error"],
        default="drop",
        help="an image file that does not exist: drop it from its document (default), skip the "
        "document, or stop with an error",
    )
    mmc4.add_argument("--json", action="store_true", help="print JSON for scripts")
    on_dask(mmc4, " (the same shards as one process: the documents are counted first, then one task per shard)")
    mmc4.set_defaults(func=_convert_mmc4)
