"""The exception tree subclasses the builtins callers already catch, and redacts secrets."""

import pytest

from wds_cloud import errors


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (errors.UnknownSchemeError, ValueError),
        (errors.ShardNotFoundError, FileNotFoundError),
        (errors.MissingExtraError, ImportError),
        (errors.CorruptShardError, ValueError),
        (errors.TransferError, OSError),
        (errors.PipeError, ConnectionError),
        (errors.ObjectChangedError, OSError),
        (errors.SecurityError, PermissionError),
        (errors.CredentialsError, PermissionError),
        (errors.DecodingError, ValueError),
        (errors.PluginConflictError, RuntimeError),
        (errors.ConfigError, ValueError),
    ],
)
def test_builtin_bases(cls, builtin):
    """Every error is both a WdsCloudError and the builtin users catch."""
    assert issubclass(cls, builtin) and issubclass(cls, errors.WdsCloudError)
    assert str(cls("boom", url="s3://b/k")) == "boom"


def test_every_class_is_documented_in_the_tree():
    """The module docstring draws every exception class."""
    for name in errors.__all__:
        if name[0].isupper():
            assert name in errors.__doc__, name


def test_redact_hides_passwords_and_signatures():
    """Passwords in userinfo and signed-URL secrets are replaced."""
    text = errors.redact("https://user:hunter2@host/p?X-Amz-Signature=abc&x=1&sig=zzz")
    assert "hunter2" not in text and "abc" not in text and "zzz" not in text
    assert "user:***@host" in text and "x=1" in text
    assert errors.redact("s3://bucket/key") == "s3://bucket/key"
    err = errors.ShardNotFoundError("gone", url="http://a:secret@h/x")
    assert "secret" not in err.url


def test_connection_errors_name_the_endpoint_really_tried(monkeypatch):
    """A refused connection names the scheme, host and port tried (the endpoint, not the bucket), redacted."""
    import socket

    import pytest

    pytest.importorskip("botocore")
    import wds_cloud as wds
    from wds_cloud.errors import TransferError

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "AKIAPLANTED", "secret": "planted-secret"}
    with pytest.raises(TransferError) as info:
        wds.gopen("s3://my-bucket/x.tar", storage_options=options, retries=1).read()
    message = str(info.value)
    assert f"http://127.0.0.1:{port}" in message and "s3://my-bucket/x.tar" in message
    assert "my-bucket:80" not in message and "AKIAPLANTED" not in message and "planted-secret" not in message
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(TransferError) as info:
        wds.gopen("s3://my-bucket/y.tar", storage_options={"key": "k", "secret": "s"}, retries=1).read()
    assert f"127.0.0.1:{port}" in str(info.value)
