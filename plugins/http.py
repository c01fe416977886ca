"""The ``http`` and ``https`` backends: one streaming GET per shard, HEAD for stat, PUT for writes.

Storage options: ``headers`` (a dict sent with every request, e.g. an
``Authorization`` header) and ``timeout`` (seconds, default 60).  Listing a
prefix reads the links of the server's HTML index page.
"""

from __future__ import annotations

import html
import re
import urllib.parse
from collections.abc import Iterator
from typing import Optional

from wds_cloud.errors import redact
from wds_cloud.io import (
    Backend,
    HTTPReadStream,
    InStream,
    ObjectInfo,
    OutStream,
    SpooledPut,
    exchange,
    hookimpl,
    pinning_headers,
    raise_for_status,
    version_of,
)

HINT = "pass the header it needs in storage_options={'headers': {'Authorization': ...}}"


class HTTPBackend(Backend):
    scheme = "http"
    resumable = True
    ranged_reads = True

    @property
    def _headers(self) -> dict:
        return dict(self.storage_options.get("headers") or {})

    @property
    def _timeout(self) -> float:
        return float(self.storage_options.get("timeout", 60.0))

    def open_read(
        self,
        url: str,
        offset: int = 0,
        bufsize: Optional[int] = None,
        *,
        version: Optional[str] = None,
        timeout: Optional[float] = None,
        length: Optional[int] = None,
    ) -> InStream:
        headers = self._headers
        headers.update(pinning_headers(version))
        return HTTPReadStream(url, offset, headers, timeout or self._timeout, credentials_hint=HINT, length=length)

    def stat(self, url: str) -> ObjectInfo:
        with exchange("HEAD", url, self._headers, timeout=self._timeout) as response:
            raise_for_status(response, url, HINT)
            length = response.getheader("Content-Length")
            version = version_of(response.getheader("ETag"), response.getheader("Last-Modified"))
            return ObjectInfo(url, int(length) if length is not None else None, version)

    def list(self, prefix: str) -> Iterator[str]:
        base = prefix if prefix.endswith("/") else prefix.rsplit("/", 1)[0] + "/"
        with exchange("GET", base, self._headers, timeout=self._timeout) as response:
            raise_for_status(response, base, HINT)
            page = response.read().decode("utf-8", "replace")
        seen = set()
        for href in re.findall(r'href="([^"]+)"', page):
            url = urllib.parse.urljoin(base, html.unescape(href))
            if url.startswith(prefix) and url != base and url not in seen and "?" not in url[len(base) :]:
                seen.add(url)
                yield url

    def open_write(self, url: str, bufsize: Optional[int] = None) -> OutStream:
        def send(body, size: int) -> None:
            headers = dict(self._headers, **{"Content-Length": str(size)})
            with exchange("PUT", url, headers, body=body, timeout=self._timeout) as response:
                raise_for_status(response, url, HINT)

        return SpooledPut(url, send)

    def __repr__(self) -> str:
        return f"<HTTPBackend {redact(self.scheme)}>"


@hookimpl
def wds_cloud_register_backends(register) -> None:
    register("http", HTTPBackend, description="HTTP: streaming GET with Range, HEAD, PUT")
    register("https", HTTPBackend, description="HTTPS: streaming GET with Range, HEAD, PUT")
