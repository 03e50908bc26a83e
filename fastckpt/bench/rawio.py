"""Timed raw reads and writes through an ``aio_handle``, shared by ``tune`` and ``bench``.

Writes go to fresh files (as a checkpoint save does) and are timed until ``fsync`` returns;
reads are timed from a cold cache (see :class:`fastckpt.bench.caches.PageCache`).

Example:
    >>> import os, tempfile
    >>> from fastckpt.deepnvme import aio_handle
    >>> from fastckpt.bench.caches import PageCache
    >>> d = tempfile.mkdtemp()
    >>> buf = make_buffer(1 << 20)
    >>> h = aio_handle(1 << 20, 8, False, True, 1, engine="threads")
    >>> path = os.path.join(d, "io.bin")
    >>> timed_write(h, buf, [path]) > 0, os.path.getsize(path)
    (True, 1048576)
    >>> timed_read(h, buf, [path], PageCache()) > 0
    True
    >>> os.unlink(path)
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from fastckpt.bench.caches import PageCache, fsync_path

__all__ = [
    "PATTERN_BLOCK",
    "check_file",
    "check_pattern",
    "make_buffer",
    "make_handle",
    "pattern_block",
    "timed_read",
    "timed_write",
]

#: The fill pattern repeats every this many bytes: random, so no file system compresses it.
PATTERN_BLOCK = 1 << 20


def pattern_block(seed: int = 0) -> Any:
    """The random ``PATTERN_BLOCK`` bytes buffers are filled with (a uint8 CPU tensor).

    Example:
        >>> pattern_block().numel()
        1048576
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (PATTERN_BLOCK,), dtype=torch.uint8, generator=generator)


def _fill(flat: Any, block: Any) -> None:
    n = flat.numel()
    whole = n // PATTERN_BLOCK * PATTERN_BLOCK
    if whole:
        flat[:whole].view(-1, PATTERN_BLOCK).copy_(block.expand(whole // PATTERN_BLOCK, -1))
    if n > whole:
        flat[whole:].copy_(block[: n - whole])


def make_buffer(nbytes: int, *, gpu: bool = False, seed: int = 0) -> Any:
    """A uint8 tensor of ``nbytes`` filled with the pattern: page-aligned, page-locked host
    memory (falling back to unlocked where the locked-memory limit refuses), or CUDA memory.

    Example:
        >>> buf = make_buffer(8192)
        >>> buf.data_ptr() % 4096, buf.numel()
        (0, 8192)
    """
    import torch

    from fastckpt.io.aligned_memory import aligned_tensor

    if gpu:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    else:
        buffer = aligned_tensor(nbytes, lock=True, reused=True)
    _fill(buffer, pattern_block(seed).to(buffer.device))
    return buffer


def check_pattern(buffer: Any, seed: int = 0) -> int:
    """Offset of the first byte of ``buffer`` that differs from the pattern, or -1 if none.

    Example:
        >>> buf = make_buffer(5000)
        >>> check_pattern(buf)
        -1
        >>> buf[4321] ^= 1
        >>> check_pattern(buf)
        4321
    """
    import torch

    block = pattern_block(seed)
    flat = buffer.reshape(-1)
    for start in range(0, flat.numel(), PATTERN_BLOCK):
        part = flat[start : start + PATTERN_BLOCK].cpu()
        diff = torch.nonzero(part != block[: part.numel()])
        if diff.numel():
            return start + int(diff[0])
    return -1


def check_file(path: str | os.PathLike[str], seed: int = 0) -> int:
    """Offset of the first byte of the file at ``path`` that differs from the pattern, or -1.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(make_buffer(5000).numpy().tobytes()); f.flush()
        ...     check_file(f.name)
        -1
    """
    import torch

    block = pattern_block(seed)
    offset = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(PATTERN_BLOCK)
            if not chunk:
                return -1
            got = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
            diff = torch.nonzero(got != block[: got.numel()])
            if diff.numel():
                return offset + int(diff[0])
            offset += len(chunk)


def make_handle(config: Any, *, gds: bool = False) -> Any:
    """An ``aio_handle`` (or ``gds_handle`` with ``gds``) built from an :class:`IOConfig`-like
    object with the constructor's six fields.

    Example:
        >>> from fastckpt.config import IOConfig
        >>> make_handle(IOConfig(queue_depth=4, engine="threads")).get_queue_depth()
        4
    """
    args = (
        config.block_size,
        config.queue_depth,
        config.single_submit,
        config.overlap_events,
        config.intra_op_parallelism,
    )
    if gds:
        from fastckpt.deepnvme import gds_handle

        return gds_handle(*args)
    from fastckpt.deepnvme import aio_handle

    return aio_handle(*args, engine=config.engine)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def timed_write(handle: Any, buffer: Any, paths: Sequence[str]) -> float:
    """Seconds to write ``buffer`` to each of ``paths`` at once (fresh files) and fsync them.

    Example:
        >>> import tempfile, os
        >>> from fastckpt.deepnvme import aio_handle
        >>> p = os.path.join(tempfile.mkdtemp(), "w.bin")
        >>> timed_write(aio_handle(), make_buffer(4096), [p]) > 0
        True
    """
    for path in paths:
        _remove(path)
    start = time.perf_counter()
    for path in paths:
        handle.async_pwrite(buffer, path)
    handle.wait()
    for path in paths:
        fsync_path(path)
    return time.perf_counter() - start


def timed_read(handle: Any, buffer: Any, paths: Sequence[str], cache: PageCache) -> float:
    """Seconds to read each of ``paths`` (all at once) into ``buffer`` from a cold cache.

    With several paths the reads share the buffer: the bytes are not looked at, only timed.
    """
    cache.drop(paths)
    start = time.perf_counter()
    for path in paths:
        handle.async_pread(buffer, path)
    handle.wait()
    return time.perf_counter() - start
