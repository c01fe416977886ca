"""``webdataset.compat`` kept as a module path: the fluent datasets and the loader.

The code lives where it belongs on the data path: :mod:`wds_cloud.dataset.fluid` (the fluent methods),
:mod:`wds_cloud.dataset.webdataset` (``WebDataset``, ``MixedDataset``) and
:mod:`wds_cloud.loader.webloader` (``WebLoader``).
"""

from __future__ import annotations

from .dataset.fluid import FluidInterface, FluidWrapper
from .dataset.webdataset import CheckEmpty, MixedDataset, WebDataset, check_empty, from_spec
from .loader.webloader import WebLoader

__all__ = [
    "FluidInterface",
    "WebDataset",
    "FluidWrapper",
    "WebLoader",
    "check_empty",
    "CheckEmpty",
    "MixedDataset",
    "from_spec",
]
