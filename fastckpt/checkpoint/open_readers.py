"""A bounded set of open readers, for checkpoints made of many files.

A sharded directory or a distributed checkpoint can hold thousands of files; opening them
all at once meets the limit on open files (1024 by default on Linux: ``EMFILE``). A
:class:`ReaderCache` keeps at most ``limit`` of them open (``fastckpt.config.open_files``:
64, or ``FASTCKPT_OPEN_FILES``) and opens the others when a read needs them, closing the
least recently used one that no read is using. Readers in use are never closed: a read of
another file waits until one is free, so at most ``limit`` are open (a thread that already
holds a reader opens another without waiting, so nested reads cannot deadlock).

The bound also follows the process's soft limit on open files (``RLIMIT_NOFILE``, read at
each use): at most ``(soft - headroom) / 2`` readers, where the headroom (a quarter of the
limit, at least 12) is left for the engine's own descriptors and other code.

A file opened again must be the file opened first: its header was read then, and another
file's bytes under the same name would be read by the old header. So a reader records what
cannot repeat of its file when it is first opened (device, inode, size, modification and
status-change times, and its header's identity: :mod:`~fastckpt.checkpoint.content_identity`)
and checks it when it opens the file again. A file removed, replaced (even by one that got
the same inode back) or rewritten in place since raises ``FileNotFoundError`` naming it and
what changed: open the checkpoint again to read it as it is now.

Example:
    >>> import os, tempfile, torch
    >>> from fastckpt.checkpoint.read import open_checkpoint
    >>> from fastckpt.checkpoint.save import save
    >>> d = tempfile.mkdtemp()
    >>> paths = [os.path.join(d, f"{i}.safetensors") for i in range(3)]
    >>> for i, p in enumerate(paths):
    ...     save({"x": torch.full((2,), float(i))}, p)
    >>> cache = ReaderCache(open_checkpoint, limit=1)
    >>> [cache.call(p, lambda r: r.get_tensor("x")[0].item()) for p in paths]
    [0.0, 1.0, 2.0]
    >>> cache.open_count
    1
    >>> cache.close()
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from fastckpt.checkpoint import content_identity
from fastckpt.checkpoint.header_view import HeaderView
from fastckpt.config import open_files

try:
    import resource
except ImportError:  # not a POSIX system: no limit to follow
    resource = None  # type: ignore[assignment]

__all__ = ["HeaderOnly", "ReaderCache", "descriptor_bound"]

T = TypeVar("T")

_WAITED = object()  # what _make_room returns once it waited

#: Descriptors one open reader may hold: its file buffered and with O_DIRECT.
DESCRIPTORS_PER_READER = 2
#: Descriptors of the soft limit left to the engine's own (rings, event files) and to other
#: code: a quarter of the limit, at least this many.
MIN_HEADROOM = 12


def descriptor_bound() -> int | None:
    """How many readers fit the process's soft limit on open files now, leaving headroom
    for the engine and other code; None when the limit is unlimited.

    Example:
        >>> import resource
        >>> soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        >>> resource.setrlimit(resource.RLIMIT_NOFILE, (20, hard))
        >>> descriptor_bound()
        4
        >>> resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    """
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    headroom = max(MIN_HEADROOM, soft // 4)
    return max(1, (soft - headroom) // DESCRIPTORS_PER_READER)


@dataclasses.dataclass(frozen=True)
class FileIdentity:
    """What cannot repeat of a file a reader opened: ``stat`` (device, inode, size,
    modification and status-change times in ns; None for a URL) and ``content`` (its
    header's :mod:`~fastckpt.checkpoint.content_identity`; None when the reader has no
    header of its own)."""

    stat: tuple[int, int, int, int, int] | None
    content: tuple[str, str] | None


def _identity(reader: Any) -> FileIdentity:
    """The identity of the file a reader opened (an incremental file's own file)."""
    top = getattr(reader, "top", reader)
    storage = getattr(top, "storage", None)
    stat = None
    if storage is not None and not getattr(storage, "ranged", True):
        stat = _file_identity(storage.local_file().fd)
    has_header = hasattr(top, "header") and hasattr(top, "meta")
    return FileIdentity(stat, content_identity.of_view(top) if has_header else None)


def _file_identity(fd: int) -> tuple[int, int, int, int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _changes(first: FileIdentity, now: FileIdentity) -> str | None:
    """How the file at a path differs from the one first opened there, or None."""
    if first.stat is not None and now.stat is not None:
        if first.stat[:2] != now.stat[:2]:
            return f"replaced by another file (inode {now.stat[1]}, was {first.stat[1]})"
        what = [
            label
            for label, a, b in zip(
                ("size", "modification time", "status change time"), first.stat[2:], now.stat[2:]
            )
            if a != b
        ]
        if what:
            return f"changed in place (its {', '.join(what)} differ)"
    if first.content != now.content:
        kind = first.content[0] if first.content is not None else "header"
        table = "checksums" if kind == "checksums" else "header"
        return f"replaced or changed (its header's {table} differ)"
    return None


class HeaderOnly(HeaderView):
    """What a file's header says (names, dtypes, shapes, metadata), kept after the file
    itself is closed: a reader of many files answers from these without opening any.
    ``key`` is the path its :class:`ReaderCache` opens it by.

    Example:
        >>> import os, tempfile, torch
        >>> from fastckpt.checkpoint.read import open_checkpoint
        >>> from fastckpt.checkpoint.save import save
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> save({"w": torch.zeros(3)}, path)
        >>> with open_checkpoint(path) as r:
        ...     header = HeaderOnly(r, path)
        >>> header.info("w").shape
        (3,)
    """

    def __init__(self, reader: Any, key: str):
        self.key = key
        self.path = reader.path
        self.header, self.meta, self.compressed = reader.header, reader.meta, reader.compressed

    def _check_open(self) -> None:
        pass  # nothing is open: the header is in memory

    @property
    def aliases(self) -> dict[str, str]:
        return dict(self.meta.aliases)

    @property
    def structure(self) -> Any:
        return self.meta.tree


class ReaderCache:
    """Readers of many files, at most ``limit`` open at once (see the module).

    Args:
        opener: opens the file at a path (``fastckpt.open``, a URL reader, ...); what it
            returns has ``close()`` and ``bytes_read``.
        limit: the most readers kept open when no read uses them (default
            :func:`fastckpt.config.open_files`); lowered to what the soft limit on open
            files leaves (:func:`descriptor_bound`), checked at each use.
    """

    def __init__(self, opener: Callable[[str], Any], limit: int | None = None):
        self._opener = opener
        self._configured = open_files(limit)
        self._open: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._users: dict[str, int] = {}
        self._opening = 0  # files being opened now, outside the lock
        self._held = threading.local()  # leases this thread holds (it never waits then)
        self._identity: dict[str, FileIdentity] = {}
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a lease ended, or a reader closed
        self._bytes_closed = 0  # bytes_read of readers closed so far
        self._closed = False

    @property
    def limit(self) -> int:
        """The most readers open at once now: the configured number, or fewer where the
        soft limit on open files (read now: it may have changed) leaves fewer."""
        bound = descriptor_bound()
        return self._configured if bound is None else min(self._configured, bound)

    @property
    def open_count(self) -> int:
        """How many readers are open now."""
        with self._lock:
            return len(self._open)

    @property
    def bytes_read(self) -> int:
        """Data bytes read by every reader this cache opened."""
        with self._lock:
            return self._bytes_closed + sum(r.bytes_read for r in self._open.values())

    def adopt(self, path: str, reader: Any) -> None:
        """Takes a reader opened by the caller (who read its header) into the cache; it may
        be closed at once if more than ``limit`` are open."""
        identity = _identity(reader)
        with self._lock:
            self._identity.setdefault(path, identity)
            self._open[path] = reader
            self._open.move_to_end(path)
        self._evict()

    @contextlib.contextmanager
    def lease(self, path: str) -> Iterator[Any]:
        """The open reader of ``path`` (opened now if it is not), kept open until the
        ``with`` block ends."""
        reader = self._acquire(path)
        self._held.count = getattr(self._held, "count", 0) + 1
        try:
            yield reader
        finally:
            self._held.count -= 1
            with self._lock:
                self._users[path] -= 1
                self._freed.notify_all()
            self._evict()

    def call(self, path: str, work: Callable[[Any], T]) -> T:
        """``work(reader)`` on the open reader of ``path``."""
        with self.lease(path) as reader:
            return work(reader)

    def _acquire(self, path: str) -> Any:
        while True:
            with self._lock:
                reader = self._take(path)
                if reader is not None:
                    return reader
                victim = self._make_room()
                if victim is None:
                    self._opening += 1
                    break
            if victim is not _WAITED:
                self._retire(victim)  # closed before the next file opens: the bound holds
        # Opened outside the lock, so that threads reading different files open them in
        # parallel; two threads opening one file keep the first and close the other.
        try:
            fresh = self._reopen(path)
        except BaseException:
            with self._lock:
                self._opening -= 1
                self._freed.notify_all()
            raise
        try:
            with self._lock:  # one step, so no other thread sees room it does not have
                self._opening -= 1
                self._freed.notify_all()
                reader = self._take(path)
                if reader is None:
                    self._open[path] = reader = fresh
                    self._users[path] = self._users.get(path, 0) + 1
                    fresh = None
        finally:
            if fresh is not None:
                fresh.close()
        return reader

    def _make_room(self) -> Any:
        """Under the lock, before a file is opened: None when there is room for it (or this
        thread holds a reader already, and must not wait on itself); else the least
        recently used reader no read uses, taken out to be closed; else waits until a lease
        ends and returns ``_WAITED``."""
        holding: int = getattr(self._held, "count", 0)
        if holding or len(self._open) + self._opening < self.limit:
            return None
        for path in self._open:  # least recently used first
            if self._users.get(path, 0) == 0:
                return self._open.pop(path)
        if not self._opening and not self._open:
            return None  # nothing to wait for
        self._freed.wait()
        return _WAITED

    def _take(self, path: str) -> Any:
        """The open reader of ``path``, now in use (or None); called under the lock."""
        if self._closed:
            raise ValueError(f"{path}: the reader is closed")
        reader = self._open.get(path)
        if reader is not None:
            self._open.move_to_end(path)
            self._users[path] = self._users.get(path, 0) + 1
        return reader

    def _reopen(self, path: str) -> Any:
        """Opens ``path`` again, checking it is still the file first opened."""
        reader = self._opener(path)
        try:
            identity = _identity(reader)
            with self._lock:
                known = self._identity.setdefault(path, identity)
            changed = _changes(known, identity)
            if changed is not None:
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"{changed} since the checkpoint was opened, so what was read of it then "
                    "no longer describes it; open the checkpoint again to read it as it is now",
                    path,
                )
        except BaseException:
            reader.close()
            raise
        return reader

    def _evict(self) -> None:
        """Closes the least recently used readers no read uses, down to ``limit`` open."""
        victims = []
        with self._lock:
            spare = len(self._open) - self.limit
            if spare <= 0:  # the common case: no walk over the open readers
                return
            for path in self._open:  # least recently used first
                if self._users.get(path, 0) == 0:
                    victims.append(path)
                    if len(victims) == spare:
                        break
            victims = [self._open.pop(path) for path in victims]
        for reader in victims:  # outside the lock: close() waits for a prefetch in flight
            self._retire(reader)

    def _retire(self, reader: Any) -> None:
        nbytes = reader.bytes_read
        reader.close()
        with self._lock:
            self._bytes_closed += nbytes
            self._freed.notify_all()

    def close(self) -> None:
        """Closes every open reader; later leases raise ``ValueError``."""
        with self._lock:
            self._closed = True
            readers = list(self._open.values())
            self._open.clear()
        for reader in readers:
            self._retire(reader)
