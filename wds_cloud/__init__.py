"""wds_cloud: feed deep-learning training from sharded WebDataset tars stored anywhere.

``import wds_cloud as wds`` runs code written for webdataset 1.0.2.  Importing
the package does no I/O and loads no plugin; plugins load on first use.
"""

__version__ = "0.1.0"

from . import errors, utils
from .errors import (
    ConfigError,
    CorruptShardError,
    CredentialsError,
    DecodingError,
    MissingExtraError,
    ObjectChangedError,
    PipeError,
    PluginConflictError,
    PluginError,
    SampleError,
    SecurityError,
    ShardNotFoundError,
    StateMismatchError,
    TransferError,
    UnknownSchemeError,
    WdsCloudError,
)
from .gopen import gopen, gopen_schemes, reader
from .hookspecs import hookimpl
from .config import Settings

__all__ = [
    "__version__",
    # configuration and plugins
    "Settings", "hookimpl",
    # I/O
    "gopen", "gopen_schemes", "reader",
    # modules
    "errors", "utils",
    # errors
    "WdsCloudError", "ConfigError", "UnknownSchemeError", "CorruptShardError", "DecodingError",
    "SampleError", "StateMismatchError", "MissingExtraError", "PluginError", "PluginConflictError",
    "ShardNotFoundError", "SecurityError", "CredentialsError", "TransferError", "PipeError",
    "ObjectChangedError",
]
