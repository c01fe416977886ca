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
    before (``runs: PRELUDE`` or ``illustration: why it cannot run``), or ""."""
    return re.findall(r"(?:<!-- (.*?) -->\n)?^```python\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M)


#: what a marked page's examples run after: shards and files named as the pages name them, in an empty
#: folder that ``s3://bucket/`` is rewritten to (WDS_REWRITE)
SHARDS_PRELUDE = """
import io, json, os
import wds_cloud as wds
from PIL import Image

def jpeg():
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(out, format="JPEG")
    return out.getvalue()

JPEG = jpeg()
def write(path, n, prefix):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with wds.TarWriter(path) as sink:
        for i in range(n):
            sink.write({"__key__": f"{prefix}_{i:04d}", "txt": f"sample number {i} of {prefix}" * 2,
                        "cls": str(i % 10), "jpg": JPEG})

for s in range(100):
    write(f"train-{s:04d}.tar", 3 + s % 4, f"t{s}")
for s in range(10):
    write(f"data/train-{s:04d}.tar", 5, f"d{s}")
for name in ("a", "b"):
    write(f"{name}.tar", 10, name)
json.dump({"wids_version": 1, "shardlist": [{"url": "a.tar", "nsamples": 10}, {"url": "b.tar", "nsamples": 10}]},
          open("dataset.json", "w"))
json.dump({"shardlist": [{"url": f"train-{s:04d}.tar", "nsamples": 3 + s % 4} for s in range(8)]},
          open("train.json", "w"))
def my_samples():
    for i in range(20):
        yield JPEG, i % 10

open("train.yaml", "w").write("version: 1\\nsources:\\n  - name: a\\n    urls: train-{0000..0009}.tar\\n")
"""


#: the interleaved-documents page: 100 shards of one document each, and the names its fragments use
DOCUMENTS_PRELUDE = (
    SHARDS_PRELUDE
    + """
jpeg_bytes = JPEG
urls = "docs-{000000..000009}.tar"

def resize_images(sample):
    return sample

for s in range(100):
    with wds.TarWriter(f"docs-{s:06d}.tar") as sink:
        sink.write(wds.interleaved_sample(f"doc{s}", ["A cat.", JPEG, "It sleeps."], layout="mmc4"))
"""
)
#: the Dask page: a scheduler of its own, which Client() finds (as through DASK_SCHEDULER_ADDRESS)
CLUSTER_PRELUDE = (
    SHARDS_PRELUDE
    + """
import dask
from distributed import LocalCluster

cluster = LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0")
dask.config.set({"scheduler-address": cluster.scheduler_address})
"""
)
#: the elastic page: this process is rank 0 of a one-rank gloo group, and has a model to save
RANKS_PRELUDE = (
    SHARDS_PRELUDE
    + """
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="file://" + os.path.abspath("group"), rank=0, world_size=1)
model = torch.nn.Linear(2, 2)
"""
)
PRELUDES = {
    "shards": SHARDS_PRELUDE,
    "documents": DOCUMENTS_PRELUDE,
    "cluster": CLUSTER_PRELUDE,
    "ranks": RANKS_PRELUDE,
}


def test_every_example_runs_or_says_why_not():
    """A ```python block of a page runs in a test (its page is runnable as a whole, or it is marked
    ``runs: PRELUDE``), or is marked ``illustration:`` with the reason it cannot run here."""
    unmarked = [
        (page.name, code.splitlines()[0])
        for page in sorted(DOCS.glob("*.md"))
        if page.name not in RUNNABLE_PAGES + ["backends.md"]
        for marker, code in marked_blocks(page.name)
        if not (marker.startswith("illustration: ") or marker.removeprefix("runs: ") in PRELUDES)
    ]
    assert not unmarked


MARKED_PAGES = sorted(p.name for p in DOCS.glob("*.md") if "<!-- runs: " in p.read_text())


@pytest.mark.parametrize("page", MARKED_PAGES)
def test_the_marked_examples_of_a_page_run(page, tmp_path):
    blocks = [
        (marker.removeprefix("runs: "), code) for marker, code in marked_blocks(page) if marker.startswith("runs: ")
    ]
    (prelude,) = {name for name, _ in blocks}  # one prelude per page
    code = "\n\n".join(code for _, code in blocks)
    env = dict(os.environ, WDS_REWRITE=f"s3://bucket/={tmp_path}/;gs://bucket/={tmp_path}/")
    run = subprocess.run(
        [sys.executable, "-c", PRELUDES[prelude] + "\n\n" + code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_the_examples_of_a_page_run(page, tmp_path):
    blocks = python_blocks(page)
    assert blocks
    code = "\n\n".join(blocks)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
