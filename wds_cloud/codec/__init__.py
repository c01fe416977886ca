"""Sample fields and bytes: the table of field extensions (:mod:`~wds_cloud.codec.extensions`), the encoders
the writers use (:mod:`~wds_cloud.codec.encoders`) and record streams (:mod:`~wds_cloud.codec.records`).
Decoding is webdataset's :mod:`wds_cloud.autodecode`."""
