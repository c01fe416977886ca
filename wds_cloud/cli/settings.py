"""``wds-cloud settings``: the ``WDS_*`` environment variables, what each takes and does, and which are set.

The same table the site's environment page is made from (:data:`wds_cloud.config.ENV_DOCS`), for those who
installed the wheel and have no site.  Values are not listed (a rewrite rule or a profile path may hold a
credential): a variable is only marked as set.  Where the environment is refused, the listing is given all the same
with what is wrong, as every other command words it (a credential in a URL masked), and the exit status is 2.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from .. import config
from ..errors import ConfigError, redact
from .console import EXIT_OK, EXIT_USAGE, emit

__all__ = ["add_parser"]


def _names(cell: str) -> list:
    return re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)


def _plain(cell: str) -> str:
    return cell.replace("`", "")


def _settings(args: argparse.Namespace) -> int:
    listed = {name for row in config.ENV_DOCS for name in _names(row[0])}
    given_names = config.variables_set()
    rows = []
    for names, form, default, example, meaning in config.ENV_DOCS:
        plain = _plain(names)
        if "<" in plain:  # a family (WDS_<NAME>): the variables of its prefix that no other row names
            prefix = plain.split("<", 1)[0]
            given = sorted(n for n in given_names if n.startswith(prefix) and n not in listed)
        else:
            given = [name for name in _names(names) if name in given_names]
        rows.append(
            {
                "names": _names(names) or [plain],
                "format": _plain(form),
                "default": _plain(default),
                "example": _plain(example),
                "meaning": _plain(meaning),
                "set": given,
            }
        )
    if args.name:
        wanted = args.name.upper()
        rows = [row for row in rows if any(wanted in name for name in row["names"])]
    try:
        config.current()
        problem = None
    except ConfigError as exc:  # the environment as it stands is refused: said here, the listing still given
        problem = re.sub(r"\s*\n\s*", " ", redact(str(exc))).strip()

    def text(data: Any) -> str:
        out = []
        for row in data["settings"]:
            mark = f"  (set: {', '.join(row['set'])})" if row["set"] else ""
            out.append(f"{' / '.join(row['names'])}{mark}")
            out.append(f"    {row['meaning']}")
            out.append(f"    takes: {row['format']}; default: {row['default']}; example: {row['example']}")
        if not data["settings"]:
            out.append(f"no variable's name holds {args.name!r}: 'wds-cloud settings' lists them all")
        if data["problem"]:
            out.append(f"\nthe environment is refused (every other command exits 2): {data['problem']}")
        return "\n".join(out)

    emit(args, {"settings": rows, "problem": problem}, text)
    return EXIT_OK if problem is None else EXIT_USAGE


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "settings",
        help="list the WDS_* environment variables: what each takes and does, and which are set",
        description="List the WDS_* environment variables wds_cloud reads: the values each takes, its default, "
        "an example and what it does; those set in this environment are marked (their values are not shown).",
        epilog="examples:\n  wds-cloud settings\n  wds-cloud settings mmap\n  wds-cloud settings --json\n\n"
        "exit codes: 0 listed, 2 bad arguments (a flag) or a WDS_* variable refused (listed all the same, with\n"
        "what is wrong)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", nargs="?", help="only the variables whose name holds this (any case)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.set_defaults(func=_settings)
