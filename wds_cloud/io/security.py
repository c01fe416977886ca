"""Security policy: where shell commands and pickles are allowed.

``pipe:`` URLs written in the program run as in webdataset.  A URL that came
from data (a remote shard spec, an index file) is wrapped in :class:`UntrustedURL`
by whoever read it, and a URL produced by a rewrite rule that turned something
else into ``pipe:`` is treated the same; neither runs a command unless the user
set ``WDS_ALLOW_UNTRUSTED_PIPES=1``.  ``WDS_SECURE=1`` (or
``wds_cloud.utils.enforce_security = True``) forbids ``pipe:`` altogether.
"""

from __future__ import annotations

import collections
import os
import posixpath
import stat
import threading
import urllib.parse
from typing import Any, Optional

from .. import config
from ..config import Settings
from ..errors import MalformedDataError, SecurityError, redact
from .urls import is_local, local_path, split_scheme

__all__ = [
    "UntrustedURL",
    "is_secure",
    "check_pipe",
    "untrusted",
    "resolve",
    "resolve_base",
    "confined",
    "check_url_text",
    "MAX_URL_LENGTH",
]

#: the longest URL or path read from data: far more than a store's key (S3 and GCS take 1,024 bytes) or a
#: web server's request line (8 KiB) hold, so only a file that means harm reaches it
MAX_URL_LENGTH = 8192


class UntrustedURL(str):
    """A URL string that came from data rather than from the program.

    The mark survives what code does to derive another URL from it (``+ ".index.json"``, slicing,
    ``replace``, ``strip``, ``%``-formatting, splitting): every such result is untrusted too.
    """

    __slots__ = ()

    def __add__(self, other: str) -> UntrustedURL:
        return UntrustedURL(str.__add__(self, other))

    def __radd__(self, other: str) -> UntrustedURL:
        return UntrustedURL(str.__add__(other, self))

    def __mod__(self, values: Any) -> UntrustedURL:
        return UntrustedURL(str.__mod__(self, values))

    def __rmod__(self, template: str) -> UntrustedURL:
        return UntrustedURL(str.__mod__(template, self))

    def __getitem__(self, index: Any) -> UntrustedURL:
        return UntrustedURL(str.__getitem__(self, index))

    def __reduce__(self) -> Any:  # pickled to a spawned worker, still untrusted
        return (UntrustedURL, (str(self),))


def _marking(name: str) -> Any:
    plain = getattr(str, name)

    def method(self: UntrustedURL, *args: Any, **kwargs: Any) -> Any:
        out = plain(self, *args, **kwargs)
        if isinstance(out, str):
            return UntrustedURL(out)
        if isinstance(out, (list, tuple)):
            return type(out)(UntrustedURL(x) for x in out)
        return out

    method.__name__ = name
    method.__doc__ = plain.__doc__
    return method


for _name in (
    "replace",
    "strip",
    "lstrip",
    "rstrip",
    "removeprefix",
    "removesuffix",
    "format",
    "lower",
    "upper",
    "casefold",
    "expandtabs",
    "split",
    "rsplit",
    "partition",
    "rpartition",
    "splitlines",
    "join",
    "ljust",
    "rjust",
    "center",
    "zfill",
    "title",
    "capitalize",
    "swapcase",
    "translate",
):
    setattr(UntrustedURL, _name, _marking(_name))


def untrusted(url: str) -> UntrustedURL:
    return url if isinstance(url, UntrustedURL) else UntrustedURL(url)


def check_url_text(url: Any, where: str, field: str = "url") -> str:
    """``url`` if it is a non-empty string of printable characters; else an error naming ``where`` and ``field``,
    never the value (it may hold a token)."""
    if not isinstance(url, str) or not url:
        raise MalformedDataError(
            f"{where}: {field} must be a non-empty string (a URL or path), not "
            f"{'an empty string' if url == '' else type(url).__name__}; write it again",
            field=field,
        )
    if len(url) > MAX_URL_LENGTH:
        raise MalformedDataError(
            f"{where}: {field} is {len(url)} characters long, longer than the {MAX_URL_LENGTH} any store or "
            "server takes for one name; write it again",
            field=field,
        )
    bad = next((i for i, c in enumerate(url) if c < " " or c == "\x7f"), None)
    if bad is not None:
        raise MalformedDataError(
            f"{where}: {field} holds a control character at position {bad}, which no URL "
            "or path may hold; write it again",
            field=field,
        )
    return url


