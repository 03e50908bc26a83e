"""``fastckpt.open``: a lazy reader of fastckpt and safetensors files, and the read path
that ``fastckpt.load`` uses.

Reads go straight from the file into one page-aligned arena, split into spans that every
core works on; the tensors returned are views into the arena, so nothing is copied after
the read. Each byte range is placed in the arena at the same offset modulo the page size as
in the file, which keeps direct I/O possible even for files whose data is not aligned.

How the bytes come in is chosen per file (see :attr:`CheckpointReader.read_mode`):

- ``"buffered"``: when the data is already in memory (a hot page cache, tmpfs) or the file
  system refuses O_DIRECT, worker threads ``pread`` through the page cache and checksum
  each step while it is still in the CPU cache: memory speed, one copy per byte.
- ``"direct"``: otherwise the native engine reads with O_DIRECT (the device's speed without
  polluting the page cache) and worker threads checksum spans as they land.

Checksums of spans are joined per tensor (:func:`~fastckpt.io.checksums.crc32c_combine`),
so even one huge tensor is verified on every core.

Part of a tensor is read with :meth:`CheckpointReader.read_range` (a byte range) or
:meth:`CheckpointReader.get_slice` (rows): verified, only the checksummed pieces covering the
range are read (see :mod:`fastckpt.checkpoint.range_read`).
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import threading
from typing import Any, Sequence

import torch

from fastckpt import _C, format
from fastckpt.checkpoint.header_view import HeaderView, TensorInfo
from fastckpt.checkpoint.range_read import (
    RangeSource,
    TensorSlice,
    read_byte_range,
)
from fastckpt.checkpoint.tensor_runs import Run, tensor_runs, tensor_view
from fastckpt.config import direct_io as config_direct_io
from fastckpt.config import resolve_io, staging_bytes
from fastckpt.errors import ChecksumError, HeaderError
from fastckpt.io import device_copy, page_cache, parallel_io
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, aligned_tensor
from fastckpt.io.checksums import StreamingVerifier, crc32c_combine
from fastckpt.io.executor import Executor, shared_executor
from fastckpt.io.files import File, require_regular_file
from fastckpt.io.parallel_io import Span
from fastckpt.progress import progress_bar

__all__ = ["CheckpointReader", "open_checkpoint", "TensorInfo", "TensorSlice"]

_log = logging.getLogger("fastckpt")

# Direct reads are submitted in pieces of at most this size (on aligned file offsets), so
# finished pieces are checksummed while the rest is read, and progress can be shown.
_DIRECT_PIECE = 64 << 20
# Buffered reads are cut into about this many spans per worker thread, so that threads
# finishing early take more work; no span is smaller than _MIN_SPAN.
_SPANS_PER_WORKER = 4
_MIN_SPAN = 1 << 20
# Read through the page cache when at least this fraction of the data is resident.
_RESIDENT_ENOUGH = 0.5
# Where runs of tensors start in a GPU arena, modulo which their data offsets are kept.
_DEVICE_ALIGN = 256


def _pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    chunks, got = [], 0
    while got < n:
        data = os.pread(fd, n - got, offset + got)
        if not data:
            raise HeaderError(
                f"{path}: file ended after {offset + got} bytes while reading the header"
            )
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


class CheckpointReader(HeaderView):
    """A fastckpt/safetensors file opened for lazy reading; like ``safetensors.safe_open``.

    Use :func:`fastckpt.open` to create one.

    Example:
        >>> import torch, fastckpt
        >>> fastckpt.save({"w": torch.ones(2, 2), "b": torch.zeros(2)}, "/tmp/fastckpt-open.safetensors")
        >>> with fastckpt.open("/tmp/fastckpt-open.safetensors") as f:
        ...     sorted(f.keys()), f.info("w").shape, f.get_tensor("b").tolist()
        (['b', 'w'], (2, 2), [0.0, 0.0])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        gds: bool | None = None,
        direct_io: bool | None = None,
        engine: str | None = None,
        block_size: int | None = None,
        queue_depth: int | None = None,
        intra_op_parallelism: int | None = None,
    ):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"f must be a path (str or os.PathLike), got {type(path).__name__}")
        self.path = os.fspath(path)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            device_copy.require_cuda()  # say so now, before any reading
        elif self.device.type not in ("cpu", "meta"):
            raise ValueError(f"device {self.device} is not supported (use 'cpu' or 'cuda[:N]')")
        self.gds = gds
        if direct_io is not None and not isinstance(direct_io, bool):
            raise TypeError(f"direct_io must be True, False or None, got {direct_io!r}")
        self._direct_io = direct_io if direct_io is not None else config_direct_io()
        config = resolve_io(
            self.path,
            dict(
                engine=engine,
                block_size=block_size,
                queue_depth=queue_depth,
                intra_op_parallelism=intra_op_parallelism,
            ),
        )
        self._staging_bytes = staging_bytes()
        require_regular_file(self.path)
        self._file = File(self.path)
        try:
            self._executor: Executor = shared_executor(config)
            self._read_header()
        except BaseException:
            self._file.close()
            raise
        self._prefetched: dict[str, _PendingRead] = {}
        self._active: set[_PendingRead] = set()  # every read using the file, for close()
        self._closed = False
        self._mapped: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._bytes_read = 0

    # -- header ---------------------------------------------------------------------------
    def _read_header(self) -> None:
        size = self._file.size()
        first8 = _pread_exact(self._file.fd, min(8, size), 0, self.path) if size else b""
        try:
            n = format.parse_header_length(first8, size)
            header = format.parse_header(_pread_exact(self._file.fd, n, 8, self.path), size)
        except HeaderError as exc:
            raise HeaderError(f"{self.path}: {exc}") from None
        self._adopt_header(header)

    @property
    def read_mode(self) -> str:
        """How the data section is read now: ``"buffered"`` (through the page cache: the
        bytes are resident, the file system is memory-backed or refuses O_DIRECT, or
        ``direct_io=False``) or ``"direct"`` (O_DIRECT). Decided again at each read, since
        the page cache changes; ``direct_io=True``/``False`` (or ``FASTCKPT_DIRECT_IO``) forces it.

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"x": torch.ones(4)}, "/dev/shm/fastckpt-mode.safetensors")
            >>> fastckpt.open("/dev/shm/fastckpt-mode.safetensors").read_mode
            'buffered'
        """
        mode, _ = self._choose_read_mode()
        return mode

    def _choose_read_mode(self, region: tuple[int, int] | None = None) -> tuple[str, str]:
        """(mode, why) for the next read: of ``region`` (file offset, bytes) when given,
        else of the whole data section."""
        if self._direct_io is not None:
            return (
                ("direct", "direct_io=True") if self._direct_io else ("buffered", "direct_io=False")
            )
        if self._file.direct_fd < 0:
            return "buffered", "the file system refuses O_DIRECT"
        offset, nbytes = region or (self.header.data_offset, self.header.data_size)
        resident = page_cache.resident_fraction(self._file.fd, offset, nbytes)
        if resident is not None and resident >= _RESIDENT_ENOUGH:
            return "buffered", f"{resident:.0%} of the data is in memory"
        known = "unknown" if resident is None else f"{resident:.0%}"
        return "direct", f"{known} of the data is in memory"

    def _source(self, region: tuple[int, int] | None = None) -> _Source:
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.path}: the reader is closed")
        mode, why = self._choose_read_mode(region)
        _log.debug("reading %s: %s (%s)", self.path, mode, why)
        return _Source(
            self._file,
            self._executor,
            self.path,
            self.header.data_offset,
            self.meta.crcs or {},
            direct=mode == "direct",
        )

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self._bytes_read += nbytes

    @property
    def bytes_read(self) -> int:
        """Data bytes this reader has asked of its file so far, by every read (prefetches,
        range reads and verification included; pages of :meth:`map` are not counted).

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"w": torch.zeros(1024)}, "/tmp/fastckpt-count.safetensors")
            >>> with fastckpt.open("/tmp/fastckpt-count.safetensors") as r:
            ...     _ = r.read_range("w", 0, 100)
            ...     r.bytes_read
            100
        """
        return self._bytes_read

    # -- reading --------------------------------------------------------------------------
    def read_range(
        self,
        name: str,
        start: int,
        stop: int,
        *,
        out: torch.Tensor | None = None,
        verify: bool = False,
    ) -> torch.Tensor:
        """Bytes ``[start, stop)`` of tensor ``name`` (offsets into the tensor's bytes), read
        in parallel: a uint8 tensor on this reader's device, or ``out`` (a contiguous CPU
        tensor of ``stop - start`` bytes, any dtype) filled and returned.

        ``verify=True`` reads the checksummed pieces that cover the range (4 MiB each by
        default, aligned for direct I/O), checks each piece's CRC32C, and returns only the
        range; pieces lying inside the range are read straight into ``out``. A tensor with no
        piece checksums (files written before they existed, tensors of one piece) is read
        and checked whole. ``verify=False`` reads exactly the range.

        Raises:
            ValueError: the range is not within the tensor, or ``out`` does not fit it.
            ChecksumError: a piece read does not match its CRC32C (the message names the
                file, the tensor and the piece's byte range), or the file has no checksums
                and ``verify=True``.

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"w": torch.arange(10, dtype=torch.int32)}, "/tmp/fastckpt-rr.safetensors")
            >>> with fastckpt.open("/tmp/fastckpt-rr.safetensors") as r:
            ...     out = torch.empty(3, dtype=torch.int32)
            ...     r.read_range("w", 8, 20, out=out, verify=True).tolist()
            [2, 3, 4]
        """
        self._check_open()
        e, dest = self._range_request(name, start, stop, out, verify)
        # O_DIRECT or the page cache, by what is resident of this range (not of the file)
        read = self._source((self.header.data_offset + e.begin + start, stop - start))
        source = RangeSource(
            read.file,
            read.executor,
            read.path,
            read.data_offset,
            self.meta.crcs,
            self.meta.pieces,
            read.direct,
        )
        data = read_byte_range(
            source,
            e,
            start,
            stop,
            out=dest,
            verify=verify,
            span_bytes=_span_bytes(stop - start, read.direct),
            on_read=self._count,
        )
        if out is not None:
            return out
        return data if self.device.type == "cpu" else data.to(self.device)

    def get_slice(self, name: str, *, verify: bool = False) -> TensorSlice:
        """Tensor ``name`` to be sliced along its first dimension, reading only the rows
        asked for (through :meth:`read_range`, so ``verify=True`` checks the pieces read).

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"emb": torch.arange(8.0).reshape(4, 2)}, "/tmp/fastckpt-gs.safetensors")
            >>> with fastckpt.open("/tmp/fastckpt-gs.safetensors") as r:
            ...     r.get_slice("emb", verify=True)[2:].tolist()
            [[4.0, 5.0], [6.0, 7.0]]
        """
        e = self._entry(name)
        return TensorSlice(e, lambda lo, hi: self.read_range(e.name, lo, hi, verify=verify))

    def read(
        self,
        names: Sequence[str] | None = None,
        *,
        pin_memory: bool = False,
        verify: bool = False,
        progress: bool | None = None,
    ) -> dict[str, torch.Tensor]:
        """Reads stored tensors (all when ``names`` is None) into one arena; name -> view.

        Aliases in ``names`` are read as their targets; the result is keyed by stored name.
        """
        self._check_open()
        wanted = list(self.header.entries) if names is None else names
        entries = {}
        for n in wanted:
            e = self._entry(n)
            entries[e.name] = e
        self.require_checksums(verify)
        result: dict[str, torch.Tensor] = {}
        to_read = []
        for name, e in entries.items():
            with self._lock:
                prefetched = self._prefetched.pop(name, None)
            if prefetched is not None:
                result[name] = prefetched.collect(progress=False)[name]
            else:
                to_read.append(e)
        if self.device.type != "cpu":
            result = {name: t.to(self.device) for name, t in result.items()}
        if self.device.type == "cuda":
            result.update(self._read_to_device(to_read, verify=verify, progress=progress))
            return result
        fresh = self._read_entries(to_read, pin_memory=pin_memory, verify=verify, progress=progress)
        if self.device.type != "cpu":
            fresh = {name: t.to(self.device) for name, t in fresh.items()}
        result.update(fresh)
        return result

    def map(
        self, names: Sequence[str] | None = None, *, verify: bool = False
    ) -> dict[str, torch.Tensor]:
        """Stored tensors (all when ``names`` is None) as views of a copy-on-write mapping of
        the file: nothing is read until a tensor's pages are touched, and memory is used
        only for the pages touched. Writing to a tensor changes only this process's copy of
        that page, never the file.

        ``verify=True`` checks the CRC32Cs now (touching every page, on every core).
        A file truncated by someone else while mapped makes touching its missing pages
        raise SIGBUS; that cannot be caught, so map only files nobody rewrites in place
        (fastckpt's own saves replace files by rename, which is safe).

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"w": torch.arange(6.0)}, "/tmp/fastckpt-map.safetensors")
            >>> with fastckpt.open("/tmp/fastckpt-map.safetensors") as f:
            ...     f.map()["w"].tolist()
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        """
        self._check_open()
        if self.device.type != "cpu":
            raise ValueError(f"mapping gives CPU tensors; this reader loads to {self.device}")
        wanted = list(self.header.entries) if names is None else names
        entries = {self._entry(n).name: self._entry(n) for n in wanted}
        self.require_checksums(verify)
        data = self._mapping()
        if verify:
            runs = tensor_runs(entries.values())
            for run in runs:
                run.arena_pos = run.begin
            spans, labels = _plan_spans(runs, 0, data.data_ptr(), direct=False)
            actual = _tensor_crcs(labels, parallel_io.checksum_memory(spans))
            _check_crcs(runs, actual, self.meta.crcs or {}, self.path)
        return {name: tensor_view(data, e.begin, e) for name, e in entries.items()}

    def _mapping(self) -> torch.Tensor:
        """The data section as a uint8 tensor over a private (copy-on-write) file mapping."""
        with self._lock:
            if self._mapped is None:
                size = self.header.data_offset + self.header.data_size
                if self.header.data_size == 0:
                    self._mapped = torch.empty(0, dtype=torch.uint8)
                else:
                    mapping = mmap.mmap(self._file.fd, size, access=mmap.ACCESS_COPY)
                    # frombuffer keeps the mapping alive as long as any view of it.
                    self._mapped = torch.frombuffer(
                        mapping,
                        dtype=torch.uint8,
                        count=self.header.data_size,
                        offset=self.header.data_offset,
                    )
            return self._mapped

    def _read_to_device(
        self, entries: list[format.TensorEntry], *, verify: bool, progress: bool | None
    ) -> dict[str, torch.Tensor]:
        """Reads tensors into one arena on this reader's CUDA device; name -> view.

        Disk reads into page-locked staging buffers overlap the copies to the GPU (or cuFile
        reads straight into the arena with GDS); checksums are verified from the host copy.
        """
        runs = tensor_runs(entries)
        pos = 0
        for run in runs:  # keep each run's offset modulo 256 so tensors stay aligned to dtype
            pos = -(-pos // _DEVICE_ALIGN) * _DEVICE_ALIGN + run.begin % _DEVICE_ALIGN
            run.arena_pos = pos
            pos += run.end - run.begin
        arena = device_copy.device_arena(pos, self.device)
        self._count(sum(run.end - run.begin for run in runs))
        crcs = self.meta.crcs if verify else None
        base = self.header.data_offset
        with progress_bar(sum(r.end - r.begin for r in runs), "loading", enabled=progress) as bar:
            for run in runs:
                verifier = StreamingVerifier(run.entries, crcs, self.path) if crcs else None

                def on_host(offset: int, address: int, nbytes: int, verifier=verifier) -> None:
                    if verifier is not None:
                        verifier.feed(offset - base, address, nbytes)
                    bar.update(nbytes)

                device_copy.read_into_device(
                    self._executor,
                    self._file,
                    base + run.begin,
                    run.end - run.begin,
                    arena[run.arena_pos : run.arena_pos + (run.end - run.begin)],
                    staging_bytes=self._staging_bytes,
                    gds=self.gds,
                    on_host=on_host,
                )
                if verifier is not None:
                    verifier.finish()
        return {
            e.name: tensor_view(arena, run.arena_pos + (e.begin - run.begin), e)
            for run in runs
            for e in run.entries
        }

    def _read_entries(
        self,
        entries: list[format.TensorEntry],
        *,
        pin_memory: bool,
        verify: bool,
        progress: bool | None,
    ) -> dict[str, torch.Tensor]:
        pending = self._start(entries, pin_memory=pin_memory, verify=verify, background=False)
        return pending.collect(progress=progress)

    def _start(
        self, entries: list[format.TensorEntry], *, pin_memory: bool, verify: bool, background: bool
    ) -> _PendingRead:
        pending = _PendingRead(
            self._source(), entries, pin_memory=pin_memory, verify=verify, background=background
        )
        self._count(sum(span.nbytes for span in pending.spans))
        with self._lock:
            self._active.add(pending)
        pending.on_finish(self._forget)
        return pending

    def _forget(self, pending: _PendingRead) -> None:
        with self._lock:
            self._active.discard(pending)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: the reader is closed")

    def prefetch(
        self, names: Sequence[str], *, pin_memory: bool = False, verify: bool = False
    ) -> None:
        """Starts reading these tensors in the background and returns at once.

        A later :meth:`get_tensor`/:meth:`get_tensors` of a prefetched name waits only for
        what is still in flight. Errors surface there.

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"a": torch.ones(3), "b": torch.zeros(3)}, "/tmp/fastckpt-pre.safetensors")
            >>> with fastckpt.open("/tmp/fastckpt-pre.safetensors") as r:
            ...     r.prefetch(["b"])
            ...     r.get_tensor("b").tolist()
            [0.0, 0.0, 0.0]
        """
        if isinstance(names, str):
            raise TypeError("names must be a sequence of str, not a str")
        entries = {}
        for n in names:
            e = self._entry(n)
            if e.name not in self._prefetched:
                entries[e.name] = e
        self.require_checksums(verify)
        pending = self._start(
            list(entries.values()), pin_memory=pin_memory, verify=verify, background=True
        )
        with self._lock:
            for name in entries:
                self._prefetched[name] = pending

    def verify(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> list[str]:
        """Checks stored CRC32Cs; returns the names of damaged tensors (empty when intact).

        Raises:
            ChecksumError: the file has no checksums (it cannot be verified).
        """
        self.require_checksums()
        damaged: list[str] = []
        crcs = self.meta.crcs or {}
        wanted = (
            list(self.header.entries) if names is None else [self._entry(n).name for n in names]
        )
        budget = 256 << 20  # read in batches so memory stays bounded on huge files
        batch: list[str] = []
        size = 0
        with progress_bar(
            sum(self.header.entries[n].nbytes for n in wanted), "verifying", enabled=progress
        ) as bar:
            for name in wanted + [None]:
                if name is not None:
                    batch.append(name)
                    size += self.header.entries[name].nbytes
                if batch and (name is None or size >= budget):
                    tensors = self._read_entries(
                        [self.header.entries[n] for n in batch],
                        pin_memory=False,
                        verify=False,
                        progress=False,
                    )
                    for n in batch:
                        t = tensors[n]
                        actual = (
                            _C.crc32c(t.data_ptr(), t.numel() * t.element_size())
                            if t.numel()
                            else 0
                        )
                        if crcs.get(n) is not None and actual != crcs[n]:
                            damaged.append(n)
                    bar.update(size)
                    batch, size = [], 0
        return damaged

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Closes the file, first waiting for every read still using it (prefetches
        included); reading afterwards raises ``ValueError``. Closing twice is harmless."""
        with self._lock:
            self._closed = True
            active, self._active, self._prefetched = list(self._active), set(), {}
        for pending in active:
            pending.wait_quietly()
        self._file.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class _Source:
    """What a read needs of its reader (not the reader itself: a dropped reader must not be
    kept alive by a prefetch it started)."""

    file: File
    executor: Executor
    path: str
    data_offset: int
    crcs: dict[str, int]
    direct: bool


class _PendingRead:
    """Reads of some tensors into one arena, started at creation (on a background thread
    with ``background=True``, as prefetches are).

    :meth:`collect` waits for them, checks checksums and returns ``name -> tensor`` views of
    the arena. It may be called from several threads and more than once: the first call
    does the work, later ones return its result or error.
    """

    def __init__(
        self,
        source: _Source,
        entries: list[format.TensorEntry],
        *,
        pin_memory: bool,
        verify: bool,
        background: bool,
    ):
        self.source = source
        self.verify = verify
        self.runs = tensor_runs(entries)
        self.arena = aligned_tensor(_place_runs(self.runs, source.data_offset), lock=pin_memory)
        self.spans, self.labels = _plan_spans(
            self.runs, source.data_offset, self.arena.data_ptr(), direct=source.direct
        )
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Any] = []
        self._bar: Any = None
        self._crcs: list[list[int]] | None = None
        self._error: BaseException | None = None
        self._result: dict[str, torch.Tensor] | None = None
        if background:
            threading.Thread(target=self._transfer, name="fastckpt-prefetch", daemon=True).start()
        else:
            self._transfer()

    def on_finish(self, callback: Any) -> None:
        """Calls ``callback(self)`` once the transfer is over (at once if it already is)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def _progress(self, nbytes: int) -> None:
        bar = self._bar
        if bar is not None:
            with self._lock:
                bar.update(nbytes)

    def _transfer(self) -> None:
        source = self.source
        try:
            if source.direct:
                crcs = parallel_io.read_direct(
                    source.executor,
                    source.file,
                    self.spans,
                    owner=self.arena,
                    checksum=self.verify,
                    on_progress=self._progress,
                )
            else:
                crcs = parallel_io.read_buffered(
                    source.file, self.spans, checksum=self.verify, on_progress=self._progress
                )
            self._crcs = crcs
        except BaseException as exc:  # noqa: BLE001 - handed to whoever collects
            self._error = exc
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def wait_quietly(self) -> None:
        """Waits until no transfer of this read is running; raises nothing."""
        self._done.wait()

    def collect(self, *, progress: bool | None = None) -> dict[str, torch.Tensor]:
        if not self._done.is_set():
            total = sum(span.nbytes for span in self.spans)
            with progress_bar(total, "loading", enabled=progress) as bar:
                with self._lock:
                    self._bar = bar
                self._done.wait()
                self._bar = None
        with self._lock:
            if self._result is None and self._error is None:
                try:
                    if self.verify:
                        actual = _tensor_crcs(self.labels, self._crcs or [])
                        _check_crcs(self.runs, actual, self.source.crcs, self.source.path)
                    self._result = {
                        e.name: tensor_view(self.arena, run.arena_pos + (e.begin - run.begin), e)
                        for run in self.runs
                        for e in run.entries
                    }
                except BaseException as exc:  # noqa: BLE001 - kept for later callers too
                    self._error = exc
            if self._error is not None:
                raise self._error
            return self._result


def _check_crcs(
    runs: list[Run], actual: dict[str, int], expected: dict[str, int], path: str
) -> None:
    """ChecksumError naming the first tensor (in file order) whose CRC32C is not the recorded one."""
    for run in runs:
        for e in run.entries:
            want = expected.get(e.name)
            got = actual.get(e.name, 0)
            if want is not None and got != want:
                raise ChecksumError(
                    f"tensor {e.name!r} in {path} is damaged: "
                    f"CRC32C {got:08x}, expected {want:08x}",
                    tensor=e.name,
                    filename=path,
                )


def _place_runs(runs: list[Run], data_offset: int) -> int:
    """Sets each run's arena position, keeping its file offset modulo the page (so O_DIRECT
    stays possible); returns the arena's size."""
    pos = 0
    for run in runs:
        pos = (
            -(-pos // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT
            + (data_offset + run.begin) % BUFFER_ALIGNMENT
        )
        run.arena_pos = pos
        pos += run.end - run.begin
    return pos


def _span_bytes(total: int, direct: bool) -> int:
    """The most bytes one span covers."""
    if direct:
        return _DIRECT_PIECE
    share = total // (parallel_io.worker_count() * _SPANS_PER_WORKER)
    share = -(-share // _MIN_SPAN) * _MIN_SPAN  # whole MiBs keep spans page-aligned
    return max(_MIN_SPAN, min(_DIRECT_PIECE, share))


def _plan_spans(
    runs: list[Run], data_offset: int, arena: int, *, direct: bool
) -> tuple[list[Span], list[list[tuple[str, int]]]]:
    """The spans that read ``runs`` into the arena at ``arena`` (cut at file offsets that
    are multiples of the span size), and per span its checksum segments as (tensor, bytes).

    A tensor can cover several spans (its CRC is then joined from theirs) and a span several
    tensors (one segment each); empty tensors take no segment.
    """
    step = _span_bytes(sum(r.end - r.begin for r in runs), direct)
    spans: list[Span] = []
    labels: list[list[tuple[str, int]]] = []
    for run in runs:
        start = run.begin
        while start < run.end:
            absolute = data_offset + start
            stop = min(run.end, (absolute // step + 1) * step - data_offset)
            cuts, segments = [], []
            for e in run.entries:
                lo, hi = max(e.begin, start), min(e.end, stop)
                if hi > lo:
                    if lo > start:
                        cuts.append(lo - start)
                    segments.append((e.name, hi - lo))
            spans.append(
                Span(
                    absolute, arena + run.arena_pos + (start - run.begin), stop - start, tuple(cuts)
                )
            )
            labels.append(segments)
            start = stop
    return spans, labels


def _tensor_crcs(labels: list[list[tuple[str, int]]], span_crcs: list[list[int]]) -> dict[str, int]:
    """Each tensor's CRC32C, joined from its segments' CRCs in file order."""
    crcs: dict[str, int] = {}
    for segments, values in zip(labels, span_crcs):
        for (name, nbytes), value in zip(segments, values):
            crcs[name] = crc32c_combine(crcs[name], value, nbytes) if name in crcs else value
    return crcs


def open_checkpoint(
    f: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    gds: bool | None = None,
    direct_io: bool | None = None,
    **io: Any,
) -> CheckpointReader:
    """Opens a checkpoint for lazy reading (exported as ``fastckpt.open``).

    Args:
        f: the file's path.
        device: where :meth:`~CheckpointReader.get_tensor` puts tensors: ``"cpu"`` or
            ``"cuda[:N]"`` (read through page-locked staging buffers into GPU memory).
        gds: for a CUDA device, read with GPUDirect Storage (``True``: GDS or
            ``EngineUnavailableError``; ``None``: when ``FASTCKPT_GDS=1`` and GDS runs here).
        direct_io: ``True``/``False`` forces O_DIRECT / page-cache reads; default: chosen at
            each read by what is in memory (see :attr:`CheckpointReader.read_mode`).
        **io: ``engine``, ``block_size``, ``queue_depth``, ``intra_op_parallelism``.

    Example:
        >>> import torch, fastckpt
        >>> fastckpt.save({"x": torch.arange(4)}, "/tmp/fastckpt-open2.safetensors")
        >>> with fastckpt.open("/tmp/fastckpt-open2.safetensors") as r:
        ...     r.info("x").dtype, r.get_tensor("x").tolist()
        (torch.int64, [0, 1, 2, 3])
    """
    return CheckpointReader(f, device=device, gds=gds, direct_io=direct_io, **io)
