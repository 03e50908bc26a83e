"""A checkpoint file on a local file system, read by the native engine.

How bytes come in is chosen per read (:meth:`LocalStorage.choose_mode`):

- ``"buffered"``: when the bytes are already in memory (a hot page cache, tmpfs), when the
  file system refuses O_DIRECT, or with ``direct_io=False``: worker threads ``pread``
  through the page cache and checksum each step while it is still in the CPU cache.
- ``"direct"``: the native engine reads with O_DIRECT and worker threads checksum spans as
  they land.
- ``"staged"``: O_DIRECT into the staging pool's registered huge-page buffers, each copied
  out (and checksummed in the copy) on every core while the next reads run
  (:mod:`fastckpt.io.staged_reads`): where the device is slow to take scattered 4 KiB pages.
- ``"mapped"``: worker threads copy out of a read-only mapping of the file; the page
  faults bring the bytes in with the kernel's readahead.

For a cold file, which of these is fastest depends on the device: O_DIRECT with a deep
queue on local NVMe, the page cache's readahead on many virtual and network disks. So it is
measured, not assumed: ``fastckpt tune`` times a cold read in each mode and remembers the
winner per file system; ``FASTCKPT_READ_MODE`` forces one; without either, ``"staged"``.
When other work holds the cores (:func:`fastckpt.io.cpu_load.machine_busy`), the winner tune
measured beside a busy machine is taken, and an untuned or quiet ``"staged"`` becomes
``"direct"``: the staged copy is worth its CPU only where cores are free.

A file system that takes O_DIRECT at open but refuses it for reads (some memory-backed and
network file systems) is found out by one aligned read when the file is opened, so the mode
reported is the mode used. Writes go through :class:`~fastckpt.io.commit.AtomicFile`.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "x.bin")
    >>> with LocalStorage(path, create=True) as s:
    ...     s.write_atomically([b"abc", b"def"], 6)
    >>> with LocalStorage(path) as s:
    ...     s.size(), s.read_bytes(2, 3)
    (6, b'cde')
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterable, Sequence
from typing import Any

from fastckpt.config import direct_io as config_direct_io
from fastckpt.config import read_mode_override, resolve_io, tuned_read_mode
from fastckpt.io import cpu_load, page_cache, parallel_io
from fastckpt.io.commit import AtomicFile
from fastckpt.io.cpu_load import contended_mode
from fastckpt.io.executor import Executor, shared_executor
from fastckpt.io.files import File, require_regular_file
from fastckpt.io.parallel_io import Span
from fastckpt.io.staged_reads import read_staged
from fastckpt.io.staging_pool import default_pool
from fastckpt.storage.base import Progress, Storage

__all__ = ["LocalStorage", "span_bytes"]

# Direct reads are submitted in pieces of at most this size (on aligned file offsets), so
# finished pieces are checksummed while the rest is read, and progress can be shown.
_DIRECT_PIECE = 64 << 20
# Buffered reads are cut into about this many spans per worker thread, so that threads
# finishing early take more work; no span is smaller than _MIN_SPAN.
_SPANS_PER_WORKER = 4
_MIN_SPAN = 1 << 20
# Read through the page cache when at least this fraction of the bytes is resident.
_RESIDENT_ENOUGH = 0.5


# st_dev -> whether O_DIRECT reads work on that file system (see LocalStorage._probe_direct)
_DIRECT_READS: dict[int, bool] = {}


def _direct_read_works(fd: int, alignment: int) -> bool:
    """Whether one aligned O_DIRECT read of ``fd`` (opened with O_DIRECT) is taken."""
    probe = mmap.mmap(-1, alignment)  # page-aligned memory
    try:
        os.preadv(fd, [probe], 0)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
            raise
        return False
    finally:
        probe.close()
    return True


def span_bytes(total: int, mode: str) -> int:
    """The most bytes one span covers when reading ``total`` bytes of a local file in
    ``mode``: direct reads in large pieces, buffered ones shared among the worker threads.

    Example:
        >>> span_bytes(1 << 30, "direct") == _DIRECT_PIECE, span_bytes(100, "buffered") == _MIN_SPAN
        (True, True)
    """
    if mode in ("direct", "staged"):
        return _DIRECT_PIECE
    share = total // (parallel_io.worker_count() * _SPANS_PER_WORKER)
    share = -(-share // _MIN_SPAN) * _MIN_SPAN  # whole MiBs keep spans page-aligned
    return max(_MIN_SPAN, min(_DIRECT_PIECE, share))


class LocalStorage(Storage):
    """A local file (see the module's description).

    Args:
        path: the file.
        create: the file need not exist yet (it is only written, with
            :meth:`write_atomically`); nothing is opened.
        direct_io: ``True``/``False`` forces O_DIRECT / page-cache reads; None chooses by
            what is in memory (and ``FASTCKPT_DIRECT_IO``).
        io: ``engine``, ``block_size``, ``queue_depth``, ``intra_op_parallelism``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create: bool = False,
        direct_io: bool | None = None,
        **io: Any,
    ):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"f must be a path (str or os.PathLike), got {type(path).__name__}")
        self.location = os.fspath(path)
        if direct_io is not None and not isinstance(direct_io, bool):
            raise TypeError(f"direct_io must be True, False or None, got {direct_io!r}")
        self._direct_io = direct_io if direct_io is not None else config_direct_io()
        self._io = {k: io.get(k) for k in ("engine", "block_size", "queue_depth")}
        self._io["intra_op_parallelism"] = io.get("intra_op_parallelism")
        unknown = set(io) - set(self._io)
        if unknown:
            raise TypeError(f"unexpected I/O option {sorted(unknown)[0]!r}")
        self._file: File | None = None
        self._executor: Executor | None = None
        if create:
            return
        config = resolve_io(self.location, self._io)
        require_regular_file(self.location)
        self._file = File(self.location)
        try:
            self._executor = shared_executor(config)
            self._probe_direct()
        except BaseException:
            self._file.close()
            raise

    def _probe_direct(self) -> None:
        """Drops O_DIRECT when the file system took it at open but refuses it for reads, so
        that :meth:`choose_mode` reports the mode really used. One aligned read per file
        system and process: a refusal is the file system's, not the file's, and the read
        goes to the device, a fixed cost larger than a small checkpoint's whole load."""
        file = self._file
        assert file is not None
        if file.direct_fd < 0 or self._direct_io is False:
            return
        device = os.fstat(file.fd).st_dev
        works = _DIRECT_READS.get(device)
        if works is None:
            works = _direct_read_works(file.direct_fd, file.alignment)
            _DIRECT_READS[device] = works
        if not works:
            os.close(file.direct_fd)
            file.direct_fd = -1

    @property
    def file(self) -> File:
        if self._file is None or self._file.fd < 0:
            raise ValueError(f"{self.location}: the file is closed")
        return self._file

    def local_file(self) -> File:
        return self.file

    def size(self) -> int:
        return self.file.size()

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        chunks, got, fd = [], 0, self.file.fd
        while got < nbytes:
            data = os.pread(fd, nbytes - got, offset + got)
            if not data:
                raise EOFError(f"{self.location}: file ended after {offset + got} bytes")
            chunks.append(data)
            got += len(data)
        return b"".join(chunks)

    def choose_mode(self, region: tuple[int, int]) -> tuple[str, str]:
        if self._direct_io is not None and (not self._direct_io or self.file.direct_fd >= 0):
            return (
                ("direct", "direct_io=True") if self._direct_io else ("buffered", "direct_io=False")
            )
        read_mode_override()  # a bad FASTCKPT_READ_MODE is an error whatever is resident
        if self.file.direct_fd < 0:
            # tmpfs and the like: resident by nature, so no residency check is worth its cost
            wanted, _ = self._wanted_mode()
            if wanted != "mapped":
                return "buffered", "the file system refuses O_DIRECT"
        offset, nbytes = region
        resident = page_cache.resident_fraction(self.file.fd, offset, nbytes)
        if resident is not None and resident >= _RESIDENT_ENOUGH:
            return "buffered", f"{resident:.0%} of the data is in memory"
        # the tuned mode is looked up only for cold bytes: a hot load skips the lookup
        wanted, why = self._wanted_mode()
        known = "unknown" if resident is None else f"{resident:.0%}"
        return wanted, f"{known} of the data is in memory; {why}"

    def _wanted_mode(self, busy: bool | None = None) -> tuple[str, str]:
        """How a cold file is to be read, and why: forced (``FASTCKPT_READ_MODE``), as tuned
        for this file system (the contended winner when the cores are busy), or O_DIRECT;
        ``busy`` (None: :func:`~fastckpt.io.cpu_load.machine_busy`) says whether other work
        holds the cores (see :func:`~fastckpt.io.cpu_load.contended_mode`)."""
        forced = read_mode_override()  # a bad value is an error whatever is resident
        if forced is not None:
            return forced, f"read mode forced to {forced}"
        busy = cpu_load.machine_busy() if busy is None else busy
        tuned = tuned_read_mode(self.location, contended=True) if busy else None
        if tuned is not None:
            return tuned
        tuned = tuned_read_mode(self.location)
        if tuned is not None:
            mode, why = contended_mode(tuned[0], busy=busy)
            return mode, f"{tuned[1]}; {why}"
        # Untuned, O_DIRECT through the staging pool: on our virtio disk 1.31x straight
        # O_DIRECT into the load's memory (2.06 against 1.57 GB/s, 2 GiB, 4 rounds), where
        # the copy costs a core's share of memory bandwidth; tune measures both. Beside a
        # busy machine the copy has no free core: straight O_DIRECT then.
        mode, why = contended_mode("staged", busy=busy)
        return mode, f"no read mode tuned here; {why}"

    def span_bytes(self, total: int, mode: str) -> int:
        return span_bytes(total, mode)

    def read_spans(
        self,
        spans: Sequence[Span],
        *,
        owner: Any,
        mode: str,
        checksum: bool,
        on_progress: Progress | None = None,
    ) -> list[list[int]]:
        if mode == "direct":
            assert self._executor is not None
            return parallel_io.read_direct(
                self._executor,
                self.file,
                spans,
                owner=owner,
                checksum=checksum,
                on_progress=on_progress,
            )
        if mode == "staged":
            assert self._executor is not None
            return read_staged(
                self._executor,
                self.file,
                spans,
                pool=default_pool(),
                checksum=checksum,
                on_progress=on_progress,
            )
        if mode == "mapped":
            return parallel_io.read_mapped(
                self.file, spans, checksum=checksum, on_progress=on_progress
            )
        return parallel_io.read_buffered(
            self.file, spans, checksum=checksum, on_progress=on_progress
        )

    @property
    def executor(self) -> Executor:
        assert self._executor is not None
        return self._executor

    def write_atomically(self, pieces: Iterable[Any], total: int) -> None:
        with AtomicFile(self.location, direct=False) as out:
            offset = 0
            for piece in pieces:
                view = memoryview(piece.numpy() if hasattr(piece, "numpy") else piece).cast("B")
                out.file.pwrite_all(view, offset)  # type: ignore[arg-type]
                offset += len(view)
            if offset != total:
                raise ValueError(f"{self.location}: wrote {offset} bytes, expected {total}")

    def delete(self) -> None:
        os.unlink(self.location)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
