"""Optimizers that own a test's tensors, so that a lazy save reads them lazily.

A lazy save reads after the call only what a fenced optimizer owns (its parameters and
state); everything else is copied at the call. Tests of the lazy machinery (the ring, the
fence's snapshots, the version checks) fence an optimizer over the tensors they save,
never stepped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch


def owner(tensors: Mapping[str, Any] | Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """An SGD optimizer (never stepped) whose parameters are ``tensors`` (a dict's values,
    nested dicts included)."""
    found: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(tensors if isinstance(tensors, Mapping) else list(tensors))
    unique = list({id(t): t for t in found}.values())
    return torch.optim.SGD(unique, lr=0.0)
