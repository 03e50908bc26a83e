"""Copies of a step's files from one tier to another (the drain): bounded memory, a bandwidth
cap, and every copy checked before the step is committed at its target.

A file is streamed in chunks of 16 MiB from its source (a local file or a URL) to its target:
a local file (written, then fsynced) or a URL's atomic sink (on S3 a multipart upload with a
few parts in flight; the object appears only once complete). At most :data:`COPY_MEMORY`
bytes are held at once, the HTTP client's copies included, whatever the file's size up to
160 GiB (S3 takes at most 10,000 parts, so a larger file needs larger parts: one in flight).

Between two local files (:func:`copy_file`) the copy touches no new memory and reads each
byte once: the source is mapped a window at a time, each tensor of a fastckpt checkpoint is
checked against the CRC32C its header records as its bytes go out (damage in the source tier
raises rather than spreading to root), and the pages are written to the target with O_DIRECT
where its file system takes it, then fsynced (a failed write is reported by the kernel). A
buffered copy read back for a check would allocate the file's size in page cache twice,
copy every byte three times and read it twice: on a busy machine, CPU time taken from the
training loop (measured with ``benchmarks/bench_manager.py``). Restores verify every CRC32C
again.

A copy to a URL is read back (:func:`verify_copy`), as a stream of the same bounded size,
and checked twice: its CRC32C must be the source's (computed as the bytes went out), and for
a fastckpt file each tensor's bytes must have the CRC32C its header records. Any difference
raises :class:`~fastckpt.errors.ChecksumError` naming the file (and the tensors).

Example:
    >>> import tempfile, os, torch
    >>> from fastckpt.checkpoint import save
    >>> source = os.path.join(tempfile.mkdtemp(), "a.safetensors")
    >>> save.save({"w": torch.ones(1000)}, source)
    >>> crc = copy_file(source, "memory://doc-transfer/a.safetensors")
    >>> verify_copy("memory://doc-transfer/a.safetensors", crc)
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import errno
import mmap
import os
import stat
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from fastckpt import _C, storage
from fastckpt.checkpoint.read import CheckpointReader
from fastckpt.checkpoint.tensor_crcs import damaged
from fastckpt.errors import ChecksumError
from fastckpt.io import kept_mappings
from fastckpt.io.checksums import crc32c_combine
from fastckpt.io.commit import fsync_directory
from fastckpt.io.files import File
from fastckpt.io.parallel_io import MAP_POPULATE
from fastckpt.storage.url import UrlStorage

__all__ = ["COPY_MEMORY", "copy_file", "lower_thread_priority", "open_own_file", "verify_copy"]

#: The most bytes a copy or its verification holds at once.
COPY_MEMORY = 256 << 20
_CHUNK = 16 << 20
_READ_AHEAD = 4  # ranged reads of a URL in flight while a copy is read back
# Measured: each part in flight costs twice its size (ours, and the HTTP client's copy), and
# the client's and the threads' own buffers about this much.
_HEADROOM = 64 << 20
_S3_MAX_PARTS = 10_000

Options = Mapping[str, Any] | None


def lower_thread_priority(nice: int | None) -> None:
    """Gives the calling thread (alone) the CPU priority ``nice`` (0 to 19; None: unchanged).

    A drain at nice 19 takes the CPU time that training leaves idle and little of the rest:
    under Linux's scheduler a nice-19 thread weighs 1.5% of a nice-0 one, so on a busy
    machine the training threads keep their cores and the drain stretches instead. Linux
    alone sets a thread's priority (``setpriority`` on its thread id); elsewhere, and where
    the call is refused, the thread keeps the process's priority.

    Example:
        >>> import threading
        >>> t = threading.Thread(target=lower_thread_priority, args=(19,)); t.start(); t.join()
        >>> os.getpriority(os.PRIO_PROCESS, 0) < 19  # the calling thread's own is untouched
        True
    """
    if nice is None or not sys.platform.startswith("linux"):
        return
    if not 0 <= nice <= 19:
        raise ValueError(f"nice must be within 0..19, got {nice!r}")
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # a sandbox may refuse; the drain then runs as is
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:  # only ever lowered (raising needs root)
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def _size(location: str, options: Options) -> int:
    local = storage.to_local(location)
    if local is not None:
        return os.path.getsize(local)
    return UrlStorage(location, storage_options=options).size()


def _address(data: bytes | memoryview) -> int:
    """The address of a buffer's first byte (kept alive by the caller)."""
    if isinstance(data, bytes):
        return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
    return int(np.frombuffer(data, np.uint8).ctypes.data) if len(data) else 0


