"""Runs of adjacent tensors, read as one byte range each, and tensors viewed out of the
memory the bytes land in. Shared by every reader (local files, URLs).

A CPU tensor taken out of an arena gets a storage of its own that starts at its first byte
and ends at its last (:func:`own_bytes`), over the arena's memory: no copy, and yet it
behaves as ``torch.load``'s tensors do (``storage_offset() == 0``, ``torch.save`` of it
writes its own bytes, ``torch.set_rng_state`` takes it). The arena lives until its last
tensor dies.

Example:
    >>> from fastckpt.format import TensorEntry
    >>> runs = tensor_runs([TensorEntry("b", "F32", (1,), 4, 8), TensorEntry("a", "F32", (1,), 0, 4)])
    >>> [(r.begin, r.end, [e.name for e in r.entries]) for r in runs]
    [(0, 8, ['a', 'b'])]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch

from fastckpt import format
from fastckpt.checkpoint import dtypes

__all__ = [
    "Run",
    "arena_exporter",
    "own_bytes",
    "place_runs",
    "placed",
    "tensor_runs",
    "tensor_view",
]


@dataclasses.dataclass
class Run:
    """Adjacent tensors read as one byte range; ``arena_pos`` is where ``begin`` lands."""

    begin: int
    end: int
    entries: list[format.TensorEntry]
    arena_pos: int = 0


def tensor_runs(entries: Iterable[format.TensorEntry]) -> list[Run]:
    """The entries grouped into runs of touching or overlapping byte ranges, in file order."""
    runs: list[Run] = []
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if runs and e.begin <= runs[-1].end:
            runs[-1].end = max(runs[-1].end, e.end)
            runs[-1].entries.append(e)
        else:
            runs.append(Run(e.begin, e.end, [e]))
    return runs


def placed(pos: int, offset: int, alignment: int) -> int:
    """The first arena position at or after ``pos`` that sits at ``offset`` modulo
    ``alignment``: bytes read from file offset ``offset`` keep their place in a page (so
    O_DIRECT stays possible) or in a GPU allocation's alignment (so dtypes stay aligned).

    Example:
        >>> placed(0, 8200, 4096), placed(10, 8200, 4096), placed(300, 64, 256)
        (8, 4104, 576)
    """
    return -(-pos // alignment) * alignment + offset % alignment if alignment > 1 else pos


def place_runs(runs: list[Run], base: int, alignment: int) -> int:
    """Sets each run's ``arena_pos`` one after the other, each at its offset ``base + begin``
    modulo ``alignment`` (see :func:`placed`); returns the arena's size. Every arena of
    tensors (CPU loads, GPU loads, URLs) is laid out here.

    Example:
        >>> runs = [Run(0, 10, []), Run(100, 104, [])]
        >>> place_runs(runs, 8, 64), [r.arena_pos for r in runs]
        (112, [8, 108])
    """
    pos = 0
    for run in runs:
        pos = placed(pos, base + run.begin, alignment)
        run.arena_pos = pos
        pos += run.end - run.begin
    return pos


def arena_exporter(arena: torch.Tensor) -> Any:
    """A buffer-protocol object over a CPU ``arena`` that keeps it alive, for
    :func:`own_bytes` (made once per arena, shared by its tensors)."""
    return arena.numpy() if arena.device.type == "cpu" else None


def own_bytes(arena: torch.Tensor, start: int, nbytes: int, exporter: Any = None) -> torch.Tensor:
    """Bytes ``arena[start : start + nbytes]`` as a uint8 tensor with a storage of its own
    over the same memory (CPU), so ``storage_offset()`` is 0 and ``untyped_storage()`` holds
    only these bytes; the arena is freed when the last such tensor dies. Device arenas give
    a plain view.

    Example:
        >>> arena = torch.arange(16, dtype=torch.uint8)
        >>> part = own_bytes(arena, 4, 8)
        >>> part.storage_offset(), part.untyped_storage().nbytes(), part.data_ptr() - arena.data_ptr()
        (0, 8, 4)
    """
    if arena.device.type != "cpu" or nbytes == 0:
        return arena[start : start + nbytes]
    if exporter is None:
        exporter = arena_exporter(arena)
    # frombuffer holds the exporter (a numpy array holding the arena) until the storage dies
    return torch.frombuffer(exporter, dtype=torch.uint8, count=nbytes, offset=start)


def tensor_view(
    arena: torch.Tensor, start: int, e: format.TensorEntry, exporter: Any = None
) -> torch.Tensor:
    """The tensor of ``e`` whose bytes start at ``arena[start]``: on the CPU over the arena's
    memory with a storage of its own (see :func:`own_bytes`), on a device a view."""
    dtype = dtypes.to_torch(e.dtype)
    shape = dtypes.torch_shape(e.dtype, e.shape, tensor=e.name)
    if e.nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=arena.device)
    address = arena.data_ptr() + start
    if address % dtype.itemsize:
        # files from other writers may not align tensors to their dtype
        return arena[start : start + e.nbytes].clone().view(dtype).view(shape)
    return own_bytes(arena, start, e.nbytes, exporter).view(dtype).view(shape)
