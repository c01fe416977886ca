"""A real HTTP object server on loopback, with what parallel ranged reads need (for tests and benchmarks).

``GET`` with a single ``Range`` (206 and ``Content-Range``, 416 past the end), ``If-Match`` on the
ETag (412 when the object changed), ``HEAD``, ``PUT``, and HTML listings of prefixes; an optional
bearer token.  Objects live in memory (:class:`Store`), each version with its ETag, and every request
is logged as ``(method, key, Range)`` in ``Store.requests``, so a test can see what a reader asked for.

    server, store = http_server()
    store.put("/bucket/shard-0000.tar", data)
    ... wds.WebDataset(f"{server.url}/bucket/shard-0000.tar") ...
    server.stop()

With :class:`~wds_cloud.testing.faults.FaultProxy` in front it is a distant store (see
:mod:`wds_cloud.testing.link`).  With ``range_cost`` it is a store where every GET, ranged or not,
costs time in proportion to the whole object, one request at a time (as a store that reads the whole
object for each request does): ``http_server(range_cost=0.01)`` charges 10 ms per MB of the object.

``validators`` says how answers name an object's version: ``"etag"`` (a strong ETag, and ``Last-Modified``),
``"weak"`` (a weak ETag, ``W/"..."``, and ``Last-Modified``), ``"last-modified"`` (no ETag, as Python's
``http.server`` and RangeHTTPServer answer) or ``"none"``; each version of an object is dated one second after
the one before.  ``conditions=False`` ignores ``If-Match`` and ``If-Unmodified-Since``, as those file servers do
(by default they are honoured, ``If-Match`` comparing strong tags only, as RFC 9110 says).
"""

from __future__ import annotations

import email.utils
import hashlib
import html
import json
import os
import re
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer as _ThreadingHTTPServer
from typing import Any, Optional

__all__ = ["Store", "HTTPObjectHandler", "ObjectHandler", "Server", "ThreadingHTTPServer", "http_server", "parse_range"]


class ThreadingHTTPServer(_ThreadingHTTPServer):
    """The standard threading server with a listen backlog for many parallel connections (the default is 5:
    a burst of parallel ranged reads would see dropped SYNs and a second's wait each).  A client that goes away
    mid-answer (a reader that stopped, a part paused or given up) is no error of the server's: it is not
    printed (the standard server prints a traceback for each)."""

    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


#: the date of the first version stored (each later one is a second after the one before)
_FIRST_DATE = 1_700_000_000

#: how answers may name a version (see the module docstring)
VALIDATORS = ("etag", "weak", "last-modified", "none")


class Store:
    """Objects in memory, with an ETag and a modification date per version."""

    def __init__(self, validators: str = "etag", conditions: bool = True) -> None:
        if validators not in VALIDATORS:
            raise ValueError(f"validators={validators!r}: expected one of {', '.join(VALIDATORS)}")
        self.validators = validators
        self.conditions = conditions
        self.objects: dict[str, bytes] = {}
        self.etags: dict[str, str] = {}
        self.modified: dict[str, float] = {}  # seconds since the epoch, one second apart per version stored
        self._versions = 0
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, Optional[str]]] = []
        self.bytes_sent = 0
        #: seconds per MB of the whole object that every GET costs, one GET at a time (None: free)
        self.range_cost: Optional[float] = None
        self.busy = threading.Lock()  # held while a GET's cost is paid
        #: connections the server accepted (a reader that reuses kept connections opens few)
        self.connections = 0

    def put(self, key: str, data: bytes) -> None:
        etag = '"' + hashlib.md5(data).hexdigest() + '"'  # once per version, not per request
        with self.lock:
            self.objects[key] = data
            self.etags[key] = etag
            self._versions += 1
            self.modified[key] = _FIRST_DATE + self._versions

    def put_directory(self, directory: str) -> None:
        """Store every file of ``directory`` as ``/NAME``."""
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    self.put("/" + name, f.read())

    def etag(self, key: str) -> str:
        return self.etags[key]

    def version_headers(self, key: str) -> dict[str, str]:
        """The headers that name the stored version of ``key``, as ``validators`` says."""
        headers = {}
        if self.validators in ("etag", "weak"):
            headers["ETag"] = ("W/" if self.validators == "weak" else "") + self.etags[key]
        if self.validators != "none":
            headers["Last-Modified"] = email.utils.formatdate(self.modified[key], usegmt=True)
        return headers

    def refuses(self, key: str, if_match: Optional[str], if_unmodified_since: Optional[str]) -> bool:
        """Whether the conditions of a request fail for the stored version of ``key`` (HTTP 412): ``If-Match``
        compares strong tags only (a weak tag, or none, never matches), ``If-Unmodified-Since`` compares the date
        (ignored when ``If-Match`` is present, or when the date cannot be read)."""
        if not self.conditions:
            return False
        if if_match is not None:
            if if_match.strip() == "*":
                return False
            strong = self.etags[key] if self.validators == "etag" else None
            return strong is None or strong not in [tag.strip() for tag in if_match.split(",")]
        if if_unmodified_since is not None and self.validators in ("etag", "weak", "last-modified"):
            try:
                since = email.utils.parsedate_to_datetime(if_unmodified_since).timestamp()
            except (TypeError, ValueError):
                return False
            return self.modified[key] > since
        return False


