"""The house's layout holds: every top-level module has its reason, subpackages named for their place on the
data path, imports that only go down it, no import cycles, plugins on the public I/O layer only, no
class-name dispatch, no module writing another's private attributes, upstream and documented paths intact,
loggers named after their modules.  The checks are functions, tested on planted violations too."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "wds_cloud"
PLUGINS = ROOT / "plugins"

#: webdataset 1.0.2's module paths, kept as the public facade
UPSTREAM_MODULES = [
    "autodecode",
    "cache",
    "compat",
    "extradatasets",
    "filters",
    "gopen",
    "handlers",
    "mix",
    "multi",
    "pipeline",
    "pytorch",
    "shardlists",
    "tariterators",
    "tenbin",
    "typecheck",
    "utils",
    "writer",
    "wids",
]
#: the public face at the top level
PUBLIC_FACE = ["__init__", "__main__", "errors", "config", "stages"]
#: documented paths of ours at the top level: thin facades over the subpackage where the code lives
DOCUMENTED_FACADES = ["dask", "interleaved", "manifest", "records", "transport"]
#: the subpackages, named for their place on the data path (see the README's map)
SUBPACKAGES = [
    "io",
    "resume",
    "tar",
    "codec",
    "index",
    "mixing",
    "dataset",
    "loader",
    "jobs",
    "tools",
    "cli",
    "testing",
]
#: the layers, lowest first: a module imports only from its own layer and those below; a name is a top-level
#: module or subpackage (every module of a subpackage is in its layer)
LAYERS = [
    ("base", ["errors", "config", "stages", "handlers", "typecheck", "tenbin", "pytorch", "utils"]),
    ("opening a URL", ["io"]),
    ("states", ["resume"]),
    ("tar and fields", ["tar", "codec", "autodecode", "writer", "gopen", "manifest", "records"]),
    (
        "shards to samples",
        [
            "shardlists",
            "tariterators",
            "cache",
            "filters",
            "pipeline",
            "index",
            "mixing",
            "mix",
            "wids",
            "extradatasets",
        ],
    ),
    ("datasets", ["dataset"]),
    ("loading", ["loader", "compat", "multi", "transport"]),
    ("tools and the command line", ["jobs", "tools", "dask", "interleaved", "cli", "testing", "__main__", "__init__"]),
]
#: what io/ may import besides itself: the bottom layer plugins build on
IO_MAY_IMPORT = {"wds_cloud.errors", "wds_cloud.config"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The wds_cloud modules ``name`` imports anywhere in its text (in functions too: a lazy import is an edge)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("wds_cloud"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("wds_cloud"))
    edges = set()
    for target in found:
        if target not in modules:
            continue
        edges.add(target)
        # importing a submodule of another subpackage runs that subpackage's __init__ first
        parent = target.rpartition(".")[0]
        if parent not in ("", "wds_cloud") and not name.startswith(parent + ".") and name != parent:
            edges.add(parent)
    edges.discard(name)
    return edges


def test_no_import_cycles():
    """No chain of imports (lazy ones included) leads from a module back to itself."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    graph["wds_cloud"] = set()  # the facade imports everything; nothing below may need it
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_nothing_below_imports_the_package_facade():
    """Modules import what they use from where it lives, never from the package's own __init__."""
    modules = _modules()
    consumers = {"wds_cloud", "wds_cloud.cli", "wds_cloud.cli.demo", "wds_cloud.__main__"}  # the command line
    offenders = [
        name
        for name, path in modules.items()
        if name not in consumers
        and "wds_cloud" in _imports(name, path, {**modules, "wds_cloud": PACKAGE / "__init__.py"})
    ]
    assert not offenders


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for number, (_, names) in enumerate(LAYERS):
        if top in names:
            return number
    raise AssertionError(f"{module} is in no layer: add its top-level name to LAYERS (and to the README's map)")


