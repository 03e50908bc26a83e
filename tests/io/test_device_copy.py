"""CUDA tensors through page-locked staging: aio_handle with CUDA tensors, read_into_device,
write_from_device and the copy helpers. The planning and argument checks run everywhere;
the transfers need a CUDA GPU (marked ``cuda``)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _host_cuda import HostEvent, HostStream
from _page_cache import drop_from_page_cache

from fastckpt.aio import aio_handle
from fastckpt.config import IOConfig
from fastckpt.errors import EngineUnavailableError
from fastckpt.io import device_copy as cuda
from fastckpt.io.aligned_memory import BufferRef
from fastckpt.io.executor import Executor
from fastckpt.io.files import File

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize("offset", [0, 1, 4095, 4096 + 7, (1 << 20) - 1])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4097, (1 << 20) + 3, (5 << 20) + 11])
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_plan_covers_the_range_with_aligned_pieces(offset, nbytes, chunk):
    pieces = cuda._plan(offset, nbytes, chunk)
    assert sum(n for _, n in pieces) == nbytes
    pos = offset
    for i, (start, n) in enumerate(pieces):
        assert start == pos and 0 < n <= chunk
        if i:
            assert start % chunk == 0  # every piece but the first starts aligned
        pos += n
    if nbytes:
        first, n = pieces[0]
        assert first % chunk + n <= chunk


@pytest.mark.parametrize("staging", [1 << 20, 3 << 20, 64 << 20, 256 << 20, 4 << 30])
def test_ring_stays_within_the_staging_budget(staging):
    chunk, depth = cuda._ring(staging)
    assert chunk % 4096 == 0 and chunk >= 4096
    assert 2 <= depth <= 8
    assert chunk * depth <= staging
    assert chunk <= 64 << 20


# ----------------------------------------------------------------------- GDS choice


def test_use_gds_choices(monkeypatch):
    assert cuda.use_gds(False) is False
    assert cuda.use_gds(None) is False
    monkeypatch.setenv("FASTCKPT_GDS", "0")
    assert cuda.use_gds(None) is False
    monkeypatch.setenv("FASTCKPT_GDS", "maybe")
    with pytest.raises(ValueError, match="FASTCKPT_GDS"):
        cuda.use_gds(None)
    monkeypatch.setenv("FASTCKPT_GDS", "1")
    from fastckpt import gds

    available = gds.engine_info().available
    assert cuda.use_gds(None) is available  # falls back to the pipeline where GDS cannot run
    if not available:
        with pytest.raises(EngineUnavailableError, match="gds=True"):
            cuda.use_gds(True)


# --------------------------------------------------------------------- argument checks


class _FakeCudaTensor:
    """Looks like a CUDA torch.Tensor to the buffer checks, for machines without CUDA."""

    __module__ = "torch_fake"

    def __init__(self, nbytes: int):
        self._host = torch.zeros(nbytes, dtype=torch.uint8)
        self.is_cuda = True
        self.device = torch.device("cuda", 0)
        self.layout = torch.strided
        self.dtype = torch.uint8

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return self._host.data_ptr()

    def numel(self):
        return self._host.numel()

    def element_size(self):
        return 1


@pytest.mark.skipif(CUDA, reason="checks what happens where CUDA is missing")
def test_aio_handle_with_a_cuda_tensor_without_cuda_raises_clearly(tmp_path):
    h = aio_handle(engine="threads")
    path = tmp_path / "x.bin"
    path.write_bytes(b"\0" * 64)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        h.sync_pwrite(_FakeCudaTensor(16), str(path))
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        h.async_pread(_FakeCudaTensor(16), str(path))
    assert h.wait() == 0
    assert len(os.listdir("/proc/self/fd")) == before  # the files opened were closed again


def test_device_functions_check_their_arguments(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\0" * 64)
    ex = Executor(IOConfig(engine="threads"))
    host = torch.zeros(16, dtype=torch.uint8)
    with File(path) as f:
        with pytest.raises(TypeError, match="device_tensor_uint8: expected a CUDA tensor"):
            cuda.read_into_device(ex, f, 0, 16, host, staging_bytes=1 << 20)
        with pytest.raises(TypeError, match="device_tensor: expected a CUDA tensor"):
            cuda.write_from_device(ex, f, 0, host, staging_bytes=1 << 20)
        with pytest.raises(TypeError, match="executor"):
            cuda.read_into_device(object(), f, 0, 16, host, staging_bytes=1 << 20)
        with pytest.raises(TypeError, match="file"):
            cuda.read_into_device(ex, str(path), 0, 16, host, staging_bytes=1 << 20)
        with pytest.raises(ValueError, match="file_offset"):
            cuda.read_into_device(ex, f, -1, 16, host, staging_bytes=1 << 20)
        with pytest.raises(ValueError, match="staging_bytes"):
            cuda.read_into_device(ex, f, 0, 16, host, staging_bytes=4096)
        with pytest.raises(TypeError, match="buffer"):
            cuda.submit_device_io(ex, f, BufferRef(host.data_ptr(), 16, host), 0, write=False)
        with pytest.raises(TypeError, match="expected a CUDA torch.Tensor"):
            cuda.submit_device_io(ex, f, BufferRef(0, 16, b"x" * 16), 0, write=False)
    with pytest.raises(TypeError, match="tensor: expected a contiguous host"):
        cuda.pin_host_tensor(torch.zeros(8, 2)[:, 0])


@pytest.mark.skipif(CUDA, reason="checks what happens where CUDA is missing")
def test_device_functions_without_cuda_say_so(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\0" * 64)
    ex = Executor(IOConfig(engine="threads"))
    with File(path) as f, pytest.raises(RuntimeError, match="CUDA is not available"):
        cuda.read_into_device(ex, f, 0, 16, _FakeCudaTensor(16), staging_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        cuda.pin_host_tensor(torch.zeros(8))


# ------------------------------------------------------------------------------ on GPU


def _random_bytes(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


SIZES = [1, 4095, 4097, (1 << 20) + 3, (40 << 20) + 5]  # the last spans several staging buffers
OFFSETS = [0, 4096 + 7]


@pytest.fixture(params=["threads", "auto"])
def handle(request):
    return aio_handle(
        block_size=1 << 20, queue_depth=16, intra_op_parallelism=2, engine=request.param
    )


@pytest.mark.cuda
@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("offset", OFFSETS)
def test_aio_handle_cuda_roundtrip(handle, tmp_path, nbytes, offset):
    data = _random_bytes(nbytes, nbytes)
    src = data.cuda()
    path = str(tmp_path / "c.bin")
    assert handle.sync_pwrite(src, path, file_offset=offset) == 1
    assert os.path.getsize(path) == offset + nbytes
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read() == data.numpy().tobytes()
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    assert handle.sync_pread(dst, path, file_offset=offset) == 1
    assert torch.equal(dst.cpu(), data)
    dst.zero_()
    assert handle.async_pread(dst, path, file_offset=offset) == 0
    assert handle.wait() == 1
    assert torch.equal(dst.cpu(), data)


@pytest.mark.cuda
def test_aio_handle_cuda_every_method_and_dtype(handle, tmp_path):
    src = torch.randn(3 * 1024 + 1, device="cuda")  # float32, awkward byte size
    paths = [str(tmp_path / f"m{i}.bin") for i in range(4)]
    assert handle.write(src, paths[0], validate=True) == 0
    assert handle.pwrite(src, paths[1], False, False) == 1
    assert handle.pwrite(src, paths[2], async_op=True) == 0
    assert handle.async_pwrite(src, paths[3]) == 0
    assert handle.wait() == 2
    outs = [torch.empty_like(src) for _ in range(4)]
    assert handle.read(outs[0], paths[0], validate=True) == 0
    assert handle.pread(outs[1], paths[1], False, False) == 1
    assert handle.pread(outs[2], paths[2], **{"async": True}) == 0
    assert handle.async_pread(outs[3], paths[3]) == 0
    assert handle.wait() == 2
    for out in outs:
        assert torch.equal(out, src)


@pytest.mark.cuda
def test_aio_handle_cuda_sees_pending_kernels_and_many_queued_ops(handle, tmp_path):
    path = str(tmp_path / "q.bin")
    tensors = []
    offset = 0
    for i in range(12):
        # Produced by kernels still queued when the write is submitted.
        t = torch.full((4096 * i + 3 + i,), i, dtype=torch.uint8, device="cuda") * 1
        tensors.append((t, offset))
        assert handle.async_pwrite(t, path, file_offset=offset) == 0
        offset += t.numel()
    assert handle.wait() == 12
    outs = []
    for t, off in tensors:
        o = torch.empty_like(t)
        handle.async_pread(o, path, file_offset=off)
        outs.append(o)
    assert handle.wait() == 12
    for o, (t, _) in zip(outs, tensors):
        assert torch.equal(o, t)


@pytest.mark.cuda
def test_aio_handle_cuda_errors_surface(handle, tmp_path):
    path = str(tmp_path / "short.bin")
    with open(path, "wb") as f:
        f.write(b"x" * 100)
    with pytest.raises(ValueError, match="past the end"):
        handle.sync_pread(torch.empty(101, dtype=torch.uint8, device="cuda"), path)
    with pytest.raises(ValueError, match="contiguous"):
        handle.sync_pwrite(torch.zeros(8, 2, device="cuda")[:, 0], path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert handle.async_pwrite(torch.ones(10, dtype=torch.uint8, device="cuda"), fd=fd) == 0
        with pytest.raises(OSError):
            handle.wait()
    finally:
        os.close(fd)


@pytest.mark.cuda
@pytest.mark.parametrize("offset", [0, 7, 4096 + 7])
@pytest.mark.parametrize("nbytes", [1, 4097, (3 << 20) + 5])
def test_read_into_device(tmp_path, offset, nbytes):
    data = _random_bytes(offset + nbytes + 100, 5)
    path = tmp_path / "r.bin"
    path.write_bytes(data.numpy().tobytes())
    ex = Executor(IOConfig(engine="auto", intra_op_parallelism=2))
    arena = torch.full((nbytes + 10,), 0xAB, dtype=torch.uint8, device="cuda")
    with File(path) as f:
        cuda.read_into_device(ex, f, offset, nbytes, arena, staging_bytes=1 << 20)
    assert torch.equal(arena[:nbytes].cpu(), data[offset : offset + nbytes])
    assert bool((arena[nbytes:] == 0xAB).all())  # only the first nbytes are written
    with File(path) as f, pytest.raises(OSError, match="past the end"):
        cuda.read_into_device(ex, f, offset + 101, nbytes, arena, staging_bytes=1 << 20)


@pytest.mark.cuda
@pytest.mark.parametrize("offset", [0, 4096 + 7])
def test_write_from_device(tmp_path, offset):
    src = torch.randn((5 << 20) // 4 + 3, device="cuda")
    ex = Executor(IOConfig(engine="auto"))
    path = tmp_path / "w.bin"
    with File(path, write=True, create=True) as f:
        cuda.write_from_device(ex, f, offset, src, staging_bytes=2 << 20)
    raw = path.read_bytes()
    assert len(raw) == offset + src.numel() * 4
    assert raw[offset:] == src.cpu().numpy().tobytes()
    half = src.numel() * 2
    with File(path, write=True) as f:
        cuda.write_from_device(ex, f, 0, src, staging_bytes=1 << 20, nbytes=half)
    assert path.read_bytes()[:half] == src.cpu().numpy().tobytes()[:half]


@pytest.mark.cuda
def test_host_pinning_makes_device_copies_asynchronous():
    from fastckpt.io.aligned_memory import aligned_tensor

    src = torch.arange(1 << 16, dtype=torch.int32, device="cuda") * 3
    dst = aligned_tensor(src.numel() * 4 + 4096)
    cuda.pin_host_tensor(dst)
    try:
        dst[: src.numel() * 4].copy_(src.view(torch.uint8), non_blocking=True)
        torch.cuda.synchronize()
        got = np.frombuffer(dst[: src.numel() * 4].numpy().tobytes(), dtype=np.int32)
        assert np.array_equal(got, src.cpu().numpy())
    finally:
        cuda.unpin_host_tensor(dst)


@pytest.mark.cuda
def test_gds_false_and_unavailable_gds_use_the_pipeline(tmp_path, monkeypatch):
    data = _random_bytes(4097, 9)
    path = tmp_path / "p.bin"
    path.write_bytes(data.numpy().tobytes())
    ex = Executor(IOConfig(engine="threads"))
    arena = torch.empty(4097, dtype=torch.uint8, device="cuda")
    monkeypatch.setenv("FASTCKPT_GDS", "1")  # GDS where available, else the pipeline
    with File(path) as f:
        cuda.read_into_device(ex, f, 0, 4097, arena, staging_bytes=1 << 20)
        assert torch.equal(arena.cpu(), data)
        arena.zero_()
        cuda.read_into_device(ex, f, 0, 4097, arena, staging_bytes=1 << 20, gds=False)
        assert torch.equal(arena.cpu(), data)


# ------------------------------------------- the pipelines' bookkeeping, on the CPU


@pytest.fixture
def host_cuda(monkeypatch):
    """Stands CPU memory in for device memory: streams, events and pinned buffers become
    no-ops and plain tensors, so the staging pipelines' chunking, ring and error handling
    run with real I/O on any machine."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", HostStream)
    monkeypatch.setattr(torch.cuda, "Event", HostEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: HostStream())
    monkeypatch.setattr(cuda, "_pinned", lambda torch_, n: torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(cuda, "require_cuda", lambda: torch)
    monkeypatch.setattr(cuda, "_check_device_bytes", lambda tensor, argname: None)


PIPE_SIZES = [1, 4095, 4097, 3 * 8192, 3 * 8192 + 1, 100_003]


@pytest.mark.parametrize("nbytes", PIPE_SIZES)
@pytest.mark.parametrize("offset", [0, 7, 8192 + 4096 + 7])
@pytest.mark.parametrize("depth", [2, 3, 8])
def test_pipeline_file_to_device_bookkeeping(host_cuda, tmp_path, nbytes, offset, depth):
    data = _random_bytes(offset + nbytes, nbytes + depth)
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    ex = Executor(IOConfig(engine="auto", intra_op_parallelism=2, block_size=4096))
    dst = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    with File(path) as f:
        cuda._file_to_device(
            ex, f, dst, offset, max_parts=0, chunk=8192, depth=depth, ready=HostEvent()
        )
    assert torch.equal(dst, data[offset:])
    assert ex.pending() == 0


@pytest.mark.parametrize("nbytes", PIPE_SIZES)
@pytest.mark.parametrize("offset", [0, 7, 8192 + 4096 + 7])
@pytest.mark.parametrize("depth", [2, 3, 8])
def test_pipeline_device_to_file_bookkeeping(host_cuda, tmp_path, nbytes, offset, depth):
    src = _random_bytes(nbytes, nbytes * 3 + depth)
    path = tmp_path / "f.bin"
    ex = Executor(IOConfig(engine="auto", intra_op_parallelism=2, block_size=4096))
    with File(path, write=True, create=True) as f:
        cuda._device_to_file(ex, f, src, offset, max_parts=1, chunk=8192, depth=depth, ready=None)
    raw = path.read_bytes()
    assert len(raw) == offset + nbytes
    assert raw[offset:] == src.numpy().tobytes()
    assert ex.pending() == 0


def test_pipeline_errors_are_raised_after_every_op_finished(host_cuda, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 50_000)
    ex = Executor(IOConfig(engine="threads", block_size=4096))
    dst = torch.zeros(100_000, dtype=torch.uint8)
    with File(path) as f, pytest.raises(OSError, match="end of the file"):
        cuda._file_to_device(ex, f, dst, 0, max_parts=0, chunk=8192, depth=4, ready=None)
    assert ex.pending() == 0
    assert bytes(dst[:49_152].numpy()) == b"x" * 49_152  # the pieces before the failing one
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            cuda._device_to_file(
                ex, File.from_fd(fd), dst, 0, max_parts=0, chunk=8192, depth=4, ready=None
            )
        assert info.value.errno is not None
    finally:
        os.close(fd)
    assert ex.pending() == 0


def test_submit_device_io_runs_in_the_background_and_reports(host_cuda, tmp_path):
    data = _random_bytes((1 << 20) + 3, 11)
    path = tmp_path / "s.bin"
    ex = Executor(IOConfig(engine="threads"))
    with File(path, write=True, create=True) as f:
        wait = cuda.submit_device_io(
            ex, f, BufferRef(data.data_ptr(), data.numel(), data, True), 4096 + 7, write=True
        )
        assert wait() is None
    assert path.read_bytes()[4096 + 7 :] == data.numpy().tobytes()
    back = torch.zeros_like(data)
    with File(path) as f:
        wait = cuda.submit_device_io(
            ex, f, BufferRef(back.data_ptr(), back.numel(), back, True), 4096 + 7, write=False
        )
        wait()
    assert torch.equal(back, data)
    with File(path) as f:
        too_far = cuda.submit_device_io(
            ex, f, BufferRef(back.data_ptr(), back.numel(), back, True), 1 << 22, write=False
        )
        with pytest.raises(OSError, match="end of the file"):
            too_far()
    with pytest.raises(ValueError, match="reference covers"):
        cuda.submit_device_io(ex, None, BufferRef(back.data_ptr(), 5, back, True), 0, write=False)


# ------------------------------------------------ checkpoints to and from CUDA


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, 257, generator=g),  # spans several 64 KiB staging pieces
        "norm": torch.randn(257, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7),
        "empty": torch.empty(0, 3),
        "mask": torch.rand(33, generator=g) > 0.5,
    }


