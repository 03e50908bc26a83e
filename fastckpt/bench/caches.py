"""Cold and hot page caches, and durability: what a timed read or write starts from.

Reads are timed cold (the page cache dropped where this process may, else the file's clean
pages evicted) or hot (every byte read once before); writes are timed until the data and
the file's name are on the device (fsync of the file and of its directory).

Example:
    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     _ = f.write(b"x" * 10000); f.flush()
    ...     make_durable(f.name)
    ...     drop_page_cache([f.name]) in ("drop_caches", "fadvise")
    True
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from fastckpt.bench.units import MiB
from fastckpt.io import released_files

__all__ = ["PageCache", "drop_page_cache", "fsync_path", "make_durable", "warm_page_cache"]


class PageCache:
    """Drops the kernel's page cache before timed reads, where this process may.

    Dropping needs root (writing ``/proc/sys/vm/drop_caches``). Where that is refused, or
    ``allow_drop`` is False (``--no-drop-caches``: the whole machine's cache is not this
    process's to empty), the clean pages of the files about to be read are still evicted with
    ``posix_fadvise(DONTNEED)`` (allowed to anyone), and fastckpt's engines read with
    O_DIRECT, which bypasses the cache on file systems that allow it.

    Constructing one with ``allow_drop`` tries a first drop, to learn whether it may.

    Example:
        >>> cache = PageCache(allow_drop=False)
        >>> cache.can_drop, cache.describe().startswith("page cache not dropped (--no-drop-caches)")
        (False, True)
    """

    PATH = "/proc/sys/vm/drop_caches"

    def __init__(self, *, allow_drop: bool = True) -> None:
        self.reason = ""
        self.opted_out = not allow_drop
        self.can_drop = self._try_drop() if allow_drop else False

    def _try_drop(self) -> bool:
        try:
            os.sync()
            with open(self.PATH, "w", encoding="ascii") as f:
                f.write("3\n")
            return True
        except OSError as exc:
            self.reason = exc.strerror or str(exc)
            return False

    def drop(self, paths: Iterable[str | os.PathLike[str]] = ()) -> None:
        """Makes the next read of ``paths`` come from the device (as far as permitted).

        A save over an existing file frees the old file's blocks after it returns
        (:mod:`fastckpt.io.released_files`); that is waited for first, with the discards a
        ``discard``-mounted file system then sends: a load timed right after a save
        otherwise shared the disk with them (2 GiB: 1.60 GB/s against 2.14 here)."""
        released_files.wait()
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        if self.can_drop:
            self._try_drop()

    def describe(self) -> str:
        """One line for the output: how reads are kept cold."""
        if self.can_drop:
            return f"page cache dropped before every read (running as root; {self.PATH})"
        if self.opted_out:
            return (
                "page cache not dropped (--no-drop-caches): read figures are not cold where "
                "data stays in memory; only O_DIRECT and posix_fadvise of the files read "
                "keep them from the cache"
            )
        return (
            f"page cache not dropped ({self.PATH}: {self.reason or 'not permitted'}; needs root): "
            "reads rely on O_DIRECT and posix_fadvise"
        )


_page_cache: PageCache | None = None


def drop_page_cache(files: Sequence[str | os.PathLike[str]] = ()) -> str:
    """Makes the next reads of ``files`` come from the device; returns how.

    As root the whole cache is dropped ("drop_caches"); otherwise each file's clean pages
    are evicted with ``posix_fadvise(DONTNEED)`` ("fadvise"). See :class:`PageCache`.
    """
    global _page_cache
    if _page_cache is None:
        _page_cache = PageCache()
    _page_cache.drop(files)
    return "drop_caches" if _page_cache.can_drop else "fadvise"


def warm_page_cache(files: Iterable[str | os.PathLike[str]], chunk: int = 8 * MiB) -> int:
    """Reads every byte of ``files`` once, so the next reads find them in the page cache.

    The reads go through a small reused buffer, so the caller's RSS does not grow.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(b"x" * 10000); f.flush()
        ...     warm_page_cache([f.name])
        10000
    """
    total = 0
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return total


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flushes a file's data to the device (what "timed to durability" means here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_durable(path: str | os.PathLike[str]) -> None:
    """fsync of the file and of its directory (so its name survives a crash too)."""
    fsync_path(path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
