"""Runs of adjacent tensors, read as one byte range each, and tensors viewed out of the
memory the bytes land in. Shared by every reader (local files, URLs).

Example:
    >>> from fastckpt.format import TensorEntry
    >>> runs = tensor_runs([TensorEntry("b", "F32", (1,), 4, 8), TensorEntry("a", "F32", (1,), 0, 4)])
    >>> [(r.begin, r.end, [e.name for e in r.entries]) for r in runs]
    [(0, 8, ['a', 'b'])]
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from fastckpt import format
from fastckpt.checkpoint import dtypes

__all__ = ["Run", "place_runs", "placed", "tensor_runs", "tensor_view"]


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


def tensor_view(arena: torch.Tensor, start: int, e: format.TensorEntry) -> torch.Tensor:
    """The tensor of ``e`` whose bytes start at ``arena[start]``, as a view where possible."""
    dtype = dtypes.to_torch(e.dtype)
    shape = dtypes.torch_shape(e.dtype, e.shape, tensor=e.name)
    if e.nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=arena.device)
    raw = arena[start : start + e.nbytes]
    if raw.data_ptr() % raw.new_empty(0, dtype=dtype).element_size():
        raw = raw.clone()  # files from other writers may not align tensors to their dtype
    return raw.view(dtype).view(shape)
