"""Opening a URL, and everything under it: the layer storage plugins build on.

The data path: :func:`~wds_cloud.io.open.gopen` applies the rewrite rules
(``WDS_REWRITE``, then the plugins' ``wds_cloud_rewrite_url`` hook), lets a plugin
route the URL to another backend (``wds_cloud_route_url``: AIStore's ``USE_AIS_FOR``),
asks the :mod:`~wds_cloud.io.registry` which backend claims the scheme, and wraps what
the backend opens in a :class:`~wds_cloud.io.resilient.ResumableStream` that survives
dropped connections.  The shard cache (:mod:`~wds_cloud.io.shardcache`) and the
opener stages (:mod:`wds_cloud.cache`) sit above it.

A plugin (built-in or third-party) imports what it needs from here and from
:mod:`wds_cloud.errors`, nothing else: the names below are that contract.
"""

from .atomic import AtomicFile
from .backend import Backend, InStream, ObjectInfo, OutStream, ReadStream, missing_modules, require, skip
from .fsbackend import FsspecBackend
from .hookspecs import hookimpl, hookspec
from .httpstream import (
    HTTPReadStream,
    connection_error,
    exchange,
    pinning_headers,
    raise_for_status,
    request,
    version_of,
)
from .mapped import map_file
from .open import gopen, open_backend, rewrite_url
from .pipes import Pipe
from .publishing import Publishing
from .registry import Claim, Registrar, Registry, get_registry, split_scheme
from .security import UntrustedURL, check_pipe, is_secure, untrusted
from .uploads import FsspecUpload, SpooledPut
from .urls import is_local, local_path, local_version

__all__ = [
    # the plugin contract
    "hookimpl",
    "hookspec",
    "Registrar",
    "Backend",
    "ReadStream",
    "InStream",
    "OutStream",
    "ObjectInfo",
    "FsspecBackend",
    "require",
    "missing_modules",
    "skip",
    # helpers backends build on
    "HTTPReadStream",
    "request",
    "exchange",
    "raise_for_status",
    "connection_error",
    "version_of",
    "pinning_headers",
    "SpooledPut",
    "FsspecUpload",
    "AtomicFile",
    "Publishing",
    "Pipe",
    "check_pipe",
    "is_secure",
    "untrusted",
    "UntrustedURL",
    # opening and URL facts
    "gopen",
    "open_backend",
    "rewrite_url",
    "Registry",
    "Claim",
    "get_registry",
    "split_scheme",
    "is_local",
    "local_path",
    "local_version",
    "map_file",
]
