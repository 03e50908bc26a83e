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

__all__ = ["StreamingVerifier", "crc32c_combine"]

# CRC32C's polynomial, bit-reversed (the CRC is computed least significant bit first).
_POLY = 0x82F63B78


def _multiply_mod_poly(a: int, b: int) -> int:
    """a * b modulo the polynomial, both in the bit-reversed representation."""
    product = 0
    bit = 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


# x^(2^k) modulo the polynomial, for k = 0..63 (x^1 is 1 << 30 in this representation).
_X_POW_2K = [1 << 30]
for _ in range(63):
    _X_POW_2K.append(_multiply_mod_poly(_X_POW_2K[-1], _X_POW_2K[-1]))


def _x_pow_8n(n: int) -> int:
    """x^(8n) modulo the polynomial: appending n zero bytes multiplies a CRC by it."""
    result, k = 1 << 31, 3  # x^0; 8n = n << 3
    while n:
        if n & 1:
            result = _multiply_mod_poly(_X_POW_2K[k], result)
        n >>= 1
        k += 1
    return result


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32C of bytes A + B from the CRC32Cs of A and B and the length of B.

    This is what lets pieces of one tensor be checksummed on different threads.

    Example:
        >>> import numpy as np
        >>> data = np.arange(1000, dtype=np.uint8)
        >>> whole = _C.crc32c(data.ctypes.data, 1000)
        >>> a, b = _C.crc32c(data.ctypes.data, 300), _C.crc32c(data.ctypes.data + 300, 700)
        >>> crc32c_combine(a, b, 700) == whole
        True
    """
    if len_b == 0:
        return crc_a
    return _multiply_mod_poly(_x_pow_8n(len_b), crc_a) ^ crc_b


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
