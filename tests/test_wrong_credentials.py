"""Wrong credentials on every backend, against servers that check them: a CredentialsError (a
PermissionError) that names the fix, at once (never retried six times), with no secret in the message, on
read, write, stat, list and index.

Azure: Azurite checks the shared key and SAS signatures.  S3: moto with IAM checks on (see
test_s3_credentials.py) for write, stat and list; reads are presigned GETs, which moto with checks on
answers with a 500 of its own (a KeyError on the missing Authorization header, whatever the key), so
reads and indexing go to an S3-shaped loopback server that answers as S3 does.  GCS and HTTP: loopback
servers that refuse the token they are given.
"""

import http.server
import threading

import pytest

import wds_cloud as wds
from wds_cloud.errors import CredentialsError
from wds_cloud.index import index_of
from wds_cloud.io.open import exists, open_backend

from .cloud import HTTP_TOKEN

ACTIONS = ["read", "write", "stat", "list", "index"]
SECRET = "c2VjcmV0LXRoYXQtbXVzdC1uZXZlci1zaG93LXVw"  # base64, so that Azure's SDK takes it as a key


def attempt(action, url, options, folder):
    if action == "read":
        with wds.gopen(url, "rb", storage_options=options) as stream:
            stream.read()
    elif action == "write":
        with wds.gopen(folder + "new.tar", "wb", storage_options=options) as out:
            out.write(b"data")
    elif action == "stat":
        exists(url, storage_options=options)
    elif action == "list":
        list(open_backend(folder, storage_options=options).list(folder))
    else:
        index_of(url, storage_options=options)


def check(info, *names):
    error = info.value
    assert isinstance(error, CredentialsError) and isinstance(error, PermissionError), repr(error)
    text = str(error)
    assert SECRET not in text and SECRET not in repr(error.__dict__)
    assert any(name in text for name in names), text


# Azure (Azurite)
@pytest.fixture
def az_blob(az_container):
    container, options = az_container
    with wds.gopen(f"az://{container}/a.tar", "wb", storage_options=options) as out:
        out.write(b"x" * 2048)
    return container, options


@pytest.mark.parametrize("action", ACTIONS)
def test_azure_a_wrong_account_key(az_blob, action):
    container, options = az_blob
    wrong = {
        "connection_string": options["connection_string"].replace(
            options["connection_string"].split("AccountKey=")[1].split(";")[0], SECRET
        )
    }
    with pytest.raises(CredentialsError) as info:
        attempt(action, f"az://{container}/a.tar", wrong, f"az://{container}/")
    check(info, "AZURE_STORAGE_CONNECTION_STRING", "account_key", "credential")


@pytest.mark.parametrize("action", ACTIONS)
def test_azure_an_expired_sas_token(az_blob, azurite_endpoint, action):
    import datetime

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    container, options = az_blob
    endpoint, connection = azurite_endpoint
    key = connection.split("AccountKey=")[1].split(";")[0]
    sas = generate_container_sas(
        "devstoreaccount1",
        container,
        account_key=key,
        permission=ContainerSasPermissions(read=True, write=True, list=True),
        expiry=datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc),
    )
    expired = {"account_url": endpoint, "sas_token": sas}
    with pytest.raises(CredentialsError) as info:
        attempt(action, f"az://{container}/a.tar", expired, f"az://{container}/")
    check(info, "AZURE_STORAGE_CONNECTION_STRING", "sas_token", "credential")


# GCS and HTTP: servers that refuse the token they are given
class Refusing(http.server.BaseHTTPRequestHandler):
    """Answers every request as a store refusing its credentials: ``status`` with ``body``."""

    protocol_version = "HTTP/1.1"
    status, body, content_type = 401, b"", "application/json"

    def log_message(self, *args):
        pass

    def _refuse(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.seen.append((self.command, self.path))
        self.send_response(self.status)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(self.body)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _refuse


@pytest.fixture
def refusing():
    made = []

    def start(status, body=b"", content_type="application/json"):
        handler = type("Handler", (Refusing,), {"status": status, "body": body, "content_type": content_type})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        server.seen = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append(server)
        return server

    yield start
    for server in made:
        server.shutdown()
        server.server_close()


GCS_401 = b'{"error": {"code": 401, "message": "Invalid Credentials", "errors": [{"reason": "authError"}]}}'


@pytest.mark.parametrize("action", ACTIONS)
def test_gcs_a_rejected_token(refusing, action):
    pytest.importorskip("gcsfs")
    server = refusing(401, GCS_401)
    options = {"endpoint_url": f"http://127.0.0.1:{server.server_port}", "token": "anon"}
    with pytest.raises(CredentialsError) as info:
        attempt(action, "gs://bucket/a.tar", options, "gs://bucket/")
    check(info, "GOOGLE_APPLICATION_CREDENTIALS", "token")
    assert len(server.seen) <= 2  # at once: a refusal is not retried


@pytest.mark.parametrize("action", ACTIONS)
def test_http_a_wrong_bearer_token(http_store, action):
    server, store = http_store
    store.put("/cred/a.tar", b"x" * 2048)
    options = {"headers": {"Authorization": f"Bearer {SECRET}"}}
    if action == "list":
        pytest.skip("HTTP has no listing")
    with pytest.raises(CredentialsError) as info:
        attempt(action, f"{server.url}/cred/a.tar", options, f"{server.url}/cred/")
    check(info, "headers", "Authorization")
    assert HTTP_TOKEN not in str(info.value)


S3_ERRORS = {
    "InvalidAccessKeyId": b"The AWS Access Key Id you provided does not exist in our records.",
    "SignatureDoesNotMatch": b"The request signature we calculated does not match the signature you provided.",
    "ExpiredToken": b"The provided token has expired.",
}


@pytest.mark.parametrize("code", sorted(S3_ERRORS))
@pytest.mark.parametrize("action", ["read", "index"])
def test_s3_reads_refused_as_s3_refuses_them(refusing, monkeypatch, action, code):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    body = (
        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>'
        + code.encode()
        + b"</Code><Message>"
        + S3_ERRORS[code]
        + b"</Message></Error>"
    )
    server = refusing(403, body, "application/xml")
    options = {
        "key": "AKIAEXAMPLEKEY000000",
        "secret": SECRET,
        "token": SECRET,
        "endpoint_url": f"http://127.0.0.1:{server.server_port}",
    }
    with pytest.raises(CredentialsError) as info:
        attempt(action, "s3://bucket/a.tar", options, "s3://bucket/")
    check(info, "AWS_ACCESS_KEY_ID")
    assert code in str(info.value)
    assert len(server.seen) <= 2
