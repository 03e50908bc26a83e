"""What kind of checkpoint a file is, from its first bytes: the sniffing behind ``inspect``
and ``verify`` of a directory, where the suffix says little (Lightning's ``.ckpt`` files are
fastckpt files when written through ``fastckpt.lightning``, torch.save files otherwise).

Example:
    >>> import os, tempfile, torch
    >>> import fastckpt
    >>> folder = tempfile.mkdtemp()
    >>> fastckpt.save({"w": torch.ones(2)}, os.path.join(folder, "last.ckpt"))
    >>> torch.save({"w": torch.ones(2)}, os.path.join(folder, "old.ckpt"))
    >>> sniff(os.path.join(folder, "last.ckpt")).kind, sniff(os.path.join(folder, "old.ckpt")).kind
    ('safetensors', 'torch')
    >>> found = checkpoints_in(folder)
    >>> [p.name for p in found.files], [(p.name, why) for p, why in found.skipped]
    (['last.ckpt'], [('old.ckpt', 'a torch.save file (a zip archive)')])
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from fastckpt.cli._common import USAGE, CliError
from fastckpt.format import HEADER_LIMIT
from fastckpt.format.other_formats import other_format
from fastckpt.format.torch_save import SNIFF_BYTES, torch_save_format

__all__ = [
    "CONVERT_HINT",
    "DirectoryListing",
    "FileKind",
    "checkpoint_targets",
    "checkpoints_in",
    "is_dcp_checkpoint",
    "skipped_summary",
    "sniff",
]

#: What a user does with a torch.save file to get one the commands can check.
CONVERT_HINT = "`fastckpt convert FILE OUT.safetensors` writes a fastckpt copy"

#: How each format :func:`torch_save_format` names is described to users.
_TORCH_FORMATS = {"zip": "a zip archive", "pickle": "a pickle", "tar": "a legacy tar archive"}
#: Temporary files of an atomic save (``<name>.<random>.tmp``): in progress or interrupted.
_TEMPORARY_SUFFIX = ".tmp"
#: The file that makes a directory a torch.distributed.checkpoint (DCP) checkpoint: the name
#: :data:`fastckpt.integrations.dcp.METADATA_FILE` holds (a test keeps the two equal). Spelled
#: here because importing that package imports torch.distributed.checkpoint (seconds), and
#: the storage package (:mod:`fastckpt.storage.directory_kinds`) torch, which ``--help`` and a
#: plain file do not need.
DCP_METADATA = ".metadata"


@dataclass(frozen=True)
class FileKind:
    """``kind`` is ``"safetensors"`` (a safetensors/fastckpt file, possibly damaged past its
    first bytes), ``"torch"`` (a torch.save file) or ``"other"``; ``detail`` says more, and
    ``named`` is True when it names another tool's format (NumPy's, GGUF, JSON, a pickle).

    Example:
        >>> FileKind("torch", "a zip archive").description
        'a torch.save file (a zip archive)'
    """

    kind: str
    detail: str = ""
    named: bool = False

    @property
    def description(self) -> str:
        if self.kind == "torch":
            return f"a torch.save file ({self.detail})"
        if self.kind == "safetensors":
            return "a safetensors/fastckpt file"
        if self.named:
            return f"{self.detail}, not a checkpoint file"
        return f"not a checkpoint file ({self.detail})" if self.detail else "not a checkpoint file"


def sniff(path: str | os.PathLike[str]) -> FileKind:
    """The kind of the regular file ``path``, from its first bytes and its size.

    A safetensors file starts with a little-endian u64 header length that fits the file and
    the header's ``{``; torch.save writes a zip archive or (legacy) a pickle.

    Raises:
        OSError: the file cannot be opened or read.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile(suffix=".txt") as f:
        ...     _ = f.write(b"hello everyone"); f.flush()
        ...     sniff(f.name).kind
        'other'
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(SNIFF_BYTES)
    if len(head) >= 9:
        (length,) = struct.unpack("<Q", head[:8])
        if 2 <= length <= min(HEADER_LIMIT, size - 8) and head[8:9] == b"{":
            return FileKind("safetensors")
    torch_format = torch_save_format(head)
    other = other_format(head)
    if torch_format is not None and other is not None and other.reader == "torch.load":
        return FileKind("torch", _TORCH_FORMATS[torch_format])
    if other is not None:  # NumPy's, GGUF, JSON, a plain pickle, another zip archive
        return FileKind("other", other.description, named=True)
    if size == 0:
        return FileKind("other", "empty")
    return FileKind("other", f"it starts with {head[:8]!r}")


def is_dcp_checkpoint(target: str | os.PathLike[str]) -> bool:
    """Whether ``target`` is a DCP checkpoint (a directory or URL holding ``.metadata``),
    found without importing torch.distributed: the commands import the DCP integration only
    for a target this says yes to. A URL that cannot be reached is not one (reading it then
    says why).

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> is_dcp_checkpoint(folder), is_dcp_checkpoint("/no/such/dir")
        (False, False)
        >>> open(os.path.join(folder, ".metadata"), "wb").close()
        >>> is_dcp_checkpoint(folder)
        True
    """
    from fastckpt.storage.locations import is_url

    name = os.fspath(target)
    if not is_url(name):
        return os.path.isdir(name) and os.path.isfile(os.path.join(name, DCP_METADATA))
    from fastckpt import storage

    try:
        return storage.exists(storage.join(name, DCP_METADATA))
    except (ImportError, ValueError, OSError):
        return False


