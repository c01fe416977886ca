"""Parallel parts over HTTPS reuse kept connections: a part does not pay a TLS handshake of its own.

The server is our Range-capable object server behind TLS, with a throwaway certificate made here for
127.0.0.1; the client trusts it through ``SSL_CERT_FILE``.  Handshakes are counted by the server (one
per accepted connection), GETs by its request log: counters, not timings.
"""

import datetime
import ipaddress
import ssl

import pytest

import wds_cloud as wds
from wds_cloud.io.keepalive import POOL
from wds_cloud.testing.objects import HTTPObjectHandler, Server, Store


def throwaway_certificate(folder):
    """A self-signed certificate and key for 127.0.0.1 (PEM files), valid for a day."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


@pytest.fixture
def https_store(tmp_path, monkeypatch):
    cert, key = throwaway_certificate(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", cert)
    store = Store()
    handshakes = []

    class Handler(HTTPObjectHandler):
        def setup(self):
            handshakes.append(self.client_address)
            super().setup()

    Handler.store = store
    server = Server(Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.httpd.socket = context.wrap_socket(server.httpd.socket, server_side=True)
    server.url = server.url.replace("http://", "https://")
    POOL.clear()
    yield server, store, handshakes
    server.stop()


def test_parts_over_https_reuse_kept_connections(https_store, tmp_path, monkeypatch):
    server, store, handshakes = https_store
    for s in range(3):
        with wds.TarWriter(str(tmp_path / f"s-{s}.tar")) as w:
            for i in range(40):
                w.write({"__key__": f"{s}-{i:02d}", "bin": bytes(30_000)})
    store.put_directory(str(tmp_path))
    ds = wds.WebDataset(server.url + "/s-{0..2}.tar", shardshuffle=False, part_size="128KiB", concurrency=4)
    assert len(list(ds)) == 120
    gets = [r for r in store.requests if r[0] == "GET"]
    assert len(gets) == ds.stats.requests and len(gets) >= 20  # many parts...
    assert len(handshakes) <= 4 + 1  # ...over as many TLS connections as parts in flight (and the prefetch)
    # the control: with no connection kept, every part pays its handshake (the counter counts them)
    POOL.clear()
    monkeypatch.setattr(POOL, "give", lambda key, conn: conn.close())
    before, asked = len(handshakes), len(store.requests)
    again = wds.WebDataset(server.url + "/s-{0..2}.tar", shardshuffle=False, part_size="128KiB", concurrency=4)
    assert len(list(again)) == 120
    assert len(handshakes) - before == len([r for r in store.requests[asked:] if r[0] == "GET"])
