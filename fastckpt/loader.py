"""``fastckpt.load``: read a checkpoint back into the object that was saved."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence, Union

import torch

from fastckpt import tree
from fastckpt.reader import CheckpointReader

__all__ = ["load", "resolve_device"]

MapLocation = Union[None, str, torch.device, Mapping[str, Any], Callable[..., Any]]

# Reading CRC32Cs costs little (they are checked while later pieces are still being read),
# so loads verify by default when the file has checksums. See the README's benchmark.
VERIFY_DEFAULT = True


def resolve_device(
    map_location: MapLocation, device: str | torch.device | None
) -> torch.device | Callable[..., Any]:
    """The target device from ``torch.load``-style ``map_location`` or ``device``.

    A file records no device, so a dict ``map_location`` maps from ``"cpu"`` (what every
    tensor is read into first); ``{"cuda:0": "cpu"}`` therefore loads on the CPU.

    Example:
        >>> resolve_device(None, None)
        device(type='cpu')
        >>> resolve_device({"cuda:1": "cpu"}, None)
        device(type='cpu')
    """
    if device is not None and map_location is not None:
        raise ValueError("pass either map_location or device, not both")
    where = device if device is not None else map_location
    if where is None:
        return torch.device("cpu")
    if isinstance(where, (str, torch.device)):
        return torch.device(where)
    if isinstance(where, Mapping):
        return torch.device(where.get("cpu", "cpu"))
    if callable(where):
        return where
    raise TypeError(
        f"map_location must be a str, torch.device, dict or callable, got {type(where).__name__}"
    )


def _apply_callable(fn: Callable[..., Any], t: torch.Tensor) -> torch.Tensor:
    """``torch.load``'s ``map_location(storage, location)`` applied to one tensor."""
    result = fn(t.untyped_storage(), "cpu")
    if result is None or not hasattr(result, "device") or result.device == t.device:
        return t
    return t.to(result.device)


def load(
    f: str | os.PathLike[str],
    map_location: MapLocation = None,
    *,
    device: str | torch.device | None = None,
    pin_memory: bool = False,
    weights_only: bool = True,
    keys: Sequence[str] | None = None,
    verify: bool | None = None,
    progress: bool | None = None,
    gds: bool | None = None,
    engine: str | None = None,
    block_size: int | None = None,
    queue_depth: int | None = None,
    intra_op_parallelism: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Loads what :func:`fastckpt.save` saved, or any safetensors file (as a flat dict).

    The data section is read with parallel direct I/O into one page-aligned arena
    (page-locked with ``pin_memory=True``); the returned tensors are views into it.

    Args:
        map_location: as ``torch.load``'s: a device string or ``torch.device``, a dict
            (mapping ``"cpu"``), or a callable ``(storage, location) -> storage``.
        device: the target device; an alternative spelling of ``map_location``.
        pin_memory: page-lock the arena (faster copies to a GPU later).
        weights_only: refuse to unpickle objects saved with ``allow_pickle=True``
            (raises ``fastckpt.WeightsOnlyError``); pass False only for trusted files.
        keys: load only these tensors (reading only their bytes); returns a flat
            ``name -> tensor`` dict. For nested checkpoints names look like ``"model/fc.weight"``
            (see ``fastckpt.open(f).keys()``).
        verify: check every tensor's CRC32C (``ChecksumError`` names a damaged one). Default:
            on when the file has checksums.
        progress: show a progress bar (default: on a terminal).
        gds: loading to CUDA, read with GPUDirect Storage straight into GPU memory
            (``True``: GDS or ``EngineUnavailableError``; default: when ``FASTCKPT_GDS=1``
            and GDS runs here). Otherwise disk reads into page-locked staging buffers
            overlap the copies to the GPU.
        storage_options: for a URL, passed to its fsspec file system. ``f`` may also be a
            sharded directory or its ``*.index.json`` (Hugging Face convention).

    Raises:
        FileNotFoundError: no such file (an ``OSError`` with errno and filename).
        HeaderError: not a valid safetensors file (the message says what and where).
        ChecksumError: a tensor's bytes do not match its checksum.
        KeyError: a name in ``keys`` is not in the file.

    Example:
        >>> import torch, fastckpt
        >>> opt_state = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
        >>> fastckpt.save(opt_state, "/tmp/fastckpt-load.safetensors")
        >>> back = fastckpt.load("/tmp/fastckpt-load.safetensors")
        >>> back["param_groups"][0]["lr"], list(back["state"])
        (0.1, [0])
    """
    arguments = dict(locals())  # exactly the parameters, handed on as they are
    from fastckpt.integrations import remote  # lazy: it imports this module

    if remote.routed(f):  # URLs and sharded directories
        return remote.route_load(**arguments)
    target = resolve_device(map_location, device)
    if keys is not None and (isinstance(keys, str) or not isinstance(keys, Sequence)):
        raise TypeError("keys must be a list of tensor names")
    on_cuda = isinstance(target, torch.device) and target.type == "cuda"
    with CheckpointReader(
        f,
        device=target if on_cuda else "cpu",
        gds=gds,
        engine=engine,
        block_size=block_size,
        queue_depth=queue_depth,
        intra_op_parallelism=intra_op_parallelism,
    ) as reader:
        check = reader.has_checksums and (VERIFY_DEFAULT if verify is None else verify)
        if verify and not reader.has_checksums:
            from fastckpt.errors import ChecksumError

            raise ChecksumError(f"{reader.path} has no checksums to verify", filename=reader.path)
        stored = reader.read(
            None if keys is None else list(keys),
            pin_memory=pin_memory,
            verify=check,
            progress=progress,
        )
        if isinstance(target, torch.device) and target.type not in ("cpu", "cuda"):
            stored = _to_device(stored, target)
        elif callable(target) and not isinstance(target, torch.device):
            stored = {name: _apply_callable(target, t) for name, t in stored.items()}
        aliases = reader.meta.aliases
        if keys is not None:
            return {k: stored[aliases.get(k, k)] for k in keys}
        return tree.unflatten(reader.meta.tree, stored, aliases, weights_only=weights_only)


def _to_device(tensors: dict[str, torch.Tensor], target: torch.device) -> dict[str, torch.Tensor]:
    if target.type == "meta":
        return {name: t.to("meta") for name, t in tensors.items()}
    raise ValueError(f"device {target} is not supported (use 'cpu' or 'cuda[:N]')")
