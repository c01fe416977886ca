"""``webdataset.tariterators`` kept as a module path.

The key rules and grouping live in :mod:`wds_cloud.tar.samples`, the resumable
shard reader (``tarfile_to_samples``) in :mod:`wds_cloud.tar.shardreader`.
"""

from .handlers import reraise_exception  # noqa: F401 (a name of webdataset's module)
from .stages import pipelinefilter
from .tar.samples import (
    base_plus_ext,
    group_by_keys,
    key_rule,
    last_dot_split,
    meta_prefix,
    meta_suffix,
    shard_samples,
    tar_file_expander,
    tar_file_iterator,
    url_opener,
    valid_sample,
)
from .tar.shardreader import TarSamples, tarfile_samples, tarfile_to_samples

__all__ = [
    "base_plus_ext",
    "last_dot_split",
    "key_rule",
    "valid_sample",
    "url_opener",
    "tar_file_iterator",
    "tar_file_expander",
    "group_by_keys",
    "tarfile_samples",
    "tarfile_to_samples",
    "TarSamples",
    "meta_prefix",
    "meta_suffix",
    "shard_samples",
    "pipelinefilter",
]
