"""The ``file`` backend: bare paths, ``file:`` URLs, and ``-`` for stdin/stdout.

Paths are taken verbatim: spaces, ``#`` and ``?`` are part of the file name,
and ``file:`` URLs are not percent-decoded (as in webdataset).
"""

from __future__ import annotations

import errno
import glob
import io
import os
import stat
import sys
from collections.abc import Iterator
from typing import Any, Optional

from wds_cloud.errors import AccessDeniedError, ObjectChangedError, ShardNotFoundError, TransferError
from wds_cloud.io import (
    AtomicFile,
    Backend,
    InStream,
    ObjectInfo,
    OutStream,
    hookimpl,
    local_path,
    local_version,
    map_file,
)


class _Stdio(io.RawIOBase):
    """stdin or stdout as a stream, opened lazily: the process's stream is looked up at each read or write (a
    program, a test runner or a DataLoader worker may replace it, and it need not be readable when opened, as
    with webdataset's ``sys.stdin.buffer``), and close() leaves it open."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _stream(self):
        stream = getattr(sys, self._name)
        if stream is None:
            raise OSError(errno.EBADF, f"'-' names {self._name}, which this process does not have")
        return getattr(stream, "buffer", stream)

    def readable(self) -> bool:
        return self._name == "stdin"

    def writable(self) -> bool:
        return self._name == "stdout"

    def readinto(self, buffer) -> int:
        data = self._stream().read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def write(self, data) -> int:
        return self._stream().write(data)

    def flush(self) -> None:
        if self._name == "stdout" and not self.closed:
            self._stream().flush()


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
}


def _not_a_file(url: str, mode: int) -> ShardNotFoundError:
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    if stat.S_ISDIR(mode):  # a folder named where a shard was meant: how to read the shards in it
        fix = (
            f"name its shards: `wds-cloud ls {url[:200]}/` prints a brace spec of them "
            "('folder/shard-{0000..0099}.tar'), or give a list (sorted(glob.glob('folder/*.tar'))); "
            "WebDataset('folder/') with the slash reads it as webdataset's work queue, which renames the files"
        )
    else:
        fix = "name the file itself, or read a stream with '-' (stdin) or 'pipe:cat PATH'"
    return ShardNotFoundError(
        f"{url[:200]}: is {kind}, not a regular file; a shard or data file read from a path must be a regular "
        f"file (its size known when opened); {fix}",
        url=url,
    )


def _open_regular(path: str, url: str) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file at ``path`` and its ``stat``: anything else (a device such as /dev/zero,
    a FIFO, a socket, a directory) is refused before a byte is read.  It is checked before opening (opening
    some devices acts on them) and again on the descriptor (the path may be replaced in between); a FIFO is
    opened without waiting for a writer."""
    before = os.stat(path)
    if not stat.S_ISREG(before.st_mode):
        raise _not_a_file(url, before.st_mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_a_file(url, st.st_mode)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _unopenable(url: str, exc: OSError) -> OSError:
    """Our error for a local path the system would not open or stat, naming it and the fix; an ``OSError`` of the
    kind callers catch (``FileNotFoundError`` for names no file can have, ``PermissionError`` for EACCES)."""
    reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
    if exc.errno in (errno.ENAMETOOLONG, errno.ENOTDIR, errno.ELOOP):  # names no file can have
        return ShardNotFoundError(f"{url[:200]}: no such file ({reason}); check the path", url=url)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return AccessDeniedError(
            f"{url[:200]}: this process may not read the file ({reason}); check its permissions "
            "(ls -l) and the user the job runs as",
            url=url,
        )
    return TransferError(
        f"{url[:200]}: the file could not be opened ({reason}); name a regular file this process can read",
        url=url,
        **({"errno": exc.errno, "strerror": exc.strerror} if exc.errno else {}),
    )


class _SizedFile(io.FileIO):
    """A regular file's descriptor read no further than the size it had when opened (``size``): a file that
    grows while it is read (a writer still appending, a file swapped) is an error, never an endless read."""

    def __init__(self, fd: int, url: str, size: int) -> None:
        super().__init__(fd, "rb", closefd=True)
        self.name = url  # a FileIO made from a descriptor is named by the number; readers show the name
        self.url = url
        self.size = size

    def _grew(self, n: int) -> None:
        if n and self.tell() > self.size:
            raise ObjectChangedError(
                f"{self.url[:200]}: the file grew while it was read (it had {self.size} bytes when opened); a "
                "shard must not change while it is read: read it when its writer has finished",
                url=self.url,
            )

    def _failed(self, exc: OSError) -> TransferError:
        """A read the system refused (EIO: /proc/self/mem, a failing disk), as our error with the path and byte."""
        try:
            at: object = self.tell()
        except OSError:
            at = "?"
        code = f" ({errno.errorcode.get(exc.errno, exc.errno)})" if exc.errno else ""
        known = {"errno": exc.errno, "strerror": exc.strerror} if exc.errno else {}
        return TransferError(
            f"{self.url[:200]}: reading failed at byte {at}: {exc.strerror or exc}{code}; this file cannot be "
            "read as a shard (a special file such as /proc/self/mem, a failing disk or network file system): "
            "name a regular file whose bytes `cat` can read, or copy it to a working disk",
            url=self.url,
            offset=at,
            **known,
        )

    def readinto(self, buffer) -> int:
        try:
            n = super().readinto(buffer)
        except OSError as exc:
            raise self._failed(exc) from exc
        self._grew(n or 0)
        return n

    def read(self, size: Optional[int] = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        try:
            data = super().read(size)
        except OSError as exc:
            raise self._failed(exc) from exc
        self._grew(len(data or b""))
        return data

    def readall(self) -> bytes:
        chunks: list[bytes] = []
        while True:
            chunk = self.read(max(1 << 16, self.size - self.tell() + 1))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


class LocalFile(io.BufferedReader):
    """A local file open for reading, with the backend contract's ``size`` and ``version`` (its modification
    time and size when opened)."""

    def __init__(self, raw: _SizedFile, bufsize: int, st: os.stat_result) -> None:
        super().__init__(raw, bufsize)
        self.size = st.st_size
        self.version = local_version(st)

    def mapping(self) -> Optional[tuple[Any, int, tuple]]:
        """A read-only mapping of the file as it was when opened, the position this stream is at, and the file's
        identity (the tar reader's buffer, see :mod:`wds_cloud.io.mapped`), or None: read it as a stream."""
        return map_file(self.fileno(), self.size, self.tell())


class FileBackend(Backend):
    scheme = "file"

    def open_read(self, url: str, offset: int = 0, bufsize: Optional[int] = None, **kw: object) -> InStream:
        if url == "-":
            stdin = io.BufferedReader(_Stdio("stdin"))
            if offset:
                stdin.read(offset)
            return stdin
        path = local_path(url)
        try:
            fd, st = _open_regular(path, url)
        except ShardNotFoundError:
            raise
        except FileNotFoundError as exc:
            raise ShardNotFoundError(
                f"{url}: no such file (looked for {os.path.abspath(path)!r}); "
                "check the path and the shard spec's brace ranges",
                url=url,
            ) from exc
        except ValueError as exc:  # a NUL in the path: no file can have that name
            raise ShardNotFoundError(
                f"{url!r:.200}: no such file (a path cannot hold a NUL character)", url=url
            ) from exc
        except OSError as exc:
            raise _unopenable(url, exc) from exc
        stream = LocalFile(_SizedFile(fd, url, st.st_size), bufsize or self.settings.bufsize, st)
        if offset:
            try:
                stream.seek(offset)
            except BaseException:  # an offset no file has (negative, past what seek takes): nothing leaks
                stream.close()
                raise
        return stream

    def open_write(self, url: str, bufsize: Optional[int] = None) -> OutStream:
        if url == "-":
            return io.BufferedWriter(_Stdio("stdout"))
        return AtomicFile(local_path(url), bufsize or self.settings.bufsize)

    def stat(self, url: str) -> ObjectInfo:
        try:
            st = os.stat(local_path(url))
        except FileNotFoundError as exc:
            raise ShardNotFoundError(f"{url}: no such file", url=url) from exc
        except ValueError as exc:  # a NUL in the path
            raise ShardNotFoundError(
                f"{url!r:.200}: no such file (a path cannot hold a NUL character)", url=url
            ) from exc
        except OSError as exc:
            raise _unopenable(url, exc) from exc
        if not stat.S_ISREG(st.st_mode):
            raise _not_a_file(url, st.st_mode)
        return ObjectInfo(url, st.st_size, local_version(st))

    def list(self, prefix: str) -> Iterator[str]:
        path = local_path(prefix)
        scheme_prefix = prefix[: len(prefix) - len(path)]
        if os.path.isdir(path):
            for name in sorted(os.listdir(path)):
                yield scheme_prefix + os.path.join(path, name)
            return
        for name in sorted(glob.glob(glob.escape(path) + "*")):
            yield scheme_prefix + name


@hookimpl
def wds_cloud_register_backends(register) -> None:
    register("file", FileBackend, description="local files, file: URLs, and - for stdin/stdout")
