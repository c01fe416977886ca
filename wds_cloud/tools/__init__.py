"""Jobs over whole datasets: a function over every shard on Dask (:mod:`~wds_cloud.tools.dask`) and the
interleaved-document converters (:mod:`~wds_cloud.tools.interleaved`). The command line is in
:mod:`wds_cloud.cli`."""
