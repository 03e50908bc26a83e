"""The atomic, durable commit every fastckpt writer uses.

Write ``<name>.<random>.tmp`` in the target directory, fsync it, rename it over the final
name, fsync the directory. A reader never sees a torn file at the final path, and a crash
at any point leaves the previous file there intact; on error the temporary file is removed.

Temporary files of writers that died (killed, power loss) are removed by the next save to
the same path: a writer holds an exclusive ``flock`` on its temporary file for its whole
life, and a new writer removes every ``<name>.<12 hex>.tmp`` sibling it can lock without
waiting, since the lock is free only when its writer is gone. So after any number of
crashes at most one temporary file per live or last-crashed writer remains.

A writer of many files (:mod:`fastckpt.io.commit_set`) does not hold a descriptor per file:
its temporaries form a group, named ``<name>.<token>.tmp`` with one token, and only the
first of them (the anchor) keeps its lock until the group is committed; the others are
written, fsynced and closed. A cleaner removes a temporary only when no file of its group
is locked (:func:`abandoned`), so the anchor's one lock keeps the whole group alive.

Saving over an existing file keeps its permission bits (and, when run as root, its owner),
as writing it in place would. A read-only file (no write bit, or not writable by this user)
is refused with ``PermissionError`` naming it, as ``torch.save`` refuses it, unless
``overwrite_readonly=True`` is given: the rename would otherwise replace it silently, even
for root, whom permission bits do not stop.

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

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterable
from typing import Any

from fastckpt import _C
from fastckpt.io import kept_mappings, released_files, spare_files
from fastckpt.io.files import File

__all__ = [
    "AtomicFile",
    "TemporaryGroup",
    "abandoned",
    "fsync_directory",
    "check_destination",
    "check_writable",
    "remove_stale_temporaries",
    "write_atomically",
]


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


# flock(2) errors of file systems without it (some network file systems).
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}
_TMP_SUFFIX = re.compile(r"\.[0-9a-f]{12}\.tmp")


def _held(path: str) -> bool:
    """Whether another open file description holds the ``flock`` of ``path`` now."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # gone (committed or removed)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno not in _NO_FLOCK
    finally:
        os.close(fd)  # a lock taken here goes with it
    return False


def abandoned(path: str, siblings: Iterable[str], known: dict[str, bool] | None = None) -> bool:
    """Whether the temporary file ``path``, whose own lock the caller holds, belongs to no
    live writer: no other temporary of its group (same 12-hex token, among ``siblings``,
    names in its directory) is locked. A group's files other than its anchor are kept
    alive by the anchor's lock alone (see the module). ``known`` remembers the answer per
    group across calls of one clean-up, so a directory of many staged files is walked once
    per group, not once per file.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> live = os.path.join(d, "a.bin.0123456789ab.tmp")
        >>> fd = os.open(live, os.O_RDONLY | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX)
        >>> abandoned(os.path.join(d, "b.bin.0123456789ab.tmp"), os.listdir(d))
        False
        >>> os.close(fd)
        >>> abandoned(os.path.join(d, "b.bin.0123456789ab.tmp"), os.listdir(d))
        True
    """
    directory, name = os.path.split(path)
    token = name[-16:]  # ".<12 hex>.tmp"
    if known is not None and token in known:
        return known[token]
    answer = not any(
        sibling != name and sibling.endswith(token) and _held(os.path.join(directory, sibling))
        for sibling in siblings
    )
    if known is not None:
        known[token] = answer
    return answer


