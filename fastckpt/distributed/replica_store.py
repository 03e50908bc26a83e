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

import json
import os
import re
import shutil
import stat
import tempfile
from typing import Any

__all__ = ["MARKER", "ReplicaStore", "plain_name", "remove_own_dir"]

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
        os.makedirs(self.directory, exist_ok=True)
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
        os.makedirs(source, exist_ok=True)
        final = os.path.join(source, f"step-{step:012d}")
        if os.path.lexists(final):  # the same step replicated again (a restarted run)
            remove_own_dir(final)
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
            steps = [s for s in self._steps_of(path) if self._complete(path, s)]
            if steps:
                found[int(match.group(1))] = steps
        return found

    def info(self, rank: int, step: int) -> dict[str, Any]:
        """The marker of rank ``rank``'s replica of ``step``."""
        path = os.path.join(self._dir(rank, step), MARKER)
        with open(path, "rb") as f:
            return dict(json.loads(f.read()))

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

    @staticmethod
    def _complete(source: str, step: int) -> bool:
        """Whether the replica has its marker and every file at its recorded size."""
        directory = os.path.join(source, f"step-{step:012d}")
        try:
            with open(os.path.join(directory, MARKER), "rb") as f:
                info = json.loads(f.read())
            for name, size in info["files"]:
                path = os.path.join(directory, plain_name(name))
                if os.lstat(path).st_size != size or not stat.S_ISREG(os.lstat(path).st_mode):
                    return False
        except (OSError, ValueError, KeyError, TypeError):
            return False
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
    if _is_own_dir(path):
        shutil.rmtree(path, ignore_errors=True)


def _write_atomically(path: str, data: bytes) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
    os.rename(temporary, path)
