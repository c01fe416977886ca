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

import errno
import functools
import os
import re
import tarfile
import urllib.parse
from typing import Optional

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
    "is_credential_name",
    "holds_credential",
]

# The one list of credential spellings: lists kept apart drift, and a secret one of them hid another showed.
# redact() hides what they name, and every check that refuses a secret in a URL (a Dask task, a job record's
# destination) asks holds_credential(), which asks redact(): a new spelling added here is hidden and refused
# everywhere at once.  docs/security.md states the rule.
#: a name holding one of these (case, separators and percent-encoding ignored) names a credential
_CREDENTIAL_STEMS = ("token", "secret", "passw", "passphrase", "credential", "signature", "session", "auth", "cookie")
#: a word of the name (split at separators and case changes) that is, or ends in, one of these: api_key, apikey,
#: accessKey, sig, urlsig (a word that only starts so, keyframe or signal, is not)
_CREDENTIAL_WORD_ENDINGS = ("key", "sig")
#: a word of the name that is exactly one of these (bypass and compass are not)
_CREDENTIAL_WORDS = frozenset({"pass", "pwd", "jwt", "bearer"})
#: whole names of signed URLs and OAuth answers that the rules above miss
_CREDENTIAL_NAMES = frozenset({"awsaccesskeyid", "googleaccessid", "code", "sv", "se", "skoid", "sktid"})
_NOT_AUTH = re.compile(r"author(?!i[sz])")  # author, authored, authority: people, not authorization
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

# what a browser or proxy reads as the start of an authority (WHATWG URL standard): a backslash counts as a slash,
# and after a special scheme (http, https, ws, wss, ftp) any number of slashes, none included, comes before it, so
# https:\\user:pass@host, https:///user:pass@host and https:user:pass@host all send user:pass to host
_AUTHORITY_START = (
    r"(?:(?<![a-zA-Z0-9+.-])(?i:https?|wss?|ftp):[/\\]*|[a-zA-Z][a-zA-Z0-9+.-]*:[/\\]{2,}|(?:^|(?<=[\s'\"(<=,\[]))//)"
)
# userinfo runs to the last "@" before the path, so a password holding "@" is covered whole; a scheme-relative
# URL (//user:pass@host) counts where it starts a word; a tab or control character inside it (which browsers
# drop) does not end it
_USERINFO = re.compile(rf"(?P<scheme>{_AUTHORITY_START})(?P<info>(?:[^/\\?#\s]|[\t\r\x00-\x08\x0b-\x1f\x7f])*)@")
# a query, fragment or path parameter; the name may be percent-encoded, and so may its "=" (X-Auth-Token%3Dvalue),
# which a server decodes.  Spaces, tabs and control characters inside or around a name (?token\t=v) do not end
# it: browsers drop tabs and many servers strip the rest, so is_credential_name() judges the name without them
_CONTROL = "\t\r\x00-\x08\x0b-\x1f\x7f"
_PARAMETER = re.compile(
    rf"(?P<lead>[?&;#])(?P<name>[^=&;#?'\"\n]+)(?:=(?P<value>[{_CONTROL} ]*(?:[^&;#\s'\"]|[{_CONTROL}])*))?"
)
# the rest of a shell word from where a value starts: backslash escapes, quoted runs and plain characters, up to
# the first unquoted, unescaped blank (-HAuthorization:Bearer\ TOKEN and --cookie='a=b; c=d' are one word each)
_WORD_REST = r"(?:\\.|'[^'\n]*'|\"(?:\\.|[^\"\\\n])*\"|[^\s'\"\\])*"
# where a shell word (an option, an assignment) may begin: the start, a blank, a quote, "(" or "pipe:" (not "&" or
# ";", which part a URL's query)
_WORD_START = r"(?:(?<![^\s'\"(])|(?<=pipe:))"
# a header a command sends (curl -H 'X-Auth-Token: v', --header "Authorization: Bearer v", -HCookie:a=b)
_HEADER = re.compile(
    rf"(?P<head>{_WORD_START}(?:-[A-Za-z]*H|--header)(?:=|\s*)(?P<q>['\"])?(?P<name>[A-Za-z0-9_.-]+)\s*:\s*)"
    rf"(?P<value>(?(q)[^'\"\n]*|{_WORD_REST}))"
)
# an option with its value, --name=value, -name=value, --name value (the value a word not starting with "-")
_OPTION = re.compile(
    rf"(?P<head>{_WORD_START}--?(?P<name>[A-Za-z][\w-]*)(?:=|(?P<blank>\s+)(?=[^\s-])))(?P<value>{_WORD_REST})"
)
# options named like a credential that take no value: the word after them is the next argument (the URL)
_VALUELESS = frozenset(
    {"anyauth", "proxy-anyauth", "junk-session-cookies", "keep-session-cookies", "auth-no-challenge", "ask-password"}
)
# curl's -b/--cookie given inline (name=value; a value without "=" names a cookie file), bundled or attached too
_COOKIE_OPTION = re.compile(rf"(?P<head>{_WORD_START}-[A-Za-z]*b(?:\s+|(?=\S)))(?P<value>(?=[^\s-]){_WORD_REST})")
# curl's --user/-u and --proxy-user/-U name:password: the password goes
_USER_OPTION = re.compile(
    rf"(?P<head>{_WORD_START}(?:-[A-Za-z]*[uU]|--user|--proxy-user)(?:=|\s*)['\"]?[^:\s'\"]*:)"
    rf"(?P<value>{_WORD_REST})"
)
# a shell assignment of a credential variable (env API_TOKEN=v cmd, API_TOKEN=v cmd, export SECRET=v; also a
# form field given as a word, -d password=v): the value goes, to the end of the word
_ASSIGNMENT = re.compile(rf"(?P<head>{_WORD_START}(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)=)(?P<value>{_WORD_REST})")


