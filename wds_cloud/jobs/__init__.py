"""The shard tools' job bookkeeping: what a job over a whole dataset owns, and which job writes a destination.

``wds-cloud reshard``, ``convert``, ``map`` and ``index --output`` (and ``wds_cloud.dask.map_shards``,
``convert_mmc4``) write numbered outputs that a rerun must be able to trust.  The modules:

- :mod:`~wds_cloud.jobs.patterns`: output name patterns (``out/train-%06d.tar``), checked once before
  anything is read or written: exactly one number field, in the last path segment;
- :mod:`~wds_cloud.jobs.record`: the job record beside the outputs (``<destination with N>.wds-job.json``):
  the tool, its inputs and settings, each finished output's size and SHA-256; what lets a rerun keep what is
  done, refuse another job's outputs, and remove what an interrupted run left;
- :mod:`~wds_cloud.jobs.claim`: the claim file (``.wds-job.lock``) that lets one job at a time write a
  destination, and recognises a dead job's claim.

Used by ``tools/`` and ``cli/`` only; built on ``io/`` (opening, listing and writing URLs), which a storage
plugin builds on and which knows nothing of jobs.
"""
