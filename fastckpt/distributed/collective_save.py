"""One DCP save across ranks, run where the caller likes (a background thread) on a process
group of its own, with the plans of the previous save reused while the state's structure
stays the same, and one agreement before anything is published.

The steps, on every rank of ``group`` (the checkpoint group: never the training one):

1. the coordinator runs ``prepare`` (it clears what an earlier try left); every rank sets up
   its planner and writer and hashes its state's structure (:mod:`.plan_cache`);
2. **one all-reduce** (MAX of ``[failed rank + 1, plan missing, save id, f, -f, d, -d,
   own replicated item not copied]``): whether every rank is ready, whether every rank's
   cached plan still fits, the coordinator's save id (so every rank names its file for this
   save without asking), and whether every rank's cache was made for the same structures
   of every rank (``f``: the digest of the cached ranks' structure hashes, equal everywhere
   when ``max f == -max -f``);
3. plans: reused from the cache when every rank may; else DCP's round trip (each local plan
   gathered, the global plan and metadata built by the coordinator, the plans scattered),
   whose outcome the cache then keeps. When every rank computed the same owners of the
   replicated items (:mod:`.replicated_items`: the digest ``d`` of each rank's, also in the
   all-reduce) and copied its own, each rank offers only its own replicated items: each is
   written once, by the rank the rule names, from the first save of a structure. A rank
   that copied at the call only some items (``captured``: those of its previous plan, or
   all but the replicated items other ranks write) offers only those, so replicated items
   go to ranks that copied them;
4. every rank checks that **every** item of its plan is one it captured, then writes its
   file (durable on return);
5. the coordinator gathers every rank's outcome, results and structure hash; only when every
   rank succeeded, and every item a rank left out at step 3 was written by another, does it
   publish (``writer.finish``: ``.metadata``) and run ``commit`` (the step's marker);
6. it broadcasts the outcome (and every rank's structure hash, which the caches keep), so
   each rank returns or raises the same failure, naming the rank that failed and why.

A rank that dies makes the collectives of the others fail (gloo notices the closed
connection at once; a rank that hangs, after the group's timeout), and nothing is published:
the outcome is all or nothing, and ``commit`` runs at most once, after every rank's file is
durable.

A writer taking part in the cached path has ``save_id`` (hexadecimal, at most 15 digits) and
``plan_for_rank(plan, rank)`` (the plan with this save's file for ``rank``), as
:class:`~fastckpt.integrations.dcp.FastCkptWriter` does; any other ``StorageWriter`` plans
every save.

Example (one process, no group: the same steps without collectives):
    >>> import os, tempfile, torch
    >>> from fastckpt.dcp import FastCkptWriter, load_full
    >>> from fastckpt.distributed.plan_cache import PlanCache
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> writer, cache = FastCkptWriter(path), PlanCache()
    >>> save_collectively({"w": torch.zeros(3), "step": 1}, writer, cache)
    'planned'
    >>> save_collectively({"w": torch.ones(3), "step": 2}, writer, cache)
    'cached'
    >>> load_full(path)["w"].tolist(), load_full(path)["step"]
    ([1.0, 1.0, 1.0], 2)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Container
from typing import Any

import torch

from fastckpt.distributed.plan_cache import PlanCache, structure_hash
from fastckpt.distributed.plan_exchange import (
    all_max,
    exchange_plans,
    gather_to_coordinator,
)
from fastckpt.distributed.replicated_items import Assignment, assign
from fastckpt.errors import FastCkptError

__all__ = ["CollectiveSaveError", "save_collectively", "timings"]

#: Seconds spent planning (steps 1 to 3) by the last save of this process.
timings: dict[str, float] = {}


class CollectiveSaveError(FastCkptError):
    """A collective save failed on some rank; nothing was published."""


def save_collectively(
    state: Any,
    writer: Any,
    cache: PlanCache,
    *,
    group: Any = None,
    prepare: Callable[[], None] | None = None,
    commit: Callable[[], None] | None = None,
    planner: Any = None,
    failed: BaseException | None = None,
    captured: Container[Any] | None = None,
) -> str:
    """Saves this rank's share of ``state`` with the DCP ``writer`` (every rank of ``group``
    calls it; None: this process alone), as the module describes; returns ``"cached"`` when
    the plans of the previous save were reused, else ``"planned"``. A rank whose state
    could not be captured still calls it, with that error as ``failed``: the others then
    fail at the agreement instead of waiting for it. ``captured``: the ``MetadataIndex`` of
    every item this rank copied at the call when it copied only some (the items of its
    cached plan); None: every item of ``state`` is this call's own (copied whole, or lazily
    under a fence). This rank then writes only those, or the save fails on every rank.

    Raises:
        CollectiveSaveError: a rank failed (its rank and error quoted); this rank's own
            failure is raised as it is.
        RuntimeError: a collective failed (a rank died or the group timed out).
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    dist = torch.distributed
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    coordinator = rank == 0
    planner = planner if planner is not None else DefaultSavePlanner()
    error: BaseException | None = failed
    structure = 0
    missed = True
    replicas: Assignment | None = None
    started = time.perf_counter()
    try:
        if error is not None:
            raise error
        if coordinator and prepare is not None:
            prepare()
        started = time.perf_counter()  # planning from here (prepare is the caller's)
        writer.reset()
        writer.set_up_storage_writer(coordinator, rank=rank)
        planner.set_up_planner(state, writer.storage_meta(), coordinator)
        structure = structure_hash(state)
        missed = not (cache.matches(structure) and hasattr(writer, "plan_for_rank"))
        # a function of the structure alone: kept with the plans while it is the same
        replicas = cache.replicas if not missed and cache.replicas else assign(state, world)
    except BaseException as exc:  # noqa: BLE001 - the others must hear of it
        error = exc
    save_id = _save_id(writer) if coordinator and error is None else 0
    fingerprint = 0 if missed else cache.fingerprint()
    digest = replicas.digest if replicas is not None else 0
    lacking = replicas is not None and _lacks_own(replicas, rank, captured)
    failed_rank, any_missed, agreed_id, most, least, top, bottom, any_lacking = all_max(
        group,
        [
            rank + 1 if error else 0,
            int(missed),
            save_id,
            fingerprint,
            -fingerprint,
            digest,
            -digest,
            int(lacking),
        ],
    )
    if most != -least or not most:  # the ranks' caches were made for different structures
        any_missed = 1
    # Every rank computed the same owners of the replicated items (see replicated_items).
    same_replicas = top == -bottom and top != 0
    if not failed_rank:
        cache.replicas_differ = not same_replicas
    if failed_rank:
        _end(writer, coordinator)
        if error is not None:
            raise error
        raise CollectiveSaveError(
            f"rank {failed_rank - 1} failed preparing the save; nothing saved"
        )
    if hasattr(writer, "save_id") and agreed_id:
        writer.save_id = f"{agreed_id:012x}"

    metadata = None
    plans: list[Any] | None = None
    plan: Any = None
    left_out: list[Any] = []  # items this rank did not offer (not captured at the call)
    if not any_missed:
        outcome = "cached"
        try:  # a failure here is told at the gather below, which every rank reaches
            plan = writer.plan_for_rank(cache.plan, rank)
            writer.prepare_local_plan(plan)  # (the directory)
            if coordinator:
                assert cache.plans is not None
                plans = writer.prepare_global_plan(list(cache.plans))  # (marks the save live)
                metadata = cache.metadata
        except BaseException as exc:  # noqa: BLE001 - every rank must hear of it
            error = exc
    else:  # raises on every rank alike when a rank failed
        outcome = "planned"
        # The owners of the replicated items hold when every rank computed the same and
        # copied its own: then each is offered by its owner alone (DCP's deduplication has
        # nothing left to do). Else every rank offers what it copied, and DCP picks.
        others = None
        if replicas is not None and same_replicas and not any_lacking:
            others = replicas.others(rank)
        plan, plans, metadata, left_out = _plan(
            planner, writer, group, rank, world, captured, others
        )
    timings["plan"] = time.perf_counter() - started

    results: list[Any] = []
    try:
        if error is None and captured is not None:
            _check_captured(plan, captured, rank, outcome)
        if error is None:
            final = planner.finish_plan(plan)
            written = writer.write_data(final, planner)
            written.wait()
            results = written.value()
    except BaseException as exc:  # noqa: BLE001 - every rank must hear of it, whatever it is
        error = exc
    told = f"{type(error).__name__}: {error}" if error is not None else None
    gathered = gather_to_coordinator(
        group, (told, results, structure, left_out), coordinator, world
    )
    verdict: list[Any] = [None, None]  # the failure, every rank's structure hash
    if coordinator:
        assert gathered is not None
        verdict[1] = tuple(hash_ for _, _, hash_, _ in gathered)
        failures = [f"rank {r}: {e}" for r, (e, *_) in enumerate(gathered) if e is not None]
        failures = failures or _unwritten(gathered)
        if failures:
            verdict[0] = "; ".join(failures)
        else:
            try:
                writer.finish(metadata, [rs for _, rs, _, _ in gathered])
                if commit is not None:
                    commit()
            except Exception as exc:
                error = exc
                verdict[0] = f"rank 0 committing: {type(exc).__name__}: {exc}"
    if group is not None:
        dist.broadcast_object_list(verdict, group=group, group_src=0)
    if verdict[0] is not None:
        cache.forget()
        _end(writer, coordinator)
        if error is not None:
            raise error
        raise CollectiveSaveError(f"the save failed, nothing published: {verdict[0]}")
    cache.keep(structure, plan, plans if coordinator else None, metadata, verdict[1], replicas)
    return outcome


