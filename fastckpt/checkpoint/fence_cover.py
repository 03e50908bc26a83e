"""What a lazy save's fence owns: the memory of the fenced optimizers' parameters and state.

A lazy ``async_save`` reads a tensor after the call only when something holds it still
until the writer has copied it. The fence (a step pre-hook on each fenced optimizer) holds
still exactly what those optimizers change: the parameters of their ``param_groups`` and
the tensors of their ``state`` (moments, momentum buffers, step counters). Everything else
in a state dict -- BatchNorm's running statistics (changed by every forward pass, with no
version bump), EMA copies, buffers, tensors of another optimizer -- has no fence, so it is
copied at the call (:class:`~fastckpt.checkpoint.lazy_guard.LazyGuard`).

A saved tensor is covered when its bytes lie inside one covered tensor's bytes on the same
storage: a state dict's ``param.detach()`` is covered by ``param``, and a view into a flat
parameter (FSDP, ZeRO) by the flat parameter.

Example:
    >>> import torch
    >>> model = torch.nn.BatchNorm1d(4)
    >>> cover = FenceCover([torch.optim.SGD(model.parameters(), lr=0.1)])
    >>> state = model.state_dict()
    >>> cover.covers(state["weight"]), cover.covers(state["running_mean"])
    (True, False)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["FenceCover"]


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The tensors ``optimizer.step()`` may change: its parameters and its state."""
    for group in optimizer.param_groups:
        yield from group["params"]
    for per_param in optimizer.state.values():
        if isinstance(per_param, dict):
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    yield value


def _storage_key(t: torch.Tensor) -> tuple[Any, int] | None:
    """The device and base address of ``t``'s storage (None when it has none to read)."""
    try:
        return t.device, t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, meta, functional wrappers
        return None


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte addresses ``[first, end)`` that ``t``'s elements span (its strides' reach)."""
    first = t.data_ptr()
    if t.numel() == 0:
        return first, first
    reach = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    low = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride < 0)
    start = first + low * t.element_size()
    return start, start + (reach + 1) * t.element_size()


class FenceCover:
    """The memory of ``optimizers``' parameters and state, at the time it is made.

    Optimizer state made later (an optimizer's first step creates it) is not covered: it
    did not exist at the call, so no saved tensor can be it.
    """

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer] = ()):
        spans: dict[tuple[Any, int], list[tuple[int, int]]] = {}
        for optimizer in optimizers:
            for t in _optimizer_tensors(optimizer):
                key = _storage_key(t)
                if key is not None and t.numel():
                    spans.setdefault(key, []).append(_extent(t.detach()))
        self._spans = {key: _merged(found) for key, found in spans.items()}

    def __bool__(self) -> bool:
        return bool(self._spans)

    def covers(self, t: torch.Tensor) -> bool:
        """Whether every byte of ``t`` lies in a fenced optimizer's tensor (an empty tensor
        is covered: it has no bytes to change)."""
        if t.numel() == 0:
            return True
        key = _storage_key(t)
        spans = self._spans.get(key) if key is not None else None
        if not spans:
            return False
        first, end = _extent(t)
        i = bisect.bisect_right(spans, (first, float("inf"))) - 1
        return i >= 0 and spans[i][0] <= first and end <= spans[i][1]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, the overlapping or touching ones merged."""
    merged: list[tuple[int, int]] = []
    for first, end in sorted(spans):
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((first, end))
    return merged
