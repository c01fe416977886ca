"""pipe: URLs: children are always reaped, failures explain themselves, security rules hold."""

import gc
import os

import pytest

from wds_cloud import gopen, utils
from wds_cloud.errors import PipeError, SecurityError
from wds_cloud.io import Pipe, UntrustedURL


def group_alive(pgid):
    """True while a live (not zombie) process remains in the process group ``pgid``.

    Zombies are dead: the grandchildren of the shell are reparented to PID 1,
    which reaps them (a container's PID 1 may not, hence this check).
    """
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_reads_a_command_output():
    """pipe: reads the command's stdout to the end."""
    with gopen("pipe:printf 'abc'") as f:
        assert f.read() == b"abc"


def test_children_reaped_after_early_close():
    """Closing early kills the shell and every process it started; none remains."""
    stream = gopen("pipe:cat /dev/zero | head -c 1000000000 | cat")
    assert len(stream.read(65536)) == 65536
    pgid = stream.proc.pid
    stream.close()
    assert stream.proc.poll() is not None
    assert not group_alive(pgid)


def test_children_reaped_when_dropped_unclosed():
    """A stream dropped without close() still ends its processes."""
    stream = gopen("pipe:sleep 30")
    pgid = stream.proc.pid
    del stream
    gc.collect()  # the finalizer kills the group and returns once no process of it is left
    assert not group_alive(pgid)


def test_failing_command_reports_status_and_stderr():
    """A failing command raises PipeError with its exit status and the last lines of stderr."""
    with pytest.raises(PipeError) as info:
        with gopen("pipe:echo partial; echo 'first line' >&2; echo 'no such bucket' >&2; exit 3") as f:
            f.read()
    message = str(info.value)
    assert "exited with status 3" in message and "no such bucket" in message and "first line" in message
    assert info.value.status == 3 and isinstance(info.value, OSError)


def test_a_failing_commands_stderr_is_shown_without_credentials():
    """A verbose download prints the headers it sent on stderr: the tail shown in the error hides a credential
    header's value, and redacts URLs as every message does (adversary finding, issue 41)."""
    command = (
        "pipe:printf '> Authori''zation: Bearer SEKRIT1\\n< X-Auth-''Token: SEKRIT2\\n' >&2; "
        "printf 'GET https://h/x.tar?to''ken=SEKRIT3\\nCoo''kie: session=SEKRIT4\\nplain line\\n' >&2; exit 4"
    )
    with pytest.raises(PipeError) as info:
        with gopen(command) as f:
            f.read()
    tail = str(info.value).split("its stderr ended with:", 1)[1]  # (the command itself is the user's own text)
    for shown in (tail, info.value.stderr):
        assert "SEKRIT" not in shown and "Authorization: ***" in shown and "plain line" in shown


def test_failing_command_without_stderr():
    """Even a silent failure says so instead of a bare exit code."""
    with pytest.raises(PipeError, match="status 1 and printed nothing"):
        with gopen("pipe:false") as f:
            f.read()


def test_ignore_status():
    """Statuses listed in ignore_status are not errors."""
    with Pipe("exit 141", ignore_status=[141]) as p:
        assert p.read() == b""


def test_pipe_write(tmp_path):
    """pipe: in write mode feeds the command's stdin."""
    out = tmp_path / "out.bin"
    with gopen(f"pipe:cat > '{out}'", "wb") as f:
        f.write(b"written")
    assert out.read_bytes() == b"written"


def test_pipe_write_failure():
    """A write command that fails raises PipeError on close."""
    with pytest.raises(PipeError, match="status 2"):
        with gopen("pipe:cat > /dev/null; exit 2", "wb") as f:
            f.write(b"x")


def test_secure_forbids_pipe(monkeypatch):
    """WDS_SECURE=1 and utils.enforce_security forbid pipe: entirely."""
    monkeypatch.setenv("WDS_SECURE", "1")
    with pytest.raises(SecurityError, match="WDS_SECURE"):
        gopen("pipe:echo hi")
    monkeypatch.delenv("WDS_SECURE")
    utils.enforce_security = True
    with pytest.raises(SecurityError):
        gopen("pipe:echo hi")


def test_untrusted_pipe_refused_unless_allowed(monkeypatch):
    """A pipe: command that came from data runs only with WDS_ALLOW_UNTRUSTED_PIPES=1."""
    with pytest.raises(SecurityError, match="came from data"):
        gopen(UntrustedURL("pipe:echo hi"))
    monkeypatch.setenv("WDS_ALLOW_UNTRUSTED_PIPES", "1")
    with gopen(UntrustedURL("pipe:echo hi")) as f:
        assert f.read() == b"hi\n"


def test_offset_skips_bytes():
    """A read at an offset skips that many bytes of the command's output."""
    with gopen("pipe:printf 0123456789", offset=7) as f:
        assert f.read() == b"789"
