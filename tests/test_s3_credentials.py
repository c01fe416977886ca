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
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc, "moto")
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket="locked")
        client.put_object(Bucket="locked", Key="a.tar", Body=b"x" * 1024)
        iam = boto3.client(
            "iam",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        iam.create_user(UserName="trainer")
        iam.put_user_policy(
            UserName="trainer",
            PolicyName="everything",
            PolicyDocument=(
                '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}'
            ),
        )
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        request = urllib.request.Request(
            f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )
        urllib.request.urlopen(request, timeout=30).read()  # from now on every request is authenticated
        yield endpoint, {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    finally:
        stop(proc)


def wrong(good, kind):
    """Credentials that S3 refuses: a key id it does not know, a known key with a wrong secret, or a known key
    with a session token that is not one."""
    if kind == "unknown key id":
        return {"key": "AKIAWRONGKEYID000000", "secret": "wrong-secret-value-42"}
    if kind == "wrong secret":
        return dict(good, secret="wrong-secret-value-42")
    return dict(good, token="expired-session-token-value-42")


# Reads are presigned GETs; moto with checks on answers every presigned GET with a 500 of its own (a KeyError
# on the missing Authorization header, whatever the key), so reads are tested in test_wrong_credentials.py
# against a loopback server answering as S3 does.
@pytest.mark.parametrize("kind", ["unknown key id", "wrong secret", "expired token"])
@pytest.mark.parametrize("action", ["write", "stat", "list", "good"])
def test_refused_credentials_are_a_credentials_error_naming_the_fix(checking_moto, action, kind, monkeypatch):
    endpoint, good = checking_moto
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    if action == "good":  # the same server takes the right ones: the refusals below are about the credentials
        assert exists("s3://locked/a.tar", storage_options=dict(good, endpoint_url=endpoint))
        return
    options = dict(wrong(good, kind), endpoint_url=endpoint)
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
    assert "AWS_ACCESS_KEY_ID" in text and "wrong-secret-value-42" not in text and "expired-session" not in text
    if kind == "expired token" and action == "stat":
        assert "session token" in text  # a HEAD answer has no body: the 400 says what it most likely is


def test_every_s3_error_code_formats_its_message():
    """Every entry of the S3 error table builds its message (the hint's braces are text, not fields): an
    InvalidAccessKeyId answer to a read gave KeyError "'key'" before."""
    from wds_cloud_plugins import s3

    for code, (cls, _) in s3._CODES.items():
        error = s3._from_code(code, 403, "s3://bkt/key.tar")
        assert isinstance(error, cls) and "s3://bkt/key.tar" in str(error), code
        assert "{code}" not in str(error) and "{bucket" not in str(error)
