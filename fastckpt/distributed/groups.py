"""The process group fastckpt's collectives run on, and the node each rank runs on.

Checkpoint collectives never share a group with training: a background save's barrier on
the default group could interleave with the trainer's own collectives (both would hang or
mix their messages). :func:`checkpoint_group` makes one gloo group per default group, once,
and hands the same one to every caller; gloo because checkpoint traffic is host memory and
small control messages, and because it keeps running while NCCL streams are busy.

A rank's node comes from the launcher: ``FASTCKPT_NODE`` when set, else torchrun's
``GROUP_RANK``, else ``rank // LOCAL_WORLD_SIZE``; on its own a process is node 0.

Example (one process: no group, node 0):
    >>> checkpoint_group() is None
    True
    >>> node_rank({})
    0
    >>> node_rank({"FASTCKPT_NODE": "3"}), node_rank({"GROUP_RANK": "1"})
    (3, 1)
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch

from fastckpt import config
from fastckpt.distributed.handshake import handshake

__all__ = ["checkpoint_group", "in_group", "node_rank", "nodes_of_ranks"]

_lock = threading.Lock()
_groups: dict[int, Any] = {}  # id(default group) -> its checkpoint group


def in_group() -> bool:
    """Whether a process group of more than one rank is initialized."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def checkpoint_group() -> Any:
    """The gloo group over every rank that checkpoint collectives use (None without a
    process group of more than one rank).

    The first call is itself a collective (``new_group``): every rank must make it, in the
    same order as its other group creations, before any rank uses the group from a
    background thread. Later calls return the same group. Its collectives time out after
    ``FASTCKPT_GROUP_TIMEOUT`` seconds (:func:`fastckpt.config.group_timeout_seconds`).
    """
    if not in_group():
        return None
    dist = torch.distributed
    default = dist.distributed_c10d._get_default_group()
    with _lock:
        group = _groups.get(id(default))
        if group is None:
            # A rank that hangs (rather than dies) holds the others' checkpoint collectives
            # for this long: FASTCKPT_GROUP_TIMEOUT, 5 minutes unless set (not torch's 30).
            timeout = datetime.timedelta(seconds=config.group_timeout_seconds())
            # new_group waits for every rank: a rank that is not coming is named in seconds
            handshake(
                "fastckpt's checkpoint group",
                verb="made",
                advice="make the first CheckpointManager (or the first fastckpt call with "
                "group=True) on every rank",
            )
            group = dist.new_group(backend="gloo", timeout=timeout)
            _groups[id(default)] = group
        return group


def node_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's node: ``FASTCKPT_NODE``, else ``GROUP_RANK`` (torchrun), else
    ``RANK // LOCAL_WORLD_SIZE``, else 0."""
    env = os.environ if environ is None else environ
    for name in ("FASTCKPT_NODE", "GROUP_RANK"):
        value = env.get(name)
        if value is not None:
            return _non_negative(name, value)
    rank, local_world = env.get("RANK"), env.get("LOCAL_WORLD_SIZE")
    if rank is not None and local_world is not None:
        per_node = _non_negative("LOCAL_WORLD_SIZE", local_world)
        return _non_negative("RANK", rank) // max(per_node, 1)
    return 0


def nodes_of_ranks(group: Any = None) -> list[int]:
    """The node of every rank of ``group`` (default: :func:`checkpoint_group`), in rank
    order; ``[node_rank()]`` without a process group. A collective: every rank calls it."""
    group = checkpoint_group() if group is None else group
    if group is None:
        return [node_rank()]
    dist = torch.distributed
    mine = torch.tensor([node_rank()], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def _non_negative(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}") from None
    if number < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return number
