"""How much of a file's byte range is already in memory (the page cache, or tmpfs).

A read through the page cache of resident bytes runs at memory speed, while O_DIRECT would
go to the device again; so the read path asks this module first. ``cachestat(2)`` (Linux
6.5+) answers without touching the file's pages; elsewhere ``mincore(2)`` over a read-only
mapping of the range does (it maps, but faults nothing in).

Example:
    >>> import os, tempfile
    >>> with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
    ...     _ = f.write(b"x" * 8192); f.flush()
    ...     resident_fraction(f.fileno(), 0, 8192)
    1.0
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os  # noqa: F401 - used by the doctest
import platform

__all__ = ["resident_fraction", "MEMORY_FILESYSTEMS"]

#: File systems whose files live in memory: always resident, and O_DIRECT buys nothing.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})

# cachestat's number is the same on every architecture (the generic syscall table).
_SYS_CACHESTAT = 451
_PAGE = mmap.PAGESIZE


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.syscall.restype = ctypes.c_long
_cachestat_works = platform.system() == "Linux"


def _pages(offset: int, nbytes: int) -> tuple[int, int]:
    first = offset // _PAGE
    last = -(-(offset + nbytes) // _PAGE)
    return first, last - first


def _by_cachestat(fd: int, offset: int, nbytes: int) -> float | None:
    global _cachestat_works
    if not _cachestat_works:
        return None
    first, count = _pages(offset, nbytes)
    span, stat = _CachestatRange(first * _PAGE, count * _PAGE), _Cachestat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # old kernel, or a seccomp filter
            _cachestat_works = False
        return None
    return min(1.0, stat.nr_cache / count)


def _by_mincore(fd: int, offset: int, nbytes: int) -> float | None:
    first, count = _pages(offset, nbytes)
    length = count * _PAGE
    base = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, first * _PAGE)
    if base in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vector = (ctypes.c_ubyte * count)()
        if _libc.mincore(ctypes.c_void_p(base), length, vector) != 0:
            return None
        return sum(v & 1 for v in vector) / count
    finally:
        _libc.munmap(ctypes.c_void_p(base), length)


def resident_fraction(fd: int, offset: int, nbytes: int) -> float | None:
    """The fraction (0.0 to 1.0) of the pages of bytes ``[offset, offset + nbytes)`` of the open
    file ``fd`` that are in memory, or None where the kernel cannot say.

    Example:
        >>> resident_fraction(os.open("/proc/self/stat", os.O_RDONLY), 0, 0)
        1.0
    """
    if nbytes <= 0:
        return 1.0
    found = _by_cachestat(fd, offset, nbytes)
    return found if found is not None else _by_mincore(fd, offset, nbytes)
