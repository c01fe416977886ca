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
- an output name that is also an input is refused before anything is written.

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
import time
from typing import Any

from ..errors import ConfigError, ShardNotFoundError, holds_credential, redact
from . import datafile
from .integrity import Hashing
from .open import exists, gopen
from .urls import is_local, local_path, same_location

__all__ = ["JobRecord", "record_url", "HashingWriter", "FORMAT"]

FORMAT = "wds_cloud.job"
_FIELD = re.compile(r"%[-+ #0]*\d*d")


def record_url(destination: str) -> str:
    """Where the record of a job writing ``destination`` (a ``%d`` pattern or one file) lives."""
    return _FIELD.sub("N", destination, count=1) + ".wds-job.json"


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


def _checksum(url: str) -> tuple[int, str]:
    """``(size, SHA-256)`` of the object at ``url``, read once."""
    digest = hashlib.sha256()
    with gopen(url, "rb") as stream:
        counted = Hashing(stream, digest)
        counted.drain()
    return counted.count, digest.hexdigest()


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


class JobRecord:
    """The record of one job (see the module docstring).  ``destination``: the output pattern or file."""

    def __init__(self, destination: str, tool: str, inputs: list[str], settings: dict) -> None:
        if holds_credential(destination):  # its output names would be the record's keys, the record's own name
            raise ConfigError(
                f"{redact(destination)} carries a credential in its text; the job record would list it with "
                "every output name: give the credential through the environment or a storage profile "
                "(WDS_CLOUD_CONFIG) instead"
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
                    "output somewhere else"
                )
        self._load()

    def _load(self) -> None:
        try:
            data = datafile.load(self.url, "job record")
        except ShardNotFoundError:
            self._check_strangers()
            return
        where = redact(self.url)
        fix = f"remove {where} and the outputs it lists, or choose another destination"
        datafile.need(
            isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == 1,
            where,
            "the job record",
            f"is not one ({FORMAT} version 1)",
            fix,
        )
        outputs = data.get("outputs")
        datafile.need(
            isinstance(outputs, dict)
            and all(
                isinstance(v, dict) and datafile.is_count(v.get("size")) and isinstance(v.get("sha256"), str)
                for v in outputs.values()
            ),
            where,
            "'outputs'",
            "must map each output to its size and sha256",
            fix,
        )
        differs = [
            f"{key}: recorded {datafile.shown(data.get(key))}, now {datafile.shown(value)}"
            for key, value in (("tool", self.tool), ("inputs", self.inputs), ("settings", self.settings))
            if data.get(key) != value
        ]
        if differs:
            raise ConfigError(
                f"{redact(self.destination)} holds the outputs of another job ({'; '.join(differs)}); "
                f"its outputs cannot be mixed with this one's: {fix}"
            )
        self.outputs = outputs
        self.found = True
        done = data.get("done")
        if done is not None:
            datafile.need(
                isinstance(done, dict)
                and all(
                    isinstance(k, str)
                    and k.isdigit()
                    and isinstance(v, list)
                    and all(isinstance(n, str) and n in outputs for n in v)
                    for k, v in done.items()
                ),
                where,
                "'done'",
                "must map each finished input to outputs it lists",
                fix,
            )
            self.extra["done"] = done
        self._check_strangers()

    def _check_strangers(self) -> None:
        """Refuse local files at output names that this job's record does not list, before anything is written
        (with a record of this job found, only links: regular files there are its own, see the module docstring)."""
        if not is_local(self.destination) or _FIELD.search(self.destination) is None:
            return
        pattern = local_path(self.destination)
        found = glob.glob(glob.escape(pattern[: _FIELD.search(pattern).start()]) + "*")  # type: ignore[union-attr]
        for path in sorted(found):
            if _matches(pattern, path) and not self._listed(path) and (not self.found or os.path.islink(path)):
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
        A file there that the job did not write is refused."""
        local = is_local(output)
        present = os.path.lexists(local_path(output)) if local else exists(output)
        entry = self.outputs.get(output)
        if entry is None:
            if present and (not self.found or local and os.path.islink(local_path(output))):
                raise self._stranger(output)
            return False
        if not present:
            return False
        if local and os.path.islink(local_path(output)):
            raise self._stranger(output)
        size, digest = _checksum(output)
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
