"""Settings: the only place wds_cloud reads the process environment.

Everything else receives a :class:`Settings`.  ``Settings.from_environ(environ)``
takes the mapping as a parameter, so tests pass a plain dict; :func:`current`
is the one call that hands it ``os.environ``, and it runs when a dataset or an
opener is built, never at import time.  ``docs/environment.md`` lists every
variable read here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import os
import re
from collections.abc import Mapping
from typing import Any, Optional, overload

from .errors import ConfigError, redact

__all__ = [
    "Settings",
    "current",
    "parse_size",
    "parse_positive_size",
    "parse_bool",
    "parse_count",
    "check_setting",
    "check_ceiling",
    "AS_ARGUMENT",
    "variable_for",
    "MIN_PART_SIZE",
    "Bound",
    "BOUNDS",
    "ENV_VARS",
    "ENV_DOCS",
    "variables_set",
]

#: AWS variables that change where or how botocore addresses S3: the s3 plugin presigns a GET itself only
#: where none of these asks for more than an endpoint (see plugins/s3.py); botocore reads them as ever
AWS_S3_VARS = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
    "AWS_USE_FIPS_ENDPOINT",
    "AWS_USE_DUALSTACK_ENDPOINT",
    "AWS_S3_US_EAST_1_REGIONAL_ENDPOINT",
    "AWS_S3_USE_ARN_REGION",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_S3_DISABLE_MULTIREGION_ACCESS_POINTS",
)

#: Every variable name ``from_environ`` looks up (``WDS_<NAME>`` for ``${NAME}``
#: substitution in shard specs is the one family read by prefix).
ENV_VARS = (
    "WDS_MAX_MEMBER_SIZE",
    "WDS_MAX_SAMPLE_SIZE",
    "WDS_PART_SIZE",
    "WDS_CONCURRENCY",
    "WDS_MAX_CONCURRENCY",
    "WDS_PREFETCH",
    "WDS_PLUGINS",
    "WDS_DISABLE_PLUGINS",
    "WDS_SECURE",
    "WDS_MMAP",
    "WDS_TABLE_CACHE",
    "WDS_INDEX_CACHE",
    "WDS_ALLOW_UNTRUSTED_PIPES",
    "WDS_ALLOW_PICKLE",
    "WDS_ALLOW_UNTRUSTED_LOCAL",
    "WDS_MAX_DATA_FILE_SIZE",
    "WDS_REWRITE",
    "GOPEN_REWRITE",
    "GOPEN_VERBOSE",
    "GOPEN_BUFFER",
    "WDS_SEED",
    "WDS_EPOCH",
    "WDS_VERBOSE_CACHE",
    "WDS_CACHE",
    "WDS_CACHE_SIZE",
    "WDS_SHOW_SEED",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "AIS_ENDPOINT",
    "AIS_AUTHN_TOKEN",
    "USE_AIS_FOR",
    "WDS_CLOUD_CONFIG",
    "XDG_CONFIG_HOME",
    "HOME",
    "WDS_RETRIES",
    "WDS_RETRY_TIMEOUT",
    "WDS_RETRY_BACKOFF",
    "WDS_PROGRESS_INTERVAL",
) + AWS_S3_VARS

#: What each variable of :data:`ENV_VARS` (and the families read besides) means, for the docs' generated
#: table (docs/environment.md): (names, format, default, example, meaning), Markdown text.  The format of a
#: numeric variable gains its accepted range from :data:`BOUNDS` below (one fact, one place).
_ENV_ROWS = (
    (
        "`WDS_PLUGINS`",
        "comma-separated plugin names",
        "all installed (no filter: every plugin found loads)",
        "`file,pipe,s3`",
        "load only these plugins",
    ),
    (
        "`WDS_DISABLE_PLUGINS`",
        "comma-separated plugin names",
        "none (no plugin is disabled)",
        "`pipe`",
        "never load these plugins",
    ),
    (
        "`WDS_SECURE`",
        "boolean",
        "`0` (off)",
        "`1`",
        "forbid `pipe:` URLs, local paths and `file:` URLs (stdin `-` stays allowed), rewrite rules, and unsafe decoders (pickle, `torch_loads`); refusals are `SecurityError`, also a `ValueError`",
    ),
    (
        "`WDS_MMAP`",
        "boolean",
        "`1` (on)",
        "`0`",
        "read plain tar shards on local disk (and complete in the shard cache) through a read-only memory mapping, members sliced out of the page cache (those of 256 KiB or more read with one `pread` each); `0` reads them as streams (a file system where mapping is slow or unsafe). A mapped shard must not be truncated in place while read: the size is checked before each MiB (`ObjectChangedError`), but a cut inside the MiB being read stops the reader with `SIGBUS`",
    ),
    (
        "`WDS_TABLE_CACHE`",
        "size",
        "`32MiB`",
        "`256MiB`",
        "the most memory the member tables of mapped shards may hold (where each member lies, recorded by a pass that read the shard to its end, so that the next pass over the unchanged file reads no header; none for a file changed in the last 5 seconds): about 25 bytes and the name per member, and for the default key rule about 16 more per member and a key (about 50 bytes and its length) per sample, the split names, made only while they fit; a table larger than the bound is not kept, and `wds_cloud.tar.table.held()` says how many are kept and their bytes; `0` keeps none. The bound covers a table while it is recorded too (a first pass stops recording, for the rest of that pass, as soon as the table holds more than the bound: a shard of 10^6 members takes the bound, not its whole table) and what is kept beside the tables (an entry per table held at most)",
    ),
    (
        "`WDS_INDEX_CACHE`",
        "size",
        "`128MiB`",
        "`1GiB`",
        "the most memory the member indexes a `ShardListDataset` loaded may hold in one process (each DataLoader worker has its own): about 250 bytes a sample and 225 a field; past it the least recently used are dropped (read again when needed), the one used last is always kept; `0` keeps only that one",
    ),
    (
        "`WDS_MAX_MEMBER_SIZE`",
        "size (`256MB`, `2GiB`, bytes)",
        "`2GiB`",
        "`8GiB`",
        "the largest tar member, and the largest decoded `.gz` field, read into memory; a larger one is a `CorruptShardError` (`DecodingError` for a field) naming it and the limit, before its bytes are read. `WebDataset(..., max_member_size=)` sets it per dataset. GNU long names and PAX headers are capped at 1 MiB",
    ),
    (
        "`WDS_MAX_SAMPLE_SIZE`",
        "size",
        "the member limit (`WDS_MAX_MEMBER_SIZE`)",
        "`8GiB`",
        "the most one sample may span in its tar stream (headers, long names and data: more than it holds in memory), checked as the stream is read on, each MiB or large member (so that a shard whose members share one key, a few bytes each when compressed, cannot fill memory); a larger sample is a `CorruptShardError` naming where it began and the limit. `WebDataset(..., max_sample_size=)` sets it per dataset. PAX records in force (consecutive or global headers together) are capped at 1 MiB",
    ),
    (
        "`WDS_ALLOW_UNTRUSTED_PIPES`",
        "boolean",
        "`0` (off)",
        "`1`",
        "allow `pipe:` commands that came from data (remote specs, index files) or from a rewrite rule",
    ),
    (
        "`WDS_ALLOW_UNTRUSTED_LOCAL`",
        "boolean",
        "`0` (off)",
        "`1`",
        "allow local paths and `file:` URLs named by a remote file (a spec, wids description or index read over the network); without it they are a `SecurityError`, as is a relative name that climbs out of its file's folder",
    ),
    (
        "`WDS_MAX_DATA_FILE_SIZE`",
        "size",
        "`64MiB`",
        "`512MiB`",
        "the largest structured file read from data (an index, a wids description, a manifest, a dataset spec, a saved state, a job record); a larger one is a `MalformedDataError` before it is parsed. For the files of one record a line (job records, and descriptions and manifests in their lines form, which the tools write past this size) it bounds each line, not the file",
    ),
    (
        "`WDS_ALLOW_PICKLE`",
        "boolean",
        "`0` (off)",
        "`1`",
        "allow decoding pickle (`.pyd`, `.pkl`, `.pickle`) and full `torch.load`",
    ),
    (
        "`WDS_REWRITE`",
        "`prefix=replacement;...`",
        "none (URLs are opened as given)",
        "`s3://bkt/=/mnt/bkt/`",
        "URL rewrite rules; tried before `GOPEN_REWRITE`, first match wins",
    ),
    (
        "`GOPEN_REWRITE`",
        "`prefix=replacement;...`",
        "none (URLs are opened as given)",
        "`http://a/=http://mirror/`",
        "webdataset's rewrite variable, same format",
    ),
    (
        "`GOPEN_VERBOSE`",
        "boolean",
        "`0` (off)",
        "`1`",
        "log every open at INFO level",
    ),
    (
        "`GOPEN_BUFFER`",
        "size",
        "`1MiB`",
        "`4MiB`",
        "default buffer size of opened streams",
    ),
    (
        "`WDS_SEED`",
        "integer",
        "none (no seed imposed: the program's own seeds apply)",
        "`42`",
        "default seed of shuffles and shard orders",
    ),
    (
        "`WDS_EPOCH`",
        "integer",
        "none (the program's epoch, else the first)",
        "`3`",
        "starting epoch when none is set by the program",
    ),
    (
        "`WDS_CACHE`",
        "directory",
        "none (no cache: every read goes to the store)",
        "`/scratch/wds`",
        "shard cache directory",
    ),
    (
        "`WDS_CACHE_SIZE`",
        "size",
        "none (no limit: the cache keeps every shard it holds)",
        "`50GB`",
        "shard cache bound",
    ),
    (
        "`WDS_VERBOSE_CACHE`",
        "boolean",
        "`0` (off)",
        "`1`",
        "log cache activity at INFO level",
    ),
    (
        "`WDS_SHOW_SEED`",
        "boolean",
        "`0` (off)",
        "`1`",
        "log the seeds in use",
    ),
    (
        "`WDS_<NAME>`",
        "text",
        "none (nothing substituted)",
        "`WDS_BUCKET=my-bucket`",
        "substituted for `${NAME}` in shard specs",
    ),
    (
        "`AIS_ENDPOINT`",
        "URL",
        "none (no AIStore gateway)",
        "`http://ais-gw:51080`",
        "AIStore gateway for `ais://` URLs and for `USE_AIS_FOR`",
    ),
    (
        "`AIS_AUTHN_TOKEN`",
        "text",
        "none (no token sent)",
        "`eyJhbGciOi...`",
        "bearer token sent to AIStore (never logged)",
    ),
    (
        "`USE_AIS_FOR`",
        "schemes separated by `:`",
        "none (every scheme is fetched directly)",
        "`gs:s3:az`",
        "fetch these schemes through the AIStore gateway, which caches them",
    ),
    (
        "`WDS_CLOUD_CONFIG`",
        "path",
        "`$XDG_CONFIG_HOME/wds_cloud/config.toml` when it exists (else no profiles)",
        "`~/wds-profiles.toml`",
        "the per-bucket profiles file (TOML; see `docs/cloud.md`)",
    ),
    (
        "`XDG_CONFIG_HOME`, `HOME`",
        "directory",
        "the system's (as the login sets them)",
        "`/home/me/.config`",
        "the default profiles file is `$XDG_CONFIG_HOME/wds_cloud/config.toml`, else `$HOME/.config/wds_cloud/config.toml`",
    ),
    (
        "`WDS_PROGRESS_INTERVAL`",
        "seconds",
        "`5`",
        "`30`",
        "the `wds-cloud` tools print a progress line (done/total, rate) this often on stderr when it is not a terminal (a job log); on a terminal they draw a bar. `0`: a line after every item",
    ),
    (
        "`WDS_RETRIES`",
        "integer",
        "`6`",
        "`10`",
        "attempts per fault when a remote read fails (connection reset, stall, truncated body, 5xx, 429)",
    ),
    (
        "`WDS_RETRY_TIMEOUT`",
        "seconds",
        "`60`",
        "`20`",
        "a remote read that receives nothing for this long is a stall, retried",
    ),
    (
        "`WDS_RETRY_BACKOFF`",
        "seconds",
        "`0.2`",
        "`1`",
        "first backoff delay; it doubles per attempt (with jitter), up to 5 s (or this delay, where it is longer)",
    ),
    (
        "`WDS_PART_SIZE`",
        "size",
        "`8MiB`",
        "`16MB`",
        "parallel ranged reads of remote shards: the longest part one request fetches; the first request asks for half of it, and a shard no longer than that is read with that one request. `WebDataset(part_size=)` and a profile's `part_size` set it too, held to the same range: every part is a request of its own, so the floor is 64 KiB",
    ),
    (
        "`WDS_CONCURRENCY`",
        "count",
        "measured (per host, from one connection up)",
        "`8`",
        "pins the parts of remote shards in flight at once per host and process (no measuring); unset, each host's level is measured: it starts at one connection (one request per shard), grows while the reader waits for bytes and the rate grows, comes back down when a level is no faster than the one below it (see `docs/cloud.md`); `1` reads every shard as one stream",
    ),
    (
        "`WDS_MAX_CONCURRENCY`",
        "count",
        "`16`, shared",
        "`32`",
        "the ceiling of the measured level; memory held is at most this many parts. Unset, 16 is shared by the machine's readers: each of N DataLoader workers (and of `LOCAL_WORLD_SIZE` processes) gets 16 / N; set, it is each process's own ceiling. A pinned concurrency above the ceiling in use is refused, whatever set each (this variable, `WDS_CONCURRENCY`, a profile or an argument), naming where each came from",
    ),
    (
        "`WDS_PREFETCH`",
        "count",
        "`1` (the next shard)",
        "`2`",
        "how many of the next shards (in the epoch's order, after shuffle and split) are requested while one is read; `0` turns it off",
    ),
    (
        "`RANK`, `LOCAL_RANK`",
        "integer",
        "none (rank 0)",
        "`RANK=1`",
        "this process's rank when torch.distributed is not initialized (`LOCAL_RANK` stands in for `RANK` when "
        "only it is set, as on one node); it must be less than `WORLD_SIZE` (and `LOCAL_RANK` less than "
        "`LOCAL_WORLD_SIZE`)",
    ),
    (
        "`WORLD_SIZE`",
        "integer",
        "none (one rank)",
        "`WORLD_SIZE=4`",
        "the number of ranks when torch.distributed is not initialized",
    ),
    (
        "`LOCAL_WORLD_SIZE`",
        "integer",
        "none (one process on this node)",
        "`8`",
        "processes on this node (`torchrun` sets it): they share the default `WDS_MAX_CONCURRENCY`",
    ),
    (
        "`AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`",
        "URL",
        "none (AWS's own endpoints)",
        "`http://minio:9000`",
        "botocore's own variables, also read here: an S3-compatible endpoint, addressed path-style (`ENDPOINT/bucket/key`) as botocore does",
    ),
    (
        "`AWS_USE_FIPS_ENDPOINT`, `AWS_USE_DUALSTACK_ENDPOINT`, `AWS_S3_US_EAST_1_REGIONAL_ENDPOINT`, `AWS_S3_USE_ARN_REGION`, `AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`, `AWS_S3_DISABLE_MULTIREGION_ACCESS_POINTS`",
        "botocore's",
        "none (botocore's defaults; reads signed by the plugin)",
        "`AWS_USE_FIPS_ENDPOINT=true`",
        "botocore's own variables; with any of them set, `s3://` reads are presigned by a botocore client instead of by the plugin itself (`docs/cloud.md` says why)",
    ),
)

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
# ASCII digits only: int() and float() also take "1_000", "\u0665" (an Arabic-Indic five), "nan" and "inf"
_WHOLE = re.compile(r"^\s*([+-]?[0-9]+)\s*$")
_REAL = re.compile(r"^\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*$")


def parse_bool(name: str, value: Optional[str], default: bool = False) -> bool:
    """Parse a boolean environment value (``1/0``, ``true/false``, ``yes/no``, ``on/off``)."""
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean: use 1 or 0 (also true/false, yes/no, on/off)")


_DAY = 86400.0


@dataclasses.dataclass(frozen=True)
class Bound:
    """The values one numeric setting accepts: ``least`` to ``most``, both included.

    ``kind`` is ``"count"`` (a whole number), ``"size"`` (bytes, written with or without a unit) or
    ``"seconds"`` (a finite real number); ``field`` is the :class:`Settings` attribute it sets, ``keyword``
    the Python argument that sets the same thing (``ReadOptions``, ``WebDataset``, ``gopen``), checked by
    the same :func:`check_setting`; ``note`` says what edge values mean.
    """

    kind: str
    least: float
    most: float
    field: str
    keyword: Optional[str] = None
    note: str = ""

    def describe(self) -> str:
        """The range in words, as the docs' table and the errors show it."""
        text = f"from {self._show(self.least)} to {self._show(self.most)}"
        return f"{text} ({self.note})" if self.note else text

    def _show(self, value: float) -> str:
        if self.kind == "seconds":
            return f"{value:,g} s"
        number = int(value)
        if self.kind == "size":
            if number == 1:
                return "1 byte"
            for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
                scale = _UNITS[unit.lower()]
                if number >= scale and number % scale == 0:
                    return f"{number // scale:,} {unit}"
            return f"{number:,} bytes"
        for bits in range(32, 130):  # a seed's bounds read better as powers of two
            if abs(number) == 1 << bits:
                return f"{'-' if number < 0 else ''}2^{bits}"
            if number == (1 << bits) - 1:
                return f"2^{bits} - 1"
        return f"{number:,}"


