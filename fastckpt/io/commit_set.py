"""The atomic, durable commit of a checkpoint made of several files in one directory.

:mod:`fastckpt.io.commit` makes one file appear whole or not at all. A checkpoint of several
files (Hugging Face shards plus their index, a step directory completed by a marker, the
files of a distributed checkpoint) needs more: a reader must find the old set or the new
one, never a mix, and a failed or killed save must leave the old set loadable. The protocol:

1. **Stage.** Every new file is written as ``<hint>.<token>.tmp`` (:class:`AtomicFile`), a
   name no reader follows, fsynced and closed. The set's files form one
   :class:`~fastckpt.io.commit.TemporaryGroup`: the first keeps its ``flock`` until it is
   published, which keeps every file of the group alive (a cleaner removes a temporary only
   when no file of its group is locked); the others hold no descriptor once written. So a
   set of any number of files holds one descriptor, plus those of the files being written.
2. **Publish,** under an exclusive ``flock`` on the directory itself (no lock file is left
   in it): read which names the currently published set references; give each staged file
   a final name that set does not reference (the caller's choice, see below) and rename it
   there; fsync the directory; then take the ONE atomic step that publishes the new set,
   written last: the index or marker, written by rename (:func:`write_atomically`).
3. **Remove the old files,** still under the lock: every file of the set's kind that the
   now published set does not reference, and every temporary ``*.<12 hex>.tmp`` whose
   writer is gone (its lock is free). Files of live writers are locked and stay.

A failure before the publish step removes the new files (staged or already renamed) and
leaves the old set unchanged; a kill at any point leaves the old or the new set complete,
plus unreferenced files that the next commit into the directory removes.

**Concurrent writers** stage in parallel and publish one at a time: each publish reads the
set published just before it, so the later publisher wins and both report success, as two
``torch.save`` calls to one path do. The directory then holds one complete set, the later
one; the earlier writer's files are removed by the later one's step 3. A writer never
deletes files that the published set references, so no publisher can break another's set.

**File names.** The caller picks final names from the names the published set references
(:func:`fresh_name` gives one no set has used). A name the published set references is
never written again until another set is published, so a reader that follows the current
index or marker finds the files it names unchanged until it finishes, unless they are
removed (then it gets ``FileNotFoundError``, never another save's bytes). A slow reader
that read an index two publishes ago can still meet new bytes under a name reused since;
callers that reuse names (Hugging Face's conventional ones) reuse them only into a
directory with no published set, so that cannot happen either.

Object stores (fsspec URLs) have no rename and no directory lock: there the new files are
written under names the published index does not reference, the index PUT is the atomic
step, and the files that the old index referenced are deleted after it. Concurrent writers
of one URL are not serialized (the last index PUT wins; the loser's files may leak), and a
killed save leaves its new objects behind until removed by hand.

Example:
    >>> import json, tempfile
    >>> d = tempfile.mkdtemp()
    >>> def referenced():
    ...     try:
    ...         with open(os.path.join(d, "MARKER")) as f:
    ...             return set(json.load(f))
    ...     except FileNotFoundError:
    ...         return set()
    >>> def publish(names):
    ...     write_atomically(os.path.join(d, "MARKER"), json.dumps(names).encode())
    >>> with CommitSet(d) as files:
    ...     out = files.stage("part.bin")
    ...     _ = os.pwrite(out.file.fd, b"data", 0)
    ...     _ = files.publish(lambda taken: [fresh_name("part", ".bin", taken)], publish,
    ...                       referenced, lambda name: name.startswith("part"))
    >>> import pathlib
    >>> names = referenced(); len(names), pathlib.Path(d, names.pop()).read_bytes()
    (1, b'data')
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import threading
from collections.abc import Callable, Collection, Iterator, Set
from typing import Any

from fastckpt.io.commit import (
    _NO_FLOCK,
    AtomicFile,
    TemporaryGroup,
    abandoned,
    check_writable,
    fsync_directory,
    write_atomically,
)
from fastckpt.io.files import lock_if_free

__all__ = [
    "CommitSet",
    "directory_lock",
    "fresh_name",
    "remove_unreferenced",
    "write_atomically",
]

_TEMPORARY = re.compile(r"(.+)\.[0-9a-f]{12}\.tmp")


@contextlib.contextmanager
def directory_lock(directory: str) -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``directory`` itself: publishers of one directory
    take turns. Waits while another process publishes (a short step: renames, one small
    write, unlinks). On a file system without ``flock`` it holds nothing.

    Example:
        >>> import tempfile
        >>> with directory_lock(tempfile.mkdtemp()):
        ...     pass
    """
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
        yield
    finally:
        os.close(fd)  # the lock goes with it


def fresh_name(stem: str, suffix: str, taken: Collection[str]) -> str:
    """``<stem>-<8 random hex><suffix>``, a name not in ``taken`` that no earlier set used.

    Example:
        >>> name = fresh_name("model-00001-of-00002", ".safetensors", set())
        >>> name.startswith("model-00001-of-00002-") and name.endswith(".safetensors")
        True
    """
    while True:
        name = f"{stem}-{secrets.token_hex(4)}{suffix}"
        if name not in taken:
            return name


