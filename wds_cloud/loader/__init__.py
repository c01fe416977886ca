"""From samples to a training step: :class:`~wds_cloud.loader.webloader.WebLoader` (workers, resumable
states), shared-memory batches (:mod:`~wds_cloud.loader.transport`) and the GPU
(:mod:`~wds_cloud.loader.gpu`)."""
