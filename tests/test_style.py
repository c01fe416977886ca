"""The house's habits: ruff's lint and format are clean over the code, the tests and the benchmarks."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PATHS = ["wds_cloud", "plugins", "tests", "bench", "docs/examples", "docs/_hooks", "conftest.py", "setup.py"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def have_ruff():
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")


def test_lint_is_clean(have_ruff):
    run = ruff("check", "--no-cache")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_format_is_clean(have_ruff):
    run = ruff("format", "--check", "--no-cache")
    assert run.returncode == 0, "run `ruff format` (files it would change):\n" + run.stdout[-4000:]
