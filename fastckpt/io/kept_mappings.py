"""Kept mappings: a memory file system's file mapped once, whole, for all the saves, checks
and copies that pass over it, instead of mapped and unmapped by each.

A checkpoint manager's fast tier on ``/dev/shm`` writes each save into a spare file's pages
(:mod:`fastckpt.io.spare_files`); its save thread then checksums the file and its drain
copies it to root. Each of the three mapped the file anew, and on tmpfs filling a mapping's
page table and tearing it down costs more CPU than the copy itself (measured on 2 GiB of a
2-core VM: 0.27 s against 0.10 s), twice of it in the save's call. A kept mapping is made
once, when a file becomes a spare (in the background), and serves the file from then on:
the save's call copies into it, the checksum pass and the drain read from it, and the file
keeps it while it is a step, then a spare again. The tier's files stay mapped (counted in
the process's RSS, as shared memory: the pages were allocated to the file system anyway).

A kept mapping holds an open file description of its own (read-write, as the mapping is).
:func:`fastckpt.io.spare_files.retire` asks for its write lease on that description: the
kernel then counts the mapping as the lease holder's own, and any other opener still has the
lease refused. Forked children inherit neither the mapping (``MADV_DONTFORK``) nor, in
Python's ``os.fork``, its descriptors (closed in the child): a data loader's worker must not
keep a deleted step's memory alive.

Only files on a memory file system are kept: mapping a disk file populated would read it.

Example:
    >>> import os
    >>> path = f"/dev/shm/kept-doc-{os.getpid()}"
    >>> with open(path, "wb") as f:
    ...     _ = f.write(bytes(8192))
    >>> kept = keep(path, owner="/dev/shm")
    >>> fd = os.open(path, os.O_RDONLY)
    >>> with borrow(fd) as mapping:  # any descriptor of the same file finds it
    ...     mapping.size
    8192
    >>> os.close(fd); release(path); os.unlink(path)
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastckpt import config
from fastckpt.io.page_cache import MEMORY_FILESYSTEMS
from fastckpt.io.parallel_io import map_range

__all__ = [
    "KeptMapping",
    "borrow",
    "borrow_path",
    "keep",
    "release",
    "release_descriptor",
    "release_owned",
]

_Key = tuple[int, int]  # (st_dev, st_ino)


@dataclass
class KeptMapping:
    """A populated, shared, read-write mapping of a whole file and the descriptor that holds
    it. ``address`` is the address of the file's byte 0; ``owner`` the directory of whoever
    kept it (:func:`release_owned`)."""

    fd: int
    size: int
    address: int
    owner: str
    _mapping: mmap.mmap = field(repr=False)
    _users: int = 0
    _released: bool = False

    def view(self) -> memoryview:
        """A view of the whole mapping; released by the caller before the borrow ends."""
        return memoryview(self._mapping)

    def _close(self) -> None:
        os.close(self.fd)
        with contextlib.suppress(BufferError):  # a view still held: unmapped when it goes
            self._mapping.close()


_lock = threading.Lock()
_kept: dict[_Key, KeptMapping] = {}
_inherited: list[Any] = []  # a forked child's copies of the objects: never unmapped there


def _key(st: os.stat_result) -> _Key:
    return st.st_dev, st.st_ino


def keep(path: str, *, owner: str) -> KeptMapping | None:
    """Maps the regular file ``path`` whole (its pages mapped in one call) and keeps the
    mapping until :func:`release`; returns it, or None where the file is not on a memory file
    system, is empty, or cannot be mapped. A file kept already returns its mapping.
    Mappings of files deleted since (by anyone) are released first."""
    _release_deleted()
    if config.filesystem_key(path).split(":", 1)[0] not in MEMORY_FILESYSTEMS:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        with _lock:
            if _key(st) in _kept:
                os.close(fd)
                return _kept[_key(st)]
        if not st.st_size or not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        mapping, address = map_range(fd, 0, st.st_size, writable=True)
    except OSError:
        os.close(fd)
        return None
    with contextlib.suppress(AttributeError, OSError):  # not in a forked child's memory
        mapping.madvise(mmap.MADV_DONTFORK)
    kept = KeptMapping(fd, st.st_size, address, os.path.abspath(owner), mapping)
    with _lock:
        if _kept.setdefault(_key(st), kept) is not kept:  # another thread kept it meanwhile
            kept._close()
        return _kept[_key(st)]


@contextlib.contextmanager
def borrow(fd: int) -> Iterator[KeptMapping | None]:
    """The kept mapping of the file open at ``fd``, held (not unmapped by a release) for the
    ``with`` block; None when the file has none, or has another size than its mapping (the
    file was cut or grown since: a store past its end would be a SIGBUS)."""
    with _borrowed(os.fstat(fd)) as kept:
        yield kept


@contextlib.contextmanager
def borrow_path(path: str) -> Iterator[KeptMapping | None]:
    """:func:`borrow` by name (the file ``path`` names, not followed if a link): its
    descriptor stays open for the block even if the mapping is released meanwhile."""
    try:
        st: os.stat_result | None = os.stat(path, follow_symlinks=False)
    except OSError:
        st = None
    if st is None:
        yield None
        return
    with _borrowed(st) as kept:
        yield kept


@contextlib.contextmanager
def _borrowed(st: os.stat_result) -> Iterator[KeptMapping | None]:
    with _lock:
        kept = _kept.get(_key(st))
        if kept is not None and kept.size != st.st_size:
            _drop(_key(st))
            kept = None
        if kept is not None:
            kept._users += 1
    try:
        yield kept
    finally:
        if kept is not None:
            with _lock:
                kept._users -= 1
                last = kept._released and not kept._users
            if last:
                kept._close()


def release(path: str) -> None:
    """Unmaps the kept mapping of ``path``'s file, if it has one (once no one borrows it)."""
    _release(lambda: os.stat(path, follow_symlinks=False))


