"""The public API: __all__ is curated, and the package imports without torch or I/O."""

import subprocess
import sys

import wds_cloud


def test_all_matches_public_names():
    """__all__ lists exactly the public, non-module-internal names of the package."""
    public = {n for n in dir(wds_cloud) if not n.startswith("_")}
    submodules = {n for n in public if type(getattr(wds_cloud, n)).__name__ == "module"}
    declared = set(wds_cloud.__all__)
    assert len(declared) == len(wds_cloud.__all__), "duplicates in __all__"
    missing = public - declared - submodules
    assert not missing, f"public but not in __all__: {sorted(missing)}"
    assert not (declared - public - {"__version__"}), "names in __all__ that do not exist"


def test_import_loads_no_plugin_and_no_torch():
    """Importing wds_cloud loads no plugin, touches no network and does not import torch."""
    code = ("import sys, wds_cloud, wds_cloud.registry as r;"
            "assert not r._registries; assert 'torch' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