class _Pace:
    """Sleeps as needed to keep a stream at most ``rate`` bytes a second (None: no cap)."""

    def __init__(self, rate: float | None):
        self.rate, self.started, self.done = rate, time.monotonic(), 0

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self.rate is not None:
            early = self.done / self.rate - (time.monotonic() - self.started)
            if early > 0:
                time.sleep(early)


def _direct_reads(path: str) -> Iterator[memoryview] | None:
    """The file's bytes in ``_CHUNK`` pieces read with O_DIRECT into one reused buffer
    (each valid until the next is asked for), or None where O_DIRECT is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0))
    except OSError:
        return None
    if not getattr(os, "O_DIRECT", 0):
        os.close(fd)
        return None

    def reads() -> Iterator[memoryview]:
        buffer = mmap.mmap(-1, _CHUNK)  # page-aligned, as O_DIRECT needs
        try:
            offset = 0
            while True:
                got = os.preadv(fd, [buffer], offset)  # short at the end of the file
                if not got:
                    return
                yield memoryview(buffer)[:got]
                offset += got
                if got < _CHUNK:
                    return
        finally:
            os.close(fd)
            with contextlib.suppress(BufferError):  # a view still held: the GC frees it
                buffer.close()

    return reads()


def _chunks(
    location: str,
    options: Options,
    total: int,
    *,
    rate: float | None,
    ahead: int,
    reuse: bool = False,
) -> Iterator[bytes | memoryview]:
    """The file's bytes in order, ``_CHUNK`` at a time (``ahead`` ranged reads in flight at
    a URL), at most ``rate`` bytes a second. With ``reuse``, a local file is read with
    O_DIRECT where it can be, into one reused buffer: each piece is valid until the next."""
    pace = _Pace(rate)
    local = storage.to_local(location)
    if local is not None:
        direct = _direct_reads(local) if reuse else None
        if direct is not None:
            for view in direct:
                yield view
                pace(len(view))
            return
        with open(local, "rb") as f:
            while chunk := f.read(_CHUNK):
                yield chunk
                pace(len(chunk))
        return
    source = UrlStorage(location, storage_options=options)
    offsets = iter(range(0, total, _CHUNK))
    with concurrent.futures.ThreadPoolExecutor(ahead, "fastckpt-drain-read") as pool:
        window: collections.deque[concurrent.futures.Future[bytes]] = collections.deque()
        try:
            for offset in offsets:
                window.append(pool.submit(source.read_bytes, offset, min(_CHUNK, total - offset)))
                if len(window) >= ahead:
                    break
            while window:
                chunk = window.popleft().result()
                for offset in offsets:  # one more read replaces the one taken
                    window.append(
                        pool.submit(source.read_bytes, offset, min(_CHUNK, total - offset))
                    )
                    break
                yield chunk
                pace(len(chunk))
        finally:
            for future in window:
                future.cancel()


def _upload_shape(total: int) -> tuple[int, int]:
    """``(part_size, parallel)`` of an upload of ``total`` bytes within ``COPY_MEMORY``: the
    parts in flight (each held twice: ours and the HTTP client's copy), the one being
    filled, the chunk read from the source with its copy on the way into that part, and the
    client's own buffers. S3 takes at most 10,000 parts, so files over 160 GiB need larger
    parts: one in flight then, and the bound grows with them.

    Example:
        >>> [_upload_shape(n) == (16 << 20, 4) for n in (1, 100 << 30)]
        [True, True]
        >>> part, parallel = _upload_shape(1 << 40)
        >>> part >> 20, parallel
        (105, 1)
    """
    needed = -(-total // _S3_MAX_PARTS)
    part = max(_CHUNK, -(-needed // (1 << 20)) * (1 << 20))
    parallel = (COPY_MEMORY - _HEADROOM - part - 2 * _CHUNK) // (2 * part)
    return part, max(1, min(8, parallel))


def copy_file(
    source: str,
    target: str,
    *,
    source_options: Options = None,
    target_options: Options = None,
    rate: float | None = None,
) -> int:
    """Copies ``source`` to ``target`` (each a local path or a URL) with bounded memory, at
    most ``rate`` bytes a second; returns the CRC32C of the bytes sent. A local target is
    fsynced; a URL target appears whole or not at all. A local source must be a regular
    file of its own (:func:`open_own_file`): a link is never followed.

    Raises:
        OSError: the source is a link or not a file fastckpt wrote (``ELOOP``/``EINVAL``,
            naming it).
    """
    source_local = storage.to_local(source)
    local = storage.to_local(target)
    if source_local is not None:
        fd = open_own_file(source_local)
        try:
            if local is not None:
                return _copy_local(fd, source_local, local, os.fstat(fd).st_size, rate)
            with os.fdopen(os.dup(fd), "rb") as opened:
                return _copy_to_url(opened, source, target, target_options, rate)
        finally:
            os.close(fd)
    total = _size(source, source_options)
    crc = 0

    def counted() -> Iterator[bytes]:
        nonlocal crc
        for chunk in _chunks(source, source_options, total, rate=rate, ahead=1):
            assert isinstance(chunk, bytes)  # (without reuse=True: its own bytes each time)
            crc = _C.crc32c(_address(chunk), len(chunk), crc)
            yield chunk

    if local is None:
        part, parallel = _upload_shape(total)
        sink = UrlStorage(target, storage_options=target_options, part_size=part, parallel=parallel)
        sink.write_atomically(counted(), total)
        return crc
    os.makedirs(os.path.dirname(local), exist_ok=True)
    with open(local, "wb") as out:
        for chunk in counted():
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    with contextlib.suppress(OSError):
        fsync_directory(os.path.dirname(local))
    return crc


def open_own_file(path: str) -> int:
    """A descriptor of the local file ``path``, opened without following a link; it must be
    a regular file, so that a symbolic link planted in a step never carries another file
    (or a device, a FIFO) into a copy.

    Raises:
        OSError: ``ELOOP`` for a link, ``EINVAL`` for anything else that is not such a
            file, naming ``path``.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "a")
        >>> open(path, "w").close(); os.symlink(path, path + ".link")
        >>> os.close(open_own_file(path))
        >>> open_own_file(path + ".link")
        Traceback (most recent call last):
        ...
        OSError: [Errno 40] a symbolic link, not a file fastckpt wrote: not followed: '/...a.link'
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(
                errno.ELOOP, "a symbolic link, not a file fastckpt wrote: not followed", path
            ) from None
        raise
    info = os.fstat(fd)
    # A second name (a user's hard link kept as a backup) leaves the bytes fastckpt wrote:
    # they are copied and verified like any other; only reuse and removal look at links.
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(
            errno.EINVAL, "not a regular file, not a file fastckpt wrote: not copied", path
        )
    return fd


