"""A distant object store on loopback: the HTTP object server behind a link-emulating proxy.

Every response waits ``latency`` seconds for its first byte, every connection is paced to ``rate``
bytes per second (as one TCP stream over a long link is), and ``reset_after`` resets each connection
after that many bytes.  Use it to see what a reader does over a real network, without one::

    from wds_cloud.testing.link import EmulatedLink

    with EmulatedLink(latency=0.03, rate=50e6) as link:     # or EmulatedLink("shards/", ...)
        link.put("/bucket/shard-0000.tar", data)
        ds = wds.WebDataset(f"{link.url}/bucket/shard-0000.tar")
        ...
        link.store.requests                                  # what was asked for: (method, key, Range)

To measure a store of your own, put :class:`~wds_cloud.testing.faults.FaultProxy` in front of it
instead (``bench/bench_wan.py`` runs the server and the proxy each in a process of its own, so that
they do not share the reader's interpreter).
"""

from __future__ import annotations

from typing import Any, Optional

from .faults import FaultProxy
from .objects import Store, http_server

__all__ = ["EmulatedLink"]


class EmulatedLink:
    """An object server (with the files of ``directory`` as ``/NAME``, if given) seen through a slow link."""

    def __init__(
        self,
        directory: Optional[str] = None,
        *,
        latency: float = 0.03,
        rate: Optional[float] = 50e6,
        reset_after: Optional[int] = None,
        token: Optional[str] = None,
    ) -> None:
        self.server, store = http_server(token)
        #: the objects, and the log of every request: ``(method, key, Range)``
        self.store: Store = store
        if directory is not None:
            self.store.put_directory(directory)
        self.proxy = FaultProxy(self.server.url, latency=latency, rate=rate, reset_after=reset_after)
        #: the base URL readers use (through the link)
        self.url = self.proxy.url

    @property
    def store_url(self) -> str:
        """The server's own URL (no latency, no pacing), to compare with."""
        return self.server.url

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` (a path such as ``/bucket/shard-0000.tar``)."""
        self.store.put(key if key.startswith("/") else "/" + key, data)

    def stop(self) -> None:
        self.proxy.stop()
        self.server.stop()

    def __enter__(self) -> EmulatedLink:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
