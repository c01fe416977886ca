"""The values the ``wds-cloud`` flags take, checked when the command line is parsed.

Each is an argparse ``type=``: a malformed value stops the command before anything is created (no job
record, no output, no cluster), with exit code 2 and one line naming the flag, the value and what is
accepted, never a traceback.  ``Parser`` makes argparse's own refusals that one line too (its usage
block is what ``--help`` is for), and, when ``--json`` was asked for, prints them as JSON on stdout.
"""

from __future__ import annotations

import argparse
import decimal
import json
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from ..errors import ConfigError, holds_credential, redact

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

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        known, extras = self.parse_known_args(args, namespace)
        if extras:  # said by the (sub)command they were given to, whose --help lists its flags
            self._chosen(known).error(f"unrecognized arguments: {' '.join(extras)}")
        return known

    def _chosen(self, known: Any) -> argparse.ArgumentParser:
        """The innermost subcommand's parser that ``known`` (parsed arguments) names, or this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(known, action.dest, None) or "")
                if sub is not None:
                    return sub._chosen(known) if isinstance(sub, Parser) else sub
        return self

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


#: the suffixes a size flag takes: decimal (k, M, G, T, P: powers of 1000) and binary (KiB, MiB, ...: of 1024)
_SIZE_SUFFIX = {
    "": 1,
    **{u: 1000**i for i, u in enumerate("kmgtp", 1)},
    **{u + "i": 1024**i for i, u in enumerate("kmgtp", 1)},
}
_SIZE = re.compile(
    r"\s*([0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(e[+-]?[0-9]{1,3})?\s*([kmgtp]i?)?b?\s*", re.IGNORECASE
)
#: the largest size a flag takes (an exabyte): beyond it a typo
MAX_SIZE = 10**18
SIZE_RULE = "give a whole number of bytes, 1 or more, with an optional suffix, such as 3e9, 500M or 2GiB"


def size(text: str) -> int:
    """An argparse type: a whole number of bytes, 1 or more (``3e9``, ``500000000``, ``500M``, ``2GiB``); the same
    rule for every size flag (one rule, so that ``--maxsize 0.5`` cannot be one byte to one command and refused by
    another)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r} is not a size: {SIZE_RULE}")
    number, exponent, suffix = match.groups()
    try:
        value = decimal.Decimal(number.replace("_", "") + (exponent or "")) * _SIZE_SUFFIX[(suffix or "").lower()]
    except decimal.InvalidOperation:
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r} is not a size: {SIZE_RULE}") from None
    if value != value.to_integral_value() or not 1 <= value <= MAX_SIZE:
        shown = text.strip()[:80]
        why = "a fraction of a byte" if 1 <= value <= MAX_SIZE else f"out of range (1 to {MAX_SIZE:.0e} bytes)"
        if value < 1:
            why = "less than one byte"
        raise argparse.ArgumentTypeError(f"{shown!r} is {why}: {SIZE_RULE}")
    return int(value)


def scheduler(text: str) -> str:
    """An argparse type: a Dask scheduler address (checked without the dask extra)."""
    from ..tools.dask import scheduler_address

    try:
        return scheduler_address(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def output_pattern(text: str) -> str:
    """An argparse type: an output name pattern with exactly one number field (``wds_cloud.jobs.patterns``)."""
    from ..jobs.patterns import PATTERN_RULE, output_pattern_problem

    problem = output_pattern_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{redact(text)!r}: {problem}; {PATTERN_RULE}")
    if holds_credential(text):  # the job record lists every output name, the claim and the summary too
        raise argparse.ArgumentTypeError(
            f"{redact(text)!r} carries a credential in its text; output names are written into the job record and "
            "shown: give the credential through the environment or a storage profile (WDS_CLOUD_CONFIG) instead"
        )
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
