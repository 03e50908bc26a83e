"""``dcp.async_save`` that copies nothing before it returns: :class:`FastCkptLazyStager`.

DCP's own staging (and :class:`~fastckpt.integrations.dcp.writer.FastCkptWriter`'s) copies
the state into host memory before ``dcp.async_save`` returns: a pause the length of one
copy of the state, and host memory its size. The lazy stager returns at once: its
``stage`` records the state (each tensor's version counter, non-tensor values
deep-copied) and hands DCP stand-ins over the live tensors; the writer's ``write_data``
then streams each tensor through fastckpt's fixed page-locked ring
(:func:`fastckpt.checkpoint.asynchronous.lazy_ring`) into the rank file, guarded as a lazy
``fastckpt.async_save`` is (:mod:`fastckpt.checkpoint.lazy_guard`, the same guard):

- ``fence=optimizer`` (or a list): the optimizer's next ``step()`` first snapshots the
  tensors the writer has not reached (host memory for CPU tensors; for CUDA tensors
  clones in device memory, the current stream made to wait on them), within
  ``fence_bytes``; past it, it waits for the writer. Other in-place updates call
  :meth:`FastCkptLazyStager.fence` first.
- only the fenced optimizers' parameters and state are read after ``stage`` returns
  (DTensors too, by their local tensors' memory: FSDP2's ``fully_shard``, tensor
  parallelism); every other tensor of the state (BatchNorm statistics, EMA copies,
  buffers, a DTensor no fenced optimizer steps) is copied by ``stage`` itself, since
  nothing holds it still, and named in ``call_copied``. Without ``fence=`` that is
  everything.
- every tensor read later is checked around its copy, at the fence, and against its bytes
  once written: a tensor changed unfenced fails the save (the DCP future raises, naming
  it, through DCP's ``CheckpointException`` when ranks coordinate), and nothing is
  published.

The saved files therefore hold the state at the call, or the save fails naming the tensor.

Example:
    >>> import os, tempfile, torch
    >>> import torch.distributed.checkpoint as dcp
    >>> from fastckpt.dcp import FastCkptLazyStager, FastCkptWriter, load_full
    >>> model = torch.nn.Linear(4, 4)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> before = model.weight.detach().clone()
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> stager = FastCkptLazyStager(fence=optimizer)
    >>> future = dcp.async_save({"model": model.state_dict()}, storage_writer=FastCkptWriter(path),
    ...                         async_stager=stager, no_dist=True)
    >>> model(torch.ones(1, 4)).sum().backward(); optimizer.step()  # passes the fence first
    >>> _ = future.result(); stager.close()
    >>> torch.equal(load_full(path)["model"]["weight"], before)
    True
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable

import torch

from fastckpt.checkpoint.asynchronous import fenced_optimizers
from fastckpt.checkpoint.lazy_guard import LazyGuard
from fastckpt.integrations.dcp._stand_ins import stand_in_structure

__all__ = ["FastCkptLazyStager", "LazyStage", "claim_stage"]

_HOW_TO_FENCE = (
    "pass the optimizer that changes it as FastCkptLazyStager(fence=optimizer), call "
    "stager.fence() before any other in-place update (EMA, manual loops), or stage without "
    "FastCkptLazyStager to copy the state before dcp.async_save returns"
)

_lock = threading.Lock()
_stages: list["LazyStage"] = []  # staged, not yet claimed by a writer


class LazyStage:
    """One ``stage`` call's state: its guard, and which stand-in is which live tensor.

    Holds the stand-ins only weakly: once DCP drops the staged state dict (its save ended,
    whether or not a writer claimed this stage), the stage ends, so a save that failed
    before writing never leaves a fence behind.
    """

    def __init__(
        self,
        guard: LazyGuard,
        stand_ins: dict[int, torch.Tensor],
        labels: dict[int, str],
        *,
        staging_bytes: int | None,
        owner: FastCkptLazyStager,
    ):
        self.guard = guard
        self.staging_bytes = staging_bytes
        self.owner = owner
        self.ended = False
        self._refs = {key: (weakref.ref(t), labels[key]) for key, t in stand_ins.items()}
        for tensor in stand_ins.values():
            weakref.finalize(tensor, self._forget)

    def owns(self, data: Any) -> bool:
        """Whether ``data`` is one of this stage's stand-ins (a DTensor over one, or a view
        of one)."""
        for candidate in (data, getattr(data, "_base", None), getattr(data, "_local_tensor", None)):
            entry = self._refs.get(id(candidate)) if candidate is not None else None
            if entry is not None and entry[0]() is candidate:
                return True
        return False

    def label_of(self, data: torch.Tensor) -> str | None:
        """The guard's name for the live tensor ``data`` stands in for (``data`` is a stand-in
        or a view of the whole of one, as DCP resolves a write item), else None."""
        for candidate in (data, getattr(data, "_base", None)):
            entry = self._refs.get(id(candidate)) if candidate is not None else None
            if entry is None:
                continue
            ref, label = entry
            stand_in = ref()
            if stand_in is not None and stand_in is candidate and stand_in.shape == data.shape:
                return label
        return None

    def end(self) -> None:
        """No writer may read this stage any more: its fences return, its hooks go (a
        writer that claims it afterwards fails instead of reading unguarded tensors)."""
        self.ended = True
        self.guard.finish()

    def _forget(self) -> None:
        with _lock:
            if self in _stages:
                _stages.remove(self)
        self.end()


def claim_stage(tensors: Iterable[Any]) -> LazyStage | None:
    """The pending lazy stage whose stand-ins these tensors (a rank's write items resolved,
    or its planner's state dict values) are, taken off the pending list for the writer that
    streams it; None when they are no lazy stage's.

    Example:
        >>> claim_stage([torch.zeros(1)]) is None
        True
    """
    with _lock:
        if not _stages:
            return None
        for tensor in tensors:
            for stage in _stages:
                if stage.owns(tensor):
                    _stages.remove(stage)
                    return stage
    return None


def _dtensors_by_local(value: Any) -> dict[int, torch.Tensor]:
    """The DTensors in ``value`` (nested dicts, lists, tuples), by their local tensor's id.

    Example:
        >>> _dtensors_by_local({"w": torch.zeros(1), "n": [2]})
        {}
    """
    found: dict[int, torch.Tensor] = {}
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            local = getattr(item, "_local_tensor", None)
            if isinstance(local, torch.Tensor):
                found[id(local)] = item
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return found


class FastCkptLazyStager:
    """A DCP ``AsyncStager`` that stages without copying (see the module's description),
    for ``dcp.async_save(state, storage_writer=FastCkptWriter(path), async_stager=...)``.

    Args:
        fence: an optimizer (or a list) whose next ``step()`` first snapshots what the
            writer has not copied yet (see :mod:`fastckpt.checkpoint.lazy_guard`).
        fence_bytes: cap on the memory one fence may snapshot (default: no cap); past it,
            the fence waits for the writer, at the storage's speed.
        staging_bytes: the page-locked ring the writer streams through (default 256 MiB).

    The writer must be a local :class:`~fastckpt.integrations.dcp.writer.FastCkptWriter`
    (at a URL, stage with the writer itself). Call :meth:`close` after the last save: it
    ends the stages of saves that never reached their writer.

    Example:
        >>> import torch
        >>> stager = FastCkptLazyStager()
        >>> staged = stager.stage({"w": torch.ones(2), "step": 3})
        >>> staged["step"], stager.should_synchronize_after_execute
        (3, False)
        >>> stager.close()
    """

    _synchronize_after_execute = False

    def __init__(
        self,
        *,
        fence: Any = (),
        fence_bytes: int | None = None,
        staging_bytes: int | None = None,
    ):
        self.optimizers = fenced_optimizers(fence)
        if fence_bytes is not None and (
            isinstance(fence_bytes, bool) or not isinstance(fence_bytes, int) or fence_bytes < 0
        ):
            raise ValueError(f"fence_bytes must be None or a non-negative int, got {fence_bytes!r}")
        if staging_bytes is not None and (
            isinstance(staging_bytes, bool)
            or not isinstance(staging_bytes, int)
            or staging_bytes <= 0
        ):
            raise ValueError(f"staging_bytes must be None or a positive int, got {staging_bytes!r}")
        self.fence_bytes = fence_bytes
        self.staging_bytes = staging_bytes
        self._guards: weakref.WeakSet[LazyGuard] = weakref.WeakSet()
        #: what the last :meth:`stage` copied before returning (no fence owns it): the
        #: labels of those tensors and their bytes; every other tensor is read afterwards
        self.call_copied: frozenset[str] = frozenset()
        self.call_copy_bytes = 0

    @property
    def should_synchronize_after_execute(self) -> bool:
        """False: nothing to wait for after ``dcp.async_save`` starts the save."""
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Records ``state_dict`` for a lazy save and returns stand-ins for DCP to plan on
        (no tensor is copied; non-tensor values are)."""
        keep: list[torch.Tensor] = []
        staged, live, labels = stand_in_structure(state_dict, keep)
        # The guard reads a DTensor's local tensor and checks the DTensor's version counter
        # too (an in-place op on a DTensor moves only the DTensor's).
        wrappers = _dtensors_by_local(state_dict)
        guarded = {labels[key]: wrappers.get(id(tensor), tensor) for key, tensor in live.items()}
        guard = LazyGuard(
            guarded,
            fence_bytes=self.fence_bytes,
            optimizers=self.optimizers,
            how_to_fence=_HOW_TO_FENCE,
        )
        self._guards.add(guard)
        self.call_copied, self.call_copy_bytes = guard.call_copied, guard.call_copy_bytes
        stand_ins = {id(t): t for t in keep}
        if not stand_ins:  # nothing to stream: no writer will claim it
            guard.finish()
            return staged
        stage = LazyStage(guard, stand_ins, labels, staging_bytes=self.staging_bytes, owner=self)
        with _lock:
            _stages.append(stage)
        return staged

    def fence(self) -> None:
        """Returns once the tensors of every pending save of this stager may be changed (the
        not yet copied are snapshotted or waited for, as an optimizer's fence does): call
        it before in-place updates no fenced optimizer makes."""
        for guard in list(self._guards):
            guard.fence()

    def synchronize_staging(self) -> None:
        """Nothing to wait for: the saves read the tensors themselves, fenced and checked."""

    def close(self) -> None:
        """Ends the stages of this stager that no writer claimed (saves that failed before
        writing, whose writer then never comes); the saves being written go on. Call it
        once the last save's future is done."""
        with _lock:
            mine = [s for s in _stages if s.owner is self]
        for stage in mine:
            stage.end()
