"""``CheckpointManager``: the checkpoints of a training run, saved per step, kept by policy,
in a fast tier drained to a durable one, and restored from the newest good step.

Each step is a directory committed by a marker written last (:mod:`fastckpt.series.steps`),
so a crash at any point leaves either a complete step or one that does not exist. With
``fast`` set (``/dev/shm/run``, a local NVMe), a save commits there at memory speed and a
background drain copies each committed step to ``root``, verifying every checksum of the
copy before committing it there; the fast tier keeps ``keep_fast`` steps and never deletes
one not yet drained. ``restore()`` takes the newest committed step of either tier (the fast
one first), verifies it, and falls back to the other tier, then to older steps, logging why.

Either tier may be an fsspec URL (``s3://bucket/run``, ``memory://run``; ``storage_options=``
reach its file system): a step there is committed the same way, by a marker object written
after every file of the step is complete, and a drain to it uploads with bounded memory and
reads the upload back to check it (:mod:`fastckpt.series.transfer`).

In a multi-rank run (``torch.distributed`` initialized with more than one rank, or
``distributed=True``) every rank creates a manager and calls :meth:`save` with its sharded
state (DTensors, or per-rank state as DCP takes it): the step directory then holds a DCP
checkpoint (one fastckpt file per rank and ``.metadata``, :mod:`fastckpt.series.sharded`),
committed by rank 0 only after every rank's file is durable, and :meth:`restore` loads it
into the given ``state``, resharded to whatever world size runs now. Such a save returns
once the rank's state is captured; the write, the agreement of the ranks and the commit run
in the background on a gloo group of their own (:mod:`fastckpt.distributed.collective_save`),
reusing the previous step's plans while the state's structure is the same. Locks, cleanup,
retention and drains are rank 0's alone; the other ranks follow its decisions.

With ``incremental=True`` a single-file step is saved against the previous committed step
of its tier (``fastckpt.save(..., base=)``: only the tensors that changed are written, the
others referred to), and every ``full_every``-th step is written whole so chains stay short.
Retention keeps every step a kept step needs (its marker's ``depends_on``), in every tier;
a drained step is committed in ``root`` only when its references resolve to ``root``'s own
copies (:mod:`fastckpt.series.bases`). Multi-rank (DCP) steps, and steps saved to a tier at a
URL, are always full.

A step whose own file fails verification at :meth:`restore` is moved out of the series
(:func:`~fastckpt.series.steps.quarantine_step`: its marker removed, then its directory
renamed ``step-<12 digits>.damaged-<time>``), so that training resumed from an older step can
save that step number again; so is a step that needs a step quarantined so.

One manager owns a tier at a time (an exclusive ``flock`` locally, a lease object at a URL:
:mod:`fastckpt.series.lease`), until :meth:`close`; on start it removes what an earlier one
left half done (steps without a marker, unfinished S3 uploads) and drains committed fast
steps that ``root`` lacks.

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

import collections
import concurrent.futures
import errno
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from fastckpt import api
from fastckpt.distributed.handshake import handshake
from fastckpt.errors import ChecksumError, FastCkptError, RestoreError
from fastckpt.io import spare_files
from fastckpt.series import replicas as peer_copies
from fastckpt.series import steps as layout
from fastckpt.series import transfer
from fastckpt.series.bases import needed_steps, own_damage
from fastckpt.series.common_step import CommonStep
from fastckpt.series.lease import LocalLock, UrlLease
from fastckpt.series.retention import Retention, kept_bases
from fastckpt.series.sharded import DCP_LAYOUT, Ranks, StepSaver, load_step
from fastckpt.series.shared_tiers import check_shared_tiers
from fastckpt.series.steps import Tier

__all__ = ["CheckpointManager"]

_log = logging.getLogger("fastckpt")


class StepFuture(concurrent.futures.Future[Any]):
    """The future :meth:`CheckpointManager.save` returns: once its error is taken with
    ``result()`` or ``exception()``, :meth:`~CheckpointManager.wait` and
    :meth:`~CheckpointManager.close` do not raise it again."""

    retrieved = False

    def result(self, timeout: float | None = None) -> Any:
        self.retrieved = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.retrieved = True
        return super().exception(timeout)


def _chain(source: concurrent.futures.Future, target: concurrent.futures.Future) -> None:
    """Settles ``target`` as ``source`` settles."""

    def settle(done: concurrent.futures.Future) -> None:
        error = concurrent.futures.Future.exception(done)
        if error is None:
            target.set_result(done.result())
        else:
            target.set_exception(error)

    source.add_done_callback(settle)


class CheckpointManager:
    """Saves, keeps and restores the checkpoints of one run (see the module's description).

    Args:
        root: the durable tier: a local directory (created if missing) or an fsspec URL
            (``s3://bucket/run``, ``memory://run``).
        fast: an optional fast tier (a local directory, or a URL): saves commit there and
            drain to ``root`` in the background.
        keep_last: steps ``root`` keeps (None: all), besides ``keep_every`` and ``best``.
        keep_every: also keep every step divisible by this.
        best: ``(metric, "min" | "max", count)``: also keep the ``count`` best steps by a
            metric passed to :meth:`save`.
        keep_fast: steps the fast tier keeps (those not yet drained are always kept).
        drain_bytes_per_second: cap on the drain's copy speed (None: no cap).
        drain_nice: the drain thread's CPU priority, 0 to 19 (Linux), or None (the default:
            the process's). A high value makes the drain take the CPU time training leaves
            idle; where training keeps every core busy the drain then falls behind (measured
            in docs/series.md), so it suits hosts whose cores wait on a GPU.
        storage_options: for a tier at a URL, passed to its fsspec file system (``key``,
            ``secret``, ``endpoint_url``, ...; None: ``FASTCKPT_STORAGE_OPTIONS``).
        lease_seconds: how long a URL tier's lease outlives its holder's last renewal
            (:mod:`fastckpt.series.lease`).
        distributed: steps as DCP checkpoints saved by every rank (True), as one file
            (False), or DCP when a process group of more than one rank runs (None). Every
            rank must see the same tiers (a shared file system or a URL).
        incremental: save each single-file step against the previous committed step of its
            tier, writing only the tensors that changed (:meth:`save` may override it per
            step). Steps to a tier at a URL, and multi-rank steps, are always full.
        full_every: with ``incremental``, every ``full_every``-th step of a chain is written
            whole (1: every step), so a restore reads from at most ``full_every`` files and
            retention can delete old bases.
        max_undrained: with a fast tier, the most committed steps it may hold that root
            lacks: while root fails (full, unreachable), the fast tier keeps every step
            not drained, so past this many :meth:`save` refuses (naming root's error)
            rather than fill the fast tier's memory. A failed drain is raised by the next
            :meth:`save` (once), naming the step, the tiers, the file and the errno.
        replicas: copy each committed fast step into the memory of this many other nodes
            (:mod:`fastckpt.series.replicas`): every rank then saves its own steps to its
            own ``root`` and node-local ``fast`` (``distributed`` defaults to False), and
            :meth:`restore` and :meth:`close` are collective; a restore after a node is
            lost takes the newest step that survives in any peer's memory before root.
        replication_bytes_per_second: cap on the bytes each rank sends to its peers.
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
        drain_nice: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        lease_seconds: float = 60.0,
        distributed: bool | None = None,
        incremental: bool = False,
        full_every: int = 10,
        max_undrained: int = 4,
        replicas: int = 0,
        replication_bytes_per_second: float | None = None,
    ):
        self._root = _tier(root, "root", storage_options)
        self._fast = None if fast is None else _tier(fast, "fast", storage_options)
        # A local fast tier keeps its newest deleted step's file for the next save to write
        # over (fastckpt.io.spare_files: on /dev/shm that spares allocating its pages).
        self._spare = (
            None
            if self._fast is None or self._fast.is_url
            else os.path.join(self._fast.location, layout.SPARE_FILE)
        )
        if self._fast is not None and _same(self._fast, self._root):
            raise ValueError(f"fast and root are the same directory: {self._root}")
        self.retention = Retention(keep_last, keep_every, best)
        self.fast_retention = Retention(keep_fast)
        if drain_bytes_per_second is not None and not drain_bytes_per_second > 0:
            raise ValueError(
                f"drain_bytes_per_second must be positive, got {drain_bytes_per_second!r}"
            )
        self._rate = drain_bytes_per_second
        if drain_nice is not None and (
            isinstance(drain_nice, bool)
            or not isinstance(drain_nice, int)
            or not 0 <= drain_nice <= 19
        ):
            raise ValueError(f"drain_nice must be an int within 0..19 or None, got {drain_nice!r}")
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every must be a positive int, got {full_every!r}")
        self.incremental = bool(incremental)
        self.full_every = full_every
        self._markers: dict[tuple[str, int], dict[str, Any]] = {}  # a marker never changes
        # Bases of saves not committed yet: retention keeps them (tier location, step).
        self._bases_in_use: collections.Counter[tuple[str, int]] = collections.Counter()
        self._reported: set[tuple[str, int]] = set()  # steps logged as kept for others
        self._first_reports: set[tuple[str, int, str]] = set()  # see _first_report
        self._last_commit: concurrent.futures.Future[None] | None = None
        self._ranks = Ranks(False if replicas and distributed is None else distributed)
        if self._ranks.group or replicas:  # it makes groups (collectives): every rank comes
            handshake(
                "CheckpointManager(...)",
                verb="created",
                advice="create it on every rank, or pass distributed=False on a rank that "
                "saves alone",
            )
        # the checkpoint group is made here, on every rank in the same order
        self._steps = StepSaver(self._ranks) if self._ranks.sharded else None
        self._last_sharded: StepFuture | None = None
        self._sharded_failed = False  # a multi-rank save failed: its ranks may be gone
        self._locks: list[Any] = []
        self._guard = threading.Lock()  # retention and drains never race on a tier
        # collective: every rank makes its replication groups here, in the same order
        self._replicator = peer_copies.make_replicator(
            replicas,
            self.fast,
            sharded=self._ranks.sharded,
            incremental=incremental,
            rate=replication_bytes_per_second,
            run=self.root,  # a replica another run made is never restored
        )
        self.recovery: peer_copies.Recovery | None = None  # the last restore from peers
        self._kept_for_peers: list[tuple[str, int]] = []  # see _keep_replicated
        if self._replicator is not None:  # the newest step peers hold stays in both tiers
            self._replicator.on_replicated = self._keep_replicated
            # until the ranks agree (a restore) or replicate: any step may be the one to agree on
            self._keep_replicated(*(s for t in self._tiers() for s in layout.committed_steps(t)))
        # ranks saving at their own pace agree on the newest step all hold, which retention
        # keeps (collective: made by every rank here, after the replication groups)
        self._kept_common: list[tuple[str, int]] = []  # see _keep_common
        self._common = (
            None
            if self._replicator is None
            else CommonStep(self._restorable, self._pin, self._unpin, self._keep_common)
        )
        self._saves = concurrent.futures.ThreadPoolExecutor(1, "fastckpt-manager-save")
        self._drains = concurrent.futures.ThreadPoolExecutor(
            1,
            "fastckpt-manager-drain",
            initializer=transfer.lower_thread_priority,
            initargs=(drain_nice,),
        )
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._drained: set[int] = set()  # steps this manager's drains committed in root
        self._drain_futures: list[concurrent.futures.Future[None]] = []  # not yet reported
        self._delivered: set[int] = set()  # ids of futures whose error a call raised
        if (
            isinstance(max_undrained, bool)
            or not isinstance(max_undrained, int)
            or max_undrained < 1
        ):
            raise ValueError(f"max_undrained must be a positive int, got {max_undrained!r}")
        self.max_undrained = max_undrained
        self._closed = False
        try:
            # every rank's tiers are rank 0's (a step would else lack ranks' files)
            check_shared_tiers({"root": self._root, "fast": self._fast}, self._ranks)
            self._ranks.agree(lambda: self._take_over(lease_seconds))
        except BaseException:
            self._closed = True
            self._saves.shutdown()
            self._drains.shutdown()
            for lock in self._locks:
                lock.release()
            raise

    def _take_over(self, lease_seconds: float) -> None:
        """Rank 0: locks the tiers, removes what an earlier manager left half done, and
        drains again the committed fast steps that root lacks (a failure here releases the
        locks taken: see ``__init__``)."""
        for tier in self._tiers():
            if tier.is_url:
                self._locks.append(UrlLease(tier.location, tier.storage_options, lease_seconds))
            else:
                self._locks.append(LocalLock(tier.location))
        for tier in self._tiers():
            for step in layout.uncommitted_steps(tier):
                _log.info(
                    "removing %s: a save, drain or deletion cut short", layout.step_dir(tier, step)
                )
                layout.remove_step(tier, step)
            if layout.abort_unfinished_uploads(tier):
                _log.info("aborted the unfinished uploads a killed writer left in %s", tier)
            self._set_aside_unreadable(tier)
        if self._spare is not None and spare_files.remove_stale(self._spare):
            _log.info("removed %s: a spare an earlier manager of this tier left", self._spare)
        if self._fast is not None:
            for step in self._undrained(layout.committed_steps(self._fast)):
                self._submit_drain(step)

    @property
    def root(self) -> str:
        """The durable tier's directory or URL."""
        return self._root.location

    @property
    def fast(self) -> str | None:
        """The fast tier's directory or URL, or None."""
        return None if self._fast is None else self._fast.location

    # -- saving ----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        *,
        incremental: bool | None = None,
        **save_options: Any,
    ) -> concurrent.futures.Future[None]:
        """Saves ``state`` as ``step``; returns once it is snapshotted (as
        :func:`fastckpt.async_save`, which takes ``save_options``: ``fence=optimizer`` makes
        it a lazy save that copies nothing before returning). The future is done when the
        step is committed in its first tier (the fast one when set); :meth:`wait` also
        waits for drains.

        ``incremental`` (default: the manager's) saves the step against the previous
        committed step of its tier, unless that one ends a chain of ``full_every`` steps;
        ``frozen=`` then names tensors unchanged since that step (see
        :func:`fastckpt.save`). The manager chooses ``base=`` itself.

        In a multi-rank run every rank calls this with its share of the state; it returns
        once the share is captured (copied into the writer's staging pool, or with
        ``fence=optimizer`` lazily, as a lazy single-file save), and in the background every
        rank writes its file on a gloo group of fastckpt's own (training collectives never
        wait on it) and rank 0 commits the step once every rank's file is durable. A rank
        that fails or dies leaves the step absent; the future of every rank fails, and so
        does its next :meth:`save` (once), which first waits for the previous step. The
        plans of the previous step are reused while the state's structure is the same.
        Other ``save_options`` go to :class:`~fastckpt.integrations.dcp.FastCkptWriter`
        (``checksum``, ``piece_size``, engine settings).

        Raises:
            ValueError: ``step`` is not a non-negative int, is already saved, or the
                manager is closed; ``base=`` was passed.
            RuntimeError: a URL tier's lease was taken by another manager.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._surface_drain_failures(step)
        if "base" in save_options:
            raise ValueError("the manager chooses base= itself: pass incremental=True")
        tier = self._fast or self._root
        if self._ranks.sharded:
            return self._save_sharded(tier, step, state, metrics, save_options)
        self._clear_for(tier, step)
        path = layout.join(layout.step_dir(tier, step), layout.STATE_FILE)
        frozen = save_options.pop("frozen", None)
        wanted = self.incremental if incremental is None else incremental
        base, since_full = (
            self._choose_base(tier, step) if wanted and not tier.is_url else (None, 0)
        )
        try:
            if tier.is_url:
                written = api.async_save(
                    state, path, storage_options=tier.storage_options, **save_options
                )
            else:
                os.makedirs(os.path.dirname(path))
                if base is not None:
                    save_options["base"] = layout.join(
                        layout.step_dir(tier, base), layout.STATE_FILE
                    )
                    save_options["frozen"] = frozen
                if tier == self._fast and self._spare is not None:
                    save_options.setdefault("spare_file", self._spare)
                written = api.async_save(state, path, **save_options)
        except BaseException:
            self._release_base(tier, base)
            raise

        def commit() -> None:
            try:
                written.result()
                self._check_lease()
                layout.commit(tier, step, metrics, extra=self._chain_fields(tier, step, since_full))
                self._drained.discard(step)  # a step saved again is drained again
            finally:
                self._release_base(tier, base)
            if tier == self._fast:  # opened now: retention may delete it at once
                peer_copies.replicate(self._replicator, tier, step)
            if self._common is not None:  # reported (and pinned) before retention runs
                self._common.report()
            self._retain(tier)
            if self._fast is not None:
                self._submit_drain(step)

        if written.done() and isinstance(written.exception(), (TypeError, ValueError)):
            self._release_base(tier, base)  # refused in the call, as fastckpt.save refuses
            layout.remove_step(tier, step)
            raise written.exception()
        future: StepFuture = StepFuture()
        _chain(self._saves.submit(commit), future)
        self._pending.append(future)
        self._last_commit = future
        return future

    def _keep_replicated(self, *steps: int) -> None:
        """Keeps ``steps`` in both tiers (the newest step peers hold a copy of, which a
        restore after a node's loss may agree on), instead of the steps kept before."""
        with self._guard:  # held in root too: a drain's retention may push it out there
            for key in self._kept_for_peers:
                self._bases_in_use[key] -= 1
                if self._bases_in_use[key] <= 0:
                    del self._bases_in_use[key]
            self._kept_for_peers = [(t.location, s) for t in self._tiers() for s in steps]
            for key in self._kept_for_peers:
                self._bases_in_use[key] += 1

    def _keep_common(self, step: int) -> None:
        """Keeps ``step``, the newest step every rank holds (agreed by
        :class:`~fastckpt.series.common_step.CommonStep`, or restored by every rank), in
        root (and in the fast tier while root lacks it: not drained yet), instead of the
        step kept so before: a restore always finds a step every rank can load."""
        with self._guard:
            for key in self._kept_common:
                self._bases_in_use[key] -= 1
                if self._bases_in_use[key] <= 0:
                    del self._bases_in_use[key]
            self._kept_common = [(self._root.location, step)]
            self._bases_in_use[(self._root.location, step)] += 1

    def _restorable(self) -> list[int]:
        """The steps this rank can restore from its own tiers."""
        return sorted({s for tier in self._tiers() for s in layout.committed_steps(tier)})

    def _pin(self, steps: list[int]) -> None:
        """Keeps ``steps`` in root from retention until :meth:`_unpin` (a fast step is
        either not drained yet, which its tier keeps, or also in root)."""
        with self._guard:
            for key in [(self._root.location, s) for s in steps]:
                self._bases_in_use[key] += 1

    def _unpin(self, steps: list[int]) -> None:
        with self._guard:
            for key in [(self._root.location, s) for s in steps]:
                self._bases_in_use[key] -= 1
                if self._bases_in_use[key] <= 0:
                    del self._bases_in_use[key]

    def _choose_base(self, tier: Tier, step: int) -> tuple[int | None, int]:
        """The step to save ``step`` against (the previous committed single-file step of
        ``tier``, held from retention until ``step`` commits) and the length of the chain
        ``step`` then ends (``since_full``), or ``(None, 0)`` for a full step."""
        if self._last_commit is not None:  # the previous save commits first (its error stays)
            concurrent.futures.wait([self._last_commit])
        with self._guard:
            earlier = [s for s in layout.committed_steps(tier) if s < step]
            if not earlier:
                return None, 0
            base = earlier[-1]
            try:
                marker = self._marker(tier, base)
            except (OSError, ValueError) as exc:
                _log.warning(
                    "step %d in %s is saved whole: step %d's marker: %s", step, tier, base, exc
                )
                return None, 0
            if marker.get("layout", layout.FILE_LAYOUT) != layout.FILE_LAYOUT:
                return None, 0
            since_full = int(marker.get("since_full", 0)) + 1
            if since_full >= self.full_every:
                return None, 0
            self._bases_in_use[(tier.location, base)] += 1
            return base, since_full

    def _release_base(self, tier: Tier, base: int | None) -> None:
        if base is None:
            return
        with self._guard:
            key = (tier.location, base)
            self._bases_in_use[key] -= 1
            if self._bases_in_use[key] <= 0:
                del self._bases_in_use[key]

    @staticmethod
    def _chain_fields(tier: Tier, step: int, since_full: int) -> dict[str, Any]:
        """The marker fields of an incremental step: the steps it needs (``depends_on``) and
        its place in its chain (``since_full``); none for a full step."""
        if since_full == 0:
            return {}
        needs = needed_steps(tier, step)
        if not needs:  # every tensor changed: the file holds them all
            return {}
        return {"depends_on": needs, "since_full": since_full}

    def _clear_for(self, tier: Tier, step: int) -> None:
        self._check_lease()
        committed = self._committed_before(tier, step)
        if step in committed:
            raise ValueError(
                f"step {step} is already saved in {tier if step in layout.committed_steps(tier) else self._root}"
            )
        if committed and step < committed[-1]:
            raise ValueError(
                f"step {step} is older than the newest saved step {committed[-1]} in {tier}: "
                "steps must increase (restore() the step to go back to, then save newer ones)"
            )
        layout.remove_step(tier, step)  # a save of this step cut short
        self._markers.pop((tier.location, step), None)

    def _committed_before(self, tier: Tier, step: int) -> list[int]:
        """The committed steps a save of ``step`` into ``tier`` must not repeat or go back
        behind (root's too, for the fast tier: a step in root would be replaced by this one's
        drain). A step among them that would refuse the save is first checked (its files
        against its marker, its own file's checksums) and set aside when it fails: a marker
        planted beside no state, or a damaged step, is never taken for "already saved"."""
        tiers = [tier, self._root] if tier == self._fast else [tier]
        listed = [(t, layout.committed_steps(t)) for t in tiers]
        if self._ranks.group:  # every rank reaches the same verdict: nothing is moved here
            return sorted({s for _, steps in listed for s in steps})
        moved = False
        for where, steps in listed:
            for blocking in [s for s in steps if s >= step]:
                moved |= self._set_aside_if_broken(where, blocking, verify=True)
        if moved:
            listed = [(t, layout.committed_steps(t)) for t in tiers]
        return sorted({s for _, steps in listed for s in steps})

    def _save_sharded(
        self,
        tier: Tier,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None,
        options: Mapping[str, Any],
    ) -> concurrent.futures.Future[None]:
        """Captures this rank's share (see :meth:`save`) and returns; in the background every
        rank writes its file on the checkpoint group and rank 0 commits once every rank's is
        durable. The previous step's save is finished first (its error raised here, once)."""
        assert self._steps is not None  # made in __init__ for a sharded manager
        if self._ranks.group:  # no rank goes on to the collective save alone
            digests = handshake(
                "CheckpointManager.save",
                agree_on={"step": step},
                advice="call save() on every rank, each with its share of the state (or make "
                "the manager with distributed=False where one process saves alone)",
                report=self._steps.replicas_digest(state),
            )
            if len(set(digests)) > 1:  # some rank holds other replicated items
                self._steps.replicas_differ()
        self._finish_sharded()
        self._check_step(tier, step)  # the same verdict on every rank: no collective needed
        assert self._steps is not None  # made in __init__ for a sharded manager
        directory = layout.step_dir(tier, step)
        captured: Any
        try:
            captured = self._steps.capture(directory, state, tier.storage_options, options)
        except Exception as exc:  # the other ranks hear of it at the agreement, and all
            captured = exc  # raise it at their next call (the ranks stay in step)
            _log.error("step %d: this rank's state could not be captured: %s", step, exc)

        def prepare() -> None:  # rank 0, before any rank makes the directory
            self._check_lease()
            layout.remove_step(tier, step)  # a save of this step cut short
            self._markers.pop((tier.location, step), None)

        def commit() -> None:  # rank 0, once every rank's file is durable
            self._check_lease()
            layout.commit(tier, step, metrics, DCP_LAYOUT)
            self._retain(tier)
            if self._fast is not None:
                self._submit_drain(step)

        def write() -> None:
            assert self._steps is not None
            self._steps.write(captured, prepare, commit)

        future: StepFuture = StepFuture()
        _chain(self._saves.submit(write), future)
        self._pending.append(future)
        self._last_commit = future
        self._last_sharded = future
        future.add_done_callback(self._note_sharded_failure)
        return future

    def _note_sharded_failure(self, future: concurrent.futures.Future[Any]) -> None:
        if concurrent.futures.Future.exception(future) is not None:
            self._sharded_failed = True

    def _finish_sharded(self) -> None:
        """Waits for the previous multi-rank save and raises its error: every rank's save of
        a step succeeds or fails together, and every rank raises at its next call, even
        where the error was taken from the future already, so that no rank goes on to a
        collective that another rank left (:meth:`wait` does not raise it again)."""
        previous, self._last_sharded = self._last_sharded, None
        if previous is None:
            return
        error = concurrent.futures.Future.exception(previous)  # (not marked retrieved)
        if error is not None:
            self._delivered.add(id(previous))
            raise error

    def _check_step(self, tier: Tier, step: int) -> None:
        """Refuses a step already saved or older than the newest (the checks of
        :meth:`_clear_for`, without removing anything: rank 0 does that in the background)."""
        self._check_lease()
        committed = self._committed_before(tier, step)
        if step in committed:
            raise ValueError(f"step {step} is already saved in {tier}")
        if committed and step < committed[-1]:
            raise ValueError(
                f"step {step} is older than the newest saved step {committed[-1]} in {tier}: "
                "steps must increase (restore() the step to go back to, then save newer ones)"
            )

    def _submit_drain(self, step: int) -> None:
        """Starts the drain of ``step`` in the background (its error: :meth:`save`, :meth:`wait`)."""
        future = self._drains.submit(self._drain, step)
        self._pending.append(future)
        self._drain_futures.append(future)

    def _surface_drain_failures(self, step: int) -> None:
        """Raises, once, the first drain that failed since the last call; refuses ``step``
        while the fast tier holds ``max_undrained`` steps that root lacks."""
        done = [f for f in self._drain_futures if f.done()]
        self._drain_futures = [f for f in self._drain_futures if not f.done()]
        failed = [f for f in done if f.exception() is not None]
        for future in failed:
            self._delivered.add(id(future))
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        if self._fast is None:
            return
        undrained = self._undrained(layout.committed_steps(self._fast))
        if len(undrained) >= self.max_undrained and not self._drain_futures:
            raise OSError(
                errno.EAGAIN,
                f"step {step} not saved: the fast tier {self._fast} holds {len(undrained)} "
                f"steps that root {self._root} lacks ({undrained}; max_undrained="
                f"{self.max_undrained}), and no drain is running: root is failing (see the "
                "error an earlier save raised); free root, then close and reopen the manager "
                "to drain them again",
                str(self._root),
            )

    def _drain(self, step: int) -> None:
        """Copies a committed fast step to ``root``, verifies the copy, commits it there.

        Raises:
            OSError: naming the step, both tiers and the file, with the errno.
        """
        try:
            self._drain_step(step)
        except OSError as exc:
            message = f"draining step {step} from {self.fast} to {self.root}: {exc.strerror or exc}"
            try:  # the same kind of error (MissingBaseError, FileNotFoundError...), named
                named = type(exc)(exc.errno, message, exc.filename)
            except TypeError:
                named = OSError(exc.errno, message, exc.filename)
            # logged now: the next save() that raises it may be a long training step away
            _log.error("%s", named)
            raise named from exc
        except Exception as exc:
            _log.error("draining step %d from %s to %s: %s", step, self.fast, self.root, exc)
            raise

    def _drain_step(self, step: int) -> None:
        assert self._fast is not None
        source, target = layout.step_dir(self._fast, step), layout.step_dir(self._root, step)
        marker = layout.marker_of(self._fast, step)
        self._check_lease()
        layout.remove_step(self._root, step)
        self._markers.pop((self._root.location, step), None)
        if not self._root.is_url:  # made here, now: a link planted meanwhile fails this
            os.mkdir(target)
        for name in marker["files"]:
            copied = layout.join(target, name)
            try:
                crc = transfer.copy_file(
                    layout.join(source, name),
                    copied,
                    source_options=self._fast.storage_options,
                    target_options=self._root.storage_options,
                    rate=self._rate,
                )
                if self._root.is_url or self._fast.is_url:  # local: checked as it was made
                    transfer.verify_copy(copied, crc, self._root.storage_options)
            except ChecksumError as exc:
                layout.remove_step(self._root, step)
                raise ChecksumError(f"draining step {step} to {self.root}: {exc}") from exc
        kind = marker.get("layout", layout.FILE_LAYOUT)
        extra = {}
        if kind == layout.FILE_LAYOUT:
            extra = self._check_bases_in_root(step)
            if extra:
                extra["since_full"] = marker.get("since_full", 1)
        self._check_lease()
        layout.commit(self._root, step, marker.get("metrics"), kind, extra=extra)
        self._drained.add(step)
        self._retain(self._root)
        self._retain(self._fast)

    def _check_bases_in_root(self, step: int) -> dict[str, Any]:
        """The ``depends_on`` of the copy of ``step`` in root: its references must resolve
        to root's own committed copies (drains go in step order, so they are there); else
        the copy is removed and the drain raises."""
        try:
            needs = needed_steps(self._root, step)
            missing = sorted(set(needs) - set(self._root_steps()))
            if missing:
                raise FileNotFoundError(
                    f"step {step} needs steps {missing}, which are not committed in {self.root}"
                )
        except (FastCkptError, OSError, ValueError):
            layout.remove_step(self._root, step)
            _log.error("the copy of step %d in %s does not resolve in it: removed", step, self.root)
            raise
        return {"depends_on": needs} if needs else {}

    def _retain(self, tier: Tier) -> None:
        with self._guard:
            committed = layout.committed_steps(tier)
            if tier == self._fast:
                kept = self.fast_retention.kept(committed)
                kept |= set(self._undrained(committed))
            else:
                kept = self.retention.kept(committed, self._metrics_of(tier, committed))
            kept |= {s for (where, s) in self._bases_in_use if where == tier.location}
            kept |= self._needed_by(tier, kept, committed)
            kept |= self._unreadable_markers(tier, set(committed) - kept)
            # newest first: a step goes before the older ones it needs, so a crash
            # mid-way never leaves a committed step without its base
            spare = self._spare if tier == self._fast else None
            for step in reversed(committed):
                if step not in kept:
                    layout.remove_step(tier, step, spare=spare)
                    self._markers.pop((tier.location, step), None)

    def _needed_by(self, tier: Tier, kept: set[int], committed: list[int]) -> set[int]:
        """The steps that ``kept`` steps need (their markers' ``depends_on``, through every
        chain); a step whose marker cannot be read keeps every older step (what it needs is
        unknown). Steps kept only for others are logged once."""

        def depends_on(step: int) -> list[int]:
            try:
                return list(self._marker(tier, step).get("depends_on", []))
            except (OSError, ValueError) as exc:
                if self._first_report(tier, step, "needs"):
                    _log.warning(
                        "keeping the steps before %d in %s: its marker: %s", step, tier, exc
                    )
                return [s for s in committed if s < step]

        added = kept_bases(kept, committed, depends_on)
        for base, users in sorted(added.items()):
            if base not in committed:
                _log.error(
                    "steps %s in %s need step %d, which is missing", sorted(users), tier, base
                )
            elif (tier.location, base) not in self._reported:
                self._reported.add((tier.location, base))
                _log.info(
                    "keeping step %d in %s only because steps %s depend on it",
                    base,
                    tier,
                    sorted(users),
                )
        return set(added)

    def _set_aside_unreadable(self, tier: Tier) -> None:
        """Sets aside (:func:`~fastckpt.series.steps.set_aside`, logged) each step of
        ``tier`` whose marker cannot be read (``.unreadable-``) or whose files are not those
        its marker records (``.damaged-``: missing, or of another size): planted or damaged,
        it would count as the newest step and refuse every save, keep every older step
        through retention, and fail the drain at every start. Nothing is deleted (at a URL
        the objects are moved within the tier)."""
        for step in layout.committed_steps(tier):
            self._set_aside_if_broken(tier, step)

    def _set_aside_if_broken(self, tier: Tier, step: int, *, verify: bool = False) -> bool:
        """Sets ``step`` of ``tier`` aside when its marker cannot be read or its files do not
        match it (with ``verify``, also when its own file fails its checksums); whether it
        did. A step that cannot be reached (an I/O error) is left as it is."""
        problem: str | None
        try:
            marker = layout.marker_of(tier, step)
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:
            why, problem = "unreadable", str(exc)
        else:
            try:
                why, problem = "damaged", layout.files_problem(tier, step, marker)
                if problem is None and verify and marker.get("layout") == layout.FILE_LAYOUT:
                    problem = own_damage(tier, step)
            except OSError as exc:
                _log.warning("step %d in %s could not be checked: %s", step, tier, exc)
                return False
            if problem is None:
                return False
        with self._guard:
            moved = layout.set_aside(tier, step, why)
            self._markers.pop((tier.location, step), None)
        _log.error("step %d in %s set aside as %s: %s", step, tier, moved, problem)
        return True

    def _first_report(self, tier: Tier, step: int, kind: str) -> bool:
        """Whether ``kind`` is news for ``step`` of ``tier``: retention runs at every save, and
        the same unreadable marker logged at each would bury everything else."""
        key = (tier.location, step, kind)
        new = key not in self._first_reports
        self._first_reports.add(key)
        return new

    def _unreadable_markers(self, tier: Tier, steps: set[int]) -> set[int]:
        """The steps of ``steps`` whose marker cannot be read: never removed by retention
        (logged; a restore that meets one quarantines it)."""
        unreadable = set()
        for step in steps:
            try:
                self._marker(tier, step)
            except FileNotFoundError:
                continue  # removed meanwhile: nothing to keep
            except (OSError, ValueError) as exc:
                unreadable.add(step)
                if self._first_report(tier, step, "unreadable"):
                    _log.error(
                        "keeping step %d in %s: its commit marker cannot be read: %s",
                        step,
                        tier,
                        exc,
                    )
        return unreadable

    def _marker(self, tier: Tier, step: int) -> dict[str, Any]:
        """The marker of a committed step (read once: at a URL, one request)."""
        key = (tier.location, step)
        if key not in self._markers:
            self._markers[key] = layout.marker_of(tier, step)
        return self._markers[key]

    def _metrics_of(self, tier: Tier, steps: list[int]) -> dict[int, dict[str, float]]:
        """The metrics of ``steps`` (each marker read once: at a URL, one request each)."""
        if self.retention.best is None:
            return {}
        found = {}
        for step in steps:
            try:
                metrics = self._marker(tier, step).get("metrics", {})
            except (OSError, ValueError):
                continue  # kept anyway (_unreadable_markers)
            found[step] = metrics if isinstance(metrics, dict) else {}
        return found

    # -- reading ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Every committed step, in either tier, ascending."""
        found = set(self._root_steps())
        if self._fast is not None:
            found |= set(layout.committed_steps(self._fast))
        return sorted(found)

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        found = self.steps()
        return found[-1] if found else None

    def restore(
        self, step: int | None = None, *, state: Any = None, **load_options: Any
    ) -> tuple[int, Any]:
        """The newest committed step that loads verified (or ``step``), as ``(step, state)``;
        a damaged copy is skipped (logged) for the other tier's, then for older steps.

        A step of one file is loaded with :func:`fastckpt.load` (``load_options``:
        ``map_location=``, ...). A step saved by several ranks (a DCP checkpoint) is loaded
        into ``state`` in place, resharded to its tensors (DTensors of this run's mesh, or
        plain tensors), and ``state`` is returned; in one process ``state`` may be None for
        every value as full tensors. In a multi-rank run every rank calls this with its own
        ``state``; all take the step rank 0 picks and move on together past damage.

        A single-file step whose own file fails verification is quarantined
        (:func:`~fastckpt.series.steps.quarantine_step`, logged), and so is a step that
        failed to load and needs a step quarantined so: their step numbers can be saved
        again. A step that fails only because a base is missing or damaged is left as it is.

        Raises:
            ValueError: in a process group, ``state`` is None: a step saved by several ranks
                loads only into the sharded state it is to fill (pass ``state=``, the same
                state dict each rank passed to :meth:`save`).
            RestoreError: steps are committed but none loads (a ``FileNotFoundError``
                naming each step tried, its directory and why).
            FileNotFoundError: no step (or not ``step``) is committed.
        """
        if self._ranks.group and state is None:  # every rank: before any collective
            raise ValueError(
                f"restore() in a process group of {self._ranks.world} ranks needs state=: the "
                "sharded state to load the step into (each rank's own state dict, as passed "
                "to save(): DTensors or this rank's tensors); without it no step can load"
            )
        if self._ranks.group or self._replicator is not None:  # collective: every rank comes
            handshake("CheckpointManager.restore", agree_on={"step": step})
        if self._replicator is not None and self._fast is not None:  # every rank: the same step
            concurrent.futures.wait(list(self._pending))
            self.recovery = peer_copies.recover(self._replicator, self._fast, self._root, step)
            if self.recovery.step is None:  # every rank raises: none restores alone
                raise FileNotFoundError(f"no step is available to every rank ({self.fast})")
            step = self.recovery.step
            self._keep_replicated(step)  # (no drain's retention removes it before the load)
            if self._common is not None:  # every rank holds it now: the common step
                self._keep_common(step)
            if step not in self._root_steps():  # its node died before the drain
                self._submit_drain(step)
        if self._last_sharded is not None:  # its collectives end before the load's begin
            concurrent.futures.wait([self._last_sharded])  # (its error stays for save())
        candidates = self._ranks.agree(lambda: self._candidates(step))
        errors: list[str] = []
        files: list[str | None] = []  # the file each failure names, if any
        failed: list[tuple[Tier, int]] = []
        restored: tuple[int, Any] | None = None
        for candidate, index in candidates:
            tier = self._tiers()[index]
            directory = layout.step_dir(tier, candidate)
            try:
                loaded = self._load(tier, candidate, state, load_options)
                ok = True
            # checksums, headers, DCP's failures, an unreadable marker
            except (FastCkptError, OSError, ValueError) as exc:
                ok, loaded, error = False, None, exc
            if self._ranks.all_ok(ok):
                restored = candidate, loaded
                break
            reason = error if not ok else "another rank could not load it"
            _log.warning(
                "step %d in %s cannot be restored (%s); trying the next", candidate, tier, reason
            )
            errors.append(f"step {candidate} ({directory}): {reason}")
            files.append(getattr(error, "filename", None) if not ok else None)
            failed.append((tier, candidate))
        if failed and not self._ranks.sharded:
            self._quarantine_damaged(failed)
        if self._replicator is not None:  # every rank restored the step, or every rank raises
            why = None if restored is not None else "; ".join(errors) or f"no step {step} here"
            peer_copies.agree_restored(self._replicator, step, why)
        if restored is not None:
            return restored
        where = self.root if self.fast is None else f"{self.fast} or {self.root}"
        if not errors:
            wanted = "no committed step" if step is None else f"no committed step {step}"
            raise FileNotFoundError(f"{wanted} in {where}")
        raise RestoreError(
            errno.ENOENT,
            f"no step in {where} could be restored: " + "; ".join(errors),
            next((f for f in files if f), None),
        )

    def _quarantine_damaged(self, failed: list[tuple[Tier, int]]) -> None:
        """Moves out of the series the single-file steps of ``failed`` (steps that did not
        load) whose own file is damaged, and those of ``failed`` that need one of them; but
        never a step that another committed step, staying, needs (it may load still)."""
        concurrent.futures.wait(list(self._pending))  # no drain reads a step moved away
        for tier in self._tiers():
            steps = sorted(step for where, step in failed if where == tier)
            if steps:
                self._quarantine_in(tier, steps)

    def _quarantine_in(self, tier: Tier, failed: list[int]) -> None:
        why: dict[int, str] = {}
        intact: list[int] = []
        for step in failed:
            try:
                if self._marker(tier, step).get("layout", layout.FILE_LAYOUT) != layout.FILE_LAYOUT:
                    continue
                damage = own_damage(tier, step)
            except (OSError, ValueError) as exc:  # unreadable: nothing is moved on a guess
                _log.warning("step %d in %s is left as it is: %s", step, tier, exc)
                continue
            if damage is None:
                intact.append(step)
            else:
                why[step] = damage
        if not why:
            return
        needs = {}
        for step in layout.committed_steps(tier):
            try:
                needs[step] = set(self._marker(tier, step).get("depends_on", []))
            except (OSError, ValueError):
                needs[step] = {s for s in layout.committed_steps(tier) if s < step}
        for step in intact:  # failed, and needs a damaged step: moved with it
            lost = sorted(needs.get(step, set()) & set(why))
            if lost:
                why[step] = f"it needs step {lost[0]}, whose file is damaged"
        staying = True
        while staying:  # a step that a staying step needs stays too
            staying = False
            for step in sorted(why):
                users = [s for s, n in needs.items() if step in n and s not in why]
                if users:
                    _log.warning(
                        "step %d in %s is damaged (%s) but left in the series: steps %s need it",
                        step,
                        tier,
                        why.pop(step),
                        users,
                    )
                    staying = True
        for step in sorted(why, reverse=True):  # dependents before their bases
            self._quarantine(tier, step, why[step])

    def _quarantine(self, tier: Tier, step: int, why: str) -> None:
        with self._guard:
            where = layout.quarantine_step(tier, step)
            self._markers.pop((tier.location, step), None)
        _log.warning(
            "step %d in %s is damaged (%s): moved to %s, out of the series; the step can be "
            "saved again",
            step,
            tier,
            why,
            where,
        )

    def _candidates(self, step: int | None) -> list[tuple[int, int]]:
        """``(step, tier index)`` to try, newest first, the fast tier's copy first."""
        if self._ranks.group:  # no drain removes a fast step while the ranks read it
            concurrent.futures.wait(list(self._pending))  # its errors stay for wait()
        tiers = self._tiers()
        listed = [set(layout.committed_steps(tier)) for tier in tiers]
        wanted = sorted(set().union(*listed)) if step is None else [step]
        return [
            (candidate, index)
            for candidate in reversed(wanted)
            for index in range(len(tiers))
            if candidate in listed[index]
        ]

    def _load(self, tier: Tier, step: int, state: Any, options: Mapping[str, Any]) -> Any:
        """Step ``step`` of ``tier``, loaded as its marker's layout says."""
        directory = layout.step_dir(tier, step)
        if layout.marker_of(tier, step).get("layout") == DCP_LAYOUT:
            # with a state to load into: on the checkpoint group, the plan reused
            saver = self._steps if state is not None else None
            if self._ranks.group and tier is self._root:  # shared by every node (a fast
                options = {"group": True, **options}  # tier may be a node's own): read once
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                return load_step(
                    directory, state, self._ranks, tier.storage_options, saver=saver, **options
                )
            except CheckpointException as exc:  # a BaseException: a damaged step like any
                raise _dcp_failure(step, directory, exc) from exc
        options = dict(options)
        if tier.is_url:
            options.setdefault("storage_options", tier.storage_options)
        else:  # a link planted in a step is never followed into another run's checkpoint
            os.close(transfer.open_own_file(os.path.join(directory, layout.STATE_FILE)))
        return api.load(layout.join(directory, layout.STATE_FILE), verify=True, **options)

    # -- lifetime --------------------------------------------------------------------------
    def wait(self) -> None:
        """Waits for every save and drain started so far; raises the first error not raised
        already (by a save future's ``result()`` or by :meth:`save`).

        In a multi-rank run every rank calls it: it ends with a barrier, once rank 0's
        drains and retention are done, so that :meth:`steps` then lists the same steps on
        every rank (no barrier once a multi-rank save failed: its ranks may be gone)."""
        error: BaseException | None = None
        while self._pending and error is None:
            future = self._pending.pop(0)
            failure = concurrent.futures.Future.exception(future)  # (not marked retrieved)
            if failure is None:
                continue
            retrieved = getattr(future, "retrieved", False) or id(future) in self._delivered
            if not retrieved:
                error = failure  # the others stay pending, for the next wait() to raise
        if self._ranks.group:
            concurrent.futures.wait(list(self._pending))
            if not self._sharded_failed:
                # a wait() on a subset of ranks fails in seconds, not at the group's timeout
                handshake("CheckpointManager.wait")
                self._ranks.barrier()
        if error is not None:
            raise error

    def close(self) -> None:
        """Waits for saves and drains, then lets another manager own the tiers."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._common is not None:  # ends every rank's rounds
                self._common.close(timeout=60.0)
            if self._replicator is not None:  # replicates the newest step, then stops
                self._replicator.close(timeout=60.0)
                peer_copies.prune(self._replicator)
                for tier in self._tiers():  # the step peers hold moved on: retention applies
                    self._retain_at_close(tier)
            elif self._fast is not None and self._ranks.coordinator:
                self._retain_at_close(self._fast)  # the last drain's step may have come late
            self._saves.shutdown()
            self._drains.shutdown()
            if self._steps is not None:
                self._steps.close()
            if self._spare is not None:  # its memory goes back to the system, and the
                spare_files.discard(self._spare)  # tier's files are unmapped (kept_mappings)
            for lock in self._locks:
                lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _retain_at_close(self, tier: Tier) -> None:
        """Applies ``tier``'s retention once more, every save and drain done (logged, not
        raised: the manager is closing, and its steps are committed)."""
        try:
            self._retain(tier)
        except (OSError, ValueError) as exc:
            _log.error("retention of %s at close: %s", tier, exc)

    def _tiers(self) -> list[Tier]:
        return [self._root] if self._fast is None else [self._fast, self._root]

    def _root_steps(self) -> list[int]:
        return layout.committed_steps(self._root)

    def _undrained(self, fast_steps: list[int]) -> list[int]:
        """The fast steps root still needs: those it lacks that no drain of this manager
        copied there (root's own retention may retire a drained step before the fast tier's
        does; keeping it as undrained would hold the fast tier above ``keep_fast`` for good)."""
        in_root = set(self._root_steps())
        return sorted(s for s in fast_steps if s not in in_root and s not in self._drained)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the CheckpointManager of {self.root} is closed")

    def _check_lease(self) -> None:
        for lock in self._locks:
            lock.check()


def _tier(location: Any, what: str, storage_options: Mapping[str, Any] | None) -> Tier:
    """The tier at ``location``: a URL as given, a local directory created and absolute."""
    if not isinstance(location, (str, os.PathLike)):
        raise TypeError(f"{what} must be a directory or a URL, got {type(location).__name__}")
    tier = Tier(os.fspath(location), storage_options)
    if not tier.is_url:
        try:
            os.makedirs(tier.location, exist_ok=True)
        except FileExistsError:  # something that is not a directory holds the name
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"the {what} tier of a CheckpointManager must be a directory (or a URL), "
                "and this is a file",
                tier.location,
            ) from None
    return tier


def _same(a: Tier, b: Tier) -> bool:
    if a.is_url or b.is_url:
        return a.location == b.location
    return os.path.realpath(a.location) == os.path.realpath(b.location)


def _dcp_failure(step: int, directory: str, exc: BaseException) -> FastCkptError:
    """DCP's ``CheckpointException`` (a ``BaseException``, each rank's error inside) as a
    :class:`FastCkptError` naming the step, and the file of the first error that names one."""
    failures = getattr(exc, "failures", {}) or {}
    causes = [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
    named = [c for c in causes if getattr(c, "filename", None)]
    cause = (named or causes or [exc])[0]
    what = f"{type(cause).__name__}: {getattr(cause, 'strerror', None) or cause}"
    filename = getattr(cause, "filename", None)
    if filename:
        what += f" ({filename})"
    error = FastCkptError(f"step {step} ({directory}): loading the DCP checkpoint failed: {what}")
    error.filename = filename  # type: ignore[attr-defined]
    return error
