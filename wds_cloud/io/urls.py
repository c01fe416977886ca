"""Facts about a URL, each decided in one place: its scheme, whether it is local, its cache name.

Everything that asks "is this a local file?" (opening, the shard cache, resume)
asks :func:`is_local`; everything that needs the scheme asks :func:`split_scheme`.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from typing import Optional

__all__ = [
    "split_scheme",
    "is_local",
    "local_path",
    "same_location",
    "resolved",
    "local_version",
    "pipe_cleaner",
    "url_to_cache_name",
    "location_of",
    "folder_of",
    "relative_to_folder",
    "name_in_file",
]

_URLISH = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://\S+$")


def split_scheme(url: str) -> tuple[Optional[str], str]:
    """Split ``url`` into (scheme, rest); a bare path or a Windows drive has no scheme."""
    if url == "-":
        return None, url
    colon = url.find(":")
    if colon < 2:  # no colon, or a one-letter "scheme" such as C:\ is a path
        return None, url
    scheme = url[:colon]
    if not (scheme[0].isalpha() and all(c.isalnum() or c in "+.-" for c in scheme)):
        return None, url
    return scheme.lower(), url[colon + 1 :]


def is_local(url: str) -> bool:
    """Whether ``url`` names a file of this machine: a bare path or a ``file:`` URL (``-`` is not: it is stdio)."""
    return url != "-" and split_scheme(url)[0] in (None, "file")


def local_path(url: str) -> str:
    """The filesystem path of a bare path or ``file:`` URL."""
    url = os.fspath(url)
    if url.startswith("file://"):
        rest = url[7:]
        return rest[len("localhost") :] if rest.startswith("localhost/") else rest
    if url.startswith("file:"):
        return url[5:]
    return url


def same_location(a: str, b: str) -> bool:
    """Whether two URLs name one object: local ones compared as real paths (links and ``file:`` resolved)."""
    if is_local(a) and is_local(b):
        return resolved(local_path(a)) == resolved(local_path(b))
    return a == b


def resolved(location: str) -> str:
    """What ``location`` names once the file system has followed it: a local path made absolute with its links
    resolved (``os.path.realpath``; a name no file can have, holding a NUL, only normalized); any other URL as
    it is.  Two spellings of one local file (through a linked folder, with ``..``) resolve alike."""
    if not is_local(location):
        return location
    path = os.path.abspath(local_path(location))
    try:
        return os.path.realpath(path)
    except (OSError, ValueError):
        return os.path.normpath(path)


def local_version(st: os.stat_result) -> str:
    """What stands for a local file's version (its modification time and size), from its ``stat``: the file
    backend's ``stat`` and the indexes of local shards say the same."""
    return f"{st.st_mtime_ns:x}-{st.st_size:x}"


def pipe_cleaner(spec: str) -> str:
    """The object URL inside a ``pipe:`` command (``pipe:curl -s https://h/x.tar`` -> ``https://h/x.tar``)."""
    if not spec.startswith("pipe:"):
        return spec
    for token in reversed(spec[5:].split()):
        token = token.strip("'\"")
        if _URLISH.match(token):
            return token
    return spec


class NotAURLError(TypeError, AssertionError):
    """A URL that is not a string: a ``TypeError``, and the ``AssertionError`` webdataset raises there."""


def url_to_cache_name(url: str, ndir: int = 0) -> str:
    """A safe, collision-free, readable cache file name for ``url``.

    Readable part: scheme, bucket/host and path joined by ``__`` with unsafe
    characters replaced; a hash of the whole URL keeps distinct URLs apart.
    """
    if not isinstance(url, str):
        raise NotAURLError(f"url_to_cache_name needs a URL string, not {type(url).__name__}")
    url = pipe_cleaner(url)
    scheme, rest = split_scheme(url)
    # The readable part never holds a credential: no userinfo, no query (signatures, tokens, SAS);
    # the hash of the whole URL keeps URLs that differ only there apart.
    if rest.startswith("//"):
        authority, _, path = rest[2:].partition("/")
        rest = "//" + authority.rpartition("@")[2] + "/" + path
    if not is_local(url):
        rest = rest.split("?", 1)[0].split("#", 1)[0]
    if scheme == "pipe":  # a command with no URL in it: only its last word (options may hold tokens)
        rest = (rest.split() or ["shard"])[-1]
    readable = (scheme or "file") + "__" + rest.lstrip("/")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", readable.replace("/", "__")).strip("._") or "shard"
    digest = hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    base, ext = _split_ext(readable)
    base = base[-(150 - len(ext)) :]  # bounded length, keeping the end of the path (the shard name)
    return f"{base}.{digest}{ext}"


def _split_ext(name: str) -> tuple[str, str]:
    m = re.search(r"(\.tar(\.gz|\.bz2|\.xz|\.zst)?|\.tgz)$", name)
    return (name[: m.start()], m.group(0)) if m else (name, "")


# where files that name other files name them (manifests, wids descriptions)
def location_of(name: str, folder: Optional[str]) -> str:
    """Where the shard ``name`` of a manifest kept in ``folder`` (None: the working directory) is: local names
    as absolute normalized paths, a relative name joined to the folder, any other URL as it is."""
    scheme, _ = split_scheme(name)
    if scheme not in (None, "file"):
        return name
    path = local_path(name)
    if folder is not None and not os.path.isabs(path):
        if not is_local(folder):  # a relative entry of a remote manifest: beside it, same scheme
            return _join_url(folder, path)
        path = os.path.join(local_path(folder), path)
    return os.path.normpath(os.path.abspath(path))


def _join_url(folder: str, name: str) -> str:
    scheme, rest = split_scheme(folder)
    head = "//" if rest.startswith("//") else ""
    rest = rest[len(head) :]
    host, _, path = rest.partition("/")
    joined = posixpath.normpath(posixpath.join("/" + path, name)).lstrip("/")
    return f"{scheme}:{head}{host}/{joined}"


def folder_of(url: str) -> str:
    """The folder of the file at ``url`` (a path or a URL)."""
    if is_local(url):
        return os.path.dirname(os.path.abspath(local_path(url)))
    return url.rsplit("/", 1)[0]


def relative_to_folder(location: str, folder: str) -> str:
    """``location`` relative to ``folder`` when it is inside it, else as it is.

    A local location is inside when its folder, links resolved, is the folder (resolved) or below it: a shard
    reached through a link to the folder (``../link/s0.tar`` for a file written in ``real/``) is named ``s0.tar``,
    so the folder copied or moved elsewhere still names its own shards; a shard that is itself a link in the
    folder keeps its name there.  Failing that, a location spelled inside the folder is named as spelled."""
    if is_local(location) != is_local(folder):
        return location
    if is_local(location):
        path = local_path(location)
        parent, base = os.path.split(path)
        for inside in (
            os.path.relpath(os.path.join(resolved(parent or "."), base), resolved(folder)),
            os.path.relpath(path, local_path(folder)),
        ):
            if inside != ".." and not inside.startswith(".." + os.sep) and not os.path.isabs(inside):
                return inside.replace(os.sep, "/")
        return location
    prefix = folder.rstrip("/") + "/"
    return location[len(prefix) :] if location.startswith(prefix) else location


def name_in_file(url: str, at: str) -> str:
    """How a file written at ``at`` names ``url``: relative to that file's folder when ``url`` lies in it or below
    (readers resolve names in the file's folder, so it reads back from any working directory and moves with its
    shards), else absolute (a local path made absolute, any other URL as it is)."""
    return relative_to_folder(location_of(url, None), folder_of(at))
