"""The plan of a Hugging Face sharded save: the file names, the shard size limit, which
tensors go to which shard, and the index that maps each name to its shard.

Pure planning over a state dict's tensors (sizes and shared storage): no file is read or
written here. :mod:`~fastckpt.integrations.hf_shards_write` writes what this plans, and
:mod:`~fastckpt.integrations.hf_shards` describes the convention.

Example:
    >>> import torch
    >>> plan_shards({"a": torch.zeros(100), "b": torch.zeros(100)}, "400B")
    [['a'], ['b']]
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Set
from typing import Any

import torch

from fastckpt import storage
from fastckpt.io import commit_set

__all__ = [
    "DEFAULT_PARALLEL",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "parse_shard_size",
    "plan_shards",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: Shard names a sharded save writes: Hugging Face's, and those with a set's random tag.
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}(-[0-9a-f]{8})?\.safetensors")
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
#: Shards written or read at the same time.
DEFAULT_PARALLEL = 4


def parse_shard_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or ``"5GB"`` (decimal, as huggingface_hub) / ``"5GiB"``.

    Example:
        >>> parse_shard_size("5GB"), parse_shard_size("1.5MiB"), parse_shard_size(100)
        (5000000000, 1572864, 100)
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"max_shard_size must be an int or a str like '5GB', got {size!r}")
    if isinstance(size, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"max_shard_size {size!r} is not a size (examples: '5GB', '500MB', '2GiB')"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size}")
    return size


def _local(path: Any) -> str | None:
    """The local path of ``path`` (str, PathLike or ``file://`` URL), or None for a URL."""
    return storage.to_local(path)


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    # Tensors sharing storage (tied weights, views of one buffer) must land in one shard.
    if t.device.type == "meta":
        return ("tensor", id(t))
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _tied_groups(state_dict: Mapping[str, torch.Tensor]) -> list[tuple[list[str], int]]:
    """The state dict's names grouped by the storage they share, in order of first
    appearance, each group with the bytes its shard will hold: a shard stores a tied tensor
    once per name (safetensors readers see every key), so every name counts.

    Example:
        >>> w = torch.zeros(100)  # 400 bytes
        >>> _tied_groups({"a": w, "b": torch.zeros(10), "tied": w})
        [(['a', 'tied'], 800), (['b'], 40)]
    """
    groups: dict[tuple[Any, ...], tuple[list[str], list[int]]] = {}
    for name, t in state_dict.items():
        names, size = groups.setdefault(_storage_key(t), ([], [0]))
        names.append(name)
        size[0] += t.numel() * t.element_size()
    return [(names, size[0]) for names, size in groups.values()]


def plan_shards(
    state_dict: Mapping[str, torch.Tensor], max_shard_size: int | str
) -> list[list[str]]:
    """Names per shard, in the state dict's order (see the module docstring for the rules).
    Tensors sharing storage go to one shard, and each of their names counts toward its size
    (the shard stores a copy per name).

    Example:
        >>> import torch
        >>> w = torch.zeros(100)  # 400 bytes
        >>> plan_shards({"a": w, "b": torch.zeros(100), "tied": w, "big": torch.zeros(300)}, 800)
        [['a', 'tied'], ['big'], ['b']]
    """
    limit = parse_shard_size(max_shard_size)
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for names, size in _tied_groups(state_dict):
        if size > limit:
            shards.append(names)
            continue
        if current and current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current += names
        current_size += size
    if current:
        shards.append(current)
    return shards


def _check_state_dict(state_dict: Any) -> None:
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"a sharded save takes a flat str -> Tensor dict (a state_dict), "
            f"got {type(state_dict).__name__}"
        )
    for name, t in state_dict.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(
                f"a sharded save takes a flat str -> Tensor dict; entry {name!r} holds "
                f"{type(t).__name__}"
            )
        if type(t) is not torch.Tensor and type(t.detach()) is not torch.Tensor:
            # DTensor and other wrapper subclasses have no local storage to shard by
            raise TypeError(
                f"entry {name!r} is a {type(t).__name__}, a tensor subclass that a sharded "
                "save cannot store: pass plain tensors (for a DTensor, .full_tensor() on "
                "every rank), or save the distributed state dict through fastckpt.dcp"
            )


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _final_names(count: int, referenced: Set[str]) -> list[str]:
    """The shards' names: Hugging Face's own into a directory with no published set; else
    names the published set does not reference (``model-00001-of-00003-<8 hex>.safetensors``),
    so no file a reader may be following is written (see :mod:`fastckpt.io.commit_set`).
    One shard is ``model.safetensors`` (its rename publishes it), unless the published index
    names that file: then it gets a fresh name and an index."""
    if count == 1 and not (INDEX_NAME in referenced and WEIGHTS_NAME in referenced):
        return [WEIGHTS_NAME]
    names = [f"model-{i:05d}-of-{count:05d}" for i in range(1, count + 1)]
    if not referenced:
        return [name + ".safetensors" for name in names]
    return [commit_set.fresh_name(name, ".safetensors", referenced) for name in names]


def _belongs(name: str) -> bool:
    """Whether a file of a sharded directory is one that a sharded save writes."""
    return name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_PATTERN.fullmatch(name) is not None


def _index_bytes(
    shards: list[dict[str, torch.Tensor]], names: list[str], metadata: Mapping[str, str] | None
) -> bytes:
    """The index: every name (a tied tensor's too: its shard stores a copy under each name)
    and the bytes the shards hold."""
    total = sum(t.numel() * t.element_size() for tensors in shards for t in tensors.values())
    index = {
        "metadata": {**dict(metadata or {}), "total_size": total},
        "weight_map": {n: names[i] for i, tensors in enumerate(shards) for n in tensors},
    }
    return (json.dumps(index, indent=2, sort_keys=False) + "\n").encode()
