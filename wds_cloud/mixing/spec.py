"""Dataset specs: many sources, each with its URLs, weight and storage options, in one YAML or JSON file.

The schema (version 1; documented in ``docs/specs.md``)::

    version: 1
    seed: 0                      # optional
    samples_per_epoch: 100000    # optional, over all ranks and workers
    sources:
      - name: laion              # unique
        urls: s3://bucket/laion-{000000..000999}.tar    # a brace spec, or a list of URLs
        weight: 0.7              # relative (default 1)
        resampled: true          # optional: draw shards with replacement, never run out
        shuffle: 1000            # optional: a sample shuffle inside the source (resumable)
        shardshuffle: true       # optional (default true): a new shard order each epoch
        storage_options: {}      # optional; or profile: NAME (a [profiles.NAME] table of the profiles file)

A spec read from a file or URL is data: its URLs are untrusted (a ``pipe:`` among them runs only when
``WDS_ALLOW_UNTRUSTED_PIPES`` allows it), and relative URLs are resolved against the spec's location.
A dict given to :func:`load_spec` by the program is trusted as code is.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import numbers
import operator
from typing import Any, Optional

from ..errors import ConfigError, MalformedDataError, redact
from ..io.datafile import shown
from ..io.security import resolve
from ..resume.arguments import is_flag
from ..shardlists import MAX_DATA_URLS, expand_urls, read_spec_file

__all__ = ["DatasetSpec", "SourceSpec", "load_spec", "is_mix_spec", "SPEC_VERSION"]

SPEC_VERSION = 1
#: weights are relative: outside this range one source would starve the others to nothing, or overflow
MIN_WEIGHT, MAX_WEIGHT = 1e-9, 1e9
#: the largest sample shuffle buffer a spec may ask for (samples held in memory)
MAX_SHUFFLE = 10_000_000
_TOP = ("version", "seed", "samples_per_epoch", "sources")
_SOURCE = ("name", "urls", "weight", "resampled", "shuffle", "shardshuffle", "storage_options", "profile")
_SCHEMA_HINT = "see docs/specs.md for the schema"


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One source of a spec (see the module docstring for the fields)."""

    name: str
    urls: tuple[str, ...]
    weight: float = 1.0
    resampled: bool = False
    shuffle: int = 0
    shardshuffle: bool = True
    storage_options: Optional[dict] = None
    profile: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A parsed, checked spec."""

    sources: tuple[SourceSpec, ...]
    seed: Optional[int] = None
    samples_per_epoch: Optional[int] = None
    where: str = "<dict>"


def is_mix_spec(data: Any) -> bool:
    """Whether ``data`` (a parsed file) is one of our specs (``version`` and ``sources``), not webdataset's
    ``datasets:`` form or a wids ``shardlist``."""
    return isinstance(data, dict) and "sources" in data and "version" in data


def load_spec(spec: Any, storage_options: Optional[dict] = None, *, parsed: Any = None) -> DatasetSpec:
    """A :class:`DatasetSpec` from a dict (trusted) or the URL/path of a YAML or JSON file (untrusted data);
    ``parsed``: that file's content when the caller has read it already (the file is read once)."""
    if isinstance(spec, DatasetSpec):
        return spec
    if isinstance(spec, str):
        data = parsed if parsed is not None else read_spec_file(spec, storage_options)
        return _parse(data, spec, from_data=True)
    if isinstance(spec, dict):
        return _parse(spec, "<dict>", from_data=False)
    raise ConfigError(f"a dataset spec is a dict or the URL of a .yaml/.json file, not {type(spec).__name__}")


def _fail(where: str, what: str) -> ConfigError:
    return MalformedDataError(f"{redact(where)}: {what}; {_SCHEMA_HINT}", url=where if where != "<dict>" else None)


