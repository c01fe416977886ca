"""From samples to a training step: :class:`~wds_cloud.loader.webloader.WebLoader` (workers, resumable
states), how batches cross from the workers (:mod:`~wds_cloud.loader.frames` and
:mod:`~wds_cloud.loader.unframe`, :mod:`~wds_cloud.loader.transport`'s ``PackedBytes``,
:mod:`~wds_cloud.loader.pipes`) and the GPU (:mod:`~wds_cloud.loader.gpu`)."""
