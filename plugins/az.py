"""The ``az`` (and ``abfs``) backend: adlfs for credentials, stat, listing and writes; streamed downloads.

Storage options are adlfs's (``connection_string``, ``account_name`` with
``account_key``/``sas_token``/``credential``, ``anon``, ``account_host``).
Without options adlfs reads the standard variables
(``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_ACCOUNT_NAME``,
``AZURE_STORAGE_ACCOUNT_KEY``, ``AZURE_STORAGE_SAS_TOKEN``, ...).  Reads stream
one download per shard through adlfs's own client, chunk by chunk.
"""

from __future__ import annotations

import datetime
import re
import sys
import urllib.parse
from typing import Any, Optional

from wds_cloud.errors import (
    AccessDeniedError,
    CredentialsError,
    ObjectChangedError,
    ShardNotFoundError,
    TransferError,
    redact,
)
from wds_cloud.io import FsspecBackend, HTTPReadStream, InStream, ReadStream, hookimpl, pinning_headers

REQUIRES = ("adlfs",)
CREDENTIALS_HINT = (
    "set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
    "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN (in Python: storage_options={'connection_string': ...} "
    "or {'account_name': ..., 'account_key': ...})"
)


def _azure_error(status: int, body: str, url: str) -> Optional[BaseException]:
    """An Azure XML error body as the matching wds_cloud error (None: the generic mapping)."""
    match = re.search(r"<Code>([^<]+)</Code>", body)
    code = match.group(1) if match else ""
    shown = redact(url)
    if code in ("BlobNotFound", "ContainerNotFound"):
        what = "the container does not exist" if code == "ContainerNotFound" else "no such object"
        return ShardNotFoundError(f"{shown}: {what}", url=url)
    if code in ("AuthenticationFailed", "AuthorizationFailure", "InvalidAuthenticationInfo"):
        return CredentialsError(f"{shown}: Azure rejected the credentials ({code}); {CREDENTIALS_HINT}", url=url)
    if code == "ConditionNotMet" or status == 412:
        return ObjectChangedError(f"{shown}: the blob changed while it was being read", url=url)
    return None


class _NeverRaised(Exception):
    """Stands for azure-core's errors while azure-core is not imported (so none can have been raised)."""


def _azure_errors() -> Any:
    """azure-core's exceptions module if something imported it, else a stand-in whose classes match nothing.

    Looked up per call instead of imported with this module: every process loads the plugins, and
    azure-core costs ~30 ms to import, which users who never open an ``az://`` URL should not pay.
    """
    module = sys.modules.get("azure.core.exceptions")
    if module is not None:
        return module

    class Missing:
        ClientAuthenticationError = HttpResponseError = ResourceModifiedError = _NeverRaised
        ResourceNotFoundError = ServiceRequestError = ServiceResponseError = _NeverRaised

    return Missing


def translate(exc: BaseException, url: str) -> BaseException:
    if isinstance(exc, (ShardNotFoundError, CredentialsError, TransferError)):
        return exc
    shown = redact(url)
    status = getattr(exc, "status_code", None)
    code = getattr(exc, "error_code", "") or ""
    code = str(getattr(code, "value", code))  # the SDK's StorageErrorCode enum: its value is Azure's code
    azure = _azure_errors()
    if status == 412 or isinstance(exc, azure.ResourceModifiedError):
        return ObjectChangedError(f"{shown}: the blob changed while it was being read", url=url)
    if status in (429, 500, 502, 503, 504):
        return TransferError(f"{shown}: Azure answered HTTP {status}; it will be retried", url=url, status=status)
    if isinstance(exc, FileNotFoundError) or status == 404 or isinstance(exc, azure.ResourceNotFoundError):
        what = "the container does not exist" if "Container" in code else "no such object"
        return ShardNotFoundError(f"{shown}: {what}", url=url)
    # adlfs wraps a refused upload in a bare RuntimeError; Azure's error code is still in its text
    wrapped = isinstance(exc, RuntimeError) and any(
        c in str(exc) for c in ("AuthorizationFailure", "AuthenticationFailed", "Server failed to authenticate")
    )
    if wrapped:
        code = "AuthorizationFailure" if "AuthorizationFailure" in str(exc) else "AuthenticationFailed"
    if (
        isinstance(exc, azure.ClientAuthenticationError)
        or code in ("AuthenticationFailed", "AuthorizationFailure")
        or status == 401
        or wrapped
    ):
        return CredentialsError(
            f"{shown}: Azure rejected the credentials ({code or status}); {CREDENTIALS_HINT}", url=url
        )
    if status == 403 or isinstance(exc, PermissionError):
        return AccessDeniedError(f"{shown}: access denied by Azure ({code or exc})", url=url)
    if isinstance(exc, (azure.ServiceRequestError, azure.ServiceResponseError)) or isinstance(exc, ConnectionError):
        return TransferError(
            f"{shown}: cannot reach the Azure endpoint ({exc}); check that it is running and "
            "that the account URL / connection string is right",
            url=url,
            cause=exc,
        )
    if isinstance(exc, azure.HttpResponseError) and "payload is not completed" in str(exc):
        return TransferError(f"{shown}: the download was cut short ({exc})", url=url, cause=exc)
    if isinstance(exc, ValueError) and "credential" in str(exc).lower():
        # adlfs's own words ("Must provide either a connection_string or account_name with credentials") name
        # its Python arguments: said here as what is missing
        return CredentialsError(
            f"{shown}: no Azure credentials were found (adlfs needs an account and a key, a SAS token or a "
            f"connection string); {CREDENTIALS_HINT}",
            url=url,
        )
    return exc


