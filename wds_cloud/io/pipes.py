"""A shell command as a binary stream, with its child processes always reaped.

The command runs in its own session (process group), so closing the stream
early kills the shell *and* whatever it started (``curl | zstd -d`` included).
A command that exits with an error raises :class:`PipeError` with the exit status
and the last lines of its stderr, when the stream reaches its end or is closed.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from typing import IO, Any, Optional

from ..errors import ConfigError, PipeError, is_credential_name, redact

__all__ = ["Pipe"]

log = logging.getLogger(__name__)

STDERR_TAIL_BYTES = 4096
STDERR_TAIL_LINES = 10


def _prctl_deathsig(sig: int) -> None:
    import ctypes  # only in a forked child about to exec, on Linux: the parent never pays for it

    ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


def _die_with_parent() -> None:
    """In the child: ask Linux to kill it when the writing process dies.

    A ``pipe:`` writer such as ``cat > x.tmp && mv x.tmp x`` must not see a clean
    end of input (and publish a partial shard) because its parent was killed.
    """
    try:
        _prctl_deathsig(signal.SIGKILL)
    except Exception:
        pass


# The guard of a pipe: writer.  It holds a copy of the command's input, so the command cannot
# see a clean end of input while the guard lives; when the writing process dies, Linux sends the
# guard SIGTERM (PR_SET_PDEATHSIG) and it kills the command's whole process group *before* its
# copy closes.  So ``cat > x.tmp && mv x.tmp x`` is killed with its writer, never left to publish
# what arrived, however the kernel orders the two deaths.  SIGUSR1 dismisses it (a clean close).
_GUARD = """
import os, signal, sys
pgid, parent = int(sys.argv[1]), int(sys.argv[2])
def end(kill):
    if kill:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)
signal.signal(signal.SIGTERM, lambda *a: end(True))
signal.signal(signal.SIGUSR1, lambda *a: end(False))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGUSR1})
if os.getppid() != parent:
    end(True)
while True:
    signal.pause()
"""


def _guard_preexec() -> None:
    # blocked until the guard's handlers are in place: a signal that comes early waits for them
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    try:
        _prctl_deathsig(signal.SIGTERM)
    except Exception:
        pass


def _fileno(stream: Optional[IO[bytes]]) -> int:
    if stream is None:  # cannot happen: the pipe was asked for
        raise RuntimeError("the command has no pipe to its stdin")
    return stream.fileno()


def _start_guard(proc: subprocess.Popen) -> Optional[subprocess.Popen]:
    try:
        return subprocess.Popen(
            [sys.executable, "-S", "-c", _GUARD, str(proc.pid), str(os.getpid())],
            pass_fds=(_fileno(proc.stdin),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_guard_preexec,
        )
    except OSError:
        return None


def _dismiss(guard: Optional[subprocess.Popen]) -> None:
    """Let the guard go without killing anything (the writer closes cleanly, or has killed the command)."""
    if guard is None or guard.poll() is not None:
        return
    try:
        guard.send_signal(signal.SIGUSR1)
    except ProcessLookupError:
        pass
    guard.wait()


def _group_members(pgid: int) -> bool:
    """True while a live (not zombie) process remains in process group ``pgid`` (Linux: /proc)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def _kill_group(proc: subprocess.Popen, grace: float = 1.0) -> None:
    """Terminate ``proc``'s process group (if still running) and reap the shell."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    # The shell is gone, but a grandchild may still run: end the group, and return only when it has
    # ended (SIGKILL is delivered asynchronously), so that "closed" means "no process left".
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    if sys.platform.startswith("linux"):
        for _ in range(2000):  # at most a few seconds; a killed process is gone in microseconds
            if not _group_members(proc.pid):
                return
            time.sleep(0.002)


def _abandon(proc: subprocess.Popen, stderr, guard: Optional[subprocess.Popen] = None) -> None:
    """End a pipe that was dropped without close()."""
    _kill_group(proc)
    _dismiss(guard)
    for stream in (proc.stdout, proc.stdin, stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


def _stderr_tail(stderr) -> str:
    try:
        stderr.flush()
        size = stderr.seek(0, os.SEEK_END)
        stderr.seek(max(0, size - STDERR_TAIL_BYTES))
        text = stderr.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""
    lines = [_hidden(line) for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-STDERR_TAIL_LINES:])


#: a header as a command prints it (``curl -v``: ``> Authorization: Bearer ...``)
_HEADER_LINE = re.compile(r"^(\W*)([A-Za-z][\w-]*)(\s*:\s*)(\S.*)$")


def _hidden(line: str) -> str:
    """A line of a command's stderr as it may be shown: URLs and options redacted, and the value of a header
    whose name is a credential's (a verbose download prints the headers it sent)."""
    line = redact(line)
    header = _HEADER_LINE.match(line)
    if header and is_credential_name(header.group(2)):
        return f"{header.group(1)}{header.group(2)}{header.group(3)}***"
    return line


