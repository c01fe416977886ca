"""The ``pipe`` backend: ``pipe:COMMAND`` reads the command's stdout or writes its stdin."""

from __future__ import annotations

from typing import Optional

from wds_cloud.errors import ConfigError
from wds_cloud.io import Backend, InStream, OutStream, Pipe, check_pipe, hookimpl, skip


class PipeBackend(Backend):
    scheme = "pipe"

    def _command(self, url: str) -> str:
        check_pipe(url, self.settings)
        command = url[len("pipe:") :]
        if not command.strip():
            raise ConfigError(f"{url!r} has no command: write pipe:COMMAND, e.g. 'pipe:cat shard.tar'", url=url)
        return command

    def open_read(self, url: str, offset: int = 0, bufsize: Optional[int] = None, **kw: object) -> InStream:
        pipe = Pipe(self._command(url), "rb", bufsize or self.settings.bufsize, url=url)
        if offset:  # a command's output cannot seek: skip what was asked to be skipped
            skip(pipe.read, offset)
        return pipe

    def open_write(self, url: str, bufsize: Optional[int] = None) -> OutStream:
        return Pipe(self._command(url), "wb", bufsize or self.settings.bufsize, url=url)


@hookimpl
def wds_cloud_register_backends(register) -> None:
    register("pipe", PipeBackend, description="a shell command's stdout (read) or stdin (write)")
