"""The start methods of DataLoader workers as a pytest parameter: ``fork`` (a worker inherits the dataset as it
stands), ``spawn`` and ``forkserver`` (a worker receives it pickled; ``forkserver`` is Python 3.14's default on
Linux, ``spawn`` macOS's and Windows').  Tests pass the name as ``multiprocessing_context=``, as users do.

A spawned worker is a fresh interpreter that imports torch (seconds each on two cores), so the parameter goes on
a few representative tests with tiny shards and at most two workers; a forkserver imports torch and wds_cloud once
(:data:`PRELOAD`) and forks its workers from there, which changes nothing of what a worker receives: the pickle.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator

import pytest

#: every start method a DataLoader accepts on Linux
START_METHODS = ("fork", "spawn", "forkserver")

#: fork, and the one of the two pickling start methods whose workers start in a fraction of a second: for tests of
#: which spawn would check nothing forkserver does not (the same pickle) at seconds a worker
FORK_AND_PICKLE = ("fork", "forkserver")

#: what the forkserver imports before it forks workers (a failed import is ignored by multiprocessing)
PRELOAD = ["torch", "wds_cloud"]


def available(method: str) -> str:
    """``method``, after skipping the test where this system lacks it and preloading the forkserver."""
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"this system has no {method!r} start method")
    if method == "forkserver":
        # only read when this process first starts its forkserver; later calls change nothing
        multiprocessing.set_forkserver_preload(PRELOAD)
    return method


@pytest.fixture(params=START_METHODS)
def start_method(request: pytest.FixtureRequest) -> str:
    """The name of a start method for ``multiprocessing_context=``: each of :data:`START_METHODS`, or those a
    test names with ``@pytest.mark.parametrize("start_method", [...], indirect=True)``."""
    return available(request.param)


@contextlib.contextmanager
def program_start_method(method: str) -> Iterator[str]:
    """The program's own start method set to ``method`` (as Python 3.14 sets forkserver, or a program calling
    ``multiprocessing.set_start_method``) while the block runs; the one before is restored after."""
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(available(method), force=True)
    try:
        yield method
    finally:
        multiprocessing.set_start_method(before, force=True)
