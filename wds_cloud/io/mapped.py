"""Local shard files mapped into memory, for the tar reader to take as its buffer.

A plain tar on local disk (or complete in the shard cache) is read through a read-only mapping of the bytes
it had when it was opened: the reader slices members out of the page cache (one copy, into the ``bytes``
handed to the user; none with ``zero_copy=True``), with no reads into chunks and no joins.  The kernel is
told the mapping is read in order (``MADV_SEQUENTIAL``: read ahead, pages dropped behind), and the reader
gives back what it passed (:func:`drop`), so a mapped epoch holds no more memory than a streamed one.

Only streams that say they are a whole local file offer a mapping (:meth:`LocalFile.mapping` of the file
plugin, the cache's entries): a stream wrapped to be checked while read (a manifest) or cut to a byte
range never is, and reads as it did.  ``WDS_MMAP=0`` turns mapping off (a file system where mapping is
slow or unsafe).

A mapped file that is cut short *in place* while it is read (truncated by another process) would make the
kernel stop the reader with ``SIGBUS`` on the first page past the new end: the reader checks the size before
each window it reads (``ObjectChangedError``), but a cut inside the window being read still does; shards must
not be rewritten in place while read (write a new file and rename it over the old, as every writer of this
library does).  The size is checked when the mapping is made too: a file shorter than when it was opened is
read as a stream (and its truncation reported as usual).
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
from typing import Optional

from .. import config

__all__ = ["map_file", "drop", "populate", "PAGE"]

#: the unit the kernel maps and drops in
PAGE = mmap.PAGESIZE


def map_file(fd: int, size: int, position: int) -> Optional[tuple[mmap.mmap, int, tuple]]:
    """``(mapping, position, identity)``: a read-only mapping of the first ``size`` bytes of the file open as
    ``fd`` (the size it had when opened), where in it the stream stands, and what identifies this version of
    the file (device, inode, size, modification and change times: any write or replacement changes them); None
    where the file is better read as a stream (empty, shorter than ``size`` now, mapping turned off or refused
    by the system)."""
    if size <= 0 or not 0 <= position <= size or not config.current().mmap:
        return None
    try:
        st = os.fstat(fd)
        if st.st_size != size:
            return None  # changed since it was opened: read as a stream, which reports it
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    except (OSError, ValueError, OverflowError):
        return None
    advise = getattr(mapping, "madvise", None)
    if advise is not None and hasattr(mmap, "MADV_SEQUENTIAL"):
        try:
            advise(mmap.MADV_SEQUENTIAL)
        except OSError:
            pass
    return mapping, position, identity


def drop(mapping: mmap.mmap, start: int, end: int) -> None:
    """Give back the pages of ``mapping`` wholly within ``[start, end)`` (read already): they stay in the page
    cache, and a view still pointing into them reads them again from there."""
    first = -(-start // PAGE) * PAGE
    last = end // PAGE * PAGE
    if last <= first or not hasattr(mmap, "MADV_DONTNEED"):
        return
    try:
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
    except (OSError, ValueError):
        pass


#: ``MADV_POPULATE_READ`` (Linux 5.14): map a range's pages now, in one call (Python names it from 3.13 on)
_POPULATE_READ: int = getattr(mmap, "MADV_POPULATE_READ", 22)
_populate_works = sys.platform.startswith("linux")


def populate(mapping: mmap.mmap, start: int, end: int) -> None:
    """Map the pages of ``[start, end)`` of ``mapping`` now, in one call, rather than one fault at a time as they
    are read (where the system can: otherwise nothing)."""
    global _populate_works
    if not _populate_works:
        return
    first = start // PAGE * PAGE
    end = min(end, len(mapping))
    if end <= first:
        return
    try:
        mapping.madvise(_POPULATE_READ, first, end - first)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            _populate_works = False  # an older kernel: faults as before
    except (ValueError, OverflowError):
        pass
