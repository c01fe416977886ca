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


def test_the_handler_options_are_ones_the_docstring_style_accepts():
    """mkdocs.yml's ``docstring_options`` are options of its ``docstring_style``: mkdocstrings-python
    refuses another style's option (``ignore_init_summary`` is Google's) unless pydantic happens to be
    installed, so ``pip install -e '.[docs]' && mkdocs build`` would fail where the test extra passes."""
    yaml = pytest.importorskip("yaml")
    config = pytest.importorskip("mkdocstrings_handlers.python._internal.config")
    import dataclasses

    class Loader(yaml.SafeLoader):  # mkdocs.yml may hold !!python/name tags: read them as text
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    plugins = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["plugins"]
    options = next(p["mkdocstrings"] for p in plugins if isinstance(p, dict) and "mkdocstrings" in p)
    options = options["handlers"]["python"]["options"]
    style = options.get("docstring_style", "google")
    accepted = {
        "google": config.GoogleStyleOptions,
        "numpy": config.NumpyStyleOptions,
        "sphinx": config.SphinxStyleOptions,
    }[style]
    names = {field.name for field in dataclasses.fields(accepted)}
    assert set(options.get("docstring_options", {})) <= names, (style, sorted(names))
    assert set(options) <= {field.name for field in dataclasses.fields(config.PythonInputOptions)}


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


