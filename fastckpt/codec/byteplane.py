"""Byte planes: the bytes of floating-point elements regrouped so that zstd can shrink them.

An element is first rotated left by a few bits. By one, the sign bit moves from the top to
the bottom, and the top byte holds only exponent bits (eight of bf16's and fp32's), which
take two or three bits each once entropy-coded, while the low bytes (mantissa, nearly
random) do not shrink and are stored raw. By two or three, the top exponent bits, which are
the same in nearly every weight (|x| < 2), move to the low byte, and the top mantissa bits,
which are not quite random and depend on the exponent, join the exponent byte; then both
the top and the low byte shrink. Which rotation stores fewest bytes depends on the values
(:func:`fastckpt.codec.frames.choose_rotation` tries them). Plane ``p`` holds byte
``itemsize - 1 - p`` of every element (little-endian), so plane 0 is the exponent plane.

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


def split(data: np.ndarray, itemsize: int, rotation: int = 1) -> list[np.ndarray]:
    """The ``itemsize`` planes of ``data`` (contiguous uint8, a whole number of elements),
    each element rotated left by ``rotation`` bits (1 to ``8 * itemsize - 1``), exponent
    plane first; one plane (``data`` itself) when ``itemsize`` is 1. One native pass
    (numpy's strided copies run at a tenth of memory speed), GIL released."""
    if itemsize == 1:
        return [data]
    planes = [np.empty(data.nbytes // itemsize, np.uint8) for _ in range(itemsize)]
    _C.byteplane_split(
        data.ctypes.data, data.nbytes, itemsize, [p.ctypes.data for p in planes], rotation
    )
    return planes


def merge(planes: Sequence[np.ndarray], out: np.ndarray, itemsize: int, rotation: int = 1) -> None:
    """Writes into ``out`` (contiguous uint8, ``len(planes[0]) * itemsize`` bytes) the
    elements whose planes :func:`split` gave with the same ``rotation``."""
    if itemsize == 1:
        out[:] = planes[0]
        return
    if len(planes) != itemsize or any(len(p) * itemsize != out.nbytes for p in planes):
        raise ValueError(f"{len(planes)} planes do not make {out.nbytes} bytes")
    arrays = [np.ascontiguousarray(p, np.uint8) for p in planes]
    _C.byteplane_merge(
        out.ctypes.data, out.nbytes, itemsize, [p.ctypes.data for p in arrays], rotation
    )