#: the smallest ``part_size`` accepted (``WDS_PART_SIZE``, the argument, a profile's key): every part is a request
#: of its own, so parts of a few bytes spent the link on requests and threads (100-byte parts read a shard in
#: seconds that one stream reads in milliseconds); 64 KiB is also the first piece a part's bytes are read in
MIN_PART_SIZE = 64 << 10

#: The accepted range of every numeric variable, read where the variable is read (:meth:`Settings.from_environ`)
#: and shown in docs/environment.md.  The bounds are sane, not tight: a value past them is a typo or a unit
#: mistake (a timeout of a year, a part of a terabyte), never a setting that works.
BOUNDS: dict[str, Bound] = {
    "WDS_MAX_MEMBER_SIZE": Bound("size", 1, 1 << 40, "max_member_size", "max_member_size"),
    "WDS_MAX_SAMPLE_SIZE": Bound("size", 1, 1 << 40, "max_sample_size", "max_sample_size"),
    "WDS_MAX_DATA_FILE_SIZE": Bound("size", 1, 1 << 40, "max_data_file_size"),
    "WDS_PART_SIZE": Bound("size", MIN_PART_SIZE, 4 << 30, "part_size", "part_size"),
    "GOPEN_BUFFER": Bound("size", 1, 1 << 30, "bufsize"),
    "WDS_CACHE_SIZE": Bound("size", 0, 1 << 50, "cache_size", "cache_size", "0: no cache"),
    "WDS_TABLE_CACHE": Bound("size", 0, 1 << 40, "table_cache", None, "0: no member tables kept"),
    "WDS_INDEX_CACHE": Bound("size", 0, 1 << 44, "index_cache", None, "0: only the index used last"),
    "WDS_CONCURRENCY": Bound("count", 1, 1024, "concurrency", "concurrency", "1: one stream per shard"),
    "WDS_MAX_CONCURRENCY": Bound("count", 1, 1024, "max_concurrency", "max_concurrency"),
    "WDS_PREFETCH": Bound("count", 0, 64, "prefetch", "prefetch", "0: none"),
    "WDS_RETRIES": Bound("count", 0, 1000, "retries", "retries", "0 and 1: one attempt, no retry"),
    # below a millisecond the socket's kernel-side timeout (SO_RCVTIMEO, whole microseconds) would read 0: none
    "WDS_RETRY_TIMEOUT": Bound("seconds", 0.001, _DAY, "retry_timeout", "timeout"),
    "WDS_RETRY_BACKOFF": Bound("seconds", 0, 600, "retry_backoff", "backoff", "0: retry at once"),
    "WDS_PROGRESS_INTERVAL": Bound("seconds", 0, _DAY, "progress_interval", None, "0: after every item"),
    # the bounds of a seed everywhere else (dataset specs, states): any 64-bit integer, signed or not
    "WDS_SEED": Bound("count", -(1 << 63), (1 << 64) - 1, "seed", "seed"),
    "WDS_EPOCH": Bound("count", 0, 10**9, "epoch"),
    "RANK": Bound("count", 0, 10**6 - 1, "rank"),
    "LOCAL_RANK": Bound("count", 0, 10**6 - 1, "local_rank"),
    "WORLD_SIZE": Bound("count", 1, 10**6, "world_size"),
    "LOCAL_WORLD_SIZE": Bound("count", 1, 10**6, "local_world_size"),
}
_BY_KEYWORD = {bound.keyword: (name, bound) for name, bound in BOUNDS.items() if bound.keyword}
_BY_FIELD = {bound.field: (name, bound) for name, bound in BOUNDS.items()}
_KINDS = {
    "count": "a whole number (digits, such as 8)",
    "size": "a size (a number of bytes such as 4096, or with a unit such as 256MB or 2GiB)",
    "seconds": "a number of seconds (such as 30 or 0.5)",
}


