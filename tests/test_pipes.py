"""wds_cloud.loader.pipes: a DataLoader worker's result pipe holds a quarter of a 1 MiB batch, within the user's
pipe allowance."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import wds_cloud as wds
from wds_cloud.loader import pipes

pytestmark = pytest.mark.skipif(pipes.context() is None, reason="pipes are widened on Linux only")


def _put_one(queue) -> None:
    queue.put(b"x" * 1000)


def test_a_queue_is_widened_when_a_worker_puts_into_it_not_when_the_main_process_does():
    ctx = pipes.context()
    results, tasks = ctx.Queue(), ctx.Queue()
    tasks.put(1)  # the main process puts (a DataLoader's index queues): left as it is
    assert tasks.capacity() == 65536 and tasks.get() == 1
    worker = ctx.Process(target=_put_one, args=(results,))
    worker.start()
    assert results.get(timeout=60) == b"x" * 1000
    worker.join(60)
    assert results.capacity() == pipes.PIPE_BYTES


def test_a_refused_widening_raises_nothing():
    import os

    reader, writer = os.pipe()
    other = os.open(os.devnull, os.O_RDONLY)
    try:
        assert pipes.widen(writer, 1 << 17)
        assert not pipes.widen(other, 1 << 17)  # not a pipe: refused by the kernel, False
        assert not pipes.widen(-1)
    finally:
        for fd in (reader, writer, other):
            os.close(fd)


def _tiny_shards(tmp_path) -> list:
    urls = []
    for s in range(2):
        path = tmp_path / f"s{s}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(20 * s, 20 * s + 20):
                sink.write({"__key__": f"{i:03d}", "bin": bytes([i]) * 30000})
        urls.append(str(path))
    return urls


def test_webloader_gives_its_workers_the_wide_context_unless_the_program_chose_one(tmp_path):
    pytest.importorskip("torch")
    url = _tiny_shards(tmp_path)
    ds = wds.WebDataset(url, shardshuffle=False).to_tuple("__key__", "bin").batched(8)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=2)
    assert loader.pipeline[0].multiprocessing_context is pipes.context()
    assert sorted(k for keys, _ in loader for k in keys) == [f"{i:03d}" for i in range(40)]
    chosen = wds.WebLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert chosen.pipeline[0].multiprocessing_context.get_start_method() == "fork"
    assert not isinstance(chosen.pipeline[0].multiprocessing_context, type(pipes.context()))
    assert wds.WebLoader(ds, batch_size=None).pipeline[0].multiprocessing_context is None  # no workers


def test_the_wide_context_follows_the_programs_start_method_spawn_included(tmp_path):
    """A program that sets the spawn start method (after making the loader, even) gets spawned workers, whose
    queue crosses to them pickled."""
    pytest.importorskip("torch")
    url = _tiny_shards(tmp_path)
    script = textwrap.dedent(
        f"""
        import multiprocessing
        import wds_cloud as wds

        if __name__ == "__main__":
            ds = wds.WebDataset({url!r}, shardshuffle=False).to_tuple("__key__", "bin").batched(8)
            loader = wds.WebLoader(ds, batch_size=None, num_workers=2)
            multiprocessing.set_start_method("spawn")
            keys = sorted(k for keys, _ in loader for k in keys)
            assert keys == [f"{{i:03d}}" for i in range(40)], keys
            assert loader.pipeline[0].multiprocessing_context.get_start_method() == "spawn"
            print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_no_pipe_is_widened_where_the_users_allowance_is_small(tmp_path, monkeypatch):
    """The 44 adversary's finding: wide pipes spend the per-user allowance, past which the kernel gives every new
    pipe of the user 2 pages.  Each takes 64 pages (not 256), and where the allowance is below the floor none is
    widened."""
    import os

    assert pipes.PIPE_BYTES == 64 * 4096
    small = tmp_path / "soft"
    small.write_text(f"{pipes.ALLOWANCE_FLOOR - 1}\n")
    monkeypatch.setattr(pipes, "_ALLOWANCE", str(small))
    reader, writer = os.pipe()
    try:
        assert not pipes.widen(writer)
        small.write_text("0\n")  # no allowance at all (unlimited)
        assert pipes.widen(writer)
    finally:
        os.close(reader)
        os.close(writer)
    monkeypatch.setattr(pipes, "_ALLOWANCE", str(tmp_path / "absent"))
    assert pipes.allowance() == 16384