@pytest.fixture
def device_load_on_host(host_cuda, monkeypatch):
    """The CUDA load path with host memory as the "device" and small staging pieces."""
    import fastckpt.checkpoint.read

    monkeypatch.setattr(cuda, "device_arena", lambda n, device: torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(fastckpt.checkpoint.read, "staging_bytes", lambda: 1 << 20)
    monkeypatch.setattr(cuda, "_ring", lambda staging: (64 << 10, 3))


def test_cuda_load_pipeline_bookkeeping(device_load_on_host, tmp_path):
    import fastckpt

    state = _state()
    path = tmp_path / "ckpt.safetensors"
    fastckpt.save({"model": state, "epoch": 3}, path)
    back = fastckpt.load(path, device="cuda")
    assert back["epoch"] == 3
    for name, t in state.items():
        assert torch.equal(back["model"][name], t), name
        assert back["model"][name].dtype == t.dtype
    # all the tensors live in one arena, one allocation: their bytes lie within the file's size
    starts = [back["model"][n].data_ptr() for n in ("embed", "norm", "step")]
    assert max(starts) - min(starts) < path.stat().st_size
    subset = fastckpt.load(path, map_location="cuda", keys=["model/norm"])
    assert torch.equal(subset["model/norm"], state["norm"])
    with fastckpt.open(path, device="cuda") as reader:
        assert torch.equal(reader.get_tensor("model/embed"), state["embed"])


def test_cuda_load_verifies_from_the_staging_buffers(device_load_on_host, tmp_path):
    import fastckpt
    from fastckpt.errors import ChecksumError

    path = tmp_path / "ckpt.safetensors"
    fastckpt.save(_state(), path)
    with fastckpt.open(path) as reader:
        at = reader.info("embed").offset + 100_000  # inside the third 64 KiB piece
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ChecksumError, match="'embed'") as info:
        fastckpt.load(path, device="cuda")
    assert info.value.tensor == "embed"
    back = fastckpt.load(path, device="cuda", verify=False)  # the damage is read as is
    assert not torch.equal(back["embed"], _state()["embed"])


