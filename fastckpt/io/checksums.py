"""CRC32C arithmetic for checkpoints read and written in pieces.

:func:`piece_cuts` cuts a tensor's bytes at the checksummed pieces of the format;
:class:`PieceCrcs` accumulates one tensor's piece CRCs as its bytes pass (in order, from
any number of steps) and joins them into the tensor's CRC with :func:`crc32c_combine`, so
no byte is checksummed twice.

Example:
    >>> import numpy as np
    >>> from fastckpt import _C
    >>> data = np.arange(8, dtype=np.uint8)
    >>> whole = _C.crc32c(data.ctypes.data, 8)
    >>> head, tail = _C.crc32c(data.ctypes.data, 3), _C.crc32c(data.ctypes.data + 3, 5)
    >>> crc32c_combine(head, tail, 5) == whole
    True
"""

from __future__ import annotations

from fastckpt import _C

__all__ = ["PieceCrcs", "crc32c_combine", "piece_cuts"]


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
    return _C.crc32c_combine(crc_a, crc_b, len_b)


def piece_cuts(offset: int, nbytes: int, piece_size: int) -> tuple[int, ...]:
    """Where piece boundaries fall inside bytes ``[offset, offset + nbytes)`` of a tensor, as
    positions relative to ``offset`` (for a :class:`~fastckpt.io.parallel_io.Span`'s cuts);
    empty when ``piece_size`` is 0 (no pieces).

    Example:
        >>> piece_cuts(4096, 10000, 4096)
        (4096, 8192)
        >>> piece_cuts(100, 9000, 4096)
        (3996, 8092)
    """
    if not piece_size:
        return ()
    first = (offset // piece_size + 1) * piece_size
    return tuple(range(first - offset, nbytes, piece_size))


class PieceCrcs:
    """A tensor's CRC32C and the CRC32C of each of its fixed-size pieces, built from its
    bytes (or from checksums of consecutive segments of them) in order, each byte
    checksummed once: the whole CRC is joined from the pieces' CRCs.

    ``piece_size`` 0, or a tensor that fits one piece, records no pieces (``pieces`` stays
    empty): its whole CRC32C covers it.

    Example:
        >>> import numpy as np
        >>> data = np.arange(10000, dtype=np.uint32).view(np.uint8)
        >>> acc = PieceCrcs(data.nbytes, 16384)
        >>> acc.update(data.ctypes.data, 20000); acc.update(data.ctypes.data + 20000, 20000)
        >>> acc.whole == _C.crc32c(data.ctypes.data, data.nbytes), len(acc.pieces)
        (True, 3)
        >>> acc.pieces[2] == _C.crc32c(data.ctypes.data + 32768, 40000 - 32768)
        True
    """

    def __init__(self, nbytes: int, piece_size: int):
        self.nbytes = nbytes
        self.piece_size = piece_size if piece_size and nbytes > piece_size else 0
        self.pieces: list[int] = []
        self._whole = 0
        self._done = 0  # bytes taken so far
        self._crc = 0  # of the current piece (of everything when there are no pieces)
        self._in_piece = 0  # bytes of the current piece (of everything) taken so far

    @property
    def whole(self) -> int:
        """The CRC32C of every byte taken so far (of the tensor once all are taken)."""
        if not self.piece_size:
            return self._crc
        if self._in_piece:
            return crc32c_combine(self._whole, self._crc, self._in_piece)
        return self._whole

    @property
    def taken(self) -> int:
        """Bytes of the tensor taken so far (where the next ones start)."""
        return self._done

    def update(self, address: int, nbytes: int) -> None:
        """Checksums the next ``nbytes`` of the tensor, which are at ``address``."""
        while nbytes:
            take = nbytes if not self.piece_size else min(nbytes, self._room())
            self._crc = _C.crc32c(address, take, self._crc)
            self._advance(take)
            address += take
            nbytes -= take

    def add(self, crc: int, nbytes: int) -> None:
        """Takes the next ``nbytes`` of the tensor by their CRC32C ``crc``; they must not
        cross a piece boundary (see :func:`piece_cuts`)."""
        if self.piece_size and nbytes > self._room():
            raise ValueError(f"{nbytes} bytes cross a piece boundary at byte {self._done}")
        self._crc = crc32c_combine(self._crc, crc, nbytes) if self._in_piece else crc
        self._advance(nbytes)

    def _room(self) -> int:
        return self.piece_size - self._in_piece

    def _advance(self, nbytes: int) -> None:
        self._done += nbytes
        self._in_piece += nbytes
        if self.piece_size and (self._in_piece == self.piece_size or self._done == self.nbytes):
            crc, length = self._crc, self._in_piece
            self._whole = crc32c_combine(self._whole, crc, length) if self.pieces else crc
            self.pieces.append(crc)
            self._crc, self._in_piece = 0, 0