def _refuse(
    name: str, value: object, problem: str, bound: Bound, variable: Optional[str], where: Optional[str] = None
) -> ConfigError:
    """The error for ``name=value``: the value, the rule broken (``problem``), what ``name`` accepts (kind, units
    and range, worded alike for a variable, an argument and a profile's key) and the fix where it was given:
    the environment (``name`` is the variable), an argument (``variable`` is the variable it overrides) or a file
    (``where``: ``the profile ["s3://b/"] of FILE``)."""
    shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:40]}... ({len(str(value))} characters)"
    if where is not None:
        shown = f"{shown} (in {where})"
        fix = f"set it within that range there, or remove it for the default ({variable or 'none'})"
    elif variable is None or variable == name:
        fix = "set it within that range, or unset it for the default" if name.isupper() else "give one in that range"
    else:
        fix = f"pass a value within that range, or leave it out for the default ({variable})"
    return ConfigError(f"{name}={shown} {problem}: {name} accepts {_KINDS[bound.kind]} {bound.describe()}; {fix}")


def _number(name: str, value: object, bound: Bound, variable: Optional[str], where: Optional[str] = None) -> float:
    """``value`` (text from the environment or a file, or a Python number of any type) as a number of ``bound``'s
    kind, unchecked: text is read as the environment's is (``"4"``, ``"16MB"``), so an argument or a profile's key
    takes what the variable takes; a Python real that is whole (``4.0``) is a count too."""
    if isinstance(value, str):
        pattern = {"count": _WHOLE, "seconds": _REAL, "size": _SIZE}[bound.kind]
        match = pattern.match(value)
        unit = match.group(2).lower() if match and bound.kind == "size" else ""
        if not match or unit not in _UNITS:
            raise _refuse(name, value, f"is not {_KINDS[bound.kind].split(' (')[0]}", bound, variable, where)
        if bound.kind == "count":
            digits = match.group(1)
            if len(digits.lstrip("+-")) > 40:  # int() refuses past 4,300 digits; no bound is near 40
                raise _refuse(name, value, "is out of range", bound, variable, where)
            return int(digits)
        return float(match.group(1)) * _UNITS[unit]
    if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", None) == "b":  # numpy's bool too
        raise _refuse(name, value, "is a boolean, not a number", bound, variable, where)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:  # an int-like real past a float: out of every range
            return math.inf
    if hasattr(value, "__index__"):  # an integer type that is not registered as one
        try:
            return operator.index(value)
        except TypeError:
            pass
    kind = _KINDS[bound.kind].split(" (")[0]
    raise _refuse(name, value, f"is a {type(value).__name__}, not {kind}", bound, variable, where)


