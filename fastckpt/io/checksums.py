"""Checking tensors' CRC32Cs from bytes that arrive in file order, piece by piece.

Reads complete in pieces that need not line up with tensors: a large tensor spans several
pieces, a piece holds several small tensors. :class:`StreamingVerifier` carries each
tensor's running CRC across pieces and checks it the moment its last byte arrives, so a
load verifies while later pieces are still being read — from the arena on the CPU, or from
the page-locked staging buffers of a load to the GPU.

Example:
    >>> import numpy as np
    >>> from fastckpt import _C, format
    >>> data = np.arange(8, dtype=np.uint8)
    >>> entry = format.TensorEntry("t", "U8", (8,), 0, 8)
    >>> crc = _C.crc32c(data.ctypes.data, 8)
    >>> v = StreamingVerifier([entry], {"t": crc}, "x.safetensors")
    >>> v.feed(0, data.ctypes.data, 3); v.feed(3, data.ctypes.data + 3, 5); v.finish()
"""

from __future__ import annotations

from typing import Mapping, Sequence

from fastckpt import _C, format
from fastckpt.errors import ChecksumError

__all__ = ["StreamingVerifier"]


class StreamingVerifier:
    """Verifies ``entries`` (adjacent, in file order) from bytes fed in order.

    Args:
        entries: the tensors, sorted by data offset, without overlaps.
        crcs: expected CRC32C per tensor name; a name missing here is not checked.
        path: the file, for error messages.
    """

    def __init__(self, entries: Sequence[format.TensorEntry], crcs: Mapping[str, int], path: str):
        self._entries = list(entries)
        self._crcs = crcs
        self._path = path
        self._index = 0  # the tensor whose bytes come next
        self._crc = 0  # its CRC so far

    def feed(self, begin: int, address: int, nbytes: int) -> None:
        """Takes the ``nbytes`` at ``address``, which are data bytes ``[begin, begin + nbytes)``.

        Raises:
            ChecksumError: a tensor completed by these bytes does not match its checksum.
        """
        end = begin + nbytes
        while self._index < len(self._entries):
            e = self._entries[self._index]
            if e.begin > end or (e.begin == end and e.nbytes):
                return
            lo, hi = max(e.begin, begin), min(e.end, end)
            if hi > lo:
                self._crc = _C.crc32c(address + (lo - begin), hi - lo, self._crc)
            if e.end > end:
                return  # the rest of this tensor comes in a later piece
            self._check(e, self._crc)
            self._index += 1
            self._crc = 0

    def finish(self) -> None:
        """Checks that every tensor was fed whole (and that empty trailing ones match)."""
        while self._index < len(self._entries) and self._entries[self._index].nbytes == 0:
            self._check(self._entries[self._index], 0)
            self._index += 1
        if self._index != len(self._entries):
            missing = self._entries[self._index].name
            raise AssertionError(f"{self._path}: tensor {missing!r} was not read whole")

    def _check(self, e: format.TensorEntry, actual: int) -> None:
        expected = self._crcs.get(e.name)
        if expected is not None and actual != expected:
            raise ChecksumError(
                f"tensor {e.name!r} in {self._path} is damaged: "
                f"CRC32C {actual:08x}, expected {expected:08x}",
                tensor=e.name,
                filename=self._path,
            )
