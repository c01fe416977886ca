"""A shell command as a binary stream, with its child processes always reaped.

The command runs in its own session (process group), so closing the stream
early kills the shell *and* whatever it started (``curl | zstd -d`` included).
A command that exits with an error raises :class:`PipeError` with the exit status
and the last lines of its stderr, when the stream reaches its end or is closed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import weakref
from typing import Optional

from .errors import PipeError, redact

__all__ = ["Pipe"]

log = logging.getLogger("wds_cloud.pipes")

STDERR_TAIL_BYTES = 4096
STDERR_TAIL_LINES = 10


def _die_with_parent() -> None:
    """In the child: ask Linux to kill it when the writing process dies.

    A ``pipe:`` writer such as ``cat > x.tmp && mv x.tmp x`` must not see a clean
    end of input (and publish a partial shard) because its parent was killed.
    """
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


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
    else:
        # The shell is gone, but a grandchild may still hold the pipe: end the group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _abandon(proc: subprocess.Popen, stderr) -> None:
    """End a pipe that was dropped without close()."""
    _kill_group(proc)
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
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-STDERR_TAIL_LINES:])


class Pipe:
    """Run ``cmd`` through the shell and read its stdout (``mode="rb"``) or write its stdin (``"wb"``).

    ``ignore_status`` lists exit statuses that are not errors (upstream users pass
    e.g. ``[141]`` for SIGPIPE).  The object is a context manager; ``close()`` is
    idempotent and never leaves a process behind.
    """

    def __init__(self, cmd: str, mode: str = "rb", bufsize: int = 8192, *, ignore_status=(),
                 timeout: float = 7.0, url: Optional[str] = None, env: Optional[dict] = None) -> None:
        if mode not in ("rb", "wb", "r", "w"):
            raise ValueError(f"Pipe mode must be 'rb' or 'wb', not {mode!r}")
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
            cmd, shell=True, bufsize=max(bufsize, 8192),
            stdin=subprocess.DEVNULL if reading else subprocess.PIPE,
            stdout=subprocess.PIPE if reading else subprocess.DEVNULL,
            stderr=self._stderr, start_new_session=True, env=env,
            preexec_fn=None if reading or not sys.platform.startswith("linux") else _die_with_parent,
        )
        self.stream = self.proc.stdout if reading else self.proc.stdin
        # If the object is dropped without close(), the children are still ended.
        self._finalizer = weakref.finalize(self, _abandon, self.proc, self._stderr)
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
        what = (f"was killed by signal {-self.status}" if self.status < 0
                else f"exited with status {self.status}")
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
            for stream in (self.proc.stdout, self.proc.stdin):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
            self._finalizer.detach()
            self._stderr.close()
            log.debug("closed pipe pid=%d status=%s", self.proc.pid, self.status)

    def __enter__(self) -> "Pipe":
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
