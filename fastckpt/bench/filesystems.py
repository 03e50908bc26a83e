"""The file system a benchmark runs on: its type (memory or device), free space, O_DIRECT.

The mount table is read by :mod:`fastckpt.mounts`; which types keep files in memory is
:data:`fastckpt.io.page_cache.MEMORY_FILESYSTEMS`.

Example:
    >>> filesystem_of("/proc/self")[0]
    'proc'
    >>> available_memory() is None or available_memory() > 0
    True
"""

from __future__ import annotations

import os
import shutil

from fastckpt.bench.units import KiB, format_bytes
from fastckpt.io.page_cache import MEMORY_FILESYSTEMS
from fastckpt.mounts import mount_of

__all__ = [
    "available_memory",
    "direct_io_supported",
    "filesystem_of",
    "free_bytes",
    "on_memory_filesystem",
    "require_directory",
]


def filesystem_of(path: str | os.PathLike[str]) -> tuple[str, str, str]:
    """(type, source, mount point) of the file system holding ``path`` (which may not exist).

    Example:
        >>> filesystem_of("/proc/self")[0]
        'proc'
    """
    mount = mount_of(path)
    return mount.fs_type, mount.source, mount.mount_point


def on_memory_filesystem(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is on a file system that keeps files in memory (tmpfs and the like).

    Example:
        >>> on_memory_filesystem("/proc/self")
        False
    """
    return mount_of(path).fs_type in MEMORY_FILESYSTEMS


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes on the file system holding ``path``."""
    return shutil.disk_usage(path).free


def available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return None


def direct_io_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (tmpfs and others refuse it).

    Example:
        >>> import tempfile
        >>> direct_io_supported(tempfile.gettempdir()) in (True, False)
        True
    """
    import tempfile

    from fastckpt.io.files import File

    fd, probe = tempfile.mkstemp(prefix=".fastckpt-probe-", dir=directory)
    os.close(fd)
    try:
        with File(probe) as f:
            return f.direct
    finally:
        os.unlink(probe)


def require_directory(path: str | os.PathLike[str], need: int, *, memory: bool) -> str:
    """Checks a benchmark's directory: on a memory file system or not (as ``memory`` asks),
    with ``need`` bytes free. Returns a description; raises SystemExit with the reason.
    """
    fs_type, source, mount = filesystem_of(path)
    if (fs_type in MEMORY_FILESYSTEMS) != memory:
        kind = "a memory file system" if memory else "a disk"
        raise SystemExit(f"error: {path} is on {fs_type} ({mount}); this needs {kind}")
    free = free_bytes(path)
    if free < need:
        raise SystemExit(
            f"error: {path} has {format_bytes(free)} free; this run needs about "
            f"{format_bytes(need)}: use a smaller --size or another directory"
        )
    return f"{fs_type} ({source}, mounted at {mount})"
