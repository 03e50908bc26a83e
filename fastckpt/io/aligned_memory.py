"""Turns the objects users hand us (tensors, numpy arrays, buffers) into (address, nbytes).

The native core sees only addresses; the returned :class:`BufferRef` keeps the owning
object alive for as long as an operation on it is in flight.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from typing import Any

import numpy as np

from fastckpt import _C
from fastckpt.config import ARENA_PAGES, arena_pages
from fastckpt.io.cpu_load import cores

#: Alignment of every buffer fastckpt allocates for direct I/O: the native core's one
#: direct-I/O alignment (a page). The file format's default layout alignment has the same
#: value, so every tensor of a default layout starts on it, but the two are separate
#: constants: one is the I/O layer's, the other the format's.
BUFFER_ALIGNMENT: int = _C.DIRECT_IO_ALIGNMENT

__all__ = ["BufferRef", "buffer_ref", "aligned_tensor", "aligned_array", "arena_tensor"]


@dataclasses.dataclass(frozen=True)
class BufferRef:
    address: int
    nbytes: int
    owner: Any  # keeps the memory alive
    is_cuda: bool = False


def _is_torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def buffer_ref(
    obj: Any, *, writable: bool, argname: str = "buffer", allow_cuda: bool = False
) -> BufferRef:
    """The memory of a contiguous tensor, numpy array or buffer-protocol object.

    Args:
        writable: the operation writes into the memory (a file read), so it must be writable.
        argname: the caller's parameter name, used in error messages.
        allow_cuda: accept CUDA tensors (the caller stages them through host memory).

    Raises:
        TypeError: unsupported object, read-only buffer where a writable one is needed, or a
            CUDA tensor where none is supported.
        ValueError: a non-contiguous tensor or array.

    Example:
        >>> ref = buffer_ref(bytearray(16), writable=True)
        >>> ref.nbytes
        16
    """
    if _is_torch_tensor(obj):
        if obj.is_cuda and not allow_cuda:
            raise TypeError(f"{argname}: CUDA tensors are not supported here; pass a CPU tensor")
        if obj.device.type not in ("cpu", "cuda"):
            raise TypeError(f"{argname}: tensors on device {obj.device} are not supported")
        if obj.layout.__repr__() != "torch.strided":
            raise TypeError(
                f"{argname}: only dense (strided) tensors are supported, got {obj.layout}"
            )
        if not obj.is_contiguous():
            raise ValueError(f"{argname}: the tensor is not contiguous; call .contiguous() first")
        return BufferRef(obj.data_ptr(), obj.numel() * obj.element_size(), obj, bool(obj.is_cuda))
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{argname}: the array is not C-contiguous; use np.ascontiguousarray")
        if writable and not obj.flags.writeable:
            raise TypeError(f"{argname}: the array is read-only and cannot receive data")
        return BufferRef(obj.__array_interface__["data"][0], obj.nbytes, obj)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{argname}: expected a torch.Tensor, numpy.ndarray or buffer, got {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"{argname}: the buffer is not contiguous")
    if writable and view.readonly:
        raise TypeError(f"{argname}: the {type(obj).__name__} is read-only and cannot receive data")
    if view.nbytes == 0:
        return BufferRef(0, 0, view)
    array = np.frombuffer(view.cast("B"), dtype=np.uint8)
    return BufferRef(array.__array_interface__["data"][0], view.nbytes, (view, array))


def aligned_array(
    nbytes: int, *, lock: bool = False, strict: bool = False, reused: bool = False
) -> np.ndarray:
    """A page-aligned uint8 numpy array of ``nbytes`` (mlock()ed with ``lock``). ``reused``
    (with ``lock``): memory that many transfers go through, which the io_uring engine
    registers with the kernel on first use, so its pages are pinned once instead of for
    every request."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    # numpy's stub lists concrete buffer types before Python 3.12, and _C.pyi cannot declare
    # AlignedBuffer's buffer protocol (__buffer__) on the Pythons it must import on
    buffer = _C.AlignedBuffer(nbytes, lock=lock, strict=strict, reused=reused)
    return np.frombuffer(buffer, dtype=np.uint8)  # type: ignore[call-overload]


