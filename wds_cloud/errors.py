"""The exception tree of wds_cloud.

Every class subclasses both :class:`WdsCloudError` (so ``except WdsCloudError``
catches everything we raise on purpose) and the builtin that callers of a
data loader already catch::

    WdsCloudError(Exception)
    ├── ConfigError(ValueError)            a setting or environment value is malformed
    ├── UnknownSchemeError(ValueError)     no backend claims the URL's scheme
    ├── CorruptShardError(ValueError, tarfile.ReadError)  a tar/compressed stream is damaged or truncated
    ├── DecodingError(ValueError)          a sample field could not be decoded
    ├── SampleError(ValueError)            a sample to be written is invalid (bad key, duplicate field)
    ├── StateMismatchError(ValueError)     a saved state does not fit the dataset it is loaded into
    │   └── NotResumableError(TypeError)   state_dict() of a pipeline that cannot be resumed
    ├── MissingExtraError(ImportError)     an optional dependency is not installed
    ├── PluginError(RuntimeError)          a plugin misbehaves or cannot be loaded
    │   └── PluginConflictError            two plugins claim one scheme
    ├── ShardNotFoundError(FileNotFoundError)
    ├── SecurityError(PermissionError, ValueError)  refused by a security rule (pipe:, pickle)
    ├── CredentialsError(PermissionError)  credentials missing or rejected by a store
    └── TransferError(ConnectionError)     a connection or transfer failed (an OSError)
        ├── PipeError                      a pipe: command failed
        └── ObjectChangedError             the object changed while it was being read

Messages name the value at fault (the URL, the byte offset, the member), the
rule that was broken, and the fix.  URLs are passed through :func:`redact`
before they are put into a message, so credentials never end up in logs.
"""

from __future__ import annotations

import re
import tarfile

__all__ = [
    "WdsCloudError",
    "ConfigError",
    "UnknownSchemeError",
    "CorruptShardError",
    "DecodingError",
    "SampleError",
    "StateMismatchError",
    "NotResumableError",
    "MissingExtraError",
    "PluginError",
    "PluginConflictError",
    "ShardNotFoundError",
    "SecurityError",
    "CredentialsError",
    "TransferError",
    "PipeError",
    "ObjectChangedError",
    "redact",
]

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^/@:\s]*)(:[^/@\s]*)?@")
_SECRET_QUERY = re.compile(
    r"(?i)([?&](?:sig|signature|token|access_token|x-amz-signature|x-amz-security-token|"
    r"x-goog-signature|x-amz-credential|key|secret|password|sv|se)=)[^&#\s]*"
)


def redact(url: object) -> str:
    """Return ``url`` as text with passwords and signed-query secrets replaced by ``***``."""
    text = str(url)
    text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{m.group('user')}:***@" if m.group(3) else m.group(0), text)
    return _SECRET_QUERY.sub(r"\1***", text)


class WdsCloudError(Exception):
    """Base of every error wds_cloud raises on purpose.

    ``url`` (redacted) and any other keyword context given are kept as attributes,
    so handlers can inspect them without parsing the message.
    """

    def __init__(self, message: str = "", *, url: object = None, **context: object) -> None:
        super().__init__(message)
        self.url = redact(url) if url is not None else None
        for key, value in context.items():
            setattr(self, key, value)

    def __str__(self) -> str:  # a builtin OSError would print "[Errno None] ..." otherwise
        return self.args[0] if self.args else ""


class ConfigError(WdsCloudError, ValueError):
    """A configuration value (argument or environment variable) is malformed."""


class UnknownSchemeError(WdsCloudError, ValueError):
    """No registered backend handles the URL's scheme."""


class CorruptShardError(WdsCloudError, ValueError, tarfile.ReadError):
    """A shard is damaged or truncated; ``offset`` and ``member`` say where.

    Also a ``tarfile.ReadError``, as webdataset raises for damaged tars.
    """


class DecodingError(WdsCloudError, ValueError):
    """A field of a sample could not be decoded; ``key`` and ``field`` say which."""


class SampleError(WdsCloudError, ValueError):
    """A sample given to a writer is invalid."""


class StateMismatchError(WdsCloudError, ValueError):
    """A saved iterator state does not match the dataset it is loaded into."""


class NotResumableError(StateMismatchError, TypeError):
    """``state_dict()`` was asked of a pipeline that cannot be resumed; the message names the stage and the fix.

    Raised only by ``state_dict()``: such a pipeline iterates as any other.
    """


class MissingExtraError(WdsCloudError, ImportError):
    """An optional dependency is missing; the message gives the ``pip install`` line."""


class PluginError(WdsCloudError, RuntimeError):
    """A plugin could not be loaded or broke the hook contract."""


class PluginConflictError(PluginError):
    """Two plugins claim the same scheme and neither says ``override=True``."""


class ShardNotFoundError(WdsCloudError, FileNotFoundError):
    """The shard (file or object) does not exist."""


class SecurityError(WdsCloudError, PermissionError, ValueError):
    """An operation was refused by a security rule; the message says how to allow it.

    Also a ``ValueError``, which is what webdataset raises for its security refusals.
    """


class CredentialsError(WdsCloudError, PermissionError):
    """Credentials are missing or were rejected by the store."""


class TransferError(WdsCloudError, ConnectionError):
    """A connection or transfer failed after the attempts allowed."""


class PipeError(TransferError):
    """A ``pipe:`` command exited with an error; ``status`` and ``stderr`` tell why."""


class ObjectChangedError(TransferError):
    """The object was replaced while being read; two versions are never spliced."""
