"""CUDA tensors to and from files: page-locked staging pipelines, and GDS where asked.

Disk I/O needs host memory (or GPUDirect Storage). For a CUDA tensor the bytes go through
a small ring of page-locked host buffers, with the disk transfer of one buffer overlapping
the host/device copy of another on a side CUDA stream:

- reads: the engine fills buffers ahead while the previous buffer is copied to the GPU;
- writes: the next piece is copied from the GPU while the previous pieces are written.

Every transfer is ordered after the work queued on the tensor's current stream when it
was submitted, and is complete (side stream synchronized) when its wait returns, so the
data is visible to any stream afterwards.

Memory each function uses:

- :func:`submit_device_io` (``aio_handle`` with CUDA tensors): up to ``DEPTH`` (4) buffers
  of ``CHUNK`` (16 MiB) per operation, fewer for small ones; at most ``PIPELINES`` (4)
  operations stage at once (the others wait their turn), so at most 256 MiB of pinned
  host memory, taken from PyTorch's pinned-memory caching allocator and reused.
- :func:`read_into_device` / :func:`write_from_device`: ``staging_bytes`` of pinned host
  memory in up to 8 buffers; none with ``gds=True`` (cuFile uses its own buffers).

Example (needs a CUDA GPU)::

    from fastckpt.io.executor import Executor
    from fastckpt.io.files import File
    from fastckpt.config import IOConfig
    ex = Executor(IOConfig())
    arena = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    with File("model.safetensors") as f:
        read_into_device(ex, f, data_offset, nbytes, arena, staging_bytes=256 << 20)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from typing import Any, Callable, Iterator

from fastckpt import config
from fastckpt.errors import EngineUnavailableError
from fastckpt.io import cufile
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, BufferRef
from fastckpt.io.executor import Executor
from fastckpt.io.files import File
from fastckpt.io.interrupts import result_when_done

__all__ = [
    "CHUNK",
    "DEPTH",
    "PIPELINES",
    "device_arena",
    "pin_host_tensor",
    "read_into_device",
    "require_cuda",
    "submit_device_io",
    "unpin_host_tensor",
    "use_gds",
    "write_from_device",
]

#: Bytes per staging buffer of :func:`submit_device_io`.
CHUNK = 16 << 20
#: Staging buffers per operation: one being copied while the others are on disk.
DEPTH = 4
#: Operations staging at once; later ones wait (bounds pinned memory).
PIPELINES = 4

#: ``on_host(file_offset, address, nbytes)``: sees each piece of a read in host memory.
OnHost = Callable[[int, int, int], None]

_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _pipelines() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=PIPELINES, thread_name_prefix="fastckpt-cuda"
            )
        return _pool


def require_cuda() -> Any:
    """torch, after checking CUDA can run (RuntimeError saying why not).

    Example (needs a CUDA GPU)::

        torch = require_cuda()
    """
    import torch

    if not torch.cuda.is_available():
        why = (
            "this PyTorch is built without CUDA"
            if torch.version.cuda is None
            else "torch.cuda.is_available() is False"
        )
        raise RuntimeError(f"cannot move CUDA tensor data: CUDA is not available ({why})")
    return torch


def device_arena(nbytes: int, device: Any) -> Any:
    """``nbytes`` of uninitialized uint8 memory on a CUDA device (one allocation)."""
    torch = require_cuda()
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _check_device_bytes(tensor: Any, argname: str) -> None:
    if not (hasattr(tensor, "is_cuda") and hasattr(tensor, "data_ptr")):
        raise TypeError(f"{argname}: expected a CUDA torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cuda:
        raise TypeError(f"{argname}: expected a CUDA tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{argname}: the tensor is not contiguous; call .contiguous() first")


def _uint8() -> Any:
    import torch

    return torch.uint8


def _as_bytes(tensor: Any) -> Any:
    """A flat uint8 view of a contiguous tensor."""
    import torch

    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _plan(file_offset: int, nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """(file position, length) of each piece; pieces end on multiples of ``chunk`` in the
    file, so all but the first start aligned and go through O_DIRECT whole."""
    pieces = []
    pos, end = file_offset, file_offset + nbytes
    while pos < end:
        stop = min(end, (pos // chunk + 1) * chunk)
        pieces.append((pos, stop - pos))
        pos = stop
    return pieces


def _buffers(torch: Any, pieces: list[tuple[int, int]], align: int, count: int) -> list[Any]:
    # A piece sits in its buffer at its file position modulo the alignment, so memory and
    # file offsets line up for O_DIRECT.
    need = max(pos % align + n for pos, n in pieces)
    need = -(-need // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT
    return [_pinned(torch, need) for _ in range(count)]


def _pinned(torch: Any, nbytes: int) -> Any:
    """Page-locked, page-aligned host bytes from PyTorch's caching allocator, reused across calls.

    cudaHostAlloc memory is page-aligned; PyTorch configured to pin with cudaHostRegister
    over malloc may hand out an unaligned block, which is then re-taken one page larger and
    sliced, so O_DIRECT can use it.
    """
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if buf.data_ptr() % BUFFER_ALIGNMENT == 0:
        return buf
    buf = torch.empty(nbytes + BUFFER_ALIGNMENT, dtype=torch.uint8, pin_memory=True)
    skip = -buf.data_ptr() % BUFFER_ALIGNMENT
    return buf[skip : skip + nbytes]


def _drain(executor: Executor, in_flight: dict[int, int]) -> None:
    """Waits for every op still in flight, ignoring their errors (a first one is on its way);
    an interrupt meanwhile does not cut the wait short and is raised once all are collected."""
    interrupt = executor.drain(in_flight.values(), cancel=True)
    in_flight.clear()
    if interrupt is not None:
        raise interrupt


@contextlib.contextmanager
def _side_stream(torch: Any, tensor: Any, ready: Any) -> Iterator[Any]:
    """A new stream on ``tensor``'s device, after ``ready``; synchronized on the way out."""
    with torch.cuda.device(tensor.device):
        stream = torch.cuda.Stream(tensor.device)
        if ready is not None:
            stream.wait_event(ready)
        try:
            yield stream
        finally:
            stream.synchronize()


