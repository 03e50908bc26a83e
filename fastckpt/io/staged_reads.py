"""Cold reads through the staging pool: O_DIRECT into the pool's buffers, copied out.

The pool's buffers are in huge pages and registered with the I/O engine
(:class:`~fastckpt.io.staging_pool.StagingBuffer`), so each request is a few large DMA
segments whose pages were pinned once. A load's own memory is fresh: 4 KiB pages scattered
over physical memory, which a direct read must pin request by request and hand to the
device one page per segment. On our VM's virtio disk, 2 GiB read at 1.66 GB/s straight into
a fresh arena and at 1.94-1.95 GB/s into registered huge pages, with or without the copy
out of them (on every core, overlapping the reads that follow, the checksum taken in the
same pass). On a disk that takes scattered pages at full speed the copy is pure cost, so
this is one read mode among others that ``fastckpt tune`` measures (``"staged"``).

Example:
    >>> import numpy as np, os, tempfile
    >>> from fastckpt.config import IOConfig
    >>> from fastckpt.io.executor import Executor
    >>> from fastckpt.io.files import File
    >>> from fastckpt.io.parallel_io import Span
    >>> from fastckpt.io.staging_pool import StagingPool
    >>> data = np.arange(1 << 20, dtype=np.uint8)
    >>> path = os.path.join(tempfile.mkdtemp(), "x.bin")
    >>> with open(path, "wb") as out:
    ...     _ = out.write(data.tobytes())
    >>> back = np.zeros_like(data)
    >>> with File(path) as f:
    ...     crcs = read_staged(Executor(IOConfig()), f, [Span(100, back.ctypes.data + 100, 5000)],
    ...                        pool=StagingPool(8 << 20, piece=1 << 20))
    >>> bool((back[100:5100] == data[100:5100]).all()), bool(back[:100].any())
    (True, False)
    >>> crcs == [[_C.crc32c(data.ctypes.data + 100, 5000)]]
    True
"""

from __future__ import annotations

import bisect
import collections
from typing import Sequence

from fastckpt import _C
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, BufferRef
from fastckpt.io.executor import Executor
from fastckpt.io.files import File
from fastckpt.io.parallel_io import Progress, Span, worker_count
from fastckpt.io.staging_pool import StagingBuffer, StagingPool

__all__ = ["read_staged"]


class _Piece:
    """Up to one buffer's worth of a span: its bytes ``[at, at + nbytes)``, read from the
    aligned file offset ``start`` (``head`` bytes early) so O_DIRECT applies."""

    __slots__ = ("span", "index", "at", "nbytes", "start", "head", "cuts")

    def __init__(self, span: Span, index: int, at: int, nbytes: int):
        self.span, self.index, self.at, self.nbytes = span, index, at, nbytes
        offset = span.file_offset + at
        self.head = offset % BUFFER_ALIGNMENT
        self.start = offset - self.head
        # where a checksum segment of the span starts inside the piece
        self.cuts = [c - at for c in span.cuts if at < c < at + nbytes]


def _pieces(spans: Sequence[Span], piece: int) -> list[_Piece]:
    room = piece - BUFFER_ALIGNMENT  # a piece may start up to a page early
    out = []
    for index, span in enumerate(spans):
        for at in range(0, span.nbytes, room):
            out.append(_Piece(span, index, at, min(room, span.nbytes - at)))
    return out


class _SegmentCrcs:
    """Each span's segment CRC32Cs, joined from the pieces' parts in order."""

    def __init__(self, spans: Sequence[Span]):
        self.bounds = [(0, *span.cuts, span.nbytes) for span in spans]
        self.crcs: list[list[int]] = [[0] * (len(b) - 1) for b in self.bounds]

    def add(self, p: _Piece, values: list[int]) -> None:
        """Joins the CRC32Cs of the piece's parts (``values``, one per cut and one more)."""
        bounds, crcs = self.bounds[p.index], self.crcs[p.index]
        # the segment holding the piece's first byte, then one more per cut
        segment = bisect.bisect_right(bounds, p.at) - 1
        edges = [p.at, *(p.at + c for c in p.cuts), p.at + p.nbytes]
        for value, lo, hi in zip(values, edges, edges[1:]):
            if hi > lo:
                crcs[segment] = _C.crc32c_combine(crcs[segment], value, hi - lo)
            segment += 1


def read_staged(
    executor: Executor,
    file: File,
    spans: Sequence[Span],
    *,
    pool: StagingPool,
    checksum: bool = True,
    on_progress: Progress | None = None,
) -> list[list[int]]:
    """Reads every span into its memory through ``pool``'s buffers: the reads are queued
    as buffers free up, and each buffer, once full, is copied to its span's memory (on every
    core, checksummed in the same pass) and reused. Returns each span's segment CRC32Cs
    (empty lists without ``checksum``). Nothing started is left running when it returns
    or raises (an interrupt included)."""
    pieces = _pieces(spans, pool.piece)
    sums = _SegmentCrcs(spans) if checksum else None
    threads = worker_count()
    inflight: collections.deque[tuple[int, StagingBuffer, _Piece]] = collections.deque()

    def copy_out(buf: StagingBuffer, p: _Piece) -> None:
        src, dst = buf.address + p.head, p.span.address + p.at
        if sums is not None:
            sums.add(p, _C.memcpy_crc(dst, src, p.nbytes, p.cuts, threads))
        else:
            _C.memcpy(dst, src, p.nbytes, threads)
        if on_progress is not None:
            on_progress(p.nbytes)

    def finish_oldest(*, release: bool) -> StagingBuffer:
        op, buf, p = inflight[0]
        executor.wait(op)
        inflight.popleft()
        try:
            copy_out(buf, p)
        except BaseException:
            pool.release(buf)
            raise
        if release:
            pool.release(buf)
        return buf

    try:
        for p in pieces:
            buf = pool.try_acquire()
            if buf is None:
                # our own oldest read once it is in, else whatever another transfer gives back
                buf = finish_oldest(release=False) if inflight else pool.acquire()
            try:
                ref = BufferRef(buf.address, buf.nbytes, buf)
                op = executor.submit(file, ref, p.start, write=False, nbytes=p.head + p.nbytes)
            except BaseException:
                pool.release(buf)
                raise
            inflight.append((op, buf, p))
        while inflight:
            finish_oldest(release=True)
    except BaseException as failure:
        # Reads a failure or an interrupt left running are collected before their buffers
        # go back: none may land in a buffer another transfer holds.
        interrupt = executor.drain([op for op, _, _ in inflight], cancel=True)
        for _, buf, _ in inflight:
            pool.release(buf)
        inflight.clear()
        if interrupt is not None:
            raise interrupt from failure
        raise
    return sums.crcs if sums is not None else [[] for _ in spans]