def _unquoted(text: str) -> str:
    """``text`` percent-decoded until it no longer changes, as a server (or a proxy in front of it) may decode it."""
    while True:
        out = urllib.parse.unquote(text, errors="surrogateescape")
        if out == text:
            return out
        text = out


@functools.lru_cache(maxsize=4096)
def is_credential_name(name: str) -> bool:
    """Whether a query parameter, header or option called ``name`` holds a credential: its name, percent-decoded
    and in any case, holds token, secret, password, credential, signature, session, auth (not author) or cookie;
    or a word of it is, or ends in, key or sig (``api_key``, ``apikey``, ``X-Amz-Signature``, ``sig``); or it is
    one of the names of signed URLs (``AWSAccessKeyId``, ``GoogleAccessId``, Azure's ``sv``/``se``/``skoid``/
    ``sktid``) or OAuth's ``code``.  A name that only begins like one (``keyframe``, ``signal``) is not."""
    plain = _unquoted(name)
    compact = re.sub(r"[^a-z0-9]", "", plain.lower())
    if compact in _CREDENTIAL_NAMES:
        return True
    if any(stem in _NOT_AUTH.sub("", compact) for stem in _CREDENTIAL_STEMS):
        return True
    words = [w.lower() for w in _WORDS.findall(plain)]
    return any(w in _CREDENTIAL_WORDS or w.endswith(_CREDENTIAL_WORD_ENDINGS) for w in words)


def _userinfo(m: re.Match) -> str:
    info = m.group("info")
    if ":" in info:  # user:password -> the user stays, the password goes
        return f"{m.group('scheme')}{info.split(':', 1)[0]}:***@"
    return f"{m.group('scheme')}***@"  # a lone userinfo is often a token (https://TOKEN@host)


def _parameter(m: re.Match) -> str:
    name, value = m.group("name"), m.group("value")
    if value is None:  # no "=": perhaps an encoded one, which the server decodes into name and value
        plain = _unquoted(name)
        if "=" not in plain or not is_credential_name(plain.split("=", 1)[0]):
            return m.group(0)
        return f"{m.group('lead')}{plain.split('=', 1)[0]}=***"
    return f"{m.group('lead')}{name}=***" if is_credential_name(name) else m.group(0)


def _named(m: re.Match) -> str:
    return f"{m.group('head')}***" if is_credential_name(m.group("name")) and m.group("value") else m.group(0)


def _option(m: re.Match) -> str:
    name = m.group("name")
    if not m.group("value") or not is_credential_name(name):
        return m.group(0)
    if m.group("blank") and (name in _VALUELESS or name.startswith("no-")):
        return m.group(0)  # --anyauth URL: a flag; the word after it is not its value
    return f"{m.group('head')}***"


def _cookie(m: re.Match) -> str:
    return f"{m.group('head')}***" if "=" in m.group("value") else m.group(0)