ROLES = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`?")


def test_no_sphinx_role_shows_as_text_anywhere_in_the_site(site):
    """The docstrings' Sphinx roles become links or code: no page and no search entry shows ``:class:`` etc."""
    shown = {}
    for path in [*site.rglob("*.html"), site / "search" / "search_index.json"]:
        found = ROLES.findall(path.read_text(errors="replace"))
        if found:
            shown[str(path.relative_to(site))] = len(found)
    assert shown == {}


def test_roles_become_links_that_resolve(site):
    """A role naming a documented object is a link to it (the strict build proves every link resolves)."""
    text = (site / "reference" / "dataset" / "index.html").read_text()
    assert re.search(r'<a class="autorefs[^>]*href="[^"]*#wds_cloud\.dataset\.options\.ReadOptions"', text)


def test_class_pages_show_the_constructor_signature(site):
    """WebDataset's parameters and their defaults are on its page, not only in prose."""
    text = re.sub(r"<[^>]+>", "", (site / "reference" / "dataset" / "index.html").read_text())
    start = text.index("WebDataset(")
    signature = text[start : start + 4000]
    for parameter in list(inspect.signature(wds_cloud.WebDataset.__init__).parameters)[1:]:
        assert parameter in signature, parameter
    assert "shardshuffle" in signature and "cache_dir" in signature and "= None" in signature


def test_the_cli_page_has_every_option_of_every_subcommand(site):
    """Every option string of every command, nested ones (``convert mmc4``) included, is on the CLI page."""
    import argparse
    import html

    from wds_cloud.cli import build_parser

    text = html.unescape((site / "cli" / "index.html").read_text())
    missing = []

    def walk(parser, words):
        assert f"{' '.join(words)}" in text, words
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*words, name])
            else:
                missing.extend(f"{' '.join(words)} {o}" for o in action.option_strings if o not in text)

    walk(build_parser(), ["wds-cloud"])
    assert missing == []


def test_the_errors_page_names_every_base_callers_catch(site):
    """CorruptShardError is a ValueError and also the tarfile.ReadError webdataset users catch: both are shown."""
    import html

    text = html.unescape(re.sub(r"<[^>]+>", "", (site / "errors" / "index.html").read_text()))
    for name, cls in inspect.getmembers(wds_cloud.errors, inspect.isclass):
        if not issubclass(cls, BaseException) or cls.__module__ != "wds_cloud.errors":
            continue
        line = next(line for line in text.splitlines() if line.strip().startswith(name))
        for base in cls.__mro__[1:]:
            if base.__module__ != "wds_cloud.errors" and base not in (BaseException, Exception, object):
                shown = base.__name__ if base.__module__ == "builtins" else f"{base.__module__}.{base.__qualname__}"
                assert shown in line, (name, shown)


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


def marked_blocks(page: str) -> list[tuple[str, str]]:
    """(marker, code) of every ```python block of ``page``; the marker is the HTML comment on the line
    before (``runs`` or ``illustration: why it cannot run``), or ""."""
    return re.findall(r"(?:<!-- (.*?) -->\n)?^```python\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M)


def test_every_example_runs_or_says_why_not():
    """A ```python block of a page runs in a test (its page is runnable as a whole, or it is marked
    ``runs``), or is marked ``illustration:`` with the reason it cannot run here."""
    unmarked = [
        (page.name, code.splitlines()[0])
        for page in sorted(DOCS.glob("*.md"))
        if page.name not in RUNNABLE_PAGES + ["backends.md"]
        for marker, code in marked_blocks(page.name)
        if not (marker.startswith("illustration: ") or marker == "runs")
    ]
    assert not unmarked


MARKED_PAGES = sorted(p.name for p in DOCS.glob("*.md") if "<!-- runs -->" in p.read_text())
#: the line a page shows, before its examples that name ``s3://bucket/`` or ``gs://bucket/``, mapping those
#: onto the folder the examples run in (the reader runs them so, or against a store)
REWRITE = re.compile(r'^export WDS_REWRITE="([^"]+)"$', re.M)


def test_no_page_runs_after_code_it_does_not_show():
    """The examples of a page run as printed, one after the other in an empty folder: no marker names a
    hidden prelude (a reader would see code that cannot run: an undefined ``my_samples``, shards that
    do not exist)."""
    hidden = [
        (page.name, marker)
        for page in sorted(DOCS.glob("*.md"))
        for marker, _ in marked_blocks(page.name)
        if marker.startswith("runs") and marker != "runs"
    ]
    assert hidden == []


@pytest.mark.parametrize("page", MARKED_PAGES)
def test_a_page_that_reads_shards_writes_them_first(page):
    """A page's examples that read shards run after one of its examples wrote them (the reader starts from
    an empty folder); the cache page's examples read them and show the cache at work (hits and misses)."""
    blocks = [code for marker, code in marked_blocks(page) if marker == "runs"]
    writes = [i for i, code in enumerate(blocks) if re.search(r"ShardWriter\(|TarWriter\(|writer", code)]
    reads = [i for i, code in enumerate(blocks) if re.search(r"^\s*for [\w, ]+ in (?!range\()", code, re.M)]
    assert not reads or (writes and writes[0] <= reads[0]), page
    if page == "cache.md":
        shown = "\n".join(blocks)
        assert reads and "cache_hits" in shown and "cache_misses" in shown and "cache_reuse_misses" in shown


def test_no_page_says_an_unresumable_stage_makes_state_dict_raise():
    """Only ``state_dict(strict=True)`` raises for a pipeline that cannot be resumed (a plain
    ``state_dict()`` returns an inexact state): no page says otherwise."""
    said = [
        page.name
        for page in sorted(DOCS.glob("*.md"))
        if re.search(r"makes\s+`state_dict\(\)`\s+raise", page.read_text())
    ]
    assert said == []


@pytest.mark.parametrize("page", MARKED_PAGES)
def test_the_marked_examples_of_a_page_run(page, tmp_path):
    """The ``runs`` blocks of a page, in order, in an empty folder, with nothing before them; a page whose
    examples name a store's bucket shows the WDS_REWRITE line that maps it onto that folder (the test uses
    that line), above the first such example."""
    text = (DOCS / page).read_text()
    blocks = [code for marker, code in marked_blocks(page) if marker == "runs"]
    code = "\n\n".join(blocks)
    env = dict(os.environ)
    env.pop("WDS_REWRITE", None)
    stores = re.compile(r"\b(?:s3|gs)://bucket/")
    first = next((text.index(block) for block in blocks if stores.search(block)), None)
    if first is not None:
        rewrite = REWRITE.search(text)
        assert rewrite and rewrite.start() < first, f"{page}: no visible WDS_REWRITE line above its examples"
        env["WDS_REWRITE"] = rewrite.group(1).replace("$PWD", str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_the_examples_of_a_page_run(page, tmp_path):
    blocks = python_blocks(page)
    assert blocks
    code = "\n\n".join(blocks)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


#: what a reader types at a shell: a bash block, or pip, the CLI, the emulators or mkdocs in the prose
COMMAND = re.compile(r"```(?:bash|sh|console)\n|`(?:pip install|wds-cloud |moto_server|mkdocs |gcp-storage-emulator )")


def test_pages_with_commands_say_to_activate_the_venv_first():
    """The README makes a virtual environment it never activates (it types .venv/bin/pip): a page whose
    commands say bare ``pip``, ``wds-cloud`` or ``moto_server`` says first to activate it (outside it pip
    cannot find wds_cloud, and moto_server is not found)."""
    missing = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        first = COMMAND.search(text)
        if first and "<!-- generated:" not in text:
            activate = text.find("`. .venv/bin/activate`")
            if not 0 <= activate < first.start():
                missing.append(page.name)
    assert missing == []


def test_the_readme_says_which_pages_are_generated():
    """The pages that hold only a ``<!-- generated: ... -->`` marker are not offered as "readable here": the
    README says they are generated into the site, and where else to read them."""
    readme = (ROOT / "README.md").read_text()
    generated = [p.name for p in sorted(DOCS.glob("*.md")) if "<!-- generated:" in p.read_text()]
    sentence = re.search(r"generated into the site, not readable here:(.*?)\.\s", readme, re.S)
    assert generated and sentence and all(f"`docs/{name}`" in sentence.group(1) for name in generated)
    assert "wds-cloud --help" in readme


def test_the_folder_section_says_how_to_read_a_folder_without_the_queue():
    """reading.md's work-queue section names ``wds-cloud ls FOLDER/``, which prints the brace spec of a
    folder's shards: the way to read a folder without renaming its shards."""
    text = (DOCS / "reading.md").read_text()
    section = text[text.index("### A folder is a work queue") :]
    section = section[: section.index("\n## ")]
    assert "`wds-cloud ls folder/`" in section and "brace spec" in section


def test_the_changelog_and_the_site_tell_one_version_story():
    """The changelog says what the site says: not on PyPI, the current version is ``wds_cloud.__version__``
    (what ``wds-cloud --version`` prints, with a section of its own), and "Unreleased" lists what changed
    since; it lists what users see, not internals (logger-name tables, when numpy.random is imported)."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    index = (DOCS / "index.md").read_text()
    version = wds_cloud.__version__
    assert "not published on PyPI" in changelog and "not published on PyPI" in index
    assert f"{version} is the current version" in changelog and f"\n## {version}\n" in changelog
    assert not re.search(r"differs from \d+\.\d+\b(?!\.)", changelog)
    assert "| before | now |" not in changelog and "numpy.random" not in changelog
