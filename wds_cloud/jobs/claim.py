"""Claims: one job at a time writes a destination, and it says so before its first expensive step.

A job (``map_shards``, ``reshard``, ``convert``, ``index --output``) claims its destination when its
:class:`~wds_cloud.jobs.record.JobRecord` is made, before a cluster starts or an input is read: a claim file
beside the job record (``<destination with N>.wds-job.lock``) that names the job (tool, function or settings,
pid, host, when it started).  While it exists, any other job into that destination is refused, naming the
one that holds it: two jobs writing one destination would mix their outputs (and both report success).

- **Atomic where the store allows it.**  A local claim is written whole to a hidden file, then linked to
  its name (``link`` fails when the name exists: exactly one of two jobs gets it); it is removed when the
  job ends (:meth:`Claim.release`, or when its record is dropped, or at exit).  An object store offers no
  create-if-absent through the backend contract: there the claim is written, then read back (a job that
  finds another's claim there is refused), and released by writing it again marked released.  Two jobs
  started within the same few milliseconds against an object store can both pass; on local or network
  file systems they cannot.
- **Stale claims are recognised.**  A claim whose process is gone (on this host: its pid no longer runs,
  or runs another program since the claim, or the host rebooted since) is taken over, with a warning in
  the log.  A claim from another host cannot be judged from here: the job is refused with the fix (remove
  the claim file once that job is known to be gone).
- **A claim is data.**  It is read as a regular file only (a FIFO, a device or a link at its name is
  refused, never read), bounded in size, and every field checked; a malformed claim is refused naming the
  file and the fix, never taken for a free destination.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import math
import os
import socket
import stat
import threading
import uuid
import weakref
from typing import Any, Optional

from ..errors import ConfigError, MalformedDataError, ShardNotFoundError, redact
from ..io import datafile
from ..io.urls import is_local, local_path

__all__ = ["Claim", "claim_beside", "open_regular", "read_regular", "process_gone", "FORMAT"]

FORMAT = "wds_cloud.job-claim"
_SUFFIX = ".wds-job.json"

log = logging.getLogger(__name__)

#: tokens of the claims this process holds now (a claim naming this pid whose token is not here is stale)
_HELD: set[str] = set()
_HELD_LOCK = threading.RLock()  # re-entered when a finalizer runs while this thread holds it


def claim_beside(record: str) -> str:
    """The claim beside the job record at ``record`` (``...wds-job.json`` -> ``...wds-job.lock``)."""
    base = record[: -len(_SUFFIX)] if record.endswith(_SUFFIX) else record
    return base + ".wds-job.lock"


def open_regular(path: str, what: str) -> Any:
    """The local regular file ``path`` opened for reading; a FIFO, a device, a socket or a link there is refused
    (ConfigError naming it), never opened for reading, and so is one swapped in after the check."""
    where = redact(path)
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        raise ShardNotFoundError(f"{where}: no such file", url=path) from None
    except (OSError, ValueError) as exc:  # a name no file can have (NUL, too long): none is there
        raise ShardNotFoundError(f"{where!r:.300}: no such file ({type(exc).__name__})", url=path) from None
    if not stat.S_ISREG(before.st_mode):
        raise _not_regular(where, what, before.st_mode)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ShardNotFoundError(f"{where}: no such file", url=path) from None
    except OSError as exc:  # ELOOP: a link was put there after the check
        raise _not_regular(where, what, None) from exc
    stream = os.fdopen(fd, "rb")
    now = os.fstat(fd)
    if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
        stream.close()
        raise _not_regular(where, what, now.st_mode)
    return stream


def read_regular(path: str, limit: int, what: str) -> bytes:
    """At most ``limit`` bytes of the local regular file ``path`` (see :func:`open_regular`)."""
    with open_regular(path, what) as stream:
        return stream.read(limit)


def _not_regular(where: str, what: str, mode: Optional[int]) -> ConfigError:
    kind = (
        "a link"
        if mode is not None and stat.S_ISLNK(mode)
        else "a FIFO"
        if mode is not None and stat.S_ISFIFO(mode)
        else "a device"
        if mode is not None and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode))
        else "a folder"
        if mode is not None and stat.S_ISDIR(mode)
        else "something else"
    )
    return ConfigError(
        f"{where}: {what} is not a regular file ({kind}); the tools read only regular files there: move it away "
        "or choose another destination",
        url=where,
    )


def _proc_stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time in clock ticks since boot) of process ``pid`` from /proc, or None (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
        fields = data[data.rindex(b")") + 2 :].split()
        return fields[0].decode("ascii", "replace"), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read(64).strip() or None
    except OSError:
        return None


def _alive(pid: int, start: Optional[int]) -> bool:
    """Whether process ``pid`` of this host still runs the program that made a claim (started at ``start``)."""
    seen = _proc_stat(pid)
    if seen is not None:
        state, ticks = seen
        return state not in ("Z", "X") and (start is None or ticks == start)
    try:
        os.kill(pid, 0)  # pid >= 1 (checked): never a process group
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


def process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host (a pid below 1, or this process's, is never gone): what
    lets a job remove the temporary file of a writer that died (its name carries the writer's pid)."""
    return pid >= 1 and pid != os.getpid() and not _alive(pid, None)


