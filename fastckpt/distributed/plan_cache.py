"""What a collective save or load may reuse from the previous one: its plans and metadata,
while the state's structure stays the same.

DCP plans every save afresh: each rank plans locally, the coordinator gathers every plan,
builds the global plan and the metadata, and scatters the plans back. At hundreds of ranks
that round trip dominates a save whose bytes take a second. But a training loop saves the
same structure every time (the same names, shapes, dtypes and placements; only the values
change), so the plans of the previous save fit the next one.

:func:`structure_hash` condenses one rank's state into 62 bits from exactly what a plan
depends on (every key's path; for a tensor its dtype, shape, stride and layout; for a
DTensor also its mesh, placements and local shape; for any other value only that it is
one). :class:`PlanCache` keeps, per rank, the hash and what was planned for it, and every
rank's hash at that save; the ranks then agree in one all-reduce (each says whether its hash
equals its cached one, and the digest of every rank's cached hashes) and reuse the plans only
when every rank may and every rank's cache was made for the same structures.

Example:
    >>> import torch
    >>> a = structure_hash({"w": torch.zeros(2, 3), "step": 1})
    >>> a == structure_hash({"w": torch.ones(2, 3), "step": 7})  # values do not count
    True
    >>> a == structure_hash({"w": torch.zeros(3, 2), "step": 1})  # shapes do
    False
    >>> cache = PlanCache()
    >>> cache.matches(a)
    False
    >>> cache.keep(a, plan="rank plan")
    >>> cache.matches(a), cache.plan
    (True, 'rank plan')
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["PlanCache", "structure_hash"]

#: Hashes fit an int64 with room for its negation (they travel in all-reduces).
HASH_BITS = 62


def structure_hash(state: Any) -> int:
    """A 62-bit digest of ``state``'s structure: what DCP's plans depend on, not the values.

    Example:
        >>> import torch
        >>> structure_hash({"a": torch.zeros(1)}) != structure_hash({"b": torch.zeros(1)})
        True
    """
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, state, "")
    return int.from_bytes(digest.digest(), "little") >> (64 - HASH_BITS)


def _feed(digest: Any, value: Any, path: str) -> None:
    if isinstance(value, torch.Tensor):
        digest.update(f"{path}|{_tensor_key(value)}\n".encode())
    elif isinstance(value, Mapping):
        digest.update(f"{path}|dict{len(value)}\n".encode())
        for key, item in value.items():
            _feed(digest, item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        digest.update(f"{path}|{type(value).__name__}{len(value)}\n".encode())
        for index, item in enumerate(value):
            _feed(digest, item, f"{path}.{index}")
    else:  # saved as bytes: the plan holds one bytes item, whatever the value
        digest.update(f"{path}|object\n".encode())


def _tensor_key(tensor: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    # not requires_grad: DCP plans on detached stand-ins, which never require it
    common = f"{tensor.dtype}|{tuple(tensor.shape)}|{tensor.stride()}|{tensor.layout}"
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        local = tensor._local_tensor
        return (
            f"{common}|dtensor|{mesh.device_type}|{tuple(mesh.mesh.shape)}"
            f"|{mesh.mesh.flatten().tolist()}|{tensor.placements}|{tuple(local.shape)}"
        )
    return common


@dataclasses.dataclass
class PlanCache:
    """The plans of one rank's previous collective save (or load), reused while its
    state's :func:`structure_hash` stays the same.

    ``plan`` is this rank's final plan; on the coordinator ``plans`` are every rank's and
    ``metadata`` the global metadata (a load keeps only its own plan).
    """

    hash: int | None = None
    plan: Any = None
    plans: list[Any] | None = None
    metadata: Any = None
    #: Every rank's structure hash when the plans were made, in rank order (None: unknown).
    hashes: tuple[int, ...] | None = None
    #: Whether the ranks' replicated items differed at the last save that compared them
    #: (:mod:`.replicated_items`): a capture without a plan to reuse then copies every
    #: replicated item. Kept by :meth:`forget`: it is what the failed save learnt.
    replicas_differ: bool = False
    #: The owners of the replicated items at the cached save
    #: (:class:`~fastckpt.distributed.replicated_items.Assignment`): the same while the
    #: structure is, so a save that reuses the plans need not compute them again.
    replicas: Any = None

    def matches(self, structure: int) -> bool:
        """Whether the cached plans were made for a state of this structure."""
        return self.hash is not None and self.hash == structure

    def keep(
        self,
        structure: int,
        plan: Any,
        plans: list[Any] | None = None,
        metadata: Any = None,
        hashes: tuple[int, ...] | None = None,
        replicas: Any = None,
    ) -> None:
        """Records the plans of a save (or load) that succeeded on every rank (``hashes``:
        every rank's structure hash then, which :meth:`fingerprint` condenses;
        ``replicas``: the owners of the replicated items then)."""
        self.hash, self.plan, self.plans, self.metadata = structure, plan, plans, metadata
        self.hashes, self.replicas = hashes, replicas

    def fingerprint(self) -> int:
        """A 62-bit digest of every rank's structure hash at the cached save (0: none
        cached). Ranks whose caches agree have the same fingerprint: one all-reduce of
        ``[f, -f]`` (MAX) tells whether every rank's is the same (``max f == -max -f``).

        Example:
            >>> cache = PlanCache()
            >>> cache.fingerprint()
            0
            >>> cache.keep(5, "plan", hashes=(5, 9))
            >>> cache.fingerprint() == PlanCache(hashes=(5, 9)).fingerprint() != 0
            True
        """
        if self.hashes is None:
            return 0
        digest = hashlib.blake2b(repr(tuple(self.hashes)).encode(), digest_size=8)
        return (int.from_bytes(digest.digest(), "little") >> (64 - HASH_BITS)) or 1

    def forget(self) -> None:
        """Drops the plans: the next save plans afresh (after a failure, the ranks may
        disagree about what was cached)."""
        self.hash = self.plan = self.plans = self.metadata = self.hashes = None
        self.replicas = None
