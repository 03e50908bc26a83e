"""Files opened for direct I/O, and the executor that moves bytes between them and memory.

A :class:`File` holds two descriptors of one file: an ``O_DIRECT`` one (when the file
system takes it) for aligned blocks, and a buffered one for unaligned heads and tails. The
:class:`Executor` wraps the native executor: it submits ops, keeps their buffers and files
alive until they complete, and raises their errors as ``OSError`` with errno and filename.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

from fastckpt import _C
from fastckpt._buffers import BufferRef
from fastckpt._engines import resolve_engine
from fastckpt.config import IOConfig

__all__ = ["File", "Executor", "DEFAULT_ALIGNMENT", "shared_executor"]

DEFAULT_ALIGNMENT = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class File:
    """An open file with a buffered descriptor ``fd`` and, where allowed, an O_DIRECT ``direct_fd``.

    Args:
        path: the file.
        write: open for writing (reading too).
        create: create the file if missing.
        truncate: empty the file first.
        exclusive: fail if the file exists (with ``create``).
        direct: try O_DIRECT (falls back silently where the file system refuses it).

    Example:
        >>> with File("/tmp/fastckpt-doc.bin", write=True, create=True, truncate=True) as f:
        ...     f.size()
        0
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        write: bool = False,
        create: bool = False,
        truncate: bool = False,
        exclusive: bool = False,
        direct: bool = True,
    ):
        self.path = os.fspath(path)
        flags = (os.O_RDWR if write else os.O_RDONLY) | _O_CLOEXEC
        if create:
            flags |= os.O_CREAT
        if truncate:
            flags |= os.O_TRUNC
        if exclusive:
            flags |= os.O_EXCL
        self.fd = os.open(self.path, flags, 0o644)
        self.direct_fd = -1
        self._owns_fd = True
        if direct and _O_DIRECT:
            try:
                self.direct_fd = os.open(
                    self.path, (flags & ~(os.O_CREAT | os.O_TRUNC | os.O_EXCL)) | _O_DIRECT
                )
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    os.close(self.fd)
                    raise
        self.alignment = self._alignment()

    @classmethod
    def from_fd(cls, fd: int, *, direct: bool = True) -> "File":
        """Wraps a descriptor the caller owns (it is not closed); adds an O_DIRECT twin when possible."""
        if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
            raise ValueError(f"fd must be a non-negative int, got {fd!r}")
        self = cls.__new__(cls)
        self.path = _fd_path(fd)
        self.fd = fd
        self._owns_fd = False
        self.direct_fd = -1
        mode = os.O_RDWR if _fd_writable(fd) else os.O_RDONLY
        if direct and _O_DIRECT:
            try:
                self.direct_fd = os.open(f"/proc/self/fd/{fd}", mode | _O_DIRECT | _O_CLOEXEC)
            except OSError:
                self.direct_fd = -1
        self.alignment = self._alignment()
        return self

    def _alignment(self) -> int:
        mem, offset = _C.dio_alignment(self.direct_fd if self.direct_fd >= 0 else self.fd)
        reported = max(mem, offset)
        # The kernel does not always say (tmpfs, older kernels): a page is always enough.
        return reported if reported and reported <= DEFAULT_ALIGNMENT else DEFAULT_ALIGNMENT

    @property
    def direct(self) -> bool:
        """Whether aligned blocks bypass the page cache."""
        return self.direct_fd >= 0

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def fsync(self) -> None:
        os.fsync(self.fd)

    def truncate(self, length: int) -> None:
        os.ftruncate(self.fd, length)

    def close(self) -> None:
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1
        if self.fd >= 0 and self._owns_fd:
            os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "File":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        os.fstat(fd)  # raises EBADF with a clear message when fd is not open
        return f"<fd {fd}>"


def _fd_writable(fd: int) -> bool:
    import fcntl

    return (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) != os.O_RDONLY


class Executor:
    """Submits reads and writes to a native executor built from an :class:`IOConfig`.

    Example:
        >>> from fastckpt.config import IOConfig
        >>> from fastckpt._buffers import buffer_ref
        >>> ex = Executor(IOConfig(engine="threads"))
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
