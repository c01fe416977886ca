"""The ``ais`` backend: AIStore's HTTP API at ``AIS_ENDPOINT``, and proxying of cloud schemes.

``ais://bucket/object`` is read with ``GET /v1/objects/bucket/object`` on the
gateway, which redirects to the target holding the object.  With
``USE_AIS_FOR=gs:s3:az``, ``gs://``, ``s3://`` and ``az://`` URLs are read the
same way with ``provider=gcp|aws|azure``: AIStore fetches the object from the
cloud and caches it.  ``AIS_AUTHN_TOKEN`` is sent as a bearer token.  Only the
standard library is needed.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Optional

from wds_cloud.errors import ConfigError, TransferError, redact
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
)

PROVIDERS = {"ais": "ais", "s3": "aws", "gs": "gcp", "gcs": "gcp", "az": "azure", "abfs": "azure"}
HINT = "set AIS_AUTHN_TOKEN to a valid AIStore token"


class AISBackend(Backend):
    scheme = "ais"
    resumable = True
    ranged_reads = True

    def _endpoint(self, url: str) -> str:
        endpoint = self.storage_options.get("endpoint") or self.settings.ais_endpoint
        if not endpoint:
            raise ConfigError(
                f"{redact(url)}: no AIStore gateway is configured; set AIS_ENDPOINT, "
                "e.g. AIS_ENDPOINT=http://ais-gateway:51080",
                url=url,
            )
        return str(endpoint).rstrip("/")

    def _headers(self) -> dict:
        token = self.storage_options.get("token") or self.settings.ais_token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _object_url(self, url: str) -> str:
        scheme, rest = url.split("://", 1)
        provider = PROVIDERS.get(scheme)
        if provider is None:
            raise ConfigError(f"{redact(url)}: AIStore cannot proxy the scheme {scheme!r}")
        bucket, _, name = rest.partition("/")
        if not bucket or not name:
            raise ConfigError(f"{redact(url)}: expected {scheme}://BUCKET/OBJECT")
        return (
            f"{self._endpoint(url)}/v1/objects/{urllib.parse.quote(bucket)}/{urllib.parse.quote(name)}"
            f"?provider={provider}"
        )

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
        headers = self._headers()
        headers.update(pinning_headers(version))
        # the gateway sends the read on to a target, which needs the token too
        return HTTPReadStream(
            self._object_url(url),
            offset,
            headers,
            timeout or 60.0,
            display_url=url,
            credentials_hint=HINT,
            length=length,
            trust_redirects=True,
        )

    def stat(self, url: str) -> ObjectInfo:
        with exchange(
            "HEAD", self._object_url(url), self._headers(), display_url=url, trust_redirects=True
        ) as response:
            raise_for_status(response, url, HINT)
            length = response.getheader("Content-Length")
            version = response.getheader("ETag") or response.getheader("Ais-Version")
            return ObjectInfo(url, int(length) if length is not None else None, version)

    def list(self, prefix: str) -> Iterator[str]:
        scheme, rest = prefix.split("://", 1)
        bucket, _, name_prefix = rest.partition("/")
        token = ""
        while True:
            body = json.dumps({"action": "list", "value": {"prefix": name_prefix, "continuation_token": token}})
            url = f"{self._endpoint(prefix)}/v1/buckets/{urllib.parse.quote(bucket)}?provider={PROVIDERS[scheme]}"
            headers = dict(self._headers(), **{"Content-Type": "application/json"})
            with exchange("GET", url, headers, body=body.encode(), display_url=prefix) as response:
                raise_for_status(response, prefix, HINT)
                page = json.loads(response.read() or b"{}")
            for entry in sorted(page.get("entries") or [], key=lambda e: e["name"]):
                yield f"{scheme}://{bucket}/{entry['name']}"
            token = page.get("continuation_token") or ""
            if not token:
                return

    def open_write(self, url: str, bufsize: Optional[int] = None) -> OutStream:
        target = self._object_url(url)

        def send(body, size: int) -> None:
            # The gateway redirects a PUT to a target: ask where first, then send the body there once.
            with exchange(
                "PUT", target, dict(self._headers(), **{"Content-Length": "0"}), follow_redirects=False, display_url=url
            ) as response:
                location = response.getheader("Location")
                if response.status not in (301, 302, 307, 308) or not location:
                    raise_for_status(response, url, HINT)
                    raise TransferError(f"{redact(url)}: the AIStore gateway did not redirect the upload", url=url)
            headers = dict(self._headers(), **{"Content-Length": str(size)})
            with exchange("PUT", location, headers, body=body, display_url=url, trust_redirects=True) as response:
                raise_for_status(response, url, HINT)

        return SpooledPut(url, send)


def proxied_schemes(settings) -> frozenset:
    """The schemes ``USE_AIS_FOR`` sends through the gateway (``gs`` brings ``gcs``, ``az`` brings ``abfs``)."""
    named = settings.use_ais_for
    unknown = [s for s in named if s not in PROVIDERS]
    if unknown:
        raise ConfigError(
            f"USE_AIS_FOR={':'.join(named)!r} names {unknown}: list schemes AIStore can proxy, "
            f"separated by ':' ({':'.join(sorted(set(PROVIDERS) - {'ais'}))})"
        )
    out = set(named)
    out |= {"gcs"} if "gs" in out else set()
    out |= {"abfs"} if "az" in out else set()
    return frozenset(out)


@hookimpl
def wds_cloud_route_url(url: str, scheme: str, settings) -> Optional[str]:
    """``USE_AIS_FOR``: read the named cloud schemes through the AIStore gateway."""
    if settings.use_ais_for and scheme != "ais" and scheme in proxied_schemes(settings):
        return "ais"
    return None


@hookimpl
def wds_cloud_register_backends(register) -> None:
    register("ais", AISBackend, description="AIStore (AIS_ENDPOINT), and USE_AIS_FOR proxying")