def _file_to_device(
    executor: Executor,
    file: File,
    dst: Any,
    file_offset: int,
    *,
    max_parts: int,
    chunk: int,
    depth: int,
    ready: Any,
    on_host: OnHost | None = None,
    direct: bool = True,
) -> None:
    import torch

    pieces = _plan(file_offset, dst.numel(), chunk)
    if not pieces:
        return
    align = file.alignment
    count = min(max(2, depth), len(pieces))
    with _side_stream(torch, dst, ready) as stream:
        buffers = _buffers(torch, pieces, align, count)
        copied: list[Any] = [None] * count
        in_flight: dict[int, int] = {}

        def start(i: int) -> None:
            pos, n = pieces[i]
            buf = buffers[i % count]
            ref = BufferRef(buf.data_ptr() + pos % align, n, buf)
            in_flight[i] = executor.submit(
                file, ref, pos, write=False, max_parts=max_parts, direct=direct
            )

        try:
            for i in range(count):
                start(i)
            for i, (pos, n) in enumerate(pieces):
                executor.wait(in_flight[i])  # dropped once collected: _drain skips it then
                del in_flight[i]
                buf, lead, at = buffers[i % count], pos % align, pos - file_offset
                with torch.cuda.stream(stream):
                    dst[at : at + n].copy_(buf[lead : lead + n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                copied[i % count] = event
                if on_host is not None:  # reads the buffer while the copy to the GPU runs
                    on_host(pos, buf.data_ptr() + lead, n)
                # Refill the buffer of the previous piece once its copy is done; the copy just
                # queued overlaps the reads already in flight.
                refill = i - 1 + count
                if i >= 1 and refill < len(pieces):
                    copied[(i - 1) % count].synchronize()
                    start(refill)
        finally:
            _drain(executor, in_flight)


def _device_to_file(
    executor: Executor,
    file: File,
    src: Any,
    file_offset: int,
    *,
    max_parts: int,
    chunk: int,
    depth: int,
    ready: Any,
) -> None:
    import torch

    pieces = _plan(file_offset, src.numel(), chunk)
    if not pieces:
        return
    align = file.alignment
    count = min(max(2, depth), len(pieces))
    with _side_stream(torch, src, ready) as stream:
        buffers = _buffers(torch, pieces, align, count)
        in_flight: dict[int, int] = {}
        try:
            for i, (pos, n) in enumerate(pieces):
                if i >= count:
                    executor.wait(in_flight[i - count])  # its buffer is free again
                    del in_flight[i - count]
                buf, lead, at = buffers[i % count], pos % align, pos - file_offset
                with torch.cuda.stream(stream):
                    buf[lead : lead + n].copy_(src[at : at + n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                event.synchronize()
                ref = BufferRef(buf.data_ptr() + lead, n, buf)
                in_flight[i] = executor.submit(file, ref, pos, write=True, max_parts=max_parts)
            for i in sorted(in_flight):
                executor.wait(in_flight[i])
                del in_flight[i]
        finally:
            _drain(executor, in_flight)


def _ready_event(torch: Any, tensor: Any) -> Any:
    """An event on the tensor's current stream: what the caller queued so far comes first."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def submit_device_io(
    executor: Executor,
    file: File,
    ref: BufferRef,
    file_offset: int,
    *,
    write: bool,
    max_parts: int = 0,
) -> Callable[[], None]:
    """Starts moving a CUDA tensor's bytes to (``write``) or from ``file`` at ``file_offset``
    through page-locked staging buffers; returns a function that blocks until the transfer
    is done and raises its first error.

    Used by :class:`fastckpt.aio.aio_handle` for CUDA tensors. The transfer runs in a
    background thread (at most :data:`PIPELINES` at once), so this returns at once.
    ``ref.owner`` must be the contiguous CUDA tensor; it is kept alive until the end.

    Raises:
        TypeError: ``ref`` is not a CUDA tensor's.
        RuntimeError: CUDA is not available.
    """
    tensor = ref.owner
    _check_device_bytes(tensor, "buffer")
    torch = require_cuda()
    flat = _as_bytes(tensor)
    if flat.numel() != ref.nbytes:
        raise ValueError(
            f"buffer: the reference covers {ref.nbytes} bytes but the tensor has {flat.numel()}"
        )
    ready = _ready_event(torch, tensor)
    move = _device_to_file if write else _file_to_device
    future = _pipelines().submit(
        move,
        executor,
        file,
        flat,
        file_offset,
        max_parts=max_parts,
        chunk=CHUNK,
        depth=DEPTH,
        ready=ready,
    )

    def wait() -> None:
        result_when_done(future)  # Ctrl-C meanwhile: raised once the transfer is over

    return wait


def use_gds(gds: bool | None, path: str | os.PathLike[str] | None = None) -> bool:
    """Whether a device transfer (of the file ``path``) goes through GPUDirect Storage.

    ``True``: yes, or :class:`EngineUnavailableError` where it cannot run. ``False``: no.
    ``None``: the environment variable ``FASTCKPT_GDS`` decides when set (1/true/yes/on or
    0/false/no/off); otherwise GDS is used when ``fastckpt tune`` measured it reading faster
    than the staging pipeline on ``path``'s file system (:func:`fastckpt.config.gds_preferred`).
    Either way only where GDS is available, so an unavailable GDS falls back to the pipeline.

    Example:
        >>> use_gds(False)
        False
    """
    if gds is None:
        choice = config.gds_choice()
        if choice is False:
            return False
        if choice is None and (path is None or not config.gds_preferred(path)):
            return False
        return cufile.status()[0]
    if not gds:
        return False
    available, reason = cufile.status()
    if not available:
        raise EngineUnavailableError(f"gds=True: GPUDirect Storage is not available here: {reason}")
    return True


def _device_transfer_args(
    executor: Executor,
    file: File,
    file_offset: int,
    nbytes: int | None,
    tensor: Any,
    staging_bytes: int,
    argname: str,
) -> tuple[Any, Any, int]:
    """Checks the arguments of a device transfer; returns (torch, the tensor's first
    ``nbytes`` as uint8, nbytes)."""
    if not isinstance(executor, Executor):
        raise TypeError(
            f"executor: expected a fastckpt.io.executor.Executor, got {type(executor).__name__}"
        )
    if not isinstance(file, File):
        raise TypeError(f"file: expected a fastckpt.io.files.File, got {type(file).__name__}")
    if isinstance(file_offset, bool) or not isinstance(file_offset, int) or file_offset < 0:
        raise ValueError(f"file_offset must be a non-negative int, got {file_offset!r}")
    if (
        isinstance(staging_bytes, bool)
        or not isinstance(staging_bytes, int)
        or staging_bytes < (1 << 20)
    ):
        raise ValueError(f"staging_bytes must be an int of at least 1 MiB, got {staging_bytes!r}")
    _check_device_bytes(tensor, argname)
    torch = require_cuda()
    flat = _as_bytes(tensor)
    if nbytes is None:
        nbytes = flat.numel()
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= flat.numel():
        raise ValueError(
            f"nbytes must be an int between 0 and {argname}'s {flat.numel()} bytes, got {nbytes!r}"
        )
    return torch, flat[:nbytes], nbytes


def _ring(staging_bytes: int) -> tuple[int, int]:
    """(chunk, depth) for a staging budget: up to 8 buffers of 4 to 64 MiB."""
    chunk = min(64 << 20, max(4 << 20, staging_bytes // 8)) // (1 << 20) * (1 << 20)
    chunk = min(chunk, staging_bytes // 2 // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT)
    depth = max(2, min(8, staging_bytes // chunk))
    return chunk, depth


def read_into_device(
    executor: Executor,
    file: File,
    file_offset: int,
    nbytes: int,
    device_tensor_uint8: Any,
    *,
    staging_bytes: int,
    gds: bool | None = None,
    max_parts: int = 0,
    on_host: OnHost | None = None,
    direct: bool = True,
) -> None:
    """Reads ``nbytes`` of ``file`` at ``file_offset`` into the start of a contiguous CUDA
    tensor (a uint8 arena, or the bytes of any dtype); blocks until the bytes are there
    (visible to every stream).

    Through the staging pipeline (``staging_bytes`` of pinned host memory, disk reads
    overlapping host-to-device copies), or straight into device memory with cuFile when
    :func:`use_gds` says so (``gds=True``: GDS or an error; ``None``: ``FASTCKPT_GDS``).
    ``max_parts`` caps the threads each disk read is split over (0: the executor's).
    ``on_host(file_offset, address, nbytes)``, if given, is called with every piece in file
    order while it is in host memory (to checksum it); with GDS the bytes never are, so the
    pieces are copied back from the GPU through ``staging_bytes`` of pinned memory for it.
    ``direct=False`` reads the staging buffers through the page cache (the caller's read
    policy found buffered reads faster, or the bytes resident); GDS ignores it.

    Raises:
        TypeError/ValueError: a bad argument (named).
        EngineUnavailableError: ``gds=True`` where GDS cannot run.
        OSError: the read failed, or the file is too short.
    """
    torch, dst, nbytes = _device_transfer_args(
        executor,
        file,
        file_offset,
        nbytes,
        device_tensor_uint8,
        staging_bytes,
        "device_tensor_uint8",
    )
    if nbytes == 0:
        return
    size = file.size()
    if file_offset + nbytes > size:
        import errno

        raise OSError(
            errno.ENODATA,
            f"read of {nbytes} bytes at offset {file_offset} goes past the end of the "
            f"file ({size} bytes)",
            file.path,
        )
    if use_gds(gds, file.path):
        threads = max_parts or executor.config.intra_op_parallelism
        cufile.transfer(file, dst, file_offset, write=False, threads=threads)
        if on_host is not None:
            _replay_from_device(torch, dst, file_offset, staging_bytes, on_host)
        return
    chunk, depth = _ring(staging_bytes)
    _file_to_device(
        executor,
        file,
        dst,
        file_offset,
        max_parts=max_parts,
        chunk=chunk,
        depth=depth,
        ready=_ready_event(torch, dst),
        on_host=on_host,
        direct=direct,
    )


def _replay_from_device(
    torch: Any, src: Any, file_offset: int, staging_bytes: int, on_host: OnHost
) -> None:
    """Copies ``src`` back to pinned host memory piece by piece and shows each to ``on_host``."""
    chunk, _ = _ring(staging_bytes)
    host = _pinned(torch, min(chunk, src.numel()))
    for at in range(0, src.numel(), chunk):
        n = min(chunk, src.numel() - at)
        host[:n].copy_(src[at : at + n])  # synchronous: the bytes are there when it returns
        on_host(file_offset + at, host.data_ptr(), n)


def write_from_device(
    executor: Executor,
    file: File,
    file_offset: int,
    device_tensor: Any,
    *,
    staging_bytes: int,
    nbytes: int | None = None,
    gds: bool | None = None,
    max_parts: int = 0,
) -> None:
    """Writes the first ``nbytes`` (default: all) of a contiguous CUDA tensor to ``file`` at
    ``file_offset``; blocks until written (not fsync'ed).

    The mirror of :func:`read_into_device`: device-to-host copies into ``staging_bytes`` of
    pinned buffers overlap the disk writes, or cuFile writes from device memory with GDS.
    """
    torch, src, nbytes = _device_transfer_args(
        executor, file, file_offset, nbytes, device_tensor, staging_bytes, "device_tensor"
    )
    if nbytes == 0:
        return
    if use_gds(gds, file.path):
        threads = max_parts or executor.config.intra_op_parallelism
        cufile.transfer(file, src, file_offset, write=True, threads=threads)
        return
    chunk, depth = _ring(staging_bytes)
    _device_to_file(
        executor,
        file,
        src,
        file_offset,
        max_parts=max_parts,
        chunk=chunk,
        depth=depth,
        ready=_ready_event(torch, src),
    )


def pin_host_tensor(tensor: Any) -> None:
    """Page-locks a contiguous host tensor for CUDA (``cudaHostRegister``) so copies to and
    from it run asynchronously; undo with :func:`unpin_host_tensor` before freeing it.
    Raises ``RuntimeError`` naming the CUDA error."""
    if tensor.is_cuda or not tensor.is_contiguous():
        raise TypeError("tensor: expected a contiguous host (CPU) tensor")
    torch = require_cuda()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: CUDA error {int(err)}")


def unpin_host_tensor(tensor: Any) -> None:
    """Undoes :func:`pin_host_tensor`."""
    torch = require_cuda()
    if tensor.numel() == 0:
        return
    err = torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    if int(err) != 0:
        raise RuntimeError(f"cudaHostUnregister failed: CUDA error {int(err)}")
