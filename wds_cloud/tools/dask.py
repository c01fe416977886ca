"""Processing shards on a Dask cluster: a function over every shard, outputs written whole, reruns safe.

``map_shards(fn, source, destination)`` reads each input shard with our reader on a Dask worker, applies
``fn`` to each sample (``per="sample"``: a sample in, a sample, None or a list of samples out) or to the
shard's sample iterator (``per="shard"``: samples out), and writes the output with our writer.  Without
``client`` a ``LocalCluster`` sized to the machine is started and closed; with one, the same code runs on
every machine its scheduler reaches.

- **Deterministic names.** Input shard ``i`` (in the order of ``source``) gives the output
  ``destination % i``; with ``maxcount``/``maxsize`` an input may give several, ``destination % i`` with
  ``-001``, ``-002``, ... before the extension for the second, third, ... .  A retried task writes the same
  names again, so a retry never duplicates a sample.
- **Outputs appear whole.** Each output is published only when complete (a local file is renamed into
  place, an object is uploaded at close); a worker killed mid-shard leaves nothing under an output name and
  the scheduler runs the shard again.
- **The job record** (``destination`` with ``N`` for the number, then ``.wds-job.json``, see
  :mod:`wds_cloud.jobs.record`) lives beside the outputs: the function, the inputs and the settings, and
  per finished input its outputs with their sizes and SHA-256.  Running the same job again skips the inputs
  whose outputs are still there and unchanged; another function, other inputs or other settings are refused
  before anything is written, naming what differs.
- **No secrets in the task graph.** Tasks carry URLs (redacted where they hold credentials, refused then)
  and the name of a storage profile, never storage options: credentials reach the workers through their
  environment or the profiles file (``WDS_CLOUD_CONFIG``), which the scheduler and its dashboard never see.

Needs the ``dask`` extra: ``pip install 'wds_cloud[dask]' (in a clone: pip install -e '.[dask]')``.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import functools
import importlib
import ipaddress
import logging
import math
import numbers
import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Optional, Union, cast

from ..errors import ConfigError, MissingExtraError, SecurityError, UnknownSchemeError, holds_credential, redact
from ..handlers import reraise_exception
from ..jobs.patterns import check_output_pattern
from ..jobs.record import output_names

__all__ = [
    "map_shards",
    "output_names",
    "load_function",
    "distributed_module",
    "cluster_client",
    "passthrough",
    "sweep_partials",
    "sample_weight",
    "written_fields",
    "OutputCut",
    "OutputSpan",
    "measure_shard",
    "plan_outputs",
    "reshard_part",
    "INSTALL",
]

INSTALL = "pip install 'wds_cloud[dask]' (in a clone: pip install -e '.[dask]')"

log = logging.getLogger(__name__)


def distributed_module() -> Any:
    """``dask.distributed``, or MissingExtraError with the install line."""
    try:
        import distributed
    except ImportError as exc:
        raise MissingExtraError(f"running on Dask needs dask.distributed: {INSTALL}") from exc
    return distributed


#: the transports a Dask scheduler listens on (``host:port`` alone is tcp)
SCHEDULER_SCHEMES = ("tcp", "tls", "ws", "wss", "ucx")
_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})")


def scheduler_problem(address: str) -> Optional[str]:
    """What keeps ``address`` from being a Dask scheduler address (``[SCHEME://]HOST:PORT``), or None.

    Checked before anything starts: distributed's own refusals are bare ValueErrors, raised only once a
    tool has begun, after the job claimed its destination."""
    if not isinstance(address, str) or not address.strip():
        return "it is empty"
    scheme, sep, rest = address.strip().partition("://")
    if not sep:
        scheme, rest = "tcp", scheme
    if scheme.lower() not in SCHEDULER_SCHEMES:
        return f"{scheme!r} is not a transport Dask schedulers listen on ({', '.join(SCHEDULER_SCHEMES)})"
    if any(c in rest for c in "/?#@") or any(c.isspace() or not c.isprintable() for c in rest):
        return "it holds a path, query, user name or space after HOST:PORT"
    if rest.startswith("["):  # an IPv6 address, in brackets as in URLs
        host, close, port = rest[1:].partition("]")
        if not close:
            return "an IPv6 address without its closing ']'"
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"{host!r} is not an IPv6 address"
        if not port.startswith(":"):
            return "no port after the IPv6 address"
        port = port[1:]
    else:
        host, colon, port = rest.rpartition(":")
        if not colon:
            return "no port (Dask's scheduler listens on 8786 by default)"
        if ":" in host:
            return "an IPv6 address must be in brackets, such as tcp://[::1]:8786"
        if not _HOSTNAME.fullmatch(host):
            return f"{host!r} is not a host name or address"
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return f"the port {port!r} is not a number from 1 to 65535"
    return None


def scheduler_address(address: str) -> str:
    """``address`` when it is a Dask scheduler address, else ConfigError naming it and what is accepted."""
    problem = scheduler_problem(address)
    if problem is not None:
        raise ConfigError(
            f"{redact(str(address))!r} is not a Dask scheduler address: {problem}; give HOST:PORT or "
            "tcp://HOST:PORT, such as tcp://10.0.0.5:8786 (tls://, ws://, wss://, ucx:// too; IPv6 as [::1]:8786)"
        )
    return address.strip()


def _refused(address: str) -> bool:
    """Whether a TCP scheduler address refuses a connection right away (other schemes, or a host that does not
    answer at once, are left to distributed and its timeout)."""
    scheme, _, rest = address.rpartition("://")
    if scheme not in ("", "tcp"):
        return False
    host, _, port = rest.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
    return False


@contextlib.contextmanager
def cluster_client(scheduler: Optional[str] = None, workers: Optional[int] = None) -> Iterator[Any]:
    """A ``distributed.Client`` of the scheduler at ``scheduler``, or of a ``LocalCluster`` of ``workers``
    processes (default: one per core) started here and closed on leaving."""
    if scheduler is not None:
        scheduler = scheduler_address(scheduler)  # before the extra is needed: a typo is named either way
    distributed = distributed_module()
    if scheduler:
        if _refused(scheduler):  # answered at once: distributed would retry for its whole connect timeout (30 s)
            raise ConfigError(
                f"scheduler {redact(scheduler)}: nothing listens there (the connection was refused); check that a "
                "Dask scheduler runs at that address (`dask scheduler` prints it), or leave the scheduler out "
                "(--scheduler on the command line) to start a local cluster",
                field="scheduler",
            )
        try:
            client = distributed.Client(scheduler)
        except OSError as exc:  # distributed's "Timed out trying to connect to ... after 30 s"
            raise ConfigError(
                f"scheduler {redact(scheduler)}: no Dask scheduler answered there ({exc}); check that one runs at "
                "that address (`dask scheduler` prints it), or leave the scheduler out (--scheduler on the "
                "command line) to start a local cluster",
                field="scheduler",
            ) from None
        try:
            yield client
        finally:
            client.close()
        return
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers {workers}: give at least 1")
    import dask

    # Dask's nannies start workers with MALLOC_TRIM_THRESHOLD_=65536, which fixes glibc's mmap threshold: every
    # decoded image buffer is then mapped and unmapped afresh.  A batch job does not need Dask's statistical
    # profiler (a thread in every worker sampling the running task every 10 ms, taking the GIL from it), its
    # 20 ms event-loop health tick, its 0.5 s system monitor or work stealing (equal tasks wait on the scheduler
    # anyway): they take cores a CPU-bound job needs (figures: bench/README.md, bench_dask.py)
    environ = {
        k: v
        for k, v in (dask.config.get("distributed.nanny.pre-spawn-environ", None) or {}).items()
        if k != "MALLOC_TRIM_THRESHOLD_"
    }
    quiet = {
        "distributed.worker.profile.enabled": False,
        "distributed.admin.tick.interval": "500ms",
        "distributed.admin.system-monitor.interval": "5s",
        "distributed.scheduler.work-stealing": False,
    }
    with dask.config.set({"distributed.nanny.pre-spawn-environ": environ, **quiet}):
        cluster = distributed.LocalCluster(
            n_workers=workers or os.cpu_count() or 1, threads_per_worker=1, processes=True, dashboard_address=":0"
        )
    client = distributed.Client(cluster)
    log.info(
        "a local Dask cluster of %d workers; its dashboard (progress): %s", len(cluster.workers), client.dashboard_link
    )
    try:
        yield client
    finally:
        # our own shutdown: workers told to stop may take a moment, which the nanny reports as a warning
        # ("Worker process still alive after 4 seconds, killing") that says nothing wrong to the user
        nanny = logging.getLogger("distributed.nanny")
        level = nanny.level
        nanny.setLevel(logging.ERROR)
        try:
            client.close()
            cluster.close()
        finally:
            nanny.setLevel(level)


def passthrough(samples: Iterator[dict]) -> Iterator[dict]:
    """The shard's samples as they are (``wds-cloud reshard`` on Dask: ``map_shards(passthrough, per="shard")``)."""
    return samples


def load_function(spec: str) -> Callable:
    """The function named ``MODULE:FUNCTION`` (imported here, and on each worker by its name)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{spec!r} does not name a function: give MODULE:FUNCTION, such as mypkg.filters:keep_long")
    # a relative or path-like module ('.mypkg', '../mypkg') is importlib's TypeError: refused here, naming the fix
    if not all(part.isidentifier() for part in module.split(".")):
        raise ConfigError(
            f"{spec!r} is not MODULE:NAME with an absolute module name: give dotted Python names, such as "
            "mypkg.filters:keep_long (not a path or a relative name), importable here and on every Dask worker"
        )
    if not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(f"{spec!r}: {name!r} is not a Python name: give MODULE:NAME, such as mypkg.filters:keep_long")
    try:
        found = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"cannot import {module!r} for {spec!r}: {exc}; it must be importable here and on every "
            "Dask worker (installed, or on PYTHONPATH)"
        ) from exc
    except Exception as exc:  # the module itself fails as it loads: its error, named, not a traceback of ours
        raise ConfigError(f"importing {module!r} for {spec!r} raised {type(exc).__name__}: {exc}") from exc
    fn: Any = found
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"{module!r} has no {name!r} (from {spec!r})")
    if not callable(fn):
        raise ConfigError(f"{spec!r} is not callable")
    return fn


def _samples_out(result: Any) -> Iterable[dict]:
    if result is None:
        return ()
    if isinstance(result, dict):
        return (result,)
    return result


def _apply(fn: Callable, per: str, samples: Iterator[dict], handler: Callable, failures: list) -> Iterator[dict]:
    if per == "shard":
        yield from _samples_out(fn(samples))
        return
    for sample in samples:
        try:
            result = fn(sample)
        except Exception as exn:
            if not handler(exn):
                raise
            failures.append({"key": sample.get("__key__"), "error": f"{type(exn).__name__}: {exn}"[:500]})
            continue
        yield from _samples_out(result)


def _compression(name: str) -> Any:
    """How an output is written: gzip for a ``.gz``/``.tgz`` name, else plain."""
    return "gz" if name.endswith((".gz", ".tgz")) else False


def _publish(writer: Any, stream: Any, count: int) -> dict:
    """Close ``writer`` and the HashingWriter ``stream`` under it (the output is published whole): what the
    job record keeps of the output."""
    writer.close()
    stream.close()
    return {"name": stream.name, "size": stream.count, "sha256": stream.sha256.hexdigest(), "samples": count}


#: the inputs whose outputs a rerun checks at once (their reads are queued on 16 threads)
_KEEP_BATCH = 4096

#: errors no retry of a task can mend (a scheme no backend serves, a missing extra or profile, a refused URL):
#: a task returns them as its result, so that Dask neither runs the shard again nor logs a traceback per try
_PERMANENT = (ConfigError, UnknownSchemeError, MissingExtraError, SecurityError)


def _shard_task(fn: Callable, per: str, url: str, index: int, destination: str, **options: Any) -> dict:
    """One input shard, on a worker (:func:`_shard_work`); an error no retry mends is its result, not raised."""
    try:
        return _shard_work(fn, per, url, index, destination, **options)
    except _PERMANENT as exc:
        return {"index": index, "input": redact(url), "error": f"{type(exc).__name__}: {exc}"[:1000]}


def _shard_work(
    fn: Callable,
    per: str,
    url: str,
    index: int,
    destination: str,
    maxcount: Optional[int],
    maxsize: Optional[float],
    handler: Callable,
    profile: Optional[str],
) -> dict:
    """One input shard, on a worker: read, apply, write whole; what was done, for the job record."""
    from ..compat import WebDataset
    from ..io.open import gopen
    from ..jobs.record import HashingWriter
    from ..writer import TarWriter

    started = time.perf_counter()
    options = None
    if profile:
        from .. import config
        from ..io.profiles import named_profile

        options = named_profile(profile, config.current())
    counts = {"in": 0}
    failures: list = []

    def counted(items: Iterable[dict]) -> Iterator[dict]:
        for item in items:
            counts["in"] += 1
            yield item

    dataset = WebDataset([url], shardshuffle=False, empty_check=False, storage_options=options)
    outputs: list = []
    writer = stream = None
    count = size = 0
    names: list = []
    try:
        for sample in _apply(fn, per, counted(iter(dataset)), handler, failures):
            record = {k: v for k, v in sample.items() if k == "__key__" or not k.startswith("__")}
            weight = sum(len(v) for k, v in record.items() if k != "__key__" and isinstance(v, (bytes, str)))
            if writer is not None and (
                (maxcount and count >= maxcount) or (maxsize and size + weight > maxsize and count)
            ):
                outputs.append(_publish(writer, stream, count))
                writer = stream = None
            if writer is None:
                names = output_names(destination, index, len(outputs) + 1)
                stream = HashingWriter(gopen(names[-1], "wb", storage_options=options), names[-1])
                writer = TarWriter(cast(IO[bytes], stream), compress=_compression(stream.name))
                count = size = 0
            writer.write(record)
            count += 1
            size += weight
        if writer is None:  # nothing out: an empty output keeps the numbering (input i gives output i)
            names = output_names(destination, index, 1)
            stream = HashingWriter(gopen(names[0], "wb", storage_options=options), names[0])
            writer = TarWriter(cast(IO[bytes], stream), compress=_compression(stream.name))
        outputs.append(_publish(writer, stream, count))
        writer = stream = None
    except BaseException:
        if stream is not None:
            stream.abort()  # nothing partial appears under an output name
        raise
    return {
        "index": index,
        "input": redact(url),
        "outputs": outputs,
        "samples_in": counts["in"],
        "samples_out": sum(o["samples"] for o in outputs),
        "bytes": sum(o["size"] for o in outputs),
        "failures": failures,
        "seconds": time.perf_counter() - started,
    }


def _listing(destination: str) -> Iterator[str]:
    """The file names in a local destination's folder, listed once (nothing when it does not exist)."""
    from ..io.urls import local_path

    folder = local_path(destination)[: local_path(destination).rfind("/") + 1] or "."
    try:
        listing = os.scandir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return
    with listing:
        for item in listing:
            yield item.name


def _drop_extra_parts(destination: str, parts: dict[int, int]) -> list[str]:
    """Remove the outputs of the inputs in ``parts`` (input -> how many parts it has) past their parts (its
    names ``-NNN`` from that many on), which no record lists: an earlier attempt of the job wrote them (a
    function whose output varies between runs gives fewer parts the second time), or they were put there; the
    job owns these names, and a rerun never keeps a file at them that it did not make (it would hold samples twice).  One listing
    of a local destination's folder, each name read back into its input and part once
    (:func:`~wds_cloud.jobs.record.output_number`).  The names removed, in order."""
    from ..io.urls import is_local
    from ..jobs.record import output_number

    if not is_local(destination) or not parts:
        return []
    folder = destination[: destination.rfind("/") + 1]
    removed = []
    for name in _listing(destination):
        found = output_number(destination, name)
        if found is None or found[0] not in parts or found[1] < parts[found[0]]:
            continue
        try:
            os.unlink(_local(folder + name))
        except FileNotFoundError:
            continue
        removed.append(folder + name)
    return sorted(removed)


def _local(url: str) -> str:
    from ..io.urls import local_path

    return local_path(url)


def _record_shard(record: Any, summary: dict, result: dict) -> None:
    """What one finished shard adds to the job record and the summary."""
    record.add_input(result["index"], [(o["name"], o["size"], o["sha256"]) for o in result["outputs"]])
    summary["done"] += 1
    for key in ("samples_in", "samples_out", "bytes"):
        summary[key] += result[key]
    summary["outputs"] += len(result["outputs"])
    summary["failures"] += [dict(f, input=result["input"]) for f in result["failures"]]


#: a temporary file a local output is written to before it is published (io/atomic.py's temp_name_for)
_PARTIAL = re.compile(r"\.(.+)\.\d+\.[0-9a-f]{8}\.partial")


def sweep_partials(destination: str, indexes: Iterable[int]) -> None:
    """Remove the hidden temporary files that workers killed while writing left beside local outputs of these
    inputs (a write in progress is published by renaming such a file; one whose writer died is litter).  One
    listing of the destination's folder, each name read back into its input once."""
    from ..io.urls import is_local
    from ..jobs.record import output_number

    if not is_local(destination):
        return  # an object store publishes an upload only when it completes: nothing is left behind
    wanted = set(indexes)
    folder = destination[: destination.rfind("/") + 1]
    for name in _listing(destination):
        match = _PARTIAL.fullmatch(name) if name.endswith(".partial") else None
        found = None if match is None else output_number(destination, match.group(1))
        if found is not None and found[0] in wanted:
            try:
                os.unlink(_local(folder + name))
            except FileNotFoundError:
                pass


def _number(name: str, value: Any, least: int, *, whole: bool) -> Any:
    """``value`` (None, or a number of any type: numpy's too) as a plain int or float at least ``least``, or
    ConfigError naming the argument (a bool, NaN, infinity or a fraction where a count goes are refused)."""
    if value is None and name != "retries":
        return None
    ok = isinstance(value, numbers.Integral) if whole else isinstance(value, numbers.Real)
    if ok and not isinstance(value, bool):
        plain = int(value) if whole or float(value).is_integer() and abs(value) < 2**53 else float(value)
        if math.isfinite(plain) and plain >= least:
            return plain
    kind = "a whole number" if whole else "a number"
    raise ConfigError(f"{name}={value!r:.80}: give {kind}, {least} or more{'' if whole else ', and finite'}")


def _check_url(url: str) -> None:
    """Refuse a URL carrying a credential in any spelling :func:`~wds_cloud.errors.redact` knows (userinfo,
    ``?private_token=``, ``?X-Auth-Token=``, ``?X%2DAuth%2DToken=``, ...): a task's arguments are shown by the
    scheduler and its dashboard, and the job record lists the inputs and outputs."""
    if holds_credential(url):
        raise ConfigError(
            f"{redact(url)} carries a credential in its text; a task graph would show it on the Dask "
            "scheduler and dashboard: give the credential to the workers through their environment "
            "or a named profile (profile=) instead",
            bad_argument=True,
        )


def map_shards(
    fn: Callable,
    source: Union[str, list],
    destination: str,
    *,
    per: str = "sample",
    client: Any = None,
    maxcount: Optional[int] = None,
    maxsize: Optional[float] = None,
    handler: Callable = reraise_exception,
    retries: int = 2,
    profile: Optional[str] = None,
    workers: Optional[int] = None,
    on_progress: Optional[Callable[[dict], None]] = None,
) -> dict:
    """Apply ``fn`` to every shard of ``source`` on Dask, writing outputs to ``destination`` (a ``%d`` pattern).

        Returns the summary: ``shards`` (inputs), ``done`` (run now), ``skipped`` (finished by an earlier run of
        the same job), ``samples_in``, ``samples_out``, ``bytes`` (written), ``outputs``, ``failures`` (per shard
        that failed after ``retries``: the input and the reason; per sample that ``handler`` let pass: the
        input, the key and the reason), ``removed`` (files at output names that the record
    did not list, and temporary files of writers that died, removed: the destination never holds a sample twice) and ``seconds``.  ``handler`` (a webdataset handler such as
        ``wds.warn_and_continue``) decides what a sample that ``fn`` raises on does: the default fails its shard.
        ``client``: a ``distributed.Client``; None starts a ``LocalCluster`` of ``workers`` processes (default:
        the machine's cores) and closes it.  ``profile``: the storage profile the workers use for ``source`` and
        ``destination``.  ``on_progress``: called with each finished shard's result.
    """
    from ..jobs.record import JobRecord
    from ..shardlists import expand_source

    if per not in ("sample", "shard"):
        raise ConfigError(
            f"per={per!r}: give 'sample' (fn takes and returns samples) or 'shard' (fn takes the "
            "shard's sample iterator and yields samples)"
        )
    # one number field, names that never repeat (input i gives output i): a TypeError half way, or outputs
    # published over each other, otherwise
    check_output_pattern(destination, "the destination")
    maxcount = _number("maxcount", maxcount, 1, whole=True)
    maxsize = _number("maxsize", maxsize, 1, whole=False)
    retries = _number("retries", retries, 0, whole=True)
    workers = _number("workers", workers, 1, whole=True)
    urls = expand_source(source) if not isinstance(source, list) else list(source)
    if not urls:
        raise ConfigError(f"{redact(source)!r} names no shards")
    for url in urls + [destination]:
        _check_url(url)
    if profile is not None:  # refused before the claim and the cluster, not once per task on the workers
        from .. import config
        from ..io.profiles import named_profile

        try:
            named_profile(profile, config.current())
        except ConfigError as exc:
            raise ConfigError(f"profile={profile!r}: {exc}", bad_argument=True) from None
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    # the record claims the destination before anything expensive: a second job started while this one starts
    # its cluster is refused, naming this one (two jobs would write over each other); the claim is given back however the job ends
    record = JobRecord(
        destination, "map", urls, {"function": name, "per": per, "maxcount": maxcount, "maxsize": maxsize}
    )
    with record:
        return _run(
            record,
            fn,
            per,
            urls,
            destination,
            client,
            maxcount,
            maxsize,
            handler,
            retries,
            profile,
            workers,
            on_progress,
        )


def _run(
    record: Any,
    fn: Callable,
    per: str,
    urls: list,
    destination: str,
    client: Any,
    maxcount: Optional[int],
    maxsize: Optional[float],
    handler: Callable,
    retries: int,
    profile: Optional[str],
    workers: Optional[int],
    on_progress: Optional[Callable[[dict], None]],
) -> dict:
    """The job of :func:`map_shards` once its record holds the destination."""
    todo, skipped = [], 0
    kept_parts: dict[int, int] = {}  # input skipped -> its parts: a file past them at its names goes
    with ThreadPoolExecutor(max_workers=16) as pool:  # a rerun reads back what it keeps: many at once
        for start in range(0, len(urls), _KEEP_BATCH):  # a batch at a time: pending reads stay bounded
            batch = range(start, min(start + _KEEP_BATCH, len(urls)))
            listed = {index: record.finished(index) for index in batch}
            names = [name for index in batch for name in listed[index] or ()]
            kept = dict(zip(names, pool.map(record.keep, names)))
            for index in batch:
                outputs = listed[index]
                if outputs and all(kept[output] for output in outputs):
                    skipped += 1
                    kept_parts[index] = len(outputs)
                else:
                    # what an earlier, interrupted run of this job wrote for it goes, and the input is no longer
                    # done: a record saved before it finishes again must not list it as finished
                    record.drop_input(index)
                    todo.append((index, urls[index]))
    # a file at a later part name of a skipped input that the record does not list is not kept: the
    # destination would hold those samples twice
    removed = _drop_extra_parts(destination, kept_parts)
    distributed = distributed_module() if todo else None
    started = time.perf_counter()
    summary: dict[str, Any] = {
        "shards": len(urls),
        "done": 0,
        "skipped": skipped,
        "samples_in": 0,
        "samples_out": 0,
        "bytes": 0,
        "outputs": 0,
        "failures": [],
        # what the record removed when it was loaded (unlisted files at output names, a dead writer's
        # temporary files), then what is past a kept input's parts
        "removed": [redact(name) for name in sorted([*record.removed, *removed])],
        "seconds": 0.0,
    }
    if todo:
        assert distributed is not None
        record.begin()  # before the cluster and any output: what an interrupted run leaves at its names is its own
        own = None
        written: dict[int, int] = {}  # input written now -> its parts
        try:
            if client is None:
                own = cluster_client(None, workers)
                client = own.__enter__()
            task = functools.partial(
                _shard_task,
                fn,
                per,
                destination=destination,
                maxcount=maxcount,
                maxsize=maxsize,
                handler=handler,
                profile=profile,
            )
            run = os.urandom(4).hex()
            futures = client.map(
                task,
                [url for _, url in todo],
                [index for index, _ in todo],
                pure=False,
                retries=retries,
                key=[f"wds-map-{index}-{run}" for index, _ in todo],
            )
            inputs = {future.key: (index, url) for future, (index, url) in zip(futures, todo)}
            for batch in distributed.as_completed(futures).batches():  # results fetched a batch at a time
                finished = [future for future in batch if future.status == "finished"]
                for result in client.gather(finished, errors="skip"):
                    if "error" in result:  # failed in a way no retry mends (see _shard_task): not done
                        summary["failures"].append({"input": result["input"], "error": result["error"]})
                        continue
                    _record_shard(record, summary, result)
                    written[result["index"]] = len(result["outputs"])
                    if on_progress is not None:
                        on_progress(result)
                for future in batch:
                    if future.status != "finished":
                        exc = future.exception()
                        summary["failures"].append(
                            {"input": redact(inputs[future.key][1]), "error": f"{type(exc).__name__}: {exc}"[:1000]}
                        )
                record.save_soon()
        finally:
            record.flush()
            if own is not None:
                own.__exit__(None, None, None)
            # what an earlier attempt left past the parts of an input written now goes (as for one skipped)
            summary["removed"] += [redact(name) for name in _drop_extra_parts(destination, written)]
            sweep_partials(destination, [index for index, _ in todo])
    summary["seconds"] = time.perf_counter() - started
    return summary


# reshard on Dask: the same outputs as one process, whatever the number of workers


def sample_weight(sample: dict) -> int:
    """The bytes a sample adds to an output shard as ``--maxsize`` counts them: its fields' lengths (text and
    bytes; the ``__key__`` and other ``__`` entries not)."""
    return sum(len(v) for k, v in sample.items() if not k.startswith("__") and isinstance(v, (bytes, str)))


def written_fields(sample: dict) -> dict:
    """What of a sample read back is written to an output shard: its key and fields, not the reader's
    ``__url__`` and other ``__`` entries."""
    return {k: v for k, v in sample.items() if k == "__key__" or not k.startswith("__")}


class OutputCut:
    """Which output shard each sample goes to, in order: a new one when the sample would take the current one
    past ``maxcount`` samples or ``maxsize`` bytes (a sample larger than maxsize gets a shard of its own).
    The one rule for the job in one process and on any number of Dask workers, so that both write the same
    shards under the same names."""

    def __init__(self, maxcount: int, maxsize: float) -> None:
        self.maxcount, self.maxsize = maxcount, maxsize
        self.number, self.count, self.bytes = -1, 0, 0

    def shard_for(self, size: int) -> int:
        if self.number < 0 or self.count >= self.maxcount or (self.count and self.bytes + size > self.maxsize):
            self.number, self.count, self.bytes = self.number + 1, 0, 0
        self.count += 1
        self.bytes += size
        return self.number


def measure_shard(url: str) -> bytes:
    """The weight (:func:`sample_weight`) of each sample of one input shard, in order, as 8-byte integers (on a
    worker: 8 bytes per sample travel back, not the samples)."""
    from ..compat import WebDataset

    sizes = array.array("q")
    for sample in WebDataset([url], shardshuffle=False, empty_check=False):
        sizes.append(sample_weight(sample))
    return sizes.tobytes()


@dataclasses.dataclass(frozen=True)
class OutputSpan:
    """Output shard ``number``: ``count`` samples, from sample ``first`` (counted from 0) of input ``start``."""

    number: int
    start: int
    first: int
    count: int


def plan_outputs(weights: Iterable[bytes], maxcount: int, maxsize: float) -> Iterator[OutputSpan]:
    """The output shards of a reshard, in order, from each input's sample weights (:func:`measure_shard`, in
    input order): cut by :class:`OutputCut` as one process cuts them.  One input's weights are held at a time;
    each span is given as soon as the next one starts."""
    cut = OutputCut(maxcount, maxsize)
    span: Optional[list[int]] = None  # number, start, first, count of the output being filled
    for index, packed in enumerate(weights):
        sizes = array.array("q")
        sizes.frombytes(packed)
        for position, size in enumerate(sizes):
            number = cut.shard_for(size)
            if span is None or number != span[0]:
                if span is not None:
                    yield OutputSpan(*span)
                span = [number, index, position, 0]
            span[3] += 1
    if span is not None:
        yield OutputSpan(*span)


def _tell(topic: str, output: dict) -> None:
    """Tell the client, through the scheduler, that ``output`` is published (nothing outside a Dask worker)."""
    try:
        worker = distributed_module().get_worker()
    except ValueError:  # not on a Dask worker: the result tells it
        return
    worker.log_event(topic, output)


def reshard_part(
    urls: list[str], first: int, outputs: list[tuple[str, int, bool]], compress: Any, topic: Optional[str] = None
) -> list[dict]:
    """Write consecutive output shards of a reshard (on a worker): ``outputs`` are ``(name, samples, write)`` in
    order, filled from sample ``first`` of ``urls[0]`` on, through the inputs that follow; one marked not to
    write (kept by the job record) is read past.  Each is published whole.  Returns name, size and SHA-256 of
    each written; with ``topic``, each is also told as it is published (a Dask event of that topic), so that
    the job's record keeps it even when the task or the job stops before its last output."""
    from ..compat import WebDataset
    from ..io.open import gopen
    from ..jobs.record import HashingWriter
    from ..writer import TarWriter

    def samples() -> Iterator[dict]:
        for position, url in enumerate(urls):
            for skip, sample in enumerate(WebDataset([url], shardshuffle=False, empty_check=False)):
                if position or skip >= first:
                    yield sample

    stream = iter(samples())
    done = []
    for name, count, write in outputs:
        out = HashingWriter(gopen(name, "wb"), name) if write else None
        writer = TarWriter(cast(IO[bytes], out), compress=compress) if out is not None else None
        try:
            for _ in range(count):
                sample = next(stream, None)
                if sample is None:  # the input changed since it was measured: no output is published short
                    raise ConfigError(
                        f"{redact(name)}: its inputs hold fewer samples than when the job measured them "
                        f"({redact(urls[0])} on); an input changed while the job ran: run the job again"
                    )
                if writer is not None:
                    writer.write(written_fields(sample))
            if writer is not None and out is not None:
                writer.close()
                out.close()
                done.append({"name": name, "size": out.count, "sha256": out.sha256.hexdigest(), "samples": count})
                if topic is not None:
                    _tell(topic, done[-1])
        except BaseException:
            if out is not None:
                out.abort()
            raise
    return done
