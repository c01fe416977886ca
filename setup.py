"""Package discovery (the rest of the metadata is in pyproject.toml): ``wds_cloud`` with every subpackage it
has, found, and the built-in backends of ``plugins/`` installed as ``wds_cloud_plugins``."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["wds_cloud", "wds_cloud.*"]) + ["wds_cloud_plugins"],
    package_dir={"wds_cloud_plugins": "plugins"},
)
