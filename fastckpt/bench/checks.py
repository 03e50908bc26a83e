"""Byte checks of what a benchmark loaded: every page touched, CRC-32s of tensors and files.

A lazily loaded (memory-mapped) tensor is read only when touched, so a load is timed until
:func:`touch` has read every page; afterwards (untimed) CRC-32s tell whether two loads
returned the same bytes.

Example:
    >>> import torch
    >>> crcs = tensor_crc32s({"w": torch.zeros(2, dtype=torch.uint8)})
    >>> crcs, crc_digest(crcs) == crc_digest(dict(crcs))
    ({'w': 1104745215}, True)
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from collections.abc import Mapping
from typing import Any

from fastckpt.bench.units import MiB

__all__ = ["crc_digest", "file_crc32", "tensor_crc32s", "touch"]

PAGE = mmap.PAGESIZE


def touch(obj: Any) -> int:
    """Reads one byte of every page of every tensor in ``obj`` (dicts, lists, tuples), so
    that lazily loaded (memory-mapped) tensors are really read before a clock stops;
    returns the sum of the bytes read.

    Example:
        >>> import torch
        >>> touch({"a": torch.ones(3, dtype=torch.uint8), "b": [torch.zeros(2)]})
        1
    """
    import torch

    tensors = _tensors(obj)
    total = 0
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        total += int(flat[::PAGE].sum(dtype=torch.int64))
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()
    return total


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def tensor_crc32s(tensors: Mapping[str, Any]) -> dict[str, int]:
    """CRC-32 of every byte of every tensor of a flat ``name -> tensor`` mapping (CPU).

    Two loads that agree on every name's CRC returned the same bytes.

    Example:
        >>> import torch
        >>> tensor_crc32s({"w": torch.zeros(2, dtype=torch.uint8)})
        {'w': 1104745215}
    """
    import torch

    out = {}
    for name, tensor in tensors.items():
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        out[name] = zlib.crc32(memoryview(flat.numpy()))
    return out


def file_crc32(path: str | os.PathLike[str], start: int = 0, chunk: int = 8 * MiB) -> int:
    """CRC-32 of a file's bytes from ``start`` to its end.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(bytes(2)); f.flush()
        ...     file_crc32(f.name)
        1104745215
    """
    crc = 0
    with open(path, "rb") as f:
        f.seek(start)
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def crc_digest(crcs: dict[str, int]) -> int:
    """One number for a ``name -> CRC-32`` dict: equal digests, equal bytes under every name.

    Example:
        >>> crc_digest({"a": 1, "b": 2}) == crc_digest({"b": 2, "a": 1})
        True
    """
    return zlib.crc32(json.dumps(sorted(crcs.items())).encode())
