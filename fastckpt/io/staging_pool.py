"""A bounded pool of page-aligned, page-locked staging buffers, reused across calls.

Saves copy tensors into these buffers and hand full buffers to the engine; the pool's
budget caps the extra memory a save needs, whatever the checkpoint's size. Buffers are
allocated on first use and kept, so repeated saves neither re-allocate nor re-lock memory.

A pool buffer is backed by huge pages where the system has them and is registered with the
io_uring engine at its first write (see :func:`~fastckpt.io.aligned_memory.aligned_array`'s
``reused``): the fastest memory to write from, but the slowest to allocate (its first touch
may compact memory: 0.14-0.3 s per 32 MiB buffer here, against 0.02 s for plain pages).
So that a process's first save does not pay for it, a pool made with ``background=True``
(the process-wide :func:`default_pool`) lets callers allocate pool buffers themselves only
while that is quick (huge pages free); once one took long (slower than
:data:`SLOW_FIRST_TOUCH`), a caller that finds no buffer free gets a *stand-in*: plain locked
pages, counted in the budget and kept, which a thread of the pool's own replaces with pool
buffers once no save has used the pool for a second (at once after
:meth:`StagingPool.warm_up`, which allocates the whole pool on that thread). A caller that needs less than a
buffer (``need``) and finds none free gets a *one-off* buffer of that size instead, kept
for the next small caller (in its slot, until a larger buffer needs the slot): the pool is
not allocated at all.

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
import time
import weakref

import numpy as np

from fastckpt.config import staging_bytes
from fastckpt.io import device_copy
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, aligned_array

__all__ = [
    "StagingPool",
    "StagingBuffer",
    "default_pool",
    "warm_up",
    "DEFAULT_PIECE",
    "POOLED",
    "STAND_IN",
    "ONE_OFF",
]

_log = logging.getLogger("fastckpt")

#: A pool buffer allocated slower than this (bytes per second) makes callers of a
#: background pool take stand-ins: huge pages are free (3 ms per 32 MiB here) or need
#: compaction (0.14-0.3 s), while plain pages take 0.02 s.
SLOW_FIRST_TOUCH = 500e6

# How long the pool stays idle before its thread replaces stand-ins with pool buffers: saves
# in a row are not slowed by it (see StagingPool._reserve_for_filler).
_SETTLE_S = 1.0

# Large enough that each write is one efficient stream of engine requests, small enough
# that the 256 MiB default budget gives 8 buffers to overlap copying with writing.
DEFAULT_PIECE = 32 << 20


#: What a :class:`StagingBuffer` is: a pool buffer (kept, huge pages, registered with io_uring
#: at first use), a stand-in (plain locked pages, freed when given back) or a one-off (the
#: size of a small save, kept for the next small save until its slot is wanted).
POOLED, STAND_IN, ONE_OFF = "pooled", "stand-in", "one-off"


class StagingBuffer:
    """One page-aligned buffer of the pool: ``array`` (uint8) at ``address``; ``kind`` is
    :data:`POOLED`, :data:`STAND_IN` or :data:`ONE_OFF`."""

    __slots__ = ("array", "address", "nbytes", "_tensor", "cuda_registered", "kind")

    def __init__(self, nbytes: int, kind: str = POOLED):
        # Only pool buffers are `reused` (huge pages, registered with io_uring): the others
        # live for one save, where plain pages cost a fraction to fault in.
        self.array = aligned_array(nbytes, lock=True, strict=False, reused=kind == POOLED)
        self.address = self.array.__array_interface__["data"][0]
        self.nbytes = nbytes
        self._tensor = None
        self.cuda_registered = False
        self.kind = kind

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
    free up rather than fail or grow without bound. Every buffer handed out (pool buffer,
    stand-in or one-off) takes one of the ``capacity`` slots, so the budget holds whichever
    kind a caller gets. With ``background`` (see the module's description) pool buffers are
    allocated on a thread of the pool's own, as many as callers have held at once (all of
    them after :meth:`warm_up`), and callers get stand-ins until they are ready where
    allocating them is slow.
    """

    def __init__(self, budget: int, piece: int = DEFAULT_PIECE, *, background: bool = False):
        if piece <= 0 or piece % BUFFER_ALIGNMENT:
            raise ValueError(
                f"piece must be a positive multiple of {BUFFER_ALIGNMENT}, got {piece}"
            )
        self.piece = min(
            piece, max(BUFFER_ALIGNMENT, budget // 2 // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT)
        )
        self.capacity = max(2, budget // self.piece)
        self.background = background
        self._free: list[StagingBuffer] = []  # pool buffers given back
        self._free_stand_ins: list[StagingBuffer] = []  # until the filler replaces them
        # One-offs given back, kept (each in its slot) for the next small save, unless a
        # slot is wanted for another buffer; _evicted: those to free once the lock is left.
        self._small_free: list[StagingBuffer] = []
        self._evicted: list[StagingBuffer] = []
        # Slots taken: buffers alive of every kind, and allocations under way (_reserved);
        # never more than capacity.
        self._allocated = 0
        self._reserved = 0
        self._alive = {POOLED: 0, STAND_IN: 0, ONE_OFF: 0}
        self._made_in_background = 0
        self._made = {POOLED: 0, STAND_IN: 0, ONE_OFF: 0}  # by callers
        self._wanted = 0  # the most slots callers have held at once: the filler's target
        self._filler: threading.Thread | None = None
        self._filler_failed = False  # then pool buffers are allocated by the callers again
        self._filling_one = False  # the filler holds a slot for the buffer it allocates
        self._idle_since = 0.0  # when the last buffer in use was given back
        self._eager = False  # warm_up(): the filler does not wait for the pool to settle
        self._slow = False  # the last pool buffer took long to allocate (see _timed)
        self._stop_filling = False
        self._cond = threading.Condition()
        _live_pools.add(self)

    @property
    def budget(self) -> int:
        return self.capacity * self.piece

    def counters(self) -> dict[str, int]:
        """What the pool holds now and made so far: ``pooled``, ``stand_ins`` and
        ``one_offs`` (buffers of each kind alive), ``free`` (pool buffers not handed out),
        ``in_use``, ``allocating`` (allocations under way), ``made_in_background``,
        ``stand_ins_made`` and ``one_offs_made`` (totals).

        Example:
            >>> StagingPool(8 << 20, piece=4 << 20).counters()["pooled"]
            0
        """
        with self._cond:
            return {
                "pooled": self._alive[POOLED],
                "stand_ins": self._alive[STAND_IN],
                "one_offs": self._alive[ONE_OFF],
                "free": len(self._free) + len(self._free_stand_ins) + len(self._small_free),
                "in_use": self._in_use(),
                "allocating": self._reserved,
                "made_in_background": self._made_in_background,
                "stand_ins_made": self._made[STAND_IN],
                "one_offs_made": self._made[ONE_OFF],
            }

    def try_acquire(self, *, need: int | None = None) -> StagingBuffer | None:
        """A free buffer, or None at once when all are in use. ``need``: the bytes the
        caller still has to stage; below one piece, with no pool buffer free, a one-off
        buffer of that size (the pool is not allocated for it)."""
        with self._cond:
            buf, kind = self._claim(need)
        self._drop_evicted()
        return buf if kind is None else self._make(kind, need)

    def acquire(self, timeout: float | None = None, *, need: int | None = None) -> StagingBuffer:
        """A free buffer, waiting for one to be released if all are in use (``need`` as
        for :meth:`try_acquire`)."""
        with self._cond:
            buf, kind = self._claim(need)
            while buf is None and kind is None:
                if not self._cond.wait(timeout):
                    raise TimeoutError("no staging buffer was released in time")
                buf, kind = self._claim(need)
        self._drop_evicted()
        if kind is not None:
            return self._make(kind, need)
        assert buf is not None  # the loop ends with a buffer or a kind to allocate
        return buf

    def _claim(
        self, need: int | None, *, stand_in: bool = True
    ) -> tuple[StagingBuffer | None, str | None]:
        """Under the lock: a free pool buffer, or the kind of buffer to allocate (its slot
        taken), or (None, None) when every slot is taken."""
        small = need is not None and need < self.piece
        if need is not None and small:  # the smallest kept one-off that fits
            fits = [b for b in self._small_free if b.nbytes >= need]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self._small_free.remove(buf)
                return buf, None
        if self._free:
            return self._free.pop(), None
        if self._free_stand_ins:
            return self._free_stand_ins.pop(), None
        if self._allocated >= self.capacity and not self._evict_small():
            return None, None
        self._allocated += 1
        self._reserved += 1
        if small:
            return None, ONE_OFF
        # the slots callers hold, one-offs aside: how many pool buffers the filler makes
        held = self._allocated - self._alive[ONE_OFF] - (1 if self._filling_one else 0)
        self._wanted = max(self._wanted, held)
        if stand_in and self.background and self._slow and not self._filler_failed:
            self._start_filler()
            return None, STAND_IN
        return None, POOLED

    def _make(self, kind: str, need: int | None) -> StagingBuffer:
        """Allocates a buffer of ``kind`` for a slot :meth:`_claim` took (outside the lock:
        a first touch may take a while, and buffers are given back meanwhile)."""
        nbytes = self.piece
        if kind == ONE_OFF:
            nbytes = max(1, -(-(need or 0) // BUFFER_ALIGNMENT)) * BUFFER_ALIGNMENT
        start = time.monotonic()
        try:
            buf = StagingBuffer(nbytes, kind)
        except BaseException:
            with self._cond:
                self._allocated -= 1
                self._reserved -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            if kind == POOLED:
                self._timed(start)
            self._reserved -= 1
            self._alive[kind] += 1
            self._made[kind] += 1
        return buf

    def release(self, buf: StagingBuffer) -> None:
        """Gives a buffer back, kept for the next caller (a stand-in until the filler
        replaces it, a one-off until its slot is wanted)."""
        with self._cond:
            self._cond.notify_all()  # waiting callers and the filler
            {POOLED: self._free, STAND_IN: self._free_stand_ins, ONE_OFF: self._small_free}[
                buf.kind
            ].append(buf)
            if not self._in_use():
                self._idle_since = time.monotonic()

    def grow_to(self, budget: int) -> None:
        """Raises the capacity so that ``budget`` bytes fit (never lowers it)."""
        with self._cond:
            self.capacity = max(self.capacity, -(-budget // self.piece))
            self._cond.notify_all()

    def in_use(self) -> int:
        with self._cond:
            return self._in_use()

    def _in_use(self) -> int:
        kept = len(self._free) + len(self._free_stand_ins) + len(self._small_free)
        return sum(self._alive.values()) - kept

    def _evict_small(self) -> bool:
        """Under the lock: frees the slot of a kept one-off (freed by :meth:`_drop_evicted`);
        False when none is kept."""
        return self._evict(self._small_free)

    def _evict(self, kept: list[StagingBuffer]) -> bool:
        if not kept:
            return False
        buf = kept.pop(0)
        self._evicted.append(buf)
        self._allocated -= 1
        self._alive[buf.kind] -= 1
        return True

    def _drop_evicted(self) -> None:
        """Frees the evicted one-offs, outside the lock (CUDA unregistration, munmap)."""
        with self._cond:
            evicted, self._evicted = self._evicted, []
        for buf in evicted:
            buf.free()

    def trim(self) -> None:
        """Frees every buffer not in use (they are re-allocated on demand); a background
        allocation under way is stopped first."""
        with self._cond:
            self._stop_filling = True
            filler = self._filler
            self._cond.notify_all()
        if filler is not None and filler is not threading.current_thread():
            filler.join()
        with self._cond:
            self._stop_filling = False
            self._eager = False
            self._wanted = 0
            freed = self._free + self._free_stand_ins + self._small_free
            self._allocated -= len(freed)
            for buf in freed:
                self._alive[buf.kind] -= 1
            self._free, self._free_stand_ins, self._small_free = [], [], []
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
                with self._cond:
                    buf, kind = self._claim(None, stand_in=False)
                self._drop_evicted()
                if kind is not None:
                    buf = self._make(kind, None)
                if buf is None:
                    break
                taken.append(buf)
                if cuda:
                    buf.register_for_cuda()
        finally:
            for buf in taken:
                self.release(buf)
        return sum(b.nbytes for b in taken)

    # -- background allocation --------------------------------------------------------------
    def warm_up(self) -> None:
        """Starts allocating every pool buffer (``capacity``) on the pool's thread and
        returns at once; acquisitions meanwhile take each buffer as soon as it exists.

        Example:
            >>> pool = StagingPool(8 << 20, piece=4 << 20)
            >>> pool.warm_up()
            >>> pool.wait_warm(timeout=10)
            True
            >>> pool.trim()
        """
        with self._cond:
            self._wanted = self.capacity
            self._filler_failed = False
            self._eager = True
            self._start_filler()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Waits for the background allocation to end; False on timeout."""
        with self._cond:
            filler = self._filler
        if filler is not None:
            filler.join(timeout)
            return not filler.is_alive()
        return True

    def _timed(self, start: float) -> None:
        """Under the lock: notes whether the pool buffer allocated since ``start`` was slow
        (callers then take stand-ins) or not (they allocate pool buffers themselves again)."""
        self._slow = time.monotonic() - start > self.piece / SLOW_FIRST_TOUCH

    def _start_filler(self) -> None:
        """Under the lock: starts the filler thread unless it runs (or has nothing to do)."""
        if self._filler is not None or self._alive[POOLED] >= self._wanted:
            return
        self._filler = threading.Thread(
            target=self._fill, name="fastckpt-staging-pool", daemon=True
        )
        self._filler.start()

    def _fill(self) -> None:
        """The filler: pool buffers up to the target, one at a time, each given out (to the
        free list) as soon as it exists; it waits for stand-ins to free slots."""
        me = threading.current_thread()
        try:
            while self._reserve_for_filler(me):
                self._drop_evicted()
                start = time.monotonic()
                try:
                    buf = StagingBuffer(self.piece, POOLED)
                except Exception as exc:  # callers allocate (and see the error) themselves
                    _log.warning("allocating a staging buffer in the background failed: %s", exc)
                    with self._cond:
                        self._allocated -= 1
                        self._reserved -= 1
                        self._filling_one = False
                        self._filler_failed = True
                    return
                with self._cond:
                    self._timed(start)
                    self._reserved -= 1
                    self._filling_one = False
                    self._alive[POOLED] += 1
                    self._made_in_background += 1
                    self._free.append(buf)
                    self._cond.notify_all()
        finally:
            with self._cond:
                if self._filler is me:
                    self._filler = None
                self._cond.notify_all()

    def _reserve_for_filler(self, me: threading.Thread) -> bool:
        """Takes a slot for the filler's next buffer; False when it has nothing left to do."""
        with self._cond:
            while True:
                if self._stop_filling or self._filler is not me:
                    return False
                if self._alive[POOLED] >= min(self._wanted, self.capacity):
                    return False
                if self._allocated == self._alive[POOLED] >= self.capacity:
                    return False  # every slot holds a pool buffer: none will free up
                # Only while no buffer is in use, and (unless warming up) once the pool has
                # been idle a while: populating a locked buffer holds the process's
                # memory-map lock (0.1-0.3 s where huge pages need compaction), and a save
                # beside it stalled behind it, in its own allocations and in the kernel's
                # pinning of the pages it writes from (a 117 MB first save: 0.35 s for 3
                # stand-ins of 0.02 s each; a second save right after the first: 0.5 s
                # against 0.13). Saves in a row keep using the stand-ins meanwhile.
                if self._in_use() or self._reserved:
                    self._cond.wait()
                    continue
                quiet = self._idle_since + (0.0 if self._eager else _SETTLE_S) - time.monotonic()
                if quiet > 0:
                    self._cond.wait(quiet)
                    continue
                # a stand-in gives way to it, or where every slot is taken, a kept one-off
                if not self._evict(self._free_stand_ins) and self._allocated >= self.capacity:
                    if not self._evict_small():
                        return False
                self._allocated += 1
                self._reserved += 1
                self._filling_one = True
                return True

    def _after_fork_in_child(self) -> None:
        # The child has none of the parent's threads: no filler, and no allocation under
        # way (their slots are free again); the lock may have been held by one of them.
        self._cond = threading.Condition()
        self._allocated -= self._reserved
        self._reserved = 0
        self._filling_one = False
        self._filler = None
        self._stop_filling = False


#: Every pool alive, so that fork() finds them (see _before_fork).
_live_pools: weakref.WeakSet[StagingPool] = weakref.WeakSet()
_forking: list[StagingPool] = []


def _before_fork() -> None:
    # Each pool's lock is held across fork(), so the child sees each pool's counts whole
    # (not half-way through a filler's update). No pool lock is held while another is
    # taken, so taking them all here cannot deadlock.
    _forking[:] = list(_live_pools)
    for pool in _forking:
        pool._cond.acquire()


def _after_fork_in_parent() -> None:
    for pool in _forking:
        pool._cond.release()
    _forking.clear()


_pools: dict[int, StagingPool] = {}
_pools_lock = threading.Lock()


def default_pool(budget: int | None = None) -> StagingPool:
    """The process-wide pool for a budget (default: ``fastckpt.config.staging_bytes()``),
    whose buffers are allocated in the background (see the module's description)."""
    budget = staging_bytes(budget)
    with _pools_lock:
        pool = _pools.get(budget)
        if pool is None:
            pool = _pools[budget] = StagingPool(budget, background=True)
        return pool


def warm_up(budget: int | None = None) -> StagingPool:
    """Starts allocating the process-wide staging pool (:func:`default_pool`) in the
    background and returns it at once: a process that will save a large state soon calls
    it early (after a fork of DataLoader workers, ideally), so that its first save finds the
    buffers ready. Nothing is allocated in a process that neither calls it nor saves.

    Example:
        >>> pool = warm_up()
        >>> pool.wait_warm(timeout=30)
        True
    """
    pool = default_pool(budget)
    pool.warm_up()
    return pool


def _after_fork_in_child() -> None:
    # Buffers handed out in the parent belong to threads that did not survive fork().
    global _pools_lock
    _pools_lock = threading.Lock()
    for pool in _forking:
        pool._after_fork_in_child()
    _forking.clear()
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


def zero_fill(buf: StagingBuffer, begin: int, end: int) -> None:
    """Zeroes bytes [begin, end) of a buffer (the padding of the last direct-I/O block)."""
    buf.array[begin:end] = np.uint8(0)
