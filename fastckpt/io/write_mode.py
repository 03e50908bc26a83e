"""How a save writes a local file: with O_DIRECT through staging buffers, or from the
tensors' own memory through the page cache, and why.

The two paths win in different places, so the choice is made per save, in this order:

1. ``direct_io=True``/``False`` on the call, else ``FASTCKPT_DIRECT_IO``;
2. tensors on a GPU go through page-locked staging buffers (O_DIRECT where it is taken);
3. a file system that refuses O_DIRECT, or one that lives in memory (tmpfs), is written
   through the page cache (O_DIRECT buys nothing there);
4. a small state (at most :data:`SMALL_STATE_BYTES`) is written through the page cache: a
   save of a few MiB is made of fixed costs (staging, a padded last block, a truncate), and
   one ``pwrite`` per tensor and the fsync is what ``safetensors`` + fsync pays; the file
   also stays in memory for a load that follows;
5. what ``fastckpt tune`` measured on the file system (:func:`fastckpt.config.tuned_write_mode`);
6. otherwise O_DIRECT, the documented default: on the disks measured while writing this
   (a virtual SSD whose O_DIRECT writes ran 1.3-2x faster than its buffered ones, see
   docs/benchmarks.md) it is the faster path, and it leaves the page cache alone.

Each choice is logged on the ``fastckpt`` logger at DEBUG with its reason.

Example:
    >>> choose_write_mode("/tmp/x.safetensors", 1 << 30, direct_available=True, explicit=True)
    ('direct', 'direct_io=True')
    >>> choose_write_mode("/tmp/x.safetensors", 1 << 30, direct_available=False)
    ('buffered', 'the file system refuses O_DIRECT')
"""

from __future__ import annotations

import logging

from fastckpt import config
from fastckpt.io.page_cache import MEMORY_FILESYSTEMS

__all__ = ["SMALL_STATE_BYTES", "choose_write_mode"]

_log = logging.getLogger("fastckpt")

#: States of at most this many bytes are written through the page cache by default.
#: Measured here: at 16 MiB a buffered save took 0.5-0.7x the time of a direct one, at
#: 512 MiB 2x (docs/benchmarks.md); 64 MiB is well below where the direct path pulls ahead.
SMALL_STATE_BYTES = 64 << 20


def choose_write_mode(
    path: str,
    nbytes: int | None,
    *,
    direct_available: bool,
    explicit: bool | None = None,
    on_device: bool = False,
) -> tuple[str, str]:
    """``("direct" | "buffered", why)`` for a save of ``nbytes`` to ``path`` (see the
    module's description for the order of the rules). ``direct_available``: the file was
    opened with O_DIRECT; ``explicit``: the call's ``direct_io``; ``on_device``: some
    tensors are on a GPU. ``nbytes=None`` applies rules 1-3 only (a caller whose other paths
    are built for memory file systems: asynchronous saves), else O_DIRECT.

    Example:
        >>> choose_write_mode("/tmp/x", 1 << 30, direct_available=True, explicit=False)
        ('buffered', 'direct_io=False')
    """
    mode, why = _choose(path, nbytes, direct_available, explicit, on_device)
    _log.debug("saving %s: %s (%s)", path, mode, why)
    return mode, why


def _choose(
    path: str, nbytes: int | None, direct_available: bool, explicit: bool | None, on_device: bool
) -> tuple[str, str]:
    if on_device:  # device tensors need host staging anyway
        return "direct", "tensors on a GPU are staged through page-locked buffers"
    if explicit is not None:
        return ("direct", "direct_io=True") if explicit else ("buffered", "direct_io=False")
    forced = config.direct_io()
    if forced is not None:
        return (
            ("direct", "FASTCKPT_DIRECT_IO=1") if forced else ("buffered", "FASTCKPT_DIRECT_IO=0")
        )
    if not direct_available:
        return "buffered", "the file system refuses O_DIRECT"
    fs_type = config.filesystem_key(path).split(":", 1)[0]
    if fs_type in MEMORY_FILESYSTEMS:
        return "buffered", f"a memory file system ({fs_type})"
    if nbytes is None:
        return "direct", "O_DIRECT where the file system takes it (no size-based choice)"
    if nbytes <= SMALL_STATE_BYTES:
        return "buffered", (
            f"a small state ({nbytes / 2**20:.1f} MiB, at most {SMALL_STATE_BYTES >> 20} MiB): "
            "through the page cache"
        )
    tuned = config.tuned_write_mode(path)
    if tuned is not None:
        return tuned
    return "direct", "no write mode tuned here: O_DIRECT (the default)"