def _checked(name: str, value: object, bound: Bound, variable: Optional[str], where: Optional[str] = None) -> Any:
    number = _number(name, value, bound, variable, where)
    if isinstance(number, float) and math.isnan(number):
        raise _refuse(name, value, "is not a number", bound, variable, where)
    if not bound.least <= number <= bound.most:  # inf and 1e999 included
        raise _refuse(name, value, "is out of range", bound, variable, where)
    if bound.kind == "seconds":
        return float(number)
    whole = round(number)
    # a part of a byte (1.5, 1.1KiB) is never cut silently; a size with a unit may miss a whole number by a float's
    # rounding ("0.3GB"), a count (4.0) may not
    slack = 1e-9 * max(1.0, abs(number)) if bound.kind == "size" else 0.0
    if abs(number - whole) > slack:
        problem = (
            f"is {number!r} bytes, not a whole number of them" if bound.kind == "size" else "is not a whole number"
        )
        raise _refuse(name, value, problem, bound, variable, where)
    return int(whole)


def check_setting(
    name: str, value: object, default: Any = None, bound: Optional[Bound] = None, where: Optional[str] = None
) -> Any:
    """``value`` of a numeric setting, checked against its range in :data:`BOUNDS` (``default`` when unset).

    ``name`` is a variable (``WDS_RETRY_TIMEOUT``, whose text is parsed) or the Python argument that sets the
    same thing (``timeout``, which also takes numbers, numpy's included, and the variable's text); both get the
    same range.  A value outside it is a :class:`ConfigError` naming ``name``, the value, the kind and range
    accepted (with units) and the fix; ``where`` names the file that set it (a profile), for that fix.
    ``bound`` checks a setting that has no variable (a field of an object built directly) the same way.
    """
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return default
    if bound is not None:
        return _checked(name, value, bound, name, where)
    if name in BOUNDS:
        return _checked(name, value, BOUNDS[name], name, where)
    if name in _BY_KEYWORD:
        variable, bound = _BY_KEYWORD[name]
        return _checked(name, value, bound, variable, where)
    raise KeyError(f"{name!r} is no bounded setting: add it to wds_cloud.config.BOUNDS")


