"""Reading and writing a DCP checkpoint's ``.metadata``, without running code from it.

DCP stores its :class:`~torch.distributed.checkpoint.metadata.Metadata` as a pickle, and
unpickling runs whatever the pickle names: a hostile ``.metadata`` would run code as soon as
a checkpoint is inspected, verified, converted or loaded. So it is read with an unpickler
that admits only what real metadata holds: DCP's metadata classes, the storage record of
DCP's ``FileSystemWriter``, ``torch.Size``, torch's dtypes, layouts and memory formats, paths
and plain containers. Anything else raises :class:`fastckpt.errors.UnsafePickleError`
naming the global; ``allow_pickle=True`` unpickles without limits (trusted files only).

Example:
    >>> import os, pickle, tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, METADATA_FILE), "wb") as f:
    ...     f.write(pickle.dumps(print)) and None
    >>> try:
    ...     read_dcp_metadata(d)
    ... except UnsafePickleError as exc:
    ...     exc.global_name
    'builtins.print'
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata

from fastckpt.errors import HeaderError, UnsafePickleError
from fastckpt.integrations import remote
from fastckpt.integrations.dcp._paths import METADATA_FILE, location
from fastckpt.io.files import require_regular_file

__all__ = [
    "METADATA_FILE",
    "UnsafePickleError",
    "is_dcp_checkpoint",
    "is_ours",
    "read_dcp_metadata",
    "write_dcp_metadata",
    "file_of",
]

#: Globals a DCP metadata pickle may name besides the classes of DCP's metadata module.
_ADMITTED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name, from torch's own table
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("fastckpt.integrations.dcp.storage_item", "StoredItem"),  # FastCkptWriter's entries
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


def _admitted(module: str, name: str) -> bool:
    """Whether a metadata pickle may name ``module.name``: data classes and values only."""
    if (module, name) in _ADMITTED:
        return True
    if module == "torch":  # torch.float32, torch.strided, torch.contiguous_format, ...
        value = getattr(torch, name, None)
        return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
    if module == dcp_metadata.__name__:
        # Metadata, TensorStorageMetadata, ChunkStorageMetadata, MetadataIndex, ... and the
        # enum of memory formats: plain records, whatever this torch version adds.
        value = getattr(dcp_metadata, name, None)
        return (
            isinstance(value, type)
            and value.__module__ == module
            and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
        )
    return False


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals :func:`_admitted` lets through."""

    def find_class(self, module: str, name: str) -> Any:
        if not _admitted(module, name):
            raise UnsafePickleError(f"{module}.{name}", global_name=f"{module}.{name}")
        return super().find_class(module, name)


def _unpickle(data: bytes, path: str, allow_pickle: bool) -> Any:
    if allow_pickle:
        return pickle.loads(data)
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as exc:
        raise UnsafePickleError(
            f"{path}: refused to unpickle {exc.global_name}: DCP metadata holds only DCP's "
            "metadata classes, torch dtypes and plain containers, and unpickling anything "
            "else runs code from the file; if you trust this checkpoint, pass "
            "allow_pickle=True (--allow-pickle on the command line)",
            global_name=exc.global_name,
            filename=path,
        ) from None


def read_dcp_metadata(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> Metadata:
    """DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` of a checkpoint (a
    directory or a URL), unpickled by an unpickler that admits only DCP's metadata classes.

    Args:
        allow_pickle: unpickle without limits (runs any code the file holds: only for
            checkpoints you trust).

    Raises:
        FileNotFoundError: ``path`` holds no ``.metadata``.
        fastckpt.errors.UnsafePickleError: the file names a global outside DCP's metadata
            (nothing from it ran).
        fastckpt.HeaderError: the file is not a DCP metadata pickle.

    Example:
        >>> import os, tempfile, torch
        >>> import torch.distributed.checkpoint as dcp
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        >>> read_dcp_metadata(path).state_dict_metadata["w"].size
        torch.Size([2])
    """
    meta_path = remote.join(location(path), METADATA_FILE)
    if not remote.is_url(meta_path):
        require_regular_file(meta_path)  # a FIFO would block the read until a writer came
    data = remote.read_bytes(meta_path, storage_options)
    try:
        metadata = _unpickle(data, meta_path, allow_pickle)
    except UnsafePickleError:
        raise
    except Exception as exc:  # any other unpickling failure means a damaged file
        raise HeaderError(f"{meta_path}: not a DCP metadata file ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise HeaderError(f"{meta_path}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def write_dcp_metadata(
    path: str, metadata: Metadata, storage_options: dict[str, Any] | None = None
) -> None:
    """Publishes ``metadata`` as the checkpoint at ``path``: the commit step of a save
    (temporary file, fsync, rename, directory fsync; at a URL one upload, whole or absent)."""
    remote.write_bytes(remote.join(path, METADATA_FILE), pickle.dumps(metadata), storage_options)


def is_dcp_checkpoint(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> bool:
    """Whether ``path`` is a DCP checkpoint (ours or DCP's own ``FileSystemWriter``): a
    directory, or a URL, holding ``.metadata``.

    Example:
        >>> is_dcp_checkpoint("/no/such/dir"), is_dcp_checkpoint("memory://no/such/ckpt")
        (False, False)
    """
    where = location(path)
    if remote.is_url(where):
        # Unreachable or unknown storage is "not a checkpoint": reading it says why.
        try:
            fs, inner = remote.url_to_fs(remote.join(where, METADATA_FILE), storage_options)
            return bool(fs.isfile(inner))
        except (ImportError, ValueError, OSError):
            return False
    return os.path.isdir(where) and os.path.isfile(os.path.join(where, METADATA_FILE))


def is_ours(metadata: Metadata) -> bool:
    """Whether FastCkptWriter wrote the checkpoint: each item stored as (file, tensor name)."""
    data = metadata.storage_data or {}
    return bool(data) and all(
        isinstance(v, tuple) and len(v) == 2 and all(isinstance(s, str) for s in v)
        for v in data.values()
    )


def file_of(storage: Any) -> str | None:
    """The file an item of the metadata's ``storage_data`` is stored in (ours or DCP's)."""
    if isinstance(storage, tuple):
        return storage[0]
    return getattr(storage, "relative_path", None)
