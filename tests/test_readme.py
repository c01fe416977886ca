"""The README's set-up commands are the ones CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_test_command():
    """.ci/run's command is the README's second set-up command, verbatim."""
    commands = readme_commands()
    assert len(commands) >= 2 and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()
