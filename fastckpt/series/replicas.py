"""A manager's fast tier replicated into peers' memory (``CheckpointManager(replicas=k)``).

Layout: every rank is the writer of its own steps. Each rank runs a manager with
``distributed=False`` (the default with ``replicas``) on its own directories: a root of its
own (``root/rank-00003``, on shared or durable storage) and a fast tier in its node's memory
(``/dev/shm/run/rank-00003``). A step committed in the fast tier (its ``state.safetensors``
and ``COMMITTED`` marker) is queued for replication; the replicas a rank keeps for its
peers live in ``<fast>/.replicas`` (:mod:`fastckpt.distributed.replica_store`), so losing a
node loses them with it. At restore the ranks agree on the newest step that every rank can
get (own fast tier, a peer's replica, its root) and a rank whose fast tier lacks it gets it
from a peer, committed into its fast tier; the restore then loads it from there (a copy that
fails verification falls back to root's, as always).

Example (one process: there are no peers to replicate to):
    >>> import tempfile
    >>> make_replicator(1, tempfile.mkdtemp(), sharded=False, incremental=False, rate=None)
    Traceback (most recent call last):
    ...
    ValueError: replicas=1 needs at least 2 nodes (each copy on another node); this run has 1
"""

from __future__ import annotations

import logging
import os
import time

from fastckpt.distributed.replication import Recovery, Replicator
from fastckpt.series import steps as layout
from fastckpt.series.steps import Tier

__all__ = ["REPLICA_DIR", "Recovery", "from_peer", "make_replicator", "recover", "replicate"]

#: The directory inside a rank's fast tier that holds the replicas it keeps for its peers.
REPLICA_DIR = ".replicas"

_log = logging.getLogger("fastckpt")


def make_replicator(
    replicas: int,
    fast: str | None,
    *,
    sharded: bool,
    incremental: bool,
    rate: float | None,
) -> Replicator | None:
    """The manager's replicator (None for ``replicas=0``); a collective when ``replicas``.

    Raises:
        ValueError: naming ``replicas`` when it cannot apply (no local fast tier, sharded
            or incremental steps, not fewer than the nodes).
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"replicas must be a non-negative int, got {replicas!r}")
    if not replicas:
        return None
    if fast is None or Tier(fast).is_url:
        raise ValueError(f"replicas={replicas} needs a local fast tier (fast=) to replicate")
    if sharded:
        raise ValueError(
            f"replicas={replicas} replicates each rank's own steps: pass distributed=False "
            "(each rank its own root and fast tier), not DCP steps"
        )
    if incremental:
        raise ValueError(f"replicas={replicas} needs full steps: incremental=True is not supported")
    return Replicator(os.path.join(fast, REPLICA_DIR), replicas=replicas, bytes_per_second=rate)


def replicate(replicator: Replicator | None, tier: Tier, step: int) -> None:
    """Queues a committed fast step for replication (its files, then its marker)."""
    if replicator is None:
        return
    try:
        names = [*layout.marker_of(tier, step)["files"], layout.MARKER]
        replicator.replicate(step, layout.step_dir(tier, step), names)
    except (OSError, ValueError) as exc:  # the step is committed: replication is extra
        _log.error("step %d in %s is not replicated: %s", step, tier, exc)


def recover(replicator: Replicator, fast: Tier, root: Tier, step: int | None) -> Recovery:
    """Agrees with every rank on the step to restore and brings it into ``fast`` from a
    peer where this rank's fast tier lacks it (a collective: see :class:`Replicator`).

    When the newest step was asked for, this rank's steps newer than the one agreed on (saved
    here, but lost with another node) are set aside in both tiers, renamed
    ``step-<12 digits>.abandoned-<UTC time>`` (nothing is deleted): the run goes on from the
    step agreed on, and its next saves must not be refused as older than them."""
    root_steps = layout.committed_steps(root)
    recovery = replicator.recover(
        layout.committed_steps(fast),
        root_steps,
        lambda s: layout.step_dir(fast, s),
        step=step,
    )
    if step is None and recovery.step is not None:
        for tier in (fast, root):
            for newer in [s for s in layout.committed_steps(tier) if s > recovery.step]:
                _abandon(tier, newer, recovery.step)
    mine = recovery.sources[replicator.rank] if recovery.sources else None
    if mine is not None and mine.startswith("peer"):
        _log.info(
            "rank %d: step %s recovered into %s from %s's replica (%.3f s)",
            replicator.rank,
            recovery.step,
            fast,
            mine,
            recovery.seconds,
        )
    return recovery


def from_peer(recovery: Recovery, rank: int) -> bool:
    """Whether ``rank`` got the recovered step from a peer's replica."""
    return bool(recovery.sources) and recovery.sources[rank].startswith("peer")


def _abandon(tier: Tier, step: int, agreed: int) -> None:
    """Sets ``step`` of ``tier`` aside (one rename; a URL tier keeps it, logged)."""
    if tier.is_url:
        _log.warning("step %d in %s is newer than step %d the ranks restored", step, tier, agreed)
        return
    directory = layout.step_dir(tier, step)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, attempt = f"{directory}.abandoned-{stamp}", 1
    while os.path.lexists(target):
        attempt += 1
        target = f"{directory}.abandoned-{stamp}-{attempt}"
    os.rename(directory, target)
    _log.warning(
        "step %d in %s set aside as %s: the ranks restored step %d (the others lack it)",
        step,
        tier,
        target,
        agreed,
    )
