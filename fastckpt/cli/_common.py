"""Pieces the commands share: errors with an exit status, argument types, cold caches, files.

Exit statuses follow one rule across commands: 0 success, 1 the work failed or found
damage, 2 the command line (or the machine) cannot do what was asked.

Example:
    >>> size_arg("64K")
    65536
    >>> format_bytes(3 << 30)
    '3.00 GiB'
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

from fastckpt.config import parse_size

__all__ = [
    "FAILURE",
    "USAGE",
    "CliError",
    "PageCache",
    "bool_arg",
    "check_engines",
    "checkpoint_files",
    "engine_list_arg",
    "format_bytes",
    "fsync_path",
    "gbps",
    "median",
    "positive_int_arg",
    "require_cuda",
    "require_gds",
    "size_arg",
    "warn",
]

FAILURE = 1
USAGE = 2

#: Engines a user may name on the command line (``gds`` is picked with ``--gds``).
ENGINE_CHOICES = ("io_uring", "libaio", "threads")


class CliError(Exception):
    """A failure reported as one line on stderr and an exit status (no traceback).

    Example:
        >>> err = CliError("no such directory: /x", USAGE)
        >>> err.status, str(err)
        (2, 'no such directory: /x')
    """

    def __init__(self, message: str, status: int = FAILURE):
        super().__init__(message)
        self.status = status


def warn(message: str) -> None:
    """Prints ``warning: message`` on stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------ argument types


def size_arg(text: str) -> int:
    """argparse type for byte sizes: ``4096``, ``64K``, ``1M``, ``400M``, ``1G`` (powers of 1024).

    Example:
        >>> size_arg("1G")
        1073741824
    """
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def positive_int_arg(text: str) -> int:
    """argparse type for counts (``--loops``, ``--queue_depth``).

    Example:
        >>> positive_int_arg("32")
        32
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def bool_arg(text: str) -> bool:
    """argparse type for ``true``/``false`` values (also 1/0, yes/no, on/off).

    Example:
        >>> bool_arg("True"), bool_arg("0")
        (True, False)
    """
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def engine_list_arg(text: str) -> list[str]:
    """argparse type for ``--engine``: one name or a comma list, checked against known engines.

    Example:
        >>> engine_list_arg("io_uring,threads")
        ['io_uring', 'threads']
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected an engine name")
    for name in names:
        if name not in ENGINE_CHOICES:
            raise argparse.ArgumentTypeError(
                f"unknown engine {name!r}; choose from {', '.join(ENGINE_CHOICES)}"
            )
    return names


def check_engines(names: Iterable[str]) -> list[str]:
    """Keeps the order, drops repeats, and fails (status 2) on an engine not available here.

    Example:
        >>> check_engines(["threads", "threads"])
        ['threads']
    """
    from fastckpt.io.engines import engines

    info = engines()
    result: list[str] = []
    for name in names:
        if name in result:
            continue
        if not info[name].available:
            raise CliError(f"engine {name!r} is not available here: {info[name].reason}", USAGE)
        result.append(name)
    return result


def require_cuda(option: str) -> None:
    """Fails with status 2 when ``option`` (``--gpu``, ``--gds``) needs CUDA and there is none."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is needed by every command that gets here
        raise CliError(f"{option} needs PyTorch with CUDA; torch is not installed", USAGE) from None
    if not torch.cuda.is_available():
        raise CliError(
            f"{option} needs a CUDA GPU, and torch.cuda.is_available() is False here", USAGE
        )


def require_gds() -> None:
    """Fails with status 2 unless GPUDirect Storage can run here (CUDA and cuFile)."""
    require_cuda("--gds")
    from fastckpt.io.engines import engines

    info = engines()["gds"]
    if not info.available:
        raise CliError(f"--gds: GPUDirect Storage is not available here: {info.reason}", USAGE)


# ------------------------------------------------------------------------ numbers


def format_bytes(nbytes: float) -> str:
    """A byte count for people, in powers of 1024.

    Example:
        >>> format_bytes(1536), format_bytes(12)
        ('1.50 KiB', '12 B')
    """
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.2f} {unit}"
    raise AssertionError("unreachable")


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10**9 bytes per second, as storage vendors and DeepSpeed count).

    Example:
        >>> gbps(2_000_000_000, 1.0)
        2.0
    """
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


def median(values: Iterable[float | None]) -> float:
    """The median of the values that were measured (None left out), or NaN for none.

    Example:
        >>> median([3.0, 1.0, 2.0])
        2.0
        >>> median([None, 4.0])
        4.0
    """
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else math.nan


# ------------------------------------------------------------------------ cold reads


class PageCache:
    """Drops the kernel's page cache before timed reads, where this process may.

    Dropping needs root (writing ``/proc/sys/vm/drop_caches``). Where that is refused, the
    clean pages of the files about to be read are still evicted with
    ``posix_fadvise(DONTNEED)`` (allowed to anyone), and fastckpt's engines read with
    O_DIRECT, which bypasses the cache on file systems that allow it.

    Example:
        >>> cache = PageCache()
        >>> cache.can_drop in (True, False)
        True
    """

    PATH = "/proc/sys/vm/drop_caches"

    def __init__(self) -> None:
        self.reason = ""
        self.can_drop = self._try_drop()

    def _try_drop(self) -> bool:
        try:
            os.sync()
            with open(self.PATH, "w", encoding="ascii") as f:
                f.write("3\n")
            return True
        except OSError as exc:
            self.reason = exc.strerror or str(exc)
            return False

    def drop(self, paths: Iterable[str | os.PathLike[str]] = ()) -> None:
        """Makes the next read of ``paths`` come from the device (as far as permitted)."""
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        if self.can_drop:
            self._try_drop()

    def describe(self) -> str:
        """One line for the output: how reads are kept cold."""
        if self.can_drop:
            return "page cache dropped before every read (running as root)"
        return (
            f"page cache not dropped ({self.PATH}: {self.reason or 'not permitted'}; needs root): "
            "reads rely on O_DIRECT and posix_fadvise"
        )


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


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flushes a file's data to the device (what "timed to durability" means here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------ paths


def checkpoint_files(target: str, pattern: str = "*.safetensors") -> list[Path | str]:
    """``target`` itself when it is a file or a URL; the ``pattern`` files directly inside a
    directory.

    Raises:
        CliError: (status 2) the path does not exist, or a directory holds no such file.

    Example:
        >>> try:
        ...     checkpoint_files("/no/such/path")
        ... except CliError as err:
        ...     print(err.status, err)
        2 no such file or directory: /no/such/path
    """
    from fastckpt.integrations.remote import is_url

    if is_url(target):  # one object at a URL (credentials: FASTCKPT_STORAGE_OPTIONS or AWS_*)
        return [target]
    path = Path(target)
    if path.is_dir():
        found = sorted(p for p in path.glob(pattern) if p.is_file())
        if not found:
            raise CliError(f"no {pattern} files in directory {target}", USAGE)
        return found
    if not path.exists():
        raise CliError(f"no such file or directory: {target}", USAGE)
    return [path]
