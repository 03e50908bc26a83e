"""``fastckpt.save``: stream a state dict into a direct-I/O safetensors file, atomically.

The pipeline: flatten the object into named tensors (:mod:`fastckpt.checkpoint.tree`), plan the
layout (:mod:`fastckpt.format`), then copy the tensors in file order into staging buffers
from a bounded pool (:mod:`fastckpt.io.staging_pool`) and hand each full buffer to the engine while
the next one fills: copy and I/O overlap, and the extra memory is the pool's budget,
whatever the checkpoint's size. Each tensor is read from its source once; the CRC32C of each
of its pieces (:data:`fastckpt.format.DEFAULT_PIECE_SIZE` bytes) is computed from the staging
buffer (hardware instruction where present) while or after that buffer is written, and the
tensor's CRC32C is joined from them. The header, which holds
the checksums, is written last; the file is then committed atomically (:mod:`fastckpt.io.commit`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from concurrent.futures import Future
from typing import Any, Iterator, Mapping

import torch

from fastckpt import _C, config, format
from fastckpt.checkpoint import (
    compressed_tensors,
    compressed_writer,
    dtypes,
    incremental,
    save_order,
    tree,
)
from fastckpt.checkpoint.digests import BufferHasher, TensorDigest, hash_beside
from fastckpt.checkpoint.lazy_guard import LazyGuard
from fastckpt.config import resolve_io
from fastckpt.io import parallel_io
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, BufferRef
from fastckpt.io.checksums import PieceCrcs, piece_cuts
from fastckpt.io.commit import AtomicFile, check_destination
from fastckpt.io.executor import Executor, shared_executor
from fastckpt.io.files import File
from fastckpt.io.parallel_io import Span
from fastckpt.io.staging_pool import StagingBuffer, StagingPool, default_pool, zero_fill
from fastckpt.io.write_mode import SMALL_STATE_BYTES, choose_write_mode
from fastckpt.progress import progress_bar

_log = logging.getLogger("fastckpt")

__all__ = [
    "save",
    "SavePlan",
    "plan_save",
    "StreamWriter",
    "executor_for_destination",
    "save_into",
    "write_into",
    "write_plan",
]


@dataclasses.dataclass
class SavePlan:
    """Everything decided before the first byte is written.

    Attributes:
        entries: the tensors in file order, with their data-section offsets.
        tensors: stored name -> tensor (a tied tensor under its name and each alias).
        user_metadata, aliases, tree: what goes into ``__metadata__``.
        checksum: whether CRC32C values are recorded.
        alignment: the layout's alignment (bytes).
        piece_size: bytes per checksummed piece of tensors larger than one (0: no piece
            checksums, only one CRC32C per tensor).
        header_size: bytes before the data section (fixed before the CRCs are known,
            because each CRC is stored as exactly 8 hex digits).
        references: tensors of the saved object not written but referred to in an earlier
            file (an incremental save, :mod:`fastckpt.checkpoint.incremental`), or None.
        known_hashes: stored name -> XXH3-128 already computed (not hashed again).
        record: what this save remembers of its tensors for the next incremental save.
        index_draft: the index the file will have, completed and kept once its header is
            made (:mod:`fastckpt.checkpoint.known_indexes`).
    """

    entries: list[format.TensorEntry]
    tensors: dict[str, torch.Tensor]
    user_metadata: dict[str, str] | None
    aliases: dict[str, str]
    tree: Any
    checksum: bool
    alignment: int
    header_size: int = 0
    piece_size: int = format.DEFAULT_PIECE_SIZE
    references: Any = None  # fastckpt.format.references.References
    known_hashes: dict[str, str] = dataclasses.field(default_factory=dict)
    record: Any = None  # fastckpt.checkpoint.incremental.SaveRecord
    index_draft: Any = None  # fastckpt.checkpoint.incremental.IndexDraft
    #: compressed tensors' true dtype, shape and CRC32C (``tensors`` holds them raw; the
    #: CRC32Cs are known once written)
    compressed: dict[str, format.compressed.CompressedTensor] = dataclasses.field(
        default_factory=dict
    )
    #: tensors stored compressed, written by compressed_writer.py (their entries are planned
    #: as large as a frame can get, and the header's room with them, until written)
    frames: dict[str, compressed_tensors.FrameJob] = dataclasses.field(default_factory=dict)

    @property
    def data_size(self) -> int:
        return self.entries[-1].end if self.entries else 0

    @property
    def file_size(self) -> int:
        return self.header_size + self.data_size

    def header(
        self,
        crcs: Mapping[str, int] | None,
        pieces: Mapping[str, list[int]] | None = None,
        hashes: Mapping[str, str] | None = None,
    ) -> bytes:
        """The encoded header (length prefix, JSON, padding) with these checksums: one
        CRC32C per tensor, the pieces' CRC32Cs of the tensors larger than one piece, and
        each tensor's XXH3-128 (``hashes``)."""
        recorded = self.checksum and crcs is not None
        metadata = format.build_metadata(
            self.user_metadata,
            crcs=dict(crcs) if recorded and crcs is not None else None,
            aliases=self.aliases or None,
            tree=self.tree,
            pieces=pieces if recorded and self.piece_size else None,
            piece_size=self.piece_size or None,
            hashes=hashes if recorded else None,
            references=self.references,
        )
        if self.compressed:
            metadata[format.compressed.KEY_COMPRESSED] = format.compressed.encode_table(
                self.compressed
            )
        return format.encode_header(self.entries, metadata, self.alignment)

    def checksummers(self) -> dict[str, PieceCrcs]:
        """A :class:`~fastckpt.io.checksums.PieceCrcs` per stored tensor, to feed its bytes
        (a :class:`~fastckpt.checkpoint.digests.TensorDigest`: it hashes them too)."""
        known = self.known_hashes
        return {
            e.name: TensorDigest(e.nbytes, self.piece_size, known.get(e.name)) for e in self.entries
        }

    def write_header(self, file: File, sums: Mapping[str, PieceCrcs]) -> None:
        """Writes the header with the checksums ``sums`` hold (:meth:`header_from`) into the
        room planned for it at the start of ``file``."""
        header = self.header_from(sums)
        if len(header) != self.header_size:  # it would overwrite the first tensor's bytes
            raise AssertionError("header size changed between planning and writing")
        file.pwrite_all(header, 0)

    def header_from(self, sums: Mapping[str, PieceCrcs]) -> bytes:
        """The encoded header with the checksums that ``sums`` (fed every byte) hold."""
        hashes = {n: getattr(acc, "strong", None) for n, acc in sums.items()}
        missing = [n for n, h in hashes.items() if h is None]
        if not self.checksum:  # nothing was fed: no checksums, no hashes
            return self.header(None)
        if missing:  # a writer fed CRCs without bytes: it must hash them (hash_memory)
            raise AssertionError(f"tensor {missing[0]!r} was not hashed while it was written")
        if self.record is not None:  # CRC32Cs of the bytes the hashes were computed from
            from_bytes = {n: acc.whole for n, acc in sums.items() if getattr(acc, "from_bytes", 0)}
            self.record.hashed(hashes, from_bytes)
        header = self.header(
            {name: acc.whole for name, acc in sums.items()},
            {name: acc.pieces for name, acc in sums.items() if acc.pieces},
            hashes,  # type: ignore[arg-type]
        )
        if self.index_draft is not None:
            self.index_draft.remember(header, hashes)
        return header