def variable_for(keyword: str) -> str:
    """The variable that sets what the Python argument ``keyword`` sets (``part_size``: ``WDS_PART_SIZE``)."""
    return _BY_KEYWORD[keyword][0]


#: where a setting came from, in an error's words, when it was a Python argument (see :func:`check_ceiling`)
AS_ARGUMENT = "given as an argument"


def check_ceiling(
    concurrency: Optional[int], max_concurrency: Optional[int], origins: Optional[Mapping[str, str]] = None
) -> None:
    """A pinned ``concurrency`` is no more than ``max_concurrency``, whatever set each: checked on the settings
    resolved from every source (argument, profile, environment), ``origins`` saying in words where each came from
    (``from WDS_CONCURRENCY``; unsaid, both are arguments).  Above it the pin wins and the ceiling bounds nothing,
    silently."""
    if origins is None:
        origins = {"concurrency": AS_ARGUMENT, "max_concurrency": AS_ARGUMENT}
    if concurrency is not None and max_concurrency is not None and concurrency > max_concurrency:
        raise ConfigError(
            f"concurrency={concurrency} ({origins['concurrency']}) is above max_concurrency={max_concurrency} "
            f"({origins['max_concurrency']}): concurrency pins the connections per host, max_concurrency bounds the "
            f"level measured when it is not pinned; give a concurrency of at most {max_concurrency}, or a "
            "max_concurrency of at least the concurrency, or leave one of them out"
        )


