"""The API reference has an entry for every name users call (``wds_cloud.__all__``, every fluent method), and
no page, module or benchmark cites an issue number (readers have no tracker: the reason is said in place).

The reference is what the ``::: module`` directives of ``docs/reference/*.md`` render: a module's public
members that have a docstring (mkdocs.yml: ``filters: ["!^_"]``, ``show_if_no_docstring: false``), as griffe
loads them with the site's own extensions. Reading that, rather than building the site, keeps this a second's
work; ``tests/test_docs_site.py`` builds the site and proves the same directives render.
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import re

import pytest

import wds_cloud

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
#: an issue cited by number: "issue 41", "issue #41", "Issue41", "issues 41 and 44"
ISSUE = re.compile(r"\bissues? ?#?\d+", re.I)


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", ROOT / "docs" / "_hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def directives() -> dict[str, list | None]:
    """The modules the reference pages render, each with its ``members:`` list (None: all of them): read by the
    docs' own hook, so the test and the site agree on what a directive says."""
    return _hook("roles")._rendered_modules()


@pytest.fixture(scope="module")
def package():
    griffe = pytest.importorskip("griffe", reason="the docs extra: pip install -e '.[docs]' (the test extra has it)")
    extensions = griffe.load_extensions(_hook("curried").CurriedFilters())
    return griffe.load("wds_cloud", search_paths=[str(ROOT)], extensions=extensions)


def entries(package) -> set[str]:
    """The dotted paths of every object the reference shows."""
    shown: set[str] = set()

    def walk(obj, members):
        for name, member in obj.members.items():
            if name.startswith("_") or member.is_alias or (members is not None and name not in members):
                continue
            if member.is_module or member.docstring is None:
                continue
            shown.add(member.path)
            if member.is_class:
                walk(member, None)

    for path, members in directives().items():
        module = package[path.removeprefix("wds_cloud.")] if path != "wds_cloud" else package
        shown.add(module.path)
        walk(module, members)
    return shown


def lines() -> set[str]:
    """The names a reference page gives a line of its own, ``- **`wds.NAME`**: ...`` (values such as
    ``wds.gopen_schemes``, which have no docstring of their own to render)."""
    return {
        m for page in REFERENCE.glob("*.md") for m in re.findall(r"^- \*\*`wds\.(\w+)`\*\*", page.read_text(), re.M)
    }


def reference_path(package, name: str) -> str:
    """Where the reference shows ``wds.<name>``: the path of the object it is, after imports."""
    member = package[name]
    member = member.final_target if member.is_alias else member
    if member.is_module and not inspect.ismodule(getattr(wds_cloud, name)):
        # a function named as its module (``wds.gopen``, ``wds.interleaved``): the package imports the function
        member = member.members[name]
        member = member.final_target if member.is_alias else member
    return member.path


def test_every_public_name_has_a_reference_entry(package):
    """Each name of ``wds_cloud.__all__`` (``wds.to_tuple``, ``wds.batched``, ``wds.WebLoader``, the modules
    ``wds.utils`` ...) is shown, with its docstring, on a page of the reference, or has a line of its own."""
    shown, given = entries(package), lines()
    missing = [
        f"{name} ({reference_path(package, name)})"
        for name in wds_cloud.__all__
        if name not in given and reference_path(package, name) not in shown
    ]
    assert missing == []


def test_every_fluent_method_has_a_reference_entry(package):
    """Each public method of the fluent interface (``.to_tuple()``, ``.batched()``, ``.map_dict()``, ...) that
    ``WebDataset``, ``FluidWrapper`` and ``WebLoader`` share is shown, with its docstring."""
    shown = entries(package)
    methods = [n for n, _ in inspect.getmembers(wds_cloud.FluidInterface, inspect.isfunction) if not n.startswith("_")]
    missing = [n for n in methods if f"wds_cloud.dataset.fluid.FluidInterface.{n}" not in shown]
    assert methods and missing == []


def test_curried_filters_show_the_parameters_users_pass(package):
    """``wds.to_tuple`` is shown as the function users call: the generator's parameters after ``data``, and its
    docstring (which ``help(wds.to_tuple)`` shows too)."""
    to_tuple = package["filters.to_tuple"]
    assert to_tuple.is_function
    assert [p.name for p in to_tuple.parameters] == list(inspect.signature(wds_cloud.filters._to_tuple).parameters)[1:]
    assert to_tuple.docstring.value == inspect.getdoc(wds_cloud.to_tuple)


