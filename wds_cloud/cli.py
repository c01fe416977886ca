"""The ``wds-cloud`` command line: ``backends``, ``demo`` and the shard tools (:mod:`wds_cloud.shardtools`)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from . import __version__, config
from .demo import add_parser as add_demo
from .errors import WdsCloudError
from .io.registry import get_registry
from .shardtools import add_parsers as add_tools

__all__ = ["main"]


def _backends(args: argparse.Namespace) -> int:
    registry = get_registry(config.current())
    rows = [("SCHEME", "PLUGIN", "DISTRIBUTION", "STATUS")]
    for scheme in registry.schemes():
        claim = registry.claims[scheme]
        missing = claim.missing()
        status = "ready" if not missing else f"needs {claim.install_hint()}"
        rows.append((f"{scheme}:", claim.plugin, claim.distribution or "-", status))
    for scheme, claim in registry.fallback_claims().items():
        status = "ready" if not claim.missing() else f"needs {claim.install_hint()}"
        rows.append((f"{scheme}:", claim.plugin, claim.distribution or "-", status))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])) + "  " + row[3])
    if registry.skipped:
        print(f"\nplugins disabled by WDS_PLUGINS/WDS_DISABLE_PLUGINS: {', '.join(registry.skipped)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wds-cloud",
        description="Stream WebDataset tar shards from local disk, pipes and object stores.",
        epilog="Run 'wds-cloud COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"wds-cloud {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    backends = commands.add_parser(
        "backends", help="list the URL schemes, the plugin providing each, and whether it is ready",
        description="List every URL scheme the installed plugins provide, the plugin and distribution "
                    "behind it, and whether it is ready or which extra it needs.",
    )
    backends.set_defaults(func=_backends)
    add_demo(commands)
    add_tools(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (wds-cloud backends | head): not an error of ours

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # a CLI user gets the message, not a traceback

        if not isinstance(exc, (WdsCloudError, OSError)):
            raise
        print(f"wds-cloud: error: {exc}", file=sys.stderr)
        return 1
