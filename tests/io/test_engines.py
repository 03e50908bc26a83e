"""The native module: its stub matches it, and its primitives are right."""

from __future__ import annotations

import ast
import errno
import inspect
import os
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from fastckpt import _C
from fastckpt.io.aligned_memory import aligned_array

STUB = Path(_C.__file__).resolve().parent / "_C.pyi"
if not STUB.exists():  # editable installs keep the stub in the source tree
    STUB = Path(__file__).resolve().parents[2] / "fastckpt" / "_C.pyi"


def _stub_names() -> dict[str, set[str]]:
    tree = ast.parse(STUB.read_text())
    names: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = set()  # a constant, e.g. DIRECT_IO_ALIGNMENT: int
    return names


def test_stub_matches_module():
    stub = _stub_names()
    public = {n for n in dir(_C) if not n.startswith("_")}
    assert set(stub) >= public, f"missing from _C.pyi: {sorted(public - set(stub))}"
    for name, members in stub.items():
        assert hasattr(_C, name), f"_C.pyi describes {name}, which _C does not have"
        for member in members - {"__init__"}:
            assert hasattr(getattr(_C, name), member), f"_C.{name} has no {member}"


def test_stub_signatures_match_docstrings():
    # pybind11 puts the real signature in each function's docstring.
    tree = ast.parse(STUB.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            doc = inspect.getdoc(getattr(_C, node.name)) or ""
            params = [a.arg for a in node.args.args]
            native = re.findall(r"(\w+): ", doc.split("->")[0])
            assert native == params, (node.name, native, params)


def crc32c_reference(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


# Sizes around the 3 x 8 KiB stripes of the interleaved hardware path; odd starts too.
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 1000, 24575, 24576, 24577, 65537, 73733])
@pytest.mark.parametrize("skew", [0, 3])
def test_crc32c_matches_reference(n, skew):
    buffer = np.random.default_rng(n).integers(0, 256, n + skew, dtype=np.uint8)
    data = buffer[skew:]
    addr = data.__array_interface__["data"][0]
    expected = crc32c_reference(data.tobytes())
    assert _C.crc32c(addr, n) == expected
    # Extending piece by piece gives the same value.
    half = n // 2
    assert _C.crc32c(addr + half, n - half, _C.crc32c(addr, half)) == expected


def test_crc32c_known_value():
    data = np.frombuffer(b"123456789", dtype=np.uint8)
    assert _C.crc32c(data.__array_interface__["data"][0], 9) == 0xE3069283
    assert zlib.crc32(b"123456789") != 0xE3069283  # not plain CRC32


def test_aligned_buffer_and_locking():
    buf = _C.AlignedBuffer(10_000, lock=True)
    assert buf.address % 4096 == 0 and buf.nbytes == 10_000
    assert buf.locked == _C.is_locked(buf.address)
    assert not _C.is_locked(aligned_array(4096).__array_interface__["data"][0])
    view = memoryview(buf)
    assert view.nbytes == 10_000 and not view.readonly
    big = _C.AlignedBuffer(8 << 20)
    assert big.address % (2 << 20) == 0  # huge-page aligned


# Around the streaming-store path (1 MiB per thread and up), with every misalignment of the
# destination against 16 bytes and of the source against it.
@pytest.mark.parametrize("n", [(1 << 20) - 1, 1 << 20, (1 << 20) + 63, (9 << 20) + 5])
@pytest.mark.parametrize("dst_skew,src_skew", [(0, 0), (1, 0), (0, 7), (15, 3), (8, 8)])
@pytest.mark.parametrize("threads", [1, 2])
def test_memcpy_streaming_path(n, dst_skew, src_skew, threads):
    rng = np.random.default_rng(n + dst_skew)
    src_block = rng.integers(0, 256, n + 64, dtype=np.uint8)
    dst_block = np.zeros(n + 64, dtype=np.uint8)
    src = src_block[src_skew : src_skew + n]
    dst = dst_block[dst_skew : dst_skew + n]
    _C.memcpy(dst.__array_interface__["data"][0], src.__array_interface__["data"][0], n, threads)
    assert np.array_equal(dst, src)
    assert not dst_block[:dst_skew].any() and not dst_block[dst_skew + n :].any()  # no overrun


