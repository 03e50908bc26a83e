"""The ops of an ``aio_handle``, apart from the handle's public methods: an op's arguments
checked and read in DeepSpeed's spellings (``filename`` or ``fd=``, ``async``,
``example_tenosr``), the file it works on opened (created private, as DeepSpeed does), its
transfer started and its record kept while in flight (:class:`_PendingOp`, the handle's
queue in :class:`_HandleOps`), and the read-back that ``validate=True`` asks for.

Example:
    >>> _offset_arg(100), _target("/tmp/x.bin", None, "read")
    (100, '/tmp/x.bin')
"""

from __future__ import annotations

import ctypes
import functools
import operator
import os
import threading
from typing import Any, Callable, Union

from fastckpt import _C
from fastckpt.config import IOConfig
from fastckpt.deepnvme.descriptors import HeldDescriptor, as_descriptor
from fastckpt.errors import ChecksumError
from fastckpt.io import device_copy
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, BufferRef, buffer_ref
from fastckpt.io.executor import Executor
from fastckpt.io.files import File

__all__ = ["FileTarget"]

# An argument left out (DeepSpeed's defaults, or the tuned configuration, apply).
_UNSET: Any = object()

# Files the handles create are private to their owner, as DeepSpeed's are: swapped tensors
# (optimizer state, activations) are nobody else's to read.
_CREATE_MODE = 0o600

# Where DeepSpeed takes a file name, a path or an open file descriptor.
FileTarget = Union[str, "os.PathLike[str]", int]


def _target(filename: Any, fd: Any, method: str) -> Any:
    """The file an op works on: ``filename`` (a path or a descriptor) or the ``fd=`` keyword."""
    if fd is None:
        if filename is None:
            raise TypeError(f"{method}() missing required argument 'filename' (or 'fd')")
        return filename
    if filename is not None:
        raise TypeError(f"{method}() got both 'filename' and 'fd'; pass one")
    if as_descriptor(fd) is None:
        raise TypeError(f"{method}(): fd must be an int, got {type(fd).__name__}")
    return fd


def _offset_arg(file_offset: Any) -> int:
    """``file_offset`` as an int (numpy integers too), refusing bools, floats and negatives."""
    if isinstance(file_offset, bool) or not hasattr(type(file_offset), "__index__"):
        raise TypeError(f"file_offset must be an int, got {type(file_offset).__name__}")
    file_offset = operator.index(file_offset)
    if file_offset < 0:
        raise ValueError(f"file_offset must not be negative, got {file_offset}")
    return file_offset


def _aliased_arg(
    value: Any, kwargs: dict[str, Any], method: str, name: str, alias: str, *, hint: bool
) -> Any:
    """``value``, or the same argument passed under DeepSpeed's spelling ``alias`` (found in
    ``kwargs``, which must hold nothing else); refuses both, neither, and unknown keywords
    (``hint``: a missing argument's message names ``alias`` too)."""
    if alias in kwargs:
        if value is not _UNSET:
            raise TypeError(f"{method}() got both {name!r} and {alias!r}")
        value = kwargs.pop(alias)
    if kwargs:
        raise TypeError(f"{method}() got unexpected keyword arguments {sorted(kwargs)}")
    if value is _UNSET:
        spelled = f" (DeepSpeed's {alias!r})" if hint else ""
        raise TypeError(f"{method}() missing required argument {name!r}{spelled}")
    return value


def _example_arg(example_tensor: Any, kwargs: dict[str, Any], method: str) -> Any:
    """DeepSpeed's binding names this argument ``example_tenosr``; accept both spellings."""
    return _aliased_arg(
        example_tensor, kwargs, method, "example_tensor", "example_tenosr", hint=False
    )


def _pop_async(async_op: Any, kwargs: dict[str, Any], method: str) -> bool:
    """DeepSpeed names the flag ``async`` (a keyword in Python); accept both spellings."""
    return bool(_aliased_arg(async_op, kwargs, method, "async_op", "async", hint=True))


class _PendingOp:
    """One submitted op: ``wait_fn`` blocks until it is done and raises its error."""

    __slots__ = ("wait_fn", "file", "ref", "offset", "write", "validate")

    def __init__(
        self,
        wait_fn: Callable[[], None],
        file: File,
        ref: BufferRef,
        offset: int,
        write: bool,
        validate: bool,
    ):
        self.wait_fn, self.file, self.ref = wait_fn, file, ref
        self.offset, self.write, self.validate = offset, write, validate


def _create_private(path: Any) -> File:
    """``path`` opened for writing, created with mode 0600 when missing (as DeepSpeed does);
    an existing file keeps its mode and contents."""
    # fastckpt's File creates with 0644; creating the file here first keeps it private. The
    # flags are File's own (O_RDWR, no O_TRUNC), so this open fails or blocks only where it would.
    created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _CREATE_MODE)
    try:
        return File(path, write=True, create=True)
    finally:
        os.close(created)


