"""What the ``wds-cloud`` commands show a person or a script: results, progress, errors and exit codes.

- Results go to stdout, as text or (``--json``) as one JSON document.
- Progress goes to stderr: a bar when stderr is a terminal, else a line every ``WDS_PROGRESS_INTERVAL``
  seconds (``verify: 120/1000 shards, 12.5 shards/s``) and one at the end, so that a job's log shows it.
- Exit codes: 0 done, 1 a problem with the data or the store (the message names the URL and the fix),
  2 bad arguments (:class:`UsageError`, argparse's own refusals, a malformed ``WDS_*`` setting, a destination
  holding another job's outputs: :func:`job_conflict`, or a library ``ConfigError`` raised with
  ``bad_argument=True``: an output that is an input, a credential in a URL, a destination whose record is of
  another output pattern), 130 interrupted.
- Messages of the library that advise a Python argument name the command's flag instead (:func:`for_cli`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

from .. import config
from ..errors import ConfigError

__all__ = [
    "UsageError",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_USAGE",
    "EXIT_CODES",
    "READ_EXIT_CODES",
    "progress",
    "emit",
    "shown",
    "for_cli",
    "job_conflict",
]

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
EXIT_CODES = (
    "exit codes: 0 done (every shard passed), 1 a shard could not be read or failed a check, 2 bad arguments "
    "(a flag, a WDS_* environment variable, or flags other than those recorded at the destination)"
)
#: the same for the commands that only read (no job, no destination)
READ_EXIT_CODES = (
    "exit codes: 0 done, 1 a shard or object could not be read, 2 bad arguments (a flag or a WDS_* environment "
    "variable)"
)


class UsageError(ConfigError):
    """The command line asks for something that cannot be done as given (exit code 2); the message names the
    flag and what to give instead."""


def progress(items: Iterable, total: Optional[int], what: str, unit: str = "shards", stream: Any = None) -> Iterator:
    """``items`` as they come, with progress on ``stream`` (stderr): a tqdm bar on a terminal, else a line
    every ``WDS_PROGRESS_INTERVAL`` seconds and a last one when the items end."""
    stream = stream or sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm

        yield from tqdm(items, total=total, desc=what, unit=unit.rstrip("s") or unit, file=stream, leave=False)
        return
    interval = config.current().progress_interval
    started = last = time.monotonic()
    done = 0

    def line(now: float) -> None:
        of = f"/{total}" if total is not None else ""
        rate = done / (now - started) if now > started else 0.0
        print(f"{what}: {done}{of} {unit}, {rate:,.1f} {unit}/s", file=stream, flush=True)

    for item in items:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= interval:
            line(now)
            last = now
    if done and (interval > 0 or last == started):
        line(time.monotonic())


def emit(args: argparse.Namespace, data: Any, text: Callable[[Any], str]) -> None:
    """Print a command's result: ``data`` as JSON with ``--json``, else ``text(data)``; names that are not UTF-8
    are shown escaped (:func:`shown`) in both."""
    if getattr(args, "json", False):
        print(json.dumps(_shown_all(data), indent=1))
    else:
        out = text(data)
        if out:
            print(shown(out))


def shown(text: str) -> str:
    """``text`` as printed: each byte of a name that is not UTF-8 (which the reader gives as a lone surrogate,
    ``'caf\\udce9'``) as ``\\xe9``, as ``tar`` shows such names with ``\\351``; a terminal or a pipe whose
    encoding cannot carry a lone surrogate would otherwise stop the command, and a JSON parser may refuse one.
    A backslash of the name itself is shown doubled (``\\``, as ``tar`` shows it), so that a name spelled
    ``caf\xe9`` in ASCII and one with the byte 0xE9 never look alike."""
    if "\\" in text:
        text = text.replace("\\", "\\\\")
    if text.isascii():
        return text
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that stands for no byte: shown as its code point
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _shown_all(data: Any) -> Any:
    """``data`` with :func:`shown` applied to every string in it (keys and values, at any depth)."""
    if isinstance(data, str):
        return shown(data)
    if isinstance(data, dict):
        return {_shown_all(k): _shown_all(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_shown_all(v) for v in data]
    return data


#: library advice that names a Python argument, and what a command line user does instead
_CLI_WORDS = (
    (re.compile(r" \(handler=\S+ skips damaged shards\)"), "; `wds-cloud verify SPEC` lists every damaged shard"),
    (re.compile(r"; handler=\S+ skips such shards"), ""),
    (re.compile(r" or max_member_size="), ""),
    (re.compile(r" or WebDataset\(\.\.\., max_sample_size=\)"), ""),
    (re.compile(r" or WebDataset\(\.\.\., max_member_size=\)"), ""),
    (re.compile(r"pass allow_missing=True"), "pass --allow-missing"),
    # shared messages lead with the environment variable and put the Python argument in "(in Python: ...)"
    (re.compile(r" \(in Python:[^()]*(?:\([^()]*\)[^()]*)*\)"), ""),
    (re.compile(r" \(webdataset: [^()]*\)"), ""),
    (re.compile(r",? ?or pass empty_check=False[^.;)]*"), ""),
    (re.compile(r"pass missing='drop' \(or 'skip'\)"), "pass --missing drop (or skip)"),
)
#: what the advice becomes inside ``wds-cloud verify``'s own rows (which list the damaged shards already)
_IN_VERIFY = ((re.compile(r" \(handler=\S+ skips damaged shards\)"), ""),)


def for_cli(message: str, command: str = "") -> str:
    """``message`` with advice about Python arguments replaced by what the command line offers (in
    ``command``'s own output: ``verify`` needs no pointer to itself)."""
    for pattern, words in (_IN_VERIFY if command == "verify" else ()) + _CLI_WORDS:
        message = pattern.sub(words, message)
    return message


#: a job record's setting, as the flag (or argument) of the command line that sets it
_FLAG_OF = {"function": "FUNCTION", "inputs": "the input shards", "tool": "the command"}


def _flag_value(key: str, value: Any) -> str:
    if key == "tool":
        return f"`wds-cloud {value}`"
    if key == "inputs":
        return f"{len(value)} shards" if isinstance(value, list) else "something else"
    flag = _FLAG_OF.get(key, "--" + key.replace("_", "-"))
    if value is None or value is False:
        return f"no {flag}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e18:
        value = int(value)
    shown = str(value) if isinstance(value, (int, float, str)) else type(value).__name__
    return f"{flag} {shown[:80]}" if value is not True else flag


def job_conflict(exc: Exception) -> str:
    """A job record's conflict (``ConfigError.conflict``: ``(setting, recorded, now)`` rows) in flags: what was
    recorded, what was given now, and the two ways on.  A record of another command lists that command and its
    own flags (its settings are not flags of the command typed now); the rerun that works is spelled out."""
    rows = list(getattr(exc, "conflict", ()))
    where = getattr(exc, "destination", "the destination")
    record = getattr(exc, "record", "its job record")
    tools = [(then, now) for key, then, now in rows if key == "tool"]
    other = f"write to a new destination (or remove {record} and the outputs it lists)"
    if tools:
        then, now = tools[0]
        recorded = {key: was for key, was, _ in rows if key not in ("tool", "inputs") and was is not None}
        if then == "map" and recorded.get("function") == _OLD_DASK_RESHARD:
            return (
                f"{where} holds the outputs of a `wds-cloud reshard` run on Dask by an earlier version, which "
                f"numbered them by input (this version cuts them as one process does, whatever the workers); "
                f"{other}"
            )
        flags = " ".join(_flag_value(key, value) for key, value in sorted(recorded.items()))
        return (
            f"{where} holds the outputs of another command, {_flag_value('tool', then)}"
            + (f" ({flags})" if flags else "")
            + f", not `wds-cloud {now}`: {other}"
        )
    said, again = [], []
    for key, then, now in rows:
        if key == "inputs" and isinstance(then, list) and isinstance(now, list) and len(then) == len(now):
            said.append("other input shards were recorded than those given now")
        elif key == "inputs" and isinstance(then, str) and isinstance(now, str):  # "6 inputs", "input 3 URL"
            said.append(f"the record has {then}, {now} given now")
        else:
            said.append(f"{_flag_value(key, then)} was recorded, {_flag_value(key, now)} given now")
        if key != "inputs":
            again.append(_flag_value(key, then))
    rerun = f"rerun with {' '.join(again)}" if again else "rerun with the recorded input shards"
    return f"{where} holds the outputs of another job: {'; '.join(said)}; {rerun}, or {other}"


#: the function an earlier version's ``wds-cloud reshard --workers`` recorded as a map job
_OLD_DASK_RESHARD = "wds_cloud.tools.dask:passthrough"
