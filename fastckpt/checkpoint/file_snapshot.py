"""A snapshot that is the file itself: for an eager save into memory (a spare file's pages
on tmpfs), the tensors are written into the file in the call, and the rest of the save
(checksums, hashes, header) reads the file afterwards, on the save's thread.

An eager ``async_save`` to the disk copies the state into staging memory in the call and
writes it after. Into a memory file system whose pages already exist (a spare file,
:mod:`fastckpt.io.spare_files`), the write is itself a memory copy: made in the call, it is
the snapshot, and nothing is left to write. The checksums are then taken from the file's
pages rather than in the call, so the call costs what a snapshot into staging costs: one
copy of the state, on every core.

Example:
    >>> import os, tempfile, torch
    >>> from fastckpt.checkpoint.save import plan_save
    >>> from fastckpt.io.commit import AtomicFile
    >>> path = os.path.join(tempfile.mkdtemp(), "doc.safetensors")
    >>> state = {"w": torch.arange(6.0)}
    >>> plan = plan_save(state, destination=path)
    >>> with AtomicFile(path) as out:
    ...     allocated = out.reserve(plan.file_size)
    ...     write_tensors(plan, out.file, progress=False, allocated=allocated)  # the snapshot
    ...     _ = state["w"].add_(1)  # changed after it: the file keeps the values written
    ...     checksum_and_header(plan, out.file)  # later, on another thread
    >>> import fastckpt
    >>> fastckpt.load(path, verify=True)["w"].tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator

import numpy as np

from fastckpt import _C
from fastckpt.checkpoint.save import SavePlan, byte_chunks
from fastckpt.io import parallel_io
from fastckpt.io.files import File
from fastckpt.io.parallel_io import Span
from fastckpt.progress import progress_bar

__all__ = ["checksum_and_header", "write_tensors"]

_WINDOW = 64 << 20  # bytes of the file mapped at once while it is checksummed


def write_tensors(
    plan: SavePlan, file: File, *, progress: bool | None, allocated: bool = False
) -> None:
    """Writes every tensor's bytes from its own memory into ``file`` through the page cache
    (contiguous tensors on every core, the others a slab at a time); no checksum, no header
    (:func:`checksum_and_header` adds them). ``allocated``: the file's blocks are allocated
    up to its size (:meth:`AtomicFile.reserve` returned True), so the contiguous tensors are
    copied into a mapping of it, which on tmpfs runs on every core where writes of one file
    take turns (see :func:`fastckpt.io.parallel_io.write_mapped`)."""
    spans: list[Span] = []
    strided = []
    keep = []  # tensors whose memory the spans point into
    step = max(1 << 20, min(64 << 20, plan.data_size // (parallel_io.worker_count() * 4) or 1))
    for e in plan.entries:
        t = plan.tensors[e.name].detach().resolve_conj().resolve_neg()
        if not e.nbytes:
            continue
        if not t.is_contiguous():
            strided.append(e)
            continue
        keep.append(t)
        for at in range(0, e.nbytes, step):
            n = min(step, e.nbytes - at)
            spans.append(Span(plan.header_size + e.begin + at, t.data_ptr() + at, n, ()))
    lock = threading.Lock()
    with progress_bar(plan.data_size, "saving", enabled=progress) as bar:

        def advance(nbytes: int) -> None:
            with lock:
                bar.update(nbytes)

        if allocated:
            parallel_io.write_mapped(file, spans, on_progress=advance)
        else:
            parallel_io.write_buffered(file, spans, checksum=False, on_progress=advance)
        for e in strided:  # rare (transposed views): made contiguous a slab at a time
            offset = plan.header_size + e.begin
            for chunk in byte_chunks(plan.tensors[e.name], 64 << 20):
                n = chunk.numel()
                _C.pwrite_crc(file.fd, chunk.data_ptr(), n, offset, [], False, file.path)
                offset += n
                advance(n)
    del keep


def _mapped(file: File, begin: int, end: int) -> Iterator[tuple[int, int]]:
    """``(address, nbytes)`` of the file's bytes ``[begin, end)`` in order, through read-only
    mappings of at most ``_WINDOW`` bytes, each unmapped before the next."""
    granularity = mmap.ALLOCATIONGRANULARITY
    position = begin
    while position < end:
        start = position - position % granularity
        length = min(end, start + _WINDOW) - start
        window = mmap.mmap(
            file.fd,
            length,
            flags=mmap.MAP_SHARED | parallel_io.MAP_POPULATE,
            prot=mmap.PROT_READ,
            offset=start,
        )
        try:
            array = np.frombuffer(window, np.uint8)
            yield int(array.ctypes.data) + (position - start), length - (position - start)
            del array
        finally:
            window.close()
        position = start + length


def checksum_and_header(plan: SavePlan, file: File) -> None:
    """Computes every tensor's CRC32Cs and XXH3-128 from the bytes :func:`write_tensors`
    wrote (read from the file's pages), then writes the header."""
    sums = plan.checksummers()
    if plan.checksum:
        for e in plan.entries:
            acc = sums[e.name]
            lo = plan.header_size + e.begin
            for address, nbytes in _mapped(file, lo, lo + e.nbytes):
                acc.update(address, nbytes)
    header = plan.header_from(sums)
    if len(header) != plan.header_size:  # it would overwrite the first tensor's bytes
        raise AssertionError("header size changed between planning and writing")
    file.pwrite_all(header, 0)
