"""The storage registry: collect every claim, then resolve; allow/block lists; out-of-tree plugins."""

import io
import pathlib
import textwrap
import types

import pytest

import wds_cloud
from wds_cloud import hookimpl
from wds_cloud.config import Settings
from wds_cloud.errors import PluginConflictError, PluginError, UnknownSchemeError
from wds_cloud.io import Backend, registry
from wds_cloud.io.registry import Registry

ROOT = pathlib.Path(__file__).resolve().parents[1]


class DummyBackend(Backend):
    pass


def make_plugin(scheme, override=False, **kw):
    """A plugin object registering ``scheme``."""
    ns = types.SimpleNamespace()

    @hookimpl
    def wds_cloud_register_backends(register):
        register(scheme, DummyBackend, override=override, **kw)

    ns.wds_cloud_register_backends = wds_cloud_register_backends
    return ns


class FakeEntryPoint:
    def __init__(self, name, obj, dist="fake-dist"):
        self.name, self._obj, self.value = name, obj, f"fake:{name}"
        self.dist = types.SimpleNamespace(name=dist)

    def load(self):
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


def fresh(entry_points=(), **settings):
    return Registry(Settings(**settings), entry_points=list(entry_points))


def test_two_plain_claims_conflict_naming_both():
    """Two plugins claiming one scheme is an error that names both plugins and the fix."""
    with pytest.raises(PluginConflictError) as info:
        fresh([FakeEntryPoint("alpha", make_plugin("x"), "dist-a"), FakeEntryPoint("beta", make_plugin("x"), "dist-b")])
    message = str(info.value)
    assert "'alpha'" in message and "'beta'" in message and "dist-a" in message and "override=True" in message


@pytest.mark.parametrize("order", [("plain", "over"), ("over", "plain")])
def test_override_wins_whatever_the_load_order(order):
    """An override=True claim wins over a plain one, independent of entry-point order."""
    plugins = {
        "plain": make_plugin("x", description="plain"),
        "over": make_plugin("x", override=True, description="over"),
    }
    reg = fresh([FakeEntryPoint(name, plugins[name]) for name in order])
    assert reg.claims["x"].description == "over" and reg.claims["x"].plugin == "over"


def test_two_overrides_conflict():
    """Two override=True claims on one scheme are a conflict too."""
    with pytest.raises(PluginConflictError, match="overridden by several"):
        fresh(
            [FakeEntryPoint("a", make_plugin("x", override=True)), FakeEntryPoint("b", make_plugin("x", override=True))]
        )


def test_block_and_allow_lists():
    """WDS_DISABLE_PLUGINS skips a plugin; WDS_PLUGINS keeps only those named."""
    eps = [FakeEntryPoint("a", make_plugin("x")), FakeEntryPoint("b", make_plugin("x"))]
    assert fresh(eps, plugins_block=("b",)).claims["x"].plugin == "a"
    assert fresh(eps, plugins_allow=("b",)).claims["x"].plugin == "b"
    reg = Registry(Settings.from_environ({"WDS_DISABLE_PLUGINS": "pipe"}))
    assert "pipe" not in reg.schemes() and "file" in reg.schemes()
    with pytest.raises(UnknownSchemeError, match="disabled"):
        reg.claim("pipe", "pipe:true")


def test_broken_plugin_is_named():
    """A plugin that fails to import raises PluginError naming it and the way out."""
    with pytest.raises(PluginError, match="'broken'.*WDS_DISABLE_PLUGINS"):
        fresh([FakeEntryPoint("broken", ImportError("no module named nope"))])


def test_invalid_scheme_registration():
    """Registering 's3://' instead of 's3' is refused with the right form."""
    with pytest.raises(PluginError, match="scheme name alone"):
        fresh([FakeEntryPoint("bad", make_plugin("s3://"))])


def test_builtins_come_from_entry_points():
    """file and pipe are found through the wds_cloud entry-point group, as third parties are."""
    reg = registry.get_registry(Settings())
    assert reg.claims["file"].distribution == "wds_cloud"
    assert reg.claims["pipe"].plugin == "pipe"
    assert registry.get_registry(Settings()) is reg  # loaded once per process


