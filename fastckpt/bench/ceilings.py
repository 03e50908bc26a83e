"""The ceilings a loader or saver is compared with: what plain parallel ``preadv`` and
``pwrite`` reach on one file, with no format, checksum or tensor in the way; and, with
O_DIRECT (:func:`direct_pwrite_file`, :func:`direct_preadv_file`), what the device itself
reaches, page cache out of the way (what fio's sequential direct jobs measure).

Example:
    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as d:
    ...     seconds = pwrite_file(f"{d}/f", [b"ab" * 700], 2, chunk=512)
    ...     buf, seconds = preadv_file(f"{d}/f", 2, chunk=512)
    ...     bytes(buf[:4])
    b'abab'
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from fastckpt.bench.caches import make_durable
from fastckpt.bench.units import MiB

__all__ = ["direct_preadv_file", "direct_pwrite_file", "preadv_file", "pwrite_file"]

PAGE = mmap.PAGESIZE


def preadv_file(
    path: str | os.PathLike[str],
    threads: int,
    *,
    start: int = 0,
    chunk: int = 16 * MiB,
    prefault: bool = False,
) -> tuple[mmap.mmap, float]:
    """The parallel-``preadv`` ceiling: ``threads`` threads read the file from ``start`` to
    its end with ``os.preadv`` into one anonymous buffer, in ``chunk`` pieces taken in turn.

    The buffer is allocated before the clock starts; its pages are faulted in by the reads
    (as a loader's fresh memory is) unless ``prefault`` writes them first. Returns the
    buffer and the seconds the reads took.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(b"ab" * 5000); f.flush()
        ...     buf, seconds = preadv_file(f.name, 2, chunk=1024)
        >>> bytes(buf[:4]), len(buf), seconds > 0
        (b'abab', 10000, True)
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        nbytes = os.fstat(fd).st_size - start
        buffer = mmap.mmap(-1, max(nbytes, 1))
        if prefault:
            for offset in range(0, nbytes, PAGE):
                buffer[offset] = 0
        view = memoryview(buffer)
        pieces = [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]
        errors: list[BaseException] = []

        def worker(first: int) -> None:
            try:
                for off, n in pieces[first::threads]:
                    done = 0
                    while done < n:
                        got = os.preadv(fd, [view[off + done : off + n]], start + off + done)
                        if got == 0:
                            raise EOFError(f"{path}: file ended at {start + off + done}")
                        done += got
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
        view.release()
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return buffer, seconds


def pwrite_file(
    path: str | os.PathLike[str],
    buffers: Sequence[Any],
    threads: int,
    *,
    chunk: int = 8 * MiB,
) -> float:
    """The write ceiling of one file: ``threads`` threads ``os.pwrite`` the bytes of
    ``buffers`` (objects with the buffer protocol) back to back into a new file at ``path``,
    in ``chunk`` pieces taken in turn, then the file is made durable. No header, no
    checksum: the kernel's own cost of putting these bytes into this file. Returns seconds.

    Example:
        >>> import tempfile, pathlib
        >>> with tempfile.TemporaryDirectory() as d:
        ...     seconds = pwrite_file(f"{d}/f", [b"ab" * 700, b"c"], 2, chunk=512)
        ...     pathlib.Path(d, "f").read_bytes() == b"ab" * 700 + b"c"
        True
    """
    views = [memoryview(b).cast("B") for b in buffers]
    pieces: list[tuple[memoryview, int]] = []
    offset = 0
    for view in views:
        pieces += [(view[at : at + chunk], offset + at) for at in range(0, len(view), chunk)]
        offset += len(view)
    errors: list[BaseException] = []
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        def worker(first: int) -> None:
            try:
                for piece, at in pieces[first::threads]:
                    done = 0
                    while done < len(piece):
                        done += os.pwrite(fd, piece[done:], at + done)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    make_durable(path)
    return time.perf_counter() - t0


#: Bytes per O_DIRECT request of the device ceilings, and requests in flight (one thread
#: each): a deep queue of large requests, as fio's ``--bs=4M --iodepth=32`` jobs.
DIRECT_CHUNK = 4 * MiB
DIRECT_IN_FLIGHT = 16


def _in_parallel(count: int, work: Any) -> None:
    """Runs ``work(i)`` for i in range(count) on as many threads; re-raises the first error."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def _direct_open(path: str | os.PathLike[str], flags: int) -> int:
    """``open`` with O_DIRECT; ``OSError`` saying the file system refuses it."""
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as exc:
        raise OSError(exc.errno, f"O_DIRECT refused here: {exc.strerror}", str(path)) from None


def direct_pwrite_file(path: str | os.PathLike[str], nbytes: int) -> float:
    """The device's write ceiling: ``nbytes`` (rounded up to whole pages) written to a new
    file at ``path`` with O_DIRECT, :data:`DIRECT_IN_FLIGHT` requests of
    :data:`DIRECT_CHUNK` in flight, then fsync of the file and its directory. Returns the
    seconds from the open to the end of the fsyncs (the buffer is made before).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory(dir=".") as d:
        ...     seconds = direct_pwrite_file(f"{d}/f", 10 * 4096)
        ...     os.path.getsize(f"{d}/f")
        40960
    """
    nbytes = -(-nbytes // PAGE) * PAGE
    chunk = min(DIRECT_CHUNK, max(PAGE, nbytes))
    buffer = mmap.mmap(-1, chunk)  # page-aligned; one source for every request
    buffer.write(os.urandom(min(chunk, 1 << 20)) * (chunk // min(chunk, 1 << 20)))
    pieces = [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]
    t0 = time.perf_counter()
    fd = _direct_open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        view = memoryview(buffer)

        def work(first: int) -> None:
            for off, n in pieces[first::DIRECT_IN_FLIGHT]:
                done = 0
                while done < n:
                    done += os.pwritev(fd, [view[done:n]], off + done)

        _in_parallel(min(DIRECT_IN_FLIGHT, len(pieces)), work)
        view.release()
    finally:
        os.close(fd)
    make_durable(path)
    return time.perf_counter() - t0


def direct_preadv_file(path: str | os.PathLike[str]) -> float:
    """The device's read ceiling: the whole file at ``path`` read with O_DIRECT,
    :data:`DIRECT_IN_FLIGHT` requests of :data:`DIRECT_CHUNK` in flight, into page-aligned
    buffers reused by each thread (no page faults). The caller empties the page cache
    first (O_DIRECT reads resident pages from the device anyway). Returns seconds.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory(dir=".") as d:
        ...     _ = direct_pwrite_file(f"{d}/f", 3 * 4096)
        ...     direct_preadv_file(f"{d}/f") > 0
        True
    """
    fd = _direct_open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        nbytes = -(-size // PAGE) * PAGE  # the tail block is read whole, as O_DIRECT must
        chunk = min(DIRECT_CHUNK, max(PAGE, nbytes))
        pieces = [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]
        threads = max(1, min(DIRECT_IN_FLIGHT, len(pieces)))
        buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]

        def work(first: int) -> None:
            view = memoryview(buffers[first])
            for off, n in pieces[first::threads]:
                done = 0
                while done < n:
                    got = os.preadv(fd, [view[done:n]], off + done)
                    if got == 0:
                        break  # the (unaligned) end of the file
                    done += got
            view.release()

        t0 = time.perf_counter()
        _in_parallel(threads, work)
        seconds = time.perf_counter() - t0
        for b in buffers:
            b.close()
    finally:
        os.close(fd)
    return seconds