def _is_text(value: Any, most: int) -> bool:
    return isinstance(value, str) and 0 < len(value) <= most


def _check(doc: Any, where: str, fix: str) -> dict:
    """The claim ``doc`` with every field checked (MalformedDataError naming the field otherwise)."""

    def need(ok: bool, field: str, problem: str) -> None:
        datafile.need(ok, where, field, problem, fix)

    need(isinstance(doc, dict) and doc.get("format") == FORMAT, "the claim", f"is not one ({FORMAT} version 1)")
    need(type(doc.get("version")) is int and doc["version"] == 1, "'version'", "must be 1")
    known = {"format", "version", "token", "pid", "host", "boot", "process_start", "started", "tool", "job"}
    need(set(doc) <= known | {"released"}, "the claim", f"holds fields no claim has ({sorted(set(doc) - known)})")
    if doc.get("released") is not None:
        need(doc["released"] is True, "'released'", "must be true when present")
        need(_is_text(doc.get("token"), 64), "'token'", "must be the claim's token")
        return doc
    need(_is_text(doc.get("token"), 64), "'token'", "must be a short text")
    need(datafile.is_count(doc.get("pid"), 1 << 31) and doc["pid"] >= 1, "'pid'", "must be a process id (1 or more)")
    need(_is_text(doc.get("host"), 255), "'host'", "must be a host name")
    need(doc.get("boot") is None or _is_text(doc["boot"], 64), "'boot'", "must be a boot id or null")
    start = doc.get("process_start")
    need(start is None or datafile.is_count(start, 1 << 62), "'process_start'", "must be a count of ticks or null")
    started = doc.get("started")
    need(
        type(started) in (int, float) and math.isfinite(started) and 0 <= started < 1e11,
        "'started'",
        "must be a time in seconds since 1970",
    )
    need(_is_text(doc.get("tool"), 100), "'tool'", "must name the tool")
    need(isinstance(doc.get("job"), str) and len(doc["job"]) <= 1000, "'job'", "must describe the job briefly")
    return doc


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).isoformat(sep=" ", timespec="seconds")


