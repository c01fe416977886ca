"""The documentation site builds offline with ``mkdocs build --strict`` (a broken link, a page missing from
the navigation or a bad reference fails), its generated pages hold what the code has, every public name
has a docstring for the reference, and the examples of the pages that promise it run as they are."""

from __future__ import annotations

import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import wds_cloud

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: pages whose every ```python block runs as it is, in order, in an empty folder
RUNNABLE_PAGES = ["quickstart.md", "migrating.md"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]' (the test extra has it)")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return out


def test_the_site_builds_strictly(site):
    for page in ("index.html", "quickstart/index.html", "migrating/index.html", "reference/dataset/index.html"):
        assert (site / page).is_file(), page


def test_the_cli_page_is_the_parser(site):
    from wds_cloud.cli import build_parser

    text = (site / "cli" / "index.html").read_text()
    parser = build_parser()
    commands = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"][0].choices
    assert commands and all(f"wds-cloud {name}" in text for name in commands)


def test_the_environment_page_lists_every_variable_read(site):
    text = (site / "environment" / "index.html").read_text()
    assert all(name in text for name in wds_cloud.config.ENV_VARS)


def test_the_errors_page_holds_the_tree(site):
    text = (site / "errors" / "index.html").read_text()
    classes = [
        n
        for n, c in inspect.getmembers(wds_cloud.errors, inspect.isclass)
        if issubclass(c, BaseException) and c.__module__ == "wds_cloud.errors"
    ]
    assert classes and all(name in text for name in classes)


def test_every_public_name_has_a_docstring():
    """The reference shows what has a docstring: a public name without one would be missing from it."""
    missing = [
        n
        for n in wds_cloud.__all__
        if not n.startswith("__") and callable(getattr(wds_cloud, n)) and not inspect.getdoc(getattr(wds_cloud, n))
    ]
    assert not missing


def python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M)


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_the_examples_of_a_page_run(page, tmp_path):
    blocks = python_blocks(page)
    assert blocks
    code = "\n\n".join(blocks)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
