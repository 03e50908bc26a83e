"""``fastckpt.load`` of a small file in memory, or of a mapping, in one pass.

A load of a 64 KiB state costs a few hundred microseconds of set-up around a read that takes
ten: a reader with its locks and prefetch table, run and span planning, a checksum table per
read. For the common case (the whole file to the CPU, nothing compressed or referenced,
no ``keys``, no ``pin_memory``) this module does only what the load needs, with the same
checks as :class:`~fastckpt.checkpoint.read.CheckpointReader`:

- the header is read, parsed and checked as every reader's is (the same
  :func:`~fastckpt.format.read_header_from` and :meth:`HeaderView._adopt_header`);
- the data section is read by one ``pread`` (two halves on two threads from
  :data:`SPLIT_BYTES` on) into one arena, each tensor's CRC32C computed in the same pass
  while its bytes are in the cache; or, for ``mmap=True``, the file is mapped;
- the tensors are views of the arena (or mapping), built in one loop, each with a storage
  of its own as every CPU load's are.

Anything else (compressed tensors, incremental references, a mapping to verify) returns
:data:`NOT_HANDLED` and the caller reads through the full reader.

Example:
    >>> import torch, fastckpt
    >>> from fastckpt.storage.resident_file import ResidentFile
    >>> fastckpt.save({"w": torch.ones(3)}, "/dev/shm/fastckpt-small.safetensors")
    >>> with ResidentFile.open_small("/dev/shm/fastckpt-small.safetensors", limit=1 << 20) as s:
    ...     load_small(s, verify=None, weights_only=True, mmap=False)["w"].tolist()
    [1.0, 1.0, 1.0]
    >>> import os; os.remove("/dev/shm/fastckpt-small.safetensors")
"""

from __future__ import annotations

import math
import mmap as _mmap
import os
import threading
from concurrent.futures import Future, wait
from typing import Any

import torch

from fastckpt import _C, format
from fastckpt.checkpoint import dtypes, tree
from fastckpt.checkpoint.header_view import HeaderView
from fastckpt.checkpoint.reader import Reader
from fastckpt.checkpoint.tensor_crcs import check_crcs
from fastckpt.checkpoint.tensor_runs import arena_exporter, own_bytes
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, arena_tensor
from fastckpt.io.checksums import crc32c_combine
from fastckpt.storage.resident_file import PageCacheFile

__all__ = ["NOT_HANDLED", "SPLIT_BYTES", "load_small"]

#: What :func:`load_small` returns for a file it leaves to the full reader.
NOT_HANDLED: Any = object()

#: A data section of at least this many bytes is read as two halves on two threads (the
#: caller's and one kept for it): copying and checksumming a hot file is bound by one
#: core's memory bandwidth, not by the storage.
SPLIT_BYTES = 8 << 20

# A fastckpt header is padded to the alignment (4 KiB): the first read takes it whole.
_HEADER_PROBE = format.DEFAULT_ALIGNMENT


class _HeaderOnly(HeaderView):
    """The header side of a reader, without the reader: :meth:`HeaderView._adopt_header`
    checks what ties the header's parts together exactly as for every reader."""

    def __init__(self, path: str, header: format.Header):
        self.path = path
        self._adopt_header(header)

    def _check_open(self) -> None:
        return None


def load_small(
    storage: PageCacheFile, *, verify: bool | None, weights_only: bool, mmap: bool
) -> Any:
    """The object saved in the file ``storage`` holds open (all of it, on the CPU), or
    :data:`NOT_HANDLED` where the full reader must read it. ``storage`` stays open.

    ``verify`` as :func:`fastckpt.load`'s: None checks the CRC32Cs the file records; a
    mapping (``mmap=True``) is checked only with ``verify=True`` (then left to the full
    reader, which checks the mapped pages on every core).

    Raises:
        HeaderError, ChecksumError, NoChecksumsError, OSError: as :func:`fastckpt.load`.
    """
    if mmap and verify:
        return NOT_HANDLED
    path = storage.location
    header = format.read_header_from(
        storage.read_bytes, storage.size(), where=path, probe=_HEADER_PROBE
    )
    view = _HeaderOnly(path, header)
    meta = view.meta
    if view.compressed or meta.references is not None:
        return NOT_HANDLED
    Reader.require_checksums(view, bool(verify))  # type: ignore[arg-type]
    aliases = meta.aliases
    if mmap:
        stored = _mapped(storage, header, aliases)
    else:
        check = meta.crcs is not None and (verify is None or bool(verify))
        stored = _read_whole(storage, view, check)
    return tree.unflatten(meta.tree, stored, dict(aliases), weights_only=weights_only)


def _read_whole(storage: PageCacheFile, view: _HeaderOnly, check: bool) -> dict[str, torch.Tensor]:
    """Every stored tensor (a tied tensor's stored copy left out, as the full reader does),
    read by one ``pread`` of the data section into one arena, checksummed in the same pass
    when ``check``; a damaged tensor (or stored copy of a tied one) raises ChecksumError."""
    header = view.header
    entries = list(header.entries.values())  # in data order, tiling the data section
    size, base = header.data_size, header.data_offset
    # the data keeps its place in a page, as every arena's (placed(), tensor_runs.py)
    pad = base % BUFFER_ALIGNMENT
    arena = arena_tensor(pad + size)
    filled = [e for e in entries if e.end > e.begin]
    if size:
        cuts = [e.begin for e in filled[1:]]
        crcs = _pread_crc(storage, arena.data_ptr() + pad, size, base, cuts, check)
        if check:
            _check(view, filled, crcs)
    aliases = view.meta.aliases
    exporter = arena_exporter(arena)
    return {
        e.name: _view(arena, pad + e.begin, e, exporter) for e in entries if e.name not in aliases
    }


