"""Conformance suite of the DeepNVMe API, run against every engine available here."""

from __future__ import annotations

import gc
import os
import stat
import time

import numpy as np
import pytest
import torch

import fastckpt
from fastckpt import aio
from fastckpt.aio import aio_handle, aio_read, aio_write, deepspeed_memcpy

SIZES = [0, 1, 511, 4095, 4096, 4097, (1 << 20) + 3]
OFFSETS = [0, 1, 4096 + 7]


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed + n)
    )


def make_handle(engine: str, **kwargs) -> aio_handle:
    # Small blocks and several workers so that even 1 MiB ops are split into many requests.
    settings = dict(block_size=64 * 1024, queue_depth=4, intra_op_parallelism=3)
    settings.update(kwargs)
    return aio_handle(**settings, engine=engine)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("nbytes", SIZES)
def test_awkward_sizes_round_trip(engine, io_dir, nbytes, offset):
    h = make_handle(engine)
    path = os.path.join(io_dir, "data.bin")
    data = random_bytes(nbytes)
    assert h.sync_pwrite(data, path, offset) == 1
    assert os.path.getsize(path) == (offset + nbytes if nbytes else 0)
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read() == data.numpy().tobytes()

    back = torch.empty_like(data)
    assert h.async_pread(back, path, offset) == 0
    assert h.wait() == 1
    assert torch.equal(back, data)

    # A misaligned destination goes through the bounce buffers.
    misaligned = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
    assert h.read(misaligned, path, True, offset) == 0  # DeepSpeed's read returns 0
    assert torch.equal(misaligned, data)


@pytest.mark.parametrize("method", ["read", "write", "pread", "pwrite", "sync", "async"])
def test_every_io_method(engine, tmp_path, method):
    h = make_handle(engine)
    path = str(tmp_path / "t.bin")
    src = torch.randn(50_000)
    dst = torch.zeros_like(src)
    if method in ("read", "write"):
        assert h.write(src, path, True) == 0
        assert h.read(dst, path, True) == 0
    elif method == "pwrite":
        assert h.pwrite(src, path, True, False) == 1
        assert h.pwrite(src, path, False, True) == 0  # DeepSpeed's positional async flag
        assert h.wait() == 1
        assert h.pread(dst, path, False, **{"async": False}) == 1
    elif method == "pread":
        h.sync_pwrite(src, path)
        assert h.pread(dst, path, True, **{"async": True}) == 0
        assert h.wait() == 1
    elif method == "sync":
        assert h.sync_pwrite(src, path) == 1
        assert h.sync_pread(dst, path) == 1
    else:
        assert h.async_pwrite(src, path) == 0
        assert h.wait() == 1
        assert h.async_pread(dst, path) == 0
        assert h.wait() == 1
    assert torch.equal(src, dst)


def test_async_queue_of_several_ops(engine, tmp_path):
    h = make_handle(engine, overlap_events=True)
    tensors = [torch.randn(1000 * (i + 1)) for i in range(6)]
    for i, t in enumerate(tensors):
        assert h.async_pwrite(t, str(tmp_path / f"{i}.bin")) == 0
    assert h.wait() == 6
    assert h.wait() == 0
    outs = [torch.empty_like(t) for t in tensors]
    for i, o in enumerate(outs):
        h.async_pread(o, str(tmp_path / f"{i}.bin"))
    assert h.wait() == 6
    for t, o in zip(tensors, outs):
        assert torch.equal(t, o)


def test_fd_based_calls(engine, tmp_path):
    h = make_handle(engine)
    path = tmp_path / "fd.bin"
    a, b = random_bytes(10_000, 1), random_bytes(5_000, 2)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        h.async_pwrite(a, fd=fd, file_offset=0)
        h.async_pwrite(b, fd=fd, file_offset=10_000)
        assert h.wait() == 2
        back = torch.empty(15_000, dtype=torch.uint8)
        h.async_pread(back, fd=fd, file_offset=0)
        assert h.wait() == 1
    finally:
        os.close(fd)
    assert torch.equal(back, torch.cat([a, b]))


