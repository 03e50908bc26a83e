"""``fastckpt.open``: a lazy reader of fastckpt and safetensors files, and the read path
that ``fastckpt.load`` uses.

Reads go straight from the file into one page-aligned arena with parallel O_DIRECT; the
tensors returned are views into it, so nothing is copied after the read. Each byte range is
placed in the arena at the same offset modulo the page size as in the file, which keeps
direct I/O possible even for files whose data does not start on an aligned offset.
Checksums are verified piece by piece while later pieces are still being read.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Iterable, Sequence

import torch

from fastckpt import _C, cuda, dtypes, format
from fastckpt._buffers import BufferRef, aligned_tensor
from fastckpt._io import Executor, File, shared_executor
from fastckpt._progress import progress_bar
from fastckpt._verify import StreamingVerifier
from fastckpt.config import resolve_io, staging_bytes
from fastckpt.errors import ChecksumError, HeaderError

__all__ = ["CheckpointReader", "open_checkpoint", "TensorInfo"]

_PAGE = 4096
# Reads are submitted in pieces of this size so checksums of finished pieces are verified
# while the rest is read, and progress can be shown.
_READ_PIECE = 64 << 20
# Where runs of tensors start in a GPU arena, modulo which their data offsets are kept.
_DEVICE_ALIGN = 256


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What the header says of one tensor, known without reading it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute file offset of the first byte


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


@dataclasses.dataclass
class _Run:
    """Adjacent tensors read as one byte range; ``arena_pos`` is where ``begin`` lands."""

    begin: int
    end: int
    entries: list[format.TensorEntry]
    arena_pos: int = 0


def _runs(entries: Iterable[format.TensorEntry]) -> list[_Run]:
    runs: list[_Run] = []
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if runs and e.begin <= runs[-1].end:
            runs[-1].end = max(runs[-1].end, e.end)
            runs[-1].entries.append(e)
        else:
            runs.append(_Run(e.begin, e.end, [e]))
    return runs


class CheckpointReader:
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
            cuda.require_cuda()  # say so now, before any reading
        elif self.device.type not in ("cpu", "meta"):
            raise ValueError(f"device {self.device} is not supported (use 'cpu' or 'cuda[:N]')")
        self.gds = gds
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
        self._file = File(self.path)
        try:
            self._executor: Executor = shared_executor(config)
            self._read_header()
        except BaseException:
            self._file.close()
            raise
        self._prefetched: dict[str, _PendingRead] = {}
        self._lock = threading.Lock()

    # -- header ---------------------------------------------------------------------------
    def _read_header(self) -> None:
        size = self._file.size()
        first8 = _pread_exact(self._file.fd, min(8, size), 0, self.path) if size else b""
        try:
            n = format.parse_header_length(first8, size)
            self.header = format.parse_header(_pread_exact(self._file.fd, n, 8, self.path), size)
            self.meta = format.split_metadata(self.header.metadata)
        except HeaderError as exc:
            raise HeaderError(f"{self.path}: {exc}") from None
        entries = self.header.entries
        for alias, target in self.meta.aliases.items():
            if target not in entries:
                raise HeaderError(
                    f"{self.path}: alias {alias!r} points to missing tensor {target!r}"
                )
            if alias in entries:
                raise HeaderError(f"{self.path}: alias {alias!r} is also a stored tensor")
        if self.meta.crcs is not None:
            unknown = set(self.meta.crcs) - set(entries)
            if unknown:
                raise HeaderError(
                    f"{self.path}: checksum for missing tensor {sorted(unknown)[0]!r}"
                )
        for entry in entries.values():
            dtypes.to_torch(entry.dtype)  # HeaderError for a dtype torch cannot hold

    # -- what the header says -------------------------------------------------------------
    def keys(self) -> list[str]:
        """Every tensor name: stored tensors in file order, then aliases of tied tensors."""
        return list(self.header.entries) + list(self.meta.aliases)

    def metadata(self) -> dict[str, str]:
        """The user's metadata (``__metadata__`` without fastckpt's own ``fastckpt.*`` keys)."""
        return dict(self.meta.user)

    @property
    def has_checksums(self) -> bool:
        """Whether the file records a CRC32C per tensor."""
        return self.meta.crcs is not None

    def _entry(self, name: str) -> format.TensorEntry:
        if not isinstance(name, str):
            raise TypeError(f"tensor names are str, got {type(name).__name__}")
        target = self.meta.aliases.get(name, name)
        try:
            return self.header.entries[target]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in {self.path}") from None

    def info(self, name: str) -> TensorInfo:
        """dtype, shape, size and file offset of a tensor, without reading it."""
        e = self._entry(name)
        return TensorInfo(
            name, dtypes.to_torch(e.dtype), e.shape, e.nbytes, self.header.data_offset + e.begin
        )

    # -- reading --------------------------------------------------------------------------
    def get_tensor(self, name: str) -> torch.Tensor:
        """Reads one tensor (waiting only for what is still in flight if it was prefetched)."""
        return self.get_tensors([name])[name]

    def get_tensors(self, names: Sequence[str], *, verify: bool = False) -> dict[str, torch.Tensor]:
        """Reads several tensors in one batch of parallel reads."""
        if isinstance(names, str):
            raise TypeError("names must be a sequence of str, not a str")
        tensors = self.read(list(names), verify=verify)
        return {n: tensors[self.meta.aliases.get(n, n)] for n in names}

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
        wanted = list(self.header.entries) if names is None else names
        entries = {}
        for n in wanted:
            e = self._entry(n)
            entries[e.name] = e
        if verify and not self.has_checksums:
            raise ChecksumError(f"{self.path} has no checksums to verify", filename=self.path)
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

    def _read_to_device(
        self, entries: list[format.TensorEntry], *, verify: bool, progress: bool | None
    ) -> dict[str, torch.Tensor]:
        """Reads tensors into one arena on this reader's CUDA device; name -> view.

        Disk reads into page-locked staging buffers overlap the copies to the GPU (or cuFile
        reads straight into the arena with GDS); checksums are verified from the host copy.
        """
        runs = _runs(entries)
        pos = 0
        for run in runs:  # keep each run's offset modulo 256 so tensors stay aligned to dtype
            pos = -(-pos // _DEVICE_ALIGN) * _DEVICE_ALIGN + run.begin % _DEVICE_ALIGN
            run.arena_pos = pos
            pos += run.end - run.begin
        arena = cuda.device_arena(pos, self.device)
        crcs = self.meta.crcs if verify else None
        base = self.header.data_offset
        with progress_bar(sum(r.end - r.begin for r in runs), "loading", enabled=progress) as bar:
            for run in runs:
                verifier = StreamingVerifier(run.entries, crcs, self.path) if crcs else None

                def on_host(offset: int, address: int, nbytes: int, verifier=verifier) -> None:
                    if verifier is not None:
                        verifier.feed(offset - base, address, nbytes)
                    bar.update(nbytes)

                cuda.read_into_device(
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
            e.name: _view(arena, run.arena_pos + (e.begin - run.begin), e)
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
        return _PendingRead(self, entries, pin_memory=pin_memory, verify=verify).collect(
            progress=progress
        )

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
        if verify and not self.has_checksums:
            raise ChecksumError(f"{self.path} has no checksums to verify", filename=self.path)
        pending = _PendingRead(self, list(entries.values()), pin_memory=pin_memory, verify=verify)
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
        if not self.has_checksums:
            raise ChecksumError(f"{self.path} has no checksums to verify", filename=self.path)
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
        """Closes the file (waiting for any prefetch still reading it)."""
        with self._lock:
            pending, self._prefetched = list(self._prefetched.values()), {}
        for p in pending:
            p.cancel()
        self._file.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _PendingRead:
    """Reads of some tensors, submitted at creation into one arena.

    :meth:`collect` waits for them (verifying checksums piece by piece as pieces complete)
    and returns ``name -> tensor`` views of the arena. It may be called from several threads
    and more than once: the first call does the work, later ones return its result or error.
    """

    def __init__(
        self,
        reader: CheckpointReader,
        entries: list[format.TensorEntry],
        *,
        pin_memory: bool,
        verify: bool,
    ):
        self.reader = reader
        self.verify = verify
        self._lock = threading.Lock()
        self._result: dict[str, torch.Tensor] | None = None
        self._error: BaseException | None = None
        base = reader.header.data_offset
        self.runs = _runs(entries)
        pos = 0
        for run in self.runs:  # same offset modulo the page as in the file: O_DIRECT stays possible
            pos = -(-pos // _PAGE) * _PAGE + (base + run.begin) % _PAGE
            run.arena_pos = pos
            pos += run.end - run.begin
        self.arena = aligned_tensor(pos, lock=pin_memory)
        address = self.arena.data_ptr()
        self.ops: list[tuple[int, _Run, int, int]] = []  # (op id, run, piece start, piece end)
        executor, file = reader._executor, reader._file
        try:
            for run in self.runs:
                start = run.begin
                while start < run.end:
                    stop = min(run.end, _piece_end(base + start) - base)
                    ref = BufferRef(
                        address + run.arena_pos + (start - run.begin), stop - start, self.arena
                    )
                    self.ops.append(
                        (executor.submit(file, ref, base + start, write=False), run, start, stop)
                    )
                    start = stop
        except BaseException:
            self.cancel()
            raise

    def collect(self, *, progress: bool | None = None) -> dict[str, torch.Tensor]:
        with self._lock:
            if self._result is None and self._error is None:
                try:
                    self._result = self._wait_and_view(progress)
                except BaseException as exc:
                    self._error = exc
            if self._error is not None:
                raise self._error
            return self._result

    def cancel(self) -> None:
        """Waits for every op without raising (no read may outlive the arena's owner)."""
        for op, *_ in self.ops:
            try:
                self.reader._executor.wait(op)
            except OSError:
                pass

    def _wait_and_view(self, progress: bool | None) -> dict[str, torch.Tensor]:
        crcs = self.reader.meta.crcs if self.verify else None
        verifiers = (
            {id(run): StreamingVerifier(run.entries, crcs, self.reader.path) for run in self.runs}
            if crcs
            else {}
        )
        address = self.arena.data_ptr()
        total = sum(r.end - r.begin for r in self.runs)
        with progress_bar(total, "loading", enabled=progress) as bar:
            for i, (op, run, start, stop) in enumerate(self.ops):
                try:
                    self.reader._executor.wait(op)
                    if verifiers:
                        verifiers[id(run)].feed(
                            start, address + run.arena_pos + (start - run.begin), stop - start
                        )
                except BaseException:
                    self.ops = self.ops[i + 1 :]
                    self.cancel()  # no read may outlive this failure unwaited
                    raise
                bar.update(stop - start)
        for verifier in verifiers.values():
            verifier.finish()
        return {e.name: self._view(run, e) for run in self.runs for e in run.entries}

    def _view(self, run: _Run, e: format.TensorEntry) -> torch.Tensor:
        return _view(self.arena, run.arena_pos + (e.begin - run.begin), e)


def _view(arena: torch.Tensor, start: int, e: format.TensorEntry) -> torch.Tensor:
    """The tensor of ``e`` whose bytes start at ``arena[start]``, as a view where possible."""
    dtype = dtypes.to_torch(e.dtype)
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=dtype, device=arena.device)
    raw = arena[start : start + e.nbytes]
    if raw.data_ptr() % raw.new_empty(0, dtype=dtype).element_size():
        raw = raw.clone()  # files from other writers may not align tensors to their dtype
    return raw.view(dtype).view(e.shape)


