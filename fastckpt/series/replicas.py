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

from fastckpt.distributed.replica_store import identity, verify
from fastckpt.distributed.replication import Recovery, Replicator
from fastckpt.errors import FastCkptError
from fastckpt.series import steps as layout
from fastckpt.series.steps import Tier
from fastckpt.storage.url import url_errors

__all__ = [
    "REPLICA_DIR",
    "Recovery",
    "agree_restored",
    "from_peer",
    "make_replicator",
    "prune",
    "recover",
    "replicate",
]

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
    run: str = "",
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
    return Replicator(
        os.path.join(fast, REPLICA_DIR), replicas=replicas, bytes_per_second=rate, run=run
    )


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

    Each copy is known by its content (:func:`~fastckpt.distributed.replica_store.identity`
    of its ``state.safetensors``, read without following a link): a peer's replica is used
    only where it is the step this rank committed. This rank's own fast copy of the step is
    verified first; a damaged one is quarantined and the step comes from a peer or root.

    This rank's steps newer than the one agreed on that not every rank can get (saved here,
    but lost with another node) are set aside in both tiers, a URL tier too, renamed
    ``step-<12 digits>.abandoned-<UTC time>`` (nothing is deleted), and every rank drops
    its replicas of them: the run goes on from the step agreed on, its next saves are not
    refused as older than them, and a step number saved again is never restored from the
    copy set aside."""
    own, fallback = _identities(fast), _identities(root)

    def check_own(candidate: int) -> None:
        if own.get(candidate) is not None:  # (a file without checksums cannot be checked)
            path = layout.join(layout.step_dir(fast, candidate), layout.STATE_FILE)
            verify(path, path, own[candidate])

    def set_aside_own(candidate: int) -> None:
        moved = layout.quarantine_step(fast, candidate)
        _log.warning("step %d in %s is damaged: moved to %s", candidate, fast, moved)

    recovery = replicator.recover(
        own,
        fallback,
        lambda s: layout.step_dir(fast, s),
        step=step,
        check_own=check_own,
        set_aside_own=set_aside_own,
    )
    if recovery.step is not None:
        for tier in (fast, root):
            for newer in [s for s in layout.committed_steps(tier) if s in recovery.abandoned]:
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


def agree_restored(replicator: Replicator, step: int | None, error: str | None) -> None:
    """Every rank restored ``step`` (``error``: why this rank did not), or every rank raises
    at once, naming the ranks that failed and why: no rank goes on alone (a collective).

    Raises:
        FileNotFoundError: some rank could not restore the step agreed on.
    """
    failures = replicator.agree(error)
    if failures:
        raise FileNotFoundError(
            f"step {step} could not be restored on every rank: " + "; ".join(failures)
        )


def prune(replicator: Replicator | None) -> None:
    """Keeps the newest replica of each rank this rank holds copies for, and no other."""
    if replicator is not None:
        try:
            replicator.store.prune(replicator.sources)
        except OSError as exc:
            _log.error("the replicas in %s were not pruned: %s", replicator.store.directory, exc)


def _identities(tier: Tier) -> dict[int, str | None]:
    """The committed steps of ``tier`` with their content's identity; a step whose file
    cannot be read as a checkpoint file of its own (a link, a damaged header) is left out,
    logged: it is never restored, nor a replica matched against it."""
    found: dict[int, str | None] = {}
    for step in layout.committed_steps(tier):
        path = layout.join(layout.step_dir(tier, step), layout.STATE_FILE)
        try:
            if layout.marker_of(tier, step).get("layout", layout.FILE_LAYOUT) != layout.FILE_LAYOUT:
                continue
            found[step] = identity(path, tier.storage_options)
        except (FastCkptError, OSError, ValueError) as exc:
            _log.warning("step %d in %s is not restored: %s: %s", step, tier, path, exc)
    return found


def from_peer(recovery: Recovery, rank: int) -> bool:
    """Whether ``rank`` got the recovered step from a peer's replica."""
    return bool(recovery.sources) and recovery.sources[rank].startswith("peer")


def _abandon(tier: Tier, step: int, agreed: int) -> None:
    """Sets ``step`` of ``tier`` aside: renamed ``step-<12 digits>.abandoned-<UTC time>``, its
    marker with it (one rename locally; at a URL its marker is copied there first, then
    removed from the step, so the step leaves the series at once, then its objects move)."""
    directory = layout.step_dir(tier, step)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if tier.is_url:
        target = _abandon_url(tier, directory, stamp)
    else:
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


def _abandon_url(tier: Tier, directory: str, stamp: str) -> str:
    fs, path = tier.fs()
    base = f"{path}/{os.path.basename(directory)}"
    target, attempt = f"{base}.abandoned-{stamp}", 1
    while fs.exists(target):
        attempt += 1
        target = f"{base}.abandoned-{stamp}-{attempt}"
    with url_errors(directory, "setting aside"):
        fs.copy(f"{base}/{layout.MARKER}", f"{target}/{layout.MARKER}")
        fs.rm(f"{base}/{layout.MARKER}")  # the step is no longer committed from here on
        fs.invalidate_cache(path)
        for name in sorted(fs.find(base)):
            fs.mv(name, target + name[len(base) :])
    fs.invalidate_cache(path)
    return layout.join(tier.location, os.path.basename(target))
