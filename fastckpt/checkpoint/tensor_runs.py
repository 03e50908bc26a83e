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

__all__ = ["Run", "tensor_runs", "tensor_view"]


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
