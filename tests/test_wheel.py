"""The wheel is the product: built from this tree, installed without the source tree on the path, it imports
every subpackage, lists its backends and reads a shard."""

import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMOKE = r"""
import io, pkgutil, sys, tarfile
import wds_cloud
assert wds_cloud.__file__.startswith(sys.argv[1]), wds_cloud.__file__
for module in pkgutil.walk_packages(wds_cloud.__path__, "wds_cloud."):
    if module.name.startswith(("wds_cloud.loader.gpu", "wds_cloud.testing.conformance", "wds_cloud.__main__")):
        continue  # need torch / pytest, which a plain install does not have
    __import__(module.name)
import wds_cloud_plugins.file, wds_cloud_plugins.s3
path = sys.argv[2]
with tarfile.open(path, "w") as tar:
    for i in range(3):
        info = tarfile.TarInfo(f"{i:03d}.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
print(len(list(wds_cloud.WebDataset(path, shardshuffle=False))))
"""


@pytest.mark.slow
def test_the_built_wheel_installs_and_works_without_the_source_tree(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:  # built offline with this environment's setuptools
        pytest.skip("building the wheel offline needs setuptools >= 77 here (torch's install brings it)")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), ROOT],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("wds_cloud-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in (
        "wds_cloud/io/open.py",
        "wds_cloud/tar/members.py",
        "wds_cloud/tar/grouping.py",
        "wds_cloud/jobs/record.py",
        "wds_cloud/resume/state.py",
        "wds_cloud/py.typed",
        "wds_cloud_plugins/file.py",
    ):
        assert needed in names, needed
    assert any(n.endswith("/LICENSE") for n in names)
    target = tmp_path / "installed"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # -S: no site processing, so the editable install's path hook (the source tree) is not there; the
    # dependencies come from this environment's site-packages, listed after the installed wheel
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]]))
    run = subprocess.run(
        [sys.executable, "-S", "-c", SMOKE, str(target), str(tmp_path / "s.tar")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "3"
    backends = subprocess.run(
        [sys.executable, "-S", "-m", "wds_cloud", "backends"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert backends.returncode == 0 and "s3:" in backends.stdout, backends.stderr
