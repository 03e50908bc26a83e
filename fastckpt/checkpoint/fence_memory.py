"""Host memory that lazy saves' fences copy into, kept for the next fence.

When the step after a lazy ``async_save`` comes before its writer is done, the fence copies
what the writer has not reached into host memory (:mod:`.lazy_guard`). A training loop
fences at the same point of every checkpoint, so the same sizes come back: a buffer the
writer is done with is kept and handed to the next fence that asks for its size. Fresh
memory costs a page fault and a zeroed page per 4 KiB on its first touch, more than the copy
itself: measured on a 2-core VM, a fence copying 2 GiB into fresh memory took about 1 s,
into memory touched before 0.2 s.

What is kept never exceeds the most the fences have held at once (a peak the process has
reached already); :func:`fastckpt.release_staging` frees it (:func:`trim`).

Example:
    >>> trim()  # forget what earlier fences of this process kept
    >>> a = take(1 << 20)
    >>> give_back(a)
    >>> take(1 << 20).data_ptr() == a.data_ptr()  # the same memory, touched already
    True
"""

from __future__ import annotations

import os
import threading

import torch

__all__ = ["give_back", "idle_bytes", "take", "trim"]

_lock = threading.Lock()
_idle: dict[int, list[torch.Tensor]] = {}  # nbytes -> buffers no fence holds
_idle_bytes = 0
_held = 0  # bytes taken and not given back
_peak = 0  # the most bytes taken at once


def take(nbytes: int) -> torch.Tensor:
    """A flat uint8 host tensor of ``nbytes``: one given back before when there is one of
    that size, else new memory."""
    global _idle_bytes, _held, _peak
    with _lock:
        free = _idle.get(nbytes)
        buffer = free.pop() if free else None
        if buffer is not None:
            _idle_bytes -= nbytes
        _held += nbytes
        _peak = max(_peak, _held)
    return buffer if buffer is not None else torch.empty(nbytes, dtype=torch.uint8)


def give_back(buffer: torch.Tensor) -> None:
    """``buffer`` (from :func:`take`) is no longer read or written: kept for a later fence,
    unless the idle buffers would exceed the peak."""
    global _idle_bytes, _held
    nbytes = buffer.numel()
    with _lock:
        _held -= nbytes
        if _idle_bytes + _held + nbytes <= _peak:
            _idle.setdefault(nbytes, []).append(buffer)
            _idle_bytes += nbytes


def idle_bytes() -> int:
    """Bytes kept for later fences."""
    return _idle_bytes


def trim() -> None:
    """Frees every kept buffer (those held by fences stay theirs), and forgets the peak."""
    global _idle_bytes, _peak
    with _lock:
        _idle.clear()
        _idle_bytes = 0
        _peak = _held


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a parent's thread may have held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
