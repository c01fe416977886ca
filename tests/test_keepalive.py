"""HTTP keep-alive: a connection whose response was read to its end serves the next request to that host.

The server here is a few lines over raw sockets so that each test decides exactly when it closes a
connection; every wait is on an event the server sets, never on time.
"""

import multiprocessing
import socket
import threading

import pytest

from wds_cloud.gopen import gopen
from wds_cloud.io.keepalive import POOL

BODY = b"0123456789" * 10


class Server:
    """Answers ``GET`` with BODY (HTTP/1.1, kept open) and records connections and requests.

    ``close_after_response``: close each connection right after its first response (the client is not told).
    ``drop_second``: on a connection's second request, read it and close without answering.
    """

    def __init__(self, close_after_response=False, drop_second=False):
        self.close_after_response = close_after_response
        self.drop_second = drop_second
        self.connections = 0
        self.requests = 0
        self.closed = threading.Event()  # a connection was closed by the server
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/shard.tar"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        served = 0
        buffer = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                _, buffer = buffer.split(b"\r\n\r\n", 1)
                self.requests += 1
                if self.drop_second and served == 1:
                    break
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)
                served += 1
                if self.close_after_response:
                    break
        self.closed.set()

    def stop(self):
        self._listener.close()


@pytest.fixture
def server(request):
    POOL.clear()
    s = Server(**getattr(request, "param", {}))
    yield s
    s.stop()
    POOL.clear()


def read(url):
    with gopen(url) as stream:
        return stream.read()


def test_a_connection_serves_the_next_request(server):
    """Two reads, one connection: the second pays no handshake."""
    assert read(server.url) == BODY and read(server.url) == BODY
    assert (server.connections, server.requests) == (1, 2)


@pytest.mark.parametrize("server", [{"close_after_response": True}], indirect=True)
def test_a_connection_the_server_closed_while_idle_is_not_used(server):
    """The server closed the kept connection: noticed before use, the read opens a new one, no error."""
    assert read(server.url) == BODY
    assert server.closed.wait(30)
    assert read(server.url) == BODY
    assert (server.connections, server.requests) == (2, 2)


@pytest.mark.parametrize("server", [{"drop_second": True}], indirect=True)
def test_a_connection_closed_as_it_is_used_is_retried_once_on_a_new_one(server):
    """The server takes the request on the kept connection and closes it unanswered: one more try, fresh."""
    assert read(server.url) == BODY
    assert read(server.url) == BODY
    assert (server.connections, server.requests) == (2, 3)


def _child_reads(url, results):
    results.put(read(url) == BODY)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_child_never_uses_its_parents_connections(server):
    """A DataLoader worker forked after the parent read opens its own connection; the parent's goes on."""
    assert read(server.url) == BODY
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_child_reads, args=(server.url, results))
    child.start()
    assert results.get(timeout=60) is True
    child.join(60)
    assert child.exitcode == 0
    assert server.connections == 2  # the child's own
    assert read(server.url) == BODY  # the parent's kept connection still works
    assert (server.connections, server.requests) == (2, 3)


def test_a_response_not_read_to_its_end_does_not_keep_its_connection(server):
    """Closing a stream part-way leaves bytes on the connection: it is closed, never reused."""
    with gopen(server.url) as stream:
        assert stream.read(10) == BODY[:10]
    assert read(server.url) == BODY
    assert server.connections == 2
