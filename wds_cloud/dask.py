"""``wds_cloud.dask``, a documented path: processing shards on a Dask cluster (the code lives in
:mod:`wds_cloud.tools.dask`)."""

from __future__ import annotations

from .tools.dask import (
    INSTALL,
    cluster_client,
    distributed_module,
    load_function,
    map_shards,
    output_names,
    passthrough,
    sweep_partials,
)

__all__ = [
    "map_shards",
    "output_names",
    "load_function",
    "distributed_module",
    "cluster_client",
    "passthrough",
    "sweep_partials",
    "INSTALL",
]
