"""What ``fastckpt inspect`` and ``fastckpt verify`` report about a DCP checkpoint (a
directory or a URL): its keys, shapes and files, and whether every file and checksum is
intact. Only headers and the restricted-unpickled ``.metadata`` are read for a description.

Example:
    >>> import os, tempfile, torch
    >>> import torch.distributed.checkpoint as dcp
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    >>> describe_dcp(path)["writer"], verify_dcp(path)[0]
    ('dcp', 'UNVERIFIABLE')
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from fastckpt.checkpoint.read import open_checkpoint
from fastckpt.errors import FastCkptError
from fastckpt.integrations import remote
from fastckpt.integrations.dcp._paths import location
from fastckpt.integrations.dcp.metadata import file_of, is_ours, read_dcp_metadata

__all__ = ["describe_dcp", "format_dcp", "verify_dcp"]


def describe_dcp(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """What ``fastckpt inspect`` reports about a DCP checkpoint directory or URL (JSON-able).

    Keys: ``path``, ``kind`` (``"dcp"``), ``writer`` (``"fastckpt"`` or ``"dcp"``), ``entries``
    (``key, type, dtype, shape, chunks, bytes``), ``files`` (name and size), ``total_bytes``.

    ``.metadata`` is read by the restricted unpickler (``allow_pickle=True``: without limits,
    for trusted checkpoints only); a file naming anything else raises
    :class:`fastckpt.errors.UnsafePickleError`.
    """
    path = location(path)
    metadata = read_dcp_metadata(path, storage_options=storage_options, allow_pickle=allow_pickle)
    entries = []
    total = 0
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            nbytes = md.size.numel() * md.properties.dtype.itemsize
            total += nbytes
            entries.append(
                {
                    "key": fqn,
                    "type": "tensor",
                    "dtype": str(md.properties.dtype).removeprefix("torch."),
                    "shape": list(md.size),
                    "chunks": len(md.chunks),
                    "bytes": nbytes,
                }
            )
        else:
            assert isinstance(md, BytesStorageMetadata)
            entries.append(
                {"key": fqn, "type": "bytes", "dtype": "", "shape": [], "chunks": 1, "bytes": 0}
            )
    named = {file_of(v) for v in (metadata.storage_data or {}).values()}
    files = sorted(name for name in named if name is not None)
    sizes = _file_sizes(path, storage_options)
    return {
        "path": path,
        "kind": "dcp",
        "writer": "fastckpt" if is_ours(metadata) else "dcp",
        "entries": entries,
        "files": [{"name": f, "bytes": sizes.get(f)} for f in files],
        "total_bytes": total,
    }


def _file_sizes(path: str, storage_options: dict[str, Any] | None = None) -> dict[str, int]:
    """Name -> size of every file directly in the checkpoint directory or URL."""
    if not remote.is_url(path):
        if not os.path.isdir(path):
            return {}
        return {entry.name: entry.stat().st_size for entry in os.scandir(path) if entry.is_file()}
    fs, inner = remote.url_to_fs(path, storage_options)
    with remote._Errors(path, "listing"):
        listing = fs.ls(inner, detail=True)
    return {
        e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
        for e in listing
        if e.get("type") == "file"
    }


def verify_dcp(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> tuple[str, str, list[str]]:
    """Checks a DCP checkpoint directory or URL: its metadata, that every item it names
    exists, and (for ours) every tensor's CRC32C. Returns ``(status, detail, damaged)`` with
    status ``OK``, ``DAMAGED``, ``UNVERIFIABLE`` (DCP's own format has no checksums) or
    ``ERROR``. A ``.metadata`` that names objects outside DCP's metadata is ``DAMAGED`` and
    is not unpickled, unless ``allow_pickle=True`` (trusted checkpoints only).

    Example:
        >>> verify_dcp("/no/such/dir")[0], verify_dcp("memory://no/such/ckpt")[0]
        ('ERROR', 'ERROR')
    """
    name = location(path)
    try:
        metadata = read_dcp_metadata(
            name, storage_options=storage_options, allow_pickle=allow_pickle
        )
    except FastCkptError as exc:
        return "DAMAGED", f"{name}: {exc}", []
    except OSError as exc:
        return "ERROR", f"{name}: {exc.strerror or exc}", []
    data = metadata.storage_data or {}
    per_file: dict[str, list[str]] = {}
    for storage in data.values():
        per_file.setdefault(file_of(storage) or "?", []).append(
            storage[1] if isinstance(storage, tuple) else ""
        )
    try:
        present = _file_sizes(name, storage_options)
    except OSError as exc:
        return "ERROR", f"{name}: {exc.strerror or exc}", []
    missing = [f for f in per_file if f not in present]
    if missing:
        return "DAMAGED", f"{name}: missing files: {', '.join(sorted(missing))}", []
    if not is_ours(metadata):
        return (
            "UNVERIFIABLE",
            f"{name}: DCP checkpoint of {len(per_file)} files without checksums "
            "(written by DCP's FileSystemWriter); its files are all present",
            [],
        )
    damaged: list[str] = []
    for file_name, names in sorted(per_file.items()):
        file_path = remote.join(name, file_name)
        try:
            with _open_rank_file(file_path, storage_options) as reader:
                absent = sorted(set(names) - set(reader.keys()))
                if absent:
                    damaged += [f"{file_name}:{n} (missing)" for n in absent]
                    continue
                damaged += [f"{file_name}:{n}" for n in reader.verify(sorted(set(names)))]
        except FastCkptError as exc:
            return "DAMAGED", f"{name}: {file_name}: {exc}", damaged
        except OSError as exc:
            return "ERROR", f"{name}: {file_name}: {exc.strerror or exc}", damaged
    if damaged:
        return "DAMAGED", f"{name}: damaged: {', '.join(damaged[:20])}", damaged
    return (
        "OK",
        f"{name} (DCP checkpoint, {len(metadata.state_dict_metadata)} keys, {len(per_file)} files)",
        [],
    )


def _open_rank_file(path: str, storage_options: dict[str, Any] | None) -> Any:
    if remote.is_url(path):
        return remote.RemoteReader(path, storage_options=storage_options)
    return open_checkpoint(path)


def format_dcp(info: dict[str, Any]) -> str:
    """The text ``fastckpt inspect`` prints for :func:`describe_dcp`'s result.

    Example:
        >>> info = {"path": "ckpt", "writer": "fastckpt", "total_bytes": 16, "files": [],
        ...         "entries": [{"key": "w", "type": "tensor", "dtype": "float32",
        ...                      "shape": [4], "chunks": 2, "bytes": 16}]}
        >>> print(format_dcp(info))  # doctest: +NORMALIZE_WHITESPACE
        ckpt: DCP checkpoint written by fastckpt, 1 keys, 16 bytes of tensors in 0 files
          key  type    dtype    shape  chunks  bytes
          w    tensor  float32  [4]         2     16
    """
    lines = [
        f"{info['path']}: DCP checkpoint written by "
        f"{'fastckpt' if info['writer'] == 'fastckpt' else 'DCP FileSystemWriter'}, "
        f"{len(info['entries'])} keys, {info['total_bytes']} bytes of tensors "
        f"in {len(info['files'])} files"
    ]
    rows = [("key", "type", "dtype", "shape", "chunks", "bytes")]
    for e in info["entries"]:
        shape = "[" + ", ".join(map(str, e["shape"])) + "]" if e["type"] == "tensor" else ""
        rows.append((e["key"], e["type"], e["dtype"], shape, str(e["chunks"]), str(e["bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for row in rows:
        left = "  ".join(row[i].ljust(widths[i]) for i in range(4))
        right = "  ".join(row[i].rjust(widths[i]) for i in range(4, 6))
        lines.append(f"  {left}  {right}")
    for f in info["files"]:
        size = "missing" if f["bytes"] is None else f"{f['bytes']} bytes"
        lines.append(f"  file {f['name']}: {size}")
    return "\n".join(lines)
