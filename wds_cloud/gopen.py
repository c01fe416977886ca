"""``webdataset.gopen`` kept as a module path; the code lives in :mod:`wds_cloud.io.open`.

``gopen(url, mode)`` opens any URL the registry knows (see ``docs/plugins.md``);
``gopen_schemes`` is the writable table of webdataset-style openers.
"""

from .io.open import (
    Pipe,
    gopen,
    gopen_curl,
    gopen_error,
    gopen_file,
    gopen_pipe,
    gopen_schemes,
    open_backend,
    reader,
    rewrite_url,
)

__all__ = [
    "gopen",
    "gopen_schemes",
    "rewrite_url",
    "reader",
    "gopen_file",
    "gopen_pipe",
    "gopen_curl",
    "gopen_error",
    "Pipe",
    "open_backend",
]
