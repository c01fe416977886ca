"""The ``s3`` backend: s3fs for stat, listing and (multipart) writes; one signed GET per shard for reads.

Storage options are s3fs's (``key``, ``secret``, ``token``, ``endpoint_url``,
``profile``, ``anon``, ``client_kwargs``, ``config_kwargs``); the same options
build the botocore client that signs the reads, so both always use the same
credentials.  Without options, the standard AWS environment applies
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3`` for S3-compatible stores, ...).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import Any, Optional

from wds_cloud.errors import (
    AccessDeniedError,
    CredentialsError,
    ObjectChangedError,
    ShardNotFoundError,
    TransferError,
    WdsCloudError,
    redact,
)
from wds_cloud.io import FsspecBackend, HTTPReadStream, InStream, hookimpl, pinning_headers, require

REQUIRES = ("s3fs", "botocore")
CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) (in Python: storage_options={'key': ..., "
    "'secret': ...}); for a public bucket put anon = true in its table of the profiles file (WDS_CLOUD_CONFIG) (in Python: "
    "storage_options={'anon': True})"
)


_XML_CODE = re.compile(r"<Code>([^<]+)</Code>")


#: a bucket name S3 serves as ``https://BUCKET.s3.amazonaws.com`` (no dots: the wildcard certificate fits)
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
#: the regions of the standard AWS partition (amazonaws.com); others (China, GovCloud, ISO) go through botocore
_AWS_REGION = re.compile(r"^(us|eu|ap|sa|ca|me|af|il|mx)-[a-z]+-\d+$")
#: Config settings that only shape botocore's connections, not the URL or the signature
_TRANSPORT_ONLY = {
    "max_pool_connections",
    "connect_timeout",
    "read_timeout",
    "retries",
    "tcp_keepalive",
    "user_agent",
    "user_agent_extra",
    "user_agent_appid",
}
#: the AWS variables (config.AWS_S3_VARS) that only name an endpoint; with any other one set the client signs
_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


class LocalSigner:
    """Presigns S3 GETs without a botocore client, for the common cases.

    Creating a botocore client parses botocore's endpoint and S3 service models (~70-230 ms,
    once per process, so once per DataLoader worker too), which is most of the time to a first
    sample.  A presigned GET needs none of it: the credentials (botocore's own chain, so profiles,
    SSO, roles and refresh work as before), the region, and the URL.  This class makes the URL
    itself where botocore's rule is simple (an endpoint_url: path style; AWS: a DNS-safe bucket
    on ``s3.amazonaws.com``) and signs it with botocore's SigV4 query signer, so the result equals
    the client's URL.  Anything else (accelerate, FIPS, dual-stack, access points, other partitions,
    addressing settings) answers None from :meth:`presign` and the client signs.
    """

    def __init__(self, storage_options: dict, aws_s3: tuple[tuple[str, str], ...] = ()) -> None:
        import botocore.session

        options = storage_options
        env = dict(aws_s3)
        client_kwargs = dict(options.get("client_kwargs") or {})
        config_kwargs = dict(options.get("config_kwargs") or {})
        self.anon = bool(options.get("anon"))
        self.usable = (
            set(config_kwargs) <= _TRANSPORT_ONLY
            and set(client_kwargs)
            <= {"endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
            and set(env) <= set(_ENDPOINT_VARS)
        )
        self.session = botocore.session.Session(profile=options.get("profile"))
        endpoint = (
            options.get("endpoint_url")
            or client_kwargs.get("endpoint_url")
            or env.get("AWS_ENDPOINT_URL_S3")
            or env.get("AWS_ENDPOINT_URL")
        )
        try:
            scoped = self.session.get_scoped_config()
        except Exception:  # a named profile that does not exist: the client says so in its words
            self.usable = False
            scoped = {}
        if any(
            name in scoped
            for name in (
                "s3",
                "services",
                "endpoint_url",
                "use_fips_endpoint",
                "use_dualstack_endpoint",
                "ignore_configured_endpoint_urls",
            )
        ):
            self.usable = False
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.region = client_kwargs.get("region_name") or self.session.get_config_variable("region") or "us-east-1"
        if self.endpoint is None and not _AWS_REGION.match(self.region):
            self.usable = False
        # as the client is built below: client_kwargs first, then s3fs's key/secret/token
        self.key = client_kwargs.get("aws_access_key_id") or options.get("key")
        self.secret = client_kwargs.get("aws_secret_access_key") or options.get("secret")
        self.token = client_kwargs.get("aws_session_token") or options.get("token")
        self._credentials: Any = None

    def url_for(self, bucket: str, key: str) -> Optional[str]:
        """The unsigned URL of the object, or None where botocore's addressing rules are not simple."""
        quoted = urllib.parse.quote(key, safe="/~")
        if self.endpoint is not None:
            return f"{self.endpoint}/{bucket}/{quoted}"
        if _DNS_BUCKET.match(bucket) and "--" not in bucket:  # "--": S3 Express and the like
            return f"https://{bucket}.s3.amazonaws.com/{quoted}"
        return None

    def credentials(self) -> Any:
        if self._credentials is None:
            if self.key and self.secret:
                from botocore.credentials import Credentials

                self._credentials = Credentials(self.key, self.secret, self.token)
            else:
                self._credentials = self.session.get_credentials()
                if self._credentials is None:
                    import botocore.exceptions

                    raise botocore.exceptions.NoCredentialsError()
        return self._credentials

    def presign(self, bucket: str, key: str, expires: int = 3600) -> Optional[str]:
        if not self.usable or bucket.startswith("arn:"):
            return None
        url = self.url_for(bucket, key)
        if url is None or self.anon:
            return url
        from botocore.auth import S3SigV4QueryAuth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method="GET", url=url)
        S3SigV4QueryAuth(self.credentials().get_frozen_credentials(), "s3", self.region, expires=expires).add_auth(
            request
        )
        return request.url


