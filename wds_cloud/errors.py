"""The exception tree of wds_cloud.

Every class subclasses both :class:`WdsCloudError` (so ``except WdsCloudError``
catches everything we raise on purpose) and the builtin that callers of a
data loader already catch::

    WdsCloudError(Exception)
    ├── ConfigError(ValueError)            an argument, setting or environment value is malformed
    │   └── MalformedDataError             a structured file from data (index, description, manifest, spec,
    │       │                              state, job record) is malformed, too large or too deep
    │       └── CorruptIndexError          a shard's index does not describe a shard (offsets, sizes, counts)
    ├── UnknownSchemeError(ValueError)     no backend claims the URL's scheme
    ├── CorruptShardError(ValueError, tarfile.ReadError)  a tar/compressed stream is damaged or truncated
    ├── DecodingError(ValueError)          a sample field could not be decoded
    ├── SampleError(ValueError)            a sample to be written is invalid (bad key, duplicate field)
    ├── IntegrityError(ValueError)         a shard does not match its manifest (size, samples, checksum)
    ├── RandomAccessError(ValueError)      a sample cannot be read at random (a compressed shard)
    ├── StateMismatchError(ValueError)     a saved state does not fit the dataset it is loaded into
    │   └── NotResumableError(TypeError)   state_dict(strict=True) of a pipeline that cannot be resumed
    ├── MissingExtraError(ImportError)     an optional dependency is not installed
    ├── PluginError(RuntimeError)          a plugin misbehaves or cannot be loaded
    │   └── PluginConflictError            two plugins claim one scheme
    ├── ShardNotFoundError(FileNotFoundError)
    ├── SecurityError(PermissionError, ValueError)  refused by a security rule (pipe:, pickle)
    ├── CredentialsError(PermissionError)  credentials missing or rejected by a store
    │   └── AccessDeniedError              accepted, but they may not do this (HTTP 403)
    └── TransferError(ConnectionError)     a connection or transfer failed (an OSError)
        ├── PipeError                      a pipe: command failed
        └── ObjectChangedError             the object changed while it was being read

One warning: :class:`InexactResumeWarning` (a ``UserWarning``), when a state that cannot be resumed exactly
is loaded and the epoch starts again (training goes on).

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
    "MalformedDataError",
    "CorruptIndexError",
    "UnknownSchemeError",
    "CorruptShardError",
    "IntegrityError",
    "RandomAccessError",
    "DecodingError",
    "SampleError",
    "StateMismatchError",
    "NotResumableError",
    "InexactResumeWarning",
    "MissingExtraError",
    "PluginError",
    "PluginConflictError",
    "ShardNotFoundError",
    "SecurityError",
    "CredentialsError",
    "AccessDeniedError",
    "TransferError",
    "PipeError",
    "ObjectChangedError",
    "redact",
]

# userinfo runs to the last "@" before the path, so a password holding "@" is covered whole
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<info>[^/?#\s]*)@")
_SECRET_QUERY = re.compile(
    r"(?i)([?&;](?:sig|signature|token|access_token|id_token|refresh_token|x-amz-signature|x-amz-security-token|"
    r"x-amz-credential|awsaccesskeyid|x-goog-signature|x-goog-credential|googleaccessid|key|api_key|apikey|"
    r"access_key|secret|client_secret|password|passwd|sv|se|skoid|sktid|code)=)[^&#;\s'\"]*"
)


def _userinfo(m: re.Match) -> str:
    info = m.group("info")
    if ":" in info:  # user:password -> the user stays, the password goes
        return f"{m.group('scheme')}{info.split(':', 1)[0]}:***@"
    return f"{m.group('scheme')}***@"  # a lone userinfo is often a token (https://TOKEN@host)


def redact(url: object) -> str:
    """``url`` (or any text holding URLs) with userinfo passwords and tokens and signed-query secrets as ``***``.

    The one redaction function: every URL wds_cloud prints, logs, stores in a state or puts
    into an error message goes through it.
    """
    text = str(url)
    if "@" in text:
        text = _USERINFO.sub(_userinfo, text)
    if "=" in text:
        text = _SECRET_QUERY.sub(r"\1***", text)
    return text


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


class MalformedDataError(ConfigError):
    """A structured file read from data (an index, a wids description, a manifest, a spec, a saved state, a
    job record, a line of documents) is malformed, larger or deeper than allowed, or claims what cannot be;
    ``url`` and ``field`` say where.  Also a ``ConfigError`` and a ``ValueError``."""


class CorruptIndexError(MalformedDataError):
    """A shard's index cannot describe the shard: offsets outside it or overlapping, sizes beyond it, counts
    that do not fit; write it again with ``wds-cloud index``."""


class UnknownSchemeError(WdsCloudError, ValueError):
    """No registered backend handles the URL's scheme."""


class CorruptShardError(WdsCloudError, ValueError, tarfile.ReadError):
    """A shard is damaged or truncated; ``offset`` and ``member`` say where.

    Also a ``tarfile.ReadError``, as webdataset raises for damaged tars.
    """


class DecodingError(WdsCloudError, ValueError):
    """A field of a sample could not be decoded; ``key`` and ``field`` say which."""


class SampleError(WdsCloudError, ValueError):
    """A sample is invalid: one given to a writer, or one a stage cannot use (a document missing an image)."""


class IntegrityError(WdsCloudError, ValueError):
    """A shard does not match its manifest: ``url``, ``expected`` and ``actual`` say how."""


class RandomAccessError(WdsCloudError, ValueError):
    """A sample cannot be read by itself (a compressed shard must be decompressed from its start)."""


class StateMismatchError(WdsCloudError, ValueError):
    """A saved iterator state does not match the dataset it is loaded into."""


class NotResumableError(StateMismatchError, TypeError):
    """``state_dict(strict=True)`` was asked of a pipeline that cannot be resumed; the message names the stage
    and the fix.

    Raised only when asked for: such a pipeline iterates as any other, and its plain ``state_dict()`` (which
    trainers call on their own) gives an inexact state that restarts the pass when loaded.
    """


class InexactResumeWarning(UserWarning):
    """A state that cannot be resumed exactly was loaded: the pass it was taken in starts again from its
    beginning (the message says why the state is inexact and the fix).  A warning, not an error: training
    goes on, as with webdataset, which has no states at all."""


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


class AccessDeniedError(CredentialsError):
    """The credentials were accepted but do not allow this operation."""


class TransferError(WdsCloudError, ConnectionError):
    """A connection or transfer failed after the attempts allowed."""


class PipeError(TransferError):
    """A ``pipe:`` command exited with an error; ``status`` and ``stderr`` tell why."""


class ObjectChangedError(TransferError):
    """The object was replaced while being read; two versions are never spliced."""
