"""Idle HTTP connections kept for the next request to the same endpoint (HTTP/1.1 keep-alive).

Random access reads one small range per sample; without reuse each of them pays a TCP (and TLS)
handshake, which over a real network costs more than the range itself.  A ranged stream that
ended exactly where its response ended hands its connection back here; the next request to the
same scheme, host and port takes it.  Nothing crosses a fork: a child process starts with an
empty pool (the parent's sockets stay the parent's).  A connection the server closed while it
sat idle is noticed before use (the socket reads as ready) and dropped; one that the server
closes just as it is used fails before any byte of a response, and the caller retries that
request once on a new connection (:data:`STALE`).
"""

from __future__ import annotations

import atexit
import http.client
import os
import select
import threading
import time
from typing import Optional

__all__ = ["ConnectionPool", "POOL", "STALE"]

#: what a kept connection the server had closed raises on its next request (safe to retry a GET once)
STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class ConnectionPool:
    """Idle connections per ``(scheme, host, port)``, at most ``per_endpoint`` each, none older than ``max_idle`` s."""

    def __init__(self, per_endpoint: int = 16, max_idle: float = 20.0) -> None:
        self.per_endpoint = per_endpoint
        self.max_idle = max_idle
        self._idle: dict[tuple, list[tuple[float, http.client.HTTPConnection]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(scheme: str, host: str, port: Optional[int]) -> tuple:
        return scheme, host, port or (443 if scheme == "https" else 80)

    def take(self, key: tuple, timeout: float) -> Optional[http.client.HTTPConnection]:
        """An idle connection to ``key`` that is still open, with ``timeout`` set; None when there is none."""
        now = time.monotonic()
        while True:
            with self._lock:
                idle = self._idle.get(key)
                if not idle:
                    return None
                since, conn = idle.pop()
            sock = conn.sock
            if sock is None or now - since > self.max_idle or _readable(sock):
                conn.close()  # closed by the server, or sent something unasked: not reusable
                continue
            conn.timeout = timeout
            sock.settimeout(timeout)
            return conn

    def give(self, key: tuple, conn: http.client.HTTPConnection) -> None:
        """Keep ``conn`` (its last response read to the end) for the next request to ``key``."""
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < self.per_endpoint:
                idle.append((time.monotonic(), conn))
                return
        conn.close()

    def after_fork(self) -> None:
        """In a forked child: drop the parent's connections (a new lock: another thread may have held the
        old one at the fork).  Closing the child's copies of their descriptors sends nothing (no
        shutdown), so the parent's connections go on."""
        self._lock = threading.Lock()
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for _, conn in conns:
                conn.close()

    def clear(self) -> None:
        """Close every kept connection (at exit, and for benchmarks and tests that need them gone)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for _, conn in conns:
                conn.close()


def _readable(sock) -> bool:
    """Whether an idle socket has something to read: an end of file (the server closed it) or stray bytes."""
    try:
        if hasattr(select, "poll"):  # no limit on descriptor numbers, unlike select()
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        ready, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(ready)


#: the process-wide pool the HTTP streams use
POOL = ConnectionPool()
atexit.register(POOL.clear)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=POOL.after_fork)
