"""What keeps a lazy asynchronous save true to the values at call time.

``async_save(state, path, fence=optimizer)`` returns after copying only what no fence holds
still; a background thread then streams the rest through a fixed ring of staging buffers to
the file while training goes on. Three things hold the file to the values at call time:

- **what is read lazily** (by construction): only the tensors the fence owns -- the
  parameters and state of the fenced optimizers (:mod:`.fence_cover`) -- are read after
  the call. Every other tensor of the state (BatchNorm's running statistics, which a forward
  pass changes without moving their version counter; EMA copies; buffers; another
  optimizer's tensors) is copied at the call: a CPU tensor into host memory, a CUDA tensor
  into device memory on a side stream ordered after the work queued before the call, with
  the current stream made to wait for that copy. A lazy save with no optimizer fenced
  therefore copies the whole state at the call (it never streams unguarded tensors).
- **the fence** (held off): an ``Optimizer.register_step_pre_hook`` on each fenced optimizer
  runs :meth:`LazyGuard.fence` before it changes anything (after the step's closure, for
  torch's own optimizers). The writer reads a tensor a piece at a time, claiming each piece
  while it copies it. The fence snapshots into host memory every byte the writer has not
  reached, waits for the one piece being copied (a memory copy, never a disk write), and
  the step goes on; the writer continues from the snapshot. ``fence_bytes`` caps the
  snapshots: what does not fit is left to the writer, and the fence waits for it to pass
  through the ring, at the storage's speed. A step of any other optimizer (one made after
  the call, a fused one whose kernels move no version counter) that may change a tensor not
  yet copied fences the save the same way, through one global step pre-hook. Other code that
  changes a fenced tensor in place (a manual update of a parameter) calls ``future.fence()``
  first.
- **the checks** (detected): each tensor read live has its version counter
  (``tensor._version``) compared with the call's before its first byte is copied and after
  its last; again at the fence, for every tensor read so far (by then every in-place op the
  trainer started has finished and moved its counter); and, when the save has written
  everything before any fence came, its bytes are hashed again and compared with what was
  written, which catches an op still running while the writer copied (the counter moves
  only when an op ends). A change found fails the save: ``result()`` raises a
  :class:`fastckpt.LazySaveError` naming the tensor; a mixed checkpoint is never committed.

What the checks cannot see, and the docs say so: a write that bypasses the version counter
(``tensor.data``, a ``.numpy()`` view, a custom kernel) to a *fenced* tensor, finished
before the writer reached it; and, for CUDA tensors (not hashed again), the same writes at
any time before the fence. Code that changes parameters or optimizer state that way
between a lazy save and the next step calls ``future.fence()`` first, or saves without
``lazy``/``fence`` (a snapshot of everything at the call).

CUDA tensors. The call records an event on each device's current stream. The writer copies
device-to-host on a side stream per device that waits on that event, a ring buffer at a
time into the page-locked ring; each buffer's copies are followed by an event the writer
synchronizes on before handing that buffer to the disk. A tensor's version is checked again
once its copies are seen complete (a CUDA op moves the counter when it is queued, so the
check cannot miss an op queued before it). The fence never waits on the host for
device-to-host copies: it clones what the writer has not queued on the side stream, within
``fence_bytes``, and makes the current stream wait on an event after those clones and every
copy queued so far. Past the cap, the fence waits until the writer has *queued* the copies
of the rest.

Example:
    >>> import torch
    >>> w, running_mean = torch.zeros(3, requires_grad=True), torch.zeros(3)
    >>> optimizer = torch.optim.SGD([w], lr=0.1)
    >>> guard = LazyGuard({"w": w, "running_mean": running_mean}, fence_bytes=None,
    ...                   optimizers=[optimizer])
    >>> guard.call_copy_bytes  # the statistics, copied at the call; w is read lazily
    12
    >>> with torch.no_grad():
    ...     _ = w.add_(1)  # changed before the writer copied it, outside the fenced step
    >>> try:
    ...     guard.begin("w")
    ... except LazySaveError as exc:
    ...     print(str(exc).split(":")[0])
    tensor 'w' changed after async_save(lazy) was called and before its bytes were copied
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fastckpt.checkpoint import fence_memory
from fastckpt.checkpoint.digests import hash_tensor
from fastckpt.checkpoint.fence_cover import FenceCover, local_part
from fastckpt.errors import LazySaveError

__all__ = ["LazyGuard", "LazySaveError", "fence_after_closure", "write_guarded"]

_HOW_TO_FENCE = (
    "pass the optimizer that changes it as async_save(..., fence=optimizer), call "
    "future.fence() before any other in-place update (EMA, manual loops), or save "
    "without fence= to snapshot everything before async_save returns"
)


class LazyGuard:
    """The per-save state shared by the writer thread and the fence (see the module's
    description). Tensor names are the plan's stored names.

    The writer reads a CPU tensor with :meth:`begin`, :meth:`read` per piece and
    :meth:`copied`; a CUDA tensor (:meth:`on_device`) with :meth:`begin_device`,
    :meth:`copy_to_host` per piece and :meth:`copied`, and calls :meth:`wait_copies` before
    it writes any buffer.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        fence_bytes: int | None,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        how_to_fence: str = _HOW_TO_FENCE,
    ):
        optimizers = list(optimizers)
        cover = FenceCover(optimizers)
        # A DTensor is read through its local tensor; its own version counter counts too:
        # an in-place op on a DTensor moves the DTensor's counter, not its local tensor's.
        self._outer = {n: t for n, t in tensors.items() if local_part(t) is not t}
        self._tensors = {n: local_part(t) for n, t in tensors.items()} if self._outer else tensors
        # ... and so do the counters of the fenced optimizers' tensors over the same memory
        # (a parameter, whose state dict entry is a detached DTensor with a local tensor of
        # its own: a change made through the parameter moves only the parameter's counters)
        self._owners = {n: _other_owners(cover, t) for n, t in tensors.items()}
        self._how_to_fence = how_to_fence  # the end of a LazySaveError's message
        self._versions = {name: self._version(name) for name in self._tensors}
        self._fence_bytes = fence_bytes
        self._lock = threading.Condition()
        self._copying: str | None = None  # the tensor the writer reads now
        self._claimed = 0  # bytes of it the writer read or queued (or reads now)
        self._reading = False  # a read of the tensor itself is under way (CPU)
        self._slab: tuple[int, torch.Tensor] | None = None  # rows of a strided one, copied
        self._done: set[str] = set()  # copied (or snapshotted, see _snapshots)
        # what the fences took: name -> (first byte, flat uint8 bytes from it to the end);
        # the first byte is 0 unless the writer was copying the tensor (its tail)
        self._snapshots: dict[str, tuple[int, torch.Tensor]] = {}
        self._kept: dict[str, torch.Tensor] = {}  # name -> fence_memory buffer it is in
        self._finished = False
        self._fenced_on: list[torch.optim.Optimizer] = []
        self.snapshot_bytes = 0  # host memory the fences took, for the docs' figures
        self.device_snapshot_bytes = 0  # device memory the fences took
        # -- CUDA tensors (see the module's description)
        self._device = {name for name, t in self._tensors.items() if _on_device(t)}
        self._call_events = _call_events(self._tensors[name] for name in self._device)
        self._host_ready = list(self._call_events.values())  # waited for before a CPU copy
        self._sides: dict[Any, Any] = {}  # device -> side stream, after its call event
        self._flat: dict[str, torch.Tensor] = {}  # the bytes the writer reads, per tensor
        self._queued: set[str] = set()  # every copy queued, not yet seen complete
        self._fenced: set[str] = set()  # ordered before a fence: no check after the copy
        # -- what no fence holds still is copied now (fence_cover.py)
        self._fence_started = False  # a fence began: every op the trainer queued is done
        self._settled = False  # a fence completed: nothing is read live any more
        self._failure: LazySaveError | None = None  # found by a fence, raised by the writer
        self._call_copied: set[str] = set()  # copied at the call, never read live
        self.call_copy_bytes = 0  # memory those copies took, for the docs' figures
        self._copy_uncovered(cover)
        self.fence_optimizers(optimizers)
        if len(self._call_copied) < len(self._tensors):
            _fence_every_optimizer(self)

    @property
    def call_copied(self) -> frozenset[str]:
        """The names of the tensors copied at the call (no fence owns them), whose bytes
        :attr:`call_copy_bytes` counts; every other tensor is read after the call.

        Example:
            >>> w, ema = torch.zeros(2), torch.zeros(2)
            >>> guard = LazyGuard({"w": w, "ema": ema}, fence_bytes=None,
            ...                   optimizers=[torch.optim.SGD([w], lr=0.1)])
            >>> sorted(guard.call_copied), guard.call_copy_bytes
            (['ema'], 8)
        """
        with self._lock:
            return frozenset(self._call_copied)

    def _copy_uncovered(self, cover: FenceCover) -> None:
        """Copies now every tensor ``cover`` does not hold still (all of them when no
        optimizer is fenced): a CPU tensor into host memory, a CUDA tensor into device
        memory on its side stream, after the work queued before the call, with the current
        stream made to wait for the copy (a forward pass queued next must not overwrite
        BatchNorm's statistics before they are copied). The writer reads the copies."""
        with self._lock:
            uncovered = [n for n, t in self._tensors.items() if not cover.covers(t)]
            for name in uncovered:
                tensor = self._tensors[name]
                if name in self._device:
                    stream = self._side(name)
                    copy = _queue_clone(stream, _queue_flat(stream, tensor))
                    self._snapshots[name] = (0, copy)
                else:
                    self._snapshots[name] = (0, self._host_tail(name, tensor, 0))
                self._call_copied.add(name)
                self.call_copy_bytes += tensor.numel() * tensor.element_size()
            for device, stream in self._sides.items():
                torch.cuda.current_stream(device).wait_event(_record(stream))

    # -- the writer's side ------------------------------------------------------------------
    def begin(self, name: str) -> None:
        """The writer starts on the CPU tensor ``name`` (then reads it with :meth:`read`):
        checked unchanged since the call (LazySaveError otherwise), unless a fence
        snapshotted it whole (the snapshot is read then)."""
        if self._host_ready:
            for event in self._host_ready:
                event.synchronize()  # work queued before the call is in the tensors
            self._host_ready = []
        with self._lock:
            self._raise_failure()
            if name not in self._snapshots:
                self._check(name, "before its bytes were copied")
            self._copying, self._claimed, self._slab = name, 0, None

    @contextlib.contextmanager
    def read(self, name: str, start: int, nbytes: int) -> Iterator[torch.Tensor]:
        """Bytes ``[start, start + nbytes)`` of the CPU tensor ``name`` in row-major order,
        as a contiguous uint8 tensor valid inside the ``with``: from the fence's snapshot
        once one covers them, else from the tensor itself. A read of the tensor is claimed
        until the ``with`` ends: a fence snapshots only the bytes past it, and waits for it
        (one memory copy, never a disk write). The writer reads a tensor in order.

        Example:
            >>> w = torch.arange(4, dtype=torch.int32)
            >>> guard = LazyGuard({"w": w}, fence_bytes=None)
            >>> guard.begin("w")
            >>> with guard.read("w", 4, 8) as part:
            ...     part.view(torch.int32).tolist()
            [1, 2]
        """
        with self._lock:
            snapshot = self._snapshots.get(name)
            if snapshot is None:
                tensor = self._tensors[name]
                self._claimed, self._reading = start + nbytes, True
        if snapshot is not None:
            at, data = snapshot
            yield data[start - at : start - at + nbytes]
            return
        try:
            yield self._tensor_bytes(name, tensor, start, nbytes)
        finally:
            with self._lock:
                self._reading = False
                self._lock.notify_all()

    def _tensor_bytes(
        self, name: str, tensor: torch.Tensor, start: int, nbytes: int
    ) -> torch.Tensor:
        """Bytes ``[start, start + nbytes)`` of ``tensor`` itself: a view when it is
        contiguous, else a slice of a contiguous copy of the rows holding them (kept for
        the next reads, which follow on)."""
        t = _rows(tensor)
        if _plain(t):
            return t.reshape(-1).view(torch.uint8)[start : start + nbytes]
        slab = self._slab
        if slab is None or not slab[0] <= start <= start + nbytes <= slab[0] + slab[1].numel():
            row_bytes = t.numel() // t.shape[0] * t.element_size()
            first, end = start // row_bytes, -(-(start + nbytes) // row_bytes)
            rows = t[first:end].resolve_conj().resolve_neg().contiguous()
            slab = self._slab = (first * row_bytes, rows.reshape(-1).view(torch.uint8))
        return slab[1][start - slab[0] : start - slab[0] + nbytes]

    def _host_tail(self, name: str, tensor: torch.Tensor, start: int) -> torch.Tensor:
        """A host copy of ``tensor``'s bytes from ``start`` on; a contiguous one is copied
        into :mod:`.fence_memory` of the whole tensor's size (kept in ``_kept`` until the
        writer is done with it), so that the next checkpoint's fence finds the memory
        touched already."""
        t = _rows(tensor)
        if t.numel() == 0 or not _plain(t):
            return _host_tail(tensor, start)
        flat = t.reshape(-1).view(torch.uint8)
        buffer = self._kept[name] = fence_memory.take(flat.numel())
        buffer[start:].copy_(flat[start:])
        return buffer[start:]

    def on_device(self, name: str) -> bool:
        """Whether ``name`` is a CUDA tensor (copied with :meth:`copy_to_host`)."""
        return name in self._device

    def begin_device(self, name: str) -> None:
        """The writer starts on the CUDA tensor ``name``: checked unchanged since the call,
        unless a fence snapshotted it (its clone is read then)."""
        with self._lock:
            self._raise_failure()
            if name in self._snapshots:
                self._fenced.add(name)  # the clone holds the values at call time
                return
            self._check(name, "before its bytes were copied")
            self._flat[name] = _queue_flat(self._side(name), self._tensors[name])
            self._copying, self._claimed = name, 0

    def copy_to_host(self, name: str, start: int, dst: torch.Tensor) -> None:
        """Queues the copy of bytes ``[start, start + dst.numel())`` of ``name`` (or of its
        clone, once a fence took one) into the page-locked ``dst`` on the side stream."""
        end = start + dst.numel()
        with self._lock:
            snapshot = self._snapshots.get(name)
            if snapshot is None:
                src, self._claimed = self._flat[name][start:end], end
            else:
                at, clone = snapshot
                src = clone[start - at : end - at]
            _queue_copy(self._side(name), dst, src)

    def wait_copies(self) -> None:
        """Returns once every device-to-host copy queued so far is complete (an event per
        side stream, synchronized): called before a buffer is written. The CUDA tensors
        whose copies were all queued are then checked unchanged (LazySaveError)."""
        with self._lock:
            if not self._sides:
                return
            queued = list(self._queued)  # their copies come before the events below
            events = [_record(stream) for stream in self._sides.values()]
        for event in events:
            event.synchronize()
        with self._lock:
            try:
                for name in queued:
                    if name not in self._fenced:
                        self._check(name, "while its bytes were copied")
            finally:
                for name in queued:
                    self._queued.discard(name)
                    self._done.add(name)
                    self._snapshots.pop(name, None)  # device memory back
                    self._flat.pop(name, None)
                self._lock.notify_all()

    def copied(self, name: str) -> None:
        """The writer copied every byte of ``name`` (for a CUDA tensor: queued every copy,
        checked by the next :meth:`wait_copies`): checked unchanged meanwhile."""
        with self._lock:
            if name in self._device:
                self._queued.add(name)
                if self._copying == name:
                    self._copying = None
                self._lock.notify_all()
                return
            try:
                self._raise_failure()
                # a snapshot was taken unchanged, before the step: no check needed
                if self._copying == name and name not in self._snapshots:
                    self._check(name, "while its bytes were copied")
            finally:
                self._copying, self._slab = None, None
                self._snapshots.pop(name, None)
                kept = self._kept.pop(name, None)
                self._done.add(name)
                self._lock.notify_all()
        if kept is not None:  # the writer is done reading it: the next fence may copy into it
            fence_memory.give_back(kept)

    def settle(self) -> None:
        """Waits for the device-to-host copies queued so far, checking nothing: before a
        buffer is given back on failure, so that no copy lands in it afterwards."""
        with self._lock:
            events = [_record(stream) for stream in self._sides.values()]
        for event in events:
            event.synchronize()

    def verify_unfenced(self, digests: Mapping[str, Any]) -> None:
        """Called once every byte is written, before the commit: when no fence has come
        yet, checks that the tensors read live still hold what was written. A version
        counter moves only when an in-place op *finishes*, so one still running while the
        writer copied its tensor is invisible to it; the bytes are not: each CPU tensor
        read live is hashed again (XXH3-128) and compared with the hash of the bytes
        written (``digests``: name -> an object with ``strong``). A fence that begins
        meanwhile takes over (it checks every counter once the trainer's ops are done).

        Raises:
            LazySaveError: a tensor read live changed before the fenced step.
        """
        with self._lock:
            self._raise_failure()
            if self._fence_started:
                return
            live = self._read_live()
            for name in live:
                self._check(name, "while or after its bytes were copied")
            hashed = {
                n: self._tensors[n]
                for n in live
                if n not in self._device and getattr(digests.get(n), "strong", None)
            }
        for name, tensor in hashed.items():
            if hash_tensor(tensor) == digests[name].strong:
                continue
            with self._lock:
                if self._fence_started:  # the step may be changing it now: the fence decides
                    self._raise_failure()
                    return
                raise LazySaveError(
                    f"tensor {name!r} changed after async_save(lazy) was called, before any "
                    "fenced step, without moving its version counter in time (an in-place "
                    "update still running while its bytes were copied, or a write through "
                    "`.data`): the checkpoint would not hold the values at the call and was "
                    f"not committed; {self._how_to_fence}"
                )

    def finish(self) -> None:
        """The save ended (committed or failed): fences return at once; no step fences it.
        Calls after the first do nothing."""
        if self._finished:
            return
        self.settle()  # nothing queued may still read the tensors or write the ring
        with self._lock:
            self._finished = True
            self._snapshots.clear()
            self._kept.clear()  # freed: a failed writer may still hold a view of one
            self._slab = None
            self._flat.clear()
            self._queued.clear()
            self._tensors = {}  # the future outlives the save: it must not keep the state
            self._outer, self._owners = {}, {}
            self._lock.notify_all()
        with _fenced_lock:
            for optimizer in self._fenced_on:
                pending = _fenced.get(optimizer, [])
                if self in pending:
                    pending.remove(self)
            if self in _reading_live:
                _reading_live.remove(self)
        self._fenced_on.clear()

    def rebind(self, names: Mapping[str, str | torch.Tensor]) -> None:
        """Renames the guarded tensors to the names the writer stores them under: ``new ->
        old name``, or ``new -> tensor`` for a tensor made after the call that nothing
        else changes (checked from now). A tensor no new name takes is not written, and no
        fence waits for it. Called before the writer starts.

        Example:
            >>> w = torch.zeros(2)
            >>> fenced = [torch.optim.SGD([w], lr=0.1)]
            >>> guard = LazyGuard({"model.w": w, "unused": torch.ones(1)}, fence_bytes=None,
            ...                   optimizers=fenced)
            >>> guard.rebind({"w@0": "model.w", "extra": torch.ones(1)})
            >>> guard.begin("w@0")
            >>> with guard.read("w@0", 0, 8) as part:
            ...     part.data_ptr() == w.data_ptr()
            True
        """
        with self._lock:
            tensors, versions, snapshots, device = {}, {}, {}, set()
            outer: dict[str, torch.Tensor] = {}
            owners: dict[str, list[torch.Tensor]] = {}
            for new, old in names.items():
                if isinstance(old, torch.Tensor):
                    tensors[new] = local_part(old)
                    if tensors[new] is not old:
                        outer[new] = old
                    own = tensors[new]._version + (old._version if new in outer else 0)
                    versions[new] = (own, 0)
                    if _on_device(old):
                        device.add(new)
                    continue
                tensors[new], versions[new] = self._tensors[old], self._versions[old]
                if old in self._outer:
                    outer[new] = self._outer[old]
                if old in self._owners:
                    owners[new] = self._owners[old]
                if old in self._snapshots:
                    snapshots[new] = self._snapshots[old]
                if old in self._device:
                    device.add(new)
            new_devices = {tensors[n].device for n in device} - set(self._call_events)
            if new_devices:
                self._call_events.update(
                    _call_events(t for t in tensors.values() if t.device in new_devices)
                )
            self._tensors, self._versions, self._snapshots = tensors, versions, snapshots
            self._outer, self._owners = outer, owners
            self._kept = {}  # a snapshot may now serve two names: freed, not kept
            self._device = device
            self._fenced = {
                new for new, old in names.items() if isinstance(old, str) and old in self._fenced
            }
            self._call_copied = {
                new
                for new, old in names.items()
                if isinstance(old, str) and old in self._call_copied
            }
            self._lock.notify_all()

    def _raise_failure(self) -> None:
        """Raises what a fence found (a tensor read live that changed before the step)."""
        if self._failure is not None:
            raise self._failure

    def _version(self, name: str) -> tuple[int, int]:
        """``name``'s version counters: its own (for a DTensor, its local tensor's and its
        own added), and those of the fenced optimizers' tensors over its memory added (each
        moves with the in-place ops made through that tensor, and never goes back)."""
        outer = self._outer.get(name)
        own = self._tensors[name]._version + (0 if outer is None else outer._version)
        return own, sum(t._version for t in self._owners.get(name, ()))

    def _changed(self, name: str, when: str) -> LazySaveError | None:
        """The error to raise when ``name``'s version counter moved since the call."""
        now, then = self._version(name), self._versions[name]
        if now == then:
            return None
        moved = (
            f"its version counter moved from {then[0]} to {now[0]}"
            if now[0] != then[0]
            else "the version counter of the fenced optimizer's tensor over its memory (the "
            f"parameter or optimizer state it is, or that DTensor's local tensor) moved from "
            f"{then[1]} to {now[1]}"
        )
        return LazySaveError(
            f"tensor {name!r} changed after async_save(lazy) was called and {when}: "
            f"{moved}, so the checkpoint would mix values of two steps and was not "
            f"committed; {self._how_to_fence}"
        )

    def _read_live(self) -> list[str]:
        """The tensors the writer has read (or queued copies of) from their own memory."""
        started = self._done | self._queued | ({self._copying} if self._copying else set())
        return [n for n in self._tensors if n in started and n not in self._call_copied]

    def _check(self, name: str, when: str) -> None:
        self._raise_failure()
        error = self._changed(name, when)
        if error is not None:
            raise error

    def _side(self, name: str) -> Any:
        """The side stream of ``name``'s device, made at first use after its call event."""
        device = self._tensors[name].device
        stream = self._sides.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device)
            stream.wait_event(self._call_events[device])
            self._sides[device] = stream
        return stream

    # -- the trainer's side -----------------------------------------------------------------
    def fence(self) -> None:
        """Returns once the tensors may change: the bytes the writer has not reached are
        snapshotted, within ``fence_bytes`` together, a CPU tensor's into host memory, a
        CUDA tensor's cloned on the side stream; for the tensor being copied that is the
        part past the writer's position. Then it waits for the rest: a read of a CPU tensor
        under way (one memory copy), any tensor past the cap or changed unfenced (a CPU
        tensor until copied, a CUDA tensor until its copies are queued); and the current
        CUDA streams wait on the side streams' work."""
        with self._lock:
            if self._finished or self._settled:
                return  # (after the first fence nothing is read live any more)
            # Every in-place op the trainer queued before this step has finished (CPU) or
            # moved its counter (CUDA, at launch): a tensor read live that changed since
            # the call may be torn in the file. The save fails; the step goes on.
            self._fence_started = True
            for name in self._read_live():
                self._failure = self._failure or self._changed(
                    name, "before the fenced step, while or after its bytes were copied"
                )
            if self._failure is not None:
                self._settled = True
                self._lock.notify_all()
                return
            budget = self._fence_bytes
            for name, tensor in self._tensors.items():
                if name in self._done or name in self._snapshots or name in self._queued:
                    continue
                at = self._claimed if name == self._copying else 0  # what the writer has
                nbytes = tensor.numel() * tensor.element_size() - at
                if budget is not None and nbytes > budget:
                    continue  # left for the writer: waited for below
                if self._version(name) != self._versions[name]:
                    continue  # changed unfenced: the writer fails the save, not this step
                if name in self._device:
                    flat = self._flat.get(name)  # the bytes being copied, if started
                    stream = self._side(name)
                    if flat is None:
                        flat = _queue_flat(stream, tensor)
                    self._snapshots[name] = (at, _queue_clone(stream, flat[at:]))
                    self.device_snapshot_bytes += nbytes
                else:
                    self._snapshots[name] = (at, self._host_tail(name, tensor, at))
                    self.snapshot_bytes += nbytes
                if budget is not None:
                    budget -= nbytes
            while not self._finished and (
                self._reading
                or any(
                    n not in self._done and n not in self._snapshots and n not in self._queued
                    for n in self._tensors
                )
            ):
                self._lock.wait()
            self._settled = True
            if self._finished or not self._sides:
                return
            for name in self._device - self._done:  # every copy of it is ordered below
                if self._version(name) == self._versions[name]:
                    self._fenced.add(name)
            for device, stream in self._sides.items():
                torch.cuda.current_stream(device).wait_event(_record(stream))

    def steps_unread(self, cover: FenceCover) -> bool:
        """Whether a step of the optimizers ``cover`` was made of may change a tensor the
        writer still reads from the tensor's own memory (not yet copied, and no fence has
        come): such a step must fence this save first."""
        with self._lock:
            if self._finished or self._settled:
                return False
            return any(
                cover.overlaps(tensor)
                for name, tensor in self._tensors.items()
                if name not in self._done and name not in self._call_copied
            )

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