def _parse(data: Any, where: str, from_data: bool) -> DatasetSpec:
    if not isinstance(data, dict):
        raise _fail(where, f"a dataset spec is a mapping with 'version' and 'sources', not {type(data).__name__}")
    unknown = [k for k in data if k not in _TOP]
    if unknown:
        raise _fail(
            where, f"unknown top-level field(s) {', '.join(map(shown, unknown[:5]))} (known: {', '.join(_TOP)})"
        )
    if data.get("version") != SPEC_VERSION:
        raise _fail(where, f"'version' is {shown(data.get('version'))}; this wds_cloud reads version: {SPEC_VERSION}")
    seed = _plain(data.get("seed"))
    if seed is not None and (type(seed) is not int or not -(1 << 63) <= seed < (1 << 64)):
        raise _fail(where, f"'seed' must be an integer, not {shown(seed)}")
    per_epoch = _plain(data.get("samples_per_epoch"))
    if per_epoch is not None and (type(per_epoch) is not int or per_epoch < 1):
        raise _fail(
            where,
            f"'samples_per_epoch' must be a positive integer, not {shown(per_epoch)} (leave it out to "
            "end an epoch when a source that is not resampled ends)",
        )
    sources = data.get("sources")
    if not isinstance(sources, list) or not sources:
        raise _fail(where, "'sources' must be a non-empty list of sources (each with name, urls and weight)")
    parsed: list[SourceSpec] = []
    for i, source in enumerate(sources):
        parsed.append(_source(source, i, where, from_data))
    names = [s.name for s in parsed]
    duplicated = sorted(n for n, count in collections.Counter(names).items() if count > 1)
    if duplicated:
        raise _fail(
            where,
            f"source name(s) {', '.join(map(shown, duplicated[:5]))} appear more than once; give each "
            "source a unique name",
        )
    return DatasetSpec(tuple(parsed), seed, per_epoch, where)


def _source(source: Any, i: int, where: str, from_data: bool) -> SourceSpec:
    if not isinstance(source, dict):
        raise _fail(where, f"sources[{i}] must be a mapping with name, urls and weight, not {type(source).__name__}")
    name = source.get("name")
    label = f"source {name[:80]!r}" if isinstance(name, str) and name else f"sources[{i}]"
    if not isinstance(name, str) or not name:
        raise _fail(where, f"{label}: 'name' is missing or not a string; give each source a unique name")
    unknown = [k for k in source if k not in _SOURCE]
    if unknown:
        raise _fail(
            where, f"{label}: unknown field(s) {', '.join(map(shown, unknown[:5]))} (known: {', '.join(_SOURCE)})"
        )
    urls = source.get("urls")
    if isinstance(urls, str) and urls:
        urls = [urls]
    if isinstance(urls, list) and urls and all(isinstance(u, str) and u for u in urls):
        # expanded here, so that each URL of a spec read from data carries its untrusted mark
        resolved = tuple(
            resolve(u, where) if from_data else u
            for u in expand_urls(list(urls), MAX_DATA_URLS if from_data else None, where)
        )
    else:
        raise _fail(
            where, f"{label}: 'urls' must be a brace spec string or a non-empty list of URLs, not {shown(urls)}"
        )
    weight = _plain(source.get("weight", 1.0))
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
        or not MIN_WEIGHT <= weight <= MAX_WEIGHT
    ):
        raise _fail(
            where,
            f"{label}: 'weight' must be a positive number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g} "
            f"(weights are relative), not {shown(weight)}",
        )
    flags = {}
    for key in ("resampled", "shardshuffle"):
        value = source.get(key, key == "shardshuffle")
        if not isinstance(value, bool):
            raise _fail(where, f"{label}: '{key}' must be true or false, not {shown(value)}")
        flags[key] = value
    shuffle = _plain(source.get("shuffle", 0))
    if type(shuffle) is not int or not 0 <= shuffle <= MAX_SHUFFLE:
        raise _fail(
            where, f"{label}: 'shuffle' must be a buffer size (a whole number, 0 for none), not {shown(shuffle)}"
        )
    options = source.get("storage_options")
    if options is not None and not isinstance(options, dict):
        raise _fail(
            where, f"{label}: 'storage_options' must be a mapping of the backend's options, not {shown(options)}"
        )
    profile = source.get("profile")
    if profile is not None and (not isinstance(profile, str) or not profile):
        raise _fail(
            where, f"{label}: 'profile' must name a [profiles.NAME] table of the profiles file, not {shown(profile)}"
        )
    return SourceSpec(
        name,
        resolved,
        float(weight),
        flags["resampled"],
        shuffle,
        flags["shardshuffle"],
        dict(options) if options else None,
        profile,
    )


def _plain(value: Any) -> Any:
    """A number of a spec given as a dict (numpy's too) as a plain int or float, checked as one; anything else as
    it is (a YAML or JSON file holds plain ones only)."""
    if is_flag(value):
        return value
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    if isinstance(value, numbers.Real) and type(value) is not float:
        return float(value)
    return value
