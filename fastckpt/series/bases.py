"""The steps an incremental step needs, and whether a step's own file is damaged.

An incremental step's ``state.safetensors`` refers to tensors in earlier steps' files of the
same tier (``../step-<12 digits>/state.safetensors``, see :mod:`fastckpt.checkpoint.incremental`).
:func:`needed_steps` opens the step's file and its whole chain (headers only; every reference
is checked) and names the steps of the tier holding those files: retention keeps them while it
keeps the step, and a drained copy is accepted only when they resolve inside the target tier.
:func:`own_damage` checks the step's own file alone (its header and the CRC32C of the tensors
it holds), which tells a damaged step from one whose base is missing or damaged.

Example:
    >>> import os, tempfile, torch
    >>> from fastckpt.checkpoint.save import save
    >>> from fastckpt.series import steps
    >>> tier = tempfile.mkdtemp()
    >>> for step in (1, 2):
    ...     os.makedirs(steps.step_dir(tier, step))
    >>> first = os.path.join(steps.step_dir(tier, 1), steps.STATE_FILE)
    >>> save({"a": torch.ones(64), "b": torch.zeros(2)}, first)
    >>> second = os.path.join(steps.step_dir(tier, 2), steps.STATE_FILE)
    >>> save({"a": torch.ones(64), "b": torch.ones(2)}, second, base=first)
    >>> needed_steps(tier, 2), needed_steps(tier, 1), own_damage(tier, 2)
    ([1], [], None)
"""

from __future__ import annotations

import os
import re

from fastckpt.checkpoint.chained_reader import files_of
from fastckpt.checkpoint.read import CheckpointReader, open_checkpoint
from fastckpt.errors import ChecksumError, HeaderError
from fastckpt.series import steps as layout
from fastckpt.series.steps import Tier
from fastckpt.storage import is_url

__all__ = ["needed_steps", "own_damage", "step_of_file"]

_STATE = re.compile(r"step-(\d{12})/" + re.escape(layout.STATE_FILE))


def _tier(tier: Tier | str) -> Tier:
    return tier if isinstance(tier, Tier) else Tier(os.fspath(tier))


def _state_file(tier: Tier, step: int) -> str:
    return layout.join(layout.step_dir(tier, step), layout.STATE_FILE)


def step_of_file(tier: Tier | str, path: str) -> int | None:
    """The step whose ``state.safetensors`` ``path`` is in ``tier``, or None (another file).

    Example:
        >>> step_of_file(Tier("/run"), "/run/step-000000000007/state.safetensors")
        7
        >>> step_of_file(Tier("/run"), "/elsewhere/step-000000000007/state.safetensors") is None
        True
    """
    tier = _tier(tier)
    if is_url(path) != tier.is_url:
        return None
    if tier.is_url:
        prefix = tier.location + "/"
        relative = path[len(prefix) :] if path.startswith(prefix) else None
    else:
        relative = os.path.relpath(os.path.abspath(path), tier.location)
    match = _STATE.fullmatch(relative.replace(os.sep, "/")) if relative else None
    return int(match.group(1)) if match else None


def needed_steps(tier: Tier | str, step: int) -> list[int]:
    """The steps of ``tier`` whose files the single-file step ``step`` needs besides its
    own (its whole chain), ascending; ``[]`` for a full step.

    Raises:
        MissingBaseError: a file it needs is missing (named).
        HeaderError: a file it needs is not a step's state file in ``tier`` (the reference
            resolves outside the tier); or a reference is broken.
        ChecksumError: a base records another hash than the reference.
    """
    tier = _tier(tier)
    path = _state_file(tier, step)
    with open_checkpoint(path, storage_options=tier.storage_options) as reader:
        own = reader.path if is_url(reader.path) else os.path.abspath(reader.path)
        files = sorted(files_of(reader) - {own})
    needed = []
    for file in files:
        found = step_of_file(tier, file)
        if found is None:
            raise HeaderError(f"{path} needs {file}, which is not a step of {tier}")
        needed.append(found)
    return sorted(set(needed))


def own_damage(tier: Tier | str, step: int) -> str | None:
    """Why the single-file step ``step``'s own ``state.safetensors`` is damaged (its header
    does not decode, or tensors it holds fail their CRC32C), or None when it verifies
    (its bases are not read). A file that cannot be reached (an I/O error) is not called
    damaged: the error is raised.
    """
    tier = _tier(tier)
    path = _state_file(tier, step)
    try:
        with CheckpointReader(path, storage_options=tier.storage_options) as reader:
            if not reader.has_checksums:
                return None
            bad = reader.verify()
    except FileNotFoundError:
        return f"{path} is missing"
    except (HeaderError, ChecksumError) as exc:
        return str(exc)
    return f"{path}: damaged tensors {bad}" if bad else None
