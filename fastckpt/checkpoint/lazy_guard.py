"""What keeps a lazy asynchronous save true to the values at call time.

``async_save(state, path, fence=optimizer)`` returns without copying a byte; a background
thread then streams each tensor through a fixed ring of staging buffers to the file while
training goes on. Parameters and optimizer state do not change until the next
``optimizer.step()``, so the copy overlaps the next forward and backward passes. Two things
hold the file to the values at call time:

- **the fence** (held off): an ``Optimizer.register_step_pre_hook`` on each fenced optimizer
  runs :meth:`LazyGuard.fence` before its next step. The fence snapshots the tensors the
  writer has not reached into ordinary host memory (so the step goes on at once) and waits
  only for the tensor being copied now. ``fence_bytes`` caps that memory: past it, the fence
  waits for the writer to copy the rest through the ring, at the storage's speed. Other
  mutators (EMA updates, manual loops, schedulers that touch tensors) call
  ``future.fence()`` themselves first.
- **the version check** (detected): each tensor's version counter (``tensor._version``),
  recorded at call time, is compared before its first byte is copied and after its last.
  A tensor changed in between fails the save: ``result()`` raises a
  :class:`fastckpt.LazySaveError`
  naming it and how to fence it. A silently mixed checkpoint is never committed.

What the version counter cannot see: writes through ``tensor.data`` or ``.numpy()`` views,
writes from other processes (shared memory), and CUDA kernels queued on other streams
after the call. Fence those writers explicitly (``future.fence()``), or take the default
snapshot (``async_save`` without ``fence``), which copies everything before returning.

Example:
    >>> import torch
    >>> w = torch.zeros(3)
    >>> guard = LazyGuard({"w": w}, fence_bytes=None)
    >>> w.add_(1)  # changed before the writer copied it, with no fence
    tensor([1., 1., 1.])
    >>> try:
    ...     guard.source("w")
    ... except LazySaveError as exc:
    ...     print(str(exc).split(":")[0])
    tensor 'w' changed after async_save(lazy) was called and before its bytes were copied
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from fastckpt.errors import LazySaveError

__all__ = ["LazyGuard", "LazySaveError"]

_HOW_TO_FENCE = (
    "pass the optimizer that changes it as async_save(..., fence=optimizer), call "
    "future.fence() before any other in-place update (EMA, manual loops), or save "
    "without fence= to snapshot everything before async_save returns"
)


class LazyGuard:
    """The per-save state shared by the writer thread and the fence (see the module's
    description). Tensor names are the plan's stored names."""

    def __init__(self, tensors: dict[str, torch.Tensor], *, fence_bytes: int | None):
        self._tensors = tensors
        self._versions = {name: t._version for name, t in tensors.items()}
        self._fence_bytes = fence_bytes
        self._lock = threading.Condition()
        self._copying: str | None = None  # the tensor the writer reads now
        self._done: set[str] = set()  # copied (or snapshotted, see _snapshots)
        self._snapshots: dict[str, torch.Tensor] = {}
        self._finished = False
        self._fenced_on: list[torch.optim.Optimizer] = []
        self.snapshot_bytes = 0  # host memory the fences took, for the docs' figures
        self._ready = _cuda_event_for(tensors.values())

    # -- the writer's side ------------------------------------------------------------------
    def source(self, name: str) -> torch.Tensor:
        """The tensor to copy for ``name``: its snapshot if a fence took one, else the tensor
        itself, checked unchanged since the call (LazySaveError otherwise)."""
        if self._ready is not None:
            self._ready.synchronize()  # work queued before the call is in the tensors
            self._ready = None
        with self._lock:
            snap = self._snapshots.pop(name, None)
            if snap is not None:
                return snap
            self._check(name, "before its bytes were copied")
            self._copying = name
            return self._tensors[name]

    def copied(self, name: str) -> None:
        """The writer copied every byte of ``name``: checked unchanged meanwhile."""
        with self._lock:
            try:
                if self._copying == name:
                    self._check(name, "while its bytes were copied")
            finally:
                self._copying = None
                self._done.add(name)
                self._lock.notify_all()

    def finish(self) -> None:
        """The save ended (committed or failed): fences return at once; no step fences it."""
        with self._lock:
            self._finished = True
            self._snapshots.clear()
            self._tensors = {}  # the future outlives the save: it must not keep the state
            self._lock.notify_all()
        with _fenced_lock:
            for optimizer in self._fenced_on:
                pending = _fenced.get(optimizer, [])
                if self in pending:
                    pending.remove(self)
        self._fenced_on.clear()

    def _check(self, name: str, when: str) -> None:
        now = self._tensors[name]._version
        if now != self._versions[name]:
            raise LazySaveError(
                f"tensor {name!r} changed after async_save(lazy) was called and {when}: "
                f"its version counter moved from {self._versions[name]} to {now}, so the "
                f"checkpoint would mix values of two steps and was not committed; "
                f"{_HOW_TO_FENCE}"
            )

    # -- the trainer's side -----------------------------------------------------------------
    def fence(self) -> None:
        """Returns once the tensors may change: every tensor not yet copied is snapshotted
        into host memory (within ``fence_bytes``; past it, waited for), and the one being
        copied now is waited for."""
        with self._lock:
            if self._finished:
                return
            budget = self._fence_bytes
            for name, tensor in self._tensors.items():
                if name in self._done or name in self._snapshots or name == self._copying:
                    continue
                nbytes = tensor.numel() * tensor.element_size()
                if budget is not None and nbytes > budget:
                    continue  # left for the writer: waited for below
                if tensor._version != self._versions[name]:
                    continue  # changed unfenced: the writer fails the save, not this step
                self._snapshots[name] = tensor.detach().to("cpu", copy=True)
                self.snapshot_bytes += nbytes
                if budget is not None:
                    budget -= nbytes
            while not self._finished and any(
                n not in self._done and n not in self._snapshots for n in self._tensors
            ):
                self._lock.wait()

    def fence_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Runs :meth:`fence` before the next step of each optimizer."""
        for optimizer in optimizers:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    "fence takes a torch.optim.Optimizer or a list of them, got "
                    f"{type(optimizer).__name__}"
                )
            with _fenced_lock:
                pending = _fenced.get(optimizer)
                if pending is None:
                    pending = _fenced[optimizer] = []
                    optimizer.register_step_pre_hook(_fence_pending_saves)
                pending.append(self)
            self._fenced_on.append(optimizer)


# One step pre-hook per fenced optimizer, kept for the optimizer's life: it fences the lazy
# saves pending on it. Saves come and go through this registry rather than by adding and
# removing hooks, since a save ends on its own thread, and removing a hook there while a
# step iterates the optimizer's hooks breaks that step ("OrderedDict mutated during
# iteration").
_fenced_lock = threading.Lock()
_fenced: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[LazyGuard]] = (
    weakref.WeakKeyDictionary()
)


def _fence_pending_saves(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    with _fenced_lock:
        pending = list(_fenced.get(optimizer, ()))
    for guard in pending:
        guard.fence()


def _after_fork_in_child() -> None:
    global _fenced_lock
    _fenced_lock = threading.Lock()  # a save thread of the parent may have held it
    _fenced.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _cuda_event_for(tensors: Iterable[torch.Tensor]) -> Any:
    """An event after the work queued on the current CUDA stream at call time, when any
    tensor is on a GPU (the writer thread waits for it before its first copy)."""
    if not any(t.device.type == "cuda" for t in tensors):
        return None
    event = torch.cuda.Event()
    event.record()
    return event
