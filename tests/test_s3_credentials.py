"""Wrong S3 credentials, against a moto server that checks them: a CredentialsError naming the fix, never a
KeyError from formatting the hint, never the secret."""

import subprocess
import sys
import urllib.request

import pytest

import wds_cloud as wds
from wds_cloud.errors import CredentialsError, WdsCloudError
from wds_cloud.io.open import exists, open_backend

from .cloud import free_port, stop, wait_for_port

pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def checking_moto():
    """A moto server of its own (a child process: its auth switch is global to the process), with a bucket
    and an object made before authentication is turned on."""
    import boto3

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc, "moto")
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        client.create_bucket(Bucket="locked")
        client.put_object(Bucket="locked", Key="a.tar", Body=b"x" * 1024)
        request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=30).read()  # from now on every request is authenticated
        yield endpoint
    finally:
        stop(proc)


WRONG = {"key": "AKIAWRONGKEYID000000", "secret": "wrong-secret-value-42"}


# Reads are presigned GETs; moto answers a presigned GET with an unknown key with a 500 (its own bug: S3
# answers 403 InvalidAccessKeyId, which the error table covers, tested below), so reads are left out here.
@pytest.mark.parametrize("action", ["write", "stat", "list"])
def test_an_unknown_key_is_a_credentials_error_naming_the_fix(checking_moto, action, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    options = dict(WRONG, endpoint_url=checking_moto)
    with pytest.raises(WdsCloudError) as info:
        if action == "write":
            with wds.gopen("s3://locked/b.tar", "wb", storage_options=options) as out:
                out.write(b"data")
        elif action == "stat":
            exists("s3://locked/a.tar", storage_options=options)
        else:
            list(open_backend("s3://locked/", storage_options=options).list("s3://locked/"))
    assert isinstance(info.value, CredentialsError), repr(info.value)
    text = str(info.value)
    assert "AWS_ACCESS_KEY_ID" in text and WRONG["secret"] not in text


def test_every_s3_error_code_formats_its_message():
    """Every entry of the S3 error table builds its message (the hint's braces are text, not fields): an
    InvalidAccessKeyId answer to a read gave KeyError "'key'" before."""
    from wds_cloud_plugins import s3

    for code, (cls, _) in s3._CODES.items():
        error = s3._from_code(code, 403, "s3://bkt/key.tar")
        assert isinstance(error, cls) and "s3://bkt/key.tar" in str(error), code
        assert "{code}" not in str(error) and "{bucket" not in str(error)