def _copy_to_url(
    opened: Any, source: str, target: str, target_options: Options, rate: float | None
) -> int:
    """Uploads the open local file ``opened`` (``source``) to the URL ``target``."""
    total = os.fstat(opened.fileno()).st_size
    crc = 0
    pace = _Pace(rate)

    def counted() -> Iterator[bytes]:
        nonlocal crc
        while chunk := opened.read(_CHUNK):
            crc = _C.crc32c(_address(chunk), len(chunk), crc)
            yield chunk
            pace(len(chunk))

    part, parallel = _upload_shape(total)
    sink = UrlStorage(target, storage_options=target_options, part_size=part, parallel=parallel)
    sink.write_atomically(counted(), total)
    return crc


def _windows(source: str | int, total: int) -> Iterator[memoryview]:
    """The file's bytes ``_CHUNK`` at a time, each a read-only mapping of the file (faulted
    in at once), unmapped before the next: the copy holds at most ``_CHUNK`` of it mapped,
    and copies none of it. A file with a kept mapping (a fast tier's, on a memory file
    system: :mod:`fastckpt.io.kept_mappings`) is read from it instead, mapping nothing."""
    opened = os.fdopen(os.dup(source), "rb") if isinstance(source, int) else open(source, "rb")
    with opened as f, kept_mappings.borrow(f.fileno()) as kept:
        if kept is not None:
            yield from _kept_windows(kept, total)
        else:
            yield from _mapped_windows(f.fileno(), total)


def _kept_windows(kept: kept_mappings.KeptMapping, total: int) -> Iterator[memoryview]:
    whole = kept.view()
    try:
        for offset in range(0, total, _CHUNK):
            yield whole[offset : offset + _CHUNK]
    finally:
        whole.release()


def _mapped_windows(fd: int, total: int) -> Iterator[memoryview]:
    for offset in range(0, total, _CHUNK):
        window = mmap.mmap(
            fd,
            min(_CHUNK, total - offset),
            flags=mmap.MAP_SHARED | MAP_POPULATE,
            prot=mmap.PROT_READ,
            offset=offset,
        )
        view = memoryview(window)
        try:
            yield view
        finally:
            # A copy that failed (ENOSPC) may still hold a slice of the view in its
            # traceback: the mapping then goes when that slice does, not here.
            with contextlib.suppress(BufferError):
                view.release()
                window.close()