def split(url: str) -> tuple[str, str]:
    rest = url.split("://", 1)[1] if "://" in url else url.split(":", 1)[1].lstrip("/")
    bucket, _, key = rest.partition("/")
    return bucket, key


_REJECTED = "S3 rejected the credentials ({code}); " + CREDENTIALS_HINT

#: S3 error code -> (the wds_cloud error, what happened): one table for the XML error bodies of our own
#: reads and for botocore's ClientError (stat, list, write)
_CODES: dict[str, tuple[type[WdsCloudError], str]] = {
    "NoSuchKey": (ShardNotFoundError, "no such object"),
    "NotFound": (ShardNotFoundError, "no such object"),
    "404": (ShardNotFoundError, "no such object"),
    "NoSuchBucket": (ShardNotFoundError, "the bucket {bucket!r} does not exist"),
    "InvalidAccessKeyId": (CredentialsError, _REJECTED),
    "SignatureDoesNotMatch": (CredentialsError, _REJECTED),
    "InvalidToken": (CredentialsError, _REJECTED),
    "ExpiredToken": (CredentialsError, _REJECTED),
    "AccessDenied": (AccessDeniedError, "access denied by S3; the credentials in use may not access this object"),
    # a HEAD answer has no body: a wrong key and a key without the permission look the same
    "403": (
        AccessDeniedError,
        "access denied by S3 (HTTP 403): the credentials in use are wrong, or may not "
        "access this object; " + CREDENTIALS_HINT,
    ),
    # a HEAD answer has no body: a 400 there is, in practice, a session token S3 cannot read or has expired
    "400": (
        CredentialsError,
        "S3 answered HTTP 400 (Bad Request) with no detail, as it does when the session "
        "token (AWS_SESSION_TOKEN, storage_options token) is malformed or expired; " + CREDENTIALS_HINT,
    ),
    "PreconditionFailed": (ObjectChangedError, "the object changed while it was being read"),
    "SlowDown": (TransferError, "S3 answered {code} (HTTP {status}); it will be retried"),
    "ServiceUnavailable": (TransferError, "S3 answered {code} (HTTP {status}); it will be retried"),
    "InternalError": (TransferError, "S3 answered {code} (HTTP {status}); it will be retried"),
    "RequestTimeout": (TransferError, "S3 answered {code} (HTTP {status}); it will be retried"),
}


_FIELD = re.compile(r"\{(code|status|bucket)(!r)?\}")


def _fill(template: str, **values: object) -> str:
    """``template`` with its ``{code}``, ``{status}`` and ``{bucket}`` (``!r``: quoted) filled in one pass;
    every other brace is text (the credentials hint shows ``{'key': ...}``; ``str.format`` read that as a
    field and raised ``KeyError`` on a wrong key)."""

    def one(m: re.Match) -> str:
        value = values[m.group(1)]
        return repr(value) if m.group(2) else str(value)

    return _FIELD.sub(one, template)


def _from_code(code: str, status: Optional[int], url: str) -> Optional[BaseException]:
    """The wds_cloud error for an S3 error code (None: the code is not in the table)."""
    entry = _CODES.get(code)
    if entry is None:
        return None
    cls, what = entry
    message = f"{redact(url)}: " + _fill(what, code=code, status=status, bucket=split(url)[0])
    if cls is TransferError:  # retried: a throttling code counts as the 503 it stands for
        return TransferError(message, url=url, status=status if status and status >= 500 else 503)
    return cls(message, url=url)


def _s3_error(status: int, body: str, url: str) -> Optional[BaseException]:
    """An S3 XML error body as the matching wds_cloud error (None: use the generic mapping)."""
    match = _XML_CODE.search(body)
    return _from_code(match.group(1), status, url) if match else None


