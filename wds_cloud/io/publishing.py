"""The commit-or-abort base of every write stream that publishes its object when it is closed.

``close()`` publishes (and, should publishing fail, discards what was written before raising);
``abort()`` discards; both run once.  A ``with`` block that ends by an exception aborts, so a
partial object never appears under its name.  Subclasses say how in :meth:`_publish` and
:meth:`_discard`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Publishing"]


class Publishing:
    """Base of the write streams that publish on close (atomic files, uploads, tar and record writers)."""

    closed = False

    def _publish(self) -> None:
        """Make the object visible under its name (called once, by :meth:`close`)."""
        raise NotImplementedError

    def _discard(self) -> None:
        """Throw away what was written (called once by :meth:`abort`, or after :meth:`_publish` failed)."""
        raise NotImplementedError

    def close(self) -> None:
        """Publish the object (idempotent); if that fails, discard it and raise."""
        if self.closed:
            return
        self.closed = True
        try:
            self._publish()
        except BaseException:
            self._discard()
            raise

    def abort(self) -> None:
        """Discard everything written; nothing appears under the object's name (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._discard()

    def writable(self) -> bool:
        return True

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()