def write_guarded(guard: LazyGuard, writer: Any, fill: Callable[[], None]) -> None:
    """Runs a lazy save's writer to its header: ``fill`` copies every tensor through
    ``guard``; once every write has landed, the tensors read live are verified
    (:meth:`LazyGuard.verify_unfenced`, against the writer's ``sums``), the guard finishes
    (fences return at once from then on) and the writer writes the header. The guard
    finishes whatever happens, so no step waits on a failed save."""
    try:
        fill()
        writer.drain()
        guard.verify_unfenced(writer.sums)
    finally:
        guard.finish()
    writer.finish()


# One step pre-hook per fenced optimizer, kept for the optimizer's life: it fences the lazy
# saves pending on it. Saves come and go through this registry rather than by adding and
# removing hooks, since a save ends on its own thread, and removing a hook there while a
# step iterates the optimizer's hooks breaks that step ("OrderedDict mutated during
# iteration").
_fenced_lock = threading.Lock()
_fenced: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[LazyGuard]] = (
    weakref.WeakKeyDictionary()
)


# Every lazy save still reading tensors from their own memory, and one global step pre-hook
# (installed with the first, kept for the process's life, for the reason above): a step of
# any optimizer -- one made after the call, a fused or foreach one whose kernels move no
# version counter -- that may change a tensor such a save has not copied yet fences it
# first, exactly as a fenced optimizer's step does.
_reading_live: list[LazyGuard] = []
_global_hook: Any = None