def _check(view: _HeaderOnly, filled: list[format.TensorEntry], crcs: list[int]) -> None:
    """Compares each tensor's CRC32C with the recorded one: the stored copies of tied
    tensors first (against the CRC32C of the tensor they copy), as the full reader does."""
    recorded, aliases = view.meta.crcs or {}, view.meta.aliases
    actual = {e.name: crc for e, crc in zip(filled, crcs)}
    copies = [e for e in filled if e.name in aliases]
    if copies:
        expected = {
            e.name: recorded[aliases[e.name]] if aliases[e.name] in recorded else recorded[e.name]
            for e in copies
            if aliases[e.name] in recorded or e.name in recorded
        }
        check_crcs(copies, actual, expected, view.path)
    check_crcs(filled, actual, recorded, view.path)


def _view(arena: torch.Tensor, start: int, e: format.TensorEntry, exporter: Any) -> torch.Tensor:
    """The tensor of ``e`` at ``arena[start]``, over the arena's memory with a storage of its
    own (:func:`~fastckpt.checkpoint.tensor_runs.tensor_view`, the checks of dtype and shape
    done when the header was adopted)."""
    dtype = dtypes.to_torch(e.dtype)
    shape = dtypes.torch_shape(e.dtype, e.shape, tensor=e.name)
    nbytes = e.end - e.begin
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    itemsize = dtype.itemsize
    if (arena.data_ptr() + start) % itemsize:
        # files from other writers may not align tensors to their dtype
        return arena[start : start + nbytes].clone().view(dtype).view(shape)
    count = nbytes // itemsize
    if count * itemsize != nbytes or math.prod(shape) != count:  # packed dtypes
        return own_bytes(arena, start, nbytes, exporter).view(dtype).view(shape)
    # own_bytes() with the dtype given at once (one view less: a third of a small load)
    flat = torch.frombuffer(exporter, dtype=dtype, count=count, offset=start)
    return flat if len(shape) == 1 else flat.view(shape)


def _mapped(
    storage: PageCacheFile, header: format.Header, aliases: dict[str, str]
) -> dict[str, torch.Tensor]:
    """Every stored tensor as a view of a private (copy-on-write) mapping of the file, as
    :meth:`CheckpointReader.map` gives them; nothing is read until touched."""
    if header.data_size == 0:
        data = torch.empty(0, dtype=torch.uint8)
    else:
        fd = storage.fileno()
        mapping = _mmap.mmap(fd, header.data_offset + header.data_size, access=_mmap.ACCESS_COPY)
        # frombuffer keeps the mapping alive as long as any view of it
        data = torch.frombuffer(
            mapping, dtype=torch.uint8, count=header.data_size, offset=header.data_offset
        )
    exporter = arena_exporter(data)
    return {
        name: _view(data, e.begin, e, exporter)
        for name, e in header.entries.items()
        if name not in aliases
    }


def _pread_crc(
    storage: PageCacheFile, address: int, size: int, offset: int, cuts: list[int], check: bool
) -> list[int]:
    """``_C.pread_crc`` of the data section: the CRC32C of each segment between ``cuts``;
    from :data:`SPLIT_BYTES` on, two halves read at once (the segment cut in two joined by
    :func:`crc32c_combine`)."""
    fd, path = storage.fileno(), storage.location
    if size < SPLIT_BYTES or len(os.sched_getaffinity(0)) < 2:  # one core: no second thread
        return _C.pread_crc(fd, address, size, offset, cuts, check, path)
    half = size // 2 // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT
    at = sum(1 for cut in cuts if cut < half)  # the cuts of the first half
    head_cuts, tail_cuts = cuts[:at], [cut - half for cut in cuts[at:] if cut > half]
    tail = _helper().submit(
        _C.pread_crc, fd, address + half, size - half, offset + half, tail_cuts, check, path
    )
    try:
        head = _C.pread_crc(fd, address, half, offset, head_cuts, check, path)
    except BaseException:
        wait([tail])  # never leave a read into the arena running
        raise
    rest = tail.result()
    if not check:
        return []
    if half in cuts:  # a tensor starts at the cut: no segment spans both halves
        return head + rest
    joined = crc32c_combine(head[-1], rest[0], (cuts[at] if at < len(cuts) else size) - half)
    return head[:-1] + [joined] + rest[1:]


class _Helper:
    """One thread kept for the second half of large reads (starting one per load costs
    more than the read it would share)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[tuple[Future[Any], Any, tuple[Any, ...]]] = []
        self._wake = threading.Condition(self._lock)
        threading.Thread(target=self._run, name="fastckpt-small-read", daemon=True).start()

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        done: Future[Any] = Future()
        with self._lock:
            self._jobs.append((done, fn, args))
            self._wake.notify()
        return done

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs:
                    self._wake.wait()
                done, fn, args = self._jobs.pop(0)
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)


_helper_lock = threading.Lock()
_helper_thread: _Helper | None = None


def _helper() -> _Helper:
    global _helper_thread
    with _helper_lock:
        if _helper_thread is None:
            _helper_thread = _Helper()
        return _helper_thread


def _forget_helper() -> None:
    """A forked child has no helper thread: it starts its own when it needs one."""
    global _helper_lock, _helper_thread
    _helper_lock, _helper_thread = threading.Lock(), None


os.register_at_fork(after_in_child=_forget_helper)