def _validate(op: _PendingOp) -> None:
    """Reads the range back through the page cache and compares it with the buffer."""
    import numpy as np

    if op.ref.is_cuda:
        import torch

        expected = op.ref.owner.detach().reshape(-1).view(torch.uint8).cpu().numpy()
    elif op.ref.nbytes:
        raw = (ctypes.c_uint8 * op.ref.nbytes).from_address(op.ref.address)
        expected = np.ctypeslib.as_array(raw)
    else:
        expected = np.empty(0, np.uint8)
    if isinstance(op.file, HeldDescriptor):  # the caller's descriptor may be write-only
        written = op.file.read_back(op.ref.nbytes, op.offset)
    else:
        written = os.pread(op.file.fd, op.ref.nbytes, op.offset)
    actual = np.frombuffer(written, dtype=np.uint8)
    if actual.size != expected.size or not np.array_equal(actual, expected):
        mismatch = np.flatnonzero(actual != expected[: actual.size])
        where = int(mismatch[0]) if mismatch.size else actual.size
        raise ChecksumError(
            f"validation of the {'write' if op.write else 'read'} of {op.ref.nbytes} bytes at offset "
            f"{op.offset} in {op.file.path!r} failed: first difference at byte {where}",
            filename=op.file.path,
        )


class _HandleOps:
    """The op machinery under :class:`~fastckpt.deepnvme.aio_handle.aio_handle`'s public
    methods: an op's buffer checked, its file opened and its transfer started, run to the
    end, or queued for ``wait``, and finished (validated when asked, its file closed).
    ``gds_handle`` replaces :meth:`_buffer` and :meth:`_submit`; ``aio_handle.__init__`` sets
    the attributes declared here."""

    _config: IOConfig
    _executor: Executor
    _lock: threading.Lock
    _pending: list[_PendingOp]

    def _buffer(self, buffer: Any, *, write: bool) -> BufferRef:
        """The I/O buffer's memory (CPU or CUDA), checked for the transfer's direction."""
        return buffer_ref(buffer, writable=not write, argname="buffer", allow_cuda=True)

    def _submit(
        self, file: File, ref: BufferRef, file_offset: int, *, write: bool, parallel: bool
    ) -> Callable[[], None]:
        """Starts the transfer; returns the function that waits for it (raising its error)."""
        max_parts = 0 if parallel else 1
        if ref.is_cuda:
            # Device memory is staged through page-locked host buffers.
            return device_copy.submit_device_io(
                self._executor, file, ref, file_offset, write=write, max_parts=max_parts
            )
        op_id = self._executor.submit(file, ref, file_offset, write=write, max_parts=max_parts)
        return functools.partial(self._executor.wait, op_id)

    def _start(
        self,
        buffer: Any,
        target: FileTarget,
        *,
        write: bool,
        file_offset: int,
        validate: bool,
        parallel: bool,
    ) -> _PendingOp:
        file_offset = _offset_arg(file_offset)
        ref = self._buffer(buffer, write=write)
        fd = as_descriptor(target)
        if fd is not None:
            file: File = HeldDescriptor(fd, write=write)
        elif write:
            file = _create_private(target)
        else:
            assert not isinstance(target, int)  # as_descriptor takes every int
            file = File(target)
        try:
            aligned_end = (file_offset + ref.nbytes) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT
            # (a range past the largest file offset is left for the engine to refuse)
            if write and ref.nbytes and file.size() < aligned_end < 2**63:
                # Like fio's layout step: allocate the blocks first, so parallel out-of-order
                # direct writes extend no file and leave one contiguous extent, and a full
                # disk fails here, before any byte is written. Only whole blocks: ext4 can
                # lose a buffered write of a partial tail block into a preallocated
                # (unwritten) extent that direct writes of the same file are converting.
                _C.preallocate(file.fd, aligned_end, file.path)
            if not write and ref.nbytes:
                size = file.size()
                if file_offset + ref.nbytes > size:
                    raise ValueError(
                        f"read of {ref.nbytes} bytes at file_offset {file_offset} goes past the end "
                        f"of {file.path!r} ({size} bytes)"
                    )
            wait_fn = self._submit(file, ref, file_offset, write=write, parallel=parallel)
        except BaseException:
            file.close()
            raise
        return _PendingOp(wait_fn, file, ref, file_offset, write, validate)

    def _finish(self, op: _PendingOp) -> None:
        try:
            op.wait_fn()
            if op.validate:
                _validate(op)
        finally:
            op.file.close()

    def _run(self, *args: Any, **kwargs: Any) -> int:
        """A blocking, non-parallel op outside the queue; returns 0 as DeepSpeed's does."""
        self._finish(self._start(*args, **kwargs))
        return 0

    def _queue(self, *args: Any, **kwargs: Any) -> int:
        op = self._start(*args, **kwargs)
        with self._lock:
            self._pending.append(op)
        return 0
