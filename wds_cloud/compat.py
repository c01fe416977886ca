"""``webdataset.compat`` kept as a module path: the fluent datasets and the loader.

The code lives where it belongs on the data path: :mod:`wds_cloud.dataset.fluid` (the fluent methods),
:mod:`wds_cloud.dataset.webdataset` (``WebDataset``, ``MixedDataset``) and
:mod:`wds_cloud.loader.webloader` (``WebLoader``).
"""

from __future__ import annotations

from .dataset.fluid import FluidInterface, FluidWrapper
from .dataset.webdataset import CheckEmpty, MixedDataset, WebDataset, check_empty, from_spec
from .handlers import reraise_exception
from .loader.webloader import WebLoader
from .pipeline import DataPipeline
from .pytorch import DataLoader
from .stages import pipelinefilter
from .tariterators import group_by_keys, tar_file_expander

__all__ = [
    "FluidInterface",
    "WebDataset",
    "FluidWrapper",
    "WebLoader",
    "check_empty",
    "CheckEmpty",
    "MixedDataset",
    "from_spec",
    # webdataset 1.0.2's compat imports these, and code imports them from there
    "DataPipeline",
    "DataLoader",
    "pipelinefilter",
    "reraise_exception",
    "group_by_keys",
    "tar_file_expander",
]