def translate(exc: BaseException, url: str) -> BaseException:
    """botocore/s3fs errors as wds_cloud errors that say what to do."""
    if isinstance(exc, WdsCloudError):  # ours already (a MissingExtraError among them): as it is
        return exc
    try:
        import botocore.exceptions as bex
    except ImportError:  # without botocore no botocore error can have been raised
        return exc
    shown = redact(url)
    if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
        return CredentialsError(f"{shown}: no AWS credentials were found; {CREDENTIALS_HINT}", url=url)
    if isinstance(
        exc, (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ReadTimeoutError, bex.ConnectionClosedError)
    ):
        return TransferError(
            f"{shown}: cannot connect to the S3 endpoint ({exc}); check that it is running "
            "and that endpoint_url / AWS_ENDPOINT_URL is right",
            url=url,
            cause=exc,
        )
    if isinstance(exc, bex.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code not in _CODES and (status == 403 or (status == 400 and code in ("", "400", "Bad Request"))):
            code = str(status)  # a bodyless answer (HEAD): the status is all S3 said
        known = _from_code(code, status, url)
        if known is not None:
            return known
        return TransferError(f"{shown}: S3 error {code or status}: {exc}", url=url, status=status)
    # s3fs turns S3's answers into OSErrors (PermissionError("Access Denied") for every 403, EINVAL for a
    # rejected session token, ...); S3's own code, kept as the cause, tells what happened and the fix
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, OSError) and isinstance(cause, bex.ClientError):
        return translate(cause, url)
    if isinstance(exc, FileNotFoundError):
        return ShardNotFoundError(f"{shown}: no such object", url=url)
    if isinstance(exc, PermissionError):
        return AccessDeniedError(f"{shown}: access denied by S3 ({exc})", url=url)
    return exc


class S3Backend(FsspecBackend):
    ranged_reads = True
    scheme = "s3"
    requires = REQUIRES
    extra = "s3"
    translate = staticmethod(translate)

    def __init__(self, settings, **storage_options: Any) -> None:
        super().__init__(settings, **storage_options)
        self._client = None
        self._client_pid = os.getpid()
        self._signer: Optional[LocalSigner] = None

    def make_fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def version_of(self, info: dict) -> Optional[str]:
        return info.get("VersionId") or info.get("ETag")

    @property
    def client(self) -> Any:
        require(self.scheme, self.requires, self.extra)
        with self._lock:
            if self._client is None or self._client_pid != os.getpid():  # never across a fork
                self._client, self._client_pid = self._make_client(), os.getpid()
        return self._client

    @property
    def signer(self) -> LocalSigner:
        require(self.scheme, self.requires, self.extra)
        with self._lock:
            if self._signer is None:  # no connection inside: safe to keep across a fork
                self._signer = LocalSigner(self.storage_options, self.settings.aws_s3 if self.settings else ())
        return self._signer

    def presign(self, bucket: str, key: str) -> str:
        """A GET URL for the object, valid an hour: signed here where that is simple, else by the client."""
        signed = self.signer.presign(bucket, key)
        if signed is None:
            signed = self.client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600
            )
        return signed

    def _make_client(self) -> Any:
        # botocore (which s3fs brings through aiobotocore) builds the client; boto3 is not needed.
        import botocore
        import botocore.session
        from botocore.config import Config

        options = dict(self.storage_options)
        client_kwargs = dict(options.get("client_kwargs") or {})
        config_kwargs = dict(options.get("config_kwargs") or {})
        config_kwargs.setdefault("max_pool_connections", 32)
        if options.get("anon"):
            config_kwargs["signature_version"] = botocore.UNSIGNED
        session = botocore.session.Session(profile=options.get("profile"))
        if options.get("endpoint_url"):
            client_kwargs.setdefault("endpoint_url", options["endpoint_url"])
        for ours, theirs in (
            ("key", "aws_access_key_id"),
            ("secret", "aws_secret_access_key"),
            ("token", "aws_session_token"),
        ):
            if options.get(ours):
                client_kwargs.setdefault(theirs, options[ours])
        return session.create_client("s3", config=Config(**config_kwargs), **client_kwargs)

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
        """One GET for the whole shard (or the range asked for), presigned and streamed with http.client.

        The signed URL is made locally (no request) and read straight from the
        socket, without botocore's and urllib3's per-read overhead; it never
        appears in messages (they name the s3:// URL).
        """
        bucket, key = split(url)
        headers = pinning_headers(version)
        try:
            signed = self.presign(bucket, key)
            stream = HTTPReadStream(
                signed,
                offset,
                headers,
                timeout or 60.0,
                display_url=url,
                credentials_hint=CREDENTIALS_HINT,
                error_body=_s3_error,
                length=length,
            )
        except Exception as exc:
            raise translate(exc, url) from exc
        # A single-part upload's ETag is the MD5 of the object (not with SSE-KMS or SSE-C).
        etag = (stream.etag or "").strip('"')
        if (
            len(etag) == 32
            and all(c in "0123456789abcdef" for c in etag.lower())
            and stream.headers.get("x-amz-server-side-encryption") != "aws:kms"
            and not stream.headers.get("x-amz-server-side-encryption-customer-algorithm")
        ):
            stream.md5 = etag.lower()
        return stream


@hookimpl
def wds_cloud_register_backends(register) -> None:
    register(
        "s3",
        S3Backend,
        requires=S3Backend.requires,
        extra=S3Backend.extra,
        description="Amazon S3 and S3-compatible stores",
    )
