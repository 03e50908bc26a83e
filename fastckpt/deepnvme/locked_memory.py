"""The page-locked tensors of ``aio_handle.new_cpu_locked_tensor``, one registry per process.

Like DeepSpeed's pinned-tensor manager, the registry is shared by every handle: a tensor
allocated through one handle is freed through any other, and ``is_pinned`` recognises it
whichever handle asks. A buffer counts as locked only when its whole byte range lies within
one allocation, so a view that starts inside a locked tensor but runs past its end does not.

The registry holds no tensor alive: an entry goes when its tensor is freed or garbage
collected, and the memory is unlocked and returned once no tensor views it any more.
"""

from __future__ import annotations

import weakref
from typing import Any

from fastckpt.io.aligned_memory import aligned_tensor

__all__ = ["allocate", "extent_of", "release"]


class _Allocation:
    """One locked tensor: its first byte, its byte length and a weak reference to it."""

    __slots__ = ("start", "nbytes", "tensor")

    def __init__(self, tensor: Any):
        self.start = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.element_size()
        self.tensor = weakref.ref(tensor, self._forget)

    def _forget(self, _ref: Any) -> None:
        # Runs while the tensor is being collected: a plain dict update, no lock to take.
        if _allocations.get(self.start) is self:
            _allocations.pop(self.start, None)


# start address -> allocation; dict updates are atomic under the GIL.
_allocations: dict[int, _Allocation] = {}


def allocate(num_elem: int, dtype: Any) -> Any:
    """A 1-D tensor of ``num_elem`` ``dtype`` elements in page-aligned, mlock()ed memory.

    Raises ``OSError`` when the locked-memory limit (``ulimit -l``) forbids it.

    Example:
        >>> import torch
        >>> t = allocate(1024, torch.float32)
        >>> extent_of(t.data_ptr() + 100) == (t.data_ptr(), 4096)
        True
        >>> release(t), release(t)
        (True, False)
    """
    import torch

    nbytes = num_elem * torch.empty(0, dtype=dtype).element_size()
    tensor = aligned_tensor(nbytes, dtype, lock=True, strict=True, reused=True)
    if nbytes:
        allocation = _Allocation(tensor)
        _allocations[allocation.start] = allocation
    return tensor


def release(tensor: Any) -> bool:
    """Forgets the locked tensor that starts at ``tensor``'s first byte; False if there is none.

    As with DeepSpeed's manager, any tensor with the allocation's start address names it
    (the tensor returned by :func:`allocate` or a view from its first element).
    """
    if tensor.is_cuda or tensor.numel() == 0:
        return False
    allocation = _allocations.pop(tensor.data_ptr(), None)
    return allocation is not None and allocation.tensor() is not None


def extent_of(address: int) -> tuple[int, int] | None:
    """``(start, nbytes)`` of the tensor from :func:`allocate` that holds byte ``address``, or None.

    A buffer ``[address, address + n)`` is then locked when ``address + n <= start + nbytes``.

    Example:
        >>> extent_of(0) is None
        True
    """
    for allocation in list(_allocations.values()):
        if allocation.start <= address < allocation.start + allocation.nbytes:
            if allocation.tensor() is not None:
                return allocation.start, allocation.nbytes
    return None
