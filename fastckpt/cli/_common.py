"""Pieces the commands share: errors with an exit status, argument types, checks, files.

Exit statuses follow one rule across commands: 0 success, 1 the work failed or found
damage, 2 the command line (or the machine) cannot do what was asked.

Byte counts are shown with :func:`fastckpt.bench.units.format_bytes` (imported here for
the commands).

Example:
    >>> size_arg("64K")
    65536
    >>> format_bytes(3 << 30)
    '3.00 GiB'
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from fastckpt.bench.units import format_bytes
from fastckpt.config import parse_size

__all__ = [
    "FAILURE",
    "USAGE",
    "CliError",
    "bool_arg",
    "check_engines",
    "checkpoint_files",
    "engine_list_arg",
    "format_bytes",
    "make_directory",
    "positive_int_arg",
    "removed_if_left_empty",
    "require_cuda",
    "require_gds",
    "size_arg",
    "spellings",
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


def spellings(*names: str) -> list[str]:
    """Each option name with underscores and with hyphens, for ``add_argument``: tune and bench
    keep DeepSpeed's ``--io_size`` while convert spells ``--to-dcp``, so both are accepted.

    Example:
        >>> spellings("--io_size", "--io_parallel")
        ['--io_size', '--io-size', '--io_parallel', '--io-parallel']
        >>> spellings("--no-drop-caches")
        ['--no-drop-caches', '--no_drop_caches']
    """
    result: list[str] = []
    for name in names:
        body = name.lstrip("-")
        dashes = name[: len(name) - len(body)]
        for spelled in (name, dashes + body.replace("_", "-"), dashes + body.replace("-", "_")):
            if spelled not in result:
                result.append(spelled)
    return result


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


# ------------------------------------------------------------------------ paths


def make_directory(option: str, path: str) -> bool:
    """Makes sure ``path`` is a directory, creating its last component only (as ``mkdir``
    without ``-p``): a typo in a parent should fail, not grow a tree. Returns True when the
    directory was created.

    Raises:
        CliError: (status 2) naming the missing parent, or ``path`` is not a directory, or
            it cannot be created (with the system's reason).

    Example:
        >>> try:
        ...     make_directory("--folder", "/no/such/parent/bench")
        ... except CliError as err:
        ...     print(err.status, err)  # doctest: +ELLIPSIS
        2 --folder /no/such/parent/bench: the parent directory /no/such/parent does not exist; ...
    """
    if os.path.isdir(path):
        return False
    if os.path.lexists(path):
        raise CliError(f"{option} {path}: not a directory", USAGE)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise CliError(
            f"{option} {path}: the parent directory {parent} {what}; only the last component "
            f"is created (create the parent first, e.g. mkdir -p {parent})",
            USAGE,
        )
    try:
        os.mkdir(path)
    except FileExistsError:  # made by someone else meanwhile; checked again by the caller
        return False
    except OSError as exc:
        raise CliError(f"{option} {path}: cannot create it: {exc.strerror}", USAGE) from None
    return True


@contextlib.contextmanager
def removed_if_left_empty(paths: Iterable[str]) -> Iterator[None]:
    """Removes, on the way out, each of ``paths`` that did not exist on the way in and is an
    empty directory then: a scratch folder a command created (``make_directory``) goes
    away with the command's own files, and a folder that was there, or that now holds
    anything, stays.

    Example:
        >>> import tempfile
        >>> parent = tempfile.mkdtemp()
        >>> new, kept = os.path.join(parent, "new"), os.path.join(parent, "kept")
        >>> with removed_if_left_empty([new, kept, parent]):
        ...     make_directory("--folder", new), make_directory("--folder", kept)
        ...     open(os.path.join(kept, "result.json"), "w").close()
        (True, True)
        >>> sorted(os.listdir(parent))
        ['kept']
    """
    missing = [path for path in paths if not os.path.lexists(path)]
    try:
        yield
    finally:
        for path in missing:
            # rmdir removes only an empty directory, never a file or a link to one
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)


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
    from fastckpt.storage.locations import is_url

    if is_url(target):  # one object at a URL (credentials: FASTCKPT_STORAGE_OPTIONS or AWS_*)
        return [target]
    path = Path(target)
    if path.is_dir():
        found: list[Path | str] = sorted(p for p in path.glob(pattern) if p.is_file())
        if not found:
            raise CliError(f"no {pattern} files in directory {target}", USAGE)
        return found
    if not path.exists():
        raise CliError(f"no such file or directory: {target}", USAGE)
    return [path]