def test_write_does_not_truncate(engine, tmp_path):
    h = make_handle(engine)
    path = str(tmp_path / "x.bin")
    h.sync_pwrite(random_bytes(10_000), path)
    h.sync_pwrite(torch.zeros(10, dtype=torch.uint8), path, 100)
    assert os.path.getsize(path) == 10_000


@pytest.mark.parametrize("kind", ["numpy", "bytearray", "memoryview", "bfloat16"])
def test_buffer_kinds(engine, tmp_path, kind):
    h = make_handle(engine)
    path = str(tmp_path / "b.bin")
    if kind == "numpy":
        src, dst = np.arange(3000, dtype=np.int32), np.zeros(3000, dtype=np.int32)
    elif kind == "bytearray":
        src, dst = bytearray(os.urandom(7000)), bytearray(7000)
    elif kind == "memoryview":
        src, dst = memoryview(os.urandom(7000)), memoryview(bytearray(7000))
    else:
        src, dst = torch.randn(3000).to(torch.bfloat16), torch.empty(3000, dtype=torch.bfloat16)
    h.sync_pwrite(src, path)
    h.sync_pread(dst, path)
    if kind == "bfloat16":
        assert torch.equal(src, dst)
    else:
        assert bytes(memoryview(src).cast("B")) == bytes(memoryview(dst).cast("B"))


def test_getters_and_defaults():
    h = aio_handle()
    assert h.get_block_size() == 1048576
    assert h.get_queue_depth() == 128
    assert h.get_single_submit() is False
    assert h.get_overlap_events() is False
    assert h.get_intra_op_parallelism() == 1
    assert h.get_alignment() == 512  # DeepSpeed: 512 x intra_op_parallelism
    g = aio_handle(4096 * 16, 8, True, True, 4, engine="threads")
    assert (
        g.get_block_size(),
        g.get_queue_depth(),
        g.get_single_submit(),
        g.get_overlap_events(),
        g.get_intra_op_parallelism(),
        g.get_engine(),
    ) == (65536, 8, True, True, 4, "threads")


@pytest.mark.parametrize("single_submit", [False, True])
@pytest.mark.parametrize("overlap_events", [False, True])
def test_submission_modes(engine, tmp_path, single_submit, overlap_events):
    h = make_handle(engine, single_submit=single_submit, overlap_events=overlap_events)
    data = random_bytes(3 << 20)
    h.sync_pwrite(data, str(tmp_path / "m.bin"))
    back = torch.empty_like(data)
    h.sync_pread(back, str(tmp_path / "m.bin"))
    assert torch.equal(back, data)


def test_module_functions(tmp_path):
    path = str(tmp_path / "m.bin")
    t = torch.randn(4096 + 5)
    assert aio_write(t, path, 1 << 20, 32, False, True, True) == 0
    u = torch.empty_like(t)
    assert aio_read(u, path, 1 << 20, 32, False, True, True) == 0
    assert torch.equal(t, u)


@pytest.mark.parametrize("n", [0, 1, 1000, 5_000_000])
def test_deepspeed_memcpy(n):
    src = torch.randn(n)
    dst = torch.empty_like(src)
    assert deepspeed_memcpy(dst, src) == 0
    assert torch.equal(dst, src)
    assert aio.memcpy is deepspeed_memcpy


def test_memcpy_misuse():
    with pytest.raises(ValueError, match="sizes must match"):
        deepspeed_memcpy(torch.empty(3), torch.empty(4))
    with pytest.raises(TypeError, match="dest"):
        deepspeed_memcpy(b"readonly", bytearray(8))


