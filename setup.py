"""Package discovery (the rest of the metadata is in pyproject.toml): ``wds_cloud`` with every subpackage it
has, found, and the built-in backends of ``plugins/`` installed as ``wds_cloud_plugins``.

A build starts from an empty ``build/lib`` for our packages: setuptools copies into a folder it never
cleans, so a module deleted or moved in the source would otherwise ship in the next wheel, stale."""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class CleanBuildPy(build_py):
    def run(self):
        for package in ("wds_cloud", "wds_cloud_plugins"):
            shutil.rmtree(os.path.join(self.build_lib, package), ignore_errors=True)
        super().run()


setup(
    packages=find_packages(include=["wds_cloud", "wds_cloud.*"]) + ["wds_cloud_plugins"],
    package_dir={"wds_cloud_plugins": "plugins"},
    cmdclass={"build_py": CleanBuildPy},
)