def _piece_end(offset: int) -> int:
    """The next multiple of the read piece after ``offset``."""
    return (offset // _READ_PIECE + 1) * _READ_PIECE


def open_checkpoint(
    f: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    gds: bool | None = None,
    storage_options: Any = None,
    **io: Any,
) -> CheckpointReader:
    """Opens a checkpoint for lazy reading (exported as ``fastckpt.open``).

    Args:
        f: the file's path.
        device: where :meth:`~CheckpointReader.get_tensor` puts tensors: ``"cpu"`` or
            ``"cuda[:N]"`` (read through page-locked staging buffers into GPU memory).
        gds: for a CUDA device, read with GPUDirect Storage (``True``: GDS or
            ``EngineUnavailableError``; ``None``: when ``FASTCKPT_GDS=1`` and GDS runs here).
        storage_options: for a URL, passed to its fsspec file system. ``f`` may also be a
            sharded directory or its ``*.index.json`` (Hugging Face convention).
        **io: ``engine``, ``block_size``, ``queue_depth``, ``intra_op_parallelism``.

    Example:
        >>> import torch, fastckpt
        >>> fastckpt.save({"x": torch.arange(4)}, "/tmp/fastckpt-open2.safetensors")
        >>> with fastckpt.open("/tmp/fastckpt-open2.safetensors") as r:
        ...     r.info("x").dtype, r.get_tensor("x").tolist()
        (torch.int64, [0, 1, 2, 3])
    """
    from fastckpt.integrations import remote  # lazy: it imports the checkpoint layer

    if remote.routed(f):  # URLs and sharded directories
        return remote.route_open(f, device=device, gds=gds, storage_options=storage_options, **io)
    return CheckpointReader(f, device=device, gds=gds, **io)
