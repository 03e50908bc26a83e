"""GPUDirect Storage (cuFile): availability reasons, the dlopen shim, status names and errors
on every machine; gds_handle I/O on machines with a CUDA GPU and cuFile (marked ``cuda``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
from _host_cuda import HostEvent, HostStream

import fastckpt
from fastckpt import _C, gds
from fastckpt.aio import aio_handle
from fastckpt.errors import EngineUnavailableError, FastCkptError
from fastckpt.io import cufile

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()


def _run_python(code: str, *, cwd, env: dict[str, str] | None = None) -> dict:
    """Runs ``code`` in a fresh interpreter (libcufile's process-wide state starts empty)
    and returns the JSON it prints last."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FASTCKPT_")}
    full_env.update(env or {})
    # The answer goes to a file: libcufile prints diagnostics of its own to stdout.
    result = os.path.join(str(cwd), "result.json")
    code = textwrap.dedent(code).replace(
        "print(json.dumps(", f"open({result!r}, 'w').write(json.dumps("
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    with open(result, encoding="utf-8") as f:
        return json.load(f)


def _real_libcufile() -> str | None:
    """A libcufile on this machine (a wheel's or the system's), or None."""
    for path in gds.library_candidates():
        return path
    name = ctypes.util.find_library("cufile")
    return name


# ------------------------------------------------------------------------- status codes


def test_status_names_cover_the_documented_codes():
    expected = {
        0: "CU_FILE_SUCCESS",
        5001: "CU_FILE_DRIVER_NOT_INITIALIZED",
        5011: "CU_FILE_CUDA_DRIVER_ERROR",
        5019: "CU_FILE_INVALID_FILE_OPEN_FLAG",
        5022: "CU_FILE_INVALID_VALUE",
        5024: "CU_FILE_MEMORY_NOT_REGISTERED",
        5033: "CU_FILE_NVFS_SETUP_ERROR",
        5036: "CU_FILE_GPU_MEMORY_PINNING_FAILED",
        5050: "CU_FILE_IO_MAX_ERROR",
    }
    for code, name in expected.items():
        assert _C.cufile_status_name(code) == name
    named = [
        c for c in range(5001, 5051) if not _C.cufile_status_name(c).startswith("CU_FILE_UNKNOWN")
    ]
    assert len(named) == 49  # every value but the unused 5032
    assert _C.cufile_status_name(5032) == "CU_FILE_UNKNOWN_5032"
    assert "allow_compat_mode" in _C.cufile_status_description(5001)
    assert _C.cufile_status_description(12345) == "unknown cuFile status"


def test_cufile_error_is_a_fastckpt_error_and_a_runtime_error():
    assert gds.CuFileError is _C.CuFileError
    assert issubclass(gds.CuFileError, FastCkptError)
    assert issubclass(gds.CuFileError, RuntimeError)


# ------------------------------------------------------------------------ native checks


def test_transfer_arguments_are_checked_before_any_library_call():
    with pytest.raises(ValueError, match="handle"):
        _C.cufile_read(0, 1, 10, 0)
    with pytest.raises(ValueError, match="address"):
        _C.cufile_write(1, 0, 10, 0)
    with pytest.raises(ValueError, match="out of range"):
        _C.cufile_read(1, 1, 2**63, 0)
    assert _C.cufile_read(1, 1, 0, 0) is None  # nothing to move


def test_calls_before_the_library_is_loaded_raise(tmp_path):
    out = _run_python(
        """
        import json
        from fastckpt import _C
        found = {}
        for name, call in [("open", _C.cufile_driver_open), ("register", lambda: _C.cufile_handle_register(0)),
                           ("read", lambda: _C.cufile_read(1, 1, 10, 0)), ("version", _C.cufile_version)]:
            try:
                call()
                found[name] = "no error"
            except RuntimeError as exc:
                found[name] = str(exc)
        found["library"] = _C.cufile_library()
        print(json.dumps(found))
        """,
        cwd=tmp_path,
    )
    assert out.pop("library") == ""
    for name, message in out.items():
        assert "libcufile is not loaded" in message, name


def test_bogus_library_paths_fail_cleanly_with_the_path(tmp_path):
    garbage = tmp_path / "libcufile.so.0"
    garbage.write_bytes(b"not an ELF file")
    out = _run_python(
        f"""
        import json
        from fastckpt import _C
        results = [_C.cufile_load([p], False) for p in
                   ["/nonexistent/dir/libcufile.so.0", {str(garbage)!r}, "libc.so.6"]]
        results.append(_C.cufile_load([], False))
        print(json.dumps([results, _C.cufile_library()]))
        """,
        cwd=tmp_path,
    )
    (missing, not_elf, not_cufile, nothing), library = out
    assert library == ""
    assert missing[0] is False and "/nonexistent/dir/libcufile.so.0" in missing[1]
    assert not_elf[0] is False and str(garbage) in not_elf[1]
    assert (
        not_cufile[0] is False
        and "cuFileDriverOpen" in not_cufile[1]
        and "libc.so.6" in not_cufile[1]
    )
    assert nothing[0] is False and "no candidate" in nothing[1]


def test_library_override_is_reported_in_engine_info(tmp_path):
    bogus = "/nonexistent/fastckpt-test/libcufile.so.0"
    out = _run_python(
        """
        import json
        import fastckpt, fastckpt.gds as gds
        info = gds.engine_info()
        try:
            gds.gds_handle()
            raised = ""
        except fastckpt.EngineUnavailableError as exc:
            raised = str(exc)
        print(json.dumps([info.available, info.reason, raised, gds.mode()]))
        """,
        cwd=tmp_path,
        env={"FASTCKPT_CUFILE_LIBRARY": bogus},
    )
    available, reason, raised, mode = out
    assert available is False and mode is None
    assert bogus in reason and "libcufile could not be loaded" in reason
    assert bogus in raised


# --------------------------------------------------------------------- engine reporting


@pytest.mark.skipif(CUDA, reason="checks the reasons given where CUDA is missing")
def test_engine_info_without_cuda_says_so():
    info = gds.engine_info()
    assert info.name == "gds" and not info.available
    assert "CUDA" in info.reason
    assert gds.mode() is None
    assert fastckpt.engines()["gds"] == info


@pytest.mark.skipif(CUDA, reason="checks the reasons given where CUDA is missing")
def test_gds_handle_without_cuda_raises_engine_unavailable():
    with pytest.raises(
        EngineUnavailableError, match="GPUDirect Storage is not available here: .*CUDA"
    ):
        gds.gds_handle()
    with pytest.raises(EngineUnavailableError, match="CUDA"):
        gds.transfer(None, None, 0, write=False)  # type: ignore[arg-type]


def test_engine_info_is_consistent_with_mode():
    info = gds.engine_info()
    assert isinstance(info.reason, str) and info.reason
    if info.available:
        assert gds.mode() in ("gds", "compat")
        assert info.reason.startswith("cuFile compatibility mode") == (gds.mode() == "compat")
    else:
        assert gds.mode() is None


def test_library_candidates_are_existing_files():
    for path in gds.library_candidates():
        assert os.path.isfile(path) and path.endswith("libcufile.so.0")


@pytest.mark.skipif(_real_libcufile() is None, reason="no libcufile on this machine")
@pytest.mark.skipif(CUDA, reason="checks the driver's refusal where no CUDA driver is installed")
def test_real_libcufile_without_a_gpu_raises_status_names(tmp_path):
    """The ABI end to end: a status returned in registers, decoded into a named exception."""
    out = _run_python(
        f"""
        import json, os
        from fastckpt import _C
        from fastckpt.errors import FastCkptError
        loaded, path = _C.cufile_load([{_real_libcufile()!r}], False)
        found = {{"loaded": loaded, "path": path, "version": _C.cufile_version()}}
        try:
            _C.cufile_driver_open()
            found["open"] = None
        except _C.CuFileError as exc:
            found["open"] = [exc.status, exc.code, exc.cuda_error, str(exc), isinstance(exc, FastCkptError)]
        found["refs"] = _C.cufile_driver_refs()
        fd = os.open("data.bin", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _C.cufile_handle_register(fd, "data.bin")
            found["register"] = None
        except _C.CuFileError as exc:
            found["register"] = [exc.status, exc.filename]
        try:
            _C.cufile_driver_close()
        except RuntimeError as exc:
            found["close"] = str(exc)
        print(json.dumps(found))
        """,
        cwd=tmp_path,  # cuFile writes its cufile.log into the working directory
    )
    assert out["loaded"] is True and os.path.basename(out["path"]).startswith("libcufile")
    assert isinstance(out["version"], int) and out["version"] > 0
    status, code, _cuda_error, message, is_fastckpt_error = out["open"]
    assert status.startswith("CU_FILE_") and code > 5000 and is_fastckpt_error
    assert status in message and "cuFileDriverOpen" in message
    assert out["refs"] == 0
    assert out["register"][0].startswith("CU_FILE_") and out["register"][1] == "data.bin"
    assert "without a matching" in out["close"]


# ------------------------------------------------------------------------- API surface


def test_gds_handle_has_the_aio_handle_api_and_the_gds_functions():
    aio_params = list(inspect.signature(aio_handle.__init__).parameters)
    gds_params = list(inspect.signature(gds.gds_handle.__init__).parameters)
    assert gds_params == [p for p in aio_params if p != "engine"]
    for name in (
        "read",
        "write",
        "pread",
        "pwrite",
        "sync_pread",
        "sync_pwrite",
        "async_pread",
        "async_pwrite",
        "wait",
        "get_block_size",
        "get_queue_depth",
        "get_single_submit",
        "get_overlap_events",
        "get_intra_op_parallelism",
        "get_alignment",
        "new_pinned_device_tensor",
        "free_pinned_device_tensor",
        "pin_device_tensor",
        "unpin_device_tensor",
        "new_cpu_locked_tensor",
        "free_cpu_locked_tensor",
    ):
        assert callable(getattr(gds.gds_handle, name)), name


def test_gds_handle_refuses_host_buffers(tmp_path):
    # Built without __init__ so that the check runs where GDS cannot.
    h = gds.gds_handle.__new__(gds.gds_handle)
    path = str(tmp_path / "x.bin")
    with pytest.raises(TypeError, match="buffer: gds_handle works on CUDA tensors only.*cpu"):
        h.sync_pwrite(torch.zeros(4), path)
    with pytest.raises(TypeError, match="buffer: gds_handle works on CUDA tensors only.*ndarray"):
        h.sync_pread(__import__("numpy").zeros(4), path)
    with pytest.raises(TypeError, match="file_offset"):
        h.sync_pwrite(torch.zeros(4), path, file_offset=1.5)
    with pytest.raises(ValueError, match="file_offset"):
        h.sync_pwrite(torch.zeros(4), path, file_offset=-1)
    assert not os.path.exists(path)


# ------------------------------------------------------------------------- GPU + cuFile


def _need_gds():
    info = gds.engine_info()
    if not info.available:
        pytest.skip(f"GPUDirect Storage is not available: {info.reason}")


@pytest.fixture
def handle():
    _need_gds()
    return gds.gds_handle(
        block_size=1 << 20,
        queue_depth=8,
        single_submit=False,
        overlap_events=True,
        intra_op_parallelism=4,
    )


def _random_bytes(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3, (9 << 20) + 11]
OFFSETS = [0, 4096 + 7]


@pytest.mark.cuda
def test_gds_getters_and_engine(handle):
    assert handle.get_block_size() == 1 << 20
    assert handle.get_queue_depth() == 8
    assert handle.get_single_submit() is False
    assert handle.get_overlap_events() is True
    assert handle.get_intra_op_parallelism() == 4
    assert handle.get_alignment() == 4 * 512
    assert handle.get_engine() == "gds"
    assert gds.mode() in ("gds", "compat")


@pytest.mark.cuda
@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("offset", OFFSETS)
def test_gds_sync_roundtrip(handle, tmp_path, nbytes, offset):
    path = str(tmp_path / "g.bin")
    data = _random_bytes(nbytes, nbytes)
    src = data.cuda()
    assert handle.sync_pwrite(src, path, file_offset=offset) == 1
    assert os.path.getsize(path) == offset + nbytes
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read() == data.numpy().tobytes()
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    assert handle.sync_pread(dst, path, file_offset=offset) == 1
    assert torch.equal(dst.cpu(), data)


@pytest.mark.cuda
def test_gds_every_io_method(handle, tmp_path):
    data = _random_bytes(3 * 4096 + 5, 1).cuda()
    paths = [str(tmp_path / f"m{i}.bin") for i in range(6)]
    assert handle.write(data, paths[0]) == 0  # DeepSpeed's write returns 0
    assert handle.pwrite(data, paths[1], False, False) == 1
    assert handle.pwrite(data, paths[2], async_op=True) == 0
    assert handle.async_pwrite(data, paths[3]) == 0
    assert handle.pwrite(data, paths[4], **{"async": True}) == 0
    assert handle.wait() == 3
    assert handle.sync_pwrite(data, paths[5], file_offset=4096 + 7) == 1
    outs = [torch.empty_like(data) for _ in range(6)]
    assert handle.read(outs[0], paths[0], validate=True) == 0
    assert handle.pread(outs[1], paths[1], False, False) == 1
    assert handle.pread(outs[2], paths[2], async_op=True) == 0
    assert handle.async_pread(outs[3], paths[3]) == 0
    with open(paths[4], "rb") as f:
        fd = os.dup(f.fileno())
    try:
        assert handle.async_pread(outs[4], fd=fd) == 0
        assert handle.wait() == 3
    finally:
        os.close(fd)
    assert handle.sync_pread(outs[5], paths[5], file_offset=4096 + 7) == 1
    for out in outs:
        assert torch.equal(out, data)


@pytest.mark.cuda
def test_gds_many_queued_ops(handle, tmp_path):
    tensors = [_random_bytes(4096 * i + i, i).cuda() for i in range(1, 9)]
    path = str(tmp_path / "q.bin")
    offsets = []
    pos = 0
    for t in tensors:
        offsets.append(pos)
        pos += t.numel()
    for t, off in zip(tensors, offsets):
        assert handle.async_pwrite(t, path, file_offset=off) == 0
    assert handle.wait() == len(tensors)
    outs = [torch.empty_like(t) for t in tensors]
    for o, off in zip(outs, offsets):
        handle.async_pread(o, path, file_offset=off)
    assert handle.wait() == len(tensors)
    for o, t in zip(outs, tensors):
        assert torch.equal(o, t)


@pytest.mark.cuda
def test_gds_errors(handle, tmp_path):
    path = str(tmp_path / "short.bin")
    with open(path, "wb") as f:
        f.write(b"x" * 100)
    with pytest.raises(ValueError, match="past the end"):
        handle.sync_pread(torch.empty(101, dtype=torch.uint8, device="cuda"), path)
    with pytest.raises(TypeError, match="buffer"):
        handle.sync_pread(torch.empty(10, dtype=torch.uint8), path)
    with pytest.raises(FileNotFoundError):
        handle.sync_pread(
            torch.empty(10, dtype=torch.uint8, device="cuda"), str(tmp_path / "missing.bin")
        )
    fd = os.open(path, os.O_RDONLY)
    try:
        handle.async_pwrite(torch.ones(10, dtype=torch.uint8, device="cuda"), fd=fd)
        with pytest.raises((OSError, gds.CuFileError)):
            handle.wait()
    finally:
        os.close(fd)


@pytest.mark.cuda
def test_gds_pinned_device_tensors(handle, tmp_path):
    example = torch.empty(0, dtype=torch.float16, device="cuda")
    t = handle.new_pinned_device_tensor(5000, example)
    assert t.dtype == torch.float16 and t.is_cuda and t.numel() == 5000
    t.copy_(torch.arange(5000, dtype=torch.float16, device="cuda"))
    path = str(tmp_path / "p.bin")
    assert handle.sync_pwrite(t, path) == 1
    # A slice inside a pinned tensor goes through the registration with an offset.
    part = torch.empty(1000, dtype=torch.float16, device="cuda")
    assert handle.sync_pread(part, path, file_offset=2000) == 1
    view = t[1000:2000]
    view.zero_()
    assert handle.sync_pread(view, path, file_offset=2000) == 1
    assert torch.equal(view, part)
    assert handle.free_pinned_device_tensor(t) is True
    assert handle.free_pinned_device_tensor(t) is False
    other = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    assert handle.pin_device_tensor(other) is True
    assert handle.sync_pread(other[:100], path) == 1
    assert handle.unpin_device_tensor(other) is True
    assert handle.unpin_device_tensor(other) is False
    with pytest.raises(TypeError, match="CUDA"):
        handle.pin_device_tensor(torch.zeros(4))
    assert cufile._registry == {}


@pytest.mark.cuda
def test_gds_transfer_and_device_loads(tmp_path):
    _need_gds()
    from fastckpt.config import IOConfig
    from fastckpt.io import device_copy as cuda
    from fastckpt.io.executor import Executor
    from fastckpt.io.files import File

    data = _random_bytes((5 << 20) + 9, 3)
    path = tmp_path / "t.bin"
    path.write_bytes(data.numpy().tobytes())
    ex = Executor(IOConfig(engine="threads"))
    arena = torch.empty(data.numel(), dtype=torch.uint8, device="cuda")
    with File(path) as f:
        cuda.read_into_device(ex, f, 7, data.numel() - 7, arena, staging_bytes=1 << 20, gds=True)
    assert torch.equal(arena[: data.numel() - 7].cpu(), data[7:])
    out = tmp_path / "w.bin"
    with File(out, write=True, create=True) as f:
        cuda.write_from_device(ex, f, 4096 + 7, arena, staging_bytes=1 << 20, gds=True)
    assert out.read_bytes()[4096 + 7 :] == arena.cpu().numpy().tobytes()


# --------------------------------------------- gds_handle's bookkeeping, on the CPU


class _FakeCuFile:
    """cuFile's calls on host memory with pread/pwrite, recording registrations, so that
    gds_handle's Python side (registration on the fly, pinning, queues) runs anywhere."""

    CuFileError = _C.CuFileError

    def __init__(self):
        self.handles: set[int] = set()
        self.buffers: dict[int, int] = {}
        self.registered_log: list[int] = []
        self.moves: list[tuple[int, int, int, int]] = []

    def cufile_handle_register(self, fd, path=""):
        import fcntl

        # Real cuFile takes unaligned I/O on O_DIRECT descriptors; pread/pwrite do not.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))
        self.handles.add(fd + 1000)
        return fd + 1000

    def cufile_handle_deregister(self, handle):
        self.handles.remove(handle)

    def _error(self, status):
        exc = _C.CuFileError(f"cuFileBufRegister failed: {status}")
        exc.status = status
        return exc

    def cufile_buf_register(self, address, nbytes, flags=0):
        if address in self.buffers:
            raise self._error("CU_FILE_MEMORY_ALREADY_REGISTERED")
        self.buffers[address] = nbytes
        self.registered_log.append(address)

    def cufile_buf_deregister(self, address):
        if self.buffers.pop(address, None) is None:
            raise self._error("CU_FILE_MEMORY_NOT_REGISTERED")

    def cufile_read(self, handle, base, nbytes, file_offset, buf_offset=0, threads=1, path=""):
        assert handle in self.handles
        data = os.pread(handle - 1000, nbytes, file_offset)
        if len(data) < nbytes:
            raise OSError(61, "hit the end of the file", path)
        ctypes.memmove(base + buf_offset, data, nbytes)
        self.moves.append((base, buf_offset, nbytes, threads))

    def cufile_write(self, handle, base, nbytes, file_offset, buf_offset=0, threads=1, path=""):
        assert handle in self.handles
        os.pwrite(handle - 1000, ctypes.string_at(base + buf_offset, nbytes), file_offset)
        self.moves.append((base, buf_offset, nbytes, threads))


@pytest.fixture
def host_gds(monkeypatch):
    import contextlib

    fake = _FakeCuFile()
    monkeypatch.setattr(cufile, "_C", fake)
    monkeypatch.setattr(cufile, "_probe", lambda: cufile._Probe(True, "test stand-in", "compat"))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", HostEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: HostStream())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real_ref = cufile.buffer_ref

    def host_ref(obj, *, writable, argname="buffer", allow_cuda=False):
        ref = real_ref(obj, writable=writable, argname=argname, allow_cuda=allow_cuda)
        return cufile.BufferRef(ref.address, ref.nbytes, ref.owner, True)

    monkeypatch.setattr(cufile, "buffer_ref", host_ref)
    real_empty = torch.empty

    def host_empty(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = None
        return real_empty(*args, device=device, **kwargs)

    monkeypatch.setattr(torch, "empty", host_empty)
    monkeypatch.setattr(cufile, "_registry", {})
    return fake


def test_gds_handle_bookkeeping_on_host_memory(host_gds, tmp_path):
    h = gds.gds_handle(intra_op_parallelism=3)
    assert h.get_engine() == "gds" and h.get_intra_op_parallelism() == 3
    data = _random_host_bytes(10_007)
    path = str(tmp_path / "h.bin")
    assert h.sync_pwrite(data, path, file_offset=4096 + 7) == 1
    assert h.write(data, path + ".2") == 0
    out = torch.zeros_like(data)
    assert h.async_pread(out, path, file_offset=4096 + 7) == 0
    assert h.wait() == 1
    assert torch.equal(out, data)
    # Unpinned buffers are registered for each operation and deregistered after.
    assert (
        host_gds.buffers == {} and len(host_gds.registered_log) == 3 and host_gds.handles == set()
    )
    assert [m[3] for m in host_gds.moves] == [3, 1, 3]  # parallel ops split, read/write do not

    pinned = h.new_pinned_device_tensor(4096, torch.empty(0, dtype=torch.float32))
    assert pinned.dtype == torch.float32 and pinned.numel() == 4096
    assert host_gds.buffers == {pinned.data_ptr(): 4096 * 4}
    view = pinned[100:200]
    assert h.sync_pread(view, path, file_offset=400) == 1
    base, buf_offset, nbytes, _ = host_gds.moves[-1]
    assert (base, buf_offset, nbytes) == (pinned.data_ptr(), 400, 400)  # the pinned base, offset
    assert len(host_gds.registered_log) == 4  # no registration on the fly for it
    assert h.free_pinned_device_tensor(pinned) and not h.free_pinned_device_tensor(pinned)
    assert host_gds.buffers == {}
    # DeepSpeed's binding spells the keyword "example_tenosr".
    spelled = h.new_pinned_device_tensor(num_elem=8, example_tenosr=torch.empty(0))
    assert spelled.numel() == 8 and h.free_pinned_device_tensor(tensor=spelled)

    other = torch.zeros(64, dtype=torch.uint8)
    assert h.pin_device_tensor(other) is True
    assert h.unpin_device_tensor(other) is True and h.unpin_device_tensor(other) is False
    assert cufile._registry == {} and host_gds.buffers == {}


def test_gds_handle_runs_unregistered_when_cufile_cannot_pin(host_gds, tmp_path):
    h = gds.gds_handle()
    data = _random_host_bytes(5000)
    host_gds.buffers[data.data_ptr()] = 5000  # registered behind our back
    path = str(tmp_path / "u.bin")
    assert h.sync_pwrite(data, path) == 1
    assert host_gds.moves[-1][:3] == (data.data_ptr(), 0, 5000)
    assert cufile._registry == {}


def test_gds_handle_errors_reach_wait(host_gds, tmp_path):
    h = gds.gds_handle()
    path = tmp_path / "e.bin"
    path.write_bytes(b"y" * 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert h.async_pwrite(torch.ones(10, dtype=torch.uint8), fd=fd) == 0
        with pytest.raises(OSError) as info:
            h.wait()
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)
    assert cufile._registry == {} and host_gds.buffers == {} and host_gds.handles == set()


def _random_host_bytes(n: int):
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)
    )