def _remove_if_abandoned(path: str, siblings: list[str], known: dict[str, bool]) -> bool:
    """Removes the temporary file ``path`` if no live writer holds its lock or its group's
    (``siblings``: the names in its directory; ``known``: the groups' answers so far);
    whether it did."""
    fd = lock_if_free(path)
    if fd is None:
        return False
    try:
        if not abandoned(path, siblings, known):
            return False
        os.unlink(path)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def remove_unreferenced(
    directory: str, belongs: Callable[[str], bool], referenced: Set[str]
) -> list[str]:
    """Removes the files of ``directory`` that ``belongs`` claims for the set's kind and
    ``referenced`` does not name, and the temporaries (``<name>.<12 hex>.tmp`` with
    ``belongs(name)``) of writers that are gone. Returns the names removed. Call it under
    :func:`directory_lock`, after the publish step.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> for name in ("a.bin", "b.bin", "b.bin.0123456789ab.tmp", "notes.txt"):
        ...     open(os.path.join(d, name), "w").close()
        >>> sorted(remove_unreferenced(d, lambda n: n.endswith(".bin"), {"a.bin"}))
        ['b.bin', 'b.bin.0123456789ab.tmp']
    """
    removed = []
    with os.scandir(directory) as listing:
        entries = list(listing)
    siblings = [entry.name for entry in entries if entry.name.endswith(".tmp")]
    known: dict[str, bool] = {}
    for entry in entries:
        name = entry.name
        if not entry.is_file(follow_symlinks=False):
            continue
        temporary = _TEMPORARY.fullmatch(name)
        if temporary is not None:
            if belongs(temporary.group(1)) and _remove_if_abandoned(entry.path, siblings, known):
                removed.append(name)
            continue
        if belongs(name) and name not in referenced:
            try:
                os.unlink(entry.path)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


class CommitSet:
    """New files of one checkpoint, staged, then published together (see the module).

    Use as a context manager: files still staged when it exits (an error, or no
    :meth:`publish`) are removed.

    ``overwrite_readonly=True`` lets a publish replace or remove read-only files of the
    published set; otherwise it raises ``PermissionError`` naming the first one, before any
    change (see :func:`fastckpt.io.commit.check_writable`).
    """

    def __init__(self, directory: str | os.PathLike[str], *, overwrite_readonly: bool = False):
        self.directory = os.path.abspath(os.fspath(directory))
        self.overwrite_readonly = overwrite_readonly
        self.staged: list[AtomicFile] = []
        self.published: list[str] = []
        self._group = TemporaryGroup()
        self._position: dict[AtomicFile, int] = {}
        self._lock = threading.Lock()

    def stage(self, hint: str, *, direct: bool = True, position: int | None = None) -> AtomicFile:
        """A new file, written by the caller into ``.file``; its temporary name is
        ``<hint>.<token>.tmp``, and its final name is chosen at :meth:`publish`.

        Call the returned file's ``make_durable()`` once it is written: it is then closed,
        and holds no descriptor until published. Files may be staged from several threads;
        ``position`` then gives each its place in the set (staging order otherwise).
        """
        # The hint is only a name for the temporary: read-only files are checked at publish,
        # among the files the new set replaces.
        out = AtomicFile(
            os.path.join(self.directory, hint),
            direct=direct,
            overwrite_readonly=True,
            group=self._group,
        )
        with self._lock:
            self._position[out] = len(self.staged) if position is None else position
            self.staged.append(out)
        return out

    def publish(
        self,
        final_names: Callable[[Set[str]], list[str]],
        publish_step: Callable[[list[str]], None],
        referenced: Callable[[], Set[str]],
        belongs: Callable[[str], bool],
    ) -> list[str]:
        """Makes the staged files durable, then, under the directory lock: names them,
        takes the publish step, removes the old set's files. Returns the final names.

        Args:
            final_names: given the names the published set references, the final name of
                each staged file, in staging order. A name the published set references may
                only be given when renaming over it is itself the publish step (one file).
            publish_step: the one atomic step that publishes the set (writes the index or
                marker with :func:`write_atomically`, or removes the one that would
                otherwise win), given the final names.
            referenced: the names the published set references now (read from the index).
            belongs: whether a file name is of this kind of set (removable once the
                published set does not reference it).
        """
        self.staged.sort(key=self._position.__getitem__)
        for out in self.staged:
            out.make_durable()  # the slow part, outside the lock
        with directory_lock(self.directory):
            current = referenced()
            for name in sorted(current):  # each is replaced or removed by this publish
                check_writable(
                    os.path.join(self.directory, name), overwrite_readonly=self.overwrite_readonly
                )
            names = final_names(current)
            if len(names) != len(self.staged):
                raise ValueError(f"{len(names)} names for {len(self.staged)} staged files")
            renamed: list[str] = []
            # The group's anchor (the one file still locked) goes last: its lock keeps the
            # files not yet renamed alive
            order = sorted(zip(self.staged, names), key=lambda pair: not pair[0].member)
            try:
                for out, name in order:
                    out.commit(os.path.join(self.directory, name), sync_directory=False)
                    renamed.append(name)
                fsync_directory(self.directory)
                publish_step(names)
            except BaseException:
                self._remove(renamed, referenced)
                raise
            finally:
                self.abort()
            self.published = names
            self.remove_unreferenced(belongs, referenced())
        return names

    def remove_unreferenced(self, belongs: Callable[[str], bool], keep: Set[str]) -> list[str]:
        """:func:`remove_unreferenced` in this directory, then an fsync of it."""
        removed = remove_unreferenced(self.directory, belongs, keep)
        if removed:
            fsync_directory(self.directory)
        return removed

    def _remove(self, names: list[str], referenced: Callable[[], Set[str]]) -> None:
        """Removes new files renamed before a failure, unless the published set names them."""
        try:
            keep = referenced()
        except (OSError, ValueError):
            return  # cannot tell: leave them for the next commit's clean-up
        for name in names:
            if name not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.directory, name))

    def abort(self) -> None:
        """Removes every file still staged (the group's anchor last: its lock keeps the
        others from a cleaner until they are gone)."""
        for out in sorted(self.staged, key=lambda out: not out.member):
            out.abort()
        self.staged = []

    def __enter__(self) -> CommitSet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.abort()
