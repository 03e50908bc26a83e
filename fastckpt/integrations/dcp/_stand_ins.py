"""The state dict a stager hands DCP for ``dcp.async_save``: the caller's containers copied,
non-tensor values deep-copied (so later changes to them are not saved), and each tensor
replaced by a stand-in, a new tensor object over the same memory whose id tells the writer
which live tensor a write item stands for.

A stand-in of a plain tensor is ``tensor.detach()``: it shares the tensor's storage and its
version counter, so an in-place change of either moves both. A DTensor's stand-in is a new
DTensor over its local tensor's ``detach()``.

Example:
    >>> import torch
    >>> w = torch.zeros(2)
    >>> keep = []
    >>> staged, live, labels = stand_in_structure({"m": {"w": w}, "cfg": [1]}, keep)
    >>> staged["m"]["w"] is w, live[id(keep[0])] is w, labels[id(keep[0])]
    (False, True, 'm.w')
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["stand_in", "stand_in_structure"]


def stand_in(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A new tensor object with ``value``'s metadata for DCP to plan on, and its local part."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value._local_tensor.detach()
        twin: torch.Tensor = DTensor.from_local(
            local,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
        return twin, local
    twin = value.detach()
    return twin, twin


def stand_in_structure(
    obj: Any, keep: list[torch.Tensor]
) -> tuple[Any, dict[int, torch.Tensor], dict[int, str]]:
    """A copy of ``obj``'s containers with tensors replaced by stand-ins and other values
    deep-copied; the id of each stand-in's local tensor -> the live (local) tensor it
    stands for, and -> its dotted path in ``obj`` (DCP's name for it). The stand-ins' local
    tensors are appended to ``keep`` (their ids stay unique while kept)."""
    live: dict[int, torch.Tensor] = {}
    labels: dict[int, str] = {}
    # A module-level walk, not a nested recursive function: that one would sit in a
    # reference cycle with ``keep`` until the garbage collector ran, and a stand-in must go
    # as soon as DCP drops the staged state (a lazy stage ends then).
    return _walk(obj, "", keep, live, labels), live, labels


def _walk(
    value: Any,
    path: str,
    keep: list[torch.Tensor],
    live: dict[int, torch.Tensor],
    labels: dict[int, str],
) -> Any:
    if isinstance(value, torch.Tensor):
        twin, local = stand_in(value)
        live[id(local)] = value._local_tensor if hasattr(value, "_local_tensor") else value
        labels[id(local)] = path
        keep.append(local)
        return twin
    if isinstance(value, dict):
        return {
            k: _walk(v, f"{path}.{k}" if path else str(k), keep, live, labels)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_walk(v, f"{path}.{i}", keep, live, labels) for i, v in enumerate(value)]
    if type(value) is tuple:
        return tuple(_walk(v, f"{path}.{i}", keep, live, labels) for i, v in enumerate(value))
    return copy.deepcopy(value)