class Claim:
    """The claim of the job writing ``destination`` (its record at ``record``).  :meth:`acquire` takes it or
    raises ConfigError naming the holder; :meth:`release` gives it back (also when the claim is dropped)."""

    def __init__(self, destination: str, record: str, tool: str, job: str) -> None:
        self.destination = destination
        self.url = claim_beside(record)
        self.where = redact(self.url)
        self.token = uuid.uuid4().hex
        self.owner = {
            "format": FORMAT,
            "version": 1,
            "token": self.token,
            "pid": os.getpid(),
            "host": socket.gethostname()[:255] or "localhost",
            "boot": _boot_id(),
            "process_start": (_proc_stat(os.getpid()) or (None, None))[1],
            "started": round(datetime.datetime.now().timestamp(), 3),
            "tool": tool[:100] or "?",
            "job": job[:1000],
        }
        self.held = False
        self._finalizer: Optional[weakref.finalize] = None

    # -- taking it

    def acquire(self) -> None:
        """Take the claim (see the module docstring), or raise ConfigError naming the job that holds it."""
        for _ in range(8):  # each turn ends a stale claim or wins; a claim taken over by others meanwhile: again
            if self._try_create():
                self._finalizer = weakref.finalize(self, _release_unreferenced, self.url, self.token, os.getpid())
                self.held = True
                with _HELD_LOCK:
                    _HELD.add(self.token)
                return
            holder = self._read()
            if holder is None or holder.get("released"):
                continue  # given back meanwhile
            if self._live(holder):
                if holder["pid"] != os.getpid() or holder["host"] != self.owner["host"]:
                    raise self._refusal(holder)
                gc.collect()  # a record of this process that nothing references any more gives its claim back
                holder = self._read()
                if holder is not None and not holder.get("released") and self._live(holder):
                    raise self._refusal(holder)
                continue
            self._take_over(holder)
        raise ConfigError(
            f"{redact(self.destination)}: the claim {self.where} changed hands again and again while this job "
            "tried to take it; another job is starting here: wait for it, or write to another destination"
        )

    def _try_create(self) -> bool:
        """Create the claim if nobody has one: True when this job now holds it."""
        body = json.dumps(self.owner, sort_keys=True).encode("utf-8")
        if not is_local(self.url):
            there = self._read()
            if there is not None and not there.get("released"):
                return False
            self._write(self.owner)
            again = self._read()
            return again is not None and again.get("token") == self.token
        path = local_path(self.url)
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        temp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{self.token[:8]}.claiming")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(body)
            try:
                os.link(temp, path)  # atomic, and fails when a claim is there: one job of many gets it
                return True
            except FileExistsError:
                return False
            except OSError:  # a file system without hard links: exclusive create, then write
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as out:
                    out.write(body)
                return True
        finally:
            try:
                os.unlink(temp)
            except FileNotFoundError:
                pass

    def _read(self) -> Optional[dict]:
        """The claim there now (checked), or None."""
        fix = (
            f"if no job is writing {redact(self.destination)} now, remove {self.where}; "
            "else wait for that job or choose another destination"
        )
        try:
            if is_local(self.url):
                data = read_regular(local_path(self.url), 64 * 1024 + 1, "the job's claim")
                if len(data) > 64 * 1024:
                    raise MalformedDataError(f"{self.where}: the claim is larger than any claim; {fix}")
            else:
                data = datafile.read_bytes(self.url, "job claim", max_size=64 * 1024)
        except ShardNotFoundError:
            return None
        try:
            doc = datafile.parse_json(data, self.where, "job claim") if data else None
        except MalformedDataError:
            raise MalformedDataError(f"{self.where}: the job claim is not JSON text; {fix}", field="syntax") from None
        return _check(doc, self.where, fix)

    def _write(self, doc: dict) -> None:
        from ..io.open import gopen

        with gopen(self.url, "wb") as out:
            out.write(json.dumps(doc, sort_keys=True).encode("utf-8"))

    def _live(self, holder: dict) -> bool:
        """Whether the job named by ``holder`` may still run (anything this host cannot judge counts as live)."""
        if holder["host"] != self.owner["host"]:
            return True
        if holder.get("boot") and self.owner["boot"] and holder["boot"] != self.owner["boot"]:
            return False  # the host rebooted since: no process of that boot runs
        if holder["pid"] == os.getpid():
            with _HELD_LOCK:
                return holder["token"] in _HELD
        return _alive(holder["pid"], holder.get("process_start"))

    def _take_over(self, holder: dict) -> None:
        """Remove the stale claim ``holder`` (and only it: one that replaced it meanwhile is left alone)."""
        log.warning(
            "%s: the claim of %s is stale (that job is gone); this job takes it over",
            self.where,
            self._describe(holder),
        )
        if not is_local(self.url):
            self._write(dict(holder, released=True))
            return
        path = local_path(self.url)
        aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{self.token[:8]}.stale")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return  # another job removed it first
        try:
            moved = json.loads(read_regular(aside, 64 * 1024, "the job's claim"))
        except (ValueError, ConfigError):
            moved = None
        if not isinstance(moved, dict) or moved.get("token") != holder["token"]:
            try:  # a claim made in between (by a job that took the stale one over first): put it back
                os.link(aside, path)
            except OSError:
                pass
        os.unlink(aside)

    @staticmethod
    def _describe(holder: dict) -> str:
        job = f" ({holder['job']})" if holder.get("job") else ""
        return f"{holder['tool']}{job}, pid {holder['pid']} on {holder['host']}, started {_when(holder['started'])}"

    def _refusal(self, holder: dict) -> ConfigError:
        return ConfigError(
            f"{redact(self.destination)}: another job is writing here: {self._describe(holder)} (its claim: "
            f"{self.where}); two jobs into one destination would mix their outputs: wait for it to end, or write "
            f"to another destination; if that job is no longer running, remove {self.where}",
            url=self.destination,
        )

    # -- giving it back

    def release(self) -> None:
        """Give the claim back (idempotent)."""
        if not self.held:
            return
        self.held = False
        if self._finalizer is not None:
            self._finalizer.detach()
        _release(self.url, self.token, os.getpid())


def _release_unreferenced(url: str, token: str, pid: int) -> None:
    """:func:`_release` for a claim nothing refers to any more, called by the garbage collector at any point of
    this thread (it may hold the plugin registry's lock, or a connection pool's): a local claim is removed with
    plain file calls, a remote one on a thread of its own, which waits for those locks instead of re-entering
    them."""
    if is_local(url):
        _release(url, token, pid)
    else:
        threading.Thread(target=_release, args=(url, token, pid), name="wds_cloud job claim release").start()


def _release(url: str, token: str, pid: int) -> None:
    """Remove the claim at ``url`` if it is still the one with ``token`` (a forked child never releases its
    parent's claim)."""
    if os.getpid() != pid:
        return
    with _HELD_LOCK:
        _HELD.discard(token)
    try:
        if is_local(url):
            path = local_path(url)
            held = json.loads(read_regular(path, 64 * 1024, "the job's claim"))
            if isinstance(held, dict) and held.get("token") == token:
                os.unlink(path)
            return
        from ..io.open import gopen

        held = datafile.parse_json(datafile.read_bytes(url, "job claim", max_size=64 * 1024), redact(url))
        if isinstance(held, dict) and held.get("token") == token:
            with gopen(url, "wb") as out:
                out.write(json.dumps({"format": FORMAT, "version": 1, "released": True, "token": token}).encode())
    except Exception as exc:  # noqa: BLE001 (at exit or in a finalizer: report, never raise)
        log.warning("%s: could not give the job's claim back (%s); remove it once no job runs", redact(url), exc)
