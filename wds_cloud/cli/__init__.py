"""The ``wds-cloud`` command line: ``backends``, ``demo``, ``settings`` and the shard tools
(:mod:`wds_cloud.cli.shardtools`)."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Optional

from .. import __version__, config
from ..errors import ConfigError, UnknownSchemeError, WdsCloudError
from ..io.fsbackend import fsspec_protocols
from ..io.registry import get_registry
from .console import EXIT_CODES, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, UsageError, emit, for_cli, job_conflict
from .demo import add_parser as add_demo
from .flags import Parser, json_failure
from .settings import add_parser as add_settings
from .shardtools import add_parsers as add_tools

__all__ = ["main"]


def _import_problem(path: str) -> Optional[str]:
    """None when the class at ``path`` (``module.Class``) imports here ("ready" means importable), else why not."""
    module, _, name = path.rpartition(".")
    if not module:
        return f"no driver class known ({path or 'none'})"
    try:
        with warnings.catch_warnings():  # a driver's import-time deprecation is not a missing driver
            warnings.simplefilter("ignore")
            found = importlib.import_module(module)
        getattr(found, name)
    except Exception as exc:  # ImportError, or a driver that fails as it loads: either way not usable here
        return f"{path} does not import ({type(exc).__name__}: {exc})"
    return None


def _status(install: Optional[str]) -> str:
    """A scheme that is not ready, as the STATUS column says it: the install line where one is known, else why
    (fsspec's own reasons, such as "LibArchive requires to be installed", are not install lines)."""
    text = (install or "").strip()
    if text.startswith("pip install") or text.startswith("conda install"):
        return f"needs `{text}`"
    match = re.search(r"(?:pip|conda) install [\w.\[\]'\"=<>-]+(?: [\w.\[\]'\"=<>-]+)*", text)
    if match:
        return f"needs `{match.group(0).rstrip('.')}`"
    # fsspec's "Install X to access ...", "Please install X ...", 'requires "X" to be installed'
    named = re.match(r"(?:please )?install '?([A-Za-z][\w.\[\]-]*)'?(?: |$)", text, re.IGNORECASE) or re.search(
        r'requires "([A-Za-z][\w.-]*)"', text
    )
    if named:
        return f"needs `pip install {named.group(1)}`"
    return f"unavailable: {text or 'its driver does not import here'}"


def _backends(args: argparse.Namespace) -> int:
    registry = get_registry(config.current())
    claims = [(scheme, registry.claims[scheme], "plugin") for scheme in registry.schemes()]
    if args.all:
        claims += [(scheme, claim, "fsspec") for scheme, claim in registry.fallback_claims().items()]
    drivers = fsspec_protocols() if args.all else {}
    rows = []
    for scheme, claim, kind in claims:
        if kind == "fsspec":  # fsspec names every protocol it knows; the driver behind one may be absent
            path, hint = drivers.get(scheme, ("", None))
            problem = _import_problem(path)
            ready, install = problem is None, None if problem is None else (hint or problem)
        else:
            missing = claim.missing()
            ready, install = not missing, None if not missing else claim.install_hint()
        rows.append(
            {
                "scheme": scheme,
                "plugin": claim.plugin,
                "distribution": claim.distribution,
                "kind": kind,
                "ready": ready,
                "install": install,
            }
        )

    def text(data: dict) -> str:
        table = [("SCHEME", "PLUGIN", "DISTRIBUTION", "STATUS")] + [
            (
                f"{r['scheme']}:",
                r["plugin"],
                r["distribution"] or "-",
                "ready" if r["ready"] else _status(r["install"]),
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
    parser = Parser(
        prog="wds-cloud",
        description="Stream WebDataset tar shards from local disk, pipes and object stores.",
        epilog="examples (each runs as it stands, in an empty folder):\n"
        "  wds-cloud demo --url data              write demo shards into data/ and read them back\n"
        "  wds-cloud ls data                      list them (and the brace spec that names them)\n"
        "  wds-cloud ls data/demo-000000.tar      one shard's members\n"
        "  wds-cloud verify 'data/demo-{000000..000003}.tar'\n"
        "  wds-cloud backends                     the URL schemes this installation reads\n\n"
        f"Run 'wds-cloud COMMAND --help' for a command's options.\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"wds-cloud {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    backends = commands.add_parser(
        "backends",
        help="list the URL schemes, the plugin providing each, and whether it is ready",
        description="List every URL scheme the installed plugins provide, the plugin and distribution "
        "behind it, and whether it is ready or which extra it needs.",
        epilog="examples:\n  wds-cloud backends\n  wds-cloud backends --all --json\n\n"
        "exit codes: 0 listed, 2 bad arguments (a flag, a WDS_* environment variable)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    backends.add_argument(
        "--all", action="store_true", help="also list the schemes fsspec opens without a plugin of ours (its fallbacks)"
    )
    backends.add_argument("--json", action="store_true", help="print JSON for scripts")
    backends.set_defaults(func=_backends)
    add_demo(commands)
    add_settings(commands)
    add_tools(commands)
    return parser


def _one_line(message: str) -> str:
    return re.sub(r"\s*\n\s*", " ", message).strip()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    Parser.wants_json = "--json" in argv
    try:
        args = parser.parse_args(argv)  # argparse's own refusals: one line, SystemExit(2) (flags.Parser)
    finally:
        Parser.wants_json = False
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    name = f"wds-cloud {args.command}" if getattr(args, "command", None) else "wds-cloud"
    if getattr(args, "kind", None):
        name += f" {args.kind}"
    wants_json = bool(getattr(args, "json", False))

    def fail(line: str, code: int) -> int:
        if wants_json:  # a script reading stdout gets JSON whatever happens
            json_failure(line, code)
        print(line, file=sys.stderr)
        return code

    try:
        config.current()  # every command reads and checks the WDS_* settings once, before anything else
    except ConfigError as exc:
        if args.command != "settings":  # which lists them, and says what is wrong (to mend the environment)
            return fail(f"{name}: error: {_one_line(str(exc))}", EXIT_USAGE)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except BrokenPipeError:  # the reader went away (wds-cloud backends | head): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (UsageError, UnknownSchemeError) as exc:  # the value typed is the problem: exit 2
        return fail(f"{name}: error: {_one_line(for_cli(str(exc)))} (see '{name} --help')", EXIT_USAGE)
    except ConfigError as exc:
        if getattr(exc, "bad_argument", False):  # the value typed is the problem, not the data: exit 2
            return fail(f"{name}: error: {_one_line(for_cli(str(exc)))}", EXIT_USAGE)
        if getattr(exc, "conflict", None) is None:
            return fail(f"{name}: error: {_one_line(for_cli(str(exc)))}", EXIT_PROBLEM)
        # the destination holds another job's outputs: the command line given is the problem (exit 2)
        return fail(f"{name}: error: {_one_line(job_conflict(exc))}", EXIT_USAGE)
    except Exception as exc:  # a CLI user gets the message, not a traceback
        if not isinstance(exc, (WdsCloudError, OSError)):
            if wants_json:
                json_failure(f"{name}: internal error: {type(exc).__name__}: {_one_line(str(exc))}", EXIT_PROBLEM)
            raise  # our bug: the traceback is what a report needs
        return fail(f"{name}: error: {_one_line(for_cli(str(exc)))}", EXIT_PROBLEM)
