"""Which rank writes each replicated item of a multi-rank save, decided by every rank alone.

DCP gives each item that several ranks offer (a plain tensor or value of the same name on
every rank, as in DDP; a DTensor placed ``Replicate()``) to one of them only after its
planning round trip: every rank must copy such items at the call in case it is the one.
Here the choice is a function of what every rank holds alike, so each rank knows before
the call which replicated items are its own, copies only those, and offers only those.

The items assigned this way (:func:`assign`) are the ones every rank of the save holds
whole: every plain tensor and every non-tensor value of the state (DCP plans them on every
rank under the same name), and every DTensor whose placements are all ``Replicate()`` over
a mesh of every rank. They are sorted by size (largest first), then name, and each goes to
the rank with the fewest bytes so far (the lowest rank on a tie): the bytes balance over
the ranks, and every rank that holds the same items computes the same owners. Values
saved as bytes (no size) come last, so the tensors' owners do not depend on them; a rank
keeps deep copies of every value at the call whatever their owner, so a value is never
lost when the ranks' values differ.

Whether every rank does hold the same items is known only when they meet: each rank's
:attr:`Assignment.digest` (of the items, their sizes and the number of ranks) travels in the
save's first all-reduce, and the assignment holds only where every rank's is the same.
DTensors replicated over part of the ranks (an HSDP mesh's ``Replicate`` dimension) are
not assigned here: DCP's planner picks their writers.

Example:
    >>> import torch
    >>> state = {"w": torch.zeros(4), "b": torch.zeros(2), "step": 3}
    >>> two = assign(state, 2)
    >>> sorted((i.fqn, r) for i, r in two.owners.items())
    [('b', 1), ('step', 1), ('w', 0)]
    >>> sorted(i.fqn for i in two.others(1))
    ['w']
    >>> two.digest == assign({"w": torch.ones(4), "b": torch.ones(2), "step": 9}, 2).digest
    True
    >>> two.digest == assign(state, 3).digest  # another number of ranks: another rule
    False
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
from collections.abc import Container, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["AllBut", "Assignment", "assign"]

#: Digests fit an int64 with room for their negation (they travel in all-reduces).
DIGEST_BITS = 62


@dataclasses.dataclass(frozen=True)
class AllBut(Container[MetadataIndex]):
    """Every item except ``left``: what a rank captured when it copied all of its state but
    the replicated items that other ranks write.

    Example:
        >>> w, b = MetadataIndex("w"), MetadataIndex("b")
        >>> w in AllBut(frozenset({b})), b in AllBut(frozenset({b}))
        (True, False)
    """

    left: frozenset[MetadataIndex]

    def __contains__(self, index: object) -> bool:
        return index not in self.left


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The writer of each replicated item (``owners``: item index -> rank) and the digest
    every rank compares to know that all of them computed the same owners."""

    owners: dict[MetadataIndex, int]
    digest: int

    def others(self, rank: int) -> frozenset[MetadataIndex]:
        """The replicated items that ranks other than ``rank`` write."""
        return frozenset(i for i, owner in self.owners.items() if owner != rank)

    def others_tensors(self, rank: int) -> frozenset[MetadataIndex]:
        """The replicated tensors that ranks other than ``rank`` write (without the values
        saved as bytes, which a capture keeps whatever their owner: deep copies)."""
        return frozenset(i for i in self.others(rank) if i.offset is not None)

    def own(self, rank: int) -> list[MetadataIndex]:
        """The replicated items that ``rank`` writes."""
        return [i for i, owner in self.owners.items() if owner == rank]


def assign(state: Mapping[str, Any], world: int) -> Assignment:
    """The owners of ``state``'s replicated items among ``world`` ranks (see the module).

    ``state`` is a state dict as DCP takes it (nested or already flattened: DCP's dotted
    names are the items' names either way).

    Example:
        >>> import torch
        >>> got = assign({"m": {"w": torch.zeros(8)}, "v": torch.zeros(2)}, 2).owners
        >>> sorted((i.fqn, tuple(i.offset), r) for i, r in got.items())
        [('m.w', (0,), 0), ('v', (0,), 1)]
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(dict(state))
    sized: list[tuple[int, str, MetadataIndex]] = []
    for fqn, value in flat.items():
        index = _replicated_index(fqn, value, world)
        if index is not None:
            size = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
            sized.append((size, fqn, index))
    sized.sort(key=lambda s: (-s[0], s[1]))
    least = [(0, rank) for rank in range(max(world, 1))]  # (bytes so far, rank): a heap
    owners: dict[MetadataIndex, int] = {}
    digest = hashlib.blake2b(f"world {world}\n".encode(), digest_size=8)
    for size, fqn, index in sized:
        load, owner = least[0]
        # a value (no size) adds nothing: the tensors' owners do not depend on the values
        heapq.heapreplace(least, (load + size, owner))
        owners[index] = owner
        digest.update(f"{fqn}|{tuple(index.offset or ())}|{size}\n".encode())
    value = int.from_bytes(digest.digest(), "little") >> (64 - DIGEST_BITS)
    return Assignment(owners, value or 1)


def _replicated_index(fqn: str, value: Any, world: int) -> MetadataIndex | None:
    """DCP's index of the one write item ``value`` makes when every rank holds it whole;
    None for anything else (a shard, a DTensor replicated over part of the ranks)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, DTensor):
        mesh = value.device_mesh
        whole = all(isinstance(p, Replicate) for p in value.placements)
        if not whole or mesh.size() != world or mesh.get_coordinate() is None:
            return None
        return MetadataIndex(fqn, torch.Size([0] * value.dim()))
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            return None  # a tensor subclass (a ShardedTensor's pieces): DCP plans it itself
        return MetadataIndex(fqn, torch.Size([0] * value.dim()))
    return MetadataIndex(fqn)  # a value saved as bytes: one item of this name on every rank
