"""The executor that moves bytes between files and memory.

:class:`Executor` wraps the native executor: it submits ops, keeps their buffers and files
alive (and the files' descriptors open) until they complete, and raises their errors as
``OSError`` with errno and filename.

A native wait cannot be interrupted: Ctrl-C is raised once it returns. Code that stops
early (an error, ``KeyboardInterrupt``) must still collect every op it started before it
lets the buffers or the file go: :meth:`Executor.drain` does that through further
interrupts, and returns the interrupt for the caller to raise afterwards.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterable

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
        >>> import os, tempfile
        >>> ex = Executor(IOConfig(engine="threads"))
        >>> from fastckpt.io.files import File
        >>> path = os.path.join(tempfile.mkdtemp(), "doc.bin")
        >>> with File(path, write=True, create=True, truncate=True) as f:
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
        direct: bool = True,
    ) -> int:
        """Starts moving ``ref`` (or its first ``nbytes``) to/from ``file`` at ``offset``; returns an op id.

        ``direct=False`` goes through the page cache even where the file has an O_DIRECT
        descriptor (a read policy chose buffered reads for a cold file).
        """
        if offset < 0:
            raise ValueError(f"file_offset must not be negative, got {offset}")
        length = ref.nbytes if nbytes is None else nbytes
        self._check_process()
        file.hold()  # its descriptors stay open until the op is collected, even if closed
        try:
            op_id = self._native.submit(
                file.direct_fd if direct else -1,
                file.fd,
                ref.address,
                length,
                offset,
                write,
                file.path,
                file.alignment,
                max_parts,
            )
        except BaseException:
            file.unhold()
            raise
        with self._lock:
            self._keepalive[op_id] = (file, ref, keep)
        return op_id

    def wait(self, op_id: int) -> None:
        """Blocks (without the GIL) until op ``op_id`` is done; raises its ``OSError``.

        Raises:
            ValueError: ``op_id`` is not pending (never submitted, or already waited for).
        """
        try:
            self._native.wait(op_id)
        finally:
            # An interrupt raised before the native wait began leaves the op running: its
            # memory and file must stay alive until a later wait (or drain) collects it.
            if not self._native.is_pending(op_id):
                self._forget(op_id)

    def is_pending(self, op_id: int) -> bool:
        """Whether ``op_id`` was submitted and not yet collected by a wait."""
        return self._native.is_pending(op_id)

    def cancel(self, op_id: int) -> bool:
        """Drops the parts of ``op_id`` no worker has started; the op still has to be waited
        for (it then fails with ``ECANCELED``). Returns whether anything was dropped."""
        return self._native.cancel(op_id)

    def drain(self, op_ids: Iterable[int], *, cancel: bool = False) -> BaseException | None:
        """Collects every op of ``op_ids`` still pending, whatever happens meanwhile: the ops'
        own errors are dropped (the caller is already handling an error), and an interrupt
        (``KeyboardInterrupt``, ``SystemExit``) raised while waiting does not stop the
        draining. With ``cancel``, the parts not yet started are dropped first, so only
        those running are waited for. Returns the first interrupt, for the caller to raise
        once it has released what the ops used; None if there was none.

        Example:
            >>> from fastckpt.config import IOConfig
            >>> Executor(IOConfig(engine="threads")).drain([]) is None
            True
        """
        interrupt: BaseException | None = None
        op_ids = list(op_ids)
        if cancel:
            for op_id in reversed(op_ids):  # the last queued first: workers take the oldest
                try:
                    self._native.cancel(op_id)
                except BaseException as exc:  # noqa: BLE001 - an interrupt: keep draining
                    if interrupt is None:
                        interrupt = exc
        for op_id in op_ids:
            while True:
                try:
                    if self._native.is_pending(op_id):
                        self.wait(op_id)
                    break
                except (OSError, ValueError):
                    break  # its failure, or collected meanwhile: either way over
                except BaseException as exc:  # noqa: BLE001 - kept, raised by the caller
                    if interrupt is None:
                        interrupt = exc
        return interrupt

    def _forget(self, op_id: int) -> None:
        with self._lock:
            kept = self._keepalive.pop(op_id, None)
        if kept is not None:
            kept[0].unhold()

    def wait_all(self) -> int:
        """Blocks until every op is done; returns how many; raises the first failure."""
        try:
            return self._native.wait_all()
        finally:
            if self._native.pending() == 0:  # not when interrupted before the native wait
                with self._lock:
                    kept, self._keepalive = self._keepalive, {}
                for file, _, _ in kept.values():
                    file.unhold()

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
