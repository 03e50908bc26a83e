"""The native core under failure: out of memory, no threads to be had, offsets near 2**64.

Each scenario that used to crash the process runs in a child interpreter, so a crash fails
the test instead of killing the test runner. Memory and thread creation are made to fail for
real, with ``RLIMIT_AS`` in the child: thread stacks and bounce buffers are mappings, so a
small address-space allowance refuses them (``RLIMIT_NPROC`` would not: it does not bind root).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from fastckpt import _C
from fastckpt.aio import aio_handle

MiB = 1 << 20

# Shared by the children: the address space in use now, and a limit of `extra` bytes more.
# One malloc arena and a fixed mmap threshold make "a block-sized allocation is a mapping of
# its own" hold for every allocation, from any thread.
PRELUDE = textwrap.dedent(
    """
    import resource

    def vm_size():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmSize in /proc/self/status")

    SOFT, HARD = resource.getrlimit(resource.RLIMIT_AS)

    def limit_address_space(extra):
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + extra, HARD))

    def lift_limit():
        resource.setrlimit(resource.RLIMIT_AS, (SOFT, HARD))
    """
)
CHILD_ENV = {**os.environ, "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}


def run_child(code: str, timeout: float = 120) -> str:
    """Runs `code` in a fresh interpreter; fails unless it exits 0 (a signal is a failure)."""
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=CHILD_ENV,
    )
    if proc.returncode < 0:
        pytest.fail(f"child killed by signal {-proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def require_o_direct(path) -> None:
    """The bounce-buffer path only runs where the file system takes O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        pytest.skip(f"no O_DIRECT on {path}: {exc}")
    os.close(fd)


def test_bounce_buffer_enomem_mid_batch_drains_in_flight_reads(engine, tmp_path):
    # Memory misaligned by one byte is read through aligned bounce buffers, one per request
    # in flight. With room for one, the second allocation fails while the first read is in
    # flight: the op must fail with ENOMEM only after that read has completed. Failing at once
    # freed the buffer under the read, and the next op reaped its stale completion (SIGSEGV,
    # a spinning io_uring reap, EINVAL from io_getevents).
    path = tmp_path / "data.bin"
    data = np.random.default_rng(1).integers(0, 256, 32 * MiB, dtype=np.uint8)
    data.tofile(path)
    require_o_direct(path)
    out = run_child(
        f"""
        import errno
        import numpy as np, torch
        from fastckpt.aio import aio_handle

        path = {str(path)!r}
        expected = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        handle = aio_handle(block_size=8 << 20, queue_depth=8, intra_op_parallelism=1,
                            engine={engine!r})
        raw = torch.zeros(expected.numel() + 1, dtype=torch.uint8)
        buffer = raw[1:]  # one byte past an aligned start
        handle.sync_pread(buffer[:4096], path)  # workers and engine up before the limit

        limit_address_space(14 << 20)  # one 8 MiB bounce buffer fits, two do not
        for attempt in range(3):
            try:
                handle.sync_pread(buffer, path)
            except OSError as exc:
                assert exc.errno == errno.ENOMEM, exc
                assert exc.filename == path, exc
            else:
                raise AssertionError("the read succeeded with room for one bounce buffer")
        lift_limit()

        # Nothing stale is left in the engine: the next reads are whole and right.
        for attempt in range(2):
            buffer.zero_()
            handle.sync_pread(buffer, path)
            assert torch.equal(buffer, expected)
        print("ok")
        """,
        timeout=60,
    )
    assert out.strip() == "ok"


def test_parallel_memcpy_without_threads_copies_on_the_calling_thread():
    # A thread that cannot be created after others started used to destroy the started ones
    # unjoined: std::terminate, SIGABRT. The copy must finish, its parts done on the caller.
    out = run_child(
        """
        import threading
        import numpy as np
        from fastckpt import _C

        src = np.random.default_rng(2).integers(0, 256, 64 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        address = lambda a: a.__array_interface__["data"][0]

        # What one thread costs here: its stack (plus guard), measured.
        gate = threading.Event()
        before = vm_size()
        probe = threading.Thread(target=gate.wait)
        probe.start()
        per_thread = vm_size() - before
        gate.set()
        probe.join()
        assert per_thread > 0, per_thread

        # The exited thread's stack stays cached and serves one new thread; half a stack
        # more refuses the next. So the copy gets one helper and then no more.
        limit_address_space(per_thread // 2)
        _C.memcpy(address(dst), address(src), src.nbytes, 8)

        # The limit is real: two threads at once cannot be had.
        gate.clear()
        started = []
        try:
            for _ in range(2):
                t = threading.Thread(target=gate.wait)
                t.start()
                started.append(t)
        except RuntimeError:
            refused = True
        else:
            refused = False
        gate.set()
        for t in started:
            t.join()
        lift_limit()
        assert refused, "thread creation did not fail under the limit"
        assert np.array_equal(dst, src)
        print("ok")
        """,
        timeout=60,
    )
    assert out.strip() == "ok"