class Pipe:
    """Run ``cmd`` through the shell and read its stdout (``mode="rb"``) or write its stdin (``"wb"``).

    ``ignore_status`` lists exit statuses that are not errors (upstream users pass
    e.g. ``[141]`` for SIGPIPE).  The object is a context manager; ``close()`` is
    idempotent and never leaves a process behind.
    """

    def __init__(
        self,
        cmd: str,
        mode: str = "rb",
        bufsize: int = 8192,
        *,
        ignore_status=(),
        timeout: float = 7.0,
        url: Optional[str] = None,
        env: Optional[dict] = None,
    ) -> None:
        if mode not in ("rb", "wb", "r", "w"):
            raise ConfigError(f"Pipe mode must be 'rb' or 'wb', not {mode!r}")
        self.cmd = cmd
        self.url = url or f"pipe:{cmd}"
        self.mode = mode
        self.ignore_status = set(ignore_status) | {0}
        self.timeout = timeout
        self.status: Optional[int] = None
        self.closed = False
        self._killed = False
        self._stderr = tempfile.TemporaryFile()
        reading = mode.startswith("r")
        self.proc = subprocess.Popen(
            cmd,
            shell=True,
            bufsize=max(bufsize, 8192),
            stdin=subprocess.DEVNULL if reading else subprocess.PIPE,
            stdout=subprocess.PIPE if reading else subprocess.DEVNULL,
            stderr=self._stderr,
            start_new_session=True,
            env=env,
            preexec_fn=None if reading or not sys.platform.startswith("linux") else _die_with_parent,
        )
        # a BufferedReader (reading) or a BufferedWriter (writing): the methods below use each as its mode allows
        self.stream: Any = self.proc.stdout if reading else self.proc.stdin
        linux = sys.platform.startswith("linux")
        self._guard = _start_guard(self.proc) if not reading and linux else None
        # If the object is dropped without close(), the children are still ended.
        self._finalizer = weakref.finalize(self, _abandon, self.proc, self._stderr, self._guard)
        log.debug("started pipe pid=%d for %s", self.proc.pid, redact(self.url))

    # reading
    def read(self, size: Optional[int] = -1) -> bytes:
        data = self.stream.read(size)
        if (not data and size != 0) or size is None or size < 0:
            self._finish()
        return data

    def readinto(self, buffer) -> int:
        n = self.stream.readinto(buffer)
        if not n and len(buffer):
            self._finish()
        return n

    def read1(self, size: int = -1) -> bytes:
        data = self.stream.read1(size)
        if not data and size != 0:
            self._finish()
        return data

    # writing
    def write(self, data) -> int:
        try:
            return self.stream.write(data)
        except BrokenPipeError as exc:
            self._finish()  # raises PipeError with the command's own explanation, if it failed
            raise PipeError(f"{redact(self.url)}: the command stopped reading its input", url=self.url) from exc

    def flush(self) -> None:
        if self.mode.startswith("w") and not self.closed:
            self.stream.flush()

    def readable(self) -> bool:
        return self.mode.startswith("r")

    def writable(self) -> bool:
        return self.mode.startswith("w")

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()

    def _finish(self) -> None:
        """Wait for the command after its output ended and raise if it failed."""
        if self.status is not None:
            return
        self.status = self.proc.wait()
        self._check()

    def _check(self) -> None:
        if self._killed or self.status in self.ignore_status:
            return
        tail = _stderr_tail(self._stderr)
        status = self.status if self.status is not None else 0
        what = f"was killed by signal {-status}" if status < 0 else f"exited with status {self.status}"
        message = f"{redact(self.url)}: the command {what}"
        message += f"; its stderr ended with:\n{tail}" if tail else " and printed nothing on stderr"
        raise PipeError(message, url=self.url, status=self.status, stderr=tail)

    def abort(self) -> None:
        """Stop the command now; a writer's output is left to the command to discard."""
        self._killed = True
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.mode.startswith("w") and not self._killed:
                _dismiss(self._guard)  # its copy of the input closes: the command sees the end of input
                try:
                    self.stream.close()
                except BrokenPipeError:
                    pass
                try:
                    self.status = self.proc.wait(timeout=None)
                finally:
                    _kill_group(self.proc)
                self._check()
                return
            if self.status is None:
                finished = self.proc.poll() is not None
                if not finished:
                    self._killed = True  # stopped early by the reader: not the command's fault
                _kill_group(self.proc)
                self.status = self.proc.wait()
                if finished:
                    self._check()  # it ended on its own: a failure is the command's, report it
            else:
                _kill_group(self.proc)
        finally:
            _dismiss(self._guard)
            for stream in (self.proc.stdout, self.proc.stdin):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
            self._finalizer.detach()
            self._stderr.close()
            log.debug("closed pipe pid=%d status=%s", self.proc.pid, self.status)

    def __enter__(self) -> Pipe:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()

    def __iter__(self):
        return iter(self.stream)

    def __repr__(self) -> str:
        return f"<Pipe {redact(self.url)!r} mode={self.mode!r} status={self.status}>"
