"""``fastckpt.open``: the reader of a single checkpoint file, wherever it lives, and the read
path that ``fastckpt.load`` uses.

One implementation over the storage interface (:mod:`fastckpt.storage`): range planning,
verification and prefetch are written once, for local files and fsspec URLs alike. Reads go
straight from storage into one page-aligned arena, split into spans that every core (or
every connection) works on; the tensors returned lie in the arena, so nothing is copied
after the read (on the CPU each has a storage of its own over its bytes, see
:func:`~fastckpt.checkpoint.tensor_runs.own_bytes`). Each byte range is placed in the arena at the same offset modulo the
page size as in the file, which keeps direct I/O possible even for files whose data is not
aligned.

How the bytes come in is chosen per read by the storage (see :attr:`CheckpointReader.read_mode`):
``"buffered"`` (the page cache: the bytes are resident, or the file system refuses O_DIRECT),
``"staged"`` or ``"direct"`` (O_DIRECT with the native engine, through the staging pool or
straight into the tensors), ``"mapped"``, or ``"ranged"`` (parallel ranged reads of a URL).
Local files never go through fsspec.

Checksums of spans are joined per tensor (:mod:`fastckpt.checkpoint.tensor_crcs`), so even one
huge tensor is verified on every core; a GPU load joins them from the pieces passing through
host memory, by the same mechanism.

Part of a tensor is read with :meth:`CheckpointReader.read_range` (a byte range) or
:meth:`CheckpointReader.get_slice` (rows): verified, only the checksummed pieces covering the
range are read (see :mod:`fastckpt.checkpoint.range_read`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import mmap
import threading
from collections.abc import Iterator
from typing import Any, Mapping, Sequence

import torch

from fastckpt import format
from fastckpt.checkpoint import compressed_tensors
from fastckpt.checkpoint.chained_reader import open_chain
from fastckpt.checkpoint.digests import hash_tensors
from fastckpt.checkpoint.header_view import HeaderView, TensorInfo, read_header
from fastckpt.checkpoint.range_read import RangeSource, TensorSlice, read_byte_range
from fastckpt.checkpoint.reader import Reader, check_framework
from fastckpt.checkpoint.tensor_crcs import TensorCrcs, check_crcs, damaged
from fastckpt.checkpoint.tensor_runs import (
    Run,
    arena_exporter,
    place_runs,
    tensor_runs,
    tensor_view,
)
from fastckpt.config import staging_bytes
from fastckpt.io import device_copy, parallel_io
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, arena_tensor
from fastckpt.io.parallel_io import Span
from fastckpt.progress import progress_bar
from fastckpt.storage import Storage, open_storage, to_local
from fastckpt.storage.file_object import FileObjectStorage, is_file_object
from fastckpt.storage.resident_file import ResidentFile

__all__ = ["CheckpointReader", "open_checkpoint", "TensorInfo", "TensorSlice"]

_log = logging.getLogger("fastckpt")

# Where runs of tensors start in a GPU arena, modulo which their data offsets are kept.
_DEVICE_ALIGN = 256
# verify() reads in batches of about this many bytes, so memory stays bounded on huge files.
_VERIFY_BATCH = 256 << 20
_LOCAL_OPTIONS = ("direct_io", "engine", "block_size", "queue_depth", "intra_op_parallelism")
_URL_OPTIONS = ("part_size", "parallel", "header_probe")


def _check_device(device: str | torch.device) -> torch.device:
    target = torch.device(device)
    if target.type == "cuda":
        device_copy.require_cuda()  # say so now, before any reading
    elif target.type not in ("cpu", "meta"):
        raise ValueError(f"device {target} is not supported (use 'cpu' or 'cuda[:N]')")
    return target


class CheckpointReader(HeaderView, Reader):
    """A fastckpt/safetensors file opened for lazy reading (a :class:`~fastckpt.Reader`).

    Use :func:`fastckpt.open` to create one; ``f`` is a path, a ``file://`` URL, an fsspec
    URL, a readable binary file object or an open :class:`~fastckpt.storage.Storage`.

    Example:
        >>> import torch, fastckpt
        >>> fastckpt.save({"w": torch.ones(2, 2), "b": torch.zeros(2)}, "/tmp/fastckpt-open.safetensors")
        >>> with fastckpt.open("/tmp/fastckpt-open.safetensors") as f:
        ...     sorted(f.keys()), f.info("w").shape, f.get_tensor("b").tolist()
        (['b', 'w'], (2, 2), [0.0, 0.0])
    """

    def __init__(
        self,
        f: Any,
        *,
        device: str | torch.device = "cpu",
        gds: bool | None = None,
        storage_options: Mapping[str, Any] | None = None,
        **options: Any,
    ):
        self.device = _check_device(device)
        self.gds = gds
        if is_file_object(f):
            f = FileObjectStorage(f)
        if isinstance(f, Storage):
            self._storage = f
        else:
            local = to_local(f) is not None
            wanted = _LOCAL_OPTIONS if local else _URL_OPTIONS
            unknown = set(options) - set(_LOCAL_OPTIONS) - set(_URL_OPTIONS)
            if unknown:
                raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
            # the other kind's options do not apply here (a sharded directory passes both)
            chosen = {k: v for k, v in options.items() if k in wanted and v is not None}
            self._storage = open_storage(f, storage_options=storage_options, **chosen)
        self.path = self._storage.location
        if gds and self._storage.ranged:
            self._storage.close()
            raise io.UnsupportedOperation(
                f"{self.path}: GPUDirect Storage (gds=True) reads local files only; "
                "a URL is read into host memory (leave gds unset)"
            )
        try:
            self._adopt_header(read_header(self._storage))
        except BaseException:
            self._storage.close()
            raise
        self._prefetched: dict[str, _PendingRead] = {}
        self._lock = threading.Condition()
        self._in_flight = 0  # reads using the storage now; close() waits for them
        self._closed = False
        self._mapped: torch.Tensor | None = None
        self._bytes_read = 0

    # -- what every reader says ------------------------------------------------------------
    @property
    def aliases(self) -> dict[str, str]:
        return dict(self.meta.aliases)

    @property
    def structure(self) -> Any:
        return self.meta.tree

    @property
    def storage(self) -> Storage:
        """Where the bytes live."""
        return self._storage

    @property
    def read_mode(self) -> str:
        """How the data section is read now: ``"buffered"`` (through the page cache: the
        bytes are resident, the file system is memory-backed or refuses O_DIRECT, or
        ``direct_io=False``), ``"staged"`` or ``"direct"`` (O_DIRECT, through the staging
        pool or straight into the tensors), ``"mapped"``, or ``"ranged"`` (parallel ranged
        reads of a URL). Decided again at each read, since the page cache changes;
        ``direct_io=True``/``False`` (or ``FASTCKPT_DIRECT_IO``) forces it where the file
        system allows.

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"x": torch.ones(4)}, "/dev/shm/fastckpt-mode.safetensors")
            >>> fastckpt.open("/dev/shm/fastckpt-mode.safetensors").read_mode
            'buffered'
            >>> import os; os.remove("/dev/shm/fastckpt-mode.safetensors")
        """
        with self._reading():
            mode, _ = self._storage.choose_mode((self.header.data_offset, self.header.data_size))
        return mode

    def _mode(self, region: tuple[int, int]) -> str:
        mode, why = self._storage.choose_mode(region)
        _log.debug("reading %s: %s (%s)", self.path, mode, why)
        return mode

    @property
    def bytes_read(self) -> int:
        """Data bytes this reader has asked of its storage so far, by every read (prefetches,
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

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self._bytes_read += nbytes

    # -- lifetime of reads -----------------------------------------------------------------
    def _enter(self) -> None:
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.path}: the reader is closed")
            self._in_flight += 1

    def _leave(self, *_: Any) -> None:
        with self._lock:
            self._in_flight -= 1
            if not self._in_flight:
                self._lock.notify_all()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Holds the storage open for one read: close() waits until it is over."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

    def _check_open(self) -> None:
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.path}: the reader is closed")

    # -- reading ---------------------------------------------------------------------------
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
                file, the tensor and the piece's byte range).
            NoChecksumsError: the file has no checksums and ``verify=True``.

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"w": torch.arange(10, dtype=torch.int32)}, "/tmp/fastckpt-rr.safetensors")
            >>> with fastckpt.open("/tmp/fastckpt-rr.safetensors") as r:
            ...     out = torch.empty(3, dtype=torch.int32)
            ...     r.read_range("w", 8, 20, out=out, verify=True).tolist()
            [2, 3, 4]
        """
        if compressed_tensors.asks_compressed(self, [name]):  # decompresses the chunks needed
            return compressed_tensors.read_range(self, name, start, stop, out=out, verify=verify)
        with self._reading():
            e, dest = self._range_request(name, start, stop, out)
            self.require_checksums(verify)
            # O_DIRECT or the page cache, by what is resident of this range (not of the file)
            mode = self._mode((self.header.data_offset + e.begin + start, stop - start))
            source = RangeSource(
                self._storage,
                self.path,
                self.header.data_offset,
                self.meta.crcs,
                self.meta.pieces,
                mode,
            )
            data = read_byte_range(
                source,
                e,
                start,
                stop,
                out=dest,
                verify=verify,
                span_bytes=self._storage.span_bytes(stop - start, mode),
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
        self._check_open()
        e = self._entry(name)
        if e.name in self.compressed:
            return compressed_tensors.get_slice(self, e, verify)
        return TensorSlice(e, lambda lo, hi: self.read_range(e.name, lo, hi, verify=verify))

    def _entries_of(self, names: Sequence[str] | None) -> dict[str, format.TensorEntry]:
        if isinstance(names, str):
            raise TypeError("names must be a sequence of str, not a str")
        if names is None:
            entries = self._shared_entries()
        else:
            entries = {}
            for n in names:
                e = self._entry(n)
                entries[e.name] = e
        # compressed tensors are read as their stored bytes (compressed_tensors.py)
        return (
            compressed_tensors.as_stored(entries, self.compressed) if self.compressed else entries
        )

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
        Prefetched tensors are taken from their prefetch (verified now when ``verify`` asks
        and the prefetch did not; read again when ``pin_memory`` asks and it was not pinned).
        """
        if compressed_tensors.asks_compressed(self, names):  # read, then decompressed
            if verify:  # copies of the others: checked by the read of those it makes
                self._check_stored_copies(self._compressed_names(names))
            return compressed_tensors.read_decoded(
                self, names, pin_memory=pin_memory, verify=verify, progress=progress
            )
        if verify:
            self._check_stored_copies(names)
        with self._reading():
            entries = self._entries_of(names)
            self.require_checksums(verify)
            result: dict[str, torch.Tensor] = {}
            to_read = []
            taken: dict[int, tuple[_PendingRead, list[format.TensorEntry]]] = {}
            with self._lock:  # once, not per tensor: a small state has little else to do
                pendings = [self._prefetched.pop(name, None) for name in entries]
            for e, pending in zip(entries.values(), pendings):
                if pending is not None and (pending.pinned or not pin_memory):
                    taken.setdefault(id(pending), (pending, []))[1].append(e)
                else:
                    to_read.append(e)
            for pending, wanted in taken.values():
                views = pending.collect(progress=False)
                if verify:
                    check_crcs(wanted, pending.actual_crcs(), self.meta.crcs or {}, self.path)
                result.update({e.name: views[e.name] for e in wanted})
            if self.device.type != "cpu":
                result = {name: t.to(self.device) for name, t in result.items()}
            if self.device.type == "cuda" and self._storage_is_local():
                result.update(self._read_to_device(to_read, verify=verify, progress=progress))
                return result
            fresh = self._read_entries(
                to_read, pin_memory=pin_memory, verify=verify, progress=progress
            )
        if self.device.type != "cpu":
            fresh = {name: t.to(self.device) for name, t in fresh.items()}
        result.update(fresh)
        return result

    def _storage_is_local(self) -> bool:
        return not self._storage.ranged

    def map(
        self, names: Sequence[str] | None = None, *, verify: bool = False
    ) -> dict[str, torch.Tensor]:
        """Stored tensors (all when ``names`` is None) as views of a copy-on-write mapping of
        the file: nothing is read until a tensor's pages are touched, and memory is used
        only for the pages touched. Writing to a tensor changes only this process's copy of
        that page, never the file. Local files only (``io.UnsupportedOperation`` for a URL).

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
        if compressed_tensors.asks_compressed(self, names):  # those decompressed into memory
            return compressed_tensors.map_decoded(self, names, verify=verify)  # (copies too)
        if verify:
            self._check_stored_copies(names)
        with self._reading():
            if self.device.type != "cpu":
                raise ValueError(f"mapping gives CPU tensors; this reader loads to {self.device}")
            entries = self._entries_of(names)
            self.require_checksums(verify)
            data = self._mapping()
            if verify:
                runs = tensor_runs(entries.values())
                for run in runs:
                    run.arena_pos = run.begin
                spans, labels = _plan_spans(
                    runs, 0, data.data_ptr(), step=self._storage.span_bytes(data.numel(), "")
                )
                actual = _tensor_crcs(entries.values(), labels, parallel_io.checksum_memory(spans))
                check_crcs(entries.values(), actual, self.meta.crcs or {}, self.path)
        exporter = arena_exporter(data)
        return {name: tensor_view(data, e.begin, e, exporter) for name, e in entries.items()}

    def _mapping(self) -> torch.Tensor:
        """The data section as a uint8 tensor over a private (copy-on-write) file mapping."""
        file = self._storage.local_file()  # io.UnsupportedOperation for a URL, saying why
        with self._lock:
            if self._mapped is None:
                size = self.header.data_offset + self.header.data_size
                if self.header.data_size == 0:
                    self._mapped = torch.empty(0, dtype=torch.uint8)
                else:
                    mapping = mmap.mmap(file.fd, size, access=mmap.ACCESS_COPY)
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
        reads straight into the arena with GDS); checksums are joined from the pieces while
        they are in host memory and checked as a CPU load's are.
        """
        runs = tensor_runs(entries)
        # each run keeps its offset modulo 256, so tensors stay aligned to their dtype
        arena = device_copy.device_arena(place_runs(runs, 0, _DEVICE_ALIGN), self.device)
        self._count(sum(run.end - run.begin for run in runs))
        crcs = TensorCrcs(entries) if verify and self.meta.crcs else None
        base = self.header.data_offset
        file = self._storage.local_file()
        executor = self._storage.executor  # type: ignore[attr-defined]
        # The staging reads follow the CPU loads' policy (forced, tuned, or resident);
        # a mapped read has nothing to map into here, so it stages through the page cache.
        direct = self._mode((base, self.header.data_size)) in ("direct", "staged")
        with progress_bar(sum(r.end - r.begin for r in runs), "loading", enabled=progress) as bar:
            for run in runs:

                def on_host(offset: int, address: int, nbytes: int) -> None:
                    if crcs is not None:
                        crcs.add_memory(offset - base, address, nbytes)
                    bar.update(nbytes)

                device_copy.read_into_device(
                    executor,
                    file,
                    base + run.begin,
                    run.end - run.begin,
                    arena[run.arena_pos : run.arena_pos + (run.end - run.begin)],
                    staging_bytes=staging_bytes(),
                    gds=self.gds,
                    on_host=on_host,
                    direct=direct,
                )
        if crcs is not None:
            check_crcs(entries, crcs.result(), self.meta.crcs or {}, self.path)
        return _views(arena, runs)

    def _read_entries(
        self,
        entries: list[format.TensorEntry],
        *,
        pin_memory: bool,
        verify: bool,
        progress: bool | None,
    ) -> dict[str, torch.Tensor]:
        if isinstance(self._storage, ResidentFile):
            return self._read_here(entries, pin_memory=pin_memory, verify=verify)
        pending = self._start(entries, pin_memory=pin_memory, checksum=verify, background=False)
        views = pending.collect(progress=progress)
        if verify:
            check_crcs(entries, pending.actual_crcs(), self.meta.crcs or {}, self.path)
        return views

    def _read_here(
        self, entries: list[format.TensorEntry], *, pin_memory: bool, verify: bool
    ) -> dict[str, torch.Tensor]:
        """:meth:`_read_entries` of a small file in memory (:class:`ResidentFile`): read on
        this thread, one ``pread`` per run of tensors, each checksummed in the same pass;
        no background machinery, since the whole read takes less than setting it up."""
        base = self.header.data_offset
        runs = tensor_runs(entries)
        arena = arena_tensor(place_runs(runs, base, BUFFER_ALIGNMENT), lock=pin_memory)
        spans, labels = _plan_spans(runs, base, arena.data_ptr(), step=1 << 62)
        crcs = self._storage.read_spans(spans, owner=arena, mode="buffered", checksum=verify)
        self._count(sum(span.nbytes for span in spans))
        if verify:
            actual = _tensor_crcs(entries, labels, crcs)
            check_crcs(entries, actual, self.meta.crcs or {}, self.path)
        return _views(arena, runs)

    def _start(
        self,
        entries: list[format.TensorEntry],
        *,
        pin_memory: bool,
        checksum: bool,
        background: bool,
    ) -> _PendingRead:
        """Starts reading ``entries``; the storage stays open until the read is over."""
        mode = self._mode((self.header.data_offset, self.header.data_size))
        self._enter()
        try:
            pending = _PendingRead(
                self._storage,
                mode,
                self.header.data_offset,
                entries,
                pin_memory=pin_memory,
                checksum=checksum,
                background=background,
                on_finish=self._leave,
            )
        except BaseException:
            self._leave()
            raise
        self._count(pending.nbytes)
        return pending

    def prefetch(
        self, names: Sequence[str], *, pin_memory: bool = False, verify: bool = False
    ) -> None:
        """Starts reading these tensors in the background and returns at once.

        A later :meth:`get_tensor`/:meth:`get_tensors` of a prefetched name waits only for
        what is still in flight, and checks then what it asks to check (``verify=True`` here
        checksums the bytes as they land, so that check costs nothing later). Errors surface
        there.

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"a": torch.ones(3), "b": torch.zeros(3)}, "/tmp/fastckpt-pre.safetensors")
            >>> with fastckpt.open("/tmp/fastckpt-pre.safetensors") as r:
            ...     r.prefetch(["b"])
            ...     r.get_tensor("b").tolist()
            [0.0, 0.0, 0.0]
        """
        with self._reading():
            entries = {
                name: e
                for name, e in self._entries_of(names).items()
                if name not in self._prefetched
            }
            self.require_checksums(verify)
            pending = self._start(
                list(entries.values()), pin_memory=pin_memory, checksum=verify, background=True
            )
            with self._lock:
                for name in entries:
                    self._prefetched[name] = pending

    def verify(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> list[str]:
        """Checks stored CRC32Cs, and XXH3-128s where recorded; returns the names of damaged
        tensors (empty when intact).

        Every byte a reader may read is checked: the stored copy of a tied tensor too (the
        bytes a safetensors reader returns under the alias, which fastckpt never reads), and
        each compressed tensor is decompressed, a few chunks at a time, and checked against
        the CRC32C (and XXH3-128) of its uncompressed bytes, since a frame may match its
        stored CRC32C and still not decode. The XXH3-128 a save records is checked too: the
        CRC32C and it were computed from the same bytes, so they must both match them.

        Raises:
            NoChecksumsError: the file has no checksums (it cannot be verified).

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"w": torch.ones(3)}, "/tmp/fastckpt-verify.safetensors")
            >>> fastckpt.open("/tmp/fastckpt-verify.safetensors").verify()
            []
        """
        return list(self.verify_failures(names, progress=progress))

    def verify_failures(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> dict[str, str]:
        """:meth:`verify`, saying which check each damaged tensor failed: ``"CRC32C"`` (its
        stored bytes), ``"XXH3-128"``, or ``"decompressed CRC32C"`` (a compressed tensor
        that does not decode to the bytes its header records); in file order.

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"w": torch.ones(3)}, "/tmp/fastckpt-verify.safetensors")
            >>> fastckpt.open("/tmp/fastckpt-verify.safetensors").verify_failures()
            {}
        """
        with self._reading():
            self.require_checksums()
            wanted = {**self._entries_of(names), **self._stored_copies(names)}
            hashes: dict[str, str] = {}
            found = dict.fromkeys(self._damaged(list(wanted.values()), progress, hashes), "CRC32C")
            recorded = self.meta.hashes or {}
            for name, digest in hashes.items():
                if name not in found and recorded.get(name) not in (None, digest):
                    found[name] = "XXH3-128"
            for name in wanted:
                if name in self.compressed and name not in found:
                    failed = compressed_tensors.check_streaming(
                        self, compressed_tensors.stored_entry(self.header.entries[name]),
                        xxh3_128=recorded.get(name),
                    )  # fmt: skip
                    if failed is not None:
                        _log.info("%s: tensor %r: %s", self.path, name, failed[1])
                        found[name] = failed[0]
        order = {name: i for i, name in enumerate(self.header.entries)}
        return dict(sorted(found.items(), key=lambda item: order.get(item[0], len(order))))

    def _check_stored_copies(self, names: Sequence[str] | None = None) -> None:
        """Checks the stored copies of the tied tensors among ``names`` (all when None; a
        name may be the alias or the tensor it copies) against the CRC32C of the tensor they
        copy. fastckpt reads a tied tensor once, under its first name, and never the copy
        stored under the alias; but a safetensors reader returns the copy, so a read that
        verifies checks it too. Costs one more read of each tied tensor's bytes (none when
        nothing is tied).

        Raises:
            ChecksumError: naming the damaged copy (the alias) and the file.
        """
        copies = self._stored_copies(names)
        if not copies or not self.meta.crcs:
            return
        with self._reading():
            entries = list(copies.values())
            actual = self._actual_crcs(entries)
            check_crcs(entries, actual, self._copy_crcs(copies), self.path)

    def _stored_copies(self, names: Sequence[str] | None) -> dict[str, format.TensorEntry]:
        """The stored copies of tied tensors among ``names`` (all when None), by alias; a
        compressed one as its stored bytes. A tensor named is intact only when every copy of
        it is, so naming the tensor a copy holds names the copy too (an incremental
        checkpoint's reader names stored tensors only)."""
        if isinstance(names, str):
            raise TypeError("names must be a sequence of str, not a str")
        entries, aliases = self.header.entries, self.meta.aliases
        if names is None:
            wanted = list(aliases)
        else:
            named = set(names)
            wanted = [a for a, target in aliases.items() if a in named or target in named]
        copies = {a: entries[a] for a in wanted if a in entries}
        return compressed_tensors.as_stored(copies, self.compressed) if copies else copies

    def _compressed_names(self, names: Sequence[str] | None) -> list[str]:
        """The stored names of the compressed tensors among ``names`` (all when None)."""
        return [n for n in self._entries_of(names) if n in self.compressed]

    def _copy_crcs(self, copies: Mapping[str, format.TensorEntry]) -> dict[str, int]:
        """The CRC32C each copy must have: the one recorded for the tensor it copies (the
        header's own check made the copy's recorded CRC32C equal to it)."""
        crcs, aliases = self.meta.crcs or {}, self.meta.aliases
        return {
            alias: crcs[aliases[alias]] if aliases[alias] in crcs else crcs[alias]
            for alias in copies
            if aliases[alias] in crcs or alias in crcs
        }

    def _actual_crcs(
        self,
        entries: list[format.TensorEntry],
        *,
        progress: bool | None = False,
        hashes: dict[str, str] | None = None,
    ) -> dict[str, int]:
        """The CRC32C of each of ``entries``' bytes, read in batches of about
        ``_VERIFY_BATCH`` bytes so that memory stays bounded whatever the file's size; into
        ``hashes``, when given, the XXH3-128 of the bytes of those the header records one
        for (a compressed tensor's is of its decoded bytes: not here), from the same read."""
        recorded = (self.meta.hashes or {}) if hashes is not None else {}
        actual: dict[str, int] = {}
        with progress_bar(sum(e.nbytes for e in entries), "verifying", enabled=progress) as bar:
            for batch in _batches(entries, _VERIFY_BATCH):
                pending = self._start(batch, pin_memory=False, checksum=True, background=False)
                views = pending.collect(progress=False)
                actual.update(pending.actual_crcs())
                to_hash = {
                    e.name: views[e.name]
                    for e in batch
                    if e.name in recorded and e.name not in self.compressed and e.name in views
                }
                if hashes is not None and to_hash:
                    hashes.update(hash_tensors(to_hash, parallel_io.worker_count()))
                bar.update(sum(e.nbytes for e in batch))
        return actual

    def _damaged(
        self,
        entries: list[format.TensorEntry],
        progress: bool | None,
        hashes: dict[str, str] | None = None,
    ) -> list[str]:
        """The names of ``entries`` whose bytes do not match their recorded CRC32C (a stored
        copy of a tied tensor: the CRC32C of the tensor it copies); ``hashes``: see
        :meth:`_actual_crcs`."""
        expected = {**(self.meta.crcs or {}), **self._copy_crcs(self._stored_copies(None))}
        actual = self._actual_crcs(entries, progress=progress, hashes=hashes)
        return damaged(entries, actual, expected)

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Closes the storage, first waiting for every read still using it (prefetches
        included); reading afterwards raises ``ValueError``. Closing twice is harmless."""
        with self._lock:
            self._closed = True
            self._prefetched = {}
            while self._in_flight:
                self._lock.wait()
        self._storage.close()

    def __enter__(self) -> CheckpointReader:
        return self


def _batches(entries: list[format.TensorEntry], limit: int) -> Iterator[list[format.TensorEntry]]:
    """``entries`` in order, cut into batches of at least ``limit`` bytes (the last one
    smaller); a tensor larger than ``limit`` is a batch of its own."""
    batch: list[format.TensorEntry] = []
    size = 0
    for e in entries:
        batch.append(e)
        size += e.nbytes
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _views(arena: torch.Tensor, runs: list[Run]) -> dict[str, torch.Tensor]:
    """The tensors of ``runs``; on the CPU each with a storage of its own over the arena."""
    exporter = arena_exporter(arena)
    return {
        e.name: tensor_view(arena, run.arena_pos + (e.begin - run.begin), e, exporter)
        for run in runs
        for e in run.entries
    }


class _PendingRead:
    """Reads of some tensors into one arena, started at creation (on a background thread
    with ``background=True``, as prefetches are). Holds the storage, never the reader: a
    dropped reader must not be kept alive by a prefetch it started.

    :meth:`collect` waits for the bytes and returns ``name -> tensor`` views of the arena;
    :meth:`actual_crcs` the tensors' CRC32Cs (from the spans' checksums when it was read with
    ``checksum=True``, else from memory, once). Both may be called from several threads and
    more than once.
    """

    def __init__(
        self,
        storage: Storage,
        mode: str,
        data_offset: int,
        entries: list[format.TensorEntry],
        *,
        pin_memory: bool,
        checksum: bool,
        background: bool,
        on_finish: Any,
    ):
        self.storage, self.mode, self.checksum = storage, mode, checksum
        self.entries = entries
        self.runs = tensor_runs(entries)
        self.arena = arena_tensor(
            place_runs(self.runs, data_offset, BUFFER_ALIGNMENT), lock=pin_memory
        )
        self.pinned = pin_memory
        total = sum(run.end - run.begin for run in self.runs)
        self.spans, self.labels = _plan_spans(
            self.runs, data_offset, self.arena.data_ptr(), step=storage.span_bytes(total, mode)
        )
        self.nbytes = sum(span.nbytes for span in self.spans)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._on_finish = on_finish
        self._bar: Any = None
        self._span_crcs: list[list[int]] | None = None
        self._crcs: dict[str, int] | None = None
        self._error: BaseException | None = None
        if background:
            threading.Thread(target=self._transfer, name="fastckpt-prefetch", daemon=True).start()
        else:
            self._transfer()

    def _progress(self, nbytes: int) -> None:
        bar = self._bar
        if bar is not None:
            with self._lock:
                bar.update(nbytes)

    def _transfer(self) -> None:
        try:
            self._span_crcs = self.storage.read_spans(
                self.spans,
                owner=self.arena,
                mode=self.mode,
                checksum=self.checksum,
                on_progress=self._progress,
            )
        except BaseException as exc:  # noqa: BLE001 - handed to whoever collects
            self._error = exc
        finally:
            self._done.set()
            self._on_finish(self)

    def collect(self, *, progress: bool | None = None) -> dict[str, torch.Tensor]:
        self._wait(progress)
        return _views(self.arena, self.runs)

    def _wait(self, progress: bool | None) -> None:
        """Waits for the reads (raising their error), showing a bar while they last."""
        if not self._done.is_set():
            with progress_bar(self.nbytes, "loading", enabled=progress) as bar:
                with self._lock:
                    self._bar = bar
                self._done.wait()
                self._bar = None
        if self._error is not None:
            raise self._error

    def actual_crcs(self) -> dict[str, int]:
        """Each tensor's CRC32C, joined from the spans' checksums."""
        self._wait(False)  # (no views: building them costs more than a small read)
        with self._lock:
            if self._crcs is None:
                span_crcs = self._span_crcs if self.checksum else None
                if span_crcs is None:  # read without checksums: checksum the memory now
                    span_crcs = parallel_io.checksum_memory(self.spans)
                self._crcs = _tensor_crcs(self.entries, self.labels, span_crcs)
            return self._crcs


def _plan_spans(
    runs: list[Run], data_offset: int, arena: int, *, step: int
) -> tuple[list[Span], list[list[tuple[str, int, int]]]]:
    """The spans that read ``runs`` into the arena at ``arena`` (cut at file offsets that
    are multiples of ``step``), and per span its checksum segments as (tensor, data offset,
    bytes).

    A tensor can cover several spans (its CRC is then joined from theirs) and a span several
    tensors (one segment each); empty tensors take no segment.
    """
    spans: list[Span] = []
    labels: list[list[tuple[str, int, int]]] = []
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
                    segments.append((e.name, lo, hi - lo))
            spans.append(
                Span(
                    absolute, arena + run.arena_pos + (start - run.begin), stop - start, tuple(cuts)
                )
            )
            labels.append(segments)
            start = stop
    return spans, labels


def _tensor_crcs(
    entries: Any, labels: list[list[tuple[str, int, int]]], span_crcs: list[list[int]]
) -> dict[str, int]:
    """Each tensor's CRC32C, joined from its segments' CRCs."""
    crcs = TensorCrcs(entries)
    for segments, values in zip(labels, span_crcs):
        for (name, lo, nbytes), value in zip(segments, values):
            crcs.add(name, lo, value, nbytes)
    return crcs.result()


def open_checkpoint(
    f: Any,
    framework: str = "pt",
    device: str | torch.device = "cpu",
    *,
    gds: bool | None = None,
    direct_io: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **io: Any,
) -> CheckpointReader:
    """Opens a checkpoint file for lazy reading (exported as ``fastckpt.open``).

    Args:
        f: the file's path, a ``file://`` URL, an fsspec URL (``s3://``, ``memory://``, ...),
            or a readable binary file object (``open(path, "rb")``, ``io.BytesIO``), read with
            ``seek``/``readinto`` and left open.
        framework: as ``safetensors.safe_open``'s: ``"pt"`` (torch tensors, the only kind
            fastckpt returns; ``ValueError`` for another).
        device: where :meth:`~CheckpointReader.get_tensor` puts tensors: ``"cpu"`` or
            ``"cuda[:N]"`` (read through page-locked staging buffers into GPU memory).
        gds: for a CUDA device, read with GPUDirect Storage (``True``: GDS or
            ``EngineUnavailableError``; ``None``: when ``FASTCKPT_GDS=1`` and GDS runs here).
        direct_io: ``True``/``False`` forces O_DIRECT / page-cache reads; default: chosen at
            each read by what is in memory (see :attr:`CheckpointReader.read_mode`).
        storage_options: for a URL, passed to its fsspec file system.
        **io: for a local file ``engine``, ``block_size``, ``queue_depth``,
            ``intra_op_parallelism``; for a URL ``part_size`` (bytes per ranged read) and
            ``parallel`` (ranged reads in flight).

    Example:
        >>> import torch, fastckpt
        >>> fastckpt.save({"x": torch.arange(4)}, "/tmp/fastckpt-open2.safetensors")
        >>> with fastckpt.open("/tmp/fastckpt-open2.safetensors") as r:
        ...     r.info("x").dtype, r.get_tensor("x").tolist()
        (torch.int64, [0, 1, 2, 3])
    """
    check_framework(framework)
    reader = CheckpointReader(
        f, device=device, gds=gds, direct_io=direct_io, storage_options=storage_options, **io
    )
    if reader.meta.references is None:
        return reader

    # An incremental checkpoint: its bases are opened alike
    def open_base(path: str) -> CheckpointReader:
        return CheckpointReader(
            path, device=device, gds=gds, direct_io=direct_io, storage_options=storage_options, **io
        )

    return open_chain(reader, open_base)  # type: ignore[return-value]
