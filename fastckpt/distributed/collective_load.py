"""One DCP load across ranks on the checkpoint group, with the plan of the previous load
reused while both the state's structure and the checkpoint's are the same.

DCP plans every load as it plans every save: each rank's read plan is gathered by the
coordinator, which builds the global plan and scatters it back. A run that loads steps of
one structure again and again (evaluation, a restore after every failure) can skip that
round trip: a rank's read plan depends only on its state's structure and the checkpoint's
(its names, shapes, chunks), not on which files hold the bytes, which each load reads from
its own ``.metadata``.

The steps, on every rank of ``group``:

1. read ``.metadata``, set up the reader and the planner, hash the state's structure and
   the checkpoint's (:mod:`.plan_cache`);
2. **one all-reduce** (MAX of ``[failed rank + 1, plan missing]``);
3. the plan: reused from the cache when every rank may, else DCP's round trip;
4. read this rank's items;
5. one all-reduce of the outcome, so every rank raises when one failed.

What is reused: each rank's final read plan (its ``ReadItem`` list, after the reader's and
the planner's global step). What is not: ``.metadata`` (read at every load: it says which
file holds each item) and the reader's own setup.

Example (one process, no group):
    >>> import os, tempfile, torch
    >>> import torch.distributed.checkpoint as dcp
    >>> from fastckpt.dcp import FastCkptReader, FastCkptWriter
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = dcp.save({"w": torch.arange(3.0)}, storage_writer=FastCkptWriter(path), no_dist=True)
    >>> cache, state = PlanCache(), {"w": torch.zeros(3)}
    >>> load_collectively(state, FastCkptReader(path), cache)
    'planned'
    >>> load_collectively(state, FastCkptReader(path), cache), state["w"].tolist()
    ('cached', [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from fastckpt.distributed.plan_cache import HASH_BITS, PlanCache, structure_hash
from fastckpt.distributed.plan_exchange import all_max, exchange_plans
from fastckpt.errors import FastCkptError

__all__ = ["CollectiveLoadError", "load_collectively", "metadata_hash"]


class CollectiveLoadError(FastCkptError):
    """A collective load failed on some rank (its rank and error quoted)."""


def metadata_hash(metadata: Any) -> int:
    """A 62-bit digest of a DCP checkpoint's structure (``state_dict_metadata``: names,
    types, shapes, chunks), not of where its bytes are.

    Example:
        >>> from torch.distributed.checkpoint.metadata import Metadata
        >>> metadata_hash(Metadata({})) == metadata_hash(Metadata({}, storage_data={"x": 1}))
        True
    """
    digest = hashlib.blake2b(digest_size=8)
    for key in sorted(metadata.state_dict_metadata):
        digest.update(f"{key}|{metadata.state_dict_metadata[key]!r}\n".encode())
    return int.from_bytes(digest.digest(), "little") >> (64 - HASH_BITS)


def load_collectively(
    state: Any, reader: Any, cache: PlanCache, *, group: Any = None, planner: Any = None
) -> str:
    """Loads the checkpoint of the DCP ``reader`` into ``state`` in place (every rank of
    ``group`` calls it; None: this process alone), as the module describes; returns
    ``"cached"`` when the previous load's plan was reused, else ``"planned"``.

    Raises:
        CollectiveLoadError: a rank failed (the first failed rank quoted); this rank's own
            failure is raised as it is.
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    dist = torch.distributed
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    coordinator = rank == 0
    planner = planner if planner is not None else DefaultLoadPlanner()
    error: BaseException | None = None
    key = 0
    missed = True
    try:
        metadata = reader.read_metadata()
        reader.set_up_storage_reader(metadata, coordinator)
        planner.set_up_planner(state, metadata, coordinator)
        key = structure_hash(state) ^ metadata_hash(metadata)
        missed = not cache.matches(key)
    except Exception as exc:
        error = exc
    failed_rank, any_missed = all_max(group, [rank + 1 if error else 0, int(missed)])
    if failed_rank:
        _raise(error, f"rank {failed_rank - 1} failed reading the checkpoint's metadata")
    if not any_missed:
        plan, outcome = cache.plan, "cached"
    else:
        plan, outcome = _plan(planner, reader, group, rank, world), "planned"
    try:
        final = planner.finish_plan(plan)
        reader.read_data(final, planner).wait()
    except Exception as exc:
        error = exc
    (failed_rank,) = all_max(group, [rank + 1 if error else 0])
    if failed_rank:
        cache.forget()
        _raise(error, f"rank {failed_rank - 1} failed reading its part of the checkpoint")
    cache.keep(key, plan)
    return outcome


def _plan(planner: Any, reader: Any, group: Any, rank: int, world: int) -> Any:
    """DCP's planning round trip for a load; this rank's read plan (every rank raises when
    one failed)."""
    exchanged = exchange_plans(
        lambda: reader.prepare_local_plan(planner.create_local_plan()),
        lambda every: (
            reader.prepare_global_plan(planner.create_global_plan(every)),
            None,
        ),
        group,
        rank,
        world,
    )
    if exchanged.error is not None:
        raise CollectiveLoadError(f"planning the load failed: {exchanged.error}")
    return exchanged.plan


def _raise(own: BaseException | None, others: str) -> None:
    if own is not None:
        raise own
    raise CollectiveLoadError(others)
