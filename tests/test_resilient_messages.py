"""What giving up says about its cause: a host name that does not resolve is not a slow store (new-user finding:
613 lines of 'raise WDS_RETRIES ... if the store is only slow' for a host that does not exist)."""

from __future__ import annotations

import socket

from wds_cloud.errors import TransferError
from wds_cloud.io import resilient


def _caused(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


def test_an_unresolved_host_is_told_apart_from_a_slow_store():
    dns = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert resilient._unresolved(_caused(TransferError("cannot connect https://h.invalid:443"), dns))
    assert resilient._unresolved(TransferError("[Errno -3] Temporary failure in name resolution"))
    assert resilient._unresolved(OSError("curl: (6) Could not resolve host: h.invalid"))
    assert not resilient._unresolved(_caused(TransferError("read timed out"), TimeoutError("timed out")))
    assert not resilient._unresolved(ConnectionResetError(104, "Connection reset by peer"))
