"""Files opened for direct I/O.

A :class:`File` holds two descriptors of one file: an ``O_DIRECT`` one (when the file
system takes it) for aligned blocks, and a buffered one for unaligned heads and tails.

Native and worker-thread I/O take the descriptor numbers, not the object: a number closed
while such an operation runs would be reused by the next file opened, and the operation
would read or write that file instead. So operations :meth:`File.hold` the file while they
run, and :meth:`File.close` of a held file closes its descriptors only once the last
operation lets go (:meth:`File.unhold`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from typing import Any

from fastckpt import _C

__all__ = ["File", "lock_if_free", "require_regular_file"]


def lock_if_free(path: str) -> int | None:
    """Opens ``path`` read-only (not through a symlink) and takes its ``flock`` exclusively
    without waiting: the descriptor holding the lock, or None when the file is gone or
    another holds its lock (a live writer's temporary file, say).

    Example:
        >>> import tempfile
        >>> path = tempfile.mkstemp()[1]
        >>> fd = lock_if_free(path)
        >>> lock_if_free(path) is None  # another open file description holds it
        True
        >>> os.close(fd)
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: The direct-I/O alignment assumed where the kernel reports none (a page).
DIRECT_IO_ALIGNMENT: int = _C.DIRECT_IO_ALIGNMENT


def _open_twin(fd: int, path: str, flags: int) -> int:
    """A second descriptor of ``fd``'s own file with ``flags`` (O_DIRECT), or -1.

    Opening ``path`` again could open another file: one renamed over it since ``fd`` was
    opened (an atomic save by another process), and a reader would take the header from one
    file and the data from the other. So the open file is reopened through
    ``/proc/self/fd``; where that is missing, ``path`` is opened and kept only if it is
    still the same file.
    """
    try:
        return os.open(f"/proc/self/fd/{fd}", flags)
    except FileNotFoundError:  # no /proc here
        pass
    twin = os.open(path, flags)
    mine, theirs = os.fstat(fd), os.fstat(twin)
    if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
        os.close(twin)
        return -1  # replaced meanwhile: buffered reads of the file opened
    return twin


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
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "doc.bin")
        >>> with File(path, write=True, create=True, truncate=True) as f:
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
        self._init_holds()
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
                self.direct_fd = _open_twin(
                    self.fd, self.path, (flags & ~(os.O_CREAT | os.O_TRUNC | os.O_EXCL)) | _O_DIRECT
                )
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    # forgotten before raising: the finalizer of this half-made object
                    # would close the number again, by then another thread's descriptor
                    fd, self.fd = self.fd, -1
                    os.close(fd)
                    raise
        self.alignment = self._alignment()

    @classmethod
    def from_fd(cls, fd: int, *, direct: bool = True) -> "File":
        """Wraps a descriptor the caller owns (it is not closed); adds an O_DIRECT twin when possible."""
        if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
            raise ValueError(f"fd must be a non-negative int, got {fd!r}")
        self = cls.__new__(cls)
        self._init_holds()
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

    def _init_holds(self) -> None:
        self.fd = self.direct_fd = -1
        self._owns_fd = False
        self._holds = 0
        self._close_requested = False
        self._holds_lock = threading.Lock()

    def hold(self) -> None:
        """Keeps the descriptors open until the matching :meth:`unhold`, even if
        :meth:`close` is called meanwhile (it then closes them at the last unhold).

        Example:
            >>> f = File("/dev/null")
            >>> f.hold(); f.close(); f.fd >= 0
            True
            >>> f.unhold(); f.fd
            -1
        """
        with self._holds_lock:
            if self.fd < 0 or self._close_requested:
                raise ValueError(f"I/O on a closed file: {self.path}")
            self._holds += 1

    def unhold(self) -> None:
        """Ends one :meth:`hold`; closes the descriptors if :meth:`close` was called."""
        with self._holds_lock:
            self._holds -= 1
            close_now = self._holds == 0 and self._close_requested
        if close_now:
            self._close_descriptors()

    def _alignment(self) -> int:
        mem, offset = _C.dio_alignment(self.direct_fd if self.direct_fd >= 0 else self.fd)
        reported = max(mem, offset)
        # The kernel does not always say (tmpfs, older kernels): a page is always enough.
        return reported if reported and reported <= DIRECT_IO_ALIGNMENT else DIRECT_IO_ALIGNMENT

    @property
    def direct(self) -> bool:
        """Whether aligned blocks bypass the page cache."""
        return self.direct_fd >= 0

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def pwrite_all(self, data: bytes, offset: int) -> None:
        """Writes all of ``data`` at ``offset`` through the page cache (headers, small files)."""
        view = memoryview(data)
        while view:
            written = os.pwrite(self.fd, view, offset)
            if written <= 0:  # never loop on a file system that stops taking bytes
                raise OSError(errno.EIO, f"write made no progress at offset {offset}", self.path)
            view, offset = view[written:], offset + written

    def fsync(self) -> None:
        os.fsync(self.fd)

    def truncate(self, length: int) -> None:
        os.ftruncate(self.fd, length)

    def close(self) -> None:
        """Closes the descriptors, or, while an operation holds the file, marks them to be
        closed when the last one lets go."""
        with self._holds_lock:
            if self._holds:
                self._close_requested = True
                return
        self._close_descriptors()

    def _close_descriptors(self) -> None:
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
            self._close_descriptors()  # no operation holds a file nobody references
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


def require_regular_file(path: str) -> None:
    """Refuses, before opening, what is not a regular file: a directory raises
    ``IsADirectoryError``; a FIFO, socket or device ``OSError(EINVAL)`` (opening a FIFO
    would block until a writer appears), each naming ``path``.

    Example:
        >>> require_regular_file("/dev/null")
        Traceback (most recent call last):
        ...
        OSError: [Errno 22] not a regular file (a character device): '/dev/null'
    """
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a checkpoint file", path)
    kind = (
        "a named pipe"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "not a file"
    )
    raise OSError(errno.EINVAL, f"not a regular file ({kind})", path)
