"""Job records: the shard tools own what they write.

``wds-cloud reshard``, ``wds-cloud convert`` and ``wds-cloud index --output`` keep, beside their outputs, a
record of the job (``<destination with N for the number>.wds-job.json``): the tool, its inputs, its
settings, and for every output finished its size and SHA-256.  With it a rerun is safe:

- a rerun of the same job keeps an output only if the record lists it and it still has that size and
  checksum; anything else at that name is written again;
- a rerun with other inputs or settings is refused before anything is written (it would mix two jobs'
  outputs: 1,200 samples out of 1,000), naming what differs and the fix;
- a file at an output name that no record lists (left by another run, a planted link) is refused, named,
  never kept or followed; once this job's record exists (it is saved before the first output is
  written), an unlisted regular file at one of its output names is the job's own, published by a run
  interrupted before its record caught up, and is written again (a link is still refused);
- an output name that is also an input is refused before anything is written (``bad_argument``), and so is
  a source or destination whose scheme no backend serves;
- the record keeps the output pattern (``destination``): ``out/t-%04d.tar`` and ``out/t-%d.tar`` share the
  record name ``out/t-N.tar.wds-job.json``, so a job of one pattern finding the other's record is refused as
  a bad argument naming that pattern (write to another folder or name), never told the record is malformed
  (records written before this field are checked name by name, as before);
- one job at a time: making the record claims the destination (:mod:`wds_cloud.io.jobclaim`) before the
  job's first expensive step; a second job into it is refused naming the first, a dead job's claim is
  taken over.

A record is data anyone who can write the destination may have edited: every field is checked.  Its
outputs are names this job would write (``destination % i``; with a ``done`` map, exactly the outputs of
each finished input as :func:`output_names` gives them, in order), never a file elsewhere, another input's
output or a path that climbs; sizes and SHA-256 digests are of the right type and range.  A checksum reads
only a regular file (a FIFO, device or link at an output name is refused, never read), and no more than
the size the record claims (+1, to see growth).

The record is a structured file read as data (:mod:`wds_cloud.io.datafile`), written atomically: before the
first output (:meth:`JobRecord.begin`), then as outputs finish (:meth:`JobRecord.save_soon`: at most about
once a second, so that a job of many thousand outputs does not rewrite its record thousands of times), and
at the end.  The shard tools above use it (io/ depends on nothing above it).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import stat
import time
from typing import Any, Optional

from .. import config
from ..errors import ConfigError, ShardNotFoundError, holds_credential, redact
from . import datafile
from .jobclaim import Claim, claim_beside, open_regular
from .open import check_schemes, exists, gopen
from .urls import is_local, local_path, same_location

__all__ = ["JobRecord", "record_url", "claim_url", "output_names", "HashingWriter", "FORMAT"]

FORMAT = "wds_cloud.job"
_FIELD = re.compile(r"%[-+ #0]*\d*d")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_INPUT = re.compile(r"0|[1-9][0-9]{0,17}")
#: the largest output a record may claim (a petabyte)
MAX_OUTPUT_SIZE = datafile.MAX_SHARD_BLOCKS * 512
_FIELDS = {"format", "version", "tool", "inputs", "settings", "outputs", "done", "destination"}


def record_url(destination: str) -> str:
    """Where the record of a job writing ``destination`` (a ``%d`` pattern or one file) lives."""
    return _FIELD.sub("N", destination, count=1) + ".wds-job.json"


def claim_url(destination: str) -> str:
    """Where the claim of the job writing ``destination`` lives while it runs (see :mod:`wds_cloud.io.jobclaim`)."""
    return claim_beside(record_url(destination))


def output_names(destination: str, index: int, parts: int) -> list[str]:
    """The names of the ``parts`` outputs of input ``index`` of a job writing ``destination``: ``destination %
    index``, then the same name with ``-001``, ``-002``, ... before the extension (``wds_cloud.dask``'s naming)."""
    first = destination % index
    root, dot, ext = first.rpartition(".")
    if not dot or "/" in ext:
        root, ext = first, ""
    out = [first]
    for part in range(1, parts):
        out.append(f"{root}-{part:03d}.{ext}" if ext else f"{root}-{part:03d}")
    return out


def _same_name(recorded: str, ours: str) -> bool:
    """Whether a name read from a record spells the job's own name ``ours`` (then ``ours`` is what is used):
    equal, or for local paths equal once made absolute and normalised, decided on the text alone (the
    record's spelling is never opened)."""
    if recorded == ours:
        return True
    if not (is_local(recorded) and is_local(ours)) or "\0" in recorded or len(recorded) > 4096:
        return False
    return os.path.abspath(local_path(recorded)) == os.path.abspath(local_path(ours))


def _own_name(destination: str, name: str) -> Optional[str]:
    """The job's own spelling of ``name`` when it is one of the names ``destination % i`` (or the one-file
    destination itself), else None."""
    if _FIELD.search(destination) is None:
        return destination if _same_name(name, destination) else None
    if len(name) > 4096:
        return None
    for number in set(re.findall(r"\d{1,18}", name)):
        try:
            ours = destination % int(number)
        except (TypeError, ValueError):  # not a pattern of one number field (the tools check theirs first)
            return None
        if _same_name(name, ours):
            return ours
    return None


def _matches(pattern: str, url: str) -> bool:
    """Whether ``url`` is one of the names of the ``%d`` ``pattern``."""
    m = _FIELD.search(pattern)
    if m is None:
        return same_location(pattern, url)
    if is_local(pattern) and is_local(url):
        pattern_dir, url_dir = os.path.dirname(local_path(pattern)), os.path.dirname(local_path(url))
        if os.path.realpath(pattern_dir or ".") != os.path.realpath(url_dir or "."):
            return False
        pattern, url = os.path.basename(local_path(pattern)), os.path.basename(local_path(url))
        m = _FIELD.search(pattern)
        assert m is not None
    # -NNN after the number: the second, third... output of one input (wds_cloud.dask's naming)
    return (
        re.fullmatch(re.escape(pattern[: m.start()]) + r"-?\d+(-\d{3})?" + re.escape(pattern[m.end() :]), url)
        is not None
    )


def _checksum(url: str, limit: Optional[int] = None) -> tuple[int, str]:
    """``(size, SHA-256)`` of the object at ``url``, read once and no further than ``limit`` + 1 bytes (enough
    to tell that it is larger); a local one only when it is a regular file (see :func:`open_regular`)."""
    digest = hashlib.sha256()
    count = 0
    stream = open_regular(local_path(url), "an output") if is_local(url) else gopen(url, "rb")
    with stream:
        while limit is None or count <= limit:
            chunk = stream.read(1 << 20 if limit is None else min(1 << 20, limit + 1 - count))
            if not chunk:
                break
            digest.update(chunk)
            count += len(chunk)
    return count, digest.hexdigest()


def _lstat(path: str) -> Optional[os.stat_result]:
    try:
        return os.lstat(path)
    except (OSError, ValueError):  # nothing there, or a name no file can have
        return None


class HashingWriter:
    """A write stream that counts and hashes what passes to ``stream`` (the checksum a record keeps, with no
    second read of the output)."""

    def __init__(self, stream: Any, name: str) -> None:
        self._stream = stream
        self.name = name
        self.sha256 = hashlib.sha256()
        self.count = 0

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        self.count += len(memoryview(data).cast("B"))
        return self._stream.write(data)

    def flush(self) -> None:
        flush = getattr(self._stream, "flush", None)
        if flush is not None:
            flush()

    def tell(self) -> int:
        return self.count

    def close(self) -> None:
        self._stream.close()

    def abort(self) -> None:
        abort = getattr(self._stream, "abort", None)
        if abort is not None:
            abort()
        else:
            self._stream.close()


def _describe(settings: dict) -> str:
    """The job in a few words for its claim: the function (``map``) first, then the other settings."""
    items = sorted(settings.items(), key=lambda kv: kv[0] != "function")
    return "; ".join(f"{k} {v}" for k, v in items)[:1000]


def _differences(data: dict, tool: str, inputs: list[str], settings: dict) -> list[tuple[str, Any, Any]]:
    """What a job record says that this job does not: ``(name, recorded, now)`` for the tool, the inputs and each
    setting that differs (a command line names each as its flag)."""
    found: list[tuple[str, Any, Any]] = []
    if data.get("tool") != tool:
        found.append(("tool", data.get("tool"), tool))
    if data.get("inputs") != inputs:
        found.append(("inputs", data.get("inputs"), inputs))
    recorded = data.get("settings")
    if not isinstance(recorded, dict):
        found.append(("settings", recorded, settings))
        return found
    for key in sorted(set(recorded) | set(settings), key=str):
        if recorded.get(key) != settings.get(key):
            found.append((str(key), recorded.get(key), settings.get(key)))
    return found


class JobRecord:
    """The record of one job (see the module docstring).  ``destination``: the output pattern or file."""

    def __init__(self, destination: str, tool: str, inputs: list[str], settings: dict) -> None:
        if holds_credential(destination):  # its output names would be the record's keys, the record's own name
            raise ConfigError(
                f"{redact(destination)} carries a credential in its text; the job record would list it with "
                "every output name: give the credential through the environment or a storage profile "
                "(WDS_CLOUD_CONFIG) instead",
                bad_argument=True,
            )
        self.destination = destination
        self.url = record_url(destination)
        self.tool = tool
        self.inputs = [redact(u) for u in inputs]
        self.settings = dict(settings)
        self.outputs: dict[str, dict] = {}
        #: what a tool keeps besides (``map``: ``"done"``, each finished input's outputs), saved with the record
        self.extra: dict[str, Any] = {}
        #: whether a record of this job was found (then unlisted files at its output names are its own)
        self.found = False
        self._saved_at = 0.0
        self._save_cost = 0.0
        self._unsaved = False
        for url in inputs:
            if _matches(destination, url) or same_location(self.url, url):
                raise ConfigError(
                    f"{redact(url)} is both an input and an output name of this {tool} ("
                    f"{redact(destination)}): it would be overwritten while it is read; write the "
                    "output somewhere else",
                    bad_argument=True,
                )
        # a URL no backend serves can never be read or written: refused before the claim, nothing created
        check_schemes([destination, *inputs])
        # the destination is this job's before anything expensive (a cluster, an input read): a second job
        # started meanwhile is refused naming this one (issue 41)
        self._claim = Claim(destination, self.url, tool, _describe(settings))
        self._claim.acquire()
        try:
            self._load()
        except BaseException:
            self._claim.release()
            raise

    def release(self) -> None:
        """Give the destination's claim back (at the end of the job; also done when the record is dropped)."""
        self._claim.release()

    def __enter__(self) -> JobRecord:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _read(self) -> Any:
        """The record's document, or ShardNotFoundError; a local record only when it is a regular file."""
        if not is_local(self.url):
            return datafile.load(self.url, "job record")
        limit = config.current().max_data_file_size
        with open_regular(local_path(self.url), "the job record") as stream:
            data = stream.read(limit + 1)
        datafile.need(
            len(data) <= limit,
            redact(self.url),
            "the job record",
            f"is larger than {limit} bytes, the most read for one",
            "if it is genuine, raise WDS_MAX_DATA_FILE_SIZE",
        )
        return datafile.parse_json(data, redact(self.url), "job record")

    def _load(self) -> None:
        try:
            data = self._read()
        except ShardNotFoundError:
            self._check_strangers()
            return
        where = redact(self.url)
        fix = f"remove {where} and the outputs it lists, or choose another destination"

        def need(ok: bool, field: str, problem: str) -> None:
            datafile.need(ok, where, field, problem, fix)

        need(
            isinstance(data, dict) and data.get("format") == FORMAT and type(data.get("version")) is int,
            "the job record",
            f"is not one ({FORMAT} version 1)",
        )
        need(data["version"] == 1, "'version'", "must be 1 (a record of another version of wds_cloud)")
        need(
            set(data) <= _FIELDS,
            "the job record",
            f"holds fields no record has ({datafile.shown(sorted(set(data) - _FIELDS))})",
        )
        self._check_pattern(data.get("destination"), need)
        conflict = _differences(data, self.tool, self.inputs, self.settings)
        if conflict:
            said = "; ".join(
                f"{key} {datafile.shown(then)} was recorded, {datafile.shown(now)} given now"
                for key, then, now in conflict
            )
            raise ConfigError(
                f"{redact(self.destination)} holds the outputs of another job ({said}); its outputs cannot be "
                f"mixed with this one's: run again with the recorded settings, or {fix}",
                conflict=conflict,
                destination=redact(self.destination),
                record=where,
            )
        outputs = data.get("outputs")
        need(isinstance(outputs, dict), "'outputs'", "must map each output to its size and sha256")
        for name, entry in outputs.items():
            need(
                isinstance(entry, dict)
                and set(entry) == {"size", "sha256"}
                and datafile.is_count(entry["size"], MAX_OUTPUT_SIZE)
                and isinstance(entry["sha256"], str)
                and _SHA256.fullmatch(entry["sha256"]) is not None,
                "'outputs'",
                f"must map each output to its size (0 to {MAX_OUTPUT_SIZE}) and sha256 (64 hex digits), not "
                f"{datafile.shown(name)}: {datafile.shown(entry)}",
            )
        done = data.get("done")
        if done is None:
            # the tools without a done map write destination % k: every name listed is one of those
            own: dict[str, dict] = {}
            for name, entry in outputs.items():
                ours = _own_name(self.destination, name)
                need(
                    ours is not None and ours not in own,
                    "'outputs'",
                    f"lists {datafile.shown(name)}, which is not an output name of this job "
                    f"({redact(self.destination)})",
                )
                own[str(ours)] = entry
            self.outputs = own
        else:
            self.outputs, self.extra["done"] = self._check_done(done, outputs, need)
        self.found = True
        self._check_strangers()

    def _check_pattern(self, recorded: Any, need: Any) -> None:
        """Refuse the record of a job with another output pattern that shares this one's record name
        (``out/t-%04d.tar`` and ``out/t-%d.tar`` both keep ``out/t-N.tar.wds-job.json``): not a malformed
        record, another job's destination (issue 41).  Records written before the pattern was kept have no
        ``destination``: their outputs are checked against this job's names as before."""
        if recorded is None:
            return
        need(
            isinstance(recorded, str) and 0 < len(recorded) <= 4096,
            "'destination'",
            "must be the output pattern of the job that wrote the record",
        )
        # the folder is not compared: a destination moved (or named from another working directory) keeps its record
        then, now = recorded.rsplit("/", 1)[-1], self.destination.rsplit("/", 1)[-1]
        if then == now:
            return
        need(
            _FIELD.sub("N", then, count=1) == _FIELD.sub("N", now, count=1),
            "'destination'",
            f"names {datafile.shown(recorded)}, whose job record is not this one",
        )
        raise ConfigError(
            f"{redact(self.destination)}: its job record {redact(self.url)} belongs to another job, whose output "
            f"pattern is {redact(recorded)!r} (the two patterns share one record name); write this job to "
            "another folder or under another name",
            bad_argument=True,
            destination=redact(self.destination),
            record=redact(self.url),
            other_pattern=redact(recorded),
        )

    def _check_done(self, done: Any, outputs: dict, need: Any) -> tuple[dict, dict]:
        """The ``done`` map (finished input -> its outputs) checked against this job: each key an input of the
        job spelled as the job writes it, each value exactly that input's first outputs in order
        (:func:`output_names`), and the record's outputs exactly those; in the job's own spelling."""
        need(
            isinstance(done, dict) and len(done) <= len(self.inputs),
            "'done'",
            f"must map at most the job's {len(self.inputs)} inputs to their outputs",
        )
        checked: dict[str, list] = {}
        own: dict[str, dict] = {}
        listed = set()
        for key, names in done.items():
            need(
                _INPUT.fullmatch(key) is not None and int(key) < len(self.inputs),
                "'done'",
                f"names input {datafile.shown(key)}, which this job of {len(self.inputs)} inputs does not have "
                "(inputs are numbered 0, 1, ... as given)",
            )
            need(
                isinstance(names, list) and 0 < len(names) <= len(outputs),
                "'done'",
                f"must map input {key} to the list of its outputs (one or more the record lists)",
            )
            ours = output_names(self.destination, int(key), len(names))
            for name, expected in zip(names, ours):
                need(
                    isinstance(name, str) and _same_name(name, expected),
                    "'done'",
                    f"maps input {key} to {datafile.shown(name)}, which is not its output: its outputs are "
                    f"{datafile.shown(ours[: len(names)])} (only names this job writes for that input count)",
                )
                need(
                    name in outputs,
                    "'done'",
                    f"maps input {key} to {datafile.shown(name)}, which 'outputs' does not list",
                )
                listed.add(name)
                own[expected] = outputs[name]
            checked[str(int(key))] = ours
        extra = set(outputs) - listed
        need(
            not extra,
            "'outputs'",
            f"lists {datafile.shown(sorted(extra))}, which no finished input in 'done' gave",
        )
        return own, checked

    def _check_strangers(self) -> None:
        """Refuse local files at output names that this job's record does not list, before anything is written
        (with a record of this job found, only what is not a regular file: regular files there are its own,
        see the module docstring)."""
        if not is_local(self.destination) or _FIELD.search(self.destination) is None:
            return
        pattern = local_path(self.destination)
        found = glob.glob(glob.escape(pattern[: _FIELD.search(pattern).start()]) + "*")  # type: ignore[union-attr]
        for path in sorted(found):
            if _matches(pattern, path) and not self._listed(path):
                st = _lstat(path)
                if st is not None and (not self.found or not stat.S_ISREG(st.st_mode)):
                    raise self._stranger(path)

    def _listed(self, url: str) -> bool:
        return any(same_location(url, name) for name in self.outputs)

    def _stranger(self, url: str) -> ConfigError:
        return ConfigError(
            f"{redact(url)} is at an output name of this {self.tool}, but no record of this job says it "
            f"wrote it (the record is {redact(self.url)}); move it away or choose another destination",
            url=url,
        )

    def keep(self, output: str) -> bool:
        """Whether ``output`` is already done by this job and unchanged (then it is kept); False: write it.
        A file there that the job did not write is refused, and so is anything but a regular file (a FIFO, a
        device, a link: never read)."""
        local = is_local(output)
        st = _lstat(local_path(output)) if local else None
        present = st is not None if local else exists(output)
        entry = self.outputs.get(output)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise self._stranger(output)
        if st is not None and not stat.S_ISREG(st.st_mode):
            open_regular(local_path(output), "an output")  # raises, naming what is there
        if entry is None:
            if present and not self.found:
                raise self._stranger(output)
            return False
        if not present or st is not None and st.st_size != entry["size"]:
            return False
        size, digest = _checksum(output, limit=entry["size"])
        return size == entry["size"] and digest == entry["sha256"]

    def open(self, output: str) -> HashingWriter:
        """A write stream for ``output`` (published whole when closed) whose checksum :meth:`finish` records."""
        if is_local(output) and os.path.islink(local_path(output)):
            raise self._stranger(output)
        return HashingWriter(gopen(output, "wb"), output)

    def finish(self, writer: Any, stream: HashingWriter) -> None:
        """Close ``writer`` (a TarWriter over ``stream``, from :meth:`open`) and ``stream``, which publishes the
        output whole, then record it as finished and save the record."""
        writer.close()
        stream.close()
        self.outputs[stream.name] = {"size": stream.count, "sha256": stream.sha256.hexdigest()}
        self.save_soon()

    def written(self, output: str) -> None:
        """Record ``output``, written by other means, as finished (its checksum read back) and save the record."""
        size, digest = _checksum(output)
        self.outputs[output] = {"size": size, "sha256": digest}
        self.save()

    def begin(self) -> None:
        """Save the record before the job writes its first output (a new job), so that what a run interrupted
        before its next save leaves at the job's output names is known to be the job's own."""
        if not self.found:
            self.save()
            self.found = True

    def save_soon(self) -> None:
        """Save now if the last save is a second old (or twenty times what a save costs, for huge records);
        else at the next call or :meth:`save`.  An output published but not yet saved is written again by a
        rerun (see the module docstring): nothing is lost, some work is repeated."""
        self._unsaved = True
        if time.monotonic() - self._saved_at >= max(1.0, 20 * self._save_cost):
            self.save()

    def save(self) -> None:
        """Write the record now (atomically: published whole)."""
        started = time.monotonic()
        data = {
            "format": FORMAT,
            "version": 1,
            "tool": self.tool,
            "inputs": self.inputs,
            "settings": self.settings,
            "destination": self.destination,
            "outputs": self.outputs,
            **self.extra,
        }
        with gopen(self.url, "wb") as out:
            out.write(json.dumps(data, sort_keys=True, separators=(",", ":")).encode("utf-8"))
        self._saved_at = time.monotonic()
        self._save_cost = self._saved_at - started
        self._unsaved = False

    def flush(self) -> None:
        """Save what :meth:`save_soon` has not saved yet (call at the end of a job, and when it stops)."""
        if self._unsaved:
            self.save()