def test_cuda_load_without_cuda_says_so(tmp_path):
    import fastckpt

    if CUDA:
        pytest.skip("CUDA is available here")
    path = tmp_path / "c.safetensors"
    fastckpt.save({"x": torch.ones(2)}, path)
    for call in (
        lambda: fastckpt.load(path, device="cuda:0"),
        lambda: fastckpt.open(path, device="cuda"),
        lambda: fastckpt.async_load(path, map_location="cuda").result(),
    ):
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            call()


@pytest.mark.cuda
@pytest.mark.parametrize("verify", [True, False])
def test_cuda_load_round_trip(tmp_path, verify):
    import fastckpt

    state = _state(1)
    path = tmp_path / "ckpt.safetensors"
    fastckpt.save({"model": state, "lr": 0.5}, path)
    back = fastckpt.load(path, device="cuda", verify=verify)
    assert back["lr"] == 0.5
    for name, t in state.items():
        assert back["model"][name].is_cuda
        assert torch.equal(back["model"][name].cpu(), t), name
    with fastckpt.open(path, device="cuda:0") as reader:
        reader.prefetch(["model/norm"])
        assert torch.equal(reader.get_tensor("model/norm").cpu(), state["norm"])
        assert reader.get_tensor("model/embed").device.type == "cuda"
    loaded = fastckpt.async_load(path, map_location="cuda").result()
    assert torch.equal(loaded["model"]["embed"].cpu(), state["embed"])