def _item_name(index: Any) -> str:
    """A write item's name for messages: its key, and where its chunk starts when not at 0."""
    offset = tuple(getattr(index, "offset", None) or ())
    return index.fqn if not any(offset) else f"{index.fqn} (chunk at {offset})"


def _lacks_own(replicas: Assignment, rank: int, captured: Container[Any] | None) -> bool:
    """Whether this rank did not copy at the call some replicated item the rule makes its
    own (it copied the items of a plan made when the ranks' replicated items differed)."""
    return captured is not None and any(i not in captured for i in replicas.own(rank))


def _check_captured(plan: Any, captured: Container[Any], rank: int, outcome: str) -> None:
    """Raises unless every item of ``plan`` is one this rank captured at the call: any other
    would be read from the live tensors after the call returned (values of a later time)."""
    missing = [item.index for item in plan.items if item.index not in captured]
    if not missing:
        return
    names = ", ".join(repr(_item_name(i)) for i in missing[:5])
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    how = "the plan reused" if outcome == "cached" else "the new plan (another rank's changed)"
    raise CollectiveSaveError(
        f"rank {rank} would write {names}{more} from the live tensors: it copied at the call "
        f"only the items of its previous plan (its state's structure was unchanged), and {how} "
        "gives it these; nothing saved, the next save copies this rank's whole state"
    )