def upward_imports(graph: dict) -> list:
    """The imports in ``graph`` (module -> modules it imports) that go up the data path, or out of io/."""
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if _layer(target) > _layer(module):
                bad.append(f"{module} ({LAYERS[_layer(module)][0]}) imports {target} ({LAYERS[_layer(target)][0]})")
            elif (
                module.startswith("wds_cloud.io")
                and not target.startswith("wds_cloud.io")
                and target not in IO_MAY_IMPORT
            ):
                bad.append(f"{module} (io/) imports {target}: io/ imports only errors, config and itself")
    return bad


def test_imports_go_down_the_data_path():
    """io/ imports only errors, config and itself; every other module only its own layer and those below."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert not upward_imports(graph)


def test_an_upward_import_is_caught():
    planted = {
        "wds_cloud.io.urls": {"wds_cloud.utils"},
        "wds_cloud.tar.reader": {"wds_cloud.dataset.webdataset"},
        "wds_cloud.resume.state": {"wds_cloud.io.datafile"},
    }
    assert upward_imports(planted) == [
        "wds_cloud.io.urls (io/) imports wds_cloud.utils: io/ imports only errors, config and itself",
        "wds_cloud.tar.reader (tar and fields) imports wds_cloud.dataset.webdataset (datasets)",
    ]


def test_plugins_import_only_the_io_layer_and_errors():
    """Built-in plugins use exactly what a third-party plugin may: wds_cloud.io and wds_cloud.errors."""
    bad = []
    for path in PLUGINS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and not node.level
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            bad += [
                f"{path.name}: {n}"
                for n in names
                if n and n.startswith("wds_cloud") and n not in ("wds_cloud.io", "wds_cloud.errors")
            ]
    assert not bad


def _is_thin(path: pathlib.Path) -> bool:
    """A facade: a docstring, imports and ``__all__``, nothing else."""
    body = ast.parse(path.read_text()).body
    return all(
        isinstance(node, (ast.Import, ast.ImportFrom))
        or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        or (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"])
        for node in body
    )


def misplaced(root: pathlib.Path) -> list:
    """The top-level modules and subpackages of the package at ``root`` that have no reason to be there."""
    bad = []
    for path in sorted(root.glob("*.py")):
        name = path.stem
        if name in UPSTREAM_MODULES or name in PUBLIC_FACE:
            continue
        if name in DOCUMENTED_FACADES:
            if not _is_thin(path):
                bad.append(f"{name}.py is a documented path but not a thin facade: move its code into a subpackage")
            continue
        bad.append(
            f"{name}.py: not webdataset's, not the public face, not a documented facade: move it into the "
            "subpackage of its place on the data path"
        )
    for path in sorted(p for p in root.iterdir() if (p / "__init__.py").exists()):
        if path.name not in SUBPACKAGES:
            bad.append(f"{path.name}/: not a known subpackage: add it to SUBPACKAGES, LAYERS and the README's map")
    return bad


def test_every_top_level_module_has_its_reason():
    """Top level: webdataset's module paths, the public face, thin facades of documented paths; the rest lives
    in subpackages named for their place on the data path."""
    assert not misplaced(PACKAGE)


def test_a_misplaced_module_is_caught(tmp_path):
    for name in ("__init__", "errors", "dask", "gadgets"):
        (tmp_path / f"{name}.py").write_text('"""doc"""\nfrom .x import y\n__all__ = ["y"]\n')
    (tmp_path / "records.py").write_text("def helper():\n    return 1\n")
    (tmp_path / "misc").mkdir()
    (tmp_path / "misc" / "__init__.py").write_text("")
    found = misplaced(tmp_path)
    assert len(found) == 3 and found[0].startswith("gadgets.py") and found[1].startswith("records.py is a")
    assert found[2].startswith("misc/")


def test_loggers_are_named_after_their_modules():
    """``logging.getLogger(__name__)`` everywhere: users filter on the module a message comes from.  (A
    third party's logger named as a literal, to quiet it during our own shutdown, is not one of ours.)"""
    foreign = re.compile(r"getLogger\(\"(?!wds_cloud|plugins)[A-Za-z_][\w.]*\"\)")
    bad = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in list(PACKAGE.rglob("*.py")) + list(PLUGINS.glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "getLogger(" in line and "getLogger(__name__)" not in line and not foreign.search(line)
    ]
    assert not bad
    assert foreign.search('logging.getLogger("distributed.nanny")')
    assert not foreign.search('logging.getLogger("wds_cloud.cache")')


def test_no_class_name_dispatch():
    """Stages are told apart by what they implement, never by their class's name."""
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in list(PACKAGE.rglob("*.py")) + list(PLUGINS.glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"__name__\s*(==|!=|in\b)", line)
    ]
    assert not hits


