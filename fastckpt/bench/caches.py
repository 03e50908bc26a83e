"""Cold and hot page caches, and durability: what a timed read or write starts from.

Reads are timed cold (the files about to be read written back and evicted from the page
cache; the whole machine's cache dropped only when asked, as root) or hot (every byte read
once before); writes are timed until the data and the file's name are on the device (fsync
of the file and of its directory).

Example:
    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     _ = f.write(b"x" * 10000); f.flush()
    ...     make_durable(f.name)
    ...     drop_page_cache([f.name])
    'fadvise'
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from fastckpt.bench.units import MiB
from fastckpt.io import released_files

__all__ = ["PageCache", "drop_page_cache", "fsync_path", "make_durable", "warm_page_cache"]


class PageCache:
    """Makes timed reads cold: before each, the files about to be read are written back
    (fsync) and their pages evicted with ``posix_fadvise(DONTNEED)``, which anyone may do and
    which leaves the rest of the machine's cache (other programs' files) alone. fastckpt's
    engines also read with O_DIRECT, which bypasses the cache where the file system allows.

    With ``allow_drop`` (``--drop-all-caches``) the whole machine's page cache is dropped
    too, which needs root (writing ``/proc/sys/vm/drop_caches``) and makes every other
    program on the machine read its files from the disk again; constructing one tries a
    first drop, to learn whether it may.

    Example:
        >>> cache = PageCache()
        >>> cache.can_drop, cache.describe().startswith("the files read are evicted")
        (False, True)
    """

    PATH = "/proc/sys/vm/drop_caches"
    asked = False  # whether the whole cache was asked to be dropped (--drop-all-caches)
    reason = ""

    def __init__(self, *, allow_drop: bool = False) -> None:
        self.reason = ""
        self.asked = allow_drop
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
            return (
                "the whole page cache dropped before every read (--drop-all-caches, running "
                f"as root; {self.PATH})"
            )
        evicted = (
            "the files read are evicted from the page cache before every read (fsync, then "
            "posix_fadvise(DONTNEED)); reads use O_DIRECT where the file system takes it"
        )
        if self.asked:
            return (
                f"{evicted}; the whole cache was not dropped (--drop-all-caches: {self.PATH}: "
                f"{self.reason or 'not permitted'}; needs root)"
            )
        return f"{evicted}; the rest of the machine's cache is left alone"


_page_cache: PageCache | None = None


def drop_page_cache(files: Sequence[str | os.PathLike[str]] = ()) -> str:
    """Makes the next reads of ``files`` come from the device; returns how: each file is
    written back and its pages evicted with ``posix_fadvise(DONTNEED)`` ("fadvise"); the
    machine's other cached files are left alone. See :class:`PageCache`.
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