def _check_tensor(name: str, t: torch.Tensor) -> None:
    if type(t) is not torch.Tensor and type(t.detach()) is not torch.Tensor:
        # DTensor, FakeTensor, wrapper subclasses: their bytes are not in one local storage
        # (nn.Parameter passes: detach() gives its plain tensor).
        raise TypeError(
            f"tensor {name!r} is a {type(t).__name__}, a tensor subclass whose bytes fastckpt "
            "cannot read directly: save a plain tensor (for a DTensor, .full_tensor() or "
            ".to_local()), or save a distributed state dict through fastckpt.dcp"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"tensor {name!r} is on device {t.device}, which fastckpt cannot save")


def plan_save(
    obj: Any,
    *,
    metadata: Mapping[str, str] | None = None,
    alignment: int = format.DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    piece_size: int = format.DEFAULT_PIECE_SIZE,
    base: str | os.PathLike[str] | None = None,
    frozen: incremental.Frozen = None,
    destination: str | None = None,
    compress: bool | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> SavePlan:
    """Flattens ``obj`` and plans the file's layout; raises before anything is written.

    With ``base`` (and the ``destination`` path), only the tensors whose bytes differ from
    ``base``'s are planned; the others become references (:mod:`.incremental`). A
    ``destination`` also lets the next incremental save skip hashing what has not changed.
    ``storage_options`` open a ``base`` at a URL.

    Example:
        >>> import torch
        >>> plan = plan_save({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
        >>> [e.name for e in plan.entries], plan.header_size
        (['b', 'w'], 4096)
    """
    if isinstance(alignment, bool) or not isinstance(alignment, int):
        raise TypeError(f"alignment must be an int, got {type(alignment).__name__}")
    _check_piece_size(piece_size)
    compression = compressed_tensors.check_compress(compress)
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of str -> str, got {type(metadata).__name__}")
    flat = tree.flatten(obj, allow_pickle=allow_pickle)
    # A tied tensor is also stored under each alias: readers that know no aliases
    # (safetensors' load_file, other languages) then see every key of a state dict, while
    # fastckpt reads it once and gives the alias the very same tensor.
    stored = {**flat.tensors, **{a: flat.tensors[t] for a, t in flat.aliases.items()}}
    specs = []
    for name, t in stored.items():
        _check_tensor(name, t)
        shape = dtypes.stored_shape(t.dtype, t.shape, name=name)
        specs.append((name, dtypes.to_safetensors(t.dtype), shape))
    choice = incremental.choose(
        stored,
        specs,
        base,
        destination,
        frozen=frozen,
        checksum=checksum,
        storage_options=storage_options,
        aliases=flat.aliases,
    )
    if choice.references is not None:
        specs = [spec for spec in specs if spec[0] not in choice.references.tensors]
        stored = {name: stored[name] for name, _, _ in specs}
    frames: dict[str, compressed_tensors.FrameJob] = {}
    if compression is not None:  # frames: written (and sized) by compressed_writer.py
        specs, frames = compressed_tensors.plan_frames(stored, specs, compression)
    entries = format.plan_layout(specs, alignment)
    if frames:  # sized as large as they can get until written
        entries = compressed_tensors.frame_entries(entries, frames)
    plan = SavePlan(
        entries=entries,
        tensors=stored,
        references=choice.references,
        known_hashes=choice.hashes,
        record=choice.record,
        index_draft=choice.draft,
        user_metadata=dict(metadata) if metadata is not None else None,
        aliases=flat.aliases,
        tree=flat.tree,
        checksum=checksum,
        alignment=alignment,
        piece_size=piece_size,
        compressed=compressed_tensors.placeholder_table(frames),
        frames=frames,
    )
    # Every CRC is 8 hex digits, so zeros of the right count size the header exactly.
    zeros = {
        e.name: [0] * (format.piece_count(e.nbytes, piece_size) if piece_size else 0)
        for e in entries
    }
    no_hashes = {e.name: "0" * format.HASH_HEX_DIGITS for e in entries}
    plan.header_size = len(
        plan.header({e.name: 0 for e in entries}, {n: z for n, z in zeros.items() if z}, no_hashes)
        if checksum and piece_size
        else plan.header({e.name: 0 for e in entries} if checksum else None, None, no_hashes)
    )
    return plan


def _check_piece_size(piece_size: int) -> None:
    if isinstance(piece_size, bool) or not isinstance(piece_size, int):
        raise TypeError(f"piece_size must be an int, got {type(piece_size).__name__}")
    if not 0 <= piece_size <= format.MAX_PIECE_SIZE or piece_size % format.DEFAULT_ALIGNMENT:
        raise ValueError(
            f"piece_size must be 0 or a positive multiple of {format.DEFAULT_ALIGNMENT} up to "
            f"{format.MAX_PIECE_SIZE}, got {piece_size}"
        )


def byte_chunks(t: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """uint8 tensors covering ``t``'s bytes in row-major order, none larger than ``max_bytes``.

    Contiguous tensors are viewed in place; a non-contiguous one is made contiguous a slab
    of rows at a time, so the temporary memory stays near ``max_bytes``.
    """
    t = t.detach().resolve_conj().resolve_neg()
    if t.numel() == 0:
        return
    if t.is_contiguous():
        data = t.reshape(-1).view(torch.uint8)
        for start in range(0, data.numel(), max_bytes):
            yield data[start : start + max_bytes]
        return
    row_bytes = (t.numel() // t.shape[0]) * t.element_size()
    step = max(1, max_bytes // max(1, row_bytes))
    for start in range(0, t.shape[0], step):
        yield from byte_chunks(t[start : start + step].contiguous(), max_bytes)


class StreamWriter:
    """Copies a plan's tensors through staging buffers into a file, overlapping copy and I/O.

    :meth:`fill` copies every tensor (returning when the last byte is in a staging buffer
    or on its way to disk); :meth:`finish` waits for the writes and writes the header;
    :meth:`abort` waits for in-flight writes (so no buffer is reused under I/O) and gives
    every buffer back. ``fill`` then ``finish`` may run on different threads.

    Checksums of CPU tensors are computed in the copy's own pass (each step checksummed as it
    is read, :func:`fastckpt._C.memcpy_crc`). With deferred writes (an asynchronous save's
    snapshot), and for device tensors, they are computed from each staging buffer when it is
    retired (after its write, before reuse), in buffer order: the snapshot stays a plain
    multi-threaded memcpy, so it costs about what copying the state costs.

    With ``defer_writes=True`` (asynchronous saves) full buffers are not written during
    :meth:`fill` while free buffers remain, so the snapshot does not compete with disk
    writes for memory bandwidth and CPU; :meth:`finish` starts them. When the pool runs
    out, deferred buffers are written and recycled as usual.

    Interrupts: :meth:`abort` collects every write in flight before it returns (or raises
    a Ctrl-C that came meanwhile), so neither the file nor a buffer goes while the engine
    still uses it. Once ``cancel`` (an event) is set, the next buffer or wait raises
    ``KeyboardInterrupt``: how pending asynchronous saves stop at exit.
    """

    def __init__(
        self,
        plan: SavePlan,
        file: File,
        executor: Executor,
        pool: StagingPool,
        *,
        progress: bool | None = None,
        defer_writes: bool = False,
        cancel: threading.Event | None = None,
        guard: LazyGuard | None = None,
    ):
        self.plan, self.file, self.executor, self.pool = plan, file, executor, pool
        self._guard = guard  # a lazy save's fence and version check (lazy_guard.py)
        self._cancel = cancel  # once set, the next buffer or wait raises KeyboardInterrupt
        self._defer = defer_writes
        # full buffers not yet written: (buffer, bytes to write, segments)
        self._deferred: list[tuple[StagingBuffer, int, list[tuple[str, int, int]]]] = []
        self.sums = plan.checksummers()  # each tensor's (and piece's) CRC32C so far
        # each full buffer's bytes are hashed (XXH3-128) on a thread while it is written
        self._hasher = BufferHasher() if plan.checksum else None
        # (op id, buffer, [(tensor name, offset in buffer, length)]) in submission order
        self._inflight: collections.deque[tuple[int, StagingBuffer, list[tuple[str, int, int]]]] = (
            collections.deque()
        )
        self._offset = plan.header_size  # file offset of the next buffer
        # (buffer id, offset) of segments whose CRC32Cs were fed while copied (see _copy)
        self._summed: set[tuple[int, int]] = set()
        # An asynchronous save's snapshot (deferred writes) stays a plain copy, the fastest
        # the caller can be let go; its checksums are computed when buffers are retired.
        self._fuse = plan.checksum and not defer_writes
        self._progress = progress
        self._threads = parallel_io.worker_count()

    # -- buffers ----------------------------------------------------------------------------
    def _next_buffer(self) -> StagingBuffer:
        self._check_cancelled()
        # A save smaller than one buffer gets a buffer of its own size when the pool has
        # none ready (the pool is not allocated for it); a lazy save streams through its
        # ring's pieces (lazy_guard.py).
        first = self._offset == self.plan.header_size and self._guard is None
        need = self.plan.data_size if first else None
        buf = self.pool.try_acquire(need=need)
        if buf is not None:
            return buf
        self._write_deferred()
        if self._inflight:  # recycle our own oldest buffer once its write is done
            return self._retire_oldest(release=False)
        return self.pool.acquire(need=need)  # held by other saves: wait until one frees up

    def _retire_oldest(self, *, release: bool) -> StagingBuffer:
        """Waits for the oldest write, checksums its buffer, then releases or returns it."""
        self._check_cancelled()
        op_id, buf, segments = self._inflight[0]
        try:
            self.executor.wait(op_id)
        finally:
            # Dropped only once collected: an interrupt raised before the wait began leaves
            # the write running, and abort() must still find it.
            if not self.executor.is_pending(op_id):
                self._inflight.popleft()
        try:
            if self._hasher is not None:
                self._hasher.wait(id(buf))
            if self.plan.checksum:
                for name, at, n in segments:
                    if (id(buf), at) in self._summed:  # checksummed while copied
                        self._summed.discard((id(buf), at))
                        continue
                    acc = self.sums[name]
                    if isinstance(acc, TensorDigest):
                        acc.update_crc(buf.address + at, n)
                    else:
                        acc.update(buf.address + at, n)
        except BaseException:
            self.pool.release(buf)
            raise
        if release:
            self.pool.release(buf)
        return buf

    def _check_cancelled(self) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise KeyboardInterrupt(f"save to {self.file.path} cancelled")

    def _write_deferred(self) -> None:
        while self._deferred:
            buf, nbytes, segments = self._deferred.pop(0)
            self._submit(buf, nbytes, segments, now=True)

    def _submit(
        self,
        buf: StagingBuffer,
        nbytes: int,
        segments: list[tuple[str, int, int]],
        *,
        now: bool = False,
    ) -> None:
        if self._defer and not now:
            self._deferred.append((buf, nbytes, segments))
            return
        try:
            if self._guard is not None:
                self._guard.wait_copies()  # the buffer's device-to-host copies are complete
            # The buffer is full (and, from CUDA, its copies landed): hash it while it is
            # written. A deferred buffer is hashed only now, after the snapshot: hashing
            # beside the snapshot's copy would slow it down (measured: a 2 GiB eager
            # async_save blocked 0.27 s instead of 0.15 s).
            if self._hasher is not None:
                self._hasher.start(
                    id(buf), [(self.sums[name], buf.address + at, n) for name, at, n in segments]
                )
            op_id = self.executor.submit(
                self.file,
                BufferRef(buf.address, buf.nbytes, buf),
                self._offset,
                write=True,
                nbytes=nbytes,
            )
        except BaseException:
            self.pool.release(buf)
            raise
        self._inflight.append((op_id, buf, segments))
        self._offset += nbytes

    # -- phases -----------------------------------------------------------------------------
    def fill(self) -> None:
        """Copies every tensor into staging buffers and submits each full buffer."""
        plan = self.plan
        piece = self.pool.piece
        buf: StagingBuffer | None = None
        segments: list[tuple[str, int, int]] = []
        used = 0
        with progress_bar(plan.data_size, "saving", enabled=self._progress) as bar:
            try:
                for entry in plan.entries:
                    guard = self._guard
                    if guard is not None:
                        # A lazy save reads a piece at a time through its guard
                        # (lazy_guard.py), so a fence snapshots only the bytes past the
                        # piece being copied. CUDA tensors: copies queued on a side stream,
                        # which _submit waits for before each write.
                        on_device = guard.on_device(entry.name)
                        if on_device:
                            guard.begin_device(entry.name)
                        else:
                            guard.begin(entry.name)
                        done, n = 0, entry.nbytes
                        while done < n:
                            if buf is None:
                                buf, used, segments = self._next_buffer(), 0, []
                            take = min(n - done, buf.nbytes - used)
                            if on_device:
                                buf.register_for_cuda()
                                guard.copy_to_host(
                                    entry.name, done, buf.tensor()[used : used + take]
                                )
                            else:
                                with guard.read(entry.name, done, take) as part:
                                    self._copy(part, buf, used)
                            segments.append((entry.name, used, take))
                            used += take
                            done += take
                            if used == buf.nbytes:
                                full, buf = buf, None
                                self._submit(full, used, segments)
                                bar.update(used)
                        guard.copied(entry.name)
                        continue
                    for chunk in byte_chunks(plan.tensors[entry.name], piece):
                        done, n = 0, chunk.numel()
                        while done < n:
                            if buf is None:
                                buf, used, segments = self._next_buffer(), 0, []
                            take = min(n - done, buf.nbytes - used)
                            self._copy(chunk[done : done + take], buf, used, entry.name)
                            segments.append((entry.name, used, take))
                            used += take
                            done += take
                            if used == buf.nbytes:
                                full, buf = buf, None
                                self._submit(full, used, segments)
                                bar.update(used)
                if buf is not None and used:
                    # O_DIRECT writes whole blocks: pad the last one; finish() truncates.
                    padded = -(-used // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT
                    zero_fill(buf, used, padded)
                    last, buf = buf, None
                    self._submit(last, padded, segments)
                    bar.update(used)
                if self._guard is not None:
                    self._guard.wait_copies()  # the last CUDA tensors' checks
            finally:
                if buf is not None:
                    if self._guard is not None:
                        self._guard.settle()  # no queued copy may land in it once given back
                    self.pool.release(buf)

    def _copy(
        self, chunk: torch.Tensor, buf: StagingBuffer, at: int, name: str | None = None
    ) -> None:
        """Copies ``chunk`` into ``buf`` at ``at``. With the ``name`` of the tensor it is the
        next bytes of (CPU, checksums on), its CRC32Cs are computed in the same pass and fed
        now (:func:`fastckpt._C.memcpy_crc`): a second pass over the staging buffer once
        written read it back from memory, and on two cores held the next copy up (a
        512 MiB save here: 0.18 s of CRC at 3 GB/s against 0.02 s in the copy)."""
        n = chunk.numel()
        if chunk.device.type == "cpu" and name is not None and self._fuse:
            acc = self.sums[name]
            cuts = list(piece_cuts(acc.taken, n, acc.piece_size))
            crcs = _C.memcpy_crc(buf.address + at, chunk.data_ptr(), n, cuts, self._threads)
            for lo, hi, crc in zip([0, *cuts], [*cuts, n], crcs):
                acc.add(crc, hi - lo)
            self._summed.add((id(buf), at))
        elif chunk.device.type == "cpu":
            _C.memcpy(buf.address + at, chunk.data_ptr(), n, self._threads)
        else:
            # Device to host, synchronous, into CUDA-registered memory: DMA speed, and the
            # snapshot an asynchronous save waits for costs about one pinned copy.
            buf.register_for_cuda()
            buf.tensor()[at : at + n].copy_(chunk)

    def drain(self) -> None:
        """Waits for every data write; each tensor's checksums and hash (``sums``) are then
        complete."""
        try:
            self._write_deferred()
            while self._inflight:
                self._retire_oldest(release=True)
        except BaseException:
            self.abort()
            raise
        if self._hasher is not None:
            self._hasher.close()

    def finish(self) -> None:
        """Waits for every data write, then writes the header and trims the padding."""
        self.drain()
        self.plan.write_header(self.file, self.sums)
        if self.file.size() != self.plan.file_size:
            self.file.truncate(self.plan.file_size)

    def abort(self) -> None:
        """Waits for in-flight writes, ignoring their errors, and returns the buffers.

        An interrupt (Ctrl-C) while waiting does not cut the wait short: every write is
        collected first (none may outlive the file or the buffers), then it is raised.
        """
        if self._hasher is not None:
            self._hasher.close()  # it reads buffers about to be released
        for buf, _, _ in self._deferred:
            self.pool.release(buf)
        self._deferred.clear()
        interrupt = None
        if self._inflight:  # (a writer that never wrote may have no executor yet)
            ops = [op_id for op_id, _, _ in self._inflight]
            interrupt = self.executor.drain(ops, cancel=True)  # unstarted writes: dropped
        while self._inflight:
            self.pool.release(self._inflight.popleft()[1])
        if interrupt is not None:
            raise interrupt


def save(
    obj: Any,
    f: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None = None,
    alignment: int = format.DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    piece_size: int = format.DEFAULT_PIECE_SIZE,
    progress: bool | None = None,
    staging_bytes: int | None = None,
    direct_io: bool | None = None,
    engine: str | None = None,
    block_size: int | None = None,
    queue_depth: int | None = None,
    intra_op_parallelism: int | None = None,
    overwrite_readonly: bool = False,
    base: str | os.PathLike[str] | None = None,
    frozen: incremental.Frozen = None,
    compress: bool | str | None = None,
) -> None:
    """Saves ``obj`` to the path ``f`` as a safetensors file laid out for direct I/O.

    ``obj`` is a flat ``str -> Tensor`` dict (stored under its own keys, so
    ``safetensors.torch.load_file(f)`` returns the same dict), or any nesting of dict, list,
    tuple, None, bool, int, float, str and tensors (``fastckpt.load`` returns it with the
    same types). Other objects raise ``TypeError`` naming where they sit, unless
    ``allow_pickle=True``.

    The write is atomic and durable: a temporary file in the same directory is fsynced and
    renamed over ``f``; on any error it is removed and an existing file at ``f`` is untouched.
    An ``async_save`` to the same path still pending is waited for first, so this save's
    file is the one left at ``f``.
    The new file keeps the permission bits of the one it replaces; a read-only file at ``f``
    is refused with ``PermissionError`` unless ``overwrite_readonly=True``.

    Args:
        metadata: str -> str pairs stored in the header's ``__metadata__``.
        alignment: the data section and every tensor whose size is a multiple of it start
            on multiples of it (a power of two, >= 8).
        checksum: record a CRC32C per tensor (checked by ``load(verify=True)``), and one
            per ``piece_size`` bytes of each larger tensor (checked by verified range reads,
            :meth:`~fastckpt.checkpoint.read.CheckpointReader.read_range`).
        piece_size: bytes per checksummed piece (a multiple of 4 KiB; default 4 MiB): a
            verified range read reads the pieces covering the range. 0 records none.
        allow_pickle: pickle objects that have no safe encoding (loading them then needs
            ``weights_only=False``).
        progress: show a progress bar (default: on a terminal, unless FASTCKPT_NO_PROGRESS).
        staging_bytes: staging-memory budget (default 224 MiB; see :mod:`fastckpt.config`).
        direct_io: ``True`` writes with O_DIRECT through staging buffers; ``False`` writes
            every tensor from its own memory through the page cache, on every core, with no
            staging copy. Default: ``False`` on memory file systems (tmpfs) and where O_DIRECT
            is refused, ``True`` elsewhere (the device's speed, no page-cache pollution).
        engine, block_size, queue_depth, intra_op_parallelism: I/O settings (see
            :mod:`fastckpt.config` for defaults and the tuned configuration).
        overwrite_readonly: replace a file at ``f`` that has no write permission.
        base: an earlier checkpoint (a local path; for a save to a URL, a URL): write only
            the tensors whose bytes differ from its tensors of the same name, and record a
            verified reference to the others (an incremental checkpoint, see
            docs/incremental.md). Loading it needs the base's files; plain safetensors
            readers see only the tensors written.
        frozen: with ``base``, names (or a predicate on names) of tensors the caller
            promises are unchanged since ``base``: referred to without being hashed.
        compress: store tensors compressed, losslessly (default None: off). ``True``
            chooses per dtype (byte planes + zstd for floating point, zstd for the rest);
            ``"zstd"`` or ``"byteplane"`` force one codec. Needs ``zstandard``. Tensors are
            compressed on every core while earlier ones are written, through the page cache
            (``direct_io`` does not apply), in a few chunks' memory. Only fastckpt reads such a
            file: plain safetensors readers refuse it (see docs/compression.md).

    Example:
        >>> import torch, fastckpt
        >>> model = torch.nn.Linear(4, 2)
        >>> fastckpt.save({"model": model.state_dict(), "epoch": 3}, "/tmp/fastckpt-doc.safetensors")
        >>> fastckpt.load("/tmp/fastckpt-doc.safetensors")["epoch"]
        3
    """
    path = check_destination(f)
    plan = plan_save(
        obj,
        metadata=metadata,
        alignment=alignment,
        checksum=checksum,
        allow_pickle=allow_pickle,
        piece_size=piece_size,
        base=base,
        frozen=frozen,
        destination=path,
        compress=compress,
    )
    explicit = (engine, block_size, queue_depth, intra_op_parallelism)
    if all(o is None for o in explicit) and _small_buffered(plan, direct_io):
        _save_small(
            plan,
            path,
            progress=progress,
            overwrite_readonly=overwrite_readonly,
            direct_io=direct_io,
        )
        return
    executor = executor_for_destination(
        path,
        engine=engine,
        block_size=block_size,
        queue_depth=queue_depth,
        intra_op_parallelism=intra_op_parallelism,
    )
    write_plan(
        plan,
        path,
        executor,
        default_pool(staging_bytes),
        progress=progress,
        direct_io=direct_io,
        overwrite_readonly=overwrite_readonly,
    )


def save_into(
    obj: Any,
    out: AtomicFile,
    *,
    metadata: Mapping[str, str] | None = None,
    alignment: int = format.DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    piece_size: int = format.DEFAULT_PIECE_SIZE,
    progress: bool | None = None,
    staging_bytes: int | None = None,
    direct_io: bool | None = None,
    engine: str | None = None,
    block_size: int | None = None,
    queue_depth: int | None = None,
    intra_op_parallelism: int | None = None,
    compress: bool | str | None = None,
) -> None:
    """:func:`save` into a staged file that the caller commits or aborts (a file of a
    multi-file checkpoint, :class:`fastckpt.io.commit_set.CommitSet`); same options.

    Example:
        >>> import os, tempfile, torch
        >>> target = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> with AtomicFile(target) as out:
        ...     save_into({"w": torch.ones(2)}, out)
        >>> os.path.exists(target)
        True
    """
    plan, executor = plan_and_executor(
        obj,
        out.path,
        metadata=metadata,
        alignment=alignment,
        checksum=checksum,
        allow_pickle=allow_pickle,
        piece_size=piece_size,
        engine=engine,
        block_size=block_size,
        queue_depth=queue_depth,
        intra_op_parallelism=intra_op_parallelism,
        compress=compress,
    )
    write_into(
        plan, out, executor, default_pool(staging_bytes), progress=progress, direct_io=direct_io
    )


def plan_and_executor(
    obj: Any,
    path: str,
    *,
    metadata: Mapping[str, str] | None = None,
    alignment: int = format.DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    piece_size: int = format.DEFAULT_PIECE_SIZE,
    engine: str | None = None,
    block_size: int | None = None,
    queue_depth: int | None = None,
    intra_op_parallelism: int | None = None,
    base: str | os.PathLike[str] | None = None,
    frozen: incremental.Frozen = None,
    compress: bool | str | None = None,
) -> tuple[SavePlan, Executor]:
    """What every save of ``obj`` to ``path`` starts with: its plan (checked before any file
    is touched; with ``base``, only the changed tensors) and the executor configured for
    ``path``'s file system."""
    plan = plan_save(
        obj,
        metadata=metadata,
        alignment=alignment,
        checksum=checksum,
        allow_pickle=allow_pickle,
        piece_size=piece_size,
        base=base,
        frozen=frozen,
        destination=path,
        compress=compress,
    )
    executor = executor_for_destination(
        path,
        engine=engine,
        block_size=block_size,
        queue_depth=queue_depth,
        intra_op_parallelism=intra_op_parallelism,
    )
    return plan, executor


def executor_for_destination(path: str, **explicit: Any) -> Executor:
    """The shared executor for writing ``path``: explicit I/O settings (None: unset) over the
    configuration resolved for its directory's file system (see :mod:`fastckpt.config`)."""
    return shared_executor(resolve_io(os.path.dirname(os.path.abspath(path)), explicit))


def write_plan(
    plan: SavePlan,
    path: str,
    executor: Executor,
    pool: StagingPool,
    *,
    progress: bool | None = None,
    direct_io: bool | None = None,
    overwrite_readonly: bool = False,
) -> None:
    """Writes a planned checkpoint to ``path`` with the atomic commit protocol: from the
    tensors' own memory through the page cache where that is the faster path (see
    :func:`save`'s ``direct_io``), else through staging buffers with O_DIRECT.

    Asynchronous saves to the same path still pending are waited for first, so none of
    them commits after (and over) this one."""
    save_order.wait_for_earlier(path)
    with AtomicFile(path, overwrite_readonly=overwrite_readonly) as out:
        write_into(plan, out, executor, pool, progress=progress, direct_io=direct_io)


def write_into(
    plan: SavePlan,
    out: AtomicFile,
    executor: Executor,
    pool: StagingPool,
    *,
    progress: bool | None = None,
    direct_io: bool | None = None,
) -> None:
    """Writes a planned checkpoint into ``out``'s temporary file; the caller commits it
    (one file of a multi-file checkpoint, :mod:`fastckpt.io.commit_set`) or aborts it."""
    if plan.frames:  # compressed while written (compressed_writer.py)
        out.reserve(plan.file_size)
        compressed_writer.write_frames(plan, out.file, progress=progress)
        return
    if _buffered_save(plan, out, direct_io):
        # A small file written in order through the page cache is laid out contiguously by
        # the file system's delayed allocation: reserving its blocks first only adds a
        # metadata update to the fsync (a full disk still fails, at the write or fsync).
        if plan.file_size > SMALL_STATE_BYTES:
            out.reserve(plan.file_size)
        _write_from_tensors(plan, out.file, progress=progress)
        return
    out.reserve(plan.file_size)
    writer = StreamWriter(plan, out.file, executor, pool, progress=progress)
    try:
        writer.fill()
        writer.finish()
    except BaseException:
        writer.abort()
        raise


def _through_page_cache(plan: SavePlan, out: AtomicFile, direct_io: bool | None) -> bool:
    """Whether to write from the tensors' memory through the page cache (CPU tensors only):
    when asked, where O_DIRECT is refused, or on a memory file system. Asynchronous saves
    build their in-memory paths on this answer, so it does not depend on the state's size
    (:func:`_buffered_save` does)."""
    return _write_mode(plan, out, direct_io, by_size=False) == "buffered"


def _buffered_save(plan: SavePlan, out: AtomicFile, direct_io: bool | None) -> bool:
    """Whether :func:`save` writes from the tensors' memory through the page cache: the
    choice of :mod:`fastckpt.io.write_mode` (small states, the tuned mode, ...), logged."""
    return _write_mode(plan, out, direct_io, by_size=True) == "buffered"


def _small_buffered(plan: SavePlan, direct_io: bool | None) -> bool:
    """Whether :func:`save` writes ``plan`` as a small state through the page cache
    whatever the file system: CPU tensors, nothing compressed, at most
    ``SMALL_STATE_BYTES``, and no O_DIRECT asked for (``direct_io=True`` or
    ``FASTCKPT_DIRECT_IO=1``). :func:`choose_write_mode` answers "buffered" for every such
    plan (a memory file system, one that refuses O_DIRECT, or a small state), so neither
    the file system nor the I/O configuration need be looked up."""
    if plan.frames or plan.file_size > SMALL_STATE_BYTES or direct_io:
        return False
    if direct_io is None and config.direct_io():
        return False
    return all(t.device.type == "cpu" for t in plan.tensors.values())


def _save_small(
    plan: SavePlan,
    path: str,
    *,
    progress: bool | None,
    overwrite_readonly: bool,
    direct_io: bool | None,
) -> None:
    """:func:`write_plan` of a small state (:func:`_small_buffered`): the same commit (a
    temporary file written from the tensors' memory, fsynced, renamed over ``path``, the
    directory fsynced), without an O_DIRECT descriptor, an engine or a write-mode lookup."""
    if _log.isEnabledFor(logging.DEBUG):  # as choose_write_mode logs its choice
        why = (
            "direct_io=False"
            if direct_io is False
            else "FASTCKPT_DIRECT_IO=0"
            if config.direct_io() is False
            else f"a small state ({plan.file_size / 2**20:.1f} MiB, at most "
            f"{SMALL_STATE_BYTES >> 20} MiB): through the page cache"
        )
        _log.debug("saving %s: buffered (%s)", path, why)
    if save_order.any_pending():
        save_order.wait_for_earlier(path)
    with AtomicFile(path, direct=False, overwrite_readonly=overwrite_readonly) as out:
        _write_from_tensors(plan, out.file, progress=progress)


def _write_mode(plan: SavePlan, out: AtomicFile, direct_io: bool | None, *, by_size: bool) -> str:
    mode, _ = choose_write_mode(
        out.path,
        plan.file_size if by_size else None,
        direct_available=out.file.direct_fd >= 0,
        explicit=direct_io,
        on_device=any(t.device.type != "cpu" for t in plan.tensors.values()),
    )
    return mode


def _write_from_tensors(plan: SavePlan, file: File, *, progress: bool | None) -> None:
    """Writes every tensor from its own memory (contiguous ones on every core, the others a
    bounded slab at a time), checksumming each step before it is written; then the header."""
    spans: list[Span] = []
    labels: list[str] = []  # the tensor each span belongs to
    keep: list[torch.Tensor] = []  # tensors whose memory the spans point into
    strided: list[format.TensorEntry] = []
    sums = plan.checksummers()
    step = max(1 << 20, min(64 << 20, plan.data_size // (parallel_io.worker_count() * 4) or 1))
    for e in plan.entries:
        t = plan.tensors[e.name].detach().resolve_conj().resolve_neg()
        if e.nbytes == 0:
            continue
        if not t.is_contiguous():
            strided.append(e)
            continue
        keep.append(t)
        pieces = sums[e.name].piece_size  # cut spans at piece boundaries: one CRC per piece
        for at in range(0, e.nbytes, step):
            n = min(step, e.nbytes - at)
            cuts = piece_cuts(at, n, pieces)
            spans.append(Span(plan.header_size + e.begin + at, t.data_ptr() + at, n, cuts))
            labels.append(e.name)
    lock = threading.Lock()
    # The strong hashes are computed from the tensors' memory beside the writes (xxhash
    # releases the GIL): the engine's workers checksum CRC32C, not XXH3.
    hashing = _hash_beside(plan, sums) if plan.checksum else None
    with progress_bar(plan.data_size, "saving", enabled=progress) as bar:

        def advance(nbytes: int) -> None:
            with lock:
                bar.update(nbytes)

        try:
            found = parallel_io.write_buffered(
                file, spans, checksum=plan.checksum, on_progress=advance
            )
        finally:
            if hashing is not None:
                hashing.result()
        if plan.checksum:
            for name, span, values in zip(labels, spans, found):
                _add_segments(sums[name], span, values)
        for e in strided:  # rare (transposed views): made contiguous a slab at a time
            at = 0
            acc = sums[e.name]
            for chunk in byte_chunks(plan.tensors[e.name], 64 << 20):
                n = chunk.numel()
                piece_ends = list(piece_cuts(at, n, acc.piece_size))
                offset = plan.header_size + e.begin + at
                values = _C.pwrite_crc(
                    file.fd, chunk.data_ptr(), n, offset, piece_ends, True, file.path
                )
                if isinstance(acc, TensorDigest):
                    acc.hash_memory(chunk.data_ptr(), n)
                _add_segments(acc, Span(offset, chunk.data_ptr(), n, tuple(piece_ends)), values)
                at += n
                advance(n)
    del keep
    plan.write_header(file, sums)


def _hash_beside(plan: SavePlan, sums: Mapping[str, PieceCrcs]) -> Future[None]:
    """Starts hashing the contiguous tensors of ``plan`` from their memory, on a shared
    thread (:func:`~fastckpt.checkpoint.digests.hash_beside`)."""
    jobs = []
    for e in plan.entries:
        t = plan.tensors[e.name].detach().resolve_conj().resolve_neg()
        acc = sums[e.name]
        if e.nbytes and t.is_contiguous() and isinstance(acc, TensorDigest):
            jobs.append((acc, t.data_ptr(), t.numel() * t.element_size()))
    if plan.data_size <= _HASH_INLINE_BYTES:  # less than handing it to a thread costs
        done: Future[None] = Future()
        for acc, address, nbytes in jobs:
            acc.hash_memory(address, nbytes)
        done.set_result(None)
        return done
    return hash_beside(jobs)


# States up to this size are hashed on the caller's thread (XXH3: ~0.1 ms per MiB here, about
# what waking a shared thread and waiting for it costs).
_HASH_INLINE_BYTES = 1 << 20


def _add_segments(acc: PieceCrcs, span: Span, crcs: list[int]) -> None:
    """Feeds the CRC32C of each checksum segment of ``span`` (cut at piece boundaries)."""
    bounds = (0, *span.cuts, span.nbytes)
    for lo, hi, crc in zip(bounds, bounds[1:], crcs):
        acc.add(crc, hi - lo)