def redact(url: object) -> str:
    """``url`` (or any text holding URLs or commands) with its credentials as ``***``: userinfo passwords and
    tokens (backslashes and extra slashes after the scheme read as a browser reads them), the values of query,
    fragment and path parameters that :func:`is_credential_name` recognises (percent-encoded or not, spaces and
    control characters in the name ignored), and in a command, to the end of the shell word, the values of
    credential headers and options (``--opt=v``, ``--opt v``, ``-b v``), of ``-u user:password`` and of
    credential assignments (``env API_TOKEN=v cmd``).

    The one redaction function: every URL wds_cloud prints, logs, stores in a state, a job record or a task, or
    puts into an error message goes through it.
    """
    text = str(url)
    if "@" in text:
        text = _USERINFO.sub(_userinfo, text)
    if "=" in text or "%" in text:
        text = _PARAMETER.sub(_parameter, text)
    if "-" in text:  # options
        text = _HEADER.sub(_named, text)
        text = _OPTION.sub(_option, text)
        text = _COOKIE_OPTION.sub(_cookie, text)
        text = _USER_OPTION.sub(lambda m: f"{m.group('head')}***" if m.group("value") else m.group(0), text)
    if "=" in text:  # shell assignments (env TOKEN=v cmd)
        text = _ASSIGNMENT.sub(_named, text)
    return text


def holds_credential(url: object) -> bool:
    """Whether ``url`` carries a credential in its text (what :func:`redact` would hide): the one check of every
    place that refuses such a URL."""
    return redact(url) != str(url)


class WdsCloudError(Exception):
    """Base of every error wds_cloud raises on purpose.

    ``url`` (redacted) and any other keyword context given are kept as attributes,
    so handlers can inspect them without parsing the message.
    """

    #: the ``errno`` an error that is an ``OSError`` carries (``None``: no code fits), as the builtin it stands for
    #: would; its ``filename`` is the redacted URL.  A raise site may give ``errno=`` or ``filename=`` of its own.
    os_errno: Optional[int] = None

    def __init__(self, message: str = "", *, url: object = None, **context: object) -> None:
        super().__init__(message)
        self.url = redact(url) if url is not None else None
        if isinstance(self, OSError):
            # code that catches OSError reads errno and filename (webdataset 1.0.2 raises the builtin
            # FileNotFoundError(ENOENT, ..., path)); str() stays our message (see __str__)
            # set through setattr: these are OSError's attributes, which this base (not itself an OSError) lacks
            setattr(self, "errno", self.os_errno)  # noqa: B010
            setattr(self, "strerror", os.strerror(self.os_errno) if self.os_errno is not None else None)  # noqa: B010
            setattr(self, "filename", self.url)  # noqa: B010
        for key, value in context.items():
            if key == "filename" and value is not None:
                value = redact(value)
            setattr(self, key, value)

    def __reduce__(self) -> tuple:
        """Pickled (a DataLoader worker's error) with its attributes, errno and filename too."""
        state = dict(self.__dict__, args=self.args)  # args a handler extended (webdataset appends the URL) too
        if isinstance(self, OSError):
            state.update({k: getattr(self, k) for k in ("errno", "strerror", "filename")})
        return (type(self), self.args[:1], state)

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
    trainers call on their own) gives an inexact state that restarts the pass when loaded.  One case refuses a
    plain ``state_dict()`` too: a dataset handed to torch ``DataLoader`` worker processes and not iterated in this
    process since (the workers read copies of it, so no state of this one can say where they stand; a state
    restarting the pass would deliver their samples twice); the message names ``wds.WebLoader`` and torchdata's
    ``StatefulDataLoader``, which take the workers' states.
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
    """The shard (file or object) does not exist; ``errno`` is ``ENOENT`` and ``filename`` the redacted URL, as
    for the builtin ``FileNotFoundError`` webdataset raises."""

    os_errno = errno.ENOENT


class SecurityError(WdsCloudError, PermissionError, ValueError):
    """An operation was refused by a security rule; the message says how to allow it.

    Also a ``ValueError``, which is what webdataset raises for its security refusals.  ``errno`` is ``EACCES``.
    """

    os_errno = errno.EACCES


class CredentialsError(WdsCloudError, PermissionError):
    """Credentials are missing or were rejected by the store; ``errno`` is ``EACCES``."""

    os_errno = errno.EACCES


class AccessDeniedError(CredentialsError):
    """The credentials were accepted but do not allow this operation."""


class TransferError(WdsCloudError, ConnectionError):
    """A connection or transfer failed after the attempts allowed; ``errno`` is ``EIO`` (input/output error)."""

    os_errno = errno.EIO


class PipeError(TransferError):
    """A ``pipe:`` command exited with an error; ``status`` and ``stderr`` tell why."""


class ObjectChangedError(TransferError):
    """The object was replaced while being read; two versions are never spliced.  ``errno`` is ``ESTALE``."""

    os_errno = getattr(errno, "ESTALE", errno.EIO)
