"""One streaming HTTP GET as a binary file object, opened at a byte offset.

Built on ``http.client``: the body is read straight from the socket into the
caller's buffer, there is no block-range machinery, and nothing is shared
across processes (a forked DataLoader worker opens its own connections).
Redirects are followed (AIStore's gateway redirects every GET to a target).
HTTP errors become the errors of :mod:`wds_cloud.errors`, with the URL.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import io
import re
import socket
import ssl
import struct
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional

from .. import config
from ..errors import (
    AccessDeniedError,
    ConfigError,
    CredentialsError,
    ObjectChangedError,
    SecurityError,
    ShardNotFoundError,
    TransferError,
    redact,
)
from .backend import read_to_end, skip
from .keepalive import POOL, STALE

__all__ = [
    "HTTPReadStream",
    "request",
    "exchange",
    "raise_for_status",
    "connection_error",
    "version_of",
    "pinning_headers",
]

REDIRECTS = {301, 302, 303, 307, 308}


def connection_error(
    url: str, exc: BaseException, what: str = "connect", display_url: Optional[str] = None
) -> TransferError:
    """A TransferError naming the endpoint really tried (scheme, host, port of ``url``, the request's own
    URL), for a refused, reset or timed-out connection; the message shows ``display_url`` (the URL the
    user gave, such as ``s3://bucket/key``), never a signed request URL."""
    parts = urllib.parse.urlsplit(url)
    endpoint = f"{parts.scheme}://{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
    # a read past the socket's timeout (SO_RCVTIMEO) surfaces as EAGAIN, "Resource temporarily unavailable"
    timed_out = isinstance(exc, (socket.timeout, TimeoutError, BlockingIOError))
    reason = (
        "connection refused"
        if isinstance(exc, ConnectionRefusedError)
        else "timed out"
        if timed_out
        else redact(str(exc)) or type(exc).__name__
    )
    shown = redact(display_url or f"{endpoint}{parts.path}")
    advice = (
        "the server sent nothing for the read timeout; if it is slow rather than stuck, raise it "
        "(WebDataset(..., timeout=) or WDS_RETRY_TIMEOUT)"
        if timed_out and what != "connect"
        else "check that the server is running and that the endpoint "
        f"({_ENDPOINT_SETTINGS.get(urllib.parse.urlsplit(display_url or url).scheme, 'the URL')}) is right"
    )
    return TransferError(
        f"cannot {what} {endpoint} for {shown}: {reason}; {advice}",
        url=display_url or url,
        endpoint=endpoint,
        cause=exc,
    )


#: where each scheme's endpoint is set, named in the advice of a failed connection (environment first)
_ENDPOINT_SETTINGS = {
    "s3": "AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (in Python: storage_options={'endpoint_url': ...})",
    "gs": "STORAGE_EMULATOR_HOST, or the network's DNS for storage.googleapis.com",
    "gcs": "STORAGE_EMULATOR_HOST, or the network's DNS for storage.googleapis.com",
    "ais": "AIS_ENDPOINT",
    "az": "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME",
    "abfs": "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME",
}


def _connection(parts: urllib.parse.SplitResult, timeout: float) -> http.client.HTTPConnection:
    host = parts.hostname or ""  # an empty host fails to connect, with the URL in the message
    if parts.scheme == "https":
        return http.client.HTTPSConnection(host, parts.port, timeout=timeout, context=ssl.create_default_context())
    return http.client.HTTPConnection(host, parts.port, timeout=timeout)


#: headers a redirect to another host (or from https to http) keeps; every other one may carry a credential
_REDIRECT_SAFE = frozenset(
    {
        "range",
        "if-match",
        "if-none-match",
        "if-unmodified-since",
        "accept",
        "accept-encoding",
        "user-agent",
        "content-type",
        "content-length",
    }
)

#: how a version taken from ``Last-Modified`` begins (an ETag begins with a quote, or ``W/``)
_MODIFIED = "Last-Modified: "


def version_of(etag: Optional[str], last_modified: Optional[str]) -> Optional[str]:
    """The version of an object as an HTTP answer names it: its ETag; without one, its ``Last-Modified`` date
    (``"Last-Modified: Tue, 15 Nov 1994 08:12:31 GMT"``); None when the server sends neither.

    A server without ETags (Python's ``http.server``, RangeHTTPServer, many file servers) still says when
    the object last changed: a part answered with another date is another version.  The object's size is
    compared beside the version wherever the version is (a replacement of another size is caught even within
    the one second a date can tell apart)."""
    if etag and etag.strip():
        return etag.strip()
    if last_modified and last_modified.strip():
        return _MODIFIED + last_modified.strip()
    return None


def pinning_headers(version: Optional[str]) -> dict[str, str]:
    """The request headers that ask a server for ``version`` (from :func:`version_of`) and no other.

    A strong ETag is ``If-Match``; a weak one (``W/"..."``) asks for nothing, as ``If-Match`` compares strong
    tags only and a server that honours it would refuse every part; a ``Last-Modified`` version is
    ``If-Unmodified-Since``.  Servers may ignore these headers: every answer's version is compared with the
    pinned one as well (:class:`~wds_cloud.io.resilient.ResumableStream`)."""
    if not version or not _sendable_header(version):  # a value HTTP cannot carry back: the answers are compared
        return {}
    if version.startswith(_MODIFIED):
        return {"If-Unmodified-Since": version[len(_MODIFIED) :]}
    if version.startswith("W/"):
        return {}
    return {"If-Match": version}


def _same_trust(old: urllib.parse.SplitResult, new: urllib.parse.SplitResult) -> bool:
    """Whether credentials sent to ``old`` may go to ``new``: the same host and port, and no downgrade to http."""
    return (old.hostname, old.port) == (new.hostname, new.port) and not (old.scheme == "https" and new.scheme == "http")


def _where(url: str) -> str:
    parts = urllib.parse.urlsplit(url.split()[0] if url.split() else url)
    return f"{parts.scheme}://{parts.hostname or ''}" if parts.scheme else "the URL"


def _sendable_header(text: str) -> bool:
    """Whether a header's name and value can be sent: no newline or NUL, and Latin-1 (what ``http.client`` encodes
    header values with; a token pasted with a typographic quote is not)."""
    if any(c in text for c in "\r\n\0"):
        return False
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


def _check_request(url: str, headers: Mapping[str, str]) -> None:
    """Refuse, before any byte is sent, a URL holding a space or control character and a header (a token) holding
    a newline or NUL: HTTP cannot carry them, and ``http.client``'s own error would print the value."""
    bad = next((i for i, c in enumerate(url) if c <= " " or c == "\x7f"), None)
    if bad is not None:
        raise ConfigError(
            f"{_where(url)}: the URL holds a space or control character at position {bad}, which HTTP "
            "does not allow; quote it (a space is %20) or remove it"
        )
    for number, (key, value) in enumerate(headers.items()):
        text = f"{key}{value}"
        if any(c in text for c in "\r\n\0"):
            name = key if not any(c in key for c in "\r\n\0") else f"header {number}"
            raise ConfigError(
                f"{_where(url)}: the request header {name!r} holds a newline or NUL (a token or "
                "credential that ends in a newline, often from a file read whole), which HTTP does not "
                "allow; strip it from storage_options['headers'] or the variable it came from"
            )


_NON_ASCII = re.compile(r"[^\x00-\x7f]+")


def _request_target(parts: urllib.parse.SplitResult, display_url: str) -> str:
    """The path and query a request sends: characters beyond ASCII percent-encoded as UTF-8, as browsers and curl
    send them (``日本.tar`` is ``%E6%97%A5%E6%9C%AC.tar``; a file name that is not UTF-8, decoded with
    surrogateescape, as its own bytes); ASCII, ``%XX`` escapes included, goes as given.  ``http.client`` would
    otherwise fail with a bare UnicodeEncodeError naming neither the URL nor the character."""
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        return _NON_ASCII.sub(lambda m: urllib.parse.quote(m.group(0), safe="", errors="surrogateescape"), target)
    except UnicodeEncodeError as exc:  # a lone surrogate that no file name produced (from JSON's \ud800)
        raise ConfigError(
            f"{redact(display_url)}: the URL holds {exc.object[exc.start : exc.end]!a} at position {exc.start} of its "
            "path, which is not text and cannot be sent over HTTP; fix the URL (or the file that named it)",
            url=display_url,
        ) from None


def request(
    method: str,
    url: str,
    headers: Optional[Mapping[str, str]] = None,
    body: Optional[bytes] = None,
    timeout: float = 60.0,
    max_redirects: int = 5,
    display_url: Optional[str] = None,
    follow_redirects: bool = True,
    trust_redirects: bool = False,
):
    """Send a request, following redirects unless told not to; returns (connection, response).

    A redirect to another host, or from https to http, drops every header that may carry a
    credential (``Authorization``, tokens, storage options' headers) unless ``trust_redirects``
    (AIStore's gateway sends reads on to its targets, which need the token).  A redirect to a
    scheme other than http(s) (``pipe:``, ``file:``) is refused at once.  The caller closes both.
    """
    display_url = display_url or url
    headers = dict(headers or {})
    _check_request(url, headers)
    # the socket refuses a negative or infinite timeout with a ValueError, after it was made (it would leak)
    timeout = config.check_setting("timeout", timeout)
    trusted_hops = 1 if trust_redirects else 0  # the gateway's one redirect to its target, never further
    while True:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise TransferError(f"{redact(display_url)}: cannot follow a redirect to {redact(url)}", url=display_url)
        path = _request_target(parts, display_url)
        key = POOL.key(parts.scheme, parts.hostname or "", parts.port)
        kept = POOL.take(key, timeout) if method in ("GET", "HEAD") else None
        conn = kept or _connection(parts, timeout)
        try:
            for attempt in (kept, None):  # a kept connection the server closed as it was used: once more, new
                try:
                    conn.request(method, path, body=body, headers=dict(headers or {}))
                    response = conn.getresponse()
                    break
                except STALE:
                    if attempt is None:
                        raise
                    conn.close()
                    conn = _connection(parts, timeout)
        except http.client.InvalidURL as exc:  # a space or control character: no retry makes it valid
            conn.close()
            raise TransferError(
                f"{redact(display_url)}: not a valid HTTP URL ({redact(str(exc))}); quote the "
                "characters it names (a space is %20)",
                url=display_url,
                status=400,
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise connection_error(url, exc, display_url=display_url) from None
        except ValueError as exc:  # http.client refuses a header holding a newline: never show its value
            conn.close()
            bad = [k for k, v in (headers or {}).items() if not _sendable_header(f"{k}{v}")]
            if not bad and not str(exc).startswith("Invalid header"):
                if isinstance(exc, UnicodeError):  # a host name IDNA cannot encode (an empty or too long label)
                    raise ConfigError(
                        f"{redact(display_url)}: the URL cannot be sent over HTTP ({redact(str(exc))}); fix its "
                        "host name",
                        url=display_url,
                    ) from None
                # not a header (a timeout the socket refuses, ...): calling it one sends the user to the wrong
                # place; settings are range-checked where they are read, so this is a bug of ours and stays raw
                raise
            raise ConfigError(
                f"{redact(display_url)}: the request header(s) {bad or '(a name or value)'} hold a newline, "
                "NUL or a character HTTP does not allow in a header; remove it from storage_options['headers'] "
                "(or the credential it came from)",
                url=display_url,
            ) from None
        if not follow_redirects:
            return conn, response
        if response.status in REDIRECTS and response.getheader("Location") and max_redirects > 0:
            location = urllib.parse.urljoin(url, response.getheader("Location"))
            response.read()
            conn.close()
            target = urllib.parse.urlsplit(location)
            if target.scheme not in ("http", "https"):
                raise SecurityError(
                    f"{redact(display_url)}: the server redirected to {redact(location)!r}, which is "
                    "not an http(s) URL; redirects never open local files or run commands",
                    url=display_url,
                )
            if not _same_trust(parts, target):
                if trusted_hops > 0:
                    trusted_hops -= 1
                else:
                    headers = {k: v for k, v in headers.items() if k.lower() in _REDIRECT_SAFE}
            _check_request(location, {})
            url = location
            max_redirects -= 1
            continue
        if response.status in REDIRECTS and response.getheader("Location"):
            response.read()
            conn.close()
            raise TransferError(f"{redact(display_url)}: too many redirects (last to {redact(url)})", url=display_url)
        return conn, response


@contextlib.contextmanager
def exchange(
    method: str, url: str, headers: Optional[Mapping[str, str]] = None, body: Optional[bytes] = None, **options: Any
) -> Iterator[http.client.HTTPResponse]:
    """One request (see :func:`request` for ``options``); its response and connection close when the block ends."""
    conn, response = request(method, url, headers, body, **options)
    try:
        yield response
    finally:
        response.close()
        conn.close()


def raise_for_status(
    response: http.client.HTTPResponse,
    url: str,
    credentials_hint: str = "",
    error_body: Optional[Callable[[int, str, str], Optional[BaseException]]] = None,
) -> None:
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
        raise ObjectChangedError(f"{shown}: the object changed while it was being read (HTTP 412)", url=url, status=412)
    if status == 404:
        raise ShardNotFoundError(f"{shown}: no such object (HTTP 404{': ' + detail if detail else ''})", url=url)
    if status == 401:
        raise CredentialsError(
            f"{shown}: the server rejected the credentials (HTTP 401); "
            f"{credentials_hint or 'provide valid credentials'}",
            url=url,
        )
    if status == 403:
        raise AccessDeniedError(
            f"{shown}: access denied (HTTP 403); the credentials in use may not read this "
            f"object{'; ' + credentials_hint if credentials_hint else ''}",
            url=url,
        )
    raise TransferError(
        f"{shown}: the server answered HTTP {status} {response.reason}{': ' + detail if detail else ''}",
        url=url,
        status=status,
    )


def whole_object_md5(headers: Mapping[str, str], whole: bool) -> Optional[str]:
    """The MD5 (hex) of the whole object a response names: GCS ``x-goog-hash``, Azure
    ``x-ms-blob-content-md5``, or ``Content-MD5`` when the response carries the whole object."""
    values = []
    for part in (headers.get("x-goog-hash") or "").split(","):
        name, _, value = part.strip().partition("=")
        if name == "md5":
            values.append(value)
    values.append(headers.get("x-ms-blob-content-md5") or "")
    if whole:
        values.append(headers.get("Content-MD5") or "")
    for value in values:
        try:
            digest = base64.b64decode(value.strip(), validate=True) if value else b""
        except (binascii.Error, ValueError):
            continue
        if len(digest) == 16:
            return digest.hex()
    return None


class HTTPReadStream:
    """The body of ``GET url`` from byte ``offset``, readable with ``read``/``readinto``.

    ``size`` is the whole object's size, ``etag`` its ETag and ``version`` its version
    (:func:`version_of`: the ETag, else the ``Last-Modified`` date), when the server sent
    them.  Every request asks with a ``Range`` (``bytes=0-`` for the whole object), so
    ``ranged`` tells whether the server honours ranges.  Every read returns what one
    receive brought (``partial_reads``), so a fault never discards bytes already received;
    ``skipped`` counts the bytes a server that ignores Range sent before ``offset``
    (refetched, then dropped).
    """

    partial_reads = True

    def _header_int(self, name: str, value: str) -> int:
        """A byte count from a response header; a malformed one is the server's fault, said as such."""
        text = value.strip()
        if not text.isascii() or not text.isdigit():
            status = self._response.status if self._response is not None else None
            self.close()
            raise TransferError(
                f"{redact(self.url)}: the server sent a malformed {name} header "
                f"({text[:40]!r}, not a byte count); check the server or proxy",
                url=self.url,
                status=status,
            )  # the status makes it permanent: a retry gets the same
        return int(text)

    def __init__(
        self,
        url: str,
        offset: int = 0,
        headers: Optional[Mapping[str, str]] = None,
        timeout: float = 60.0,
        display_url: Optional[str] = None,
        credentials_hint: str = "",
        error_body: Optional[Callable[[int, str, str], Optional[BaseException]]] = None,
        length: Optional[int] = None,
        trust_redirects: bool = False,
    ) -> None:
        self.url = display_url or url
        self._request_url = url  # the endpoint really contacted, named in connection errors (never shown whole)
        self.offset = offset
        wanted = length
        self.skipped = 0
        self._pending: Optional[bytes] = None  # http.client's buffered body bytes, taken once
        self._direct: Optional[bool] = None
        #: whether the server honoured the Range asked for (None: it cannot tell, an empty object answered whole)
        self.ranged: Optional[bool] = True
        self._beyond = 0  # bytes of an answer that ignored Range past the length asked for (see read_on)
        request_headers = dict(headers or {})
        if wanted is not None:  # a bounded range: the server sends no more than asked
            request_headers["Range"] = f"bytes={offset}-{offset + max(wanted, 1) - 1}"
        else:
            # from 0 as well: the answer then says whether the server honours Range (206) or not (200), before
            # a reader in parallel parts asks it for any part (a 200 to each part would be the whole object)
            request_headers["Range"] = f"bytes={offset}-"
        self._conn, self._response = request(
            "GET", url, request_headers, timeout=timeout, display_url=self.url, trust_redirects=trust_redirects
        )
        try:
            # a range from the very end (or any range of an empty object) is not satisfiable: nothing left
            if self._response.status == 416:
                self.size: Optional[int] = offset
                self._response.read()
                self.remaining: Optional[int] = 0
                self.etag = self.last_modified = self.version = self.md5 = None
                self.headers = {}
                self.closed = False
                return
            raise_for_status(self._response, self.url, credentials_hint, error_body)
        except BaseException:
            self.close()
            raise
        header = self._response.getheader("Content-Length")
        self.remaining = self._header_int("Content-Length", header) if header is not None else None
        content_range = self._response.getheader("Content-Range")
        if self._response.status == 200:  # the server ignored Range
            # (an empty object tells nothing: a range of it cannot be satisfied, and a 200 is a fair answer)
            self.ranged = None if (self.remaining == 0 and not offset) else False
            self._discard(offset)
            self.size = self.remaining + offset if self.remaining is not None else None
            if wanted is not None and self.remaining is not None and self.remaining > wanted:
                # the rest of the body is left unread, unless the reader goes on (read_on)
                self._beyond, self.remaining = self.remaining - wanted, wanted
        elif content_range and "/" in content_range and not content_range.endswith("*"):
            self.size = self._header_int("Content-Range", content_range.rsplit("/", 1)[1])
            self._check_range(content_range, offset)
        else:
            self.size = (self.remaining + offset) if self.remaining is not None else None
        self.etag = self._response.getheader("ETag")
        self.last_modified = self._response.getheader("Last-Modified")
        self.version = version_of(self.etag, self.last_modified)
        self.headers = self._response.headers
        # the body is the whole object: an answer that ignored Range, or a range from 0 that covers it all
        whole = self._response.status == 200 or (
            offset == 0 and self.remaining is not None and self.remaining == self.size
        )
        self.md5 = whole_object_md5(self.headers, whole=whole)
        self._body = self.remaining  # the bytes this response should bring from ``offset``
        self.closed = False

    def _check_range(self, content_range: str, offset: int) -> None:
        """A 206 must answer from the byte asked for: other bytes would be spliced into the stream."""
        first = content_range.split(None, 1)[-1].split("-", 1)[0].strip()
        if self._response.status == 206 and (not first.isdigit() or int(first) != offset):
            self.close()
            raise TransferError(
                f"{redact(self.url)}: asked for the bytes from {offset}, the server answered with "
                f"{content_range[:60]!r}; its range support is broken (check the server or proxy)",
                url=self.url,
                offset=offset,
                status=206,
            )  # 206: no retry gets other bytes

    def read_on(self) -> bool:
        """Go on past the length asked for, to the end of the object, in this same response: where the server
        ignored Range it is sending the whole object anyway, and the rest costs no request.  False where it
        honoured the range (this answer ends where it was asked to end)."""
        if self.ranged is not False:
            return False
        if self.remaining is not None:
            self.remaining += self._beyond
            self._body = (self._body or 0) + self._beyond
        self._beyond = 0
        return True

    def _discard(self, n: int) -> None:
        self.skipped += skip(self._response.read, n)
        if self.remaining is not None:
            self.remaining -= self.offset

    def readable(self) -> bool:
        return True

    def _socket(self) -> Optional[socket.socket]:
        """The plain TCP socket, switched to kernel-side timeouts (http.client's buffer is drained first).

        Reads then go straight to ``recv_into(..., MSG_WAITALL)``: one system call fills the
        caller's buffer, and when the connection fails part-way the kernel still reports the
        bytes it delivered, so nothing received is lost.  TLS sockets keep the buffered path.
        """
        if self._direct is False:
            return None
        sock = getattr(self._conn, "sock", None)
        if self._direct is None:
            if (
                not isinstance(sock, socket.socket)
                or isinstance(sock, ssl.SSLSocket)
                or not hasattr(socket, "MSG_WAITALL")
                or not hasattr(socket, "SO_RCVTIMEO")
            ):
                self._direct = False
                return None
            timeout = sock.gettimeout() or 0.0
            sock.settimeout(None)
            seconds = int(timeout)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, int((timeout - seconds) * 1e6))
            )
            self._direct = True
        return sock

    def _drain(self, fp) -> None:
        """Take what http.client buffered with the headers (at most its buffer size), once."""
        buffered = max(io.DEFAULT_BUFFER_SIZE, 1 << 16)  # called only when the length is known
        self._pending = fp.read1(min(self.remaining, buffered) if self.remaining is not None else buffered)

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return read_to_end(self.read)
        fp = self._response.fp
        try:
            if self.remaining is None or fp is None:  # chunked or already finished: let http.client decode
                return self._response.read(size)
            size = min(size, self.remaining)
            if not size:
                return b""
            if self._pending is None:
                self._drain(fp)
            if self._pending:
                data, self._pending = self._pending[:size], self._pending[size:]
            else:
                sock = self._socket()
                data = sock.recv(size, socket.MSG_WAITALL) if sock is not None else fp.read1(size)
        except (OSError, http.client.HTTPException) as exc:
            raise connection_error(self._request_url, exc, "read from", display_url=self.url) from None
        self.remaining -= len(data)
        if not data:
            raise self._short()
        return data

    def readinto(self, buffer) -> int:
        fp = self._response.fp
        try:
            if self.remaining is None or fp is None:
                return self._response.readinto(buffer)
            view = memoryview(buffer).cast("B")[: self.remaining]
            if not len(view):
                return 0
            if self._pending is None:
                self._drain(fp)
            if self._pending:
                n = min(len(view), len(self._pending))
                view[:n] = self._pending[:n]
                self._pending = self._pending[n:]
            else:
                sock = self._socket()
                n = sock.recv_into(view, len(view), socket.MSG_WAITALL) if sock is not None else fp.readinto1(view)
        except (OSError, http.client.HTTPException) as exc:
            raise connection_error(self._request_url, exc, "read from", display_url=self.url) from None
        self.remaining -= n
        if not n:
            raise self._short()
        return n

    def _short(self) -> TransferError:
        """The body ended before Content-Length said it would: a fault, never an end of file."""
        body = getattr(self, "_body", None) or 0
        reached = self.offset + body - (self.remaining or 0)
        return TransferError(
            f"{redact(self.url)}: the connection closed at byte {reached} of {self.size}, "
            f"{reached - self.offset} bytes into a response of {body} (a truncated response)",
            url=self.url,
            offset=reached,
        )

    def abort(self) -> None:
        """Wake a read blocked in another thread (it then fails); the caller closes the stream after."""
        sock = getattr(self._conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Close the response; its connection is kept for the next request when the body was read to its end."""
        if getattr(self, "closed", False) is True:
            return
        self.closed = True
        response, conn = self._response, self._conn
        reusable = (
            getattr(self, "remaining", None) == 0
            and not self._pending
            and not getattr(self, "_beyond", 0)  # an answer that ignored Range, cut short: its rest is on the wire
            and response.status in (200, 206, 416)
            and not response.will_close
            and conn.sock is not None
        )
        try:
            response.close()
        finally:
            if reusable:
                parts_key = POOL.key(
                    "https" if isinstance(conn, http.client.HTTPSConnection) else "http", conn.host, conn.port
                )
                POOL.give(parts_key, conn)
            else:
                conn.close()

    def __enter__(self) -> HTTPReadStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
