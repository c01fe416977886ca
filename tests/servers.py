"""Real servers on loopback for the backend tests: an HTTP server with Range/PUT, and an AIS gateway+target.

Both are small threaded stdlib servers started on port 0.  The AIS pair speaks
the parts of AIStore's HTTP API the client uses: the gateway answers object
GETs with a 301 (HEAD and PUT with a 307) to the target, which serves the bytes
(single ``Range`` supported) with ``Ais-*`` headers and JSON error bodies.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import urllib.parse
from typing import Optional

from wds_cloud.testing.objects import (  # noqa: F401  (the HTTP server the tests use lives in the package)
    HTTPObjectHandler,
    ObjectHandler,
    Server,
    Store,
    ThreadingHTTPServer,
    http_server,
    parse_range,
)


class _AISBase(ObjectHandler):
    ais_store: dict

    def _parts(self) -> Optional[tuple[str, str, str, dict]]:
        split = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(split.query))
        m = re.match(r"^/v1/objects/([^/]+)/(.+)$", split.path)
        if not m:
            return None
        provider = {"s3": "aws", "gs": "gcp", "az": "azure", "": "ais"}.get(
            query.get("provider", ""), query.get("provider", "ais")
        )
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
        self._send_object(
            key,
            {
                "Ais-Checksum-Type": "md5",
                "Ais-Checksum-Value": hashlib.md5(data).hexdigest(),
                "Ais-Version": "1",
                "Ais-Atime": str(time.time_ns()),
            },
        )

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
            return self._error(404, f'bucket "{provider}://{bucket}" does not exist')
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
            return self._error(404, f'bucket "{provider}://{bucket}" does not exist')
        length = int(self.headers.get("Content-Length", "0") or 0)
        request = json.loads(self.rfile.read(length) or b"{}") if length else {}
        prefix = request.get("value", {}).get("prefix", "")
        start = f"{provider}/{bucket}/"
        entries = [
            {"name": k[len(start) :], "size": len(v)}
            for k, v in sorted(self.store.objects.items())
            if k.startswith(start + prefix)
        ]
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


def ais_cluster(token: Optional[str] = None) -> tuple[Server, Server, Store, set]:
    """(gateway, target, store, buckets); store keys are 'provider/bucket/object'."""
    store = Store()
    buckets: set = set()
    target = Server(type("Target", (AISTargetHandler,), {"store": store}))
    gateway = Server(
        type(
            "Gateway", (AISGatewayHandler,), {"store": store, "token": token, "target": target.url, "buckets": buckets}
        )
    )
    return gateway, target, store, buckets


def main(argv=None) -> None:
    """``python tests/servers.py http PORT [DIR [MB_PER_S]]``: serve DIR's files over HTTP in this process
    (benchmarks), each connection paced to MB_PER_S when given."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "http":
        raise SystemExit("usage: python tests/servers.py http PORT [DIR]")
    store = Store()
    if len(args) > 2:
        store.put_directory(args[2])
    rate = float(args[3]) * 1e6 if len(args) > 3 else None
    handler = type("Handler", (HTTPObjectHandler,), {"store": store, "rate": rate})
    httpd = ThreadingHTTPServer(("127.0.0.1", int(args[1])), handler)
    httpd.daemon_threads = True
    httpd.serve_forever()


if __name__ == "__main__":
    main()
