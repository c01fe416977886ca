"""The exception tree subclasses the builtins callers already catch, and redacts secrets."""

import errno
import os
import pickle

import pytest

import wds_cloud as wds
from wds_cloud import errors

from .servers import http_server


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


OS_ERRNOS = [
    (errors.ShardNotFoundError, errno.ENOENT),
    (errors.SecurityError, errno.EACCES),
    (errors.CredentialsError, errno.EACCES),
    (errors.AccessDeniedError, errno.EACCES),
    (errors.TransferError, errno.EIO),
    (errors.PipeError, errno.EIO),
    (errors.ObjectChangedError, getattr(errno, "ESTALE", errno.EIO)),
]


@pytest.mark.parametrize("cls, code", OS_ERRNOS)
def test_os_errors_carry_errno_and_the_redacted_filename(cls, code):
    """Every error that is an OSError has the errno its builtin would have and the redacted URL as filename;
    str() stays the message; both survive pickling (a DataLoader worker's error)."""
    url = "https://user:hunter2@host/shard-0.tar?X-Amz-Signature=abc&part=1"
    exc = cls("shard-0.tar: the message", url=url)
    assert exc.errno == code and exc.strerror == os.strerror(code)
    assert exc.filename == errors.redact(url) and "hunter2" not in exc.filename and "abc" not in exc.filename
    assert str(exc) == "shard-0.tar: the message" and exc.args == ("shard-0.tar: the message",)
    back = pickle.loads(pickle.dumps(exc))
    assert (type(back), str(back), back.errno, back.filename, back.url) == (cls, str(exc), code, exc.filename, exc.url)
    assert cls("no url").filename is None and cls("no url").errno == code
    given = cls("m", url=url, errno=errno.EISDIR, filename="/p?token=s")
    assert given.errno == errno.EISDIR and given.filename == "/p?token=***"
    exc.args = exc.args + ("appended by a handler",)
    assert pickle.loads(pickle.dumps(exc)).args == exc.args


def test_every_os_error_is_given_an_errno():
    """No class of the tree that is an OSError is left without its errno (a new one must be added above)."""
    classes = {getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert {c for c in classes if issubclass(c, OSError)} == {c for c, _ in OS_ERRNOS}


def test_a_missing_shard_is_enoent_with_its_path(tmp_path):
    """A missing shard read through a pipeline raises an OSError with errno ENOENT and the path as filename, as
    webdataset 1.0.2's FileNotFoundError; a missing URL with a credential names it redacted."""
    path = str(tmp_path / "nope.tar")
    with pytest.raises(OSError) as info:
        list(wds.DataPipeline(wds.SimpleShardList([path]), wds.tarfile_to_samples()))
    assert info.value.errno == errno.ENOENT and info.value.filename == path
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(OSError) as info:
        list(wds.WebDataset(f"file://{path}?token=s3cret", shardshuffle=False, empty_check=False))
    assert info.value.errno == errno.ENOENT and info.value.filename and "s3cret" not in info.value.filename


def test_a_missing_object_over_http_is_enoent():
    """A 404 from an HTTP store is ENOENT with the redacted URL, as a missing file is."""
    server, _store = http_server()
    try:
        url = f"{server.url}/missing.tar?sig=s3cret"
        with pytest.raises(OSError) as info:
            list(wds.WebDataset(url, shardshuffle=False, empty_check=False))
    finally:
        server.stop()
    assert info.value.errno == errno.ENOENT and "missing.tar" in info.value.filename
    assert "s3cret" not in info.value.filename


def test_a_folder_named_as_a_shard_says_how_to_read_its_shards(tmp_path):
    """WebDataset("folder") (no slash) names the ways to read the shards in it: ls's brace spec, a list, and what
    the slash would do (webdataset's work queue)."""
    (tmp_path / "fold").mkdir()
    with pytest.raises(errors.ShardNotFoundError, match=r"is a directory.*wds-cloud ls .*fold/.*work queue"):
        list(wds.WebDataset(str(tmp_path / "fold"), shardshuffle=False))