def parse_range(header: Optional[str], size: int) -> Optional[tuple[int, int]]:
    """``(first, last)`` byte of a single ``bytes=a-b`` (or ``a-``, ``-n``) range; None when absent or not one."""
    if not header:
        return None
    m = re.match(r"bytes=(\d*)-(\d*)$", header.strip())
    if not m:
        return None
    start = int(m.group(1)) if m.group(1) else size - int(m.group(2))
    end = int(m.group(2)) if m.group(1) and m.group(2) else size - 1
    return start, min(end, size - 1)


class ObjectHandler(BaseHTTPRequestHandler):
    """What the object handlers share: the store, the optional token and pacing, errors as JSON."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle's algorithm the body would wait for the
    # client's delayed ACK of the headers (tens of ms per small response), which real stores do not do.
    disable_nagle_algorithm = True
    store: Store
    token: Optional[str] = None
    rate: Optional[float] = None  # bytes per second per connection (benchmarks); None: as fast as possible

    def log_message(self, *args) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.store.lock:
            self.store.connections += 1

    def _key(self) -> str:
        return urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)

    def _authorized(self) -> bool:
        if self.token is None:
            return True
        if self.headers.get("Authorization") == f"Bearer {self.token}":
            return True
        self._error(401, "unauthorized: bad or missing token")
        return False

    def _error(self, status: int, message: str) -> None:
        body = json.dumps(
            {"message": message, "method": self.command, "url_path": self.path, "status": status}
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_object(self, key: str, extra_headers: Optional[dict] = None) -> None:
        self.store.requests.append((self.command, key, self.headers.get("Range")))
        data = self.store.objects.get(key)
        if data is None:
            if key.endswith("/") or key == "":
                return self._listing(key)
            return self._error(404, f"{key} does not exist")
        if self.store.refuses(key, self.headers.get("If-Match"), self.headers.get("If-Unmodified-Since")):
            return self._error(412, "precondition failed: the object changed")
        rng = parse_range(self.headers.get("Range"), len(data))
        if rng and rng[0] >= len(data):
            return self._error(416, "range not satisfiable")
        if self.store.range_cost and self.command == "GET":  # the whole object is read for every request,
            with self.store.busy:  # one at a time, before the answer starts
                time.sleep(self.store.range_cost * len(data) / 1e6)
        view = memoryview(data)  # a Range answer must not copy the object (resumes would pay for it)
        status, body = (206, view[rng[0] : rng[1] + 1]) if rng else (200, view)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for name, value in self.store.version_headers(key).items():
            self.send_header(name, value)
        self.send_header("Accept-Ranges", "bytes")
        if rng:
            self.send_header("Content-Range", f"bytes {rng[0]}-{rng[1]}/{len(data)}")
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        started = time.perf_counter()
        for pos in range(0, len(body), 1 << 16):
            self.wfile.write(body[pos : pos + (1 << 16)])
            self.store.bytes_sent += min(1 << 16, len(body) - pos)
            if self.rate:  # pace the answer like a store with this much bandwidth per connection
                ahead = started + (pos + (1 << 16)) / self.rate - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)

    def _listing(self, prefix: str) -> None:
        names = sorted(k for k in self.store.objects if k.startswith(prefix))
        links = "".join(
            f'<a href="{html.escape(urllib.parse.quote(n[len(prefix) :]))}">{html.escape(n)}</a>\n' for n in names
        )
        body = f"<html><body>\n{links}</body></html>".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _receive(self, key: str) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        data = self.rfile.read(length)
        self.store.put(key, data)
        self.send_response(201)
        for name, value in self.store.version_headers(key).items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()


class HTTPObjectHandler(ObjectHandler):
    """GET (with Range and If-Match), HEAD, PUT, and HTML listings of prefixes."""

    def do_GET(self) -> None:
        if self._authorized():
            self._send_object(self._key())

    do_HEAD = do_GET

    def do_PUT(self) -> None:
        if self._authorized():
            self._receive(self._key())


class Server:
    """A threaded server on a free loopback port; ``url`` is its base URL."""

    def __init__(self, handler: type) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def http_server(
    token: Optional[str] = None,
    range_cost: Optional[float] = None,
    validators: str = "etag",
    conditions: bool = True,
) -> tuple[Server, Store]:
    """A server and its store; ``token`` requires that bearer token, ``range_cost`` charges every GET
    that many seconds per MB of the whole object, one GET at a time; ``validators`` and ``conditions``: how
    answers name a version and whether requests' conditions are honoured (see the module docstring)."""
    store = Store(validators, conditions)
    store.range_cost = range_cost
    handler = type("Handler", (HTTPObjectHandler,), {"store": store, "token": token})
    return Server(handler), store
