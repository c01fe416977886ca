"""The ``wds-cloud`` command line: ``backends``, ``demo`` and the shard tools (:mod:`wds_cloud.cli.shardtools`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Optional

from .. import __version__, config
from ..errors import WdsCloudError
from ..io.registry import get_registry
from .console import EXIT_CODES, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, UsageError, emit, for_cli
from .demo import add_parser as add_demo
from .shardtools import add_parsers as add_tools

__all__ = ["main"]


def _backends(args: argparse.Namespace) -> int:
    registry = get_registry(config.current())
    claims = [(scheme, registry.claims[scheme], "plugin") for scheme in registry.schemes()]
    if args.all:
        claims += [(scheme, claim, "fsspec") for scheme, claim in registry.fallback_claims().items()]
    rows = []
    for scheme, claim, kind in claims:
        missing = claim.missing()
        rows.append(
            {
                "scheme": scheme,
                "plugin": claim.plugin,
                "distribution": claim.distribution,
                "kind": kind,
                "ready": not missing,
                "install": None if not missing else claim.install_hint(),
            }
        )

    def text(data: dict) -> str:
        table = [("SCHEME", "PLUGIN", "DISTRIBUTION", "STATUS")] + [
            (
                f"{r['scheme']}:",
                r["plugin"],
                r["distribution"] or "-",
                "ready" if r["ready"] else f"needs {r['install']}",
            )
            for r in data["backends"]
        ]
        widths = [max(len(row[i]) for row in table) for i in range(3)]
        lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])) + "  " + row[3] for row in table]
        if not args.all:
            lines.append("\n(--all adds the schemes fsspec opens without a plugin of ours)")
        if data["disabled"]:
            lines.append(f"\nplugins disabled by WDS_PLUGINS/WDS_DISABLE_PLUGINS: {', '.join(data['disabled'])}")
        return "\n".join(lines)

    emit(args, {"backends": rows, "disabled": list(registry.skipped)}, text)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wds-cloud",
        description="Stream WebDataset tar shards from local disk, pipes and object stores.",
        epilog=f"Run 'wds-cloud COMMAND --help' for a command's options.\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"wds-cloud {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    backends = commands.add_parser(
        "backends",
        help="list the URL schemes, the plugin providing each, and whether it is ready",
        description="List every URL scheme the installed plugins provide, the plugin and distribution "
        "behind it, and whether it is ready or which extra it needs.",
    )
    backends.add_argument(
        "--all", action="store_true", help="also list the schemes fsspec opens without a plugin of ours (its fallbacks)"
    )
    backends.add_argument("--json", action="store_true", help="print JSON for scripts")
    backends.set_defaults(func=_backends)
    add_demo(commands)
    add_tools(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse's own refusals exit with 2
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    name = f"wds-cloud {args.command}" if getattr(args, "command", None) else "wds-cloud"
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (wds-cloud backends | head): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except UsageError as exc:
        print(f"{name}: error: {exc}\n(see '{name} --help')", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # a CLI user gets the message, not a traceback
        if not isinstance(exc, (WdsCloudError, OSError)):
            raise
        print(f"{name}: error: {for_cli(str(exc))}", file=sys.stderr)
        return EXIT_PROBLEM
