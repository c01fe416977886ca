"""Job records: the shard tools own what they write.

``wds-cloud reshard``, ``wds-cloud convert``, ``wds-cloud map`` (``wds_cloud.dask.map_shards``) and
``wds-cloud index --output`` keep, beside their outputs, a record of the job (``<destination with N for the
number>.wds-job.json``): the tool, its inputs, its settings, and for every output finished its size and
SHA-256.  With it a rerun is safe:

- a rerun of the same job keeps an output only if the record lists it and it still has that size and
  checksum; anything else at that name is written again;
- a rerun with other inputs or settings is refused before anything is written (it would mix two jobs'
  outputs: 1,200 samples out of 1,000), naming what differs and the fix;
- a file at an output name that no record lists (left by another run, a planted link) is refused, named,
  never kept or followed; once this job's record exists (it is saved before the first output is
  written), an unlisted regular file at one of its output names is the job's own, published by a run
  interrupted before its record caught up, and is removed when the record is loaded (then written again
  when an output of this run takes its name; a link is still refused), and so is the temporary file of an
  output or the record whose writer's process is gone (:attr:`JobRecord.removed` lists both);
- an output name that is also an input is refused before anything is written (``bad_argument``), and so is
  a source or destination whose scheme no backend serves;
- the record keeps the output pattern (``destination``): ``out/t-%04d.tar`` and ``out/t-%d.tar`` share the
  record name ``out/t-N.tar.wds-job.json``, so a job of one pattern finding the other's record is refused as
  a bad argument naming that pattern (write to another folder or name), never told the record is malformed
  (records written before this field are checked name by name, as before);
- one job at a time: making the record claims the destination (:mod:`wds_cloud.jobs.claim`) before the
  job's first expensive step; a second job into it is refused naming the first, a dead job's claim is
  taken over.

**Its form: one record a line** (version 2), so that a job of 10^7 outputs writes a record its rerun reads
back: the ``WDS_MAX_DATA_FILE_SIZE`` cap applies to each line, the file is read as a stream
(:func:`wds_cloud.io.datafile.iter_lines`), and what is kept while it is read is what the job holds per
output anyway.  The first line is the header (``format``, ``version`` 2, ``tool``, ``settings``,
``destination``, ``inputs``: their number), then one line per input in order (``{"input": URL}``, redacted),
then a line per finished output (``{"output": NAME, "size": ..., "sha256": ...}``) or, for ``map``, per
finished input (``{"done": INDEX, "outputs": [ {"output": ..., "size": ..., "sha256": ...}, ...]}``).
Output names are file names in the destination's folder, so a record moved with its folder still holds.
A record of version 1 (one JSON document, written before) is still read, and written again in this form
by the first run that saves.

A record is data anyone who can write the destination may have edited: every field of every line is
checked, and an error names the file, the line and the field.  Its outputs are names this job would write
(``destination % i``; for ``map``, exactly the outputs of each finished input as :func:`output_names` gives
them, in order), never a file elsewhere, another input's output, a path that climbs, or one output listed
twice; sizes and SHA-256 digests are of the right type and range.  A forged line with a true checksum gains
nothing: an output is kept only when it is one of the job's own names and reads back as recorded.  A
checksum reads only a regular file (a FIFO, device or link at an output name is refused, never read), and
no more than the size the record claims (+1, to see growth).

**Costs grow with the job, never with its square.**  Loading a record is one pass over its lines; finding
strangers is one listing of the destination's folder, each name looked up in a table keyed by its file name
(no comparison of every file with every output, no ``realpath`` per pair).  Saving as outputs finish
appends their lines to a local record (each line written once: the bytes written are those of the record);
where appending is not possible (a record on an object store, or one that must lose a line: an output
written again, an input done again, a version-1 record) the whole record is written again, no more often
than once a second and no more than one twentieth of the time the job has run, so that saving costs the
job at most a small fixed share of its time.  A run killed mid-line leaves a last line without its end: it
is ignored (that output is written again) and the record is written whole at the next save.

The shard tools (``tools/``, ``cli/``) use it; it builds on ``io/``, which depends on nothing above it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from typing import Any, Optional, cast

from .. import config
from ..errors import ConfigError, ShardNotFoundError, holds_credential, redact
from ..io import datafile
from ..io.open import check_schemes, exists, gopen
from ..io.urls import is_local, local_path, resolved, same_location
from .claim import Claim, claim_beside, open_regular, process_gone

__all__ = [
    "JobRecord",
    "record_url",
    "claim_url",
    "output_names",
    "output_number",
    "HashingWriter",
    "Output",
    "FORMAT",
    "VERSION",
]

FORMAT = "wds_cloud.job"
#: the version written: one record a line (version 1, one JSON document, is still read)
VERSION = 2
_FIELD = re.compile(r"%[-+ #0]*\d*d")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: the temporary file a local output or record is written to before it is published (io/atomic.py's
#: temp_name_for): the name it will have, the writer's pid, a random tag
_PARTIAL = re.compile(r"\.(.+)\.(\d{1,10})\.[0-9a-f]{8}\.partial")
_INPUT = re.compile(r"0|[1-9][0-9]{0,17}")
#: the largest output a record may claim (a petabyte)
MAX_OUTPUT_SIZE = datafile.MAX_SHARD_BLOCKS * 512
_FIELDS = {"format", "version", "tool", "inputs", "settings", "outputs", "done", "destination"}
_HEADER = {"format", "version", "tool", "inputs", "settings", "destination"}
#: the longest file name an output may have (file systems allow 255 bytes)
_NAME_MOST = 1024
#: bytes gathered before one write when a record is written whole
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Output:
    """What a record keeps of one finished output: its size, its SHA-256 (hex) and, in a record of finished
    inputs (``map``'s), the input it belongs to."""

    size: int
    sha256: str
    input: Optional[int] = None


def record_url(destination: str) -> str:
    """Where the record of a job writing ``destination`` (a ``%d`` pattern or one file) lives."""
    return _FIELD.sub("N", destination, count=1) + ".wds-job.json"


def claim_url(destination: str) -> str:
    """Where the claim of the job writing ``destination`` lives while it runs (see :mod:`wds_cloud.jobs.claim`)."""
    return claim_beside(record_url(destination))


def _part_name(first: str, part: int) -> str:
    """The name of part ``part`` (0: ``first`` itself) of the input whose first output is ``first``."""
    if part == 0:
        return first
    root, dot, ext = first.rpartition(".")
    if not dot or "/" in ext:
        root, ext = first, ""
    return f"{root}-{part:03d}.{ext}" if ext else f"{root}-{part:03d}"


def output_names(destination: str, index: int, parts: int) -> list[str]:
    """The names of the ``parts`` outputs of input ``index`` of a job writing ``destination``: ``destination %
    index``, then the same name with ``-001``, ``-002``, ... before the extension (``wds_cloud.dask``'s naming)."""
    first = destination % index
    return [_part_name(first, part) for part in range(parts)]


class _Names:
    """The output names of one destination, recognised from their text alone: the folder they live in (the
    number field is in the last path segment, :mod:`wds_cloud.jobs.patterns`) and the shapes of a file name
    there.  Built once per destination: a name is then recognised in constant time."""

    def __init__(self, destination: str) -> None:
        self.destination = destination
        cut = destination.rfind("/") + 1
        self.folder, self.base = destination[:cut], destination[cut:]
        field = _FIELD.search(self.base)
        self.pattern = field is not None
        if field is None:
            self.loose = self.exact = None
            return
        pre, post = self.base[: field.start()], self.base[field.end() :]
        number, part = r"(\d{1,18})", r"(?:-(\d{3,18}))?"
        # the shape a rerun refuses strangers at: any number, a -NNN part (as records before this one did)
        self.loose = re.compile(re.escape(pre) + r"-?\d+(?:-\d{3,})?" + re.escape(post))
        # the exact shape of output_names' names: the part goes before the extension of destination % i
        if "." in post:
            mid, _, ext = post.rpartition(".")
            exact = re.escape(pre) + number + re.escape(mid) + part + re.escape("." + ext)
            self.order = (1, 2)
        elif "." in pre:
            root, _, ext = pre.rpartition(".")
            exact = re.escape(root) + part + re.escape("." + ext) + number + re.escape(post)
            self.order = (2, 1)
        else:
            exact = re.escape(pre) + number + re.escape(post) + part
            self.order = (1, 2)
        self.exact = re.compile(exact)

    def key(self, name: str) -> Optional[str]:
        """The file name of ``name`` when it is spelled as this job spells its outputs (in its folder)."""
        if name.startswith(self.folder) and "/" not in name[len(self.folder) :]:
            return name[len(self.folder) :]
        return None

    def number(self, base: str) -> Optional[tuple[int, int]]:
        """``(input, part)`` when the file name ``base`` is exactly one of this job's output names, else None."""
        if self.exact is None or len(base) > _NAME_MOST:
            return None
        m = self.exact.fullmatch(base)
        if m is None:
            return None
        index, part = int(m.group(self.order[0])), int(m.group(self.order[1]) or 0)
        if part == 0 and m.group(self.order[1]) is not None:
            return None  # -000 is never written: part 0 is the first name itself
        return (index, part) if _part_name(self.base % index, part) == base else None


@functools.lru_cache(maxsize=64)
def _names(destination: str) -> _Names:
    return _Names(destination)


def output_number(destination: str, name: str) -> Optional[tuple[int, int]]:
    """``(input, part)`` when the file name ``name`` (no folder) is exactly the name :func:`output_names` gives
    part ``part`` of input ``input`` of a job writing ``destination``, else None: how one listing of a folder
    is read back into the outputs of each input."""
    return _names(destination).number(name)


def _same_name(recorded: str, ours: str) -> bool:
    """Whether a name read from a version-1 record spells the job's own name ``ours`` (then ``ours`` is what is
    used): equal, or for local paths equal once made absolute and normalised, decided on the text alone (the
    record's spelling is never opened)."""
    if recorded == ours:
        return True
    if not (is_local(recorded) and is_local(ours)) or "\0" in recorded or len(recorded) > 4096:
        return False
    return os.path.abspath(local_path(recorded)) == os.path.abspath(local_path(ours))


def _own_name(destination: str, name: str) -> Optional[str]:
    """The job's own spelling of ``name`` (from a version-1 record) when it is one of the names ``destination %
    i`` (or the one-file destination itself), else None."""
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


class _InputCheck:
    """Whether an input is also an output name or the record: the destination's folder and the record resolved
    once, each input's folder once per folder (inputs share a few), so checking N inputs costs O(N)."""

    def __init__(self, destination: str, record: str) -> None:
        self.destination, self.record = destination, record
        self.names = _names(destination)
        self.local = is_local(destination)
        if self.local:
            self.folder = resolved(local_path(self.names.folder) or ".")
            self.targets = {resolved(local_path(record))}
            if not self.names.pattern:  # one file: a link to it is it
                self.targets.add(resolved(local_path(destination)))
        self.seen: dict[str, str] = {}

    def clashes(self, url: str) -> bool:
        if not (self.local and is_local(url)):
            return self._matches_text(url) or same_location(self.record, url)
        path = local_path(url)
        folder, base = os.path.split(path)
        where = self.seen.get(folder)
        if where is None:
            where = self.seen[folder] = resolved(folder or ".")
        if where == self.folder and self._matches_base(base):
            return True
        if os.path.join(where, base) in self.targets:
            return True
        try:
            link = stat.S_ISLNK(os.lstat(path).st_mode)
        except (OSError, ValueError):
            return False
        return link and resolved(path) in self.targets

    def _matches_base(self, base: str) -> bool:
        if self.names.loose is None:
            return base == self.names.base
        return self.names.loose.fullmatch(base) is not None

    def _matches_text(self, url: str) -> bool:
        base = self.names.key(url)
        return base is not None and self._matches_base(base)


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


def _differences(data: dict, tool: str, settings: dict) -> list[tuple[str, Any, Any]]:
    """What a job record says that this job does not: ``(name, recorded, now)`` for the tool and each setting
    that differs (a command line names each as its flag); the inputs are compared by the caller."""
    found: list[tuple[str, Any, Any]] = []
    if data.get("tool") != tool:
        found.append(("tool", data.get("tool"), tool))
    recorded = data.get("settings")
    if not isinstance(recorded, dict):
        found.append(("settings", recorded, settings))
        return found
    for key in sorted(set(recorded) | set(settings), key=str):
        if recorded.get(key) != settings.get(key):
            found.append((str(key), recorded.get(key), settings.get(key)))
    return found


def _line(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8") + b"\n"


def _output_line(base: str, entry: Output) -> dict:
    return {"output": base, "size": entry.size, "sha256": entry.sha256}


def _loads(text: bytes) -> Any:
    """``text`` parsed when it is JSON, else None."""
    try:
        return json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError):
        return None


def _not_json(text: bytes) -> str:
    """Why a line :func:`_loads` refused is refused: not UTF-8 (the byte named, as the description reader says
    it), or not JSON.  Composed only when a check fails."""
    try:
        text.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text (byte {exc.start})"
    return "is not JSON"


class _OutputsView(Mapping):
    """The outputs a record lists, by the job's own spelling of their names, each ``{"size": ..., "sha256":
    ...}``: a read-only view (a record changes through its methods, which save what they change)."""

    def __init__(self, record: JobRecord) -> None:
        self._record = record

    def __getitem__(self, name: str) -> dict:
        entry = self._record.entry(name)
        if entry is None:
            raise KeyError(name)
        return {"size": entry.size, "sha256": entry.sha256}

    def __iter__(self) -> Iterator[str]:
        return self._record.listed()

    def __len__(self) -> int:
        return self._record.count()


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
        self._where = redact(self.url)
        self.tool = tool
        self.inputs = [redact(u) for u in inputs]
        self.settings = dict(settings)
        #: whether a record of this job was found (then unlisted files at its output names are its own)
        self.found = False
        #: files removed from a local destination when the record was loaded (see :meth:`_check_strangers`)
        self.removed: list[str] = []
        self._names = _names(destination)
        #: what is known of each output, by its file name (the destination's folder is the same for all)
        self._entries: dict[str, Output] = {}
        #: finished input -> how many outputs it gave (a record of finished inputs: map's); None: none kept
        self._done: Optional[dict[int, int]] = None
        #: lines of outputs finished since the last save, appended at the next
        self._pending: list[bytes] = []
        #: the record on disk says what appending cannot correct (a line to lose, an old version, a cut line)
        self._rewrite = False
        self._saved_at = 0.0
        self._save_cost = 0.0
        self._unsaved = False
        check = _InputCheck(destination, self.url)
        for url in inputs:
            if check.clashes(url):
                raise ConfigError(
                    f"{redact(url)} is both an input and an output name of this {tool} ("
                    f"{redact(destination)}): it would be overwritten while it is read; write the "
                    "output somewhere else",
                    bad_argument=True,
                )
        # a URL no backend serves can never be read or written: refused before the claim, nothing created
        check_schemes([destination, *inputs])
        # the destination is this job's before anything expensive (a cluster, an input read): a second job
        # started meanwhile is refused naming this one, before either writes an output
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

    # -- what it lists

    @property
    def outputs(self) -> Mapping[str, dict]:
        """The outputs listed, by the job's own spelling of their names: ``{"size": ..., "sha256": ...}`` each."""
        return _OutputsView(self)

    @property
    def extra(self) -> dict:
        """``{"done": {input number: [its outputs]}}`` for a record of finished inputs (``map``'s), else ``{}``:
        a copy built when asked (for reading; :meth:`finished` answers for one input)."""
        if self._done is None:
            return {}
        return {"done": {str(k): output_names(self.destination, k, n) for k, n in self._done.items()}}

    def entry(self, output: str) -> Optional[Output]:
        """What the record says of ``output`` (the job's own spelling of its name), or None."""
        key = self._names.key(output)
        return None if key is None else self._entries.get(key)

    def listed(self) -> Iterator[str]:
        """The names of the outputs listed, as the job spells them."""
        return (self._names.folder + key for key in list(self._entries))

    def count(self) -> int:
        """How many outputs the record lists."""
        return len(self._entries)

    def finished(self, index: int) -> Optional[list[str]]:
        """The outputs of input ``index`` when the record lists it as finished (``map``), else None."""
        parts = None if self._done is None else self._done.get(index)
        return None if parts is None else output_names(self.destination, index, parts)

    # -- reading it

    def _lines(self) -> Generator[tuple[int, bytes], None, None]:
        """The record's lines, read as a stream; ShardNotFoundError when there is none.  A local record is read
        only when it is a regular file (a FIFO, a device or a link there is refused, never read; the file
        backend refuses one put there in between)."""
        if is_local(self.url):
            open_regular(local_path(self.url), "the job record").close()
        lines = cast(Generator[tuple[int, bytes], None, None], datafile.iter_lines(self.url, "job record"))
        try:
            yield from lines
        except ShardNotFoundError as exc:
            if not is_local(self.url):
                raise
            raise ConfigError(f"{redact(self.url)}: the job record changed while it was read ({exc})") from None
        finally:
            lines.close()

    def _read_whole(self) -> Any:
        """The record as one JSON document (version 1, written over several lines), bounded as a whole file."""
        if not is_local(self.url):
            return datafile.load(self.url, "job record")
        limit = config.current().max_data_file_size
        with open_regular(local_path(self.url), "the job record") as stream:
            data = stream.read(limit + 1)
        datafile.need(
            len(data) <= limit,
            redact(self.url),
            "the job record",
            f"is larger than {limit} bytes, the most read for one written as one document",
            "if it is genuine, raise WDS_MAX_DATA_FILE_SIZE",
        )
        return datafile.parse_json(data, redact(self.url), "job record")

    def _fix(self) -> str:
        return f"remove {self._where} and the outputs it lists, or choose another destination"

    def _load(self) -> None:
        try:
            lines = self._lines()
            first = next(lines, None)
        except ShardNotFoundError:
            self._check_strangers()
            return
        where, fix = redact(self.url), self._fix()
        try:
            head = None if first is None else _loads(first[1])
            if isinstance(head, dict) and head.get("format") == FORMAT and head.get("version") == VERSION:
                self._load_lines(head, lines)
            else:
                if head is not None:  # a version-1 document on its first line: nothing may follow it
                    extra = next(lines, None)
                    datafile.need(
                        extra is None,
                        where,
                        "the job record",
                        f"holds more after its document (line {extra and extra[0]})",
                        fix,
                    )
                    datafile.check_shape(head, where, "job record")
                    doc = head
                else:
                    lines.close()
                    doc = self._read_whole() if first is not None else datafile.parse_json(b"", where, "job record")
                self._load_document(doc)
        finally:
            lines.close()
        self.found = True
        self._check_strangers()

    def _conflict(self, conflict: list[tuple[str, Any, Any]]) -> ConfigError:
        said = "; ".join(
            f"{key} {datafile.shown(then)} was recorded, {datafile.shown(now)} given now" for key, then, now in conflict
        )
        return ConfigError(
            f"{redact(self.destination)} holds the outputs of another job ({said}); its outputs cannot be "
            f"mixed with this one's: run again with the recorded settings, or {self._fix()}",
            conflict=conflict,
            destination=redact(self.destination),
            record=redact(self.url),
        )

    def _load_lines(self, head: dict, lines: Iterator[tuple[int, bytes]]) -> None:
        """A record of one record a line (version 2): the header ``head`` (its first line), then the rest."""
        where, fix = redact(self.url), self._fix()

        def need(ok: bool, field: str, problem: str, line: int = 1) -> None:
            datafile.need(ok, f"{where} line {line}", field, problem, fix)

        need(set(head) == _HEADER, "the header", f"must hold exactly {sorted(_HEADER)}")
        need(isinstance(head["tool"], str), "'tool'", "must name the tool")
        need(isinstance(head["settings"], dict), "'settings'", "must map each setting to its value")
        count = head["inputs"]
        need(datafile.is_count(count, 1 << 62), "'inputs'", "must be the number of inputs (0 or more)")
        self._check_pattern(head["destination"], lambda ok, field, problem: need(ok, field, problem))
        conflict = _differences(head, self.tool, self.settings)
        if count != len(self.inputs):
            conflict.append(("inputs", f"{count} inputs", f"{len(self.inputs)} inputs"))
        elif not conflict:
            for position, url in enumerate(self.inputs):
                number, text = next(lines, (0, b""))
                doc = _loads(text)
                if doc is None and number:
                    need(False, "the line", _not_json(text), number)
                need(
                    isinstance(doc, dict) and set(doc) == {"input"} and isinstance(doc["input"], str),
                    "'input'",
                    f'must be input {position} of the {count} the header counts ({{"input": URL}})'
                    + ("" if number else "; the record ends before it"),
                    number,
                )
                if doc["input"] != url:
                    conflict.append(("inputs", f"input {position} {doc['input']}", f"input {position} {url}"))
                    break
        if conflict:
            raise self._conflict(conflict)
        for number, text in lines:
            cut = not text.endswith(b"\n")
            doc = _loads(text)
            if cut:  # only the last line can lack its end: a run killed while appending it
                self._rewrite = True
                if doc is None:
                    continue  # its output is not listed: a rerun writes it again
            if doc is None:
                need(False, "the line", _not_json(text), number)
            if isinstance(doc, dict) and set(doc) == {"output", "size", "sha256"}:
                base = self._own_base(doc["output"], None, 0, number)
                self._entries[base] = self._entry(doc, None, number)
            elif isinstance(doc, dict) and set(doc) == {"done", "outputs"}:
                self._load_done(doc, number)
            else:
                need(
                    False,
                    "the line",
                    f'is not a line of a job record ({{"output": ...}} or {{"done": ...}}): {datafile.shown(doc)}',
                    number,
                )

    def _bad(self, number: int, field: str, problem: str) -> None:
        """Our error naming the record, line ``number`` and ``field`` (built only when a check fails: a record of
        10^7 lines is checked without composing 10^7 messages)."""
        datafile.need(False, f"{self._where} line {number}", field, problem, self._fix())

    def _entry(self, doc: dict, index: Optional[int], number: int) -> Output:
        size, digest = doc["size"], doc["sha256"]
        if not (datafile.is_count(size, MAX_OUTPUT_SIZE) and isinstance(digest, str) and _SHA256.fullmatch(digest)):
            self._bad(
                number,
                "'size' and 'sha256'",
                f"must be the output's size (0 to {MAX_OUTPUT_SIZE}) and SHA-256 (64 hex digits), not "
                f"{datafile.shown(size)} and {datafile.shown(digest)}",
            )
        return Output(size, digest, index)

    def _own_base(self, base: Any, index: Optional[int], part: int, number: int) -> str:
        """``base`` when it is the file name of output ``part`` of input ``index`` (None: any input, part 0, as
        the tools without finished inputs write ``destination % i``), listed nowhere before; else our error."""
        names = self._names
        if not isinstance(base, str):
            ok = False
        elif not names.pattern:
            ok = base == names.base
        else:
            found = names.number(base)
            ok = found is not None and found[1] == part and (index is None or found[0] == index)
        if not ok:
            if index is None:
                wanted = f"one of this job's output names ({redact(names.base)} with a number, in its folder)"
            else:
                wanted = f"output {part} of input {index}: {_part_name(names.base % index, part)}"
            self._bad(number, "'output'", f"names {datafile.shown(base)}, which is not {wanted}")
        if base in self._entries:
            self._bad(number, "'output'", f"lists {datafile.shown(base)} a second time (each output is listed once)")
        return base

    def _load_done(self, doc: dict, number: int) -> None:
        index, outputs = doc["done"], doc["outputs"]
        if not (datafile.is_count(index) and index < len(self.inputs)):
            self._bad(
                number,
                "'done'",
                f"names input {datafile.shown(index)}, which this job of {len(self.inputs)} inputs does not have "
                "(inputs are numbered 0, 1, ... as given)",
            )
        done = self._done if self._done is not None else {}
        if index in done:
            self._bad(number, "'done'", f"lists input {index} a second time")
        if not (isinstance(outputs, list) and outputs and self._names.pattern):
            self._bad(number, "'outputs'", f"must list the outputs of input {index} (one or more)")
        for part, item in enumerate(outputs):
            if not (isinstance(item, dict) and set(item) == {"output", "size", "sha256"}):
                self._bad(
                    number,
                    "'outputs'",
                    f'must list each output as {{"output", "size", "sha256"}}, not {datafile.shown(item)}',
                )
            base = self._own_base(item["output"], index, part, number)
            self._entries[base] = self._entry(item, index, number)
        done[index] = len(outputs)
        self._done = done

    def _load_document(self, data: Any) -> None:
        """A record of version 1: one JSON document (read whole), checked field by field as it always was."""
        where, fix = redact(self.url), self._fix()

        def need(ok: bool, field: str, problem: str) -> None:
            datafile.need(ok, where, field, problem, fix)

        need(
            isinstance(data, dict) and data.get("format") == FORMAT and type(data.get("version")) is int,
            "the job record",
            f"is not one ({FORMAT} version 1 or {VERSION})",
        )
        need(data["version"] == 1, "'version'", f"must be 1 or {VERSION} (a record of another version of wds_cloud)")
        need(
            set(data) <= _FIELDS,
            "the job record",
            f"holds fields no record has ({datafile.shown(sorted(set(data) - _FIELDS))})",
        )
        self._check_pattern(data.get("destination"), need)
        conflict = _differences(data, self.tool, self.settings)
        if data.get("inputs") != self.inputs:
            conflict.insert(
                1 if conflict and conflict[0][0] == "tool" else 0, ("inputs", data.get("inputs"), self.inputs)
            )
        if conflict:
            raise self._conflict(conflict)
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
            for name, entry in outputs.items():
                ours = _own_name(self.destination, name)
                key = None if ours is None else self._names.key(ours)
                need(
                    key is not None and key not in self._entries,
                    "'outputs'",
                    f"lists {datafile.shown(name)}, which is not an output name of this job "
                    f"({redact(self.destination)})",
                )
                self._entries[str(key)] = Output(entry["size"], entry["sha256"])
        else:
            self._check_done(done, outputs, need)
        self._rewrite = True  # appending to a document would break it: the first save writes it as lines

    def _check_pattern(self, recorded: Any, need: Callable[[bool, str, str], None]) -> None:
        """Refuse the record of a job with another output pattern that shares this one's record name
        (``out/t-%04d.tar`` and ``out/t-%d.tar`` both keep ``out/t-N.tar.wds-job.json``): not a malformed
        record, another job's destination.  Records written before the pattern was kept have no
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

    def _check_done(self, done: Any, outputs: dict, need: Callable[[bool, str, str], None]) -> None:
        """The ``done`` map of a version-1 record (finished input -> its outputs) checked against this job: each
        key an input of the job spelled as the job writes it, each value exactly that input's first outputs in
        order (:func:`output_names`), and the record's outputs exactly those."""
        need(
            isinstance(done, dict) and len(done) <= len(self.inputs),
            "'done'",
            f"must map at most the job's {len(self.inputs)} inputs to their outputs",
        )
        parts: dict[int, int] = {}
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
                entry = outputs[name]
                self._entries[str(self._names.key(expected))] = Output(entry["size"], entry["sha256"], int(key))
            parts[int(key)] = len(names)
        extra = set(outputs) - listed
        need(
            not extra,
            "'outputs'",
            f"lists {datafile.shown(sorted(extra))}, which no finished input in 'done' gave",
        )
        self._done = parts

    def _check_strangers(self) -> None:
        """Refuse local files at output names that this job's record does not list, before anything is written
        (with a record of this job found, only what is not a regular file: regular files there are its own,
        see the module docstring), and remove what the job owns but must not keep: a regular file at one of
        its exact output names that the record does not list (with the record found: it is written again or,
        when no output of this run takes its name, would hold samples twice), and the temporary file of an
        output or of the record whose writer's process is gone (a killed run's litter, possibly gigabytes).
        Nothing is removed when something is refused.  One listing of the destination's folder, each name
        looked up once; what is removed is in :attr:`removed`."""
        names = self._names
        if not is_local(self.destination):
            return
        try:
            listing = os.scandir(local_path(names.folder) or ".")
        except (FileNotFoundError, NotADirectoryError):
            return
        first, litter = None, []
        gone: dict[int, bool] = {}  # pid -> whether it is gone: asked once per writer, not once per file
        with listing:
            for item in listing:
                name = item.name
                if name.endswith(".partial"):
                    if self._litter(name, gone):
                        litter.append(name)
                    continue
                if names.loose is None or name in self._entries or names.loose.fullmatch(name) is None:
                    continue
                if self.found:
                    try:
                        if item.is_file(follow_symlinks=False):
                            if names.number(name) is not None:
                                litter.append(name)
                            continue
                    except OSError:  # gone meanwhile
                        continue
                if first is None or name < first:  # the first by name: the same one named on every run
                    first = name
        if first is not None:
            raise self._stranger(names.folder + first)
        for name in sorted(litter):
            try:
                os.unlink(local_path(names.folder + name))
            except FileNotFoundError:  # gone meanwhile
                continue
            self.removed.append(names.folder + name)

    def _litter(self, name: str, gone: dict[int, bool]) -> bool:
        """Whether ``name`` is the temporary file of one of this job's outputs or of its record, left by a
        writer whose process is gone (a live writer's, or a file of another naming, is never litter)."""
        match = _PARTIAL.fullmatch(name)
        if match is None:
            return False
        target, names = match.group(1), self._names
        ours = target == self.url[self.url.rfind("/") + 1 :] or (
            names.number(target) is not None if names.pattern else target == names.base
        )
        if not ours:
            return False
        pid = int(match.group(2))
        if pid not in gone:
            gone[pid] = process_gone(pid)
        return gone[pid]

    def _stranger(self, url: str) -> ConfigError:
        return ConfigError(
            f"{redact(url)} is at an output name of this {self.tool}, but no record of this job says it "
            f"wrote it (the record is {redact(self.url)}); move it away or choose another destination",
            url=url,
        )

    # -- using it

    def keep(self, output: str) -> bool:
        """Whether ``output`` is already done by this job and unchanged (then it is kept); False: write it.
        A file there that the job did not write is refused, and so is anything but a regular file (a FIFO, a
        device, a link: never read)."""
        local = is_local(output)
        st = _lstat(local_path(output)) if local else None
        present = st is not None if local else exists(output)
        entry = self.entry(output)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise self._stranger(output)
        if st is not None and not stat.S_ISREG(st.st_mode):
            open_regular(local_path(output), "an output")  # raises, naming what is there
        if entry is None:
            if present and not self.found:
                raise self._stranger(output)
            return False
        if not present or st is not None and st.st_size != entry.size:
            return False
        size, digest = _checksum(output, limit=entry.size)
        return size == entry.size and digest == entry.sha256

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
        self.add(stream.name, stream.count, stream.sha256.hexdigest())
        self.save_soon()

    def written(self, output: str) -> None:
        """Record ``output``, written by other means, as finished (its checksum read back) and save the record."""
        size, digest = _checksum(output)
        self.add(output, size, digest)
        self.save()

    def _key(self, output: str) -> str:
        key = self._names.key(output)
        if key is None:
            raise ValueError(f"{redact(output)} is not an output name of {redact(self.destination)}")
        return key

    def add(self, output: str, size: int, sha256: str) -> None:
        """Record ``output`` (published whole) as finished with this size and SHA-256; saved by the next
        :meth:`save_soon`, :meth:`save` or :meth:`flush`."""
        key = self._key(output)
        old = self._entries.get(key)
        if old is not None:
            if old.input is not None:
                self.drop_input(old.input)
            self._rewrite = True  # listed already: appending would list it twice
        entry = Output(size, sha256)
        self._entries[key] = entry
        self._pending.append(_line(_output_line(key, entry)))
        self._unsaved = True

    def add_input(self, index: int, outputs: Iterable[tuple[str, int, str]]) -> None:
        """Record input ``index`` as finished with its ``(output, size, sha256)`` in order (the names
        :func:`output_names` gives it); saved by the next :meth:`save_soon`, :meth:`save` or :meth:`flush`."""
        self.drop_input(index)
        outputs = list(outputs)
        names = output_names(self.destination, index, len(outputs))
        items = []
        for (name, size, digest), expected in zip(outputs, names):
            if name != expected:
                raise ValueError(f"input {index}'s outputs are {names}, not {name!r}")
            key = self._key(name)
            if key in self._entries:
                self._rewrite = True
            entry = self._entries[key] = Output(size, digest, index)
            items.append(_output_line(key, entry))
        if self._done is None:
            self._done = {}
        self._done[index] = len(items)
        self._pending.append(_line({"done": index, "outputs": items}))
        self._unsaved = True

    def drop_input(self, index: int) -> None:
        """Forget that input ``index`` finished (its outputs are to be written again)."""
        parts = None if self._done is None else self._done.pop(index, None)
        if parts is None:
            return
        for name in output_names(self.destination, index, parts):
            self._entries.pop(self._key(name), None)
        self._rewrite = self._unsaved = True

    # -- saving it

    def begin(self) -> None:
        """Save the record before the job writes its first output (a new job), so that what a run interrupted
        before its next save leaves at the job's output names is known to be the job's own."""
        if not self.found:
            self.save()
            self.found = True

    def save_soon(self) -> None:
        """Save what finished since the last save: appended at once to a local record; written whole (a record
        on an object store, or one that must lose a line) only when the last save is a second old and twenty
        times what a save costs, so that saving takes a small fixed share of the job's time.  An output
        published but not yet saved is written again by a rerun (see the module docstring): nothing is lost,
        some work is repeated."""
        self._unsaved = True
        if self._appendable():
            self._append()
        elif time.monotonic() - self._saved_at >= max(1.0, 20 * self._save_cost):
            self.save()

    def save(self) -> None:
        """Save the record now: what finished since the last save appended, or the whole record written again
        (atomically: published whole) where appending cannot say it."""
        if self._appendable():
            self._append()
        else:
            self._write_whole()

    def flush(self) -> None:
        """Save what :meth:`save_soon` has not saved yet (call at the end of a job, and when it stops)."""
        if self._unsaved:
            self.save()

    def _appendable(self) -> bool:
        return self.found and not self._rewrite and is_local(self.url)

    def _append(self) -> None:
        """The pending lines appended to the local record (a regular file, never followed through a link)."""
        if self._pending:
            data = b"".join(self._pending)
            flags = os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            try:
                fd = os.open(local_path(self.url), flags)
            except OSError:  # gone, or a link put there: written whole (atomically) instead
                self._write_whole()
                return
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ConfigError(f"{redact(self.url)}: the job record is not a regular file; {self._fix()}")
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            self._pending.clear()
        self._unsaved = False

    def _record_lines(self) -> Iterator[bytes]:
        """The whole record, a line at a time (see the module docstring)."""
        yield _line(
            {
                "format": FORMAT,
                "version": VERSION,
                "tool": self.tool,
                "settings": self.settings,
                "destination": self.destination,
                "inputs": len(self.inputs),
            }
        )
        for url in self.inputs:
            yield _line({"input": url})
        for key, entry in self._entries.items():
            if entry.input is None:
                yield _line(_output_line(key, entry))
        for index, parts in (self._done or {}).items():
            first = self._names.base % index
            items = []
            for part in range(parts):
                key = _part_name(first, part)
                items.append(_output_line(key, self._entries[key]))
            yield _line({"done": index, "outputs": items})

    def _write_whole(self) -> None:
        """Write the whole record again (atomically: published whole), a chunk at a time."""
        started = time.monotonic()
        with gopen(self.url, "wb") as out:
            chunk: list[bytes] = []
            held = 0
            for line in self._record_lines():
                chunk.append(line)
                held += len(line)
                if held >= _CHUNK:
                    out.write(b"".join(chunk))
                    chunk, held = [], 0
            out.write(b"".join(chunk))
        self._saved_at = time.monotonic()
        self._save_cost = self._saved_at - started
        self._pending.clear()
        self._rewrite = self._unsaved = False
