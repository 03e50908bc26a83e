"""One manager per tier: an exclusive ``flock`` on a local tier, a lease object at a URL.

A local tier is guarded by ``flock`` on ``<tier>/.fastckpt-manager.lock``, held until the
manager closes or its process dies (the kernel releases it): a second manager is refused.

Object stores have no locks, so a URL tier has one writer by rule and a lease object that
detects a second: ``<tier>/.fastckpt-manager.lock`` holds JSON naming its owner (a random
id, the host, the pid) and when it was last renewed. A manager refuses a tier whose lease
another owner renewed within ``lease_seconds``, unless that owner is a process of this host
that no longer runs (a killed run's successor takes over at once). The owner renews the lease
every ``lease_seconds / 3`` from a background thread; if it finds the lease taken (it was
stalled past ``lease_seconds`` and a successor took over) it stops writing: the manager's
next save or drain raises. The check is advisory, not a fence: two managers started within
the same instant, or hosts whose clocks differ by more than ``lease_seconds``, may both
write; run one writer per root.

Example:
    >>> lease = UrlLease("memory://doc-lease/run", None, lease_seconds=30)
    >>> UrlLease("memory://doc-lease/run", None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: another CheckpointManager manages memory://doc-lease/run ...
    >>> lease.release()
    >>> UrlLease("memory://doc-lease/run", None).release()
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastckpt import storage

__all__ = ["LOCK_NAME", "LocalLock", "UrlLease"]

LOCK_NAME = ".fastckpt-manager.lock"
_log = logging.getLogger("fastckpt")


def launcher_hint(environ: Mapping[str, str] | None = None) -> str:
    """What to do when a tier is taken because this process is one of several that a
    launcher started (torchrun, Lightning's DDP) and made its manager before the process
    group existed: each such process then takes the tiers as a run of its own. Empty
    otherwise.

    Example:
        >>> launcher_hint({"RANK": "1", "WORLD_SIZE": "2"})[:48]
        ': this process is rank 1 of 2 launched processes'
        >>> launcher_hint({})
        ''
    """
    env = os.environ if environ is None else environ
    rank, world = env.get("RANK"), env.get("WORLD_SIZE")
    if rank is None or world is None or world.strip() in ("", "0", "1"):
        return ""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return ""
    return (
        f": this process is rank {rank} of {world} launched processes and no process group "
        "was initialized when its manager was made, so it took the tiers as a run of its "
        "own; make the manager after torch.distributed.init_process_group on every rank, "
        "or under Lightning's DDP pass a factory: FastCkptCheckpoint(manager="
        "functools.partial(CheckpointManager, root, ...)) (docs/lightning.md)"
    )


class LocalLock:
    """An exclusive ``flock`` on a local tier for the manager's life."""

    def __init__(self, directory: str):
        path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise RuntimeError(
                f"another CheckpointManager manages {directory}; close it first "
                f"(one writer per tier){launcher_hint()}"
            ) from None

    def check(self) -> None:
        """A flock cannot be lost while held: nothing to check."""

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class UrlLease:
    """The lease object of a URL tier (see the module's description).

    Raises:
        RuntimeError: another manager holds a live lease on the tier (naming its host, pid
            and when it renewed it).
    """

    def __init__(
        self, location: str, storage_options: Mapping[str, Any] | None, lease_seconds: float = 60
    ):
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds!r}")
        self.url = storage.join(location, LOCK_NAME)
        self.location = location
        self._options = storage_options
        self._seconds = float(lease_seconds)
        self._owner = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid()}
        self._lost: str | None = None
        held = self._read()
        if held is not None and self._alive(held):
            raise RuntimeError(
                f"another CheckpointManager manages {location} (host {held.get('host')}, "
                f"pid {held.get('pid')}, lease renewed {time.time() - held['renewed']:.0f} s "
                f"ago, held for {self._seconds:.0f} s); close it first (one writer per root)"
                f"{launcher_hint()}"
            )
        if held is not None:
            _log.info("taking over %s from %s (its holder is gone)", location, held)
        self._write()
        held = self._read()  # two managers starting at once: the later write wins
        if held is None or held.get("owner") != self._owner["owner"]:
            raise RuntimeError(f"another CheckpointManager took {location} at the same moment")
        self._stop = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew, name="fastckpt-manager-lease", daemon=True
        )
        self._renewer.start()

    def _read(self) -> dict[str, Any] | None:
        try:
            document = json.loads(storage.read_whole(self.url, self._options))
        except FileNotFoundError:
            return None
        except ValueError:
            return None  # a damaged lease guards nothing
        if not isinstance(document, dict) or not isinstance(document.get("renewed"), float):
            return None
        return document

    def _write(self) -> None:
        document = {**self._owner, "renewed": time.time()}
        storage.write_whole(self.url, json.dumps(document).encode(), self._options)

    def _alive(self, held: dict[str, Any]) -> bool:
        if held.get("host") == self._owner["host"] and isinstance(held.get("pid"), int):
            try:
                os.kill(held["pid"], 0)
            except ProcessLookupError:
                return False  # a process of this host that no longer runs
            except PermissionError:
                pass  # runs, as another user
        return time.time() - held["renewed"] < self._seconds

    def _renew(self) -> None:
        while not self._stop.wait(self._seconds / 3):
            try:
                held = self._read()
                if held is not None and held.get("owner") != self._owner["owner"]:
                    self._lost = (
                        f"the lease on {self.location} was taken by host {held.get('host')} "
                        f"pid {held.get('pid')} (this manager stalled past {self._seconds:.0f} s)"
                    )
                    _log.error("%s; this manager stops writing", self._lost)
                    return
                self._write()
            except OSError as exc:  # a transient failure; the next renewal tries again
                _log.warning("renewing the lease on %s failed: %s", self.location, exc)

    def check(self) -> None:
        """Raises ``RuntimeError`` once the lease was lost to another manager."""
        if self._lost is not None:
            raise RuntimeError(self._lost)

    def release(self) -> None:
        """Stops renewing and removes the lease if it is still this manager's."""
        self._stop.set()
        self._renewer.join()
        if self._lost is None:
            held = self._read()
            if held is not None and held.get("owner") == self._owner["owner"]:
                with contextlib.suppress(FileNotFoundError):
                    storage.delete(self.url, self._options)
