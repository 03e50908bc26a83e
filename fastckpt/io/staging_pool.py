"""A bounded pool of page-aligned, page-locked staging buffers, reused across calls.

Saves copy tensors into these buffers and hand full buffers to the engine; the pool's
budget caps the extra memory a save needs, whatever the checkpoint's size. Buffers are
allocated on first use and kept, so repeated saves neither re-allocate nor re-lock memory.

Example:
    >>> pool = StagingPool(budget=8 << 20, piece=4 << 20)
    >>> buf = pool.acquire()
    >>> buf.nbytes
    4194304
    >>> pool.release(buf)
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

from fastckpt.config import staging_bytes
from fastckpt.io import device_copy
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, aligned_array

__all__ = ["StagingPool", "StagingBuffer", "default_pool", "DEFAULT_PIECE"]

_log = logging.getLogger("fastckpt")

# Large enough that each write is one efficient stream of engine requests, small enough
# that the 256 MiB default budget gives 8 buffers to overlap copying with writing.
DEFAULT_PIECE = 32 << 20


class StagingBuffer:
    """One page-aligned buffer of the pool: ``array`` (uint8) at ``address``."""

    __slots__ = ("array", "address", "nbytes", "_tensor", "cuda_registered")

    def __init__(self, nbytes: int):
        self.array = aligned_array(nbytes, lock=True, strict=False, reused=True)
        self.address = self.array.__array_interface__["data"][0]
        self.nbytes = nbytes
        self._tensor = None
        self.cuda_registered = False

    def register_for_cuda(self) -> bool:
        """Registers the buffer with CUDA (``cudaHostRegister``) once, so device-to-host
        copies into it run at DMA speed instead of pageable-memory speed. False (and the
        buffer stays usable, just slower for CUDA) where CUDA cannot register it."""
        if not self.cuda_registered:
            try:
                device_copy.pin_host_tensor(self.tensor())
            except (RuntimeError, TypeError) as exc:
                _log.debug("staging buffer stays unregistered for CUDA: %s", exc)
                return False
            self.cuda_registered = True
        return True

    def free(self) -> None:
        """Undoes the CUDA registration; the memory goes when the last reference does."""
        if self.cuda_registered:
            device_copy.unpin_host_tensor(self.tensor())
            self.cuda_registered = False

    def tensor(self):
        """A uint8 torch tensor over the buffer (shares memory)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.from_numpy(self.array)
        return self._tensor


class StagingPool:
    """At most ``budget // piece`` buffers of ``piece`` bytes, handed out and taken back.

    :meth:`acquire` blocks while every buffer is in use, so callers wait for memory to
    free up rather than fail or grow without bound.
    """

    def __init__(self, budget: int, piece: int = DEFAULT_PIECE):
        if piece <= 0 or piece % BUFFER_ALIGNMENT:
            raise ValueError(
                f"piece must be a positive multiple of {BUFFER_ALIGNMENT}, got {piece}"
            )
        self.piece = min(
            piece, max(BUFFER_ALIGNMENT, budget // 2 // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT)
        )
        self.capacity = max(2, budget // self.piece)
        self._free: list[StagingBuffer] = []
        self._allocated = 0
        self._cond = threading.Condition()

    @property
    def budget(self) -> int:
        return self.capacity * self.piece

    def try_acquire(self) -> StagingBuffer | None:
        """A free buffer, or None at once when all are in use."""
        with self._cond:
            return self._take()

    def acquire(self, timeout: float | None = None) -> StagingBuffer:
        """A free buffer, waiting for one to be released if all are in use."""
        with self._cond:
            buf = self._take()
            while buf is None:
                if not self._cond.wait(timeout):
                    raise TimeoutError("no staging buffer was released in time")
                buf = self._take()
            return buf

    def _take(self) -> StagingBuffer | None:
        if self._free:
            return self._free.pop()
        if self._allocated < self.capacity:
            self._allocated += 1
            try:
                return StagingBuffer(self.piece)
            except BaseException:
                self._allocated -= 1
                raise
        return None

    def release(self, buf: StagingBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def grow_to(self, budget: int) -> None:
        """Raises the capacity so that ``budget`` bytes fit (never lowers it)."""
        with self._cond:
            self.capacity = max(self.capacity, -(-budget // self.piece))
            self._cond.notify_all()

    def in_use(self) -> int:
        with self._cond:
            return self._allocated - len(self._free)

    def trim(self) -> None:
        """Frees every buffer not in use (they are re-allocated on demand)."""
        with self._cond:
            self._allocated -= len(self._free)
            freed, self._free = self._free, []
        for buf in freed:
            buf.free()

    def prepare(self, nbytes: int, *, cuda: bool = False) -> int:
        """Allocates (page-locks, and with ``cuda`` registers with CUDA) buffers up front
        until ``nbytes`` are ready, growing the capacity if needed; returns the bytes ready.
        Later acquisitions then cost nothing."""
        self.grow_to(nbytes)
        taken: list[StagingBuffer] = []
        try:
            while sum(b.nbytes for b in taken) < nbytes:
                buf = self.try_acquire()
                if buf is None:
                    break
                taken.append(buf)
                if cuda:
                    buf.register_for_cuda()
        finally:
            for buf in taken:
                self.release(buf)
        return sum(b.nbytes for b in taken)


_pools: dict[int, StagingPool] = {}
_pools_lock = threading.Lock()


def default_pool(budget: int | None = None) -> StagingPool:
    """The process-wide pool for a budget (default: ``fastckpt.config.staging_bytes()``)."""
    budget = staging_bytes(budget)
    with _pools_lock:
        pool = _pools.get(budget)
        if pool is None:
            pool = _pools[budget] = StagingPool(budget)
        return pool


def _after_fork_in_child() -> None:
    # Buffers handed out in the parent belong to threads that did not survive fork().
    global _pools_lock
    _pools_lock = threading.Lock()
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def zero_fill(buf: StagingBuffer, begin: int, end: int) -> None:
    """Zeroes bytes [begin, end) of a buffer (the padding of the last direct-I/O block)."""
    buf.array[begin:end] = np.uint8(0)