def parse_size(name: str, value: object) -> int:
    """Parse a byte count such as ``1e10``, ``50GB``, ``512MiB`` or ``4096`` (a Python number is taken as is).

    ``name`` in :data:`BOUNDS` (as a variable or its keyword) is checked against its range; any other size must
    be finite and not negative."""
    if name in BOUNDS or name in _BY_KEYWORD:
        return int(check_setting(name, value, 0))
    return int(_checked(name, value, Bound("size", 0, 1 << 60, name), name))


#: the default of WDS_MAX_MEMBER_SIZE: generous for images, audio and video clips, and still far
#: below what a 2-core, 24 GiB training box can hold per DataLoader worker
DEFAULT_MAX_MEMBER_SIZE = 2 << 30


@overload
def parse_positive_size(name: str, value: object, default: int) -> int: ...


@overload
def parse_positive_size(name: str, value: object, default: None = None) -> Optional[int]: ...


def parse_positive_size(name: str, value: object, default: Optional[int] = None) -> Optional[int]:
    """A byte count that must be positive (``256MB``, ``2GiB``, 4096); ``default`` when unset."""
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return default
    if name in BOUNDS or name in _BY_KEYWORD:
        return int(check_setting(name, value))
    return int(_checked(name, value, Bound("size", 1, 1 << 60, name), name))


@overload
def parse_count(name: str, value: Optional[str], default: int, least: int) -> int: ...


@overload
def parse_count(name: str, value: Optional[str], default: None, least: int) -> Optional[int]: ...


def parse_count(name: str, value: Optional[str], default: Optional[int], least: int) -> Optional[int]:
    """A whole number of at least ``least`` (a count of parts or shards); the range of :data:`BOUNDS` where
    ``name`` has one."""
    if name in BOUNDS or name in _BY_KEYWORD:
        return check_setting(name, value, default)
    if value is None or value.strip() == "":
        return default
    return int(_checked(name, value, Bound("count", least, 1 << 63, name), name))


def _with_range(row: tuple[str, str, str, str, str]) -> tuple[str, str, str, str, str]:
    """A row of the docs' table with the accepted range of its numeric variables in the format column."""
    names = [name for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row[0]) if name in BOUNDS]
    ranges = {BOUNDS[name].describe() for name in names}
    if not ranges:
        return row
    if len(ranges) == 1:
        form = f"{row[1]}, {ranges.pop()}"
    else:
        form = row[1] + "; " + "; ".join(f"`{name}` {BOUNDS[name].describe()}" for name in names)
    return (row[0], form) + row[2:]


ENV_DOCS = tuple(_with_range(row) for row in _ENV_ROWS)


def _parse_list(value: Optional[str]) -> Optional[tuple[str, ...]]:
    if value is None:
        return None
    return tuple(item.strip() for item in re.split(r"[,:\s]+", value) if item.strip())


def _cloud_config_path(get) -> Optional[str]:
    explicit = get("WDS_CLOUD_CONFIG")
    if explicit:
        return explicit
    base = get("XDG_CONFIG_HOME") or (os.path.join(get("HOME"), ".config") if get("HOME") else None)
    return os.path.join(base, "wds_cloud", "config.toml") if base else None


def parse_rewrites(name: str, value: Optional[str]) -> tuple[tuple[str, str], ...]:
    """Parse ``prefix=replacement;prefix=replacement`` rewrite rules."""
    if not value:
        return ()
    rules = []
    for part in value.split(";"):
        if not part.strip():
            continue
        if "=" not in part:
            raise ConfigError(  # a rule names URLs: a credential in one is masked
                f"{name} rule {redact(part.strip())!r} has no '=': write rules as prefix=replacement, separated by ';'"
            )
        prefix, replacement = part.split("=", 1)
        rules.append((prefix.strip(), replacement))  # the replacement is exact: 'pipe:echo ' keeps its space
    return tuple(rules)


