"""``webdataset.cache`` kept as a module path; the code lives in :mod:`wds_cloud.io.opener`.

``FileCache`` is the shard-cache stage (see :mod:`wds_cloud.io.shardcache`),
``StreamingOpen`` opens shards without one; the rest are webdataset's helpers.
"""

# also importable from here, as before the code moved (not part of __all__)
from .errors import redact  # noqa: F401
from .handlers import reraise_exception  # noqa: F401
from .io.atomic import AtomicFile  # noqa: F401
from .io.backend import skip  # noqa: F401
from .io.opener import (
                        FileCache,
                        LRUCleanup,
                        StreamingOpen,
                        cached_url_opener,
                        check_tar_format,
                        download,
                        log,  # noqa: F401
                        pipe_cleaner,
                        url_to_cache_name,
)
from .io.urls import split_scheme  # noqa: F401
from .stages import PipelineStage  # noqa: F401

__all__ = ["FileCache", "StreamingOpen", "url_to_cache_name", "download", "check_tar_format", "pipe_cleaner",
           "LRUCleanup", "cached_url_opener"]
