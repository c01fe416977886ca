"""``wds_cloud.manifest``, a documented path: integrity manifests (the code lives in
:mod:`wds_cloud.io.manifest`)."""

from __future__ import annotations

from .io.manifest import FORMAT, Manifest, Verifying, check_index, load_manifest

__all__ = ["Manifest", "load_manifest", "Verifying", "check_index", "FORMAT"]