def _refuse_local(url: str, origin: str, field: str) -> SecurityError:
    return SecurityError(
        f"{redact(origin)}: {field} {redact(url)!r} names a file of this machine, but the file naming "
        "it is remote (it came from data, not from your program); if you trust its source, set "
        "WDS_ALLOW_UNTRUSTED_LOCAL=1",
        url=url,
    )


def _climbs(url: str, origin: str, base: str, field: str, fix: str, how: str = "") -> SecurityError:
    how = how or "through '..', an absolute path or a link"
    return SecurityError(
        f"{redact(origin)}: {field} {redact(url)!r} leaves {redact(base)!r}, the folder it is "
        f"resolved in ({how}); {fix}",
        url=url,
    )


def _decoded(name: str) -> str:
    """``name`` percent-decoded until it no longer changes: what a server, or a proxy in front of it that decodes
    once more, may take it to say (``%252e%252e`` -> ``%2e%2e`` -> ``..``).  Each round that changes something
    shortens the name, so the loop ends."""
    while True:
        out = urllib.parse.unquote(name, errors="surrogateescape")
        if out == name:
            return out
        name = out


def _check_spelling(name: str, origin: str, folder: str, field: str, fix: str) -> None:
    """Refuse a relative ``name`` that climbs out of ``folder`` in any spelling a server may decode: percent-encoded
    dot segments and separators (``%2e%2e/``, ``..%2f``, ``%252e``), backslashes, an absolute path or another host
    after decoding (``%2f%2fhost/x``), and control characters (``%00``); containment is decided on the decoded
    name, not on the text: a server decodes ``%2e%2e/`` as ``../``, so a check of the text alone lets it climb out."""
    plain = _decoded(name)
    bad = next((c for c in plain if c < " " or c == "\x7f"), None)
    if bad is not None:
        raise SecurityError(
            f"{redact(origin)}: {field} {redact(name)!r} decodes to a control character ({ord(bad):#04x}), which "
            f"no name of a shard or file may hold; {fix}",
            url=name,
        )
    path = plain.replace("\\", "/")  # a backslash is a separator to Windows and to some servers
    if path.startswith("/"):
        raise _climbs(name, origin, folder, field, fix, f"it decodes to {redact(plain)!r}, an absolute path or a host")
    depth = 0
    for segment in path.split("/"):
        if segment == "..":
            depth -= 1
            if depth < 0:
                spelled = "" if plain == name else f"it decodes to {redact(plain)!r}"
                raise _climbs(name, origin, folder, field, fix, spelled)
        elif segment not in ("", "."):
            depth += 1


def _absolute(url: str) -> bool:
    """Whether ``url`` stands on its own (a scheme, or an absolute path) rather than naming something in a folder."""
    return split_scheme(url)[0] is not None or url.startswith("/") or url.startswith("\\")


def _dir_of(url: str) -> str:
    """The folder of the file at ``url``; a local file named without one (``d.json``) is in ``./``, so its names
    are confined there too.  ``""``: no file (a dict the program gave)."""
    if "/" in url:
        return url.rsplit("/", 1)[0] + "/"
    return "./" if url and is_local(url) else ""


