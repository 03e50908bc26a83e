"""A snapshot that is the file itself: for an eager save into memory (a spare file's pages
on tmpfs), the tensors are written into the file in the call, and the rest of the save
(checksums, hashes, header) reads the file afterwards, on the save's thread. A lazy save
there (:class:`LazyIntoFile`) copies each tensor through its fence guard straight into the
file's pages on the save's thread: no staging ring, and no second copy by ``pwrite``.

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
from typing import Any, Callable

from fastckpt import _C
from fastckpt.checkpoint.save import SavePlan, byte_chunks
from fastckpt.io import kept_mappings, parallel_io
from fastckpt.io.aligned_memory import aligned_tensor
from fastckpt.io.files import File
from fastckpt.io.parallel_io import Span
from fastckpt.progress import progress_bar

__all__ = ["LazyIntoFile", "checksum_and_header", "write_tensors"]

_WINDOW = 64 << 20  # bytes of the file mapped at once while a lazy save writes into it
#: Bytes a lazy save copies per read of a tensor: a fence that meets the writer waits for
#: at most this one copy (as for a piece of the staging ring).
LAZY_PIECE = 16 << 20


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
            with kept_mappings.borrow(file.fd) as kept:  # a spare's: nothing to map
                mapped_at = None if kept is None else kept.address
                parallel_io.write_mapped(file, spans, on_progress=advance, mapped_at=mapped_at)
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


#: Bytes :func:`checksum_and_header` reads into its buffer at a time.
_READ_CHUNK = 8 << 20


def checksum_and_header(plan: SavePlan, file: File) -> None:
    """Computes every tensor's CRC32Cs and XXH3-128 from the bytes :func:`write_tensors`
    wrote (read back from the file's pages, or read in place from the file's kept mapping,
    :mod:`fastckpt.io.kept_mappings`), then writes the header.

    Without a kept mapping the bytes are read into one reused buffer, :data:`_READ_CHUNK` at a
    time, rather than mapped: on tmpfs, mapping a file's pages (populated, then unmapped) costs more CPU than
    copying them (measured on 2 GiB: 0.27 s against 0.10 s; read and checksum 0.24-0.29 s,
    map and checksum 0.40 s), and this pass runs beside training."""
    sums = plan.checksummers()
    if plan.checksum:
        with kept_mappings.borrow(file.fd) as kept:
            read = _in_place(kept.address) if kept is not None else _read_into_buffer(plan, file)
            for e in plan.entries:  # a chunk at a time: the CRC and hash passes hit the cache
                lo = plan.header_size + e.begin
                for at in range(lo, lo + e.nbytes, _READ_CHUNK):
                    n = min(_READ_CHUNK, lo + e.nbytes - at)
                    sums[e.name].update(read(at, n), n)
    plan.write_header(file, sums)


def _in_place(base: int) -> Callable[[int, int], int]:
    """File bytes ``[at, at + n)`` where a kept mapping at ``base`` holds them."""
    return lambda at, n: base + at


def _read_into_buffer(plan: SavePlan, file: File) -> Callable[[int, int], int]:
    """File bytes ``[at, at + n)`` read into one reused buffer (``n`` at most
    :data:`_READ_CHUNK`); returns its address."""
    buffer = aligned_tensor(min(_READ_CHUNK, max(plan.data_size, 1)))

    def read(at: int, n: int) -> int:
        address = buffer.data_ptr()  # (the closure keeps the buffer alive)
        _C.pread_crc(file.fd, address, n, at, [], False, file.path)
        return address

    return read


class LazyIntoFile:
    """The writer of a lazy ``async_save`` over a spare file on a memory file system.

    Each tensor is read through its :class:`~fastckpt.checkpoint.lazy_guard.LazyGuard` a
    piece of :data:`LAZY_PIECE` at a time (a fence snapshots what the writer has not
    reached, and waits for one piece at most) and copied straight into the file's pages
    through a populated mapping, on every core; the piece is checksummed and hashed there,
    while it is in the CPU cache. Copied once, against twice through the staging ring and
    ``pwrite`` (whose writes of one tmpfs file also take turns on its inode lock). Where the
    file's blocks could not be allocated (``allocated=False``), pieces are written with
    ``pwrite`` instead: a store into a hole of a full tmpfs would be a SIGBUS.

    Example:
        >>> import os, tempfile, torch
        >>> from fastckpt.checkpoint.lazy_guard import LazyGuard
        >>> from fastckpt.checkpoint.save import plan_save
        >>> from fastckpt.io.commit import AtomicFile
        >>> path = os.path.join(tempfile.mkdtemp(), "lazy.safetensors")
        >>> state = {"w": torch.arange(6.0)}
        >>> plan = plan_save(state, destination=path)
        >>> with AtomicFile(path) as out:
        ...     writer = LazyIntoFile(plan, out.file, LazyGuard(plan.tensors, fence_bytes=None))
        ...     writer.fill(allocated=out.reserve(plan.file_size))
        ...     writer.finish()
        >>> import fastckpt
        >>> fastckpt.load(path, verify=True)["w"].tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """

    def __init__(self, plan: SavePlan, file: File, guard: Any, *, cancel: Any = None):
        self.plan, self.file, self._guard, self._cancel = plan, file, guard, cancel
        self.sums = plan.checksummers()
        # the file bytes [first, end) mapped: (first, end, mapping, address of first)
        self._window: tuple[int, int, mmap.mmap, int] | None = None
        self._kept_at: int | None = None  # the file's byte 0 in its kept mapping, if any
        self._threads = parallel_io.worker_count()

    def fill(self, *, allocated: bool) -> None:
        """Copies every tensor into the file, piece by piece, through the guard."""
        with kept_mappings.borrow(self.file.fd) as kept:  # a spare's: no windows to map
            self._kept_at = None if kept is None else kept.address
            try:
                self._fill(allocated)
            finally:
                self._kept_at = None

    def _fill(self, allocated: bool) -> None:
        plan, guard = self.plan, self._guard
        for e in plan.entries:
            guard.begin(e.name)
            acc = self.sums[e.name]
            done = 0
            while done < e.nbytes:
                if self._cancel is not None and self._cancel.is_set():
                    raise KeyboardInterrupt(f"save to {self.file.path} cancelled")
                take = min(LAZY_PIECE, e.nbytes - done)
                offset = plan.header_size + e.begin + done
                with guard.read(e.name, done, take) as part:
                    if allocated:
                        target = self._address(offset, take)
                        _C.memcpy(target, part.data_ptr(), take, self._threads)
                        acc.update(target, take)
                    else:
                        acc.update(part.data_ptr(), take)
                        _C.pwrite_crc(
                            self.file.fd, part.data_ptr(), take, offset, [], False, self.file.path
                        )
                done += take
            guard.copied(e.name)
        self._unmap()

    def _address(self, offset: int, nbytes: int) -> int:
        """The address of file bytes ``[offset, offset + nbytes)`` in a mapping of the file
        (the file's kept mapping, the current window, or a new one from ``offset`` on)."""
        if self._kept_at is not None:
            return self._kept_at + offset
        window = self._window
        if window is None or not window[0] <= offset <= offset + nbytes <= window[1]:
            self._unmap()
            end = min(self.plan.file_size, offset + max(_WINDOW, nbytes))
            mapping, address = parallel_io.map_range(
                self.file.fd, offset, end - offset, writable=True
            )
            window = self._window = (offset, end, mapping, address)
        return window[3] + offset - window[0]

    def _unmap(self) -> None:
        if self._window is not None:
            self._window[2].close()
            self._window = None

    def drain(self) -> None:
        """Nothing is in flight once :meth:`fill` returns: ``sums`` are complete."""

    def finish(self) -> None:
        """Writes the header from the checksums the pieces fed."""
        self.plan.write_header(self.file, self.sums)

    def abort(self) -> None:
        """Unmaps the file (nothing else is in flight once :meth:`fill` returns or raises)."""
        self._unmap()