def _private_writes(source: str, path: str) -> list[str]:
    """Every write (assignment, augmented, annotated, ``del``, ``setattr``/``delattr`` with a literal name) of a
    private attribute ``x._name`` where ``x`` is not ``self``/``cls``: another object's private state.
    Dunders (``__name__``, ``__doc__``) are protocol, not private."""

    def private(name: object) -> bool:
        return isinstance(name, str) and name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    bad = []
    for node in ast.walk(ast.parse(source)):
        targets: list = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            targets = [node.target]
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            targets = [node.optional_vars]
        elif isinstance(node, ast.NamedExpr):
            targets = [node.target]
        while targets:  # a, b._x = ...; (x._y, *z._w) = ...
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            elif (
                isinstance(target, ast.Attribute)
                and private(target.attr)
                and not (isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"))
            ):
                bad.append(f"{path}:{node.lineno} {ast.unparse(target)}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and private(node.args[1].value)
        ):
            bad.append(f"{path}:{node.lineno} {node.func.id} {node.args[1].value}")
    return bad


def test_no_module_writes_another_objects_private_attributes():
    """Only an object's own methods (``self._x = ...``, ``cls._x = ...``) write its private attributes;
    anything else goes through a public method or a constructor argument."""
    bad = []
    for path in list(PACKAGE.rglob("*.py")) + list(PLUGINS.glob("*.py")):
        bad += _private_writes(path.read_text(), str(path.relative_to(ROOT)))
    assert not bad


@pytest.mark.parametrize(
    "planted",
    [
        "def f(obj):\n    obj._has_length = True\n",
        "def f(self):\n    self.other._x = 1\n",
        "def f(a, b):\n    a.x, b._y = 1, 2\n",
        "def f(a):\n    a._n += 1\n",
        "def f(a):\n    del a._n\n",
        "def f(a):\n    setattr(a, '_n', 1)\n",
        "def f(a):\n    for a._i in range(3):\n        pass\n",
        "class C:\n    def copy(self):\n        clone = C()\n        clone._state = None\n        return clone\n",
    ],
)
def test_a_private_write_is_caught(planted):
    assert _private_writes(planted, "planted.py")


def test_own_and_protocol_writes_are_allowed():
    source = "class C:\n    def f(self):\n        self._x = 1\n    @classmethod\n    def g(cls):\n        cls._y = 2\n"
    source += "def wrap(f):\n    f.__name__ = 'w'\n    f.__doc__ = None\n"
    assert not _private_writes(source, "ok.py")


UPSTREAM_NAMES = {
    "tariterators": [
        "base_plus_ext",
        "valid_sample",
        "url_opener",
        "tar_file_iterator",
        "tar_file_expander",
        "group_by_keys",
        "meta_prefix",
        "meta_suffix",
        "tarfile_samples",
        "tarfile_to_samples",
        "pipelinefilter",
        "TarSamples",
        "shard_samples",
        "key_rule",
        "last_dot_split",
    ],
    "filters": [
        "_shuffle",
        "_select",
        "_map",
        "_to_tuple",
        "_batched",
        "_rsample",
        "_extract_keys",
        "_rename_keys",
        "_xdecode",
        "default_collation_fn",
        "unlisted",
        "log_keys",
        "FilterFunction",
        "RestCurried",
        "compose",
        "pipeline",
        "default_decoders",
        "find_decoder",
        "Shuffle",
        "detshuffle",
        "shuffle",
    ],
    "autodecode": [
        "ImageHandler",
        "imagespecs",
        "IMAGE_EXTENSIONS",
        "decoders",
        "basichandlers",
        "default_decoder",
        "unpickle_loads",
        "tenbin_loads",
        "msgpack_loads",
        "npy_loads",
        "npz_loads",
        "cbor_loads",
        "default_pre_handlers",
        "default_post_handlers",
        "Decoder",
        "Continue",
        "gzfilter",
        "handle_extension",
        "imagehandler",
        "torch_loads",
        "pytorch_weights_only",
    ],
    "shardlists": [
        "expand_urls",
        "expand_source",
        "envsubst",
        "ResampledShardList",
        "DirectoryShardList",
        "SimpleShardList",
        "ResampledShards",
        "MultiShardSample",
        "resampled",
        "non_empty",
        "single_node_only",
        "split_by_node",
        "split_by_worker",
        "shardspec",
    ],
    "cache": [
        "FileCache",
        "StreamingOpen",
        "url_to_cache_name",
        "download",
        "check_tar_format",
        "LRUCleanup",
        "pipe_cleaner",
        "cached_url_opener",
    ],
    "gopen": [
        "Pipe",
        "rewrite_url",
        "reader",
        "gopen_file",
        "gopen_pipe",
        "gopen_curl",
        "gopen_error",
        "gopen",
        "gopen_schemes",
        "open_backend",
    ],
    "utils": [
        "enforce_security",
        "pytorch_worker_info",
        "pytorch_worker_seed",
        "make_seed",
        "is_iterable",
        "identity",
        "obsolete",
        "ObsoleteException",
        "deprecated",
        "glob_with_braces",
        "fnmatch_with_braces",
    ],
    "writer": [
        "default_handlers",
        "make_handlers",
        "make_encoder",
        "encode_based_on_extension",
        "encode_based_on_extension1",
        "imageencoder",
        "bytestr",
        "TarWriter",
        "ShardWriter",
        "numpy_dumps",
        "torch_dumps",
    ],
    "tenbin": ["encode_buffer", "decode_buffer", "read", "write", "save", "load"],
    "compat": ["check_empty", "WebDataset", "WebLoader", "FluidInterface", "FluidWrapper"],
    "pipeline": ["add_length_method", "DataPipeline"],
}


@pytest.mark.parametrize("module", sorted(UPSTREAM_NAMES))
def test_upstream_module_paths_keep_their_names(module):
    """``from wds_cloud.<upstream module> import <name>`` works for every name webdataset code imports."""
    mod = importlib.import_module(f"wds_cloud.{module}")
    missing = [n for n in UPSTREAM_NAMES[module] + list(getattr(mod, "__all__", ())) if not hasattr(mod, n)]
    assert not missing


#: the module paths our docs name (besides webdataset's)
DOCUMENTED_PATHS = [
    "io",
    "errors",
    "config",
    "stages",
    "index",
    "mixing",
    "dask",
    "records",
    "manifest",
    "interleaved",
    "transport",
    "cli",
    "io.security",
    "io.datafile",
    "io.concurrency",
    "jobs.record",
    "testing.faults",
    "testing.objects",
    "testing.link",
    "testing.conformance",
]


@pytest.mark.parametrize("path", DOCUMENTED_PATHS)
def test_documented_paths_import(path):
    module = importlib.import_module(f"wds_cloud.{path}")
    assert [n for n in getattr(module, "__all__", ()) if not hasattr(module, n)] == []
