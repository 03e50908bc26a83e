"""One DCP save across ranks, run where the caller likes (a background thread) on a process
group of its own, with the plans of the previous save reused while the state's structure
stays the same, and one agreement before anything is published.

The steps, on every rank of ``group`` (the checkpoint group: never the training one):

1. the coordinator runs ``prepare`` (it clears what an earlier try left); every rank sets up
   its planner and writer and hashes its state's structure (:mod:`.plan_cache`);
2. **one all-reduce** (MAX of ``[failed rank + 1, plan missing, save id]``): whether every
   rank is ready, whether every rank's cached plan still fits, and the coordinator's save id
   (so every rank names its file for this save without asking);
3. plans: reused from the cache when every rank may; else DCP's round trip (each local plan
   gathered, the global plan and metadata built by the coordinator, the plans scattered),
   whose outcome the cache then keeps;
4. every rank writes its file (durable on return);
5. the coordinator gathers every rank's outcome and results; only when every rank succeeded
   does it publish (``writer.finish``: ``.metadata``) and run ``commit`` (the step's marker);
6. it broadcasts the outcome, so each rank returns or raises the same failure, naming the
   rank that failed and why.

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

import time
from collections.abc import Callable
from typing import Any

import torch

from fastckpt.distributed.plan_cache import PlanCache, structure_hash
from fastckpt.distributed.plan_exchange import (
    all_max,
    exchange_plans,
    gather_to_coordinator,
)
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
) -> str:
    """Saves this rank's share of ``state`` with the DCP ``writer`` (every rank of ``group``
    calls it; None: this process alone), as the module describes; returns ``"cached"`` when
    the plans of the previous save were reused, else ``"planned"``. A rank whose state
    could not be captured still calls it, with that error as ``failed``: the others then
    fail at the agreement instead of waiting for it.

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
    except BaseException as exc:  # noqa: BLE001 - the others must hear of it
        error = exc
    save_id = _save_id(writer) if coordinator and error is None else 0
    failed_rank, any_missed, agreed_id = all_max(
        group, [rank + 1 if error else 0, int(missed), save_id]
    )
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
        plan, plans, metadata = _plan(planner, writer, group, rank, world)
    timings["plan"] = time.perf_counter() - started

    results: list[Any] = []
    try:
        if error is None:
            final = planner.finish_plan(plan)
            written = writer.write_data(final, planner)
            written.wait()
            results = written.value()
    except BaseException as exc:  # noqa: BLE001 - every rank must hear of it, whatever it is
        error = exc
    mine = (f"{type(error).__name__}: {error}" if error is not None else None, results)
    gathered = gather_to_coordinator(group, mine, coordinator, world)
    verdict: list[Any] = [None]
    if coordinator:
        assert gathered is not None
        failures = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e is not None]
        if failures:
            verdict[0] = "; ".join(failures)
        else:
            try:
                writer.finish(metadata, [rs for _, rs in gathered])
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
    cache.keep(structure, plan, plans if coordinator else None, metadata)
    return outcome


def _plan(
    planner: Any, writer: Any, group: Any, rank: int, world: int
) -> tuple[Any, list[Any] | None, Any]:
    """DCP's planning round trip; this rank's plan, and on the coordinator every plan and
    the metadata. Every rank raises when one failed."""

    def make_global(every: list[Any]) -> tuple[list[Any], Any]:
        plans, metadata = planner.create_global_plan(every)
        return writer.prepare_global_plan(plans), metadata

    exchanged = exchange_plans(
        lambda: writer.prepare_local_plan(planner.create_local_plan()),
        make_global,
        group,
        rank,
        world,
    )
    if exchanged.error is not None:
        _end(writer, rank == 0)
        raise CollectiveSaveError(f"planning the save failed, nothing saved: {exchanged.error}")
    return exchanged.plan, exchanged.plans, exchanged.extra


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
