"""gopen on local files, stdin/stdout, the gopen_schemes shim, rewriting and unknown schemes."""

import io
import os
import subprocess
import sys

import pytest

from wds_cloud import gopen, gopen_schemes
from wds_cloud.errors import SecurityError, ShardNotFoundError, UnknownSchemeError


@pytest.mark.parametrize("name", ["plain.tar", "with space.tar", "hash#tag.tar", "what?.tar", "a b#c?d.tar"])
def test_local_paths_are_verbatim(tmp_path, name):
    """Bare paths and file: URLs with spaces, # and ? open the file of that exact name."""
    path = tmp_path / name
    path.write_bytes(b"0123456789")
    with gopen(str(path)) as f:
        assert f.read() == b"0123456789"
    with gopen(f"file://{path}", offset=4) as f:
        assert f.read() == b"456789"
    with gopen(f"file:{path}") as f:
        assert f.read(3) == b"012"
    with gopen(path) as f:  # os.PathLike
        assert f.read(1) == b"0"


def test_write_is_atomic(tmp_path):
    """A local write appears under its name only on close; an exception leaves nothing behind."""
    target = tmp_path / "sub" / "out.tar"
    with gopen(str(target), "wb") as f:
        f.write(b"abc")
        assert not target.exists()
    assert target.read_bytes() == b"abc"
    with pytest.raises(RuntimeError):
        with gopen(str(tmp_path / "bad.tar"), "wb") as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["sub"]


def test_missing_file_names_the_path(tmp_path):
    """A missing shard raises ShardNotFoundError (a FileNotFoundError) naming it."""
    with pytest.raises(FileNotFoundError, match="nope.tar") as info:
        gopen(str(tmp_path / "nope.tar"))
    assert isinstance(info.value, ShardNotFoundError)


def test_dash_reads_stdin_and_writes_stdout(tmp_path):
    """'-' is stdin for reading and stdout for writing."""
    code = "import wds_cloud,sys;d=wds_cloud.gopen('-').read();o=wds_cloud.gopen('-','wb');o.write(d[::-1]);o.close()"
    out = subprocess.run([sys.executable, "-c", code], input=b"abc", capture_output=True, check=True)
    assert out.stdout == b"cba"


def test_unknown_scheme_lists_known_ones_and_extras():
    """An unknown scheme names the URL, the known schemes, and the extra for known cloud schemes."""
    with pytest.raises(UnknownSchemeError) as info:
        gopen("foo://bucket/x.tar")
    message = str(info.value)
    assert "foo://bucket/x.tar" in message and "file:" in message and "pipe:" in message
    assert isinstance(info.value, ValueError)
    assert "s3:" in message and "ais:" in message


def test_unknown_scheme_names_the_extras_of_unready_schemes(monkeypatch):
    """Where a known scheme's extra is missing, the unknown-scheme message gives its pip install line."""
    import sys

    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(
        UnknownSchemeError,
        match=r"s3: \(needs pip install 'wds_cloud\[s3\]' \(in a clone: pip install -e '\.\[s3\]'\)\)",
    ):
        gopen("foo://bucket/x.tar")


def test_bad_mode():
    """Only binary read and write modes exist."""
    with pytest.raises(ValueError, match="'rb' or 'wb'"):
        gopen("x.tar", "a")


def test_gopen_schemes_shim(tmp_path):
    """gopen_schemes["foo"] = fn makes foo: URLs open through fn(url, mode, bufsize)."""
    calls = []

    def opener(url, mode, bufsize):
        calls.append((url, mode, bufsize))
        return io.BytesIO(b"from foo")

    gopen_schemes["foo"] = opener
    assert gopen("foo:bar", bufsize=123).read() == b"from foo"
    assert calls == [("foo:bar", "rb", 123)]
    assert "foo" in gopen_schemes and "file" in gopen_schemes and "pipe" in list(gopen_schemes)
    (tmp_path / "x").write_bytes(b"x")
    with gopen_schemes["file"](str(tmp_path / "x"), "rb", 8192) as f:
        assert f.read() == b"x"
    del gopen_schemes["foo"]
    with pytest.raises(UnknownSchemeError):
        gopen("foo:bar")
    with pytest.raises(KeyError):
        del gopen_schemes["file"]


def test_gopen_error_forbids_a_scheme():
    """Mapping a scheme to gopen_error disables it."""
    from wds_cloud.gopen import gopen_error

    gopen_schemes["pipe"] = gopen_error
    with pytest.raises(UnknownSchemeError, match="disabled"):
        gopen("pipe:echo hi")


