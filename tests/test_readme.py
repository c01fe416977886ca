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


def test_the_readme_says_the_test_command_takes_minutes():
    """A newcomer waits minutes (torch, the test extra, Azurite) before the first test runs: the README says so."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index(readme_commands()[1]) :]
    assert re.search(r"takes minutes before the first test runs", after[:1000])


def test_the_site_installs_as_the_readme_does():
    """docs/index.md's install is the README's demo line, verbatim (one story: the same venv, the same
    extras), and every page adds an extra from the clone (``pip install -e '.[x]'``), never by the package
    name, which is not on PyPI."""
    demo = readme_commands()[0]
    index = (ROOT / "docs" / "index.md").read_text()
    assert demo in re.findall(r"```bash\n(.+?)\n```", index, re.S)[0].splitlines()
    by_name = [
        page.name
        for page in sorted((ROOT / "docs").glob("*.md"))
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", page.read_text(), re.S)
        if re.search(r"pip install [^\n]*wds_cloud\[", block)
    ]
    assert by_name == []
