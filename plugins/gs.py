"""The ``gs`` (and ``gcs``) backend: gcsfs for credentials, stat, listing and writes; one streaming GET per shard.

Storage options are gcsfs's (``token`` — ``"anon"``, a service-account file,
or ``"google_default"`` —, ``project``, ``endpoint_url``, ...).  Without options,
gcsfs's defaults apply: ``GOOGLE_APPLICATION_CREDENTIALS``, the gcloud login,
and ``STORAGE_EMULATOR_HOST`` for an emulator.  Reads stream the object's media
URL with the same credentials.
"""

from __future__ import annotations

import os
import threading
from typing import IO, Any, Iterator, Optional

from wds_cloud.backend import Backend, ObjectInfo, fsspec_list, require
from wds_cloud.errors import CredentialsError, ObjectChangedError, ShardNotFoundError, TransferError, redact
from wds_cloud.hookspecs import hookimpl
from wds_cloud.httpstream import AccessDeniedError, HTTPReadStream
from wds_cloud.uploads import FsspecUpload

REQUIRES = ("gcsfs",)
CREDENTIALS_HINT = ("set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, run "
                    "'gcloud auth application-default login', or pass storage_options={'token': ...}; "
                    "for a public bucket pass {'token': 'anon'}")


def translate(exc: BaseException, url: str) -> BaseException:
    if isinstance(exc, (ShardNotFoundError, CredentialsError, TransferError)):
        return exc
    shown = redact(url)
    code = getattr(exc, "code", None)
    if isinstance(exc, FileNotFoundError) or code == 404:
        return ShardNotFoundError(f"{shown}: no such object", url=url)
    if code == 401:
        return CredentialsError(f"{shown}: GCS rejected the credentials; {CREDENTIALS_HINT}", url=url)
    if isinstance(exc, PermissionError) or code == 403:
        return AccessDeniedError(f"{shown}: access denied by GCS; the credentials in use may not access "
                                 "this object", url=url)
    if type(exc).__name__ in ("DefaultCredentialsError", "RefreshError"):
        return CredentialsError(f"{shown}: no usable Google credentials ({exc}); {CREDENTIALS_HINT}", url=url)
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
        return TransferError(f"{shown}: cannot reach GCS ({exc}); check the endpoint and the network",
                             url=url, cause=exc)
    return exc


class GCSBackend(Backend):
    scheme = "gs"
    resumable = True

    def __init__(self, settings, **storage_options: Any) -> None:
        super().__init__(settings, **storage_options)
        self._fs = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    @property
    def fs(self) -> Any:
        require("gs", REQUIRES, "gs")
        if self._pid != os.getpid():
            self._fs, self._pid = None, os.getpid()
        with self._lock:
            if self._fs is None:
                import gcsfs

                self._fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **self.storage_options)
        return self._fs

    @staticmethod
    def _path(url: str) -> str:
        return url.split("://", 1)[1]

    def open_read(self, url: str, offset: int = 0, bufsize: Optional[int] = None, *, version: Optional[str] = None,
                  timeout: Optional[float] = None) -> IO[bytes]:
        fs = self.fs
        headers: dict[str, str] = {}
        try:
            fs.credentials.apply(headers)
        except Exception as exc:
            raise translate(exc, url) from exc
        media = fs.url(self._path(url), generation=version)  # a resumed read asks for the generation first read
        try:
            stream = HTTPReadStream(media, offset, headers, timeout or 60.0, display_url=url,
                                    credentials_hint=CREDENTIALS_HINT)
        except ShardNotFoundError as exc:
            if version:
                raise ObjectChangedError(f"{redact(url)}: generation {version} is gone: the object was replaced "
                                         "while it was being read", url=url) from exc
            raise
        stream.version = stream.headers.get("x-goog-generation") or stream.etag
        return stream

    def stat(self, url: str) -> ObjectInfo:
        try:
            self.fs.invalidate_cache(self._path(url))
            info = self.fs.info(self._path(url))
        except Exception as exc:
            raise translate(exc, url) from exc
        return ObjectInfo(url, info.get("size"), str(info.get("generation") or info.get("etag") or "") or None)

    def list(self, prefix: str) -> Iterator[str]:
        yield from fsspec_list(self.fs, prefix.split("://", 1)[0], prefix, translate)

    def open_write(self, url: str, bufsize: Optional[int] = None) -> IO[bytes]:
        try:
            f = self.fs.open(self._path(url), "wb", block_size=max(bufsize or 0, 8 << 20))
        except Exception as exc:
            raise translate(exc, url) from exc
        return FsspecUpload(f, url, translate)


@hookimpl(trylast=True)
def wds_cloud_register_backends(register) -> None:
    register("gs", GCSBackend, requires=REQUIRES, extra="gs", description="Google Cloud Storage")
    register("gcs", GCSBackend, requires=REQUIRES, extra="gs", description="Google Cloud Storage (alias of gs)")