def resolve(
    url: Any, origin: str, *, base: Optional[str] = None, field: str = "url", settings: Optional[Settings] = None
) -> UntrustedURL:
    """The one place a URL read from a file (``origin``: that file's URL or path) becomes a URL to open.

    - the result is always :class:`UntrustedURL` (a ``pipe:`` one runs only as ``check_pipe`` allows);
    - a relative name is joined to ``base`` (already resolved, see :func:`resolve_base`) or to ``origin``'s
      folder, and must stay inside it: ``..``, and for local files a link, that leave it are refused;
    - a local path or ``file:`` URL named by a remote file is refused unless ``WDS_ALLOW_UNTRUSTED_LOCAL``;
    - a join never makes a scheme: a relative name stays relative to its folder, whatever it holds.
    """
    settings = settings if settings is not None else config.current()
    where = redact(origin)
    url = check_url_text(url, where, field)
    remote_origin = bool(origin) and not is_local(origin)
    scheme, _ = split_scheme(url)
    if _absolute(url):
        if (scheme in (None, "file")) and remote_origin and not settings.allow_untrusted_local:
            raise _refuse_local(url, origin, field)
        return untrusted(url)
    folder = base if base is not None else _dir_of(origin)
    if not folder:
        return untrusted(url)
    return untrusted(_join(folder, url, origin, field, settings))


#: folders whose real path was found, with the (device, inode) they had: a description of 10^7 shards in one folder
#: costs a stat or two a name, not a realpath (an lstat per component) twice a name
_FOLDERS: collections.OrderedDict = collections.OrderedDict()
_FOLDERS_KEPT = 256
_FOLDERS_LOCK = threading.Lock()


def _real_folder(folder: str) -> str:
    """``os.path.realpath(folder)``, remembered while the folder is the same one (checked by one ``stat``: a folder
    replaced by a link elsewhere has another inode, and is looked up again)."""
    try:
        st = os.stat(folder)
    except OSError:
        return os.path.realpath(folder)
    with _FOLDERS_LOCK:
        known = _FOLDERS.get(folder)
        if known is not None and known[0] == (st.st_dev, st.st_ino):
            _FOLDERS.move_to_end(folder)
            return known[1]
    real = os.path.realpath(folder)
    with _FOLDERS_LOCK:
        _FOLDERS[folder] = ((st.st_dev, st.st_ino), real)
        if len(_FOLDERS) > _FOLDERS_KEPT:
            _FOLDERS.popitem(last=False)
    return real


def _real(path: str, root: str, real_root: str) -> str:
    """``os.path.realpath(path)`` for a normalised path: its folder's real path (``real_root`` when that folder is
    ``root``, else :func:`_real_folder`) and its last part, followed when it is a link."""
    folder, name = os.path.split(path)
    if not folder or not name or name in (os.curdir, os.pardir):
        return os.path.realpath(path)
    candidate = os.path.join(real_root if folder == root else _real_folder(folder), name)
    try:
        if not stat.S_ISLNK(os.lstat(candidate).st_mode):
            return candidate
    except OSError:
        return candidate  # absent: realpath gives the same join
    return os.path.realpath(candidate)


def _join(
    folder: str,
    name: str,
    origin: str,
    field: str,
    settings: Settings,
    fix: str = "write the full URL or path instead of a relative one",
) -> str:
    fscheme, _ = split_scheme(folder)
    if fscheme == "pipe":
        raise SecurityError(
            f"{redact(origin)}: {field} {redact(name)!r} would be joined to a pipe: command; a base "
            "or folder is a storage location, never a command",
            url=origin,
        )
    _check_spelling(name, origin, folder, field, fix)
    if fscheme in (None, "file"):
        root = os.path.normpath(local_path(folder) or ".")
        joined = os.path.normpath(os.path.join(root, name))
        if not settings.allow_untrusted_local:
            rel = os.path.relpath(joined, root)
            if rel == os.pardir or rel.startswith(os.pardir + os.sep):
                raise _climbs(name, origin, folder, field, fix)
            real_root = _real_folder(root)
            real = _real(joined, root, real_root)
            if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
                raise _climbs(
                    name,
                    origin,
                    folder,
                    field,
                    fix + " (or set WDS_ALLOW_UNTRUSTED_LOCAL=1 to follow links out of the folder)",
                )
        return joined if fscheme is None else "file://" + joined
    folder = folder if folder.endswith("/") else folder + "/"
    joined = _urljoin(folder, name)
    prefix = urllib.parse.urlsplit(folder)
    result = urllib.parse.urlsplit(joined)
    folder_path = posixpath.normpath(prefix.path or "/")
    joined_path = posixpath.normpath(result.path or "/")
    if (result.scheme, result.netloc) != (prefix.scheme, prefix.netloc) or not (
        joined_path == folder_path or joined_path.startswith(folder_path.rstrip("/") + "/")
    ):
        raise _climbs(name, origin, folder, field, fix)
    return joined


