"""Local files read through the page cache only, with none of the setup a large read needs.

A load of a small checkpoint already in memory, or a mapping of any checkpoint, needs no
O_DIRECT descriptor, no probe of the file system, no native engine and no worker threads:
:class:`~fastckpt.storage.local.LocalStorage` sets those up at open, and that setup cost
more than the whole load of a 64 KiB state. Two storages without it:

- :class:`PageCacheFile`: one buffered descriptor; what ``load(mmap=True)`` maps, and what
  its ``verify=True`` reads through.
- :class:`ResidentFile`: a small file whose bytes are in memory (tmpfs, a hot page cache),
  opened by :meth:`ResidentFile.open_small`: its tensors are read on the calling thread, one
  ``pread`` per run of adjacent tensors (one for a whole state) straight into the load's
  arena, each CRC32C computed in the same pass.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "x.bin")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(b"abcdef")
    >>> with ResidentFile.open_small(path, limit=1 << 20) as s:
    ...     s.size(), s.read_bytes(2, 3)
    (6, b'cde')
    >>> ResidentFile.open_small(path, limit=4) is None  # larger than the limit
    True
"""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Iterable, Sequence
from typing import Any

from fastckpt import _C
from fastckpt.io import page_cache, parallel_io
from fastckpt.io.files import File
from fastckpt.io.parallel_io import Span
from fastckpt.storage.base import Progress, Storage

__all__ = ["PageCacheFile", "ResidentFile"]

# A small file is read whole when at least this share of it is in memory (as LocalStorage
# reads through the page cache from this share on).
_RESIDENT_ENOUGH = 0.5
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# never blocks at open on a FIFO: what is not a regular file is refused after fstat
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def _open_regular(path: str) -> tuple[int, os.stat_result] | None:
    """A read-only descriptor of the regular file ``path`` and its status; None when it is
    no regular file or cannot be opened (the full open then says why, naming it)."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK)
    except (OSError, ValueError, TypeError):
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


class PageCacheFile(Storage):
    """A local file read through the page cache (see the module's description); opens one
    descriptor, nothing else. Read-only: ``write_atomically`` and ``delete`` refuse.

    Raises:
        OSError: the file cannot be opened or is no regular file (naming it).
    """

    def __init__(self, path: str | os.PathLike[str], *, _opened: Any = None):
        self.location = os.fspath(path)
        opened = _opened if _opened is not None else _open_regular(self.location)
        if opened is None:
            raise OSError(errno.EINVAL, "not a readable regular file", self.location)
        fd, st = opened
        self._fd, self._size = fd, st.st_size
        self._file: File | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> PageCacheFile | None:
        """The file at ``path``, or None where it is no readable regular file (the caller's
        full open then raises the error that names it)."""
        opened = _open_regular(os.fspath(path))
        return None if opened is None else cls(path, _opened=opened)

    def fileno(self) -> int:
        """The open descriptor (ValueError once closed)."""
        if self._fd < 0:
            raise ValueError(f"{self.location}: the file is closed")
        return self._fd

    def local_file(self) -> File:
        if self._fd < 0:
            raise ValueError(f"{self.location}: the file is closed")
        if self._file is None:
            self._file = File.from_fd(self._fd, direct=False)
            self._file.path = self.location  # messages name the file as the caller did
        return self._file

    def size(self) -> int:
        return self._size

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        chunks, got = [], 0
        while got < nbytes:
            data = os.pread(self._fd, nbytes - got, offset + got)
            if not data:
                raise EOFError(f"{self.location}: file ended after {offset + got} bytes")
            chunks.append(data)
            got += len(data)
        return b"".join(chunks)

    def choose_mode(self, region: tuple[int, int]) -> tuple[str, str]:
        return "buffered", "opened for the page cache only"

    def span_bytes(self, total: int, mode: str) -> int:
        from fastckpt.storage.local import span_bytes

        return span_bytes(total, "buffered")

    def read_spans(
        self,
        spans: Sequence[Span],
        *,
        owner: Any,
        mode: str,
        checksum: bool,
        on_progress: Progress | None = None,
    ) -> list[list[int]]:
        return parallel_io.read_buffered(
            self.local_file(), spans, checksum=checksum, on_progress=on_progress
        )

    def write_atomically(self, pieces: Iterable[Any], total: int) -> None:
        raise io.UnsupportedOperation(f"{self.location}: opened for reading only")

    def delete(self) -> None:
        raise io.UnsupportedOperation(f"{self.location}: opened for reading only")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()  # waits for reads holding it; owns no descriptor
            self._file = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ResidentFile(PageCacheFile):
    """A small local file mostly in memory, read on the calling thread: each run of
    adjacent tensors by one ``pread`` straight into the load's arena, checksummed in the
    same pass (a small state is read whole by one call). Open with :meth:`open_small`."""

    @classmethod
    def open_small(cls, path: str | os.PathLike[str], *, limit: int) -> ResidentFile | None:
        """The file at ``path`` when it is a regular file of at most ``limit`` bytes and
        mostly in memory (tmpfs, a hot page cache); otherwise None (nothing left open)."""
        opened = _open_regular(os.fspath(path))
        if opened is None:
            return None
        fd, st = opened
        if st.st_size > limit or not _resident(fd, st.st_size):
            os.close(fd)
            return None
        return cls(path, _opened=opened)

    def span_bytes(self, total: int, mode: str) -> int:
        return max(total, 1)  # one span per run: no worker threads share it

    def read_spans(
        self,
        spans: Sequence[Span],
        *,
        owner: Any,
        mode: str,
        checksum: bool,
        on_progress: Progress | None = None,
    ) -> list[list[int]]:
        # Memory-speed reads of a few MiB: handing them to worker threads would cost more
        # than the copies (and the CRC32C is taken while the bytes are in this core's cache).
        # On this thread, so the descriptor cannot be closed under the reads.
        if self._fd < 0:
            raise ValueError(f"{self.location}: the file is closed")
        crcs = []
        for span in spans:
            cuts = list(span.cuts)
            fd, path = self._fd, self.location
            crcs.append(
                _C.pread_crc(fd, span.address, span.nbytes, span.file_offset, cuts, checksum, path)
            )
            if on_progress is not None:
                on_progress(span.nbytes)
        return crcs


def _resident(fd: int, size: int) -> bool:
    """Whether most of the file's pages are in memory (a file on tmpfs always is)."""
    share = page_cache.resident_fraction(fd, 0, size)
    return share is not None and share >= _RESIDENT_ENOUGH
