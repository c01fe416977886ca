"""A complete third-party wds_cloud plugin: ``mem://NAME`` objects kept in a dict.

Install it with ``pip install docs/examples/wds-cloud-memory`` and
``wds-cloud backends`` lists ``mem:``; ``wds_cloud.gopen("mem://x", "wb")``
then writes an object that ``gopen("mem://x")`` reads back in the same process.
"""

from __future__ import annotations

import io

from wds_cloud.errors import ShardNotFoundError
from wds_cloud.io import Backend, ObjectInfo, hookimpl

#: The store: object URL -> bytes.  Shared by every backend instance in the process.
STORE: dict[str, bytes] = {}


class _Upload(io.BytesIO):
    """Publishes the object on close(); an exception in a with-block discards it."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self._aborted = False

    def abort(self) -> None:
        self._aborted = True
        super().close()

    def close(self) -> None:
        if not self.closed and not self._aborted:
            STORE[self.url] = self.getvalue()
        super().close()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort() if exc_type else self.close()


class MemoryBackend(Backend):
    scheme = "mem"

    def open_read(self, url, offset=0, bufsize=None, **kw):
        try:
            return io.BytesIO(STORE[url][offset:])
        except KeyError:
            raise ShardNotFoundError(f"{url}: no such object in memory", url=url) from None

    def open_write(self, url, bufsize=None):
        return _Upload(url)

    def stat(self, url):
        if url not in STORE:
            raise ShardNotFoundError(f"{url}: no such object in memory", url=url)
        return ObjectInfo(url, len(STORE[url]), version=str(hash(STORE[url])))

    def list(self, prefix):
        return iter(sorted(u for u in STORE if u.startswith(prefix)))


@hookimpl
def wds_cloud_register_backends(register):
    register("mem", MemoryBackend, description="objects in a dict of this process (example plugin)")