def test_no_file_cites_an_issue_number():
    """Code, plugins, docs and benchmarks say the reason in place, never "issue 41": readers have no tracker."""
    cited = []
    for folder in ("wds_cloud", "plugins", "docs", "bench"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".md", ".yml", ".yaml", ".toml", ".txt") or not path.is_file():
                continue
            if any(part.startswith((".venv", "_data")) for part in path.relative_to(ROOT).parts):
                continue  # the benchmarks' own environments (bench/README.md makes them) and data: not ours
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if ISSUE.search(line):
                    cited.append(f"{path.relative_to(ROOT)}:{number}")
    assert cited == []


def test_charts_tick_only_the_counts_they_measured(tmp_path, monkeypatch):
    """A chart whose x axis counts things (DataLoader workers) ticks whole numbers only: no tick at 2.5 workers,
    for every chart ``bench/figures.py`` draws."""
    pytest.importorskip("matplotlib", reason="the docs extra: pip install -e '.[docs]' (the test extra has it)")
    spec = importlib.util.spec_from_file_location("figures", ROOT / "bench" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    (tmp_path / "performance.md").write_text("")
    monkeypatch.setattr(figures, "IMG", str(tmp_path))
    monkeypatch.setattr(figures, "PAGE", str(tmp_path / "performance.md"))
    drawn = {}
    monkeypatch.setattr(figures, "save", lambda fig, name: drawn.__setitem__(name, fig))
    rates = {0: 1000.0, 1: 1800.0, 2: 3100.0, 4: 4000.0}
    figures.draw(
        {
            "throughput": {"tiny": {"wds_cloud": 2e5, "webdataset": 1e5}},
            "loader": {"wds_cloud": rates, "webdataset": {n: r / 2 for n, r in rates.items()}},
            "cache": [2.0, 0.5],
            "faults": {"clean": 100.0, "reset / 1 MB": 80.0},
            "random_access": {"wds_cloud (index files)": 1.0, "wids (whole shards)": 40.0},
        },
        "python bench/figures.py",
    )
    assert set(drawn) == {"throughput", "loader_scaling", "cache_epochs", "faults", "random_access"}
    fractional = {}
    for name, fig in drawn.items():
        for ax in fig.axes:
            xs = [x for line in ax.get_lines() for x in line.get_xdata()]
            if xs and all(float(x).is_integer() for x in xs):
                low, high = min(xs), max(xs)
                ticks = [t for t in ax.get_xticks() if low <= t <= high]
                fractional[name] = [t for t in ticks if not float(t).is_integer()]
    assert fractional == {"loader_scaling": []}


#: the names a newcomer looks for first on the package's page, "what ``import wds_cloud as wds`` gives"
MAIN_NAMES = ["WebDataset", "WebLoader", "DataPipeline", "ShardWriter", "TarWriter", "gopen", "merge_states"]


def test_the_package_page_links_the_main_names_to_their_entries(package):
    """reference/package.md lists the main classes and functions, each linked to its entry (the strict site
    build proves each link resolves)."""
    text = (REFERENCE / "package.md").read_text()
    missing = [name for name in MAIN_NAMES if f"[`wds.{name}`][{reference_path(package, name)}]" not in text]
    assert missing == []


def test_every_webdataset_parameter_is_explained():
    """WebDataset's docstring, shown as its reference entry, says what each of its parameters does."""
    doc = inspect.getdoc(wds_cloud.WebDataset) or ""
    parameters = list(inspect.signature(wds_cloud.WebDataset.__init__).parameters)[1:]
    unexplained = [name for name in parameters if f"``{name}" not in doc]
    assert unexplained == []
    assert "``-1``" in doc and "``cache_size``" in doc


def test_reference_docstrings_tell_no_design_history():
    """A docstring the reference shows says what the code does, not what an earlier version cost (figures of
    a design that was replaced, such as what ``all_gather_object`` cost on thousands of ranks)."""
    from wds_cloud.loader import webloader
    from wds_cloud.resume import elastic

    told = [
        obj.__qualname__
        for obj in (webloader.gather_merged, elastic.RankShare)
        if re.search(r"every one of [\d,]+ ranks|cost seconds per worker", inspect.getdoc(obj) or "")
    ]
    assert told == []
