"""The fluent datasets: the fluent methods (:mod:`~wds_cloud.dataset.fluid`), ``WebDataset`` and the
options it groups (:mod:`~wds_cloud.dataset.webdataset`, :mod:`~wds_cloud.dataset.options`) and
``MixedDataset`` (:mod:`~wds_cloud.dataset.mixed`)."""
