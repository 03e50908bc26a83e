"""``fastckpt.load_into``: read a checkpoint's tensors straight into the memory of a model's
parameters and buffers (or of a state dict's tensors), with no arena in between.

Each destination that matches its stored tensor (same dtype and shape, contiguous, in CPU
memory) is filled by one ranged read into its own bytes
(:meth:`~fastckpt.Reader.read_range`), checksummed on the way when the file has checksums.
Others (another dtype, a strided view, a GPU tensor) are read into host memory and copied
with ``copy_``, converting as ``load_state_dict`` does. Keys are matched and shapes checked
before anything is read, so a mismatch changes nothing.

Example:
    >>> import torch
    >>> from fastckpt.checkpoint.read import open_checkpoint
    >>> from fastckpt.checkpoint.save import save
    >>> save(torch.nn.Linear(3, 2).state_dict(), "/tmp/fastckpt-into.safetensors")
    >>> model = torch.nn.Linear(3, 2)
    >>> with open_checkpoint("/tmp/fastckpt-into.safetensors") as r:
    ...     read_into(model, r)
    IncompatibleKeys(missing_keys=[], unexpected_keys=[])
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch

from fastckpt.checkpoint.reader import Reader

__all__ = ["IncompatibleKeys", "match_keys", "read_into"]


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` returns: names the destination has that the checkpoint does
    not, and names the checkpoint has that the destination does not."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _destination(target: Any) -> tuple[dict[str, torch.Tensor], str]:
    if isinstance(target, torch.nn.Module):
        # keep_vars: the parameters themselves; their memory is what gets filled
        return dict(target.state_dict(keep_vars=True)), type(target).__name__
    if isinstance(target, Mapping):
        for name, t in target.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"model_or_state_dict: entry {name!r} is a {type(t).__name__}, not a tensor"
                )
        return dict(target), "state_dict"
    raise TypeError(
        "model_or_state_dict must be a torch.nn.Module or a dict of tensors, got "
        f"{type(target).__name__}"
    )


def _direct(dest: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the stored bytes can land in ``dest``'s memory as they are."""
    return dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous()


def match_keys(
    model_or_state_dict: Any, reader: Reader, *, strict: bool = True
) -> tuple[dict[str, torch.Tensor], list[str], IncompatibleKeys]:
    """The destination tensors by name, the names both sides have (to be filled), and the
    missing and unexpected keys; raises before anything is read when ``strict`` and keys
    differ, or when a shape differs (the checks of :func:`read_into`, also used by the
    shared load of :mod:`fastckpt.distributed`).

    Example:
        >>> import torch
        >>> from fastckpt.checkpoint.read import open_checkpoint
        >>> from fastckpt.checkpoint.save import save
        >>> save({"weight": torch.ones(2, 3)}, "/tmp/fastckpt-match.safetensors")
        >>> with open_checkpoint("/tmp/fastckpt-match.safetensors") as r:
        ...     _, shared, keys = match_keys(torch.nn.Linear(3, 2), r, strict=False)
        >>> shared, keys.missing_keys
        (['weight'], ['bias'])
    """
    dest, what = _destination(model_or_state_dict)
    stored = set(reader.keys())
    missing = [name for name in dest if name not in stored]
    unexpected = [name for name in reader.keys() if name not in dest]
    problems = []
    if strict and unexpected:
        problems.append("Unexpected key(s) in state_dict: " + ", ".join(map(repr, unexpected)))
    if strict and missing:
        problems.append("Missing key(s) in state_dict: " + ", ".join(map(repr, missing)))
    shared = [name for name in dest if name in stored]
    for name in shared:
        info = reader.info(name)
        if tuple(dest[name].shape) != tuple(info.shape):
            problems.append(
                f"size mismatch for {name}: copying a param with shape {tuple(info.shape)} "
                f"from checkpoint {reader.path}, the shape in current model is "
                f"{tuple(dest[name].shape)}"
            )
    if problems:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {what}:\n\t" + "\n\t".join(problems)
        )
    return dest, shared, IncompatibleKeys(missing, unexpected)


def read_into(
    model_or_state_dict: Any,
    reader: Reader,
    *,
    strict: bool = True,
    verify: bool | None = None,
) -> IncompatibleKeys:
    """Fills the tensors of ``model_or_state_dict`` from ``reader`` (see the module's
    description); returns the missing and unexpected keys, as ``load_state_dict`` does.

    Raises:
        RuntimeError: ``strict`` and keys differ, or a shape differs (nothing is read then).
        TypeError: ``model_or_state_dict`` is not a module or a dict of tensors.
        ChecksumError: a tensor read does not match its checksum.
    """
    dest, shared, keys = match_keys(model_or_state_dict, reader, strict=strict)
    missing, unexpected = keys
    check = reader.has_checksums if verify is None else verify
    reader.require_checksums(check)
    done: set[tuple[Any, ...]] = set()  # tied tensors: one memory, read once
    with torch.no_grad():
        for name in shared:
            target = dest[name]
            info = reader.info(name)
            key = (target.device, target.data_ptr(), target.dtype, tuple(target.stride()))
            if target.numel() == 0 or key in done:
                continue
            done.add(key)
            if _direct(target, info.dtype):
                reader.read_range(name, 0, info.nbytes, out=target.detach(), verify=check)
            else:
                target.copy_(reader.get_tensor(name, verify=check))
    return IncompatibleKeys(missing, unexpected)