@pytest.mark.cuda
def test_cuda_save_round_trip_and_async_snapshot(tmp_path):
    import fastckpt

    state = {k: v.cuda() for k, v in _state(2).items()}
    path = tmp_path / "from_gpu.safetensors"
    fastckpt.save(state, path)
    back = fastckpt.load(path)
    for name, t in state.items():
        assert torch.equal(back[name], t.cpu()), name
    future = fastckpt.async_save(state, tmp_path / "async.safetensors")
    expected = state["embed"].cpu()
    state["embed"].add_(1)  # after the snapshot: must not reach the file
    future.result()
    assert torch.equal(fastckpt.load(tmp_path / "async.safetensors")["embed"], expected)


@pytest.mark.cuda
def test_cuda_load_with_gds_where_it_runs(tmp_path):
    import fastckpt
    from fastckpt import gds

    path = tmp_path / "g.safetensors"
    state = _state(3)
    fastckpt.save(state, path)
    if not gds.engine_info().available:
        with pytest.raises(EngineUnavailableError):
            fastckpt.load(path, device="cuda", gds=True)
        return
    back = fastckpt.load(path, device="cuda", gds=True)
    for name, t in state.items():
        assert torch.equal(back[name].cpu(), t), name


def test_tuning_decides_gds_per_file_system(tmp_path, monkeypatch):
    from fastckpt import gds
    from fastckpt.config import (
        filesystem_key,
        gds_preferred,
        load_tuned,
        save_tuned,
        save_tuned_gds,
    )

    monkeypatch.delenv("FASTCKPT_GDS", raising=False)
    target = tmp_path / "ckpt.safetensors"
    key = filesystem_key(tmp_path)
    assert not gds_preferred(target)  # nothing measured
    save_tuned_gds(key, {"read_gbps": 9.0})
    assert not gds_preferred(target)  # no staging-pipeline figure to compare with
    save_tuned(key, {"block_size": 1 << 20}, {"gpu": False, "read_gbps": 3.0})
    assert not gds_preferred(target)  # measured with host buffers: not the same path
    save_tuned(key, {"block_size": 1 << 20}, {"gpu": True, "read_gbps": 3.0})
    assert load_tuned()[key]["gds"]["read_gbps"] == 9.0  # kept across a re-tune
    assert gds_preferred(target)
    # Preferred, and used wherever GDS can run; the env variable still decides when set.
    assert cuda.use_gds(None, target) is gds.engine_info().available
    monkeypatch.setenv("FASTCKPT_GDS", "0")
    assert cuda.use_gds(None, target) is False
    monkeypatch.delenv("FASTCKPT_GDS")
    save_tuned_gds(key, {"read_gbps": 2.0})
    assert not gds_preferred(target)
    assert cuda.use_gds(None, target) is False


@pytest.mark.parametrize("mode", ["direct", "buffered", "mapped"])
def test_cuda_load_staging_reads_follow_the_read_policy(
    device_load_on_host, tmp_path, monkeypatch, mode
):
    import fastckpt
    from fastckpt.io import page_cache

    state = {"w": torch.randn(1 << 20)}  # 4 MiB: many staging pieces
    path = tmp_path / "policy.safetensors"
    fastckpt.save(state, path)
    with File(path) as f:
        if f.direct_fd < 0:
            pytest.skip("this file system refuses O_DIRECT")
    drop_from_page_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        if page_cache.resident_fraction(fd, 0, path.stat().st_size) != 0.0:
            pytest.skip("the kernel kept the file's pages (or cannot say)")
        monkeypatch.setenv("FASTCKPT_READ_MODE", mode)
        back = fastckpt.load(path, device="cuda")
        assert torch.equal(back["w"], state["w"])
        resident = page_cache.resident_fraction(fd, 0, path.stat().st_size)
    finally:
        os.close(fd)
    # O_DIRECT staging reads leave the page cache empty; buffered ones (and mapped, which
    # stages through the page cache on a device) fill it
    assert (resident < 0.1) if mode == "direct" else (resident > 0.9), resident
