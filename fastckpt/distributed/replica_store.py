"""Where a node keeps its peers' replicas, on disk in its own memory (a fast tier, /dev/shm).

Layout under the store's directory::

    from-rank-00003/step-000000000007/<the files of rank 3's step 7>
    from-rank-00003/step-000000000007/REPLICA   # JSON: step, rank, node, file sizes
    .incoming-<random>/                         # a replica being received
    .landing-<random>/                          # a step being recovered into a fast tier

A replica is received into ``.incoming-<random>``; its ``REPLICA`` marker is written last
(temporary name, then rename), and only then is the directory renamed to its final name.
So a replica cut short (its sender or this node killed mid-transfer) is never listed: it
has no final name, and a final name without a marker whose sizes match the files is
ignored too. The store keeps each source rank's last complete replica and removes the
others once a new one is complete. Leftover ``.incoming-``/``.landing-`` directories
of a killed process are removed when a store is opened.

A replica is data from elsewhere, and the store's directory is writable by others: nothing
in it is followed through a link. Replicas are opened one level at a time with
``O_NOFOLLOW`` (``dir_fd=``); a link where a folder of the store belongs is renamed aside
(the link itself) and reported; a replica whose files are not regular files of their own is
not listed; a folder holding anything fastckpt did not write is renamed aside, not emptied.

Example:
    >>> import os, tempfile
    >>> store = ReplicaStore(tempfile.mkdtemp())
    >>> incoming = store.incoming()
    >>> with open(os.path.join(incoming, "a.bin"), "wb") as f:
    ...     _ = f.write(b"xyz")
    >>> store.held()  # nothing complete yet
    {}
    >>> store.commit(incoming, {"step": 7, "rank": 3, "node": 1, "files": [["a.bin", 3]]})
    >>> store.held()
    {3: [7]}
    >>> [os.path.basename(p) for _, p in store.files(3, 7)]
    ['a.bin']
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fastckpt.checkpoint.read import CheckpointReader
from fastckpt.errors import ChecksumError, FastCkptError
from fastckpt.storage import to_local

__all__ = [
    "MARKER",
    "ReplicaStore",
    "identity",
    "plain_name",
    "remove_own_dir",
    "set_aside_link",
    "share_identity",
    "verify",
    "verify_share",
]

_log = logging.getLogger("fastckpt")

#: The marker written last into a complete replica.
MARKER = "REPLICA"
_SOURCE = re.compile(r"from-rank-(\d{5})")
_STEP = re.compile(r"step-(\d{12})")


class ReplicaStore:
    """The replicas one rank holds for other ranks (see the module's description).

    Args:
        directory: the store's directory (created if missing), normally inside the node's
            fast tier so that losing the node loses it too.
    """

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = os.path.abspath(os.fspath(directory))
        _own_dir(self.directory, create=True)
        for name in os.listdir(self.directory):
            if name.startswith((".incoming-", ".landing-")):
                remove_own_dir(os.path.join(self.directory, name))

    def incoming(self) -> str:
        """A fresh directory to receive a replica into (never listed until committed)."""
        return tempfile.mkdtemp(prefix=".incoming-", dir=self.directory)

    def landing(self) -> str:
        """A fresh directory to assemble a recovered step in, on the store's file system
        (renamed into the fast tier once complete)."""
        return tempfile.mkdtemp(prefix=".landing-", dir=self.directory)

    def commit(self, incoming: str, info: dict[str, Any]) -> None:
        """Marks the replica received in ``incoming`` complete (``info``: step, rank, node,
        files as ``[name, size]``): its marker last, then the rename to its final name;
        then drops the source's other replicas."""
        step, rank = int(info["step"]), int(info["rank"])
        _write_atomically(os.path.join(incoming, MARKER), json.dumps(info).encode())
        source = os.path.join(self.directory, f"from-rank-{rank:05d}")
        _own_dir(source, create=True)  # a link planted there is set aside, never followed
        final = os.path.join(source, f"step-{step:012d}")
        if os.path.lexists(final):  # the same step replicated again (a restarted run)
            if _is_own_dir(final):
                remove_own_dir(final)
            else:
                set_aside_link(final)
        os.rename(incoming, final)
        for old in self._steps_of(source):  # the last received is the run's newest, even
            if old != step:  # when a restore went back to an older step number
                remove_own_dir(os.path.join(source, f"step-{old:012d}"))

    def held(self) -> dict[int, list[int]]:
        """The complete replicas held: source rank -> steps, ascending."""
        found: dict[int, list[int]] = {}
        for name in sorted(os.listdir(self.directory)):
            match = _SOURCE.fullmatch(name)
            path = os.path.join(self.directory, name)
            if match is None or not _is_own_dir(path):
                continue
            rank = int(match.group(1))
            steps = [s for s in self._steps_of(path) if self._complete(rank, s)]
            if steps:
                found[rank] = steps
        return found

    def held_identities(self) -> dict[int, dict[int, tuple[str | None, str]]]:
        """The complete replicas held, each with its content's identity read from its own
        file (:func:`identity`; None where it cannot be read: such a replica is never used)
        and the run its marker names: source rank -> step -> (identity, run)."""
        found: dict[int, dict[int, tuple[str | None, str]]] = {}
        for rank, steps in self.held().items():
            for step in steps:
                try:
                    info, fds = self.open_replica(rank, step)
                except (OSError, ValueError) as exc:
                    _log.warning("replica of rank %d's step %d is not used: %s", rank, step, exc)
                    continue
                try:
                    found.setdefault(rank, {})[step] = (
                        _identity_of_share(info, fds),
                        str(info.get("run", "")),
                    )
                finally:
                    for fd in fds:
                        os.close(fd)
        return found

    def open_replica(self, rank: int, step: int) -> tuple[dict[str, Any], list[int]]:
        """The marker of rank ``rank``'s replica of ``step`` and its files, opened (in the
        marker's order) without following a link anywhere below the store's directory.

        Raises:
            OSError: a part is a link (``ELOOP``) or not what a replica holds, naming it.
        """
        fds: list[int] = []
        chain = [self.directory, f"from-rank-{rank:05d}", f"step-{step:012d}"]
        directory = _open_dir_chain(chain)
        try:
            info = json.loads(_read_file_at(directory, MARKER, self._dir(rank, step)))
            for name, size in info["files"]:
                fd = _open_file_at(directory, plain_name(name), self._dir(rank, step))
                fds.append(fd)
                if os.fstat(fd).st_size != size:
                    raise OSError(
                        errno.EIO,
                        f"replica file has {os.fstat(fd).st_size} bytes, its marker says {size}",
                        os.path.join(self._dir(rank, step), name),
                    )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        finally:
            os.close(directory)
        return dict(info), fds

    def discard(self, rank: int, step: int, why: str) -> None:
        """Removes rank ``rank``'s replica of ``step`` (logged with ``why``): a replica of a
        step that the ranks set aside must never be restored in its place later."""
        path = self._dir(rank, step)
        if _is_own_dir(path):
            remove_own_dir(path)
            _log.info("replica of rank %d's step %d removed: %s", rank, step, why)

    def prune(self, sources: Sequence[int]) -> None:
        """Keeps only the newest complete replica of each rank of ``sources`` (the ranks this
        rank holds copies for); replicas of other ranks (an earlier run's placement) go."""
        for rank, steps in self.held().items():
            for step in steps:
                if rank not in sources or step != steps[-1]:
                    self.discard(rank, step, "beyond the replicas this rank keeps")

    def info(self, rank: int, step: int) -> dict[str, Any]:
        """The marker of rank ``rank``'s replica of ``step``."""
        info, fds = self.open_replica(rank, step)
        for fd in fds:
            os.close(fd)
        return info

    def files(self, rank: int, step: int) -> list[tuple[str, str]]:
        """``(name, path)`` of every file of a complete replica, in the order sent."""
        directory = self._dir(rank, step)
        return [(name, os.path.join(directory, name)) for name, _ in self.info(rank, step)["files"]]

    def _dir(self, rank: int, step: int) -> str:
        return os.path.join(self.directory, f"from-rank-{rank:05d}", f"step-{step:012d}")

    @staticmethod
    def _steps_of(source: str) -> list[int]:
        steps = []
        for name in os.listdir(source):
            match = _STEP.fullmatch(name)
            if match is not None and _is_own_dir(os.path.join(source, name)):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def _complete(self, rank: int, step: int) -> bool:
        """Whether the replica has its marker and every file, each a regular file of its own
        (no link, no second name) at its recorded size."""
        try:
            _, fds = self.open_replica(rank, step)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        for fd in fds:
            os.close(fd)
        return True


def plain_name(name: str) -> str:
    """A file name from a peer's header: a plain name inside its directory, nothing else."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"not a plain file name: {name!r}")
    return name


def _is_own_dir(path: str) -> bool:
    """A real directory (never a link to one: links are not followed)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_own_dir(path: str) -> None:
    """Removes a directory fastckpt made and the regular files in it, following no link:
    where it holds anything else (a link, a folder, a file with another name elsewhere), those
    are left as they are and the directory is renamed aside instead (logged)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return  # gone, or a link or a file: not ours to remove
    try:
        names = os.listdir(fd)
        foreign = []
        for name in names:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
                foreign.append(name)
        if not foreign:  # (a folder with anything planted in it is left whole)
            for name in names:
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    if not foreign:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return
    moved = _aside(path, "foreign")
    _log.warning(
        "%s holds what fastckpt did not write (%s): left as it is, the directory renamed %s",
        path,
        sorted(foreign),
        moved,
    )


def set_aside_link(path: str) -> str:
    """Renames a link (or a non-directory) found where fastckpt keeps a directory of its
    own: the link itself, never its target, so nothing it points to is touched (logged)."""
    moved = _aside(path, "link")
    _log.warning("%s is not a directory fastckpt made: not followed, renamed %s", path, moved)
    return moved


def _aside(path: str, kind: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, attempt = f"{path}.{kind}-{stamp}", 1
    while os.path.lexists(target):
        attempt += 1
        target = f"{path}.{kind}-{stamp}-{attempt}"
    os.rename(path, target)
    return target


def _own_dir(path: str, *, create: bool) -> None:
    """Makes sure ``path`` is a real directory: a link (or a file) there is set aside."""
    if os.path.lexists(path) and not _is_own_dir(path):
        set_aside_link(path)
    if create:
        os.makedirs(path, exist_ok=True)


def _open_dir_chain(parts: Sequence[str]) -> int:
    """A descriptor of ``parts[0]/parts[1]/...``, each opened below the last with
    ``O_NOFOLLOW``: a link anywhere in the chain raises (``ELOOP``/``ENOTDIR``)."""
    fd = os.open(parts[0], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    path = parts[0]
    try:
        for part in parts[1:]:
            path = os.path.join(path, part)
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                raise type(exc)(exc.errno, f"{exc.strerror} (not followed)", path) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_file_at(directory: int, name: str, where: str) -> int:
    """A regular file ``name`` of the directory ``directory``, opened without following a
    link; one with a second name elsewhere (a hard link) is not ours either."""
    path = os.path.join(where, name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory)
    except OSError as exc:
        raise type(exc)(exc.errno, f"{exc.strerror} (not followed)", path) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file of fastckpt's own", path)
    return fd


def _read_file_at(directory: int, name: str, where: str, limit: int = 1 << 20) -> bytes:
    fd = _open_file_at(directory, name, where)
    try:
        data = os.pread(fd, limit + 1, 0)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{os.path.join(where, name)}: larger than a marker can be")
    return data


def identity(source: Any, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The identity of a checkpoint file's content: a digest of its header (each tensor's
    name, dtype, shape and offsets, and its metadata, which records every tensor's CRC32C
    and XXH3), so two files with one identity hold the same bytes. None for a file without
    checksums (it cannot be told apart, nor verified). ``source`` is an open descriptor (read
    through a duplicate), a local path (opened without following a link) or a URL.

    Example:
        >>> import os, tempfile, torch
        >>> from fastckpt.checkpoint.save import save
        >>> path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
        >>> save({"w": torch.ones(2)}, path)
        >>> identity(path) == identity(path), len(identity(path))
        (True, 32)
    """
    with _reader(source, storage_options) as reader:
        if not reader.has_checksums:
            return None
        header = reader.header
        described = {
            "entries": [
                [name, e.dtype, list(e.shape), e.begin, e.end]
                for name, e in sorted(header.entries.items())
            ],
            "metadata": dict(sorted(header.metadata.items())),
        }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


def verify(source: Any, where: str, expected: str | None) -> None:
    """Checks a checkpoint file like a hostile one: its identity is ``expected`` and every
    tensor's bytes match its CRC32C (a replica is data from elsewhere).

    Raises:
        ChecksumError: naming ``where`` and the damaged tensors, or the identity that differs.
    """
    with _reader(source, None) as reader:
        if not reader.has_checksums:
            raise ChecksumError(f"{where}: no checksums: a replica must be verifiable")
        damaged = reader.verify(progress=False)
    if damaged:
        raise ChecksumError(f"{where}: damaged tensors {damaged}")
    found = identity(source)
    if expected is not None and found != expected:
        raise ChecksumError(f"{where}: its content is {found}, not the step's {expected}")


@contextlib.contextmanager
def _reader(source: Any, storage_options: Mapping[str, Any] | None) -> Iterator[CheckpointReader]:
    """A reader of ``source`` (see :func:`identity`); a local file is opened without following
    a link and must be a regular file."""
    local = None if isinstance(source, int) else to_local(source)
    if not isinstance(source, int) and local is None:
        with CheckpointReader(source, storage_options=storage_options) as reader:
            yield reader
        return
    if local is not None:
        fd = os.open(local, os.O_RDONLY | os.O_NOFOLLOW)
    else:
        fd = os.dup(source)
        os.lseek(fd, 0, os.SEEK_SET)  # (a duplicate shares its offset: read from the start)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", local)
        with CheckpointReader(f) as reader:
            yield reader


def _identity_of_share(info: dict[str, Any], fds: Sequence[int]) -> str | None:
    """The identity of a replica: its checkpoint file's; for files that are no checkpoint,
    a digest of their bytes (:func:`share_identity`). None where it cannot be read."""
    try:
        return share_identity([name for name, _ in info["files"]], fds)
    except (FastCkptError, OSError, ValueError):
        return None


def share_identity(names: Sequence[str], fds: Sequence[int]) -> str | None:
    """The identity of a step's files (open, in ``names``' order): its checkpoint file's
    :func:`identity`, or for files that are no checkpoint the SHA-256 of their bytes."""
    for name, fd in zip(names, fds):
        if name.endswith(".safetensors"):
            return identity(fd)
    digest = hashlib.sha256()
    for name, fd in zip(names, fds):
        digest.update(f"{name}\0".encode())
        offset = 0
        while chunk := os.pread(fd, 1 << 20, offset):
            digest.update(chunk)
            offset += len(chunk)
    return "bytes-" + digest.hexdigest()[:26]


def verify_share(
    names: Sequence[str], fds: Sequence[int], where: str, expected: str | None
) -> None:
    """Checks a step's files (open) like hostile ones: a checkpoint file's every CRC32C
    (:func:`verify`), other files' bytes against ``expected``.

    Raises:
        ChecksumError: naming ``where`` and what differs.
    """
    if any(name.endswith(".safetensors") for name in names):
        for name, fd in zip(names, fds):
            if name.endswith(".safetensors"):
                verify(fd, os.path.join(where, name), expected)
        return
    found = share_identity(names, fds)
    if expected is None or found != expected:
        raise ChecksumError(f"{where}: its bytes are {found}, not the step's {expected}")


def _write_atomically(path: str, data: bytes) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
    os.rename(temporary, path)