@dataclass
class DirectoryListing:
    """The checkpoint ``files`` of one directory and what was ``skipped`` there, with why."""

    directory: str
    files: list[Path] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def checkpoints_in(directory: str | os.PathLike[str]) -> DirectoryListing:
    """The safetensors/fastckpt files directly inside ``directory``, whatever their suffix,
    and the other regular files, each with the reason it was skipped.

    A ``*.safetensors`` file is taken even when its first bytes are wrong (so ``verify``
    reports it as damaged); hidden files and subdirectories are left out silently.

    Example:
        >>> import tempfile
        >>> checkpoints_in(tempfile.mkdtemp()).files
        []
    """
    listing = DirectoryListing(os.fspath(directory))
    for path in sorted(Path(directory).iterdir()):
        if path.name.startswith("."):
            continue
        try:
            mode = path.stat().st_mode
        except OSError as exc:
            listing.skipped.append((path, f"unreadable: {exc.strerror or exc}"))
            continue
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):  # a FIFO would make the sniffing wait for a writer
            listing.skipped.append((path, "not a regular file"))
            continue
        if path.name.endswith(_TEMPORARY_SUFFIX):
            listing.skipped.append((path, "a temporary file of a save in progress or interrupted"))
            continue
        try:
            kind = sniff(path)
        except OSError as exc:
            listing.skipped.append((path, f"unreadable: {exc.strerror or exc}"))
            continue
        if kind.kind == "safetensors" or (kind.kind == "other" and path.suffix == ".safetensors"):
            listing.files.append(path)
        elif kind.kind == "torch":
            listing.skipped.append((path, kind.description))
        elif kind.named:
            listing.skipped.append((path, kind.detail))
        else:
            listing.skipped.append((path, "neither a fastckpt/safetensors nor a torch.save file"))
    return listing


def skipped_summary(listing: DirectoryListing, *, limit: int = 10) -> str:
    """One line naming the skipped files of ``listing`` by reason (at most ``limit`` names
    per reason), with what to do about torch.save files.

    Example:
        >>> listing = DirectoryListing("ckpts", skipped=[(Path("ckpts/a.ckpt"), "a torch.save file (a zip archive)")])
        >>> print(skipped_summary(listing))
        skipped 1 file in ckpts that is not a fastckpt/safetensors file: a.ckpt: a torch.save file (a zip archive); `fastckpt convert FILE OUT.safetensors` writes a fastckpt copy of a torch.save file
    """
    by_reason: dict[str, list[str]] = {}
    for path, reason in listing.skipped:
        by_reason.setdefault(reason, []).append(path.name)
    parts = []
    for reason, names in by_reason.items():
        shown = ", ".join(names[:limit]) + (
            f", ... ({len(names) - limit} more)" if len(names) > limit else ""
        )
        parts.append(f"{shown}: {reason}")
    count = len(listing.skipped)
    text = (
        f"skipped {count} file{'' if count == 1 else 's'} in {listing.directory} that "
        f"{'is' if count == 1 else 'are'} not a fastckpt/safetensors file: {'; '.join(parts)}"
    )
    if any(reason.startswith("a torch.save file") for reason in by_reason):
        text += f"; {CONVERT_HINT} of a torch.save file"
    return text


def checkpoint_targets(target: str) -> tuple[list[Path | str], DirectoryListing | None]:
    """``target`` itself when it is a file or a URL; the checkpoint files directly inside a
    directory, with the listing (for the skipped files).

    Raises:
        CliError: (status 2) the path does not exist, or a directory holds no
            safetensors/fastckpt file (the message names what it holds instead).

    Example:
        >>> try:
        ...     checkpoint_targets("/no/such/path")
        ... except CliError as err:
        ...     print(err.status, err)
        2 no such file or directory: /no/such/path
    """
    from fastckpt.storage.locations import is_url

    if is_url(target):  # one object at a URL (credentials: FASTCKPT_STORAGE_OPTIONS or AWS_*)
        return [target], None
    path = Path(target)
    if path.is_dir():
        listing = checkpoints_in(path)
        if not listing.files:
            from fastckpt.storage.directory_kinds import directory_kind

            kind = directory_kind(path)
            if kind is not None:  # a series, a step of one or a DCP checkpoint
                raise CliError(f"{target}: {kind.message}", USAGE)
            held = f"; {skipped_summary(listing)}" if listing.skipped else " (it holds no files)"
            raise CliError(f"no fastckpt/safetensors files in directory {target}{held}", USAGE)
        return list(listing.files), listing
    if not path.exists():
        raise CliError(f"no such file or directory: {target}", USAGE)
    return [path], None
