"""A fault-injecting TCP proxy on loopback, placed between a client and a real server.

It can also stand for a distant store: ``latency=`` seconds pass between a request and the
first byte of its response, and ``rate=`` bytes per second is the most one connection carries
(each connection is paced on its own, as a TCP stream over a long link is), so a benchmark
sees what a real network does to one stream and to several in parallel.

Faults apply to the server-to-client direction of each connection:
``reset_after=N`` sends a TCP reset once N bytes went through, ``stall_after=N``
stops forwarding (the client sees silence), ``truncate_after=N`` closes the
connection cleanly (a short body), and ``error_first=K`` answers the first K
requests itself with ``error_status`` (503 by default; ``error_body`` may hold an
S3 ``SlowDown`` XML).  A client keeps connections for more requests (keep-alive): a request on
such a connection while errors are due closes it unanswered, so the client connects again and
meets the error.  ``crowd=N`` with ``crowd_rate=`` stands for a host that suffers from connections: while
more than N connections are sending (sent within the last :data:`SENDING` s), every one of them is paced to
``crowd_rate`` bytes per second.  Settings may be changed while it runs.  Every loop is
bounded: threads end when either side closes or the proxy stops.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Optional


class FaultProxy:
    """A proxy on a free loopback port (``port``) in front of ``upstream`` (``http://host:port``, the server
    whose responses it forwards, faults and paces as the module docstring says); ``stop()`` ends it, and as a
    context manager it stops on leaving::

        with FaultProxy("http://127.0.0.1:8000", latency=0.03, rate=50e6) as proxy:
            ds = wds_cloud.WebDataset(f"http://127.0.0.1:{proxy.port}/shard-000000.tar")
    """

    def __init__(
        self,
        upstream: str,
        *,
        reset_after: Optional[int] = None,
        stall_after: Optional[int] = None,
        truncate_after: Optional[int] = None,
        error_first: int = 0,
        error_status: int = 503,
        error_body: bytes = b"",
        latency: float = 0.0,
        rate: Optional[float] = None,
        crowd: Optional[int] = None,
        crowd_rate: Optional[float] = None,
    ) -> None:
        hostport = upstream.split("//", 1)[-1].split("/", 1)[0]
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"FaultProxy: upstream {upstream!r} names no port; give the server's URL with its port, "
                "for example 'http://127.0.0.1:8000'"
            )
        self.upstream = (host.strip("[]"), int(port))
        self.reset_after = reset_after
        self.stall_after = stall_after
        self.truncate_after = truncate_after
        self.error_first = error_first
        self.error_status = error_status
        self.error_body = error_body
        #: seconds from a request to the first byte of its response, and bytes/s per connection (None: as fast
        #: as loopback); both may be changed while the proxy runs
        self.latency = latency
        self.rate = rate
        #: more than ``crowd`` connections sending at once slow each to ``crowd_rate`` bytes/s (None: never)
        self.crowd = crowd
        self.crowd_rate = crowd_rate
        self._sending: dict[int, float] = {}  # connection -> when it last sent
        self.delayed = 0  # responses held back by ``latency``
        self.connections = 0
        self.faults = 0
        self.bytes_forwarded = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0  # connections accepted and not yet finished
        self._stopped = threading.Event()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self._active += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Wait until every connection so far has finished, so ``bytes_forwarded`` is final for them.

        Counting follows each send, so a client may hold bytes the count does not show yet;
        a test reads the count after this, never by guessing how long the proxy needs.
        """
        from wds_cloud.io.keepalive import POOL

        POOL.clear()  # connections this process keeps for reuse are done with: close them, so they finish
        with self._idle:
            if not self._idle.wait_for(lambda: self._active == 0, timeout):
                raise TimeoutError(f"{self._active} proxied connection(s) still open after {timeout} s")

    def _serve(self, client: socket.socket) -> None:
        try:
            self._serve_one(client)
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def _take_error(self) -> bool:
        with self._lock:
            if self.error_first > 0:
                self.error_first -= 1
                self.faults += 1
                return True
        return False

    def _serve_one(self, client: socket.socket) -> None:
        client.settimeout(30)
        if self._take_error():
            try:
                client.recv(65536)
                reason = {503: "Service Unavailable", 429: "Too Many Requests", 500: "Internal Server Error"}.get(
                    self.error_status, "Error"
                )
                head = (
                    f"HTTP/1.1 {self.error_status} {reason}\r\nContent-Length: {len(self.error_body)}\r\n"
                    "Content-Type: application/xml\r\nConnection: close\r\n\r\n"
                ).encode()
                client.sendall(head + self.error_body)
            except OSError:
                pass
            finally:
                client.close()
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=30)
        except OSError:
            client.close()
            return
        for sock in (client, upstream):  # forward each piece at once, as a server does (no Nagle delay)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        asked: list = []  # when the requests whose responses have not begun were sent (the link's clock)
        answered: list = []  # not empty once a response went back on this connection
        threading.Thread(target=self._pump_requests, args=(client, upstream, asked, answered), daemon=True).start()
        self._pump_responses(upstream, client, asked, answered)

    def _pump_requests(self, client: socket.socket, upstream: socket.socket, asked: list, answered: list) -> None:
        try:
            while not self._stopped.is_set():
                data = client.recv(65536)
                if not data:
                    break
                if answered and self.error_first > 0:  # a kept connection reused while errors are due
                    client.shutdown(socket.SHUT_RDWR)
                    break
                asked.append(time.monotonic())
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            try:
                upstream.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _pump_responses(self, upstream: socket.socket, client: socket.socket, asked: list, answered: list) -> None:
        sent = 0
        due = 0.0  # when the link has carried what was sent so far (pacing)
        try:
            while not self._stopped.is_set():
                data = upstream.recv(65536)
                if not data:
                    break
                if asked:  # the first bytes of a response: the request's round trip first
                    since = asked[0]
                    asked.clear()
                    if self.latency > 0:
                        time.sleep(max(0.0, since + self.latency - time.monotonic()))
                        with self._lock:
                            self.delayed += 1
                rate = self._rate(id(client))
                if rate:
                    due = max(due, time.monotonic()) + len(data) / rate
                    time.sleep(max(0.0, due - time.monotonic()))
                limit = min([x for x in (self.reset_after, self.stall_after, self.truncate_after) if x] or [0])
                if limit and sent + len(data) >= limit:
                    client.sendall(data[: max(0, limit - sent)])
                    with self._lock:
                        self.faults += 1
                        self.bytes_forwarded += max(0, limit - sent)
                    self._fault(client)
                    return
                client.sendall(data)
                if not answered:
                    answered.append(True)
                sent += len(data)
                with self._lock:
                    self.bytes_forwarded += len(data)
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                try:
                    # shutdown wakes the other pump blocked in recv(); a bare close() would not, and the
                    # connection would stay up until that recv returned.
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                try:
                    sock.close()
                except OSError:
                    pass

    def _rate(self, connection: int) -> Optional[float]:
        """The pace of ``connection`` now: ``crowd_rate`` while more than ``crowd`` connections are sending."""
        if self.crowd is None or self.crowd_rate is None:
            return self.rate
        now = time.monotonic()
        with self._lock:
            self._sending[connection] = now
            for key, since in list(self._sending.items()):
                if now - since > SENDING:
                    del self._sending[key]
            crowded = len(self._sending) > self.crowd
        return self.crowd_rate if crowded else self.rate

    def _fault(self, client: socket.socket) -> None:
        if self.stall_after and (not self.reset_after or self.stall_after <= self.reset_after):
            deadline = time.time() + 60
            while not self._stopped.is_set() and time.time() < deadline:
                time.sleep(0.05)  # silence; the client's read timeout must notice
            return
        if self.truncate_after and (not self.reset_after or self.truncate_after <= self.reset_after):
            client.shutdown(socket.SHUT_RDWR)
            return
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
        try:
            client.shutdown(socket.SHUT_RD)  # wake the request pump; the last close then resets
        except OSError:
            pass

    def stop(self) -> None:
        """Stop accepting and end the proxy's threads."""
        self._stopped.set()
        self._listener.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: a connection counts as sending for this long after it last sent (pieces are paced, so a busy one sends often)
SENDING = 0.25

SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
