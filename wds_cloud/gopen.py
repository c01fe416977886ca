"""``webdataset.gopen`` kept as a module path; the code lives in :mod:`wds_cloud.io.open`.

``gopen(url, mode)`` opens any URL the registry knows (see ``docs/plugins.md``);
``gopen_schemes`` is the writable table of webdataset-style openers.
"""

# also importable from here, as before the code moved (not part of __all__)
from .config import Settings  # noqa: F401
from .errors import SecurityError, UnknownSchemeError, WdsCloudError, redact  # noqa: F401
from .io import profiles  # noqa: F401
from .io.open import (
                      Pipe,
                      gopen,
                      gopen_curl,
                      gopen_error,
                      gopen_file,
                      gopen_pipe,
                      gopen_schemes,
                      log,  # noqa: F401
                      open_backend,
                      reader,
                      rewrite_url,
)
from .io.registry import get_registry  # noqa: F401
from .io.resilient import ResumableStream, RetryPolicy  # noqa: F401
from .io.security import UntrustedURL, is_secure, untrusted  # noqa: F401
from .io.urls import split_scheme  # noqa: F401

__all__ = ["gopen", "gopen_schemes", "rewrite_url", "reader", "gopen_file", "gopen_pipe", "gopen_curl",
           "gopen_error", "Pipe", "open_backend"]