def test_parallel_memcpy():
    src = np.arange(3_000_000, dtype=np.int64)
    dst = np.zeros_like(src)
    _C.memcpy(dst.__array_interface__["data"][0], src.__array_interface__["data"][0], src.nbytes, 4)
    assert np.array_equal(src, dst)


def test_unknown_engine_name():
    with pytest.raises(ValueError):
        _C.engine_status("floppy")


def test_links_only_the_c_and_cxx_runtimes():
    import shutil
    import subprocess

    if shutil.which("ldd") is None:
        pytest.skip("no ldd")
    out = subprocess.run(["ldd", _C.__file__], capture_output=True, text=True, check=True).stdout
    allowed = (
        "linux-vdso",
        "libstdc++",
        "libgcc_s",
        "libc.",
        "ld-linux",
        "libm.",
        "libpthread",
        "libdl",
    )
    for line in out.splitlines():
        name = os.path.basename(line.strip().split()[0])
        assert name.startswith(allowed), f"_C links {name}"


def test_blocking_calls_release_the_gil(tmp_path):
    import threading

    import torch

    from fastckpt.aio import aio_handle

    h = aio_handle(engine="threads", queue_depth=2, block_size=1 << 20)
    data = torch.zeros(256 << 20, dtype=torch.uint8)
    done = threading.Event()
    ticks = 0

    def io() -> None:
        h.sync_pwrite(data, str(tmp_path / "gil.bin"))
        h.sync_pread(data, str(tmp_path / "gil.bin"))
        done.set()

    worker = threading.Thread(target=io)
    worker.start()
    while not done.is_set():
        ticks += 1  # runs only while the I/O thread does not hold the GIL
    worker.join()
    assert ticks > 10_000


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_preallocate_reserves_blocks(tmp_path, where):
    directory = tmp_path if where == "disk" else Path("/dev/shm")
    if not directory.is_dir():
        pytest.skip("no /dev/shm")
    path = directory / f"fastckpt-prealloc-{os.getpid()}.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        assert _C.preallocate(fd, 3 << 20, str(path)) in (True, False)
        st = os.fstat(fd)
        if st.st_size:  # the file system supports it
            assert st.st_size == 3 << 20 and st.st_blocks * 512 >= 3 << 20
        assert _C.preallocate(fd, 0, str(path)) is True
    finally:
        os.close(fd)
        os.unlink(path)


def test_preallocate_errors_carry_errno_and_filename(tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            _C.preallocate(fd, 1 << 20, str(path))
        assert info.value.errno == errno.EBADF and info.value.filename == str(path)
    finally:
        os.close(fd)


_REUSE_CHILD = """
import os
import numpy as np
from fastckpt import _C

def tasks():
    return set(os.listdir("/proc/self/task"))

src = np.random.default_rng(3).integers(0, 256, 32 << 20, dtype=np.uint8)
dst = np.zeros_like(src)
address = (dst.__array_interface__["data"][0], src.__array_interface__["data"][0])
before = tasks()
_C.memcpy(*address, src.nbytes, 4)
helpers = tasks() - before
assert helpers, "no helper thread outlived the copy"
for _ in range(10):
    dst[:] = 0
    _C.memcpy(*address, src.nbytes, 4)
    assert np.array_equal(dst, src)
assert tasks() - before == helpers, "new threads for later copies"
print("ok")
"""


def test_parallel_memcpy_reuses_its_threads():
    # A persistent pool, not a new thread per call: after a first parallel copy its helper
    # threads stay, and later copies run on those same threads (a fresh process, so no
    # earlier test has started the pool).
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _REUSE_CHILD], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