def aligned_tensor(
    nbytes: int,
    dtype: Any = None,
    *,
    lock: bool = False,
    strict: bool = False,
    reused: bool = False,
) -> Any:
    """A page-aligned 1-D torch tensor of ``nbytes`` bytes viewed as ``dtype`` (uint8 by default);
    ``lock``, ``strict`` and ``reused`` as for :func:`aligned_array`.

    The memory is freed when the last tensor viewing it is garbage collected.

    Example:
        >>> t = aligned_tensor(8192)
        >>> t.data_ptr() % BUFFER_ALIGNMENT, t.numel()
        (0, 8192)
    """
    import torch

    dtype = dtype or torch.uint8
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    buffer = _C.AlignedBuffer(nbytes, lock=lock, strict=strict, reused=reused)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    return raw.view(dtype) if dtype != torch.uint8 else raw


#: Arenas of at most this many bytes come from the process's heap (see :func:`arena_tensor`):
#: glibc serves blocks up to its largest mmap threshold (32 MiB on 64-bit) from memory that
#: earlier frees returned, once one such block was freed.
HEAP_ARENA_BYTES = 32 << 20

# How a large arena's pages come in (:func:`fastckpt.config.arena_pages`): ``"plain"`` (4 KiB
# pages, faulted in by the reads that fill them, on every reading thread), ``"huge"``
# (``MADV_HUGEPAGE``: 2 MiB pages where the host's transparent huge pages allow it, 512
# times fewer faults) or ``"populate"`` (``MADV_POPULATE_WRITE`` on every core before the
# reads). Plain by default: on our VM (huge pages "madvise", defrag "madvise") a 1 GiB
# arena in huge pages took 5.1 s to touch, compacting memory in the fault, against 0.9 s
# in plain pages; benchmarks/bench_memory.py measures them (``fastckpt-huge``,
# ``fastckpt-populate``).
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_POPULATE_STEP = 64 << 20


def _populate(address: int, nbytes: int) -> None:
    """Faults in ``nbytes`` at ``address`` for writing, in 64 MiB steps on one thread per
    core (ctypes drops the GIL around each call); where the kernel lacks
    ``MADV_POPULATE_WRITE`` the reads fault the pages in as usual."""
    libc = _libc()
    steps = [(at, min(_POPULATE_STEP, nbytes - at)) for at in range(0, nbytes, _POPULATE_STEP)]
    threads = min(len(steps), cores(), 32)

    def work(first: int) -> None:
        for at, size in steps[first::threads]:
            libc.madvise(ctypes.c_void_p(address + at), ctypes.c_size_t(size), _MADV_POPULATE_WRITE)

    workers = [
        threading.Thread(target=work, args=(i,), name="fastckpt-populate")
        for i in range(1, threads)
    ]
    for worker in workers:
        worker.start()
    try:
        work(0)
    finally:
        for worker in workers:
            worker.join()


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def arena_tensor(nbytes: int, *, lock: bool = False, pages: str | None = None) -> Any:
    """A page-aligned 1-D uint8 tensor of ``nbytes`` for a load to read into.

    Small arenas come from torch's allocator (the heap), over-allocated by a page and cut to
    a page boundary: a fresh mapping's pages are zeroed and faulted in one by one on first
    touch, which cost more than the read itself for a state of a few MiB (16 MiB: 7.5 ms
    against 1.8 ms into reused memory, here), while the heap hands back memory an earlier
    load freed. Large or page-locked arenas are mappings of their own (:func:`aligned_tensor`),
    returned to the system when freed; ``pages`` (None: :func:`arena_pages`) says how their
    pages come in (:data:`ARENA_PAGES`).

    Example:
        >>> t = arena_tensor(8192)
        >>> t.data_ptr() % BUFFER_ALIGNMENT, t.numel()
        (0, 8192)
        >>> arena_tensor(64 << 20, pages="huge").numel() == 64 << 20
        True
    """
    import torch

    if lock or nbytes > HEAP_ARENA_BYTES or nbytes == 0:
        pages = arena_pages() if pages is None else pages
        if pages not in ARENA_PAGES:
            raise ValueError(f"pages must be one of {', '.join(ARENA_PAGES)}, got {pages!r}")
        if pages == "huge" and not lock:
            # a reused buffer is madvised for huge pages (registration needs lock too)
            buffer = _C.AlignedBuffer(nbytes, lock=False, strict=False, reused=True)
            return torch.frombuffer(buffer, dtype=torch.uint8)
        arena = aligned_tensor(nbytes, lock=lock)
        if pages == "populate" and not lock:  # locked memory is populated by mlock
            _populate(arena.data_ptr(), nbytes)
        return arena
    raw = torch.empty(nbytes + BUFFER_ALIGNMENT, dtype=torch.uint8)
    skip = -raw.data_ptr() % BUFFER_ALIGNMENT
    return raw[skip : skip + nbytes]