def test_executor_without_threads_fails_cleanly_or_runs_on_fewer(engine, tmp_path):
    # The executor's workers and the threads engine's pool had the same flaw as the memcpy:
    # a refused thread after the first aborted the process. Now a pool runs on the threads it
    # got, and one that got none raises OSError before anything started.
    path = tmp_path / "data.bin"
    out = run_child(
        f"""
        import errno, threading
        import torch
        from fastckpt.aio import aio_handle

        path = {str(path)!r}
        data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
        back = torch.zeros_like(data)

        gate = threading.Event()
        before = vm_size()
        probe = threading.Thread(target=gate.wait)
        probe.start()
        per_thread = vm_size() - before
        gate.set()
        probe.join()

        limit_address_space(per_thread // 2)
        try:
            handle = aio_handle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=4,
                                engine={engine!r})
            handle.sync_pwrite(data, path)
            handle.sync_pread(back, path)
        except OSError as exc:
            assert exc.errno in (errno.EAGAIN, errno.ENOMEM), exc
            print("refused", exc.errno)
        else:
            assert torch.equal(back, data)
            print("ran")
        """,
        timeout=60,
    )
    assert out.split()[0] in ("ran", "refused"), out


def test_error_message_carries_strerror_once(engine, tmp_path):
    # The worker stored the message with strerror appended, and wait() appended it again:
    # "... hit the end of the file: No data available: No data available".
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    buffer = _C.AlignedBuffer(8192)
    executor = _C.Executor(engine, 4096, 2, False, True, 1)
    fd = os.open(path, os.O_RDONLY)
    try:
        op = executor.submit(-1, fd, buffer.address, buffer.nbytes, 0, False, str(path))
        with pytest.raises(OSError) as info:
            executor.wait(op)
    finally:
        os.close(fd)
    assert info.value.errno == errno.ENODATA, info.value
    assert str(info.value).count(os.strerror(errno.ENODATA)) == 1, str(info.value)
    assert "hit the end of the file" in str(info.value)
    assert info.value.filename == str(path)


def test_overflowing_offsets_are_refused_before_any_io(engine, tmp_path):
    # offset + k * share wrapped past 2**64: a write meant for the file's last exabytes
    # landed at offset 0, over the data there.
    path = tmp_path / "data.bin"
    original = bytes(range(256)) * 64
    path.write_bytes(original)
    handle = aio_handle(block_size=4096, queue_depth=4, intra_op_parallelism=2, engine=engine)
    data = torch.full((8192,), 7, dtype=torch.uint8)
    for offset in (2**64 - 4096, 2**63 - 100, 2**63):
        with pytest.raises(OSError) as info:
            handle.sync_pwrite(data, str(path), file_offset=offset)
        assert info.value.errno == errno.EOVERFLOW, info.value
        assert str(offset) in str(info.value)
        assert info.value.filename == str(path)
    assert path.read_bytes() == original
    handle.sync_pwrite(data, str(path), file_offset=4096)  # an ordinary write still works
    assert path.read_bytes()[4096:12288] == bytes(data.numpy())


def test_waiting_for_one_op_from_several_threads(tmp_path):
    # wait() kept a map iterator across the condition wait; a second waiter (wait(id) or
    # wait_all()) erased the entry, and the first then erased it again through the stale
    # iterator (heap corruption). Every waiter must return, the op collected exactly once.
    path = tmp_path / "sparse.bin"
    with open(path, "wb") as f:
        f.truncate(64 * MiB)
    out = run_child(
        f"""
        import os, threading
        from fastckpt import _C

        path = {str(path)!r}
        fd = os.open(path, os.O_RDONLY)
        buffer = _C.AlignedBuffer(64 << 20)
        # Small blocks on one queue slot: the read stays in flight while the waiters block.
        executor = _C.Executor("threads", 64 << 10, 1, False, True, 1)
        for round_ in range(5):
            op = executor.submit(-1, fd, buffer.address, buffer.nbytes, 0, False, path)
            errors = []

            def waiter(fn):
                try:
                    fn()
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=waiter, args=(lambda: executor.wait(op),))
                       for _ in range(3)]
            threads.append(threading.Thread(target=waiter, args=(executor.wait_all,)))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            # A waiter that starts only after another collected the op is told so (a second
            # wait on a collected op is a ValueError); anything else is a failure.
            late = [e for e in errors if isinstance(e, ValueError) and "already waited" in str(e)]
            assert len(late) == len(errors) < len(threads), errors
            assert executor.pending() == 0
        os.close(fd)
        print("ok")
        """,
        timeout=60,
    )
    assert out.strip() == "ok"
