"""The ``gs`` (and ``gcs``) backend: gcsfs for credentials, stat, listing and writes; one streaming GET per shard.

Storage options are gcsfs's (``token`` — ``"anon"``, a service-account file,
or ``"google_default"`` —, ``project``, ``endpoint_url``, ...).  Without options,
gcsfs's defaults apply: ``GOOGLE_APPLICATION_CREDENTIALS``, the gcloud login,
and ``STORAGE_EMULATOR_HOST`` for an emulator.  Reads stream the object's media
URL with the same credentials.
"""

from __future__ import annotations

import logging
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
from wds_cloud.io import (
    FsspecBackend,
    HTTPReadStream,
    InStream,
    OutStream,
    exchange,
    hookimpl,
    pinning_headers,
    raise_for_status,
)

log = logging.getLogger(__name__)

REQUIRES = ("gcsfs",)
CREDENTIALS_HINT = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file or run "
    "'gcloud auth application-default login' (in Python: storage_options={'token': ...}); for a public bucket "
    'put token = "anon" in its table of the profiles file (WDS_CLOUD_CONFIG) (in Python: '
    "storage_options={'token': 'anon'})"
)

try:  # google-auth comes with gcsfs; without it no such error can arise
    from google.auth.exceptions import DefaultCredentialsError, RefreshError

    _GOOGLE_CREDENTIAL_ERRORS: tuple = (DefaultCredentialsError, RefreshError)
except ImportError:  # pragma: no cover - the gs extra is not installed
    _GOOGLE_CREDENTIAL_ERRORS = ()


def _credentials_likely() -> bool:
    """Whether Google credentials can be found without asking a metadata server: a key file named by
    GOOGLE_APPLICATION_CREDENTIALS, a gcloud login, or this machine being a Google Cloud VM (read from its DMI
    product name, a local file) whose metadata server gives them.  Read through google-auth's own look-ups."""
    try:
        from google.auth import _default
        from google.auth.compute_engine import _metadata
    except ImportError:  # a google-auth without them: gcsfs decides, as before
        return True
    try:
        if _default._get_explicit_environ_credentials()[0] is not None:
            return True
        if _default._get_gcloud_sdk_credentials()[0] is not None:
            return True
    except Exception:  # a key file that is there but unreadable: gcsfs reads it and says what is wrong
        return True
    return bool(_metadata.detect_gce_residency_linux())


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
        return AccessDeniedError(
            f"{shown}: access denied by GCS; the credentials in use may not access this object", url=url
        )
    if isinstance(exc, _GOOGLE_CREDENTIAL_ERRORS):
        return CredentialsError(f"{shown}: no usable Google credentials ({exc}); {CREDENTIALS_HINT}", url=url)
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
        return TransferError(
            f"{shown}: cannot reach GCS ({exc}); check the endpoint and the network", url=url, cause=exc
        )
    return exc


class GCSBackend(FsspecBackend):
    ranged_reads = True
    scheme = "gs"
    requires = REQUIRES
    extra = "gs"
    translate = staticmethod(translate)

    def make_fs(self) -> Any:
        import gcsfs

        options = dict(self.storage_options)
        if options.get("token") is None and not _credentials_likely():
            # gcsfs would ask the GCE metadata server next, with google-auth's retries and backoff: over a minute
            # where no such server answers (most machines off Google Cloud) before it falls back to anonymous
            # access; here that fallback comes at once, and says how to give credentials
            log.warning(
                "gs://: no Google credentials found; reading anonymously (public buckets only). %s", CREDENTIALS_HINT
            )
            options["token"] = "anon"
        return gcsfs.GCSFileSystem(skip_instance_cache=True, **options)

    def version_of(self, info: dict) -> Optional[str]:
        return str(info.get("generation") or info.get("etag") or "") or None

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
        fs = self.fs
        headers = self._auth_headers(url)
        # a resumed read asks for the generation first read; a version that is no generation (an ETag or a date,
        # from a GCS-compatible server that sends no x-goog-generation) is asked for by the headers that pin it
        generation = version if version and version.isdigit() else None
        if version and generation is None:
            headers.update(pinning_headers(version))
        media = fs.url(self.path(url), generation=generation)
        try:
            stream = HTTPReadStream(
                media,
                offset,
                headers,
                timeout or 60.0,
                display_url=url,
                credentials_hint=CREDENTIALS_HINT,
                length=length,
            )
        except ShardNotFoundError as exc:
            if version:
                raise ObjectChangedError(
                    f"{redact(url)}: generation {version} is gone: the object was replaced while it was being read",
                    url=url,
                ) from exc
            raise
        stream.version = stream.headers.get("x-goog-generation") or stream.version
        return stream

    def _auth_headers(self, url: str) -> dict[str, str]:
        """The request headers that carry gcsfs's credentials (none for anonymous access)."""
        headers: dict[str, str] = {}
        try:
            self.fs.credentials.apply(headers)
        except Exception as exc:
            raise translate(exc, url) from exc
        return headers

    def open_write(self, url: str, bufsize: Optional[int] = None) -> OutStream:
        self._check_credentials(url)
        return super().open_write(url, bufsize)

    def stat(self, url: str) -> Any:
        self._check_credentials(url, once=True)
        return super().stat(url)

    def list(self, prefix: str) -> Any:
        self._check_credentials(prefix, once=True)
        return super().list(prefix)

    def check_access(self, url: str) -> None:
        """One request, no retries: whether GCS answers for the bucket of ``url`` and takes the credentials (what a
        caller of the driver's own listing asks first: gcsfs retries a refused connection for about 90 s)."""
        self._check_credentials(url, once=True)

    def _check_credentials(self, url: str, once: bool = False) -> None:
        """Ask whether the store accepts the credentials for the bucket of ``url`` (``once``: only the first time
        for this bucket, for stat and list; before every write).

        gcsfs retries a 401 six times with growing pauses (about half a minute) before an upload, a stat or
        a listing fails; one request of ours says the same at once.
        """
        fs = self.fs
        bucket = self.path(url).split("/", 1)[0]
        checked = self.__dict__.setdefault("_accepted", set())
        if once and bucket in checked:
            return
        headers = self._auth_headers(url)
        probe = f"{fs._location}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}?fields=name"
        with exchange("GET", probe, headers, timeout=60.0, display_url=url) as response:
            # 401 only: credentials that work for objects may lack the bucket's own read permission (a 403 here),
            # and the operation itself says whether it is allowed
            if response.status == 401:
                raise_for_status(response, url, CREDENTIALS_HINT)
        checked.add(bucket)


@hookimpl
def wds_cloud_register_backends(register) -> None:
    register("gs", GCSBackend, requires=GCSBackend.requires, extra=GCSBackend.extra, description="Google Cloud Storage")
    register(
        "gcs",
        GCSBackend,
        requires=GCSBackend.requires,
        extra=GCSBackend.extra,
        description="Google Cloud Storage (alias of gs)",
    )
