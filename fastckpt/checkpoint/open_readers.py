"""A bounded set of open readers, for checkpoints made of many files.

A sharded directory or a distributed checkpoint can hold thousands of files; opening them
all at once meets the limit on open files (1024 by default on Linux: ``EMFILE``). A
:class:`ReaderCache` keeps at most ``limit`` of them open (``fastckpt.config.open_files``:
64, or ``FASTCKPT_OPEN_FILES``) and opens the others when a read needs them, closing the
least recently used one that no read is using. Readers in use are never closed, so the
bound is ``limit`` plus the reads running at once.

A file opened again must be the file opened first: its header was read then, and another
file's bytes under the same name would be read by the old header. A local file replaced
since (another inode) raises ``FileNotFoundError`` naming it, as a file removed since does.

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
import errno
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from fastckpt.checkpoint.header_view import HeaderView
from fastckpt.config import open_files

__all__ = ["HeaderOnly", "ReaderCache"]

T = TypeVar("T")


def _identity(reader: Any) -> tuple[int, int] | None:
    """(device, inode) of a local reader's file; None for a URL (nothing to compare)."""
    storage = getattr(reader, "storage", None)
    if storage is None or getattr(storage, "ranged", True):
        return None
    return _file_identity(storage.local_file().fd)


def _file_identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


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
            :func:`fastckpt.config.open_files`).
    """

    def __init__(self, opener: Callable[[str], Any], limit: int | None = None):
        self._opener = opener
        self.limit = open_files(limit)
        self._open: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._users: dict[str, int] = {}
        self._identity: dict[str, tuple[int, int] | None] = {}
        self._lock = threading.Lock()
        self._bytes_closed = 0  # bytes_read of readers closed so far
        self._closed = False

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
        try:
            yield reader
        finally:
            with self._lock:
                self._users[path] -= 1
            self._evict()

    def call(self, path: str, work: Callable[[Any], T]) -> T:
        """``work(reader)`` on the open reader of ``path``."""
        with self.lease(path) as reader:
            return work(reader)

    def _acquire(self, path: str) -> Any:
        with self._lock:
            reader = self._take(path)
        if reader is not None:
            return reader
        # Opened outside the lock, so that threads reading different files open them in
        # parallel; two threads opening one file keep the first and close the other.
        fresh = self._reopen(path)
        with self._lock:
            reader = self._take(path)
            if reader is None:
                self._open[path] = reader = fresh
                self._users[path] = self._users.get(path, 0) + 1
                fresh = None
        if fresh is not None:
            fresh.close()
        return reader

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
        except BaseException:
            reader.close()
            raise
        if known != identity:
            reader.close()
            raise FileNotFoundError(
                errno.ENOENT,
                "replaced by another file since the checkpoint was opened; open it again",
                path,
            )
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

    def close(self) -> None:
        """Closes every open reader; later leases raise ``ValueError``."""
        with self._lock:
            self._closed = True
            readers = list(self._open.values())
            self._open.clear()
        for reader in readers:
            self._retire(reader)
