"""mkdocs hook: pages generated from the code, never hand-copied.

A page holding one of these markers gets it replaced, at build time, by text made from the code:

- ``<!-- generated: cli -->``: every ``wds-cloud`` command's ``--help``, from the argument parser;
- ``<!-- generated: environment -->``: the table of environment variables, from ``wds_cloud.config``
  (``ENV_DOCS``, kept beside the code that reads them);
- ``<!-- generated: errors -->``: the exception tree, from ``wds_cloud.errors``.
"""

from __future__ import annotations

import argparse
import html
import inspect
import re

MARKERS = {}


def _marker(name):
    def register(fn):
        MARKERS[f"<!-- generated: {name} -->"] = fn
        return fn

    return register


@_marker("cli")
def cli_page() -> str:
    from wds_cloud.cli import build_parser

    parser = build_parser()
    parser.prog = "wds-cloud"
    out = ["```text", parser.format_help().rstrip(), "```", ""]

    def subcommands(parser, words, depth):
        for action in parser._actions:  # argparse keeps its subcommands only here
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    command = " ".join([*words, name])
                    out.extend([f"{'#' * depth} `{command}`", "", "```text", sub.format_help().rstrip(), "```", ""])
                    subcommands(sub, [*words, name], min(depth + 1, 4))  # nested ones (convert mmc4) too

    subcommands(parser, ["wds-cloud"], 2)
    return "\n".join(out)


@_marker("environment")
def environment_page() -> str:
    from wds_cloud.config import ENV_DOCS

    rows = ["| variable | format | default | example | meaning |", "|---|---|---|---|---|"]
    for names, form, default, example, meaning in ENV_DOCS:
        rows.append(f"| {unbroken_names(names)} | {form} | {default} | {example} | {meaning} |")
    return "\n".join(rows)


def unbroken_names(cell: str) -> str:
    """The variable names of a table cell as code that never breaks inside a name (the theme lets code in a
    narrow column wrap anywhere, so WDS_MAX_CONCURRENCY read as WDS_MAX_CONC / URRENCY); names still wrap
    between each other at the commas."""
    return re.sub(
        r"`([^`]+)`",
        lambda m: f'<code style="white-space: nowrap">{html.escape(m.group(1))}</code>',
        cell,
    )


@_marker("errors")
def errors_page() -> str:
    from wds_cloud import errors

    classes = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, BaseException) and c.__module__ == errors.__name__
    ]
    out = []

    def walk(cls, depth):
        # every base from outside the tree that callers catch: builtins, and others such as tarfile.ReadError
        bases = [
            b.__name__ if b.__module__ == "builtins" else f"{b.__module__}.{b.__qualname__}"
            for b in cls.__mro__[1:]
            if b.__module__ != errors.__name__ and b not in (BaseException, Exception, object)
        ]
        doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
        also = f" (also {', '.join(f'`{b}`' for b in bases)})" if bases else ""
        out.append(f"{'    ' * depth}- **`{cls.__name__}`**{also}: {doc}")
        for sub in sorted((c for c in classes if cls in c.__bases__), key=lambda c: c.__name__):
            walk(sub, depth + 1)

    for root in sorted((c for c in classes if not any(b in classes for b in c.__bases__)), key=lambda c: c.__name__):
        walk(root, 0)
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
