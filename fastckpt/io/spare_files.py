"""Spare files: a retired file's storage handed to the next save instead of freed.

On a memory file system (tmpfs, ``/dev/shm``) a file's pages are allocated as it is
written, and memory the system has not touched lately is slow to allocate: on a 2-core VM,
writing 2 GiB into a new ``/dev/shm`` file took 0.75 to 5.6 s, writing over the pages of an
existing file 0.47 s every time. A checkpoint manager's fast tier writes a step, then
deletes an older one; a spare keeps the older file's pages for the next save, which
renames it into place as its temporary file and writes over it.

A file becomes a spare only when nobody else has it open or mapped, so a reader of an old
step never sees its bytes change. The test is a Linux write lease, which the kernel grants
only to the file's one opener; it is released at once. Where leases are refused (another
opener, another owner, a file system without them), the file is deleted as before.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> old, spare = os.path.join(d, "old.bin"), os.path.join(d, ".spare")
    >>> with open(old, "wb") as f:
    ...     _ = f.write(b"x" * 4096)
    >>> retire(old, spare), os.path.exists(old)
    (True, False)
    >>> tmp, lock_fd = take(spare, d, "new.bin")
    >>> os.path.getsize(tmp), os.path.exists(spare)
    (4096, False)
    >>> os.close(lock_fd)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
import threading

from fastckpt.io import kept_mappings
from fastckpt.io.files import lock_if_free

__all__ = ["discard", "retire", "take"]

_F_SETLEASE = getattr(fcntl, "F_SETLEASE", None)  # Linux only


def _alone(fd: int) -> bool:
    """Whether ``fd`` is the only open file description of its file (no other descriptor,
    in this process or another, and no mapping): the kernel grants a write lease only then."""
    if _F_SETLEASE is None:
        return False
    try:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_WRLCK)
    except OSError:  # EAGAIN: another opener; EACCES: not our file; EINVAL: no leases here
        return False
    # Released at once: nobody can open the file meanwhile (its name is gone, see retire).
    fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
    return True


def retire(path: str, spare: str) -> bool:
    """Removes the regular file ``path``, keeping its storage as ``spare`` when no spare is
    there yet and nobody else has the file open (True); else deletes it (False). A file
    that is missing is no error (False). On a memory file system the spare keeps (or gets,
    in this call) a whole mapping for the saves that write over it
    (:mod:`fastckpt.io.kept_mappings`)."""
    # A kept mapping's own descriptor asks for the lease: a second one of ours would be an
    # opener the kernel counts against it.
    with kept_mappings.borrow_path(path) as kept:
        try:
            fd = kept.fd if kept is not None else os.open(path, _RETIRE_FLAGS)
        except FileNotFoundError:
            return False
        try:
            try:
                made = _make_spare(fd, path, spare)
            except BaseException:
                kept_mappings.release_descriptor(fd)
                raise
            if not made:  # deleted: a mapping must not hold its memory
                kept_mappings.release_descriptor(fd)
            elif kept is None:
                kept_mappings.keep(spare, owner=os.path.dirname(os.path.abspath(spare)))
            return made
        finally:
            if kept is None:
                os.close(fd)


def _make_spare(fd: int, path: str, spare: str) -> bool:
    """Renames ``path`` (open at ``fd``) to ``spare`` if it may be one (True), else
    deletes it (False)."""
    info = os.fstat(fd)
    # a file someone else also links (a hard link kept to a step's file) is not only ours:
    # its bytes are never written over
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or os.path.lexists(spare):
        os.unlink(path)
        return False
    os.rename(path, spare)  # from here no one can open it by its old name
    if _alone(fd):  # nobody opened it before the rename either
        with _made_lock:
            _made.add((info.st_dev, info.st_ino))
        return True
    os.unlink(spare)
    return False


_RETIRE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW

# The spares this process made (device, inode): ``take`` writes over nothing else, so a
# ``spare_file=`` naming some other file (or a spare planted by someone) is never consumed.
_made_lock = threading.Lock()
_made: set[tuple[int, int]] = set()


def take(spare: str, directory: str, name: str) -> tuple[str, int] | None:
    """Renames ``spare`` to a new temporary file ``<name>.<random>.tmp`` in ``directory``
    (the same file system) and returns its path with a descriptor holding its lifetime
    lock (``flock``, as :func:`fastckpt.io.commit.AtomicFile` keeps on its temporary files),
    or None when there is no spare to take. The file keeps the spare's bytes and size."""
    fd = lock_if_free(spare)
    if fd is None:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # gone, or linked elsewhere
            raise OSError("not a spare file")
        with _made_lock:  # only a file this process made a spare: never another's file
            if (info.st_dev, info.st_ino) not in _made:
                raise OSError("not a spare this process made")
            _made.discard((info.st_dev, info.st_ino))
        tmp_path = os.path.join(directory, f"{name}.{secrets.token_hex(6)}.tmp")
        os.rename(spare, tmp_path)
    except OSError:
        os.close(fd)
        return None
    return tmp_path, fd


def remove_stale(spare: str) -> bool:
    """Removes a spare another process left at ``spare`` (a manager killed before it could
    discard it), so that this one can keep spares there again; True if one was removed.
    Only a regular file nothing else links is removed (a hard link someone kept is left).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), ".spare.safetensors")
        >>> open(path, "wb").close(); remove_stale(path), os.path.exists(path)
        (True, False)
    """
    try:
        info = os.lstat(spare)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        return False
    with _made_lock:
        if (info.st_dev, info.st_ino) in _made:
            return False  # this process's own spare
    os.unlink(spare)
    return True


def discard(spare: str) -> None:
    """Deletes ``spare`` if it is there (its memory goes back to the system), and unmaps
    every file that spares of its directory kept mapped (:mod:`fastckpt.io.kept_mappings`):
    call it when done saving over spares there."""
    kept_mappings.release_owned(os.path.dirname(os.path.abspath(spare)))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(spare)