def _fence_every_optimizer(guard: LazyGuard) -> None:
    """Makes every optimizer's step fence ``guard`` first when it may change a tensor
    ``guard`` has not copied yet, until ``guard`` finishes."""
    global _global_hook
    with _fenced_lock:
        _reading_live.append(guard)
        if _global_hook is None:
            _global_hook = register_optimizer_step_pre_hook(_fence_saves_it_reads)


def _fence_saves_it_reads(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
    """The global step pre-hook: fences the lazy saves not fenced on ``optimizer`` (its
    own hook fences those) that still read a tensor ``optimizer`` may change."""
    with _fenced_lock:
        others = [g for g in _reading_live if not any(o is optimizer for o in g._fenced_on)]
    if not others:
        return None
    cover = FenceCover([optimizer])
    touched = [guard for guard in others if guard.steps_unread(cover)]
    if not touched:
        return None

    def fence() -> None:
        for guard in touched:
            guard.fence()

    return fence_after_closure(optimizer, args, kwargs, fence)


def _fence_pending_saves(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
    """The step pre-hook: fences the lazy saves pending on ``optimizer``."""
    with _fenced_lock:
        pending = list(_fenced.get(optimizer, ()))
    if not pending:
        return None

    def fence() -> None:
        for guard in pending:
            guard.fence()

    return fence_after_closure(optimizer, args, kwargs, fence)


def fence_after_closure(
    optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict, fence: Callable[[], None]
) -> Any:
    """For a step pre-hook: runs ``fence`` before ``optimizer`` changes anything, as late
    as that is known to be: after the step's closure (the forward and backward passes a
    ``step(closure)`` runs first, which then overlap the save) for torch's own optimizers,
    which evaluate the closure before they change anything, else now. Returns what a step
    pre-hook returns: None, or the step's arguments with the closure wrapped.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> order = []
        >>> args, kwargs = fence_after_closure(
        ...     opt, (opt,), {"closure": lambda: order.append("closure")},
        ...     lambda: order.append("fence"))
        >>> _ = kwargs["closure"](); order
        ['closure', 'fence']
    """
    positional = len(args) > 1  # args[0] is the optimizer itself
    closure = args[1] if positional else kwargs.get("closure")
    if closure is None or not _evaluates_closure_first(optimizer):
        fence()
        return None

    def fenced_closure() -> Any:
        loss = closure()
        fence()
        return loss

    if positional:
        return (args[0], fenced_closure, *args[2:]), kwargs
    return args, {**kwargs, "closure": fenced_closure}


def _evaluates_closure_first(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step(closure)`` calls the closure before changing anything: so
    for torch's own optimizers (and subclasses that keep their ``step``). LBFGS calls it
    again between its changes: the fence after its first call is the one that counts."""
    module = getattr(type(optimizer).step, "__module__", "") or ""
    return module.startswith("torch.optim.")


def _after_fork_in_child() -> None:
    global _fenced_lock
    _fenced_lock = threading.Lock()  # a save thread of the parent may have held it
    _fenced.clear()
    _reading_live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds its bytes in row-major order, as saved."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, a scalar as one row (copies of strided ones go by rows)."""
    t = tensor.detach()
    return t.reshape(1) if t.dim() == 0 else t


def _other_owners(cover: FenceCover, tensor: torch.Tensor) -> list[torch.Tensor]:
    """The fenced optimizers' tensors over ``tensor``'s memory (:meth:`FenceCover.owners`)
    other than ``tensor`` and its local tensor themselves (counted as its own counter)."""
    local = local_part(tensor)
    return [t for t in cover.owners(tensor) if t is not tensor and t is not local]


def _host_tail(tensor: torch.Tensor, start: int) -> torch.Tensor:
    """A host copy of ``tensor``'s row-major bytes from byte ``start`` on, flat uint8.

    Example:
        >>> _host_tail(torch.arange(3, dtype=torch.int16), 2).view(torch.int16).tolist()
        [1, 2]
    """
    t = _rows(tensor)
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if _plain(t):
        return t.reshape(-1).view(torch.uint8)[start:].clone()
    row_bytes = t.numel() // t.shape[0] * t.element_size()
    first = start // row_bytes  # copy whole rows from the one holding ``start``
    rows = t[first:].resolve_conj().resolve_neg().contiguous()
    return rows.reshape(-1).view(torch.uint8)[start - first * row_bytes :]


# -- CUDA, kept to these few calls (tests stand host memory in for the device) ---------------


def _on_device(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


def _call_events(tensors: Iterable[torch.Tensor]) -> dict[Any, Any]:
    """An event per device after the work queued on its current stream at call time."""
    events: dict[Any, Any] = {}
    for t in tensors:
        if t.device not in events:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            events[t.device] = event
    return events


def _record(stream: Any) -> Any:
    """An event after the work queued on ``stream`` so far."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _queue_flat(stream: Any, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes in row-major order as a flat uint8 tensor: a view when it is
    contiguous, else a contiguous copy queued on ``stream``."""
    t = tensor.detach()
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        with torch.cuda.stream(stream):
            t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8)


def _queue_clone(stream: Any, flat: torch.Tensor) -> torch.Tensor:
    """A copy of the flat bytes ``flat`` in device memory, queued on ``stream``."""
    with torch.cuda.stream(stream):
        return flat.clone()


def _queue_copy(stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` queued on ``stream`` (into page-locked memory: asynchronous)."""
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
