"""The ceilings a loader or saver is compared with: what plain parallel ``preadv`` and
``pwrite`` reach on one file, with no format, checksum or tensor in the way.

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

__all__ = ["preadv_file", "pwrite_file"]

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
