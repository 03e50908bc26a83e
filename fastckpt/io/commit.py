"""The atomic, durable commit every fastckpt writer uses.

Write ``<name>.<random>.tmp`` in the target directory, fsync it, rename it over the final
name, fsync the directory. A reader never sees a torn file at the final path, and a crash
at any point leaves the previous file there intact; on error the temporary file is removed.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with AtomicFile(os.path.join(d, "x.bin")) as out:
    ...     _ = os.pwrite(out.file.fd, b"hello", 0)
    >>> with open(os.path.join(d, "x.bin"), "rb") as f:
    ...     f.read()
    b'hello'
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from fastckpt import _C
from fastckpt.io.files import File

__all__ = ["AtomicFile", "fsync_directory", "check_destination"]


def check_destination(f: Any, argname: str = "f") -> str:
    """The path of a save's target as a str; TypeError for what is not a path."""
    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not path:
            raise ValueError(f"{argname} must not be empty")
        return path
    raise TypeError(
        f"{argname} must be a path (str or os.PathLike), got {type(f).__name__}; "
        "file objects are not supported because direct I/O needs a file on disk"
    )


def fsync_directory(path: str) -> None:
    """Makes a rename or creation in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFile:
    """A temporary file that becomes ``path`` on :meth:`commit`, or vanishes on :meth:`abort`.

    Used as a context manager it commits on success and aborts on an exception.
    """

    def __init__(self, path: str | os.PathLike[str], *, direct: bool = True):
        self.path = os.path.abspath(os.fspath(path))
        directory, name = os.path.split(self.path)
        if os.path.isdir(self.path):
            raise IsADirectoryError(21, "Is a directory", self.path)
        self.tmp_path = os.path.join(directory, f"{name}.{secrets.token_hex(6)}.tmp")
        self.file = File(self.tmp_path, write=True, create=True, exclusive=True, direct=direct)
        self._done = False

    def reserve(self, nbytes: int) -> None:
        """Allocates the file's blocks up front (where the file system can), so parallel
        out-of-order direct writes still give one contiguous file that later reads stream
        from, and a full disk fails here before any data is written (``OSError(ENOSPC)``)."""
        _C.preallocate(self.file.fd, nbytes, self.tmp_path)

    def commit(self) -> None:
        """fsync, rename over the final path, fsync the directory."""
        try:
            self.file.fsync()
            self.file.close()
            os.replace(self.tmp_path, self.path)
        except BaseException:
            self.abort()
            raise
        self._done = True
        fsync_directory(os.path.dirname(self.path))

    def abort(self) -> None:
        """Closes and removes the temporary file; the final path is untouched."""
        if self._done:
            return
        self._done = True
        self.file.close()
        try:
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