def _put_many(queue, sizes) -> None:
    for size in sizes:
        queue.put((size, bytes([size % 251]) * size, [b"x" * 100] * 3))


def test_messages_of_any_size_cross_whole_into_one_buffer():
    """The main process reads each message straight into one buffer of its size (multiprocessing's own receive
    copies it in pieces into a growing buffer): every size arrives whole, in order."""
    ctx = pipes.context()
    queue = ctx.Queue()
    sizes = [0, 1, 511, 65_536, 262_144, 262_145, 3_000_000, 7]
    worker = ctx.Process(target=_put_many, args=(queue, sizes))
    worker.start()
    for size in sizes:
        got = queue.get(timeout=120)
        assert got == (size, bytes([size % 251]) * size, [b"x" * 100] * 3)
    worker.join(60)


def test_a_message_cut_short_is_an_error_not_a_short_read():
    import os
    import struct

    reader, writer = os.pipe()
    try:
        os.write(writer, struct.pack("!i", 10) + b"abc")
        os.close(writer)
        writer = -1
        with pytest.raises(OSError, match="end of file during message"):
            pipes._read_exactly(reader, 4) and pipes._read_exactly(reader, 10)
        with pytest.raises(EOFError):
            pipes._read_exactly(reader, 4)
    finally:
        os.close(reader)
        if writer >= 0:
            os.close(writer)


def _pause() -> str:
    import time

    time.sleep(0.002)  # lets another thread run while this message is being unpickled
    return "paused"


class _Pausing:
    """Unpickled by running Python code that gives up the GIL, in the middle of its message."""

    def __reduce__(self):
        return (_pause, ())


def _put_numbered(queue, count: int, size: int) -> None:
    for i in range(count):
        queue.put((i, _Pausing(), bytes([i % 251]) * (size + i), bytearray([i % 7]) * 100))


def test_what_a_message_unpickled_to_survives_the_next_one_read_into_the_kept_buffer():
    """A message of up to KEPT_BYTES is read into a buffer the receiving thread keeps: the objects of one
    message stay as they were after the next messages are read into that buffer, larger ones (a buffer of
    their own) and smaller ones alike."""
    ctx = pipes.context()
    queue = ctx.Queue()
    sizes = [300_000, 1000, pipes.KEPT_BYTES, pipes.KEPT_BYTES + 1, 200_000, 5]
    worker = ctx.Process(target=_put_many, args=(queue, sizes))
    worker.start()
    got = [queue.get(timeout=120) for _ in sizes]
    worker.join(60)
    assert got == [(size, bytes([size % 251]) * size, [b"x" * 100] * 3) for size in sizes]


