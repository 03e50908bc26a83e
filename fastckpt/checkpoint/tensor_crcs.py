"""Verification of tensors read, written once for every read path: each tensor's CRC32C is
joined from the CRCs of the pieces its bytes arrived in (spans checksummed by the worker
threads, pieces of a GPU load passing through host memory, or memory checksummed after the
fact), then compared with the CRCs the file records.

Example:
    >>> import ctypes
    >>> from fastckpt import _C
    >>> from fastckpt.format import TensorEntry
    >>> data = ctypes.create_string_buffer(b"abcdefgh", 8)
    >>> address = ctypes.addressof(data)
    >>> entries = [TensorEntry("a", "U8", (3,), 0, 3), TensorEntry("b", "U8", (5,), 3, 8)]
    >>> crcs = TensorCrcs(entries)
    >>> crcs.add_memory(4, address + 4, 4); crcs.add_memory(0, address, 4)  # any order
    >>> crcs.result()["b"] == _C.crc32c(address + 3, 5)
    True
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Mapping

from fastckpt import _C, format
from fastckpt.errors import checksum_mismatch
from fastckpt.io.checksums import crc32c_combine

__all__ = ["TensorCrcs", "check_crcs", "damaged"]


class TensorCrcs:
    """Each tensor's CRC32C, joined from CRCs of pieces of its bytes given in any order and
    from any thread. Offsets are data-section offsets (``entry.begin`` ...)."""

    def __init__(self, entries: Iterable[format.TensorEntry]):
        self._entries = sorted(entries, key=lambda e: (e.begin, e.end))
        self._begins = [e.begin for e in self._entries]
        self._parts: dict[str, list[tuple[int, int, int]]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, lo: int, crc: int, nbytes: int) -> None:
        """Bytes ``[lo, lo + nbytes)`` of tensor ``name`` (offsets into the data section)
        have CRC32C ``crc``."""
        with self._lock:
            self._parts.setdefault(name, []).append((lo, crc, nbytes))

    def add_memory(self, begin: int, address: int, nbytes: int) -> None:
        """Data bytes ``[begin, begin + nbytes)``, now at ``address``: checksummed here, one
        CRC per tensor they touch."""
        end = begin + nbytes
        i = max(0, bisect.bisect_right(self._begins, begin) - 1)
        while i < len(self._entries) and self._entries[i].begin < end:
            e = self._entries[i]
            lo, hi = max(e.begin, begin), min(e.end, end)
            if hi > lo:
                self.add(e.name, lo, _C.crc32c(address + (lo - begin), hi - lo), hi - lo)
            i += 1

    def result(self) -> dict[str, int]:
        """name -> CRC32C of the bytes given (0 for a tensor given none: an empty one)."""
        out: dict[str, int] = {}
        with self._lock:
            parts = {name: sorted(pieces) for name, pieces in self._parts.items()}
        for e in self._entries:
            crc = 0
            for i, (_, value, nbytes) in enumerate(parts.get(e.name, ())):
                crc = crc32c_combine(crc, value, nbytes) if i else value
            out[e.name] = crc
        return out


def damaged(
    entries: Iterable[format.TensorEntry], actual: Mapping[str, int], expected: Mapping[str, int]
) -> list[str]:
    """The names, in file order, of the tensors whose CRC32C is not the recorded one (a
    tensor with no recorded CRC is not checked)."""
    return [
        e.name
        for e in sorted(entries, key=lambda e: e.begin)
        if expected.get(e.name) is not None and actual.get(e.name, 0) != expected[e.name]
    ]


def check_crcs(
    entries: Iterable[format.TensorEntry],
    actual: Mapping[str, int],
    expected: Mapping[str, int],
    path: str,
) -> None:
    """Raises the :class:`~fastckpt.errors.ChecksumError` of the first damaged tensor (in file
    order), naming it and ``path``."""
    bad = damaged(entries, actual, expected)
    if bad:
        name = bad[0]
        raise checksum_mismatch(name, path, actual.get(name, 0), expected[name])