def test_locked_tensors():
    h = aio_handle()
    example = torch.empty(0, dtype=torch.float16)
    t = h.new_cpu_locked_tensor(10_000, example)
    assert t.dtype == torch.float16 and t.numel() == 10_000 and t.dim() == 1
    assert t.data_ptr() % 4096 == 0
    assert h.is_pinned(t)
    assert not h.is_pinned(torch.empty(10))
    t.fill_(1.5)
    assert float(t.sum()) == 15_000
    assert h.free_cpu_locked_tensor(t) is True
    assert h.free_cpu_locked_tensor(torch.empty(3)) is False
    empty = h.new_cpu_locked_tensor(0, example)
    assert empty.numel() == 0


def test_validate_catches_mismatch(tmp_path, monkeypatch):
    h = aio_handle(engine="threads")
    path = str(tmp_path / "v.bin")
    t = torch.arange(1000, dtype=torch.int64)
    h.write(t, path, True)
    # Change the file behind the handle's back, then ask for a validated read.
    with open(path, "r+b") as f:
        f.seek(17)
        f.write(b"\xff")
    u = torch.empty_like(t)
    h.read(u, path, False)
    assert not torch.equal(t, u)
    from fastckpt.deepnvme.aio_handle import (
        _PendingOp,  # the validation step itself must catch a torn buffer
    )
    from fastckpt.io.aligned_memory import buffer_ref
    from fastckpt.io.files import File

    u[0] = 12345
    op = _PendingOp(lambda: None, File(path), buffer_ref(u, writable=True), 0, False, True)
    with pytest.raises(fastckpt.ChecksumError, match="first difference at byte 0"):
        h._finish(op)


# ---- errors -------------------------------------------------------------------------------


def test_missing_directory(engine, tmp_path):
    h = make_handle(engine)
    missing = str(tmp_path / "no" / "such" / "file.bin")
    with pytest.raises(FileNotFoundError) as info:
        h.sync_pwrite(torch.zeros(10), missing)
    assert info.value.filename == missing
    with pytest.raises(FileNotFoundError):
        h.async_pread(torch.zeros(10), missing)


