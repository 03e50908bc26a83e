"""``aio_handle`` and the DeepNVMe functions (``aio_read``, ``aio_write``, ``deepspeed_memcpy``).

Names, argument orders and defaults follow DeepSpeed's ``async_io`` op, so code written
for it ports by changing one import::

    # from deepspeed.ops.op_builder import AsyncIOBuilder
    # h = AsyncIOBuilder().load().aio_handle()
    from fastckpt.aio import aio_handle
    h = aio_handle()

What differs, on purpose: every completion is checked and failures raise ``OSError``
(errno and file name included) instead of returning -1 or printing; misuse raises
``TypeError``/``ValueError`` naming the argument; any length and offset work (unaligned
parts go through the page cache or aligned bounce buffers); buffers may be torch tensors
(pinned or not), numpy arrays or writable buffer objects. Every method takes DeepSpeed's
arguments by position or by name and returns what DeepSpeed's returns; where it takes a file
name, an open file descriptor works too (DeepSpeed's ``async_pwrite(buffer, fd, offset)``).

This module holds the public class, its settings and DeepSpeed's methods, and the module-level
functions; how an op is checked, started, queued, finished and validated is
:mod:`fastckpt.deepnvme.handle_ops`'.

Example:
    >>> import torch
    >>> from fastckpt.aio import aio_handle
    >>> h = aio_handle()
    >>> t = torch.arange(1000, dtype=torch.float32)
    >>> h.sync_pwrite(t, "/tmp/fastckpt-aio-doc.bin")
    1
    >>> u = torch.empty_like(t)
    >>> h.async_pread(u, "/tmp/fastckpt-aio-doc.bin")
    0
    >>> h.wait()
    1
    >>> bool(torch.equal(t, u))
    True
"""

from __future__ import annotations

import os
import threading
from typing import Any

from fastckpt import _C
from fastckpt.config import IOConfig, resolve_io
from fastckpt.deepnvme import locked_memory
from fastckpt.deepnvme.handle_ops import (
    _UNSET,
    FileTarget,
    _example_arg,
    _HandleOps,
    _PendingOp,
    _pop_async,
    _target,
)
from fastckpt.io import parallel_io
from fastckpt.io.aligned_memory import buffer_ref
from fastckpt.io.executor import Executor

__all__ = [
    "aio_handle",
    "aio_read",
    "aio_write",
    "deepspeed_memcpy",
    "memcpy",
]

# DeepSpeed's constructor defaults.
_DEEPSPEED_DEFAULTS = IOConfig(
    block_size=1048576,
    queue_depth=128,
    single_submit=False,
    overlap_events=False,
    intra_op_parallelism=1,
    engine="auto",
)

# DeepSpeed's O_DIRECT granularity: get_alignment() is this times intra_op_parallelism.
_DEEPSPEED_SECTOR = 512


