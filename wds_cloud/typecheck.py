"""``webdataset.typecheck`` kept as a module path.

Importing webdataset's module turned on typeguard's run-time type checks for
its modules when typeguard was installed.  wds_cloud ships type hints
(``py.typed``) for static checkers instead; importing this module changes
nothing.  ``modules`` lists the modules that hold those hints, as upstream did.
"""

from __future__ import annotations

__all__ = ["modules"]

modules = [
    "tenbin",
    "autodecode",
    "cache",
    "compat",
    "extradatasets",
    "filters",
    "gopen",
    "handlers",
    "mix",
    "pipeline",
    "shardlists",
    "tariterators",
    "utils",
    "writer",
]
