"""``CheckpointManager``: the checkpoints of a training run, saved per step, kept by policy,
in a fast tier drained to a durable one, and restored from the newest good step.

Each step is a directory committed by a marker written last (:mod:`fastckpt.series.steps`),
so a crash at any point leaves either a complete step or one that does not exist. With
``fast`` set (``/dev/shm/run``, a local NVMe), a save commits there at memory speed and a
background drain copies each committed step to ``root``, verifying every checksum of the
copy before committing it there; the fast tier keeps ``keep_fast`` steps and never deletes
one not yet drained. ``restore()`` takes the newest committed step of either tier (the fast
one first), verifies it, and falls back to the other tier, then to older steps, logging why.

One manager owns a tier at a time (an exclusive lock, held until :meth:`close`); on start it
removes what an earlier one left half done (steps without a marker) and drains committed
fast steps that ``root`` lacks.

Example:
    >>> import tempfile, torch
    >>> root = tempfile.mkdtemp()
    >>> with CheckpointManager(root, keep_last=2) as manager:
    ...     for step in (100, 200, 300):
    ...         _ = manager.save(step, {"w": torch.full((2,), float(step))})
    ...     manager.wait()
    ...     manager.steps()
    [200, 300]
    >>> with CheckpointManager(root) as manager:
    ...     step, state = manager.restore()
    >>> step, state["w"].tolist()
    (300, [300.0, 300.0])
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import logging
import os
import shutil
import threading
from collections.abc import Mapping
from typing import Any

from fastckpt import api
from fastckpt.errors import ChecksumError, HeaderError
from fastckpt.io.commit import fsync_directory
from fastckpt.series import steps as layout
from fastckpt.series.retention import Retention

__all__ = ["CheckpointManager"]

_log = logging.getLogger("fastckpt")
_LOCK_FILE = ".fastckpt-manager.lock"
_COPY_CHUNK = 16 << 20


class CheckpointManager:
    """Saves, keeps and restores the checkpoints of one run (see the module's description).

    Args:
        root: the durable tier, a local directory (created if missing).
        fast: an optional fast tier (a local directory): saves commit there and drain to
            ``root`` in the background.
        keep_last: steps ``root`` keeps (None: all), besides ``keep_every`` and ``best``.
        keep_every: also keep every step divisible by this.
        best: ``(metric, "min" | "max", count)``: also keep the ``count`` best steps by a
            metric passed to :meth:`save`.
        keep_fast: steps the fast tier keeps (those not yet drained are always kept).
        drain_bytes_per_second: cap on the drain's copy speed (None: no cap).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fast: str | os.PathLike[str] | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        best: tuple[str, str, int] | None = None,
        keep_fast: int = 1,
        drain_bytes_per_second: float | None = None,
    ):
        self.root = _local_directory(root, "root")
        self.fast = None if fast is None else _local_directory(fast, "fast")
        if self.fast is not None and os.path.realpath(self.fast) == os.path.realpath(self.root):
            raise ValueError(f"fast and root are the same directory: {self.root}")
        self.retention = Retention(keep_last, keep_every, best)
        self.fast_retention = Retention(keep_fast)
        if drain_bytes_per_second is not None and not drain_bytes_per_second > 0:
            raise ValueError(
                f"drain_bytes_per_second must be positive, got {drain_bytes_per_second!r}"
            )
        self._rate = drain_bytes_per_second
        self._locks = [_lock(tier) for tier in self._tiers()]
        self._guard = threading.Lock()  # retention and drains never race on a tier
        self._saves = concurrent.futures.ThreadPoolExecutor(1, "fastckpt-manager-save")
        self._drains = concurrent.futures.ThreadPoolExecutor(1, "fastckpt-manager-drain")
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._closed = False
        for tier in self._tiers():
            for leftover in layout.uncommitted_dirs(tier):
                _log.info("removing %s: a save, drain or deletion cut short", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
        if self.fast is not None:
            for step in sorted(set(layout.committed_steps(self.fast)) - set(self._root_steps())):
                self._pending.append(self._drains.submit(self._drain, step))

    # -- saving ----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        **save_options: Any,
    ) -> concurrent.futures.Future[None]:
        """Saves ``state`` as ``step``; returns once it is snapshotted (as
        :func:`fastckpt.async_save`, which takes ``save_options``: ``fence=optimizer`` makes
        it a lazy save that copies nothing before returning). The future is done when the
        step is committed in its first tier (the fast one when set); :meth:`wait` also
        waits for drains."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        tier = self.fast or self.root
        if step in layout.committed_steps(tier):
            raise ValueError(f"step {step} is already saved in {tier}")
        directory = layout.step_dir(tier, step)
        shutil.rmtree(directory, ignore_errors=True)  # a save of this step cut short
        os.makedirs(directory)
        written = api.async_save(state, os.path.join(directory, layout.STATE_FILE), **save_options)

        def commit() -> None:
            written.result()
            layout.commit(tier, step, metrics)
            self._retain(tier)
            if self.fast is not None:
                self._pending.append(self._drains.submit(self._drain, step))

        future = self._saves.submit(commit)
        self._pending.append(future)
        return future

    def _drain(self, step: int) -> None:
        """Copies a committed fast step to ``root``, verifies the copy, commits it there."""
        assert self.fast is not None
        source, target = layout.step_dir(self.fast, step), layout.step_dir(self.root, step)
        marker = layout.marker_of(self.fast, step)
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
        for name in marker["files"]:
            _copy_durably(os.path.join(source, name), os.path.join(target, name), self._rate)
        with api.open(os.path.join(target, layout.STATE_FILE)) as reader:
            damaged = reader.verify() if reader.has_checksums else []
        if damaged:
            shutil.rmtree(target, ignore_errors=True)
            raise ChecksumError(f"draining step {step} to {self.root}: damaged copy of {damaged}")
        layout.commit(self.root, step, marker.get("metrics"))
        self._retain(self.root)
        self._retain(self.fast)

    def _retain(self, tier: str) -> None:
        with self._guard:
            committed = layout.committed_steps(tier)
            if tier == self.fast:
                kept = self.fast_retention.kept(committed)
                kept |= set(committed) - set(self._root_steps())  # not drained yet
            else:
                metrics = {s: layout.marker_of(tier, s).get("metrics", {}) for s in committed}
                kept = self.retention.kept(committed, metrics)
            for step in committed:
                if step not in kept:
                    layout.remove_step(tier, step)

    # -- reading ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Every committed step, in either tier, ascending."""
        found = set(self._root_steps())
        if self.fast is not None:
            found |= set(layout.committed_steps(self.fast))
        return sorted(found)

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        found = self.steps()
        return found[-1] if found else None

    def restore(self, step: int | None = None, **load_options: Any) -> tuple[int, Any]:
        """The newest committed step that loads verified (or ``step``), as ``(step, state)``;
        a damaged copy is skipped (logged) for the other tier's, then for older steps.
        ``load_options`` go to :func:`fastckpt.load` (``map_location=``, ...).

        Raises:
            FileNotFoundError: no step (or not ``step``) is committed, or none loads.
        """
        candidates = self.steps() if step is None else [step]
        errors = []
        for candidate in reversed(candidates):
            for tier in self._tiers():
                if candidate not in layout.committed_steps(tier):
                    continue
                path = os.path.join(layout.step_dir(tier, candidate), layout.STATE_FILE)
                try:
                    return candidate, api.load(path, verify=True, **load_options)
                except (ChecksumError, HeaderError, OSError) as exc:
                    _log.warning(
                        "step %d in %s cannot be restored (%s); trying the next",
                        candidate,
                        tier,
                        exc,
                    )
                    errors.append(f"{path}: {exc}")
        where = self.root if self.fast is None else f"{self.fast} or {self.root}"
        if not errors:
            wanted = "no committed step" if step is None else f"no committed step {step}"
            raise FileNotFoundError(f"{wanted} in {where}")
        raise FileNotFoundError(f"no step in {where} could be restored: " + "; ".join(errors))

    # -- lifetime --------------------------------------------------------------------------
    def wait(self) -> None:
        """Waits for every save and drain started so far; raises the first error."""
        while self._pending:
            future = self._pending.pop(0)
            future.result()

    def close(self) -> None:
        """Waits for saves and drains, then lets another manager own the tiers."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._saves.shutdown()
            self._drains.shutdown()
            for fd in self._locks:
                os.close(fd)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _tiers(self) -> list[str]:
        return [self.root] if self.fast is None else [self.fast, self.root]

    def _root_steps(self) -> list[int]:
        return layout.committed_steps(self.root)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the CheckpointManager of {self.root} is closed")


def _local_directory(path: str | os.PathLike[str], what: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what} must be a directory path, got {type(path).__name__}")
    text = os.fspath(path)
    if "://" in text:
        raise ValueError(f"{what}={text!r}: the checkpoint manager takes local directories")
    os.makedirs(text, exist_ok=True)
    return os.path.abspath(text)


def _lock(tier: str) -> int:
    """An exclusive lock on ``tier`` for this manager's life (another manager is refused)."""
    fd = os.open(os.path.join(tier, _LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"another CheckpointManager manages {tier}; close it first (one writer per tier)"
        ) from None
    return fd


def _copy_durably(source: str, target: str, rate: float | None) -> None:
    """Copies a file in chunks (at most ``rate`` bytes a second) and fsyncs the copy."""
    import time

    started, copied = time.monotonic(), 0
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(_COPY_CHUNK):
            dst.write(chunk)
            copied += len(chunk)
            if rate is not None:
                ahead = copied / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        dst.flush()
        os.fsync(dst.fileno())
    with contextlib.suppress(OSError):
        fsync_directory(os.path.dirname(target))
