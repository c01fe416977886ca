"""Security policy: where shell commands and pickles are allowed.

``pipe:`` URLs written in the program run as in webdataset.  A URL that came
from data (a remote shard spec, an index file) is wrapped in :class:`UntrustedURL`
by whoever read it, and a URL produced by a rewrite rule that turned something
else into ``pipe:`` is treated the same; neither runs a command unless the user
set ``WDS_ALLOW_UNTRUSTED_PIPES=1``.  ``WDS_SECURE=1`` (or
``wds_cloud.utils.enforce_security = True``) forbids ``pipe:`` altogether.
"""

from __future__ import annotations

from typing import Optional

from .. import config, utils
from ..config import Settings
from ..errors import SecurityError, redact

__all__ = ["UntrustedURL", "is_secure", "check_pipe", "untrusted"]


class UntrustedURL(str):
    """A URL string that came from data rather than from the program."""

    __slots__ = ()


def untrusted(url: str) -> UntrustedURL:
    return url if isinstance(url, UntrustedURL) else UntrustedURL(url)


def is_secure(settings: Optional[Settings] = None) -> bool:
    """Whether secure mode is on: ``WDS_SECURE=1`` (in ``settings``, default the environment's now) or
    ``wds_cloud.utils.enforce_security`` (a module flag, read at each call as upstream users expect).

    The one secure-mode check: opening, pipes, rewrites and decoding all ask it.
    """
    if utils.enforce_security:
        return True
    return bool((settings if settings is not None else config.current()).secure)


def check_pipe(url: str, settings: Settings) -> None:
    """Refuse ``url`` (a ``pipe:`` URL) when the settings forbid running it."""
    if is_secure(settings):
        raise SecurityError(
            f"refusing to run {redact(url)!r}: pipe: URLs are forbidden while WDS_SECURE=1 "
            "(or wds_cloud.utils.enforce_security) is set (webdataset: gopen_pipe: unsafe_gopen is False, "
            "cannot open pipe URLs); use a storage URL such as s3:// or https:// instead",
            url=url,
        )
    if isinstance(url, UntrustedURL) and not settings.allow_untrusted_pipes:
        raise SecurityError(
            f"refusing to run {redact(url)!r}: this shell command came from data or from a rewrite rule, "
            "not from your program; if you trust its source, set WDS_ALLOW_UNTRUSTED_PIPES=1",
            url=url,
        )