def release_descriptor(fd: int) -> None:
    """Unmaps the kept mapping of the file open at ``fd``, if it has one."""
    _release(lambda: os.fstat(fd))


def _release(stat_of: Callable[[], os.stat_result]) -> None:
    with contextlib.suppress(OSError):  # a file already gone has no mapping to find
        key = _key(stat_of())
        with _lock:
            _drop(key)


def release_owned(owner: str) -> None:
    """Unmaps every mapping kept with ``owner`` (:func:`fastckpt.io.spare_files.discard`,
    when a manager closes its fast tier)."""
    owner = os.path.abspath(owner)
    with _lock:
        for key in [k for k, kept in _kept.items() if kept.owner == owner]:
            _drop(key)


def _release_deleted() -> None:
    """Unmaps the mappings of files that are deleted (no name left): their memory returns
    to the system only then."""
    with _lock:
        for key in [k for k, kept in _kept.items() if os.fstat(kept.fd).st_nlink == 0]:
            _drop(key)


def _drop(key: _Key) -> None:
    """Forgets ``key``'s mapping and closes it now, or when its last borrower is done.
    Called with ``_lock`` held."""
    kept = _kept.pop(key, None)
    if kept is None:
        return
    kept._released = True
    if not kept._users:
        kept._close()


def _forget_in_child() -> None:
    """In a forked child: close the descriptors of the kept files (ours, and the one each
    mmap object holds); the mappings themselves were not inherited (MADV_DONTFORK)."""
    global _lock
    _lock = threading.Lock()  # (another thread may have held it at the fork)
    if not _kept:
        return
    keys = set(_kept)
    for kept in _kept.values():
        _inherited.append(kept._mapping)  # its range is not mapped here: never unmapped
    _kept.clear()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if _key(os.stat(f"/proc/self/fd/{name}")) in keys:
                    os.close(int(name))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