def test_threads_receiving_from_one_queue_each_read_into_their_own_buffer():
    """Two threads of one process take messages from the same queue: a message is unpickled after the queue's
    lock is let go, and unpickling may run Python code (here code that gives up the GIL half way), so each thread
    reads into its own kept buffer: neither overwrites the message the other is still unpickling."""
    import threading

    ctx = pipes.context()
    queue = ctx.Queue()
    count, size = 200, 150_000
    worker = ctx.Process(target=_put_numbered, args=(queue, count, size))
    worker.start()
    received: list = []
    bad: list = []

    def take(n: int) -> None:
        for _ in range(n):
            try:
                i, paused, data, tail = queue.get(timeout=120)
            except Exception as exc:  # a message unpickled from bytes overwritten under it (each get takes one)
                bad.append(repr(exc))
                continue
            if paused != "paused" or data != bytes([i % 251]) * (size + i) or tail != bytearray([i % 7]) * 100:
                bad.append(i)
            received.append(i)

    threads = [threading.Thread(target=take, args=(count // 2,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    worker.join(60)
    assert not bad
    assert sorted(received) == list(range(count))


def test_a_webloader_with_workers_imports_what_their_seeding_needs_once_before_forking_them(tmp_path):
    """torch's worker loop seeds numpy's global generator, importing numpy.random in every forked worker of every
    epoch unless the main process has: a WebLoader with workers imports it before its first workers start; one
    without workers imports nothing for them."""
    script = tmp_path / "probe.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import wds_cloud as wds
            none = wds.WebLoader([1, 2, 3], batch_size=None, num_workers=0)
            assert list(none) == [1, 2, 3]
            print("numpy.random" in sys.modules)
            loader = wds.WebLoader(wds.DataPipeline(lambda: iter(range(4))), batch_size=None, num_workers=1)
            print("numpy.random" in sys.modules)
            print(sorted(loader), "numpy.random" in sys.modules)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["False", "False", "[0, 1, 2, 3] True"]


def _frame(obj) -> bytes:
    import pickle
    import struct

    data = pickle.dumps(obj)
    return struct.pack("!i", len(data)) + data


def _queues():
    import multiprocessing

    return [("multiprocessing", multiprocessing.get_context("fork").Queue()), ("wide", pipes.context().Queue())]


def _outcome(call):
    try:
        return ("value", call())
    except Exception as exc:  # what each queue raises, compared by type and message
        return (type(exc).__name__, str(exc))


def test_a_negative_length_reads_as_multiprocessing_reads_it_not_as_the_last_message_again():
    """A length below -1 is nothing to multiprocessing (its unpickling fails: EOFError); the kept buffer's last
    message was returned a second time (adversary finding)."""
    import os
    import struct

    got = {}
    for name, queue in _queues():
        for frame in (_frame(("batch", b"A" * 1000)), struct.pack("!i", -5)):
            queue._sem.acquire()  # as put() counts a message
            os.write(queue._writer.fileno(), frame)
        first = queue.get(timeout=60)
        got[name] = (first, _outcome(lambda q=queue: q.get(timeout=60)))
    assert got["wide"] == got["multiprocessing"]
    assert got["wide"][1][0] == "EOFError"


@pytest.mark.parametrize("head", [b"\x00\x00\x00\x64", b"\xff\xff\xff\xff", b"\xff\xff\xff\xff" + bytes(7) + b"\x0a"])
def test_the_end_of_the_pipe_right_after_a_length_is_eoferror_as_in_multiprocessing(head):
    """No byte of what the length announces arrived: EOFError, as multiprocessing says (it was OSError)."""
    import os

    got = {}
    for name, queue in _queues():
        os.write(queue._writer.fileno(), head)
        queue._writer.close()
        got[name] = _outcome(queue.get)
    assert got["wide"] == got["multiprocessing"] == ("EOFError", "")


_NESTED_QUEUE: list = []


def _nested_get():
    return _NESTED_QUEUE[0].get(timeout=60)


class _Nesting:
    """Unpickled by taking the next message from the same queue, in the same thread."""

    def __reduce__(self):
        return (_nested_get, ())


def test_a_get_asked_while_a_message_is_unpickled_does_not_read_into_the_buffer_under_it():
    """An object whose unpickling takes the next message from the same queue: that message goes into a buffer
    of its own, not the kept one the outer message is still being read from (it failed to unpickle)."""
    queue = pipes.context().Queue()
    _NESTED_QUEUE[:] = [queue]
    try:
        queue.put([_Nesting(), b"outer" * 200, {"k": list(range(50))}])
        queue.put(b"Z" * 5000 + b"inner")
        outer = queue.get(timeout=60)
    finally:
        _NESTED_QUEUE.clear()
    assert outer == [b"Z" * 5000 + b"inner", b"outer" * 200, {"k": list(range(50))}]


def test_a_numpy_random_that_fails_to_import_is_left_to_the_workers(tmp_path):
    """The import before forking never raises in the main process, whatever numpy.random raises (SystemExit
    included): the workers meet it as they would without it (adversary finding)."""
    script = tmp_path / "probe.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import numpy
            from wds_cloud.loader import webloader

            class Refuse:
                def find_spec(self, name, path=None, target=None):
                    if name == "numpy.random":
                        raise SystemExit(3)

            sys.modules.pop("numpy.random", None)
            sys.meta_path.insert(0, Refuse())
            webloader._imported_for_workers()
            print("ok")
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr


def test_a_length_claiming_more_than_arrives_takes_memory_only_as_bytes_arrive(tmp_path):
    """A frame claiming 1.5 GiB, then 3 bytes and the end of the pipe: the error multiprocessing gives, with memory
    taken as bytes arrive (the whole claim was allocated and zero-filled first; adversary finding)."""
    script = tmp_path / "probe.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, resource, struct
            from wds_cloud.loader import pipes
            queue = pipes.context().Queue()
            os.write(queue._writer.fileno(), struct.pack("!iQ", -1, 1536 << 20) + b"abc")
            queue._writer.close()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            try:
                queue.get(timeout=60)
                print("no error")
            except OSError as exc:
                print(exc)
            print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    message, grew = done.stdout.split("\n")[:2]
    assert message == "got end of file during message" and int(grew) < 64, done.stderr


def test_waiting_for_a_message_makes_no_selector_and_answers_as_multiprocessing_does(monkeypatch):
    """The queue waits for a batch with a poll object each receiving thread keeps (the connection's made,
    registered and closed a selector per batch): no selector per get, and the same answers as multiprocessing's
    queue: a message, Empty on a timeout and on get_nowait, empty(), and EOFError once the writer is gone."""
    import multiprocessing.connection
    import os

    made: list = []
    real = multiprocessing.connection.wait
    monkeypatch.setattr(multiprocessing.connection, "wait", lambda *a, **k: (made.append(1), real(*a, **k))[1])
    got = {}
    for name, q in _queues():
        made.clear()
        outcomes = [_outcome(lambda q=q: q.get(timeout=0.01)), _outcome(q.get_nowait), q.empty()]
        for i in range(50):
            q._sem.acquire()  # as put() counts a message
            os.write(q._writer.fileno(), _frame(("batch", i)))
        outcomes.append(q.empty())
        outcomes += [q.get(timeout=60) for _ in range(50)]
        outcomes.append(_outcome(lambda q=q: q.get(timeout=0)))
        q._writer.close()
        outcomes.append(_outcome(lambda q=q: q.get(timeout=60)))
        got[name] = (outcomes, len(made))
    (wide, selectors), (plain, _) = got["wide"], got["multiprocessing"]
    assert wide == plain
    assert wide[0][0] == wide[1][0] == "Empty" and wide[-1][0] == "EOFError" and wide[2] is True and wide[3] is False
    assert selectors == 0


def _get_all(queue, count: int, out) -> None:
    out.put([queue.get(timeout=120) for _ in range(count)])


def test_the_main_process_writes_small_messages_itself_in_order_and_never_waits_on_a_full_pipe():
    """The process that made a queue writes a small message (an index) itself, no feeder thread started; where
    the pipe has no room, or the message is large, the feeder thread takes it and every message after it: a
    reader gets them all, in order, and put() never blocks on a full pipe."""
    import multiprocessing

    ctx = pipes.context()
    q = ctx.Queue()
    for i in range(10):
        q.put(("index", i))
    assert q._thread is None  # no feeder thread for small messages with room
    messages = [("index", i) for i in range(10)]
    i = 10
    while q._thread is None:  # nobody reads: the pipe fills, then the feeder thread takes over
        q.put(("index", i))
        messages.append(("index", i))
        i += 1
    assert i < 10_000
    big = ("batch", b"x" * 100_000)
    q.put(big)
    messages.append(big)
    messages += [("index", j) for j in range(i, i + 20)]
    for message in messages[-20:]:
        q.put(message)
    out = multiprocessing.get_context("fork").SimpleQueue()
    reader = multiprocessing.get_context("fork").Process(target=_get_all, args=(q, len(messages), out))
    reader.start()
    assert out.get() == messages
    reader.join(60)
    assert reader.exitcode == 0


def _hold_the_write_lock(q, holding, release):
    with q._wlock:  # as a worker writing a large message into a pipe nobody reads holds it
        holding.set()
        release.wait(120)


def test_the_main_process_never_waits_for_a_lock_a_worker_holds():
    """The adversary's finding: with ``pin_memory=True`` torch's shutdown puts into the result queue from the main
    process; where a worker was writing a message larger than the pipe (nobody reading any more), it held the
    queue's write lock, and the main process's direct write waited for that lock for ever.  It never waits for it:
    the feeder thread takes the message, and sends it once the lock is free."""
    import multiprocessing
    import threading

    fork = multiprocessing.get_context("fork")
    q = pipes.context().Queue()
    holding, release = fork.Event(), fork.Event()
    worker = fork.Process(target=_hold_the_write_lock, args=(q, holding, release))
    worker.start()
    try:
        assert holding.wait(60)
        done = threading.Event()
        threading.Thread(target=lambda: (q.put((None, None)), done.set()), daemon=True).start()
        assert done.wait(60), "put() waited for the write lock a worker holds"
    finally:
        release.set()
    assert q.get(timeout=60) == (None, None)
    worker.join(60)
    assert worker.exitcode == 0