def _check_ranks(settings: Settings) -> None:
    """A rank from the environment lies within its world: a split by rank 4 of 4 would give this process no
    shards, silently (``LOCAL_RANK`` stands in for ``RANK`` where only it is set, as pytorch_worker_info does)."""
    pairs = (
        (
            "RANK" if settings.rank is not None else "LOCAL_RANK",
            settings.rank if settings.rank is not None else settings.local_rank,
            "WORLD_SIZE",
            settings.world_size,
        ),
        ("LOCAL_RANK", settings.local_rank, "LOCAL_WORLD_SIZE", settings.local_world_size),
    )
    for rank_name, rank, world_name, world in pairs:
        if rank is not None and world is not None and rank >= world:
            raise ConfigError(
                f"{rank_name}={rank} is not less than {world_name}={world}: ranks count from 0, so a world of "
                f"{world} has ranks 0 to {world - 1}; set them as torchrun does, or unset both"
            )


@dataclasses.dataclass(frozen=True)
class Settings:
    """Immutable configuration; build it with :meth:`from_environ` or directly in tests."""

    plugins_allow: Optional[tuple[str, ...]] = None
    plugins_block: tuple[str, ...] = ()
    secure: bool = False
    allow_untrusted_pipes: bool = False
    allow_pickle: bool = False
    #: plain local shards are read through a memory mapping (see :mod:`wds_cloud.io.mapped`)
    mmap: bool = True
    #: bytes the member tables of mapped shards may hold (see :mod:`wds_cloud.tar.table`)
    table_cache: int = 32 << 20
    #: bytes the member indexes loaded by a ``ShardListDataset`` may hold (see :mod:`wds_cloud.index.held`)
    index_cache: int = 128 << 20
    rewrites: tuple[tuple[str, str], ...] = ()
    verbose: bool = False
    bufsize: int = 1 << 20
    seed: Optional[int] = None
    epoch: Optional[int] = None
    cache_dir: Optional[str] = None
    cache_size: Optional[int] = None
    verbose_cache: bool = False
    show_seed: bool = False
    rank: Optional[int] = None
    world_size: Optional[int] = None
    local_rank: Optional[int] = None
    #: processes on this node (torchrun's ``LOCAL_WORLD_SIZE``): they share each host's connections
    local_world_size: Optional[int] = None
    #: ``WDS_<NAME>`` variables as sorted (NAME, value) pairs, for ``${NAME}`` in shard specs.
    template_vars: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)
    ais_endpoint: Optional[str] = None
    ais_token: Optional[str] = dataclasses.field(default=None, repr=False)  # a credential: never shown
    use_ais_for: tuple[str, ...] = ()
    #: the per-bucket profiles file (TOML); it need not exist
    cloud_config: Optional[str] = None
    #: remote reads: attempts per fault, read timeout (s), and the first backoff delay (s)
    retries: int = 6
    retry_timeout: float = 60.0
    retry_backoff: float = 0.2
    #: the largest tar member or decoded field read into memory (bytes): a hostile or broken
    #: shard fails with a clear error instead of exhausting memory
    max_member_size: int = DEFAULT_MAX_MEMBER_SIZE
    #: the most bytes of tar stream one sample may span (headers, names, data); None: the member limit
    max_sample_size: Optional[int] = None
    #: parallel ranged reads of remote shards (see :mod:`wds_cloud.io.parallel`): the size of a part, the
    #: parts in flight (None: measured per host, up to ``max_concurrency``; 1: one stream per shard), the
    #: ceiling of the measured level (None: 16 shared among the machine's DataLoader workers), and
    #: how many of the next shards are requested ahead of time (0: none)
    part_size: int = 8 << 20
    concurrency: Optional[int] = None
    max_concurrency: Optional[int] = None
    prefetch: int = 1
    #: the largest structured file read from data (index, description, manifest, spec, state, job record)
    max_data_file_size: int = 64 << 20
    #: shell commands and local paths named by a remote file (a spec, description or index) are used
    allow_untrusted_local: bool = False
    #: seconds between the CLI's progress lines when stderr is not a terminal (a job log); 0: after every item
    progress_interval: float = 5.0
    #: the :data:`AWS_S3_VARS` that are set, as (name, value) pairs
    aws_s3: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # built directly or by replace(): the numeric fields get the variables' ranges (from_environ's are in them)
        for field, (_, bound) in _BY_FIELD.items():
            value = getattr(self, field)
            if value is not None:  # made plain (4.0 or numpy's 4 is 4): frozen, so set the one way it can be
                object.__setattr__(self, field, _checked(f"Settings {field}", value, bound, f"Settings {field}"))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """Read every setting from ``environ`` (normally ``os.environ``); each number is checked against its range
        (:data:`BOUNDS`) here, where it is read."""
        get = environ.get

        def number(name: str, default: Any = None) -> Any:
            return check_setting(name, get(name), default)

        block = _parse_list(get("WDS_DISABLE_PLUGINS")) or ()
        settings = cls(
            plugins_allow=_parse_list(get("WDS_PLUGINS")),
            plugins_block=block,
            secure=parse_bool("WDS_SECURE", get("WDS_SECURE")),
            allow_untrusted_pipes=parse_bool("WDS_ALLOW_UNTRUSTED_PIPES", get("WDS_ALLOW_UNTRUSTED_PIPES")),
            allow_pickle=parse_bool("WDS_ALLOW_PICKLE", get("WDS_ALLOW_PICKLE")),
            mmap=parse_bool("WDS_MMAP", get("WDS_MMAP") or None, True),  # empty: the default, as for every variable
            table_cache=number("WDS_TABLE_CACHE", 32 << 20),
            index_cache=number("WDS_INDEX_CACHE", 128 << 20),
            # WDS_REWRITE rules come first, so where both variables match a URL WDS_REWRITE wins.
            rewrites=parse_rewrites("WDS_REWRITE", get("WDS_REWRITE"))
            + parse_rewrites("GOPEN_REWRITE", get("GOPEN_REWRITE")),
            verbose=parse_bool("GOPEN_VERBOSE", get("GOPEN_VERBOSE")),
            bufsize=number("GOPEN_BUFFER", 1 << 20),
            seed=number("WDS_SEED"),
            epoch=number("WDS_EPOCH"),
            cache_dir=get("WDS_CACHE") or None,
            cache_size=number("WDS_CACHE_SIZE"),
            verbose_cache=parse_bool("WDS_VERBOSE_CACHE", get("WDS_VERBOSE_CACHE")),
            show_seed=parse_bool("WDS_SHOW_SEED", get("WDS_SHOW_SEED")),
            rank=number("RANK"),
            world_size=number("WORLD_SIZE"),
            local_rank=number("LOCAL_RANK"),
            local_world_size=number("LOCAL_WORLD_SIZE"),
            template_vars=tuple(sorted((k[4:], v) for k, v in environ.items() if k.startswith("WDS_") and len(k) > 4)),
            ais_endpoint=(get("AIS_ENDPOINT") or "").rstrip("/") or None,
            ais_token=get("AIS_AUTHN_TOKEN") or None,
            use_ais_for=tuple(s.lower() for s in _parse_list(get("USE_AIS_FOR")) or ()),  # the ais plugin reads it
            cloud_config=_cloud_config_path(get),
            retries=number("WDS_RETRIES", 6),
            retry_timeout=number("WDS_RETRY_TIMEOUT", 60.0),
            retry_backoff=number("WDS_RETRY_BACKOFF", 0.2),
            max_member_size=number("WDS_MAX_MEMBER_SIZE", DEFAULT_MAX_MEMBER_SIZE),
            max_sample_size=number("WDS_MAX_SAMPLE_SIZE"),
            part_size=number("WDS_PART_SIZE", 8 << 20),
            concurrency=number("WDS_CONCURRENCY"),
            max_concurrency=number("WDS_MAX_CONCURRENCY"),
            prefetch=number("WDS_PREFETCH", 1),
            max_data_file_size=number("WDS_MAX_DATA_FILE_SIZE", 64 << 20),
            allow_untrusted_local=parse_bool("WDS_ALLOW_UNTRUSTED_LOCAL", get("WDS_ALLOW_UNTRUSTED_LOCAL")),
            progress_interval=number("WDS_PROGRESS_INTERVAL", 5.0),
            aws_s3=tuple((name, value) for name in AWS_S3_VARS if (value := get(name) or "")),
        )
        _check_ranks(settings)
        return settings

    def replace(self, **changes: Any) -> Settings:
        """Return a copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


_last: Optional[tuple[dict, Settings]] = None


def variables_set(environ: Optional[Mapping[str, str]] = None) -> frozenset:
    """The names of the environment's variables that hold something (an empty value is the default): what
    ``wds-cloud settings`` marks as set, never their values."""
    environ = os.environ if environ is None else environ
    return frozenset(name for name, value in environ.items() if value.strip())


#: the variables whose names start so are settings a DataLoader worker takes from the program that built its
#: dataset (see :func:`carried_environ`); credentials (``AIS_AUTHN_TOKEN``, a cloud's own) are never among them
_CARRIED_PREFIXES = ("WDS_", "GOPEN_")
_CARRIED_NAMES = ("USE_AIS_FOR", "AIS_ENDPOINT")


def _carried(name: str) -> bool:
    return name.startswith(_CARRIED_PREFIXES) or name in _CARRIED_NAMES


def carried_environ(environ: Optional[Mapping[str, str]] = None) -> dict:
    """The settings' variables of this process, for a DataLoader worker being started: a forkserver's workers
    have the environment the server started with, not the program's when it built the dataset (spawn's and
    fork's have the program's), so the dataset carries these to its worker (:func:`take_carried_environ`)."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items() if _carried(name)}


def take_carried_environ(carried: dict) -> None:
    """Make this (worker) process's settings variables those ``carried`` holds (see :func:`carried_environ`):
    set those it names, remove the others."""
    for name in [name for name in os.environ if _carried(name) and name not in carried]:
        del os.environ[name]
    for name, value in carried.items():
        if isinstance(name, str) and isinstance(value, str) and _carried(name) and os.environ.get(name) != value:
            os.environ[name] = value


def current() -> Settings:
    """Settings from this process's environment as it is now.

    Parsed again only when the environment changed since the last call (one dict
    comparison), since every open asks for them.
    """
    global _last
    raw = getattr(os.environ, "_data", None)
    last = _last
    if raw is not None and last is not None and last[0] == raw:
        return last[1]
    snapshot = dict(raw) if raw is not None else None
    settings = Settings.from_environ(os.environ)
    if snapshot is not None:
        _last = (snapshot, settings)
    return settings


class Switches:
    """Process-wide switches that code (not the environment) sets: ``wds_cloud.utils.enforce_security``
    writes :attr:`enforce_security` here, where the io layer reads it without importing ``utils``."""

    enforce_security: bool = False


#: the switches of this process
switches = Switches()