def _copy_local(fd: int, source: str, target: str, total: int, rate: float | None) -> int:
    """Copies a local file to a local file from mappings of the source: O_DIRECT writes of
    its aligned part where the target's file system takes them (the tail, and every byte
    elsewhere, through the page cache); fsynced. Returns the CRC32C of the bytes; each
    tensor of a checkpoint is checked against its header's CRC32C as it goes out.

    Raises:
        ChecksumError: the source is damaged (named, with its tensors).
    """
    os.makedirs(os.path.dirname(target), exist_ok=True)
    pace, offset, checker = _Pace(rate), 0, _Checker(source, None, opened=fd)
    with File(target, write=True, create=True, truncate=True, direct=True) as out:
        direct_fd, align = (out.direct_fd, out.alignment) if out.direct else (-1, 1)
        for view in _windows(fd, total):
            n = len(view)
            checker.feed(_address(view), n)
            aligned = n - n % align if direct_fd >= 0 else 0
            if aligned:
                _pwrite_all(direct_fd, view[:aligned], offset)
            if n > aligned:
                _pwrite_all(out.fd, view[aligned:], offset + aligned)
            offset += n
            pace(n)
        out.fsync()
    with contextlib.suppress(OSError):
        fsync_directory(os.path.dirname(target))
    checker.check(source, "the source of a copy is damaged")
    return checker.whole


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class _Checker:
    """The CRC32C of a file's bytes, fed in order, and for a fastckpt checkpoint each
    tensor's, checked against its header: every byte is read once, its segment's CRC32C
    combined into the whole file's and, inside a tensor, into the tensor's."""

    def __init__(self, location: str, options: Options, *, opened: int | None = None):
        self.entries: list[Any] = []
        self.expected: dict[str, int] = {}
        self.data_offset = 0
        if location.endswith(".safetensors"):
            # the file alone: an incremental file's bases are checked by the drain, in root
            # (``opened``: the header of the very file copied, not what its name holds now)
            with contextlib.ExitStack() as stack:
                source: Any = location
                if opened is not None:
                    source = stack.enter_context(os.fdopen(os.dup(opened), "rb"))
                reader = stack.enter_context(CheckpointReader(source, storage_options=options))
                if reader.has_checksums:
                    self.entries = sorted(reader.header.entries.values(), key=lambda e: e.begin)
                    self.expected = dict(reader.meta.crcs or {})
                    self.data_offset = reader.header.data_offset
        self.actual: dict[str, int] = {e.name: 0 for e in self.entries}
        self.whole, self.position, self.index = 0, 0, 0

    def feed(self, address: int, nbytes: int) -> None:
        """Takes the file's next ``nbytes`` bytes, at ``address``."""
        at, end = self.position, self.position + nbytes
        while at < end:
            entry = self.entries[self.index] if self.index < len(self.entries) else None
            inside = entry is not None and self.data_offset + entry.begin <= at
            if entry is None:
                stop = end
            else:
                stop = min(end, self.data_offset + (entry.end if inside else entry.begin))
            if stop > at:
                segment = _C.crc32c(address + at - self.position, stop - at)
                self.whole = crc32c_combine(self.whole, segment, stop - at)
                if inside:
                    assert entry is not None
                    name = entry.name
                    self.actual[name] = crc32c_combine(self.actual[name], segment, stop - at)
            at = stop
            if entry is not None and self.data_offset + entry.end <= at:
                self.index += 1  # (an empty tensor is passed at once)
        self.position = end

    def check(self, location: str, what: str, crc: int | None = None) -> None:
        """Raises :class:`ChecksumError` naming ``location`` when a tensor's bytes differ
        from its header's CRC32C, or the whole file's from ``crc`` (when given)."""
        bad = damaged(self.entries, self.actual, self.expected)
        if bad or (crc is not None and self.whole != crc):
            detail = f"damaged tensors {bad}" if bad else "its bytes differ from the source's"
            raise ChecksumError(f"{location}: {what}: {detail}")


def verify_copy(location: str, crc: int, options: Options = None) -> None:
    """Reads the copy at ``location`` back (bounded memory) and checks it against ``crc``
    (the source's CRC32C) and, for a ``.safetensors`` file with checksums, every tensor
    against its header's CRC32C.

    Raises:
        ChecksumError: the copy differs, naming the file and the damaged tensors.
    """
    total = _size(location, options)
    checker = _Checker(location, options)
    for chunk in _chunks(location, options, total, rate=None, ahead=_READ_AHEAD, reuse=True):
        checker.feed(_address(chunk), len(chunk))
    checker.check(location, "the copy does not verify", crc)
