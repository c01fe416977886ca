"""``wds-cloud settings``: the ``WDS_*`` environment variables, what each takes and does, and which are set.

The same table the site's environment page is made from (:data:`wds_cloud.config.ENV_DOCS`), for those who
installed the wheel and have no site.  Values are never printed (a rewrite rule or a profile path may hold a
credential): a variable is only marked as set.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from .. import config
from .console import EXIT_OK, emit

__all__ = ["add_parser"]


def _names(cell: str) -> list:
    return re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)


def _plain(cell: str) -> str:
    return cell.replace("`", "")


def _settings(args: argparse.Namespace) -> int:
    rows = []
    for names, form, default, example, meaning in config.ENV_DOCS:
        rows.append(
            {
                "names": _names(names) or [_plain(names)],
                "format": _plain(form),
                "default": _plain(default),
                "example": _plain(example),
                "meaning": _plain(meaning),
                "set": [name for name in _names(names) if os.environ.get(name) is not None],
            }
        )
    if args.name:
        wanted = args.name.upper()
        rows = [row for row in rows if any(wanted in name for name in row["names"])]

    def text(data: Any) -> str:
        out = []
        for row in data["settings"]:
            mark = f"  (set: {', '.join(row['set'])})" if row["set"] else ""
            out.append(f"{' / '.join(row['names'])}{mark}")
            out.append(f"    {row['meaning']}")
            out.append(f"    takes: {row['format']}; default: {row['default']}; example: {row['example']}")
        if not data["settings"]:
            out.append(f"no variable's name holds {args.name!r}: 'wds-cloud settings' lists them all")
        return "\n".join(out)

    emit(args, {"settings": rows}, text)
    return EXIT_OK


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "settings",
        help="list the WDS_* environment variables: what each takes and does, and which are set",
        description="List the WDS_* environment variables wds_cloud reads: the values each takes, its default, "
        "an example and what it does; those set in this environment are marked (their values are not shown).",
        epilog="examples:\n  wds-cloud settings\n  wds-cloud settings mmap\n  wds-cloud settings --json\n\n"
        "exit codes: 0 listed, 2 bad arguments (a flag, a WDS_* environment variable)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", nargs="?", help="only the variables whose name holds this (any case)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.set_defaults(func=_settings)
