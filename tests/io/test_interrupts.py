"""Ctrl-C during parallel I/O: the interrupt reaches the caller only once no worker or native
operation still uses the file's descriptors or the memory being read or written.

Each test runs a child process that interrupts itself (``os.kill(getpid(), SIGINT)`` from a
watcher thread, once ``/proc/self/io`` shows the transfer under way) in the middle of a
large save or load on a memory file system, then opens
unrelated files (which reuse the closed descriptors' numbers) and checks that nothing more
is read or written by the process: no orphaned transfer goes on after the interrupt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fastckpt.config import IOConfig
from fastckpt.io.executor import Executor
from fastckpt.io.files import File

_SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None

_CHILD = r"""
import json, os, signal, sys, threading, time
import torch
from fastckpt.checkpoint.load import load
from fastckpt.checkpoint.save import save

directory, mode, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
path = os.path.join(directory, "big.safetensors")
state = {f"t{i}": torch.full((nbytes // 8 // 4,), float(i)) for i in range(8)}

def io_counters():
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])

if mode == "load":
    save(state, path, direct_io=False)
def interrupt_after(moved, done):
    # Ctrl-C once `moved` bytes of the transfer have been read or written.
    base = io_counters()[0 if mode == "load" else 1]
    while not done.is_set():
        if io_counters()[0 if mode == "load" else 1] - base >= moved:
            os.kill(os.getpid(), signal.SIGINT)
            return
        time.sleep(0.0005)

attempts = []
for moved_mib in (32, 96, 160, 256, 64, 128):
    done = threading.Event()
    watcher = threading.Thread(target=interrupt_after, args=(moved_mib << 20, done))
    record = {"moved_mib": moved_mib, "interrupted": False}
    try:
        try:
            watcher.start()
            if mode == "save":
                save(state, path, direct_io=False)  # worker threads, from the tensors
            elif mode == "save_staged":
                save(state, path, direct_io=True)  # staging buffers, native executor
            else:
                load(path)
        except KeyboardInterrupt:
            record["interrupted"] = True
            # Files opened now take the numbers of the descriptors just closed.
            victims = [open(os.path.join(directory, f"victim{moved_mib}-{k}"), "wb") for k in range(4)]
            before = io_counters()
            time.sleep(1.0)
            after = io_counters()
            record["victim_bytes"] = sum(os.fstat(v.fileno()).st_size for v in victims)
            record["read_after"] = after[0] - before[0]
            record["written_after"] = after[1] - before[1]
            for v in victims:
                v.close()
        done.set()
        watcher.join()
    except KeyboardInterrupt:  # the watcher fired just after the call returned
        record["late"] = True
    attempts.append(record)
    if sum(a["interrupted"] for a in attempts) >= 3:
        break
print(json.dumps(attempts))
"""


def _run_child(tmp: str, mode: str, nbytes: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    # The threads engine's pwrite/pread show in /proc/self/io (io_uring's do not), which
    # the child watches to interrupt itself mid-transfer.
    env["FASTCKPT_ENGINE"] = "threads"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, tmp, mode, str(nbytes)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(_SHM is None, reason="needs a writable /dev/shm")
@pytest.mark.parametrize("mode", ["save", "save_staged", "load"])
def test_ctrl_c_mid_transfer_leaves_no_orphaned_io(mode):
    with tempfile.TemporaryDirectory(dir=_SHM) as tmp:
        attempts = _run_child(tmp, mode, 512 << 20)
        interrupted = [a for a in attempts if a["interrupted"]]
        assert interrupted, f"no attempt was interrupted mid-{mode}: {attempts}"
        for a in interrupted:
            assert a["victim_bytes"] == 0, f"checkpoint bytes landed in unrelated files: {a}"
            assert a["written_after"] < (1 << 20), f"writes went on after Ctrl-C: {a}"
            assert a["read_after"] < (1 << 20), f"reads went on after Ctrl-C: {a}"
        leftovers = [n for n in os.listdir(tmp) if n.endswith(".tmp")]
        assert not leftovers, f"temporary files left: {leftovers}"


def test_wait_on_unknown_op_raises_value_error(tmp_path):
    ex = Executor(IOConfig(engine="threads"))
    with pytest.raises(ValueError, match="12345"):
        ex.wait(12345)
    with File(tmp_path / "x.bin", write=True, create=True) as f:
        import numpy as np

        data = np.ones(8192, dtype=np.uint8)
        from fastckpt.io.aligned_memory import BufferRef

        op = ex.submit(f, BufferRef(data.ctypes.data, data.nbytes, data), 0, write=True)
        assert ex.is_pending(op)
        ex.wait(op)
        assert not ex.is_pending(op)
        with pytest.raises(ValueError, match=str(op)):
            ex.wait(op)  # already collected


def test_failing_engine_fails_the_op_instead_of_hanging(tmp_path):
    import numpy as np

    from fastckpt import _C

    native = _C.Executor("_failing", 1 << 16, 4, False, True, 1)
    data = np.ones(1 << 18, dtype=np.uint8)
    fd = os.open(tmp_path / "x.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        op = native.submit(-1, fd, data.ctypes.data, data.nbytes, 0, True, "x.bin")
        with pytest.raises(OSError) as info:
            native.wait(op)  # hung forever before the retries were bounded
        assert info.value.errno == 5  # EIO, the engine's own errno
        # The worker got a fresh engine: the next op fails again, promptly.
        op = native.submit(-1, fd, data.ctypes.data, data.nbytes, 0, True, "x.bin")
        with pytest.raises(OSError):
            native.wait(op)
    finally:
        os.close(fd)


def test_file_closed_while_held_stays_open_until_released(tmp_path):
    f = File(tmp_path / "x.bin", write=True, create=True)
    fd = f.fd
    f.hold()
    f.close()
    os.fstat(fd)  # still open: an operation holds it
    f.unhold()
    assert f.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(ValueError, match="closed"):
        f.hold()


def test_cancel_drops_ops_not_started(tmp_path):
    import errno

    import numpy as np

    from fastckpt.io.aligned_memory import BufferRef

    ex = Executor(IOConfig(engine="threads", intra_op_parallelism=1))
    data = np.ones(32 << 20, dtype=np.uint8)
    with File(tmp_path / "x.bin", write=True, create=True) as f:
        ops = [
            ex.submit(
                f, BufferRef(data.ctypes.data, data.nbytes, data), i * data.nbytes, write=True
            )
            for i in range(4)
        ]
        assert ex.cancel(ops[-1])  # one worker, still busy with the first: never started
        assert ex.drain(ops[1:-1]) is None
        ex.wait(ops[0])
        with pytest.raises(OSError) as info:
            ex.wait(ops[-1])
        assert info.value.errno == errno.ECANCELED
        assert not ex.cancel(ops[0])  # collected: nothing to drop
        assert f.size() == 3 * data.nbytes