def test_a_forked_child_keeps_the_plugins_and_makes_its_own_backends():
    """After a fork the child keeps the loaded plugins (no entry point read again before a DataLoader
    worker's first shard) but makes its own backend objects (no client crosses a fork)."""
    import os

    reg = registry.get_registry(Settings())
    parent_backend = reg.backend("file", "/x", Settings())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            child = registry.get_registry(Settings())
            ok = child is reg and "file" in child.schemes() and child.backend("file", "/x") is not parent_backend
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"


def test_missing_extra_is_reported():
    """A backend whose modules are missing says which extra installs them."""
    reg = fresh([FakeEntryPoint("c", make_plugin("cloud", requires=("no_such_module_xyz",), extra="s3"))])
    claim = reg.claims["cloud"]
    assert claim.missing() == ["no_such_module_xyz"] and claim.install_hint().startswith("pip install 'wds_cloud[s3]'")


def test_rewrite_hook_is_firstresult():
    """wds_cloud_rewrite_url: the first plugin returning a string wins."""
    first = types.SimpleNamespace()
    first.wds_cloud_rewrite_url = hookimpl(lambda url, settings: url.replace("a://", "file:"))
    none = types.SimpleNamespace()
    none.wds_cloud_rewrite_url = hookimpl(lambda url, settings: None)
    reg = fresh([FakeEntryPoint("first", first), FakeEntryPoint("none", none)])
    assert reg.rewrite("a://x") == "file:x"


def test_route_hook_sends_a_scheme_to_another_backend(tmp_path):
    """wds_cloud_route_url: a plugin names the backend that serves a URL; the URL reaches it unchanged."""
    seen = []

    class Gateway(Backend):
        def open_read(self, url, offset=0, bufsize=None, **kw):
            seen.append(url)
            return io.BytesIO(b"via gateway"[offset:])

    router = types.SimpleNamespace()
    router.wds_cloud_register_backends = hookimpl(
        lambda register: register("gw", lambda settings, **o: Gateway(settings))
    )
    router.wds_cloud_route_url = hookimpl(lambda url, scheme, settings: "gw" if scheme == "zz" else None)
    reg = fresh([FakeEntryPoint("router", router)])
    assert reg.route("zz://bucket/x", "zz") == "gw" and reg.route("file:/x", "file") is None
    registry._registries[(None, ())] = reg
    with wds_cloud.gopen("zz://bucket/x") as f:
        assert f.read() == b"via gateway"
    assert seen == ["zz://bucket/x"]


def test_out_of_tree_plugin_is_discovered_and_opens(installed_example):
    """A third-party plugin found through its dist-info serves its scheme through gopen."""
    reg = registry.get_registry(Settings())
    assert reg.claims["mem"].distribution == "wds-cloud-memory"
    with wds_cloud.gopen("mem://bucket/a.tar", "wb") as f:
        f.write(b"hello")
    with wds_cloud.gopen("mem://bucket/a.tar", "rb", offset=1) as f:
        assert f.read() == b"ello"
    backend = reg.backend("mem")
    assert backend.stat("mem://bucket/a.tar").size == 5
    assert list(backend.list("mem://bucket/")) == ["mem://bucket/a.tar"]


def test_hooks_are_documented_and_tested():
    """Every hook in hookspecs.py appears in docs/plugins.md and in a test other than this one."""
    from wds_cloud.io import hookspecs

    hooks = [n for n in dir(hookspecs) if n.startswith("wds_cloud_")]
    docs = (ROOT / "docs" / "plugins.md").read_text()
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_registry.py")
    tests += textwrap.dedent(pathlib.Path(__file__).read_text().split("def test_hooks_are_documented")[0])
    assert hooks
    for hook in hooks:
        assert f"`{hook}(" in docs, f"{hook} is not documented in docs/plugins.md"
        assert f"{hook}" in tests, f"{hook} has no test"