def test_rewrite_rules(tmp_path, monkeypatch):
    """WDS_REWRITE wins over GOPEN_REWRITE; the first matching rule is applied."""
    (tmp_path / "a.tar").write_bytes(b"A")
    (tmp_path / "b.tar").write_bytes(b"B")
    monkeypatch.setenv("WDS_REWRITE", f"mirror://=file:{tmp_path}/a")
    monkeypatch.setenv("GOPEN_REWRITE", f"mirror://=file:{tmp_path}/b")
    with gopen("mirror://.tar") as f:
        assert f.read() == b"A"


def test_rewrite_into_pipe_needs_permission(monkeypatch):
    """A rewrite that produces a pipe: URL runs only with WDS_ALLOW_UNTRUSTED_PIPES=1."""
    monkeypatch.setenv("GOPEN_REWRITE", "x://=pipe:echo ")
    with pytest.raises(SecurityError, match="WDS_ALLOW_UNTRUSTED_PIPES=1") as info:
        gopen("x://hello")
    assert any("x://hello" in note for note in getattr(info.value, "__notes__", [])) or "x://hello" in str(info.value)
    monkeypatch.setenv("WDS_ALLOW_UNTRUSTED_PIPES", "1")
    with gopen("x://hello") as f:
        assert f.read() == b"hello\n"


def test_rewrite_errors_name_both_urls(tmp_path, monkeypatch):
    """An error on a rewritten URL names the URL given and the rewritten one."""
    monkeypatch.setenv("WDS_REWRITE", f"data://=file:{tmp_path}/")
    with pytest.raises(ShardNotFoundError) as info:
        gopen("data://missing.tar")
    text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert "data://missing.tar" in text and f"{tmp_path}/missing.tar" in text


def test_dash_opens_stdin_and_stdout_lazily(monkeypatch):
    """``gopen("-")`` (as webdataset's ``sys.stdin.buffer``) needs no readable stdin when opened: the
    process's stream is looked up at each read or write, and closing leaves it open."""
    import io
    import sys

    class NotYet:
        def readable(self):
            raise OSError("not readable at open time")

    monkeypatch.setattr(sys, "stdin", NotYet())
    stream = gopen("-")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"shard bytes")))
    assert stream.read() == b"shard bytes"
    stream.close()
    assert not sys.stdin.closed
    out = io.TextIOWrapper(io.BytesIO())
    monkeypatch.setattr(sys, "stdout", None)
    writer = gopen("-", "wb")
    monkeypatch.setattr(sys, "stdout", out)
    writer.write(b"written")
    writer.close()
    assert out.buffer.getvalue() == b"written" and not out.closed


class _Unseekable(io.RawIOBase):
    """A stream that can only be read forward, as a user's decoding opener gives."""

    def __init__(self, data):
        self._data = io.BytesIO(data)

    def readable(self):
        return True

    def readinto(self, buffer):
        return self._data.readinto(buffer)


@pytest.mark.parametrize("make", [io.BytesIO, _Unseekable])
def test_an_assigned_opener_gives_the_range_asked_for(make, monkeypatch):
    """gopen(url, offset=, length=) through an opener in gopen_schemes (which opens at the start) gives those
    bytes, seeking where the stream can, reading past them where it cannot."""
    monkeypatch.setitem(gopen_schemes, "mine", lambda url, mode="rb", bufsize=8192: make(b"0123456789"))
    assert gopen("mine:x", offset=5, length=2).read() == b"56"
    assert gopen("mine:x", offset=3).read() == b"3456789"
    assert gopen("mine:x", length=4).read() == b"0123"


def test_a_resumed_pass_through_an_assigned_opener_is_exact(shards, monkeypatch):
    """A shuffle's buffered samples are fetched again with ranged reads: through a scheme of the user's they are
    the samples that were buffered (the whole shard came back for a range, and the state was refused)."""
    import wds_cloud as wds

    monkeypatch.setitem(gopen_schemes, "mine", lambda url, mode="rb", bufsize=8192: open(url[5:], mode))
    urls = "mine:" + shards  # a brace spec

    def make():
        return wds.WebDataset(urls, shardshuffle=True, seed=3).shuffle(5).to_tuple("__key__")

    full = list(make())
    ds = make()
    it = iter(ds)
    head = [next(it) for _ in range(7)]
    state = ds.state_dict(strict=True)
    again = make()
    again.load_state_dict(state)
    assert head + list(again) == full


def test_random_access_through_an_assigned_opener_without_an_index(shards, monkeypatch):
    """An opener of the user's that raises the builtin FileNotFoundError for the absent sidecar index: the shard
    is indexed on first use, as without the opener (the opener's error came out instead)."""
    import wds_cloud as wds

    def opener(url, mode="rb", bufsize=8192):
        return open(url[5:], mode)  # the builtin FileNotFoundError for a file that is not there

    monkeypatch.setitem(gopen_schemes, "mine", opener)
    first = shards.replace("{000..002}", "000")
    ds = wds.ShardListDataset(["mine:" + first], transformations=[])
    assert len(ds) == 10 and ds[3]["__key__"] == "s0_0003"
