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
parameter (FSDP, ZeRO) by the flat parameter. A DTensor (``nn.Parameter(DTensor)`` of
FSDP2's ``fully_shard`` or of tensor parallelism, and the optimizer state stepped with it)
has no storage of its own: it stands for its local tensor's memory (``to_local()``), which
for FSDP2 is a view into the parameter's padded flat shard. So an optimizer over DTensors
covers the local tensors of the DTensors that
``torch.distributed.checkpoint.state_dict.get_state_dict`` returns, and a saved DTensor is
covered when its local tensor is.

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

__all__ = ["FenceCover", "local_part"]


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The tensors ``optimizer.step()`` may change (DTensors as they are): its parameters
    and its state."""
    for group in optimizer.param_groups:
        yield from group["params"]
    for per_param in optimizer.state.values():
        if isinstance(per_param, dict):
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    yield value


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``t``'s bytes in this process: a DTensor's local tensor
    (``_local_tensor``, what ``to_local()`` views; a DTensor itself exposes no storage),
    else ``t``.

    Example:
        >>> w = torch.zeros(2)
        >>> local_part(w) is w
        True
    """
    # A DTensor subclass (nn.Parameter over a DTensor) has it too; a local tensor is never
    # a wrapper itself, but unwrap until plain, as a nested wrapper would need.
    while True:
        local = getattr(t, "_local_tensor", None)
        if not isinstance(local, torch.Tensor) or local is t:
            return t
        t = local


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
        # storage -> (extent, the optimizer's tensor, its local part): whose version
        # counters an in-place change of those bytes outside a step moves
        self._tensors: dict[tuple[Any, int], list[tuple[int, int, torch.Tensor, torch.Tensor]]]
        self._tensors = {}
        for optimizer in optimizers:
            for outer in _optimizer_tensors(optimizer):
                t = local_part(outer)
                key = _storage_key(t)
                if key is not None and t.numel():
                    first, end = _extent(t.detach())
                    spans.setdefault(key, []).append((first, end))
                    self._tensors.setdefault(key, []).append((first, end, outer, t))
        self._spans = {key: _merged(found) for key, found in spans.items()}

    def __bool__(self) -> bool:
        return bool(self._spans)

    def covers(self, t: torch.Tensor) -> bool:
        """Whether every byte of ``t`` (a DTensor: of its local tensor) lies in a fenced
        optimizer's tensor (an empty tensor is covered: it has no bytes to change)."""
        t = local_part(t)
        if t.numel() == 0:
            return True
        key = _storage_key(t)
        spans = self._spans.get(key) if key is not None else None
        if not spans:
            return False
        first, end = _extent(t)
        i = bisect.bisect_right(spans, (first, float("inf"))) - 1
        return i >= 0 and spans[i][0] <= first and end <= spans[i][1]

    def owners(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The fenced optimizers' tensors that share bytes with ``t``, with the local
        tensors of the DTensors among them: an in-place change of ``t``'s memory made
        through any of them moves one of their version counters (a DTensor's own counter
        moves, its local tensor's does not; and a state dict's ``param.detach()`` of a
        DTensor has a local tensor of its own, with a counter of its own).

        Example:
            >>> w = torch.zeros(4)
            >>> cover = FenceCover([torch.optim.SGD([w], lr=0.1)])
            >>> [o is w for o in cover.owners(w.detach()[1:])]
            [True]
        """
        t = local_part(t)
        key = _storage_key(t)
        if t.numel() == 0 or key is None:
            return []
        first, end = _extent(t)
        found: dict[int, torch.Tensor] = {}
        for start, stop, outer, local in self._tensors.get(key, ()):
            if start < end and first < stop:
                found.setdefault(id(outer), outer)
                found.setdefault(id(local), local)
        return list(found.values())

    def overlaps(self, t: torch.Tensor) -> bool:
        """Whether any byte of ``t`` lies in a covered tensor: a step of the optimizers
        this cover was made of may change ``t``.

        Example:
            >>> flat = torch.zeros(8)
            >>> cover = FenceCover([torch.optim.SGD([flat[4:]], lr=0.1)])
            >>> cover.overlaps(flat[2:6]), cover.overlaps(flat[:4]), cover.covers(flat[2:6])
            (True, False, False)
        """
        t = local_part(t)
        if t.numel() == 0:
            return False
        key = _storage_key(t)
        spans = self._spans.get(key) if key is not None else None
        if not spans:
            return False
        first, end = _extent(t)
        i = bisect.bisect_left(spans, (end,)) - 1  # the last span starting before ``end``
        return i >= 0 and spans[i][1] > first


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, the overlapping or touching ones merged."""
    merged: list[tuple[int, int]] = []
    for first, end in sorted(spans):
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((first, end))
    return merged