class _ChunkStream(ReadStream):
    """A blob download read chunk by chunk through adlfs's async client, from synchronous code."""

    def __init__(self, fs: Any, url: str, container: str, blob: str, offset: int, version: Optional[str]) -> None:
        from fsspec.asyn import sync

        self._sync = sync
        self._loop = fs.loop
        self.url = url
        client = fs.service_client.get_blob_client(container, blob)
        kwargs: dict[str, Any] = {"offset": offset, "max_concurrency": 1}
        if version:
            from azure.core import MatchConditions

            kwargs.update(etag=version, match_condition=MatchConditions.IfNotModified)
        try:
            self._downloader = sync(self._loop, client.download_blob, **kwargs)
        except Exception as exc:
            raise translate(exc, url) from exc
        props = self._downloader.properties
        content_range = getattr(props, "content_range", None)
        if content_range and "/" in content_range:  # "bytes a-b/TOTAL": the whole blob's size
            self.size: Optional[int] = int(content_range.rsplit("/", 1)[1])
        else:
            self.size = props.size + offset if props.size is not None else None
        self.etag = self.version = props.etag
        self._chunks = self._downloader.chunks()
        self._chunk = b""
        self._pos = 0
        self._eof = False
        self.closed = False

    def _next(self) -> bool:
        """Load the next downloaded chunk; False at the end of the blob."""

        async def step():
            try:
                return await self._chunks.__anext__()
            except StopAsyncIteration:
                return None

        try:
            chunk = self._sync(self._loop, step)
        except Exception as exc:
            raise translate(exc, self.url) from exc
        if chunk is None:
            self._eof = True
            return False
        self._chunk, self._pos = chunk, 0
        return True

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            parts = [self._chunk[self._pos :]]
            while self._next():
                parts.append(self._chunk)
            self._chunk, self._pos = b"", 0
            return b"".join(parts)
        if self._pos >= len(self._chunk) and (self._eof or not self._next()):
            return b""
        data = self._chunk[self._pos : self._pos + size]  # may be shorter than size: a chunk boundary
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        if self._pos >= len(self._chunk) and (self._eof or not self._next()):
            return 0
        n = min(len(buffer), len(self._chunk) - self._pos)
        memoryview(buffer).cast("B")[:n] = memoryview(self._chunk)[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self.closed = True
        self._chunks = None


class AzureBackend(FsspecBackend):
    ranged_reads = True
    scheme = "az"
    requires = REQUIRES
    extra = "az"
    translate = staticmethod(translate)

    def make_fs(self) -> Any:
        import adlfs

        return adlfs.AzureBlobFileSystem(skip_instance_cache=True, **self.storage_options)

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
        """A shared-key or SAS credential gives one signed GET streamed with http.client, resumable at
        any byte; other credentials (Azure AD) stream through adlfs's client chunk by chunk."""
        container, _, blob = self.path(url).partition("/")
        signed = self._signed_url(container, blob)
        if signed is None:
            return _ChunkStream(self.fs, url, container, blob, offset, version)
        headers = pinning_headers(version)
        return HTTPReadStream(
            signed,
            offset,
            headers,
            timeout or 60.0,
            display_url=url,
            credentials_hint=CREDENTIALS_HINT,
            error_body=_azure_error,
            length=length,
        )

    def _signed_url(self, container: str, blob: str) -> Optional[str]:
        fs = self.fs
        fields = {}
        if getattr(fs, "connection_string", None):
            fields = dict(part.split("=", 1) for part in fs.connection_string.split(";") if "=" in part)
        name = fields.get("AccountName") or getattr(fs, "account_name", None)
        key = fields.get("AccountKey") or getattr(fs, "account_key", None)
        sas = fields.get("SharedAccessSignature") or getattr(fs, "sas_token", None)
        endpoint = (
            fields.get("BlobEndpoint")
            or getattr(fs, "account_url", None)
            or (f"https://{name}.blob.core.windows.net" if name else None)
        )
        if not endpoint or not (key or sas):
            return None
        base = f"{endpoint.rstrip('/')}/{urllib.parse.quote(container)}/{urllib.parse.quote(blob)}"
        if sas:
            return f"{base}?{sas.lstrip('?')}"
        if not name:  # a key alone cannot sign: the account name is part of the signature
            return None
        from azure.storage.blob import BlobSasPermissions, generate_blob_sas

        expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=2)
        token = generate_blob_sas(
            name, container, blob, account_key=key, permission=BlobSasPermissions(read=True), expiry=expiry
        )
        return f"{base}?{token}"


@hookimpl
def wds_cloud_register_backends(register) -> None:
    register(
        "az", AzureBackend, requires=AzureBackend.requires, extra=AzureBackend.extra, description="Azure Blob Storage"
    )
    register(
        "abfs",
        AzureBackend,
        requires=AzureBackend.requires,
        extra=AzureBackend.extra,
        description="Azure Blob Storage (alias of az)",
    )