def _unwritten(gathered: list[Any]) -> list[str]:
    """Items a rank left out of its plan (not captured) that no other rank wrote: saving
    without them would lose them (the ranks' states disagree about who holds them)."""
    written = {result.index for _, results, _, _ in gathered for result in results}
    return [
        f"rank {rank}: {_item_name(index)!r} is saved by no rank: rank {rank} copied at the "
        "call only the items of its previous plan or the replicated items it writes, which "
        "gave it to another rank, and no rank that copied it holds it now (the ranks' states "
        "differ); nothing saved, the next save copies every rank's whole state"
        for rank, (_, _, _, left_out) in enumerate(gathered)
        for index in left_out
        if index not in written
    ]


def _plan(
    planner: Any,
    writer: Any,
    group: Any,
    rank: int,
    world: int,
    captured: Any,
    others: frozenset[Any] | None = None,
) -> tuple[Any, list[Any] | None, Any, list[Any]]:
    """DCP's planning round trip; this rank's plan, on the coordinator every plan and the
    metadata, and the items this rank left out of its local plan (not in ``captured``).
    ``others``: replicated items that other ranks write, not offered. Every rank raises
    when one failed."""
    left_out: list[Any] = []

    def make_local() -> Any:
        local = writer.prepare_local_plan(planner.create_local_plan())
        if others:
            local = dataclasses.replace(
                local, items=[i for i in local.items if i.index not in others]
            )
        if captured is None:
            return local
        # Only what was copied at the call is offered: DCP gives each replicated item to one
        # of the ranks offering it, so an item goes to a rank that holds its values of then.
        left_out.extend(i.index for i in local.items if i.index not in captured)
        return dataclasses.replace(local, items=[i for i in local.items if i.index in captured])

    def make_global(every: list[Any]) -> tuple[list[Any], Any]:
        plans, metadata = planner.create_global_plan(every)
        return writer.prepare_global_plan(plans), metadata

    exchanged = exchange_plans(make_local, make_global, group, rank, world)
    if exchanged.error is not None:
        _end(writer, rank == 0)
        raise CollectiveSaveError(f"planning the save failed, nothing saved: {exchanged.error}")
    return exchanged.plan, exchanged.plans, exchanged.extra, left_out


def _save_id(writer: Any) -> int:
    """The coordinator's save id as a number (0: the writer has none to share)."""
    try:
        value = int(str(writer.save_id), 16)
    except (AttributeError, ValueError):
        return 0
    return value if value < 1 << 62 else 0


def _end(writer: Any, coordinator: bool) -> None:
    """Drops the coordinator's mark of a running save (nothing will be published)."""
    if coordinator:
        try:
            writer.reset()
        except Exception:  # noqa: BLE001 - the save's own failure is the one to report
            pass
