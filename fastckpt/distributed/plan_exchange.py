"""The collectives that multi-rank saves and loads share: an all-reduce of flags, a gather
to the coordinator, and DCP's planning round trip (every rank's local plan gathered, the
global plans made by rank 0, each rank's scattered back), whose failures every rank hears of.

Every function takes ``group=None`` for one process alone (no collective runs).

Example (one process):
    >>> all_max(None, [0, 3])
    [0, 3]
    >>> out = exchange_plans(lambda: "mine", lambda every: (every, "extra"), None, 0, 1)
    >>> out.plan, out.plans, out.extra, out.error
    ('mine', ['mine'], 'extra', None)
    >>> exchange_plans(lambda: 1 / 0, lambda every: (every, None), None, 0, 1).error
    'rank 0: ZeroDivisionError: division by zero'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Exchanged", "all_max", "exchange_plans", "gather_to_coordinator"]


def all_max(group: Any, values: list[int]) -> list[int]:
    """The element-wise maximum of ``values`` over every rank of ``group`` (one all-reduce):
    how ranks agree on flags ("some rank failed", "some rank's cached plan is stale")."""
    if group is None:
        return values
    flags = torch.tensor(values, dtype=torch.int64)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
    return [int(v) for v in flags.tolist()]


def gather_to_coordinator(
    group: Any, value: Any, coordinator: bool, world: int
) -> list[Any] | None:
    """Every rank's ``value`` in rank order on rank 0 (None on the others)."""
    if group is None:
        return [value]
    every: list[Any] | None = [None] * world if coordinator else None
    torch.distributed.gather_object(value, every, group=group, group_dst=0)
    return every


@dataclasses.dataclass
class Exchanged:
    """The outcome of :func:`exchange_plans` on one rank: its plan, and on rank 0 every
    rank's plan and what ``make_global`` returned beside them; or, on every rank alike, the
    failure (``error``, naming the rank) and no plan."""

    plan: Any = None
    plans: list[Any] | None = None
    extra: Any = None
    error: str | None = None


def exchange_plans(
    make_local: Callable[[], Any],
    make_global: Callable[[list[Any]], tuple[list[Any], Any]],
    group: Any,
    rank: int,
    world: int,
) -> Exchanged:
    """DCP's planning round trip: ``make_local()`` on every rank, ``make_global(every local
    plan)`` (``(plans, extra)``) on rank 0, each rank's plan scattered back. A failure of any
    rank's step reaches every rank as :attr:`Exchanged.error`, so none is left waiting."""
    failure = "error"  # a plan slot holding (failure, message) carries an error, not a plan
    local: Any
    try:
        local = make_local()
    except Exception as exc:
        local = (failure, f"rank {rank}: {type(exc).__name__}: {exc}")
    every = gather_to_coordinator(group, local, rank == 0, world)
    out: list[Any] = [None] * world
    plans: list[Any] | None = None
    extra: Any = None
    if rank == 0:
        assert every is not None
        failures = [p[1] for p in every if _is_failure(p, failure)]
        if failures:
            out = [(failure, "; ".join(failures))] * world
        else:
            try:
                plans, extra = make_global(every)
                out = list(plans)
            except Exception as exc:
                plans = None
                out = [(failure, f"rank 0 planning: {type(exc).__name__}: {exc}")] * world
    if group is None:
        mine = out[0]
    else:
        received: list[Any] = [None]
        torch.distributed.scatter_object_list(
            received, out if rank == 0 else None, group=group, group_src=0
        )
        mine = received[0]
    if _is_failure(mine, failure):
        return Exchanged(error=mine[1])
    return Exchanged(plan=mine, plans=plans, extra=extra)


def _is_failure(slot: Any, failure: str) -> bool:
    return isinstance(slot, tuple) and len(slot) == 2 and slot[0] == failure
