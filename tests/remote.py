"""A remote object as the shard cache's opener returns one, for the cache's tests."""

import io


class Remote(io.RawIOBase):
    """A remote object as the cache's opener returns it (size, version, readinto from an offset)."""

    def __init__(self, data: bytes, offset: int = 0) -> None:
        self.data, self.pos, self.size, self.version, self.md5 = data, offset, len(data), "v1", None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        chunk = self.data[self.pos : self.pos + len(buffer)]
        buffer[: len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)