def remove_stale_temporaries(path: str) -> list[str]:
    """Removes the temporary files that dead writers left for ``path``; returns their paths.

    A temporary file whose ``flock`` can be taken without waiting has no live writer.
    Files of live writers (locked), other names and symlinks are left alone.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = open(os.path.join(d, "x.bin.0123456789ab.tmp"), "w").close()
        >>> [os.path.basename(p) for p in remove_stale_temporaries(os.path.join(d, "x.bin"))]
        ['x.bin.0123456789ab.tmp']
    """
    directory, name = os.path.split(os.path.abspath(path))
    removed: list[str] = []
    try:
        listing = [entry for entry in os.scandir(directory) if entry.name.endswith(".tmp")]
    except OSError:
        return removed
    siblings = [entry.name for entry in listing]
    known: dict[str, bool] = {}
    candidates = [
        entry.name
        for entry in listing
        if entry.name.startswith(name)
        and _TMP_SUFFIX.fullmatch(entry.name, len(name))
        and entry.is_file(follow_symlinks=False)
    ]
    for candidate in candidates:
        stale = os.path.join(directory, candidate)
        try:
            fd = os.open(stale, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it
            os.close(fd)
            continue
        if not abandoned(stale, siblings, known):  # its group's anchor is locked: alive
            os.close(fd)
            continue
        try:
            os.unlink(stale)
            removed.append(stale)
        except OSError:
            pass  # renamed into place or removed meanwhile
        finally:
            os.close(fd)  # the lock goes with it
    return removed


def _check_directory(directory: str, path: str) -> None:
    """The error a save into ``directory`` would meet, naming the directory and ``path``
    (not the temporary file's name)."""
    try:
        if stat.S_ISDIR(os.stat(directory).st_mode):
            return
        code = errno.ENOTDIR
    except OSError as exc:
        code = exc.errno if exc.errno is not None else errno.EIO
    what = "no such directory" if code == errno.ENOENT else os.strerror(code)
    kind = {errno.ENOENT: FileNotFoundError, errno.ENOTDIR: NotADirectoryError}
    raise kind.get(code, OSError)(code, f"cannot save {path}: {what}", directory)


def check_writable(path: str, *, overwrite_readonly: bool = False) -> None:
    """Refuses to replace a read-only file at ``path`` (``PermissionError`` naming it).

    A file is read-only when it has no write bit at all, or when this (non-root) user may
    not write it. The mode bits are checked directly because root passes every access test.
    A missing file, or ``overwrite_readonly=True``, passes.

    Example:
        >>> import tempfile
        >>> target = os.path.join(tempfile.mkdtemp(), "x.bin")
        >>> open(target, "w").close(); os.chmod(target, 0o444)
        >>> check_writable(target)
        Traceback (most recent call last):
        ...
        PermissionError: [Errno 13] cannot save over a read-only file (mode 0o444); pass overwrite_readonly=True to replace it: '...x.bin'
        >>> check_writable(target, overwrite_readonly=True)
    """
    if overwrite_readonly:
        return
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        return
    no_write_bit = not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    if no_write_bit or (os.geteuid() != 0 and not os.access(path, os.W_OK)):
        raise PermissionError(
            errno.EACCES,
            f"cannot save over a read-only file (mode {oct(stat.S_IMODE(mode))}); "
            "pass overwrite_readonly=True to replace it",
            path,
        )


def _carry_attributes(fd: int, path: str) -> None:
    """Gives the new file (``fd``) the permission bits (and, as root, the owner) of the
    file it is about to replace at ``path``; nothing when there is none."""
    try:
        old = os.stat(path)
    except OSError:
        return
    if not stat.S_ISREG(old.st_mode):
        return
    os.fchmod(fd, stat.S_IMODE(old.st_mode))
    if os.geteuid() == 0:
        new = os.fstat(fd)
        if (new.st_uid, new.st_gid) != (old.st_uid, old.st_gid):
            os.fchown(fd, old.st_uid, old.st_gid)


def _create_locked(tmp_path: str) -> int | None:
    """Creates ``tmp_path`` (``FileExistsError`` if it exists) and takes its lock: the lock
    fd, or None when a cleaner removed it before the lock was taken."""
    # 0o666 less the umask, as open() gives a new file
    fd = os.open(tmp_path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a cleaner is looking at it
    except OSError as exc:
        if exc.errno not in _NO_FLOCK:
            os.close(fd)
            os.unlink(tmp_path)
            raise
        return fd  # no flock here: cleaners cannot lock it either, so keep it
    if os.fstat(fd).st_nlink:
        return fd
    os.close(fd)
    return None


def _locked_temporary(directory: str, name: str) -> tuple[str, int]:
    """Creates ``<name>.<random>.tmp`` and takes its lifetime lock: (path, lock fd)."""
    while True:
        tmp_path = os.path.join(directory, f"{name}.{secrets.token_hex(6)}.tmp")
        fd = _create_locked(tmp_path)
        if fd is not None:
            return tmp_path, fd
        # a cleaner removed it before we locked it: take another name


class TemporaryGroup:
    """Temporary files written together (the files of one multi-file commit) that one lock
    keeps alive: the first file created (the anchor) keeps its lock until committed or
    removed; the others (members) share its token and drop their own lock once durable,
    so the group holds one descriptor however many files it has (see the module).

    Example:
        >>> import tempfile
        >>> d, group = tempfile.mkdtemp(), TemporaryGroup()
        >>> a = AtomicFile(os.path.join(d, "a.bin"), group=group)
        >>> b = AtomicFile(os.path.join(d, "b.bin"), group=group)
        >>> a.tmp_path[-16:] == b.tmp_path[-16:], a.member, b.member
        (True, False, True)
        >>> b.abort(); a.abort()
    """

    def __init__(self) -> None:
        self.token: str | None = None
        self._lock = threading.Lock()

    def create(self, directory: str, name: str) -> tuple[str, int, bool]:
        """A new locked temporary for ``name``: (path, lock fd, whether it is a member)."""
        with self._lock:
            if self.token is None:
                tmp_path, fd = _locked_temporary(directory, name)
                self.token = tmp_path[-16:-4]
                return tmp_path, fd, False
            token = self.token
        tmp_path = os.path.join(directory, f"{name}.{token}.tmp")
        member: int | None = None
        with contextlib.suppress(FileExistsError):  # a name staged twice keeps its own lock
            member = _create_locked(tmp_path)
        if member is None:
            return (*_locked_temporary(directory, name), False)
        return tmp_path, member, True


class AtomicFile:
    """A temporary file that becomes ``path`` on :meth:`commit`, or vanishes on :meth:`abort`.

    Used as a context manager it commits on success and aborts on an exception.
    ``overwrite_readonly=True`` replaces a read-only file at ``path`` (refused otherwise, see
    :func:`check_writable`). :meth:`commit` may name another final path in the same
    directory: a multi-file commit (:mod:`fastckpt.io.commit_set`) picks the names late.

    ``spare`` names a spare file (:mod:`fastckpt.io.spare_files`) in the same directory to
    write over instead of a new file, cut to ``size`` bytes (the file's final size, which
    the caller then writes whole); without a spare there, a new file as usual.

    ``group`` makes it one of a :class:`TemporaryGroup`'s files: a member drops its lock
    (and holds no descriptor) once :meth:`make_durable` has closed it, the group's anchor
    keeping it alive; stale temporaries are then left to the group's own clean-up.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        direct: bool = True,
        overwrite_readonly: bool = False,
        spare: str | None = None,
        size: int | None = None,
        group: TemporaryGroup | None = None,
    ):
        self.path = os.path.abspath(os.fspath(path))
        self.overwrite_readonly = overwrite_readonly
        directory, name = os.path.split(self.path)
        if os.path.isdir(self.path):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", self.path)
        _check_directory(directory, self.path)
        check_writable(self.path, overwrite_readonly=overwrite_readonly)
        if group is None:  # a group's commit removes its kind's stale temporaries itself
            remove_stale_temporaries(self.path)
        if spare is not None and size is None:
            raise ValueError("spare= needs size=: the file is cut to the size then written whole")
        taken = None if spare is None else spare_files.take(spare, directory, name)
        self.reused = taken is not None
        self.member = False
        try:
            if taken is not None:
                self.tmp_path, self._lock_fd = taken
            elif group is not None:
                self.tmp_path, self._lock_fd, self.member = group.create(directory, name)
            else:
                self.tmp_path, self._lock_fd = _locked_temporary(directory, name)
        except OSError as exc:  # name the user's path, not the temporary one
            raise type(exc)(
                exc.errno, f"cannot save {self.path}: {exc.strerror}", directory
            ) from exc
        try:
            self.file = File(self.tmp_path, write=True, direct=direct)
            if taken is not None:
                os.ftruncate(self.file.fd, size)  # type: ignore[arg-type]  # (checked above)
        except BaseException:
            self._release()
            raise
        self._done = False

    def _release(self) -> None:
        """Removes the temporary file (if still there) and drops the lifetime lock."""
        try:
            if self.reused:  # a spare's kept mapping would hold the deleted file's memory
                kept_mappings.release_descriptor(self._lock_fd)
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass
        finally:
            self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def reserve(self, nbytes: int) -> bool:
        """Allocates the file's blocks up front (where the file system can), so parallel
        out-of-order direct writes still give one contiguous file that later reads stream
        from, and a full disk fails here before any data is written (``OSError(ENOSPC)``).
        Returns whether the blocks are allocated (False where the file system cannot)."""
        return bool(_C.preallocate(self.file.fd, nbytes, self.tmp_path))

    def make_durable(self) -> None:
        """fsyncs and closes the temporary file; it stays locked (a group's member: kept
        alive by its anchor, holding no descriptor) and unnamed until :meth:`commit` (or
        removed by :meth:`abort`)."""
        if self.file.fd >= 0:
            self.file.fsync()
            self.file.close()
        if self.member:
            self._unlock()

    def commit(self, path: str | None = None, *, sync_directory: bool = True) -> None:
        """fsync, rename over the final path (``path``, default the one given at creation,
        in the same directory), fsync the directory (unless ``sync_directory=False``: the
        caller syncs it once for several files)."""
        target = self.path if path is None else os.path.abspath(path)
        try:
            if os.path.dirname(target) != os.path.dirname(self.tmp_path):
                raise ValueError(f"{target}: not in the directory of {self.tmp_path}")
            check_writable(target, overwrite_readonly=self.overwrite_readonly)
            self.make_durable()
            self._carry_attributes(target)
            replaced = released_files.hold_replaced(target)  # its blocks freed off this path
            try:
                os.replace(self.tmp_path, target)
            finally:
                released_files.release_later(replaced)
        except BaseException:
            self.abort()
            raise
        self.path = target
        self._done = True
        self._unlock()  # held until the rename: no cleaner removes a file in flight
        if sync_directory:
            fsync_directory(os.path.dirname(self.path))

    def _carry_attributes(self, target: str) -> None:
        """:func:`_carry_attributes` through the lock's descriptor, or (a closed member)
        one opened for it."""
        if self._lock_fd >= 0:
            _carry_attributes(self._lock_fd, target)
            return
        fd = os.open(self.tmp_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _carry_attributes(fd, target)
        finally:
            os.close(fd)

    def abort(self) -> None:
        """Closes and removes the temporary file; the final path is untouched."""
        if self._done:
            return
        self._done = True
        self.file.close()
        self._release()

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_atomically(
    path: str | os.PathLike[str], data: bytes, *, overwrite_readonly: bool = False
) -> None:
    """Writes a small file (an index, a metadata file) by the commit protocol: it appears
    whole and durable at ``path``, or the old one stays.

    Example:
        >>> import pathlib, tempfile
        >>> target = pathlib.Path(tempfile.mkdtemp(), "index.json")
        >>> write_atomically(target, b"{}")
        >>> target.read_bytes()
        b'{}'
    """
    with AtomicFile(path, direct=False, overwrite_readonly=overwrite_readonly) as out:
        out.file.pwrite_all(data, 0)
