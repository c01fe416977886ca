"""The values the ``wds-cloud`` flags take, checked when the command line is parsed (issue 41).

Each is an argparse ``type=``: a malformed value stops the command before anything is created (no job
record, no output, no cluster), with exit code 2 and one line naming the flag, the value and what is
accepted, never a traceback.  ``Parser`` makes argparse's own refusals that one line too (its usage
block is what ``--help`` is for), and, when ``--json`` was asked for, prints them as JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import NoReturn

from ..errors import ConfigError, redact

__all__ = ["Parser", "count", "size", "scheduler", "output_pattern", "text", "json_failure", "MAX_PARALLEL"]

#: the most --jobs/--workers a command takes: beyond this a typo (10000 for 100) would start that many
#: processes or threads
MAX_PARALLEL = 1024


def json_failure(message: str, code: int) -> None:
    """The result of a command that failed, for ``--json``: a JSON object on stdout (scripts parse stdout)."""
    print(json.dumps({"ok": False, "error": message, "exit_code": code}, indent=1))


class Parser(argparse.ArgumentParser):
    """argparse's parser, refusing in one line: ``wds-cloud verify: error: argument --jobs: ...``."""

    #: set by ``wds_cloud.cli.main`` for the command line it parses: whether ``--json`` is in it
    wants_json = False

    def error(self, message: str) -> NoReturn:
        line = f"{self.prog}: error: {message} (see '{self.prog} --help')"
        if Parser.wants_json:
            json_failure(line, 2)
        print(line, file=sys.stderr)
        sys.exit(2)


def _number_text(text: str) -> str:
    return redact(text)[:80] + ("..." if len(text) > 80 else "")


def count(minimum: int, maximum: int = 1 << 62, what: str = "a whole number") -> Callable[[str], int]:
    """An argparse type: a whole number from ``minimum`` to ``maximum``."""
    bounds = f"at least {minimum}" if maximum >= 1 << 62 else f"from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text.strip().replace("_", ""), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_number_text(text)!r} is not {what}: give {bounds}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{value} is out of range: give {bounds}")
        return value

    parse.__name__ = "count"
    return parse


def size(text: str) -> float:
    """An argparse type: a finite number of bytes above 0 (``3e9``, ``500000000``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{_number_text(text)!r} is not a number: give a number of bytes above 0, such as 3e9"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text.strip()!r}: give a finite number of bytes above 0, such as 3e9")
    return value


def scheduler(text: str) -> str:
    """An argparse type: a Dask scheduler address (checked without the dask extra)."""
    from ..tools.dask import scheduler_address

    try:
        return scheduler_address(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def output_pattern(text: str) -> str:
    """An argparse type: an output name pattern with exactly one number field (``wds_cloud.io.patterns``)."""
    from ..io.patterns import PATTERN_RULE, output_pattern_problem

    problem = output_pattern_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{redact(text)!r}: {problem}; {PATTERN_RULE}")
    return text


def text(what: str) -> Callable[[str], str]:
    """An argparse type: a non-empty string without NUL (a URL, a path, a name)."""

    def parse(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"an empty {what}: give one")
        if "\0" in value:
            raise argparse.ArgumentTypeError(f"{_number_text(value)!r} holds a NUL character: give a {what} without")
        return value

    parse.__name__ = "text"
    return parse
