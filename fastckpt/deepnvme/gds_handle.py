"""``gds_handle``: DeepNVMe's handle for CUDA tensors, over the cuFile runtime.

The handle keeps :class:`~fastckpt.deepnvme.aio_handle.aio_handle`'s constructor and I/O
methods and adds DeepSpeed's pinned-device-tensor functions; the bytes move through
:mod:`fastckpt.io.cufile` (GPUDirect Storage, or cuFile's compatibility mode).

Example (needs a CUDA GPU and cuFile)::

    from fastckpt.aio import gds_handle
    h = gds_handle(intra_op_parallelism=4)
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Callable

from fastckpt.deepnvme.aio_handle import aio_handle
from fastckpt.deepnvme.handle_ops import _UNSET, _example_arg
from fastckpt.io import cufile
from fastckpt.io.aligned_memory import BufferRef
from fastckpt.io.files import File
from fastckpt.io.interrupts import result_when_done

__all__ = ["gds_handle"]


class gds_handle(aio_handle):
    """DeepNVMe's handle for CUDA tensors over cuFile (GPUDirect Storage).

    Same constructor and I/O methods as :class:`fastckpt.aio.aio_handle` (``read``,
    ``write``, ``pread``, ``pwrite``, ``sync_pread``, ``sync_pwrite``, ``async_pread``,
    ``async_pwrite``, ``wait`` and the getters); buffers must be contiguous CUDA tensors.
    ``intra_op_parallelism`` splits each ``pread``/``pwrite`` over that many threads; up to
    four asynchronous operations run at once. ``block_size``, ``queue_depth``,
    ``single_submit`` and ``overlap_events`` are kept for the getters (cuFile sizes its own
    requests).

    Raises:
        EngineUnavailableError: GPUDirect Storage cannot run here (no CUDA GPU, no
            libcufile, or the cuFile driver does not open); the message says which.

    Example (needs a CUDA GPU and cuFile)::

        h = gds_handle(intra_op_parallelism=4)
        t = h.new_pinned_device_tensor(1 << 20, torch.empty(0, dtype=torch.float32, device="cuda"))
        h.sync_pwrite(t, "/local_nvme/t.bin")
        h.async_pread(t, "/local_nvme/t.bin"); h.wait()
        h.free_pinned_device_tensor(t)
    """

    def __init__(
        self,
        block_size: int = _UNSET,
        queue_depth: int = _UNSET,
        single_submit: bool = _UNSET,
        overlap_events: bool = _UNSET,
        intra_op_parallelism: int = _UNSET,
    ):
        cufile.require()
        # The host-memory methods inherited from aio_handle (new_cpu_locked_tensor, ...) use
        # the thread engine, which runs everywhere.
        super().__init__(
            block_size,
            queue_depth,
            single_submit,
            overlap_events,
            intra_op_parallelism,
            engine="threads",
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="fastckpt-gds"
        )
        self._device_tensors: dict[int, Any] = {}

    def get_engine(self) -> str:
        """Always ``"gds"``; :func:`mode` tells GPUDirect from compatibility mode."""
        return "gds"

    def _buffer(self, buffer: Any, *, write: bool) -> BufferRef:
        return cufile.device_ref(buffer, writable=not write, argname="buffer")

    def _submit(
        self, file: File, ref: BufferRef, file_offset: int, *, write: bool, parallel: bool
    ) -> Callable[[], None]:
        ready = _record_ready(ref)
        threads = self._config.intra_op_parallelism if parallel else 1
        future = self._pool.submit(
            cufile.transfer_range, file, ref, file_offset, write=write, threads=threads, ready=ready
        )
        # Ctrl-C during the wait is raised once the transfer is over: never while it still
        # uses the file and the buffer.
        return functools.partial(result_when_done, future)

    # -- pinned device memory (DeepSpeed's GDS-specific API) ---------------------------------
    def new_pinned_device_tensor(
        self, num_elem: int, example_tensor: Any = _UNSET, **kwargs: Any
    ) -> Any:
        """A 1-D CUDA tensor of ``num_elem`` elements of ``example_tensor``'s dtype (on its
        device when it is a CUDA tensor, else the current one), registered with cuFile.
        Release it with :meth:`free_pinned_device_tensor`. DeepSpeed's keyword spelling
        ``example_tenosr=`` works too."""
        import torch

        example_tensor = _example_arg(example_tensor, kwargs, "new_pinned_device_tensor")

        if isinstance(num_elem, bool) or not isinstance(num_elem, int) or num_elem < 0:
            raise ValueError(f"num_elem must be a non-negative int, got {num_elem!r}")
        device = (
            example_tensor.device
            if example_tensor.is_cuda
            else torch.device("cuda", torch.cuda.current_device())
        )
        tensor = torch.empty(num_elem, dtype=example_tensor.dtype, device=device)
        cufile.pin(tensor, "example_tensor")
        self._device_tensors[tensor.data_ptr()] = tensor
        return tensor

    def free_pinned_device_tensor(self, tensor: Any) -> bool:
        """Deregisters a tensor from :meth:`new_pinned_device_tensor` and drops this handle's
        reference to it; False for any other tensor."""
        if self._device_tensors.pop(tensor.data_ptr(), None) is None:
            return False
        cufile.unpin(tensor)
        return True

    def pin_device_tensor(self, tensor: Any) -> bool:
        """Registers a contiguous CUDA tensor with cuFile (DMA without bounce buffers); True
        on success, a :class:`CuFileError` otherwise. The tensor is kept alive until
        :meth:`unpin_device_tensor`."""
        return cufile.pin(tensor, "tensor")

    def unpin_device_tensor(self, tensor: Any) -> bool:
        """Deregisters a tensor pinned with :meth:`pin_device_tensor`; False if it was not."""
        return cufile.unpin(tensor)

    def __del__(self) -> None:
        super().__del__()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


def _record_ready(ref: BufferRef) -> Any:
    """An event on the tensor's current stream: the transfer waits for the work queued so far."""
    if ref.nbytes == 0:
        return None
    import torch

    device = ref.owner.device
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
