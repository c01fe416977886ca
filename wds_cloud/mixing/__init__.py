"""Mixing several sources into one stream: how they mix (:mod:`~wds_cloud.mixing.sources`) and the dataset
spec files that name them (:mod:`~wds_cloud.mixing.spec`, the one reader of spec files).
``WebDataset("train.yaml")`` gives the fluent face, :class:`wds_cloud.dataset.mixed.MixedDataset`;
webdataset's ``RandomMix`` is in :mod:`wds_cloud.mix`."""

from __future__ import annotations

from .sources import STATE_FORMAT, MixSource, MixStats, ReplayedSources
from .spec import SPEC_VERSION, DatasetSpec, SourceSpec, is_mix_spec, load_spec

__all__ = [
    "MixSource",
    "MixStats",
    "ReplayedSources",
    "STATE_FORMAT",
    "DatasetSpec",
    "SourceSpec",
    "load_spec",
    "is_mix_spec",
    "SPEC_VERSION",
]
