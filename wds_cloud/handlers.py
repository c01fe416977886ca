"""Exception handlers for the ``handler=`` argument of pipeline stages.

A handler receives the exception; returning True means "continue" (skip the
item, sample or shard), returning False means "stop the iteration", raising
propagates it.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["reraise_exception", "ignore_and_continue", "warn_and_continue", "ignore_and_stop", "warn_and_stop"]

log = logging.getLogger(__name__)


def reraise_exception(exn: BaseException) -> bool:
    """Raise the exception (the default)."""
    raise exn


def ignore_and_continue(exn: BaseException) -> bool:
    """Skip silently and go on."""
    return True


def warn_and_continue(exn: BaseException) -> bool:
    """Warn, then skip and go on."""
    warnings.warn(repr(exn), stacklevel=2)
    return True


def ignore_and_stop(exn: BaseException) -> bool:
    """Stop silently."""
    return False


def warn_and_stop(exn: BaseException) -> bool:
    """Warn, then stop."""
    warnings.warn(repr(exn), stacklevel=2)
    return False
