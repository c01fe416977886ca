"""``webdataset.cache`` kept as a module path; the code lives in :mod:`wds_cloud.io.opener`.

``FileCache`` is the shard-cache stage (see :mod:`wds_cloud.io.shardcache`),
``StreamingOpen`` opens shards without one; the rest are webdataset's helpers.
"""

from .io.opener import (
                        FileCache,
                        LRUCleanup,
                        StreamingOpen,
                        cached_url_opener,
                        check_tar_format,
                        download,
                        pipe_cleaner,
                        url_to_cache_name,
)

__all__ = ["FileCache", "StreamingOpen", "url_to_cache_name", "download", "check_tar_format", "pipe_cleaner",
           "LRUCleanup", "cached_url_opener"]