class aio_handle(_HandleOps):  # noqa: N801 - DeepSpeed's name
    """Reads and writes tensors to files, blocking or not, over a native I/O engine.

    Args:
        block_size: bytes per I/O request.
        queue_depth: requests in flight per worker.
        single_submit: submit requests one by one instead of in batches.
        overlap_events: reap completions and submit new requests as they finish (a sliding
            window); when False, each batch of ``queue_depth`` requests completes before the
            next is submitted.
        intra_op_parallelism: worker threads each op is split across.
        engine: ``"auto"``, ``"io_uring"``, ``"libaio"`` or ``"threads"``.

    Arguments left out come from the configuration ``fastckpt tune`` saved (for the file
    system of the current directory, else the newest one), else DeepSpeed's defaults.

    Example:
        >>> import numpy as np
        >>> h = aio_handle(block_size=65536, queue_depth=8, intra_op_parallelism=2)
        >>> h.get_queue_depth(), h.get_intra_op_parallelism()
        (8, 2)
        >>> a = np.arange(10, dtype=np.int64)
        >>> h.sync_pwrite(a, "/tmp/fastckpt-aio-doc2.bin")
        1
    """

    def __init__(
        self,
        block_size: int = _UNSET,
        queue_depth: int = _UNSET,
        single_submit: bool = _UNSET,
        overlap_events: bool = _UNSET,
        intra_op_parallelism: int = _UNSET,
        *,
        engine: str = _UNSET,
    ):
        explicit = {
            k: v
            for k, v in dict(
                block_size=block_size,
                queue_depth=queue_depth,
                single_submit=single_submit,
                overlap_events=overlap_events,
                intra_op_parallelism=intra_op_parallelism,
                engine=engine,
            ).items()
            if v is not _UNSET
        }
        self._config = resolve_io(
            os.getcwd(), explicit, builtin=_DEEPSPEED_DEFAULTS, any_filesystem=True
        )
        self._executor = Executor(self._config)
        self._lock = threading.Lock()
        self._pending: list[_PendingOp] = []

    # -- settings -------------------------------------------------------------------------
    def get_block_size(self) -> int:
        return self._config.block_size

    def get_queue_depth(self) -> int:
        return self._config.queue_depth

    def get_single_submit(self) -> bool:
        return self._config.single_submit

    def get_overlap_events(self) -> bool:
        return self._config.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._config.intra_op_parallelism

    def get_alignment(self) -> int:
        """DeepSpeed's value: 512 bytes (a sector) times ``intra_op_parallelism``.

        DeepSpeed's helpers (its ``FastFileWriter`` and I/O buffers) size buffers and place
        file offsets in multiples of it, so that each of the op's threads gets whole sectors.
        fastckpt needs no alignment at all: what is aligned to the file's logical block
        (often 4096 bytes) goes through O_DIRECT, unaligned heads and tails through the page
        cache.

        Example:
            >>> aio_handle(intra_op_parallelism=4).get_alignment()
            2048
        """
        return _DEEPSPEED_SECTOR * self._config.intra_op_parallelism

    def get_engine(self) -> str:
        """The engine this handle runs on (``"auto"`` resolved)."""
        return self._executor.engine

    # -- core (starting, queueing and finishing an op: handle_ops._HandleOps) ----------------
    def _queue_and_wait(self, *args: Any, **kwargs: Any) -> int:
        """A blocking parallel op: queued, then every queued op completed, as DeepSpeed does;
        returns how many completed (1 plus the asynchronous ops still queued before it)."""
        self._queue(*args, **kwargs)
        return self.wait()

    # -- DeepSpeed's I/O methods ------------------------------------------------------------
    # Each takes DeepSpeed's arguments positionally or by name. Where DeepSpeed takes a file
    # name, a file descriptor (an int, positionally or as ``fd=``) works too: it is used as
    # the caller opened it (O_DIRECT only if opened so) and never closed. Return values are
    # DeepSpeed's: ``read``/``write`` 0, the asynchronous calls 0 (``wait`` then returns the
    # count), the blocking parallel calls the number of ops completed.
    def read(
        self,
        buffer: Any,
        filename: FileTarget | None = None,
        validate: bool = False,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Blocking, single-threaded read of ``buffer.nbytes`` bytes at ``file_offset``; returns 0."""
        return self._run(
            buffer,
            _target(filename, fd, "read"),
            write=False,
            file_offset=file_offset,
            validate=bool(validate),
            parallel=False,
        )

    def write(
        self,
        buffer: Any,
        filename: FileTarget | None = None,
        validate: bool = False,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Blocking, single-threaded write of ``buffer`` at ``file_offset`` (the file is not
        truncated); returns 0."""
        return self._run(
            buffer,
            _target(filename, fd, "write"),
            write=True,
            file_offset=file_offset,
            validate=bool(validate),
            parallel=False,
        )

    def pread(
        self,
        buffer: Any,
        filename: FileTarget | None = None,
        validate: bool = False,
        async_op: bool = _UNSET,
        file_offset: int = 0,
        *,
        fd: int | None = None,
        **kwargs: Any,
    ) -> int:
        """Parallel read; with ``async_op`` (DeepSpeed: ``async``) returns 0 at once, else the
        number of ops completed (see :meth:`sync_pread`)."""
        return self._parallel(
            "pread", buffer, filename, fd, validate, async_op, file_offset, kwargs
        )

    def pwrite(
        self,
        buffer: Any,
        filename: FileTarget | None = None,
        validate: bool = False,
        async_op: bool = _UNSET,
        file_offset: int = 0,
        *,
        fd: int | None = None,
        **kwargs: Any,
    ) -> int:
        """Parallel write; with ``async_op`` (DeepSpeed: ``async``) returns 0 at once, else the
        number of ops completed (see :meth:`sync_pwrite`)."""
        return self._parallel(
            "pwrite", buffer, filename, fd, validate, async_op, file_offset, kwargs
        )

    def _parallel(
        self,
        name: str,
        buffer: Any,
        filename: FileTarget | None,
        fd: int | None,
        validate: bool,
        async_op: bool,
        file_offset: int,
        kwargs: dict[str, Any],
    ) -> int:
        """``pread``/``pwrite`` (``name``): queued, or queued and waited for."""
        start = self._queue if _pop_async(async_op, kwargs, name) else self._queue_and_wait
        return start(
            buffer,
            _target(filename, fd, name),
            write=name == "pwrite",
            file_offset=file_offset,
            validate=bool(validate),
            parallel=True,
        )

    def sync_pread(
        self,
        buffer: Any,
        filename: FileTarget | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Blocking parallel read. Like DeepSpeed's, it also completes the asynchronous ops
        queued before it and returns how many ops completed: 1 when none were queued."""
        return self._queue_and_wait(
            buffer,
            _target(filename, fd, "sync_pread"),
            write=False,
            file_offset=file_offset,
            validate=False,
            parallel=True,
        )

    def sync_pwrite(
        self,
        buffer: Any,
        filename: FileTarget | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Blocking parallel write. Like DeepSpeed's, it also completes the asynchronous ops
        queued before it and returns how many ops completed: 1 when none were queued."""
        return self._queue_and_wait(
            buffer,
            _target(filename, fd, "sync_pwrite"),
            write=True,
            file_offset=file_offset,
            validate=False,
            parallel=True,
        )

    def async_pread(
        self,
        buffer: Any,
        filename: FileTarget | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Starts a parallel read and returns 0; :meth:`wait` completes it."""
        return self._queue(
            buffer,
            _target(filename, fd, "async_pread"),
            write=False,
            file_offset=file_offset,
            validate=False,
            parallel=True,
        )

    def async_pwrite(
        self,
        buffer: Any,
        filename: FileTarget | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Starts a parallel write and returns 0; :meth:`wait` completes it.

        ``async_pwrite(buffer, fd, file_offset)`` is DeepSpeed's descriptor form (its
        FastFileWriter's): the descriptor stays the caller's and may even be closed before
        :meth:`wait`, as the op holds a duplicate of it. The buffer must not change until
        :meth:`wait` returns (the write reads it in place).
        """
        return self._queue(
            buffer,
            _target(filename, fd, "async_pwrite"),
            write=True,
            file_offset=file_offset,
            validate=False,
            parallel=True,
        )

    def wait(self) -> int:
        """Blocks (GIL released) until every queued op is done; returns how many completed.

        If any failed, raises the first failure (in submission order) after all have finished,
        so no op still uses its buffer when this returns or raises.
        """
        with self._lock:
            ops, self._pending = self._pending, []
        first_error: BaseException | None = None
        for op in ops:
            try:
                self._finish(op)
            except BaseException as exc:  # noqa: BLE001 - re-raised below after all finish
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return len(ops)

    # -- locked memory ----------------------------------------------------------------------
    def new_cpu_locked_tensor(
        self, num_elem: int, example_tensor: Any = _UNSET, **kwargs: Any
    ) -> Any:
        """A 1-D tensor of ``num_elem`` elements of ``example_tensor``'s dtype in page-aligned,
        mlock()ed memory (raises ``OSError`` when the locked-memory limit forbids it).
        DeepSpeed's keyword spelling ``example_tenosr=`` works too."""
        example_tensor = _example_arg(example_tensor, kwargs, "new_cpu_locked_tensor")
        if isinstance(num_elem, bool) or not isinstance(num_elem, int) or num_elem < 0:
            raise ValueError(f"num_elem must be a non-negative int, got {num_elem!r}")
        return locked_memory.allocate(num_elem, example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Releases a tensor from :meth:`new_cpu_locked_tensor` of any handle (as DeepSpeed's
        handles share one manager); returns False for any other tensor.

        The memory is unlocked and returned to the system once no tensor views it any more
        (freeing it under a live view would leave that view dangling).

        Example:
            >>> import torch
            >>> t = aio_handle().new_cpu_locked_tensor(8, torch.empty(0))
            >>> aio_handle().free_cpu_locked_tensor(t), aio_handle().free_cpu_locked_tensor(t)
            (True, False)
        """
        return locked_memory.release(tensor)

    def is_pinned(self, buffer: Any = _UNSET, *, tensor: Any = _UNSET) -> bool:
        """Whether the buffer's memory is page-locked (CUDA-pinned or from this library).

        As DeepSpeed checks, the whole byte range must lie within one locked allocation: a
        view that starts in a tensor from :meth:`new_cpu_locked_tensor` but runs past its end
        is not pinned. ``buffer`` is DeepSpeed's argument name; ``tensor=`` is kept for older
        fastckpt code.

        Example:
            >>> import torch
            >>> h = aio_handle()
            >>> t = h.new_cpu_locked_tensor(1024, torch.empty(0))
            >>> h.is_pinned(t), h.is_pinned(t[512:]), h.is_pinned(torch.empty(4))
            (True, True, False)
        """
        if (buffer is _UNSET) == (tensor is _UNSET):
            raise TypeError("is_pinned() takes one tensor: 'buffer' (or 'tensor')")
        tensor = tensor if buffer is _UNSET else buffer
        if tensor.numel() == 0:
            return False
        try:
            if tensor.is_pinned():
                return True
        except RuntimeError:  # CPU-only builds of torch may refuse the question
            pass
        if tensor.device.type != "cpu":
            return False
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        extent = locked_memory.extent_of(start)
        if extent is not None:
            return end <= extent[0] + extent[1]
        # Memory fastckpt locked elsewhere (staging pools, pinned loads): both ends locked.
        return _C.is_locked(start) and _C.is_locked(end - 1)

    def __del__(self) -> None:
        # Never leave kernel I/O pointing at memory Python may free.
        try:
            if self._pending:
                self.wait()
        except Exception:  # noqa: BLE001 - nothing to report to from a finalizer
            pass


def _one_shot(
    buffer: Any,
    filename: str,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
    *,
    write: bool,
) -> int:
    handle = aio_handle(block_size, queue_depth, single_submit, overlap_events, 1)
    (handle.write if write else handle.read)(buffer, filename, validate)
    return 0


def aio_read(
    buffer: Any,
    filename: str,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """Reads ``filename`` into ``buffer`` with a one-off handle; returns 0 (errors raise).

    Example:
        >>> import numpy as np
        >>> a = np.zeros(10, dtype=np.int64)
        >>> aio_write(np.arange(10), "/tmp/fastckpt-aio-doc3.bin", 1 << 20, 32, False, True, False)
        0
        >>> aio_read(a, "/tmp/fastckpt-aio-doc3.bin", 1 << 20, 32, False, True, True)
        0
        >>> int(a[-1])
        9
    """
    return _one_shot(
        buffer,
        filename,
        block_size,
        queue_depth,
        single_submit,
        overlap_events,
        validate,
        write=False,
    )


def aio_write(
    buffer: Any,
    filename: str,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """Writes ``buffer`` to ``filename`` with a one-off handle; returns 0 (errors raise)."""
    return _one_shot(
        buffer,
        filename,
        block_size,
        queue_depth,
        single_submit,
        overlap_events,
        validate,
        write=True,
    )


def deepspeed_memcpy(dest: Any, src: Any) -> int:
    """Copies ``src`` into ``dest`` (same byte size, both contiguous) on several threads; returns 0.

    Example:
        >>> import torch
        >>> a, b = torch.arange(6.0), torch.zeros(6)
        >>> deepspeed_memcpy(b, a)
        0
        >>> b.tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """
    dst_ref = buffer_ref(dest, writable=True, argname="dest")
    src_ref = buffer_ref(src, writable=False, argname="src")
    if dst_ref.nbytes != src_ref.nbytes:
        raise ValueError(
            f"dest has {dst_ref.nbytes} bytes but src has {src_ref.nbytes}; sizes must match"
        )
    _C.memcpy(dst_ref.address, src_ref.address, src_ref.nbytes, parallel_io.worker_count())
    return 0


memcpy = deepspeed_memcpy