def _urljoin(folder: str, name: str) -> str:
    """``name`` resolved in the folder URL ``folder``, for any scheme (``urllib.parse.urljoin`` knows only the
    schemes of its own lists: ``s3://b/`` joined with ``a.tar`` gives ``a.tar`` there)."""
    if split_scheme(name)[0]:
        return name  # a URL of its own (checked against the folder by the caller)
    prefix = urllib.parse.urlsplit(folder)
    path = name if name.startswith("/") else posixpath.join(prefix.path or "/", name)
    normal = posixpath.normpath(path) + ("/" if path.endswith("/") and path != "/" else "")
    return urllib.parse.urlunsplit((prefix.scheme, prefix.netloc, normal, "", ""))


def resolve_base(base: Any, origin: str, field: str = "base", settings: Optional[Settings] = None) -> str:
    """A ``base`` read from ``origin`` as a folder URL (resolved as :func:`resolve` resolves a URL); a ``pipe:``
    base is refused: joining names to a command would turn every one into a command."""
    url = check_url_text(base, redact(origin), field)
    if split_scheme(url)[0] == "pipe":
        raise SecurityError(
            f"{redact(origin)}: {field} {redact(url)!r} is a pipe: command; a base is a storage "
            "location that relative shard names are joined to, never a command",
            url=origin,
        )
    resolved = resolve(url, origin, field=field, settings=settings)
    return resolved if resolved.endswith("/") else resolved + "/"


def confined(folder: str, name: Any, where: str, field: str) -> str:
    """``name`` (read from a file) joined to ``folder`` (given by the user), refused when it would leave it:
    an absolute path, a scheme, ``..``, or a link out of a local folder.  Used where a name from data picks a
    file to read, such as the MMC4 converter's ``image_name``."""
    name = check_url_text(name, where, field)
    if _absolute(name):
        raise SecurityError(
            f"{where}: {field} {redact(name)!r} is not a name inside {redact(folder)!r} (it is an "
            "absolute path or URL); files are read only from the folder you gave",
            url=name,
        )
    settings = config.current().replace(allow_untrusted_local=False)
    return _join(
        folder.rstrip("/") + "/", name, where, field, settings, "files are read only from inside the folder you gave"
    )


def is_secure(settings: Optional[Settings] = None) -> bool:
    """Whether secure mode is on: ``WDS_SECURE=1`` (in ``settings``, default the environment's now) or
    ``wds_cloud.utils.enforce_security`` (a module flag, read at each call as upstream users expect).

    The one secure-mode check: opening, pipes, rewrites and decoding all ask it.
    """
    if config.switches.enforce_security:
        return True
    return bool((settings if settings is not None else config.current()).secure)


def check_pipe(url: str, settings: Settings) -> None:
    """Refuse ``url`` (a ``pipe:`` URL) when the settings forbid running it."""
    if is_secure(settings):
        raise SecurityError(
            f"refusing to run {redact(url)!r}: pipe: URLs are forbidden while WDS_SECURE=1 is set (in Python: "
            "or wds_cloud.utils.enforce_security) (webdataset: gopen_pipe: unsafe_gopen is False, "
            "cannot open pipe URLs); use a storage URL such as s3:// or https:// instead, or unset WDS_SECURE",
            url=url,
        )
    if isinstance(url, UntrustedURL) and not settings.allow_untrusted_pipes:
        raise SecurityError(
            f"refusing to run {redact(url)!r}: this shell command came from data or from a rewrite rule, "
            "not from your program; if you trust its source, set WDS_ALLOW_UNTRUSTED_PIPES=1",
            url=url,
        )