def test_read_only_file(engine, tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(b"x" * 100)
    path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    tmp_path.chmod(0o755)
    if os.geteuid() != 0:
        with pytest.raises(PermissionError) as info:
            make_handle(engine).sync_pwrite(torch.zeros(10), str(path))
        assert info.value.filename == str(path)
        return
    # Root ignores file modes: check in a child process that gives up root first (forked:
    # an interpreter exec'ed as nobody could not read this one under /root). No garbage
    # collection across the fork: the child of a threaded process must not run finalizers.
    gc.disable()
    pid = -1
    try:
        pid = os.fork()
    finally:
        if pid != 0:
            gc.enable()
    if pid == 0:
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.environ["FASTCKPT_CONFIG"] = "/nonexistent/tuned.json"
            make_handle(engine).sync_pwrite(torch.zeros(10), str(path))
            code = 1
        except PermissionError as exc:
            code = 0 if exc.filename == str(path) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_read_only_file_system_object(engine, tmp_path):
    # Writing through a descriptor opened read-only fails in the engine itself: EBADF.
    h = make_handle(engine)
    path = tmp_path / "ro.bin"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        h.async_pwrite(torch.zeros(10), fd=fd)
        with pytest.raises(OSError) as info:
            h.wait()
        assert info.value.errno is not None
    finally:
        os.close(fd)


def test_directory_as_file(engine, tmp_path):
    h = make_handle(engine)
    with pytest.raises(IsADirectoryError):
        h.sync_pwrite(torch.zeros(10), str(tmp_path))


def test_read_past_eof(engine, tmp_path):
    h = make_handle(engine)
    path = str(tmp_path / "short.bin")
    h.sync_pwrite(torch.zeros(100, dtype=torch.uint8), path)
    with pytest.raises(ValueError, match="past the end"):
        h.sync_pread(torch.zeros(101, dtype=torch.uint8), path)
    with pytest.raises(ValueError, match="past the end"):
        h.sync_pread(torch.zeros(10, dtype=torch.uint8), path, 95)


def test_wait_raises_after_all_finish(engine, tmp_path):
    h = make_handle(engine)
    good = [torch.randn(1000) for _ in range(3)]
    h.async_pwrite(good[0], str(tmp_path / "a.bin"))
    fd = os.open(tmp_path / "a.bin", os.O_RDONLY | os.O_CREAT)
    try:
        h.async_pwrite(good[1], fd=fd)  # fails: read-only descriptor
        h.async_pwrite(good[2], str(tmp_path / "c.bin"))
        with pytest.raises(OSError):
            h.wait()
    finally:
        os.close(fd)
    # The ops around the failure completed.
    back = torch.empty(1000)
    h.sync_pread(back, str(tmp_path / "c.bin"))
    assert torch.equal(back, good[2])
    assert h.wait() == 0


def test_misuse_errors(tmp_path):
    h = aio_handle()
    path = str(tmp_path / "m.bin")
    with pytest.raises(ValueError, match="not contiguous"):
        h.sync_pwrite(torch.randn(10, 10).t(), path)
    with pytest.raises(ValueError, match="file_offset"):
        h.sync_pwrite(torch.randn(10), path, -1)
    with pytest.raises(TypeError, match="buffer"):
        h.sync_pwrite("not a buffer", path)
    with pytest.raises(TypeError, match="read-only"):
        h.sync_pwrite(torch.zeros(1), path)
        h.sync_pread(b"immutable", path)
    with pytest.raises(TypeError, match="async"):
        h.pread(torch.zeros(1), path, False)
    with pytest.raises(ValueError, match="queue_depth"):
        aio_handle(queue_depth=0)
    with pytest.raises(ValueError, match="engine"):
        aio_handle(engine="warp-drive")


def test_unavailable_engine_is_named(monkeypatch):
    from fastckpt.io import engines as engines_module

    fake = engines_module.EngineInfo(
        "io_uring", False, "io_uring_setup failed: Operation not permitted"
    )
    monkeypatch.setattr(
        engines_module,
        "_probe",
        lambda name: fake if name == "io_uring" else engines_module.EngineInfo(name, True),
    )
    with pytest.raises(fastckpt.EngineUnavailableError, match="Operation not permitted"):
        aio_handle(engine="io_uring")
    assert engines_module.resolve_engine("auto") == "libaio"


def test_engines_report():
    info = fastckpt.engines()
    assert set(info) >= {"io_uring", "libaio", "threads", "gds"}
    assert info["threads"].available
    for item in info.values():
        assert item.available or item.reason


def test_writes_of_a_new_file_preallocate_it(tmp_path):
    """A new file is allocated before the parallel writes: one extent's worth of blocks, and
    the size is right even for a write at an offset."""
    import torch

    h = aio_handle(block_size=1 << 16, intra_op_parallelism=4)
    data = torch.arange(1 << 20, dtype=torch.int32)
    path = tmp_path / "new.bin"
    assert h.sync_pwrite(data, str(path), file_offset=4096) == 1
    assert path.stat().st_size == 4096 + data.numel() * 4
    assert path.stat().st_blocks * 512 >= data.numel() * 4
    back = torch.empty_like(data)
    h.sync_pread(back, str(path), file_offset=4096)
    assert torch.equal(back, data)


# ---- DeepSpeed's call forms ---------------------------------------------------------------
# Every I/O method takes DeepSpeed's arguments positionally or by name, and a file
# descriptor wherever DeepSpeed takes a file name (its async_pwrite(buffer, fd, file_offset)
# overload, which its FastFileWriter uses). Return values are DeepSpeed's.

CALL_SIZES = [1, 4095, 4097]
# (write method, read method, their extra DeepSpeed arguments, what the call returns)
FAMILIES = {
    "read/write": ("write", "read", ("validate",), 0),
    "pread/pwrite": ("pwrite", "pread", ("validate", "blocking"), 1),
    "pread/pwrite async": ("pwrite", "pread", ("validate", "async"), 0),
    "sync_pread/sync_pwrite": ("sync_pwrite", "sync_pread", (), 1),
    "async_pread/async_pwrite": ("async_pwrite", "async_pread", (), 0),
}


def _call(h, method, buffer, target, offset, *, extra, style):
    """``method`` called in DeepSpeed's positional or keyword form; ``target`` is a path or
    an int descriptor (passed as ``fd=`` in the keyword form, DeepSpeed's name for it)."""
    is_fd = isinstance(target, int)
    if style == "positional":
        args = [buffer, target]
        if "validate" in extra:
            args.append(True)
        if "blocking" in extra or "async" in extra:
            args.append("async" in extra)
        return getattr(h, method)(*args, offset)
    kwargs = {"buffer": buffer, ("fd" if is_fd else "filename"): target, "file_offset": offset}
    if "validate" in extra:
        kwargs["validate"] = True
    if "blocking" in extra or "async" in extra:
        kwargs["async"] = "async" in extra
    return getattr(h, method)(**kwargs)


@pytest.fixture(params=["filename", "fd", "fd-O_DIRECT"])
def target_kind(request):
    return request.param


def _open_target(kind, path, flags=os.O_RDWR | os.O_CREAT):
    if kind == "filename":
        return str(path), None
    if kind == "fd-O_DIRECT":
        flags |= os.O_DIRECT
    fd = os.open(path, flags, 0o644)
    return fd, fd


@pytest.mark.parametrize("nbytes", CALL_SIZES)
@pytest.mark.parametrize("style", ["positional", "keyword"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_deepspeed_call_forms(engine, tmp_path, target_kind, family, style, nbytes):
    write_method, read_method, extra, returns = FAMILIES[family]
    h = make_handle(engine)
    path = tmp_path / "forms.bin"
    offset = 4096 + 3
    data = random_bytes(nbytes)
    target, fd = _open_target(target_kind, path)
    try:
        assert _call(h, write_method, data, target, offset, extra=extra, style=style) == returns
        if returns == 0 and write_method != "write":
            assert h.wait() == 1
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.read() == data.numpy().tobytes()
        back = torch.empty_like(data)
        assert _call(h, read_method, back, target, offset, extra=extra, style=style) == returns
        if returns == 0 and read_method != "read":
            assert h.wait() == 1
        assert torch.equal(back, data)
        if fd is not None:  # the caller's descriptor: still open, its position untouched
            assert os.fstat(fd).st_size == offset + nbytes
            assert os.lseek(fd, 0, os.SEEK_CUR) == 0
    finally:
        if fd is not None:
            os.close(fd)


def test_numpy_integers_as_descriptor_and_offset(tmp_path):
    h = aio_handle(engine="threads")
    fd = os.open(tmp_path / "np.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert h.sync_pwrite(random_bytes(100), np.int32(fd), np.int64(7)) == 1
        assert os.fstat(fd).st_size == 107
    finally:
        os.close(fd)


def test_descriptor_uses_o_direct_only_when_opened_with_it(tmp_path):
    from fastckpt.deepnvme.descriptors import HeldDescriptor

    path = tmp_path / "d.bin"
    path.write_bytes(b"x" * 8192)
    plain = os.open(path, os.O_RDWR)
    try:
        direct = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        os.close(plain)
        pytest.skip("this file system refuses O_DIRECT")
    try:
        held = HeldDescriptor(plain, write=True)
        assert not held.direct and held.fd != plain and held.path == str(path)
        held.close()
        held = HeldDescriptor(direct, write=True)
        assert held.direct and held.direct_fd != direct
        held.close()
        # Neither of the caller's descriptors was closed or changed.
        assert fcntl_flags(plain) & os.O_DIRECT == 0
        assert fcntl_flags(direct) & os.O_DIRECT
    finally:
        os.close(plain)
        os.close(direct)


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_descriptor_closed_before_wait_still_gets_its_bytes(engine, tmp_path):
    """The caller may close its descriptor (and the number be reused) before wait(): the op
    holds a duplicate, so the bytes land in the file it was given, not the number's new file."""
    h = make_handle(engine)
    data = random_bytes(1 << 20)
    fd = os.open(tmp_path / "first.bin", os.O_RDWR | os.O_CREAT, 0o644)
    assert h.async_pwrite(data, fd, 0) == 0
    os.close(fd)
    reused = os.open(tmp_path / "second.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert h.wait() == 1
    finally:
        os.close(reused)
    assert (tmp_path / "first.bin").read_bytes() == data.numpy().tobytes()
    assert (tmp_path / "second.bin").read_bytes() == b""


def test_validate_through_a_write_only_descriptor(tmp_path):
    h = aio_handle(engine="threads")
    fd = os.open(tmp_path / "wo.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert h.write(random_bytes(5000), fd, True) == 0
        assert h.pwrite(random_bytes(5000), fd, True, False) == 1
    finally:
        os.close(fd)


def test_blocking_calls_complete_the_queued_ops(engine, tmp_path):
    """Like DeepSpeed's, a blocking parallel call waits for the ops queued before it and
    returns how many completed; read/write stay outside the queue and return 0."""
    h = make_handle(engine)
    tensors = [random_bytes(3000 + i) for i in range(3)]
    for i, t in enumerate(tensors[:2]):
        assert h.async_pwrite(t, str(tmp_path / f"{i}.bin")) == 0
    assert h.sync_pwrite(tensors[2], str(tmp_path / "2.bin")) == 3
    assert h.wait() == 0
    assert h.async_pread(torch.empty_like(tensors[0]), str(tmp_path / "0.bin")) == 0
    assert h.write(tensors[0], str(tmp_path / "w.bin"), False) == 0
    assert h.pread(torch.empty_like(tensors[1]), str(tmp_path / "1.bin"), False, False) == 2
    assert h.wait() == 0


def test_descriptor_errors(tmp_path):
    h = aio_handle(engine="threads")
    path = tmp_path / "e.bin"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDWR)
    os.close(fd)
    with pytest.raises(OSError) as info:  # a closed descriptor, named in the error
        h.async_pwrite(torch.zeros(10), fd, 0)
    assert info.value.errno == 9 and info.value.filename == f"fd {fd}"
    with pytest.raises(OSError) as info:
        h.sync_pread(torch.zeros(10), fd=fd)
    assert info.value.filename == f"fd {fd}"
    appending = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        with pytest.raises(ValueError, match="O_APPEND"):
            h.async_pwrite(torch.zeros(10), appending, 0)
        back = torch.empty(100, dtype=torch.uint8)
        ro = os.open(path, os.O_RDONLY | os.O_APPEND)
        try:  # reading through an O_APPEND descriptor is fine
            assert h.sync_pread(back, ro) == 1
        finally:
            os.close(ro)
    finally:
        os.close(appending)
    with pytest.raises(TypeError, match="both 'filename' and 'fd'"):
        h.sync_pwrite(torch.zeros(1), str(path), fd=3)
    with pytest.raises(TypeError, match="missing required argument 'filename'"):
        h.sync_pwrite(torch.zeros(1))
    with pytest.raises(TypeError, match="fd must be an int"):
        h.async_pwrite(torch.zeros(1), fd=str(path))
    with pytest.raises(TypeError, match="bool"):
        h.async_pwrite(torch.zeros(1), True)
    with pytest.raises(TypeError, match="file name"):
        h.async_pwrite(torch.zeros(1), 1.5)
    with pytest.raises(ValueError, match="negative"):
        h.async_pwrite(torch.zeros(1), -3)
    with pytest.raises(TypeError, match="file_offset"):
        h.sync_pwrite(torch.zeros(1), str(path), 1.0)
    assert h.wait() == 0


def test_deepspeed_keyword_spellings():
    h = aio_handle()
    example = torch.empty(0, dtype=torch.int16)
    t = h.new_cpu_locked_tensor(num_elem=8, example_tenosr=example)  # DeepSpeed's spelling
    u = h.new_cpu_locked_tensor(8, example_tensor=example)
    assert t.dtype == u.dtype == torch.int16
    assert h.is_pinned(buffer=t) and h.is_pinned(tensor=u) and h.is_pinned(t)
    assert h.free_cpu_locked_tensor(tensor=t) and h.free_cpu_locked_tensor(u)
    with pytest.raises(TypeError, match="both"):
        h.new_cpu_locked_tensor(8, example, example_tenosr=example)
    with pytest.raises(TypeError, match="unexpected"):
        h.new_cpu_locked_tensor(8, example, dtype=torch.int16)


def test_parameter_names_are_deepspeeds():
    """The names DeepSpeed's binding gives each argument, in its order (``async`` is a Python
    keyword: it is ``async_op`` here, and ``**{"async": ...}`` works)."""
    import inspect

    expected = {
        "read": ["buffer", "filename", "validate", "file_offset"],
        "write": ["buffer", "filename", "validate", "file_offset"],
        "pread": ["buffer", "filename", "validate", "async_op", "file_offset"],
        "pwrite": ["buffer", "filename", "validate", "async_op", "file_offset"],
        "sync_pread": ["buffer", "filename", "file_offset"],
        "sync_pwrite": ["buffer", "filename", "file_offset"],
        "async_pread": ["buffer", "filename", "file_offset"],
        "async_pwrite": ["buffer", "filename", "file_offset"],
        "new_cpu_locked_tensor": ["num_elem", "example_tensor"],
        "free_cpu_locked_tensor": ["tensor"],
        "is_pinned": ["buffer"],
        "wait": [],
    }
    for method, names in expected.items():
        params = inspect.signature(getattr(aio_handle, method)).parameters.values()
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD][1:]
        assert positional == names, method
        if method not in ("new_cpu_locked_tensor", "free_cpu_locked_tensor", "is_pinned", "wait"):
            assert "fd" in inspect.signature(getattr(aio_handle, method)).parameters, method


@pytest.mark.parametrize("offset", [1, 512, 4096 + 512])
def test_an_unaligned_head_or_tail_page_is_never_also_written_direct(engine, tmp_path, offset):
    """A device may take O_DIRECT at 512 bytes, but a page written partly through the page
    cache and partly with O_DIRECT at once cannot be invalidated, and the O_DIRECT bytes are
    lost. So an unaligned head or tail goes through the page cache to its page's boundary:
    those pages stay cached, whole and right; the pages between are written direct."""
    from fastckpt.io.page_cache import resident_fraction

    page = os.sysconf("SC_PAGESIZE")
    nbytes = 8 * page
    path = str(tmp_path / "data.bin")
    data = random_bytes(nbytes, seed=offset)
    # Other tests dropping the page cache (cold loads, as root, on the other workers, often
    # many times a second) can evict the head or tail page between the write and the check:
    # a miss is tried again, a while later; a wrong path never passes.
    for attempt in range(40):
        if attempt:
            time.sleep(0.05)
        assert make_handle(engine).sync_pwrite(data, path, offset) == 1
        fd = os.open(path, os.O_RDONLY)
        try:
            first, last = offset // page, (offset + nbytes - 1) // page
            head = resident_fraction(fd, first * page, page)
            tail = resident_fraction(fd, last * page, page)
            middle = resident_fraction(fd, (first + 1) * page, (last - first - 1) * page)
            assert os.pread(fd, nbytes, offset) == data.numpy().tobytes()
        finally:
            os.close(fd)
        if head is None or middle is None:
            pytest.skip("the kernel cannot say which pages are cached")
        if middle == 1.0:
            pytest.skip("O_DIRECT is not taken here: every page went through the page cache")
        if head == 1.0 and tail == 1.0 and middle == 0.0:
            break
        os.unlink(path)
    assert head == 1.0 and tail == 1.0  # written whole through the page cache
    assert middle == 0.0  # every page between went direct
