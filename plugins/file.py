"""The ``file`` backend: bare paths, ``file:`` URLs, and ``-`` for stdin/stdout.

Paths are taken verbatim: spaces, ``#`` and ``?`` are part of the file name,
and ``file:`` URLs are not percent-decoded (as in webdataset).
"""

from __future__ import annotations

import errno
import glob
import io
import os
import sys
from collections.abc import Iterator
from typing import Optional

from wds_cloud.errors import ShardNotFoundError
from wds_cloud.io import AtomicFile, Backend, InStream, ObjectInfo, OutStream, hookimpl, local_path, local_version


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
            stream = open(path, "rb", buffering=bufsize or self.settings.bufsize)
        except FileNotFoundError as exc:
            raise ShardNotFoundError(
                f"{url}: no such file (looked for {os.path.abspath(path)!r}); "
                "check the path and the shard spec's brace ranges",
                url=url,
            ) from exc
        except IsADirectoryError as exc:
            raise ShardNotFoundError(f"{url}: is a directory, not a shard file", url=url) from exc
        except ValueError as exc:  # a NUL in the path: no file can have that name
            raise ShardNotFoundError(
                f"{url!r:.200}: no such file (a path cannot hold a NUL character)", url=url
            ) from exc
        except OSError as exc:
            if exc.errno in (errno.ENAMETOOLONG, errno.ENOTDIR, errno.ELOOP):  # names no file can have
                raise ShardNotFoundError(
                    f"{url[:200]}: no such file ({os.strerror(exc.errno).lower()}); check the path", url=url
                ) from exc
            raise
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
