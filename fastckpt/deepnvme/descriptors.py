"""The file behind a caller's open descriptor, held for the length of one operation.

DeepSpeed's handles take an ``int`` file descriptor where they take a file name (its
FastFileWriter opens a file ``O_DIRECT`` and hands the descriptor over). The caller owns
that descriptor: fastckpt never closes it, and never changes how it was opened. So that a
descriptor closed (and its number reused) before :meth:`aio_handle.wait` cannot send the
bytes to another file, an operation works on a duplicate of it, closed when it completes.
"""

from __future__ import annotations

import errno
import fcntl
import operator
import os
from typing import Any

from fastckpt.io.files import File

__all__ = ["HeldDescriptor", "as_descriptor"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def as_descriptor(target: Any) -> int | None:
    """The descriptor ``target`` names (an ``int`` or an integer-like object), else None.

    Example:
        >>> as_descriptor(5), as_descriptor("/tmp/x.bin")
        (5, None)
    """
    if isinstance(target, (str, bytes, os.PathLike)) or target is None:
        return None
    if isinstance(target, bool):
        raise TypeError("a file descriptor must be an int, got bool")
    if not hasattr(type(target), "__index__"):
        raise TypeError(
            f"expected a file name (str or os.PathLike) or a file descriptor (int), "
            f"got {type(target).__name__}"
        )
    fd = operator.index(target)
    if fd < 0:
        raise ValueError(f"a file descriptor must not be negative, got {fd}")
    return fd


class HeldDescriptor(File):
    """A :class:`~fastckpt.io.files.File` over a duplicate of the caller's descriptor ``fd``.

    The duplicate shares ``fd``'s open file (its offset, flags and lifetime are the
    caller's); closing this object closes only the duplicate. Aligned blocks go through
    O_DIRECT only when ``fd`` was opened with it; then a buffered twin (the same file
    reopened without O_DIRECT) takes the unaligned head and tail.

    Raises:
        OSError: ``fd`` is not open (``EBADF``), named ``"fd N"``.
        ValueError: a write through a descriptor opened with ``O_APPEND`` (the kernel would
            append every block instead of writing it at its offset).

    Example:
        >>> fd = os.open("/tmp/fastckpt-held-doc.bin", os.O_RDWR | os.O_CREAT, 0o644)
        >>> held = HeldDescriptor(fd, write=True)
        >>> held.fd != fd, held.path
        (True, '/tmp/fastckpt-held-doc.bin')
        >>> held.close(); os.close(fd)
    """

    def __init__(self, fd: int, *, write: bool):
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError as exc:
            raise OSError(
                exc.errno, f"fd {fd} is not an open file descriptor ({exc.strerror})", f"fd {fd}"
            ) from None
        path = _name_of(fd)
        if write and flags & os.O_APPEND:
            raise ValueError(
                f"fd {fd} ({path}) is opened with O_APPEND: the kernel would append each "
                "block instead of writing it at its file_offset"
            )
        self._init_holds()  # File's bookkeeping of operations that keep it open
        self.path = path
        self._owns_fd = True
        self.fd = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
        if _O_DIRECT and flags & _O_DIRECT:
            # The engine sends unaligned heads and tails through a buffered descriptor.
            try:
                buffered = os.open(
                    f"/proc/self/fd/{self.fd}", (flags & os.O_ACCMODE) | os.O_CLOEXEC
                )
            except OSError:
                pass  # no twin: an unaligned request then fails with the kernel's EINVAL
            else:
                self.direct_fd, self.fd = self.fd, buffered
        self.alignment = self._alignment()

    def read_back(self, nbytes: int, offset: int) -> bytes:
        """``nbytes`` at ``offset`` through the page cache, even when ``fd`` is write-only."""
        try:
            return os.pread(self.fd, nbytes, offset)
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise
            reader = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                return os.pread(reader, nbytes, offset)
            finally:
                os.close(reader)


def _name_of(fd: int) -> str:
    """The file's path as /proc tells it, else ``"fd N"`` (used in error messages)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"
