"""The executor that moves bytes between files and memory.

:class:`Executor` wraps the native executor: it submits ops, keeps their buffers and files
alive until they complete, and raises their errors as ``OSError`` with errno and filename.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from fastckpt import _C
from fastckpt.config import IOConfig
from fastckpt.io.aligned_memory import BufferRef
from fastckpt.io.engines import resolve_engine
from fastckpt.io.files import File

__all__ = ["Executor", "shared_executor"]


class Executor:
    """Submits reads and writes to a native executor built from an :class:`IOConfig`.

    Example:
        >>> from fastckpt.config import IOConfig
        >>> from fastckpt.io.aligned_memory import buffer_ref
        >>> ex = Executor(IOConfig(engine="threads"))
        >>> from fastckpt.io.files import File
        >>> with File("/tmp/fastckpt-doc.bin", write=True, create=True, truncate=True) as f:
        ...     ex.wait(ex.submit(f, buffer_ref(b"hello", writable=False), 0, write=True))
        ...     f.size()
        5
    """

    def __init__(self, config: IOConfig):
        self.config = config
        self.engine = resolve_engine(config.engine)
        self._start()

    def _start(self) -> None:
        self._native = _C.Executor(
            self.engine,
            self.config.block_size,
            self.config.queue_depth,
            self.config.single_submit,
            self.config.overlap_events,
            self.config.intra_op_parallelism,
        )
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._keepalive: dict[int, tuple[Any, ...]] = {}

    def _check_process(self) -> None:
        """After fork() the worker threads are gone (only the forking thread survives):
        a child process (a DataLoader worker, say) gets fresh ones."""
        if self._pid != os.getpid():
            _orphaned.append(self._native)  # destroying it would join threads that do not exist
            self._start()

    def submit(
        self,
        file: File,
        ref: BufferRef,
        offset: int,
        *,
        write: bool,
        max_parts: int = 0,
        nbytes: int | None = None,
        keep: Any = None,
    ) -> int:
        """Starts moving ``ref`` (or its first ``nbytes``) to/from ``file`` at ``offset``; returns an op id."""
        if offset < 0:
            raise ValueError(f"file_offset must not be negative, got {offset}")
        length = ref.nbytes if nbytes is None else nbytes
        self._check_process()
        op_id = self._native.submit(
            file.direct_fd,
            file.fd,
            ref.address,
            length,
            offset,
            write,
            file.path,
            file.alignment,
            max_parts,
        )
        with self._lock:
            self._keepalive[op_id] = (file, ref, keep)
        return op_id

    def wait(self, op_id: int) -> None:
        """Blocks (without the GIL) until op ``op_id`` is done; raises its ``OSError``."""
        try:
            self._native.wait(op_id)
        finally:
            with self._lock:
                self._keepalive.pop(op_id, None)

    def wait_all(self) -> int:
        """Blocks until every op is done; returns how many; raises the first failure."""
        try:
            return self._native.wait_all()
        finally:
            with self._lock:
                self._keepalive.clear()

    def pending(self) -> int:
        return self._native.pending()


_shared: dict[IOConfig, Executor] = {}
_shared_lock = threading.Lock()
_orphaned: list[Any] = []  # native executors inherited through fork(), never destroyed


def _after_fork_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # another thread may have held it at fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def shared_executor(config: IOConfig) -> Executor:
    """A process-wide executor per configuration, so repeated saves and loads reuse workers.

    Callers must wait for their own ops with :meth:`Executor.wait` (never ``wait_all``,
    which would also wait for other callers' ops).
    """
    with _shared_lock:
        executor = _shared.get(config)
        if executor is None:
            executor = _shared[config] = Executor(config)
        return executor
