"""Per-bucket profiles: storage options chosen by URL prefix, from a TOML file.

The file (``WDS_CLOUD_CONFIG``, default ``$XDG_CONFIG_HOME/wds_cloud/config.toml``
or ``~/.config/wds_cloud/config.toml``) has one table per URL prefix; the keys of
a table are the storage options of that backend.  Every prefix that matches a
URL applies, longer prefixes over shorter ones, and options given to the
dataset (``storage_options=``) over all of them::

    ["s3://"]
    profile = "research"

    ["s3://minio-bucket/"]
    endpoint_url = "http://127.0.0.1:9000"
    key = "minio"
    secret = "minio-secret"

Named profiles, for dataset specs (``profile: NAME`` in a source), are tables under ``[profiles]``::

    [profiles.laion]
    endpoint_url = "https://s3.example.com"
    key = "..."

The keys ``part_size``, ``concurrency``, ``max_concurrency`` and ``prefetch`` are not storage
options: they tune the parallel ranged reads of the matching URLs (:mod:`wds_cloud.io.parallel`).
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from typing import Any, Optional

from .. import config
from ..config import Settings
from ..errors import ConfigError

__all__ = ["load_profiles", "named_profile", "options_for", "transfer_for", "TRANSFER_KEYS"]

#: profile keys that tune transfers (parallel ranged reads), kept from the backend's storage options
TRANSFER_KEYS = ("part_size", "concurrency", "max_concurrency", "prefetch")

_cache: dict[str, tuple[float, tuple, dict]] = {}
_lock = threading.Lock()


def _toml() -> Any:
    try:
        return importlib.import_module("tomllib")
    except ImportError:  # Python 3.10
        return importlib.import_module("tomli")


def load_profiles(path: Optional[str]) -> tuple[tuple[str, dict], ...]:
    """The (prefix, options) pairs of the profiles file, longest prefix last; cached until the file changes."""
    return _load(path)[0]


def named_profile(name: str, settings: Settings) -> dict:
    """The storage options of the profile called ``name`` (a ``[profiles.NAME]`` table of the profiles file),
    as dataset specs name them (``profile: NAME``); ConfigError naming the file when there is none."""
    named = _load(settings.cloud_config)[1]
    if name not in named:
        where = settings.cloud_config or "the profiles file (WDS_CLOUD_CONFIG)"
        raise ConfigError(
            f"no profile {name!r} in {where}: add a [profiles.{name}] table with its storage options"
            f"{' (it has ' + ', '.join(sorted(named)) + ')' if named else ''}"
        )
    return dict(named[name])


def _load(path: Optional[str]) -> tuple[tuple[tuple[str, dict], ...], dict]:
    if not path:
        return (), {}
    try:
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        return (), {}
    with _lock:
        cached = _cache.get(path)
        if cached and cached[0] == mtime:
            return cached[1], cached[2]
    limit = config.current().max_data_file_size
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
        if len(raw) > limit:
            raise ValueError(f"it is larger than {limit} bytes (WDS_MAX_DATA_FILE_SIZE)")
        data = _toml().loads(raw.decode("utf-8"))
    except Exception as exc:
        why = str(exc)[:200]
        raise ConfigError(
            f"{path}: cannot read the wds_cloud profiles file: {why}; it should hold one TOML "
            'table per URL prefix, e.g. ["s3://bucket/"] with endpoint_url = "..."'
        ) from exc
    profiles = []
    named = data.pop("profiles", {})
    if not isinstance(named, dict) or not all(isinstance(v, dict) for v in named.values()):
        raise ConfigError(
            f"{path}: [profiles] should hold one table per profile name, e.g. [profiles.laion] with its storage options"
        )
    for prefix, options in data.items():
        if not isinstance(options, dict) or "://" not in prefix and not prefix.endswith(":"):
            raise ConfigError(
                f'{path}: [{prefix!r}] should be a URL prefix such as "s3://bucket/" holding storage options'
            )
        profiles.append((prefix, dict(options)))
    result = tuple(sorted(profiles, key=lambda p: len(p[0])))
    with _lock:
        _cache[path] = (mtime, result, named)
    return result, named


def options_for(url: str, settings: Settings, storage_options: Optional[dict] = None) -> dict:
    """The storage options for ``url``: matching profiles, then the dataset's own options."""
    options: dict = {}
    for prefix, values in load_profiles(settings.cloud_config):
        if url.startswith(prefix):
            options.update({k: v for k, v in values.items() if k not in TRANSFER_KEYS})
    if storage_options:
        options.update(storage_options)
    return options


def transfer_for(url: str, settings: Settings) -> dict[str, tuple[Any, str]]:
    """The transfer keys (``part_size``, ``concurrency``, ...) the matching profiles set for ``url``, each as its
    value and the profile that set it (``the profile ["s3://bucket/"] of FILE``, for an error to name)."""
    found: dict[str, tuple[Any, str]] = {}
    for prefix, values in load_profiles(settings.cloud_config):
        if url.startswith(prefix):
            where = f"the profile [{json.dumps(prefix)}] of {settings.cloud_config}"
            found.update({k: (v, where) for k, v in values.items() if k in TRANSFER_KEYS})
    return found
