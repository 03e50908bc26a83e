"""Byte planes: the bytes of floating-point elements regrouped so that zstd can shrink them.

An element is first rotated left by one bit, moving the sign bit from the top to the bottom:
the top byte then holds only exponent bits (eight of bf16's and fp32's), which take two or
three bits each once entropy-coded, while the low bytes (mantissa, nearly random) do not
shrink and are stored raw. Plane ``p`` holds byte ``itemsize - 1 - p`` of every element
(little-endian), so plane 0 is the exponent plane.

Example:
    >>> import numpy as np
    >>> data = np.array([1.0, -2.0, 0.5], dtype=np.float32).view(np.uint8)
    >>> planes = split(data, 4)
    >>> [int(b) for b in planes[0]]  # the exponents of 1.0, -2.0, 0.5
    [127, 128, 126]
    >>> out = np.empty_like(data)
    >>> merge(planes, out, 4)
    >>> out.view(np.float32).tolist()
    [1.0, -2.0, 0.5]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastckpt import _C

__all__ = ["split", "merge"]


def split(data: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """The ``itemsize`` planes of ``data`` (contiguous uint8, a whole number of elements),
    exponent plane first; one plane (``data`` itself) when ``itemsize`` is 1. One native
    pass (numpy's strided copies run at a tenth of memory speed), GIL released."""
    if itemsize == 1:
        return [data]
    planes = [np.empty(data.nbytes // itemsize, np.uint8) for _ in range(itemsize)]
    _C.byteplane_split(data.ctypes.data, data.nbytes, itemsize, [p.ctypes.data for p in planes])
    return planes


def merge(planes: Sequence[np.ndarray], out: np.ndarray, itemsize: int) -> None:
    """Writes into ``out`` (contiguous uint8, ``len(planes[0]) * itemsize`` bytes) the
    elements whose planes :func:`split` gave."""
    if itemsize == 1:
        out[:] = planes[0]
        return
    if len(planes) != itemsize or any(len(p) * itemsize != out.nbytes for p in planes):
        raise ValueError(f"{len(planes)} planes do not make {out.nbytes} bytes")
    arrays = [np.ascontiguousarray(p, np.uint8) for p in planes]
    _C.byteplane_merge(out.ctypes.data, out.nbytes, itemsize, [p.ctypes.data for p in arrays])
