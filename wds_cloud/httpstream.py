"""One streaming HTTP GET as a binary file object, opened at a byte offset.

Built on ``http.client``: the body is read straight from the socket into the
caller's buffer, there is no block-range machinery, and nothing is shared
across processes (a forked DataLoader worker opens its own connections).
Redirects are followed (AIStore's gateway redirects every GET to a target).
HTTP errors become the errors of :mod:`wds_cloud.errors`, with the URL.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import urllib.parse
from typing import Callable, Mapping, Optional

from .errors import CredentialsError, ShardNotFoundError, TransferError, redact

__all__ = ["HTTPReadStream", "request", "raise_for_status", "AccessDeniedError", "connection_error"]

REDIRECTS = {301, 302, 303, 307, 308}


class AccessDeniedError(CredentialsError):
    """The credentials were accepted but do not allow this operation."""


def connection_error(url: str, exc: BaseException, what: str = "connect") -> TransferError:
    """A TransferError naming the endpoint, for a refused, reset or timed-out connection."""
    parts = urllib.parse.urlsplit(url)
    endpoint = f"{parts.scheme}://{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
    reason = "connection refused" if isinstance(exc, ConnectionRefusedError) else (
        "timed out" if isinstance(exc, (socket.timeout, TimeoutError)) else str(exc) or type(exc).__name__)
    return TransferError(
        f"cannot {what} {endpoint} for {redact(url)}: {reason}; check that the server is running and that "
        "the endpoint (endpoint_url, AIS_ENDPOINT, ...) is right", url=url, endpoint=endpoint, cause=exc)


def _connection(parts: urllib.parse.SplitResult, timeout: float) -> http.client.HTTPConnection:
    if parts.scheme == "https":
        return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout,
                                           context=ssl.create_default_context())
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def request(method: str, url: str, headers: Optional[Mapping[str, str]] = None, body: Optional[bytes] = None,
            timeout: float = 60.0, max_redirects: int = 5, display_url: Optional[str] = None,
            follow_redirects: bool = True):
    """Send a request, following redirects unless told not to; returns (connection, response).

    The caller closes both.
    """
    display_url = display_url or url
    while True:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise TransferError(f"{redact(display_url)}: cannot follow a redirect to {redact(url)}", url=display_url)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        conn = _connection(parts, timeout)
        try:
            conn.request(method, path, body=body, headers=dict(headers or {}))
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise connection_error(url, exc) from exc
        if not follow_redirects:
            return conn, response
        if response.status in REDIRECTS and response.getheader("Location") and max_redirects > 0:
            location = urllib.parse.urljoin(url, response.getheader("Location"))
            response.read()
            conn.close()
            url = location
            max_redirects -= 1
            continue
        if response.status in REDIRECTS and response.getheader("Location"):
            response.read()
            conn.close()
            raise TransferError(f"{redact(display_url)}: too many redirects (last to {redact(url)})", url=display_url)
        return conn, response


def raise_for_status(response: http.client.HTTPResponse, url: str, credentials_hint: str = "",
                     error_body: Optional[Callable[[int, str, str], Optional[BaseException]]] = None) -> None:
    """Raise the matching wds_cloud error for a non-2xx response (reads its body for the message).

    ``error_body(status, body, url)`` may return a more specific error from the body (S3's XML codes).
    """
    status = response.status
    if 200 <= status < 300:
        return
    try:
        detail = response.read(2000).decode("utf-8", "replace").strip()
    except Exception:
        detail = ""
    if error_body is not None:
        specific = error_body(status, detail, url)
        if specific is not None:
            raise specific
    detail = redact(detail.replace("\n", " ")[:300])
    shown = redact(url)
    if status == 412:
        from .errors import ObjectChangedError

        raise ObjectChangedError(f"{shown}: the object changed while it was being read (HTTP 412)", url=url,
                                 status=412)
    if status == 404:
        raise ShardNotFoundError(f"{shown}: no such object (HTTP 404{': ' + detail if detail else ''})", url=url)
    if status == 401:
        raise CredentialsError(f"{shown}: the server rejected the credentials (HTTP 401); "
                               f"{credentials_hint or 'provide valid credentials'}", url=url)
    if status == 403:
        raise AccessDeniedError(f"{shown}: access denied (HTTP 403); the credentials in use may not read this "
                                f"object{'; ' + credentials_hint if credentials_hint else ''}", url=url)
    raise TransferError(f"{shown}: the server answered HTTP {status} {response.reason}"
                        f"{': ' + detail if detail else ''}", url=url, status=status)


class HTTPReadStream:
    """The body of ``GET url`` from byte ``offset``, readable with ``read``/``readinto``.

    ``size`` is the whole object's size and ``etag`` its version tag, when the
    server sent them.  Every read returns what one receive brought (``partial_reads``),
    so a fault never discards bytes already received; ``skipped`` counts the bytes a
    server that ignores Range sent before ``offset`` (refetched, then dropped).
    """

    partial_reads = True

    def __init__(self, url: str, offset: int = 0, headers: Optional[Mapping[str, str]] = None,
                 timeout: float = 60.0, display_url: Optional[str] = None, credentials_hint: str = "",
                 error_body: Optional[Callable[[int, str, str], Optional[BaseException]]] = None) -> None:
        self.url = display_url or url
        self.offset = offset
        self.skipped = 0
        request_headers = dict(headers or {})
        if offset:
            request_headers["Range"] = f"bytes={offset}-"
        self._conn, self._response = request("GET", url, request_headers, timeout=timeout, display_url=self.url)
        try:
            if self._response.status == 416 and offset:  # reading from the very end: nothing left
                self.size = offset
                self._response.read()
                self.remaining = 0
                self.etag = self.version = None
                self.headers = {}
                self.closed = False
                return
            raise_for_status(self._response, self.url, credentials_hint, error_body)
        except BaseException:
            self.close()
            raise
        length = self._response.getheader("Content-Length")
        self.remaining = int(length) if length is not None else None
        content_range = self._response.getheader("Content-Range")
        if offset and self._response.status == 200:  # the server ignored Range: skip what was asked to skip
            self._discard(offset)
            self.size = self.remaining
        elif content_range and "/" in content_range and not content_range.endswith("*"):
            self.size = int(content_range.rsplit("/", 1)[1])
        else:
            self.size = (self.remaining + offset) if self.remaining is not None else None
        self.etag = self._response.getheader("ETag")
        self.version = self.etag
        self.headers = self._response.headers
        self.closed = False

    def _discard(self, n: int) -> None:
        while n > 0:
            chunk = self._response.read(min(n, 1 << 20))
            if not chunk:
                break
            n -= len(chunk)
            self.skipped += len(chunk)
        if self.remaining is not None:
            self.remaining -= self.offset

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            parts = []
            while True:
                chunk = self.read(1 << 20)
                if not chunk:
                    return b"".join(parts)
                parts.append(chunk)
        fp = self._response.fp
        try:
            if self.remaining is None or fp is None:  # chunked or already finished: let http.client decode
                return self._response.read(size)
            # Straight from the socket's buffered reader (http.client's read(n) would fill a zeroed
            # bytearray and copy it again), and at most one receive: what arrived is returned, so a
            # connection lost later never takes bytes already received with it.
            data = fp.read1(min(size, self.remaining)) if self.remaining else b""
        except (OSError, http.client.HTTPException) as exc:
            raise connection_error(self.url, exc, "read from") from exc
        self.remaining -= len(data)
        if not data and self.remaining and size:
            raise self._short()
        return data

    def readinto(self, buffer) -> int:
        fp = self._response.fp
        try:
            if self.remaining is None or fp is None:
                return self._response.readinto(buffer)
            view = memoryview(buffer).cast("B")
            n = fp.readinto1(view[:self.remaining]) if self.remaining else 0
        except (OSError, http.client.HTTPException) as exc:
            raise connection_error(self.url, exc, "read from") from exc
        self.remaining -= n
        if not n and self.remaining and len(buffer):
            raise self._short()
        return n

    def _short(self) -> TransferError:
        """The body ended before Content-Length said it would: a fault, never an end of file."""
        received = (self.size or 0) - self.remaining
        return TransferError(f"{redact(self.url)}: the connection closed after {received} of {self.size} bytes "
                             "(a truncated response)", url=self.url, offset=received)

    def close(self) -> None:
        self.closed = True
        try:
            self._response.close()
        finally:
            self._conn.close()

    def __enter__(self) -> "HTTPReadStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
