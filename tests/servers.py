"""Real servers on loopback for the backend tests: an HTTP server with Range/PUT, and an AIS gateway+target.

Both are small threaded stdlib servers started on port 0.  The AIS pair speaks
the parts of AIStore's HTTP API the client uses: the gateway answers object
GETs with a 301 (HEAD and PUT with a 307) to the target, which serves the bytes
(single ``Range`` supported) with ``Ais-*`` headers and JSON error bodies.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer as _ThreadingHTTPServer
from typing import Optional


class ThreadingHTTPServer(_ThreadingHTTPServer):
    """The standard threading server with a listen backlog for many parallel connections (the default is 5:
    a burst of parallel ranged reads would see dropped SYNs and a second's wait each)."""

    request_queue_size = 128


class Store:
    """Objects in memory, with an ETag per version."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.etags: dict[str, str] = {}
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, Optional[str]]] = []
        self.bytes_sent = 0

    def put(self, key: str, data: bytes) -> None:
        etag = '"' + hashlib.md5(data).hexdigest() + '"'  # once per version, not per request
        with self.lock:
            self.objects[key] = data
            self.etags[key] = etag

    def etag(self, key: str) -> str:
        return self.etags[key]


def _parse_range(header: Optional[str], size: int) -> Optional[tuple[int, int]]:
    if not header:
        return None
    m = re.match(r"bytes=(\d*)-(\d*)$", header.strip())
    if not m:
        return None
    start = int(m.group(1)) if m.group(1) else size - int(m.group(2))
    end = int(m.group(2)) if m.group(1) and m.group(2) else size - 1
    return start, min(end, size - 1)


class _ObjectHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle's algorithm the body would wait for the
    # client's delayed ACK of the headers (tens of ms per small response), which real stores do not do.
    disable_nagle_algorithm = True
    store: Store
    token: Optional[str] = None
    rate: Optional[float] = None  # bytes per second per connection (benchmarks); None: as fast as possible

    def log_message(self, *args) -> None:  # quiet
        pass

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
        body = json.dumps({"message": message, "method": self.command, "url_path": self.path,
                           "status": status}).encode()
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
        etag = self.store.etag(key)
        if_match = self.headers.get("If-Match")
        if if_match and if_match != etag:
            return self._error(412, "precondition failed: the object changed")
        rng = _parse_range(self.headers.get("Range"), len(data))
        if rng and rng[0] >= len(data):
            return self._error(416, "range not satisfiable")
        view = memoryview(data)  # a Range answer must not copy the object (resumes would pay for it)
        status, body = (206, view[rng[0]:rng[1] + 1]) if rng else (200, view)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", etag)
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
            self.wfile.write(body[pos:pos + (1 << 16)])
            self.store.bytes_sent += min(1 << 16, len(body) - pos)
            if self.rate:  # pace the answer like a store with this much bandwidth per connection
                ahead = started + (pos + (1 << 16)) / self.rate - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)

    def _listing(self, prefix: str) -> None:
        names = sorted(k for k in self.store.objects if k.startswith(prefix))
        links = "".join(f'<a href="{html.escape(urllib.parse.quote(n[len(prefix):]))}">{html.escape(n)}</a>\n'
                        for n in names)
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
        self.send_header("ETag", self.store.etag(key))
        self.send_header("Content-Length", "0")
        self.end_headers()


class HTTPObjectHandler(_ObjectHandler):
    """GET (with Range and If-Match), HEAD, PUT, and HTML listings of prefixes."""

    def do_GET(self) -> None:
        if self._authorized():
            self._send_object(self._key())

    do_HEAD = do_GET

    def do_PUT(self) -> None:
        if self._authorized():
            self._receive(self._key())


class _AISBase(_ObjectHandler):
    ais_store: dict

    def _parts(self) -> Optional[tuple[str, str, str, dict]]:
        split = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(split.query))
        m = re.match(r"^/v1/objects/([^/]+)/(.+)$", split.path)
        if not m:
            return None
        provider = {"s3": "aws", "gs": "gcp", "az": "azure", "": "ais"}.get(query.get("provider", ""),
                                                                          query.get("provider", "ais"))
        return provider, m.group(1), urllib.parse.unquote(m.group(2)), query


class AISTargetHandler(_AISBase):
    def do_GET(self) -> None:
        parts = self._parts()
        if parts is None:
            return self._error(400, f"bad request path {self.path}")
        provider, bucket, name, query = parts
        if "pid" not in query:
            return self._error(400, "targets are reached through the gateway's redirect")
        key = f"{provider}/{bucket}/{name}"
        data = self.store.objects.get(key)
        if data is None:
            return self._error(404, f"t[T1]: {provider}://{bucket}/{name} does not exist")
        self._send_object(key, {"Ais-Checksum-Type": "md5", "Ais-Checksum-Value": hashlib.md5(data).hexdigest(),
                                "Ais-Version": "1", "Ais-Atime": str(time.time_ns())})

    do_HEAD = do_GET

    def do_PUT(self) -> None:
        parts = self._parts()
        if parts is None:
            return self._error(400, f"bad request path {self.path}")
        provider, bucket, name, _ = parts
        self._receive(f"{provider}/{bucket}/{name}")


class AISGatewayHandler(_AISBase):
    target: str = ""
    buckets: set

    def _redirect(self, status: int) -> None:
        if not self._authorized():
            return
        if self.path == "/v1/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        parts = self._parts()
        if parts is None:
            return self._error(400, f"bad request path {self.path}")
        provider, bucket, _, _ = parts
        if (provider, bucket) not in self.buckets:
            return self._error(404, f"bucket \"{provider}://{bucket}\" does not exist")
        sep = "&" if "?" in self.path else "?"
        self.send_response(status)
        self.send_header("Location", f"{self.target}{self.path}{sep}pid=p1&utm={time.time_ns()}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        split = urllib.parse.urlsplit(self.path)
        m = re.match(r"^/v1/buckets/([^/]+)$", split.path)
        if m:
            return self._list(m.group(1), dict(urllib.parse.parse_qsl(split.query)))
        self._redirect(301)

    def _list(self, bucket: str, query: dict) -> None:
        if not self._authorized():
            return
        provider = query.get("provider", "ais")
        if (provider, bucket) not in self.buckets:
            return self._error(404, f"bucket \"{provider}://{bucket}\" does not exist")
        length = int(self.headers.get("Content-Length", "0") or 0)
        request = json.loads(self.rfile.read(length) or b"{}") if length else {}
        prefix = request.get("value", {}).get("prefix", "")
        start = f"{provider}/{bucket}/"
        entries = [{"name": k[len(start):], "size": len(v)} for k, v in sorted(self.store.objects.items())
                   if k.startswith(start + prefix)]
        body = json.dumps({"entries": entries, "continuation_token": ""}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._redirect(307)

    def do_PUT(self) -> None:
        length = int(self.headers.get("Content-Length", "0") or 0)
        if length and not self.headers.get("Expect"):
            self.rfile.read(length)  # the client sends the body before it sees the redirect
        self._redirect(307)


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


def http_server(token: Optional[str] = None) -> tuple[Server, Store]:
    store = Store()
    handler = type("Handler", (HTTPObjectHandler,), {"store": store, "token": token})
    return Server(handler), store


def ais_cluster(token: Optional[str] = None) -> tuple[Server, Server, Store, set]:
    """(gateway, target, store, buckets); store keys are 'provider/bucket/object'."""
    store = Store()
    buckets: set = set()
    target = Server(type("Target", (AISTargetHandler,), {"store": store}))
    gateway = Server(type("Gateway", (AISGatewayHandler,), {"store": store, "token": token, "target": target.url,
                                                           "buckets": buckets}))
    return gateway, target, store, buckets


def main(argv=None) -> None:
    """``python tests/servers.py http PORT [DIR [MB_PER_S]]``: serve DIR's files over HTTP in this process
    (benchmarks), each connection paced to MB_PER_S when given."""
    import os
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "http":
        raise SystemExit("usage: python tests/servers.py http PORT [DIR]")
    store = Store()
    if len(args) > 2:
        for name in sorted(os.listdir(args[2])):
            with open(os.path.join(args[2], name), "rb") as f:
                store.put("/" + name, f.read())
    rate = float(args[3]) * 1e6 if len(args) > 3 else None
    handler = type("Handler", (HTTPObjectHandler,), {"store": store, "rate": rate})
    httpd = ThreadingHTTPServer(("127.0.0.1", int(args[1])), handler)
    httpd.daemon_threads = True
    httpd.serve_forever()


if __name__ == "__main__":
    main()
