"""The layout of a checkpoint series in one directory (a tier).

Each step is a directory ``step-<12 digits>`` holding the checkpoint (``state.safetensors``)
and, written last, atomically and durably, the commit marker ``COMMITTED`` (JSON: the step,
each file's size, the metrics, the time). A step without its marker does not exist: it is a
save that did not finish (or a deletion that did), removed by the next manager. Deleting a
step removes its marker first, so a crash mid-deletion leaves a step that no longer exists,
never a partial one that does.

Example:
    >>> import tempfile, os
    >>> tier = tempfile.mkdtemp()
    >>> os.makedirs(step_dir(tier, 7))
    >>> committed_steps(tier), uncommitted_dirs(tier) == [step_dir(tier, 7)]
    ([], True)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from typing import Any

from fastckpt.io.commit import fsync_directory, write_atomically

__all__ = [
    "MARKER",
    "STATE_FILE",
    "commit",
    "committed_steps",
    "marker_of",
    "remove_step",
    "step_dir",
    "uncommitted_dirs",
]

MARKER = "COMMITTED"
STATE_FILE = "state.safetensors"
_STEP = re.compile(r"step-(\d{12})")


def step_dir(tier: str, step: int) -> str:
    """The directory of ``step`` in ``tier``."""
    return os.path.join(tier, f"step-{step:012d}")


def _step_of(name: str) -> int | None:
    match = _STEP.fullmatch(name)
    return int(match.group(1)) if match else None


def committed_steps(tier: str) -> list[int]:
    """The steps of ``tier`` with a commit marker, ascending."""
    try:
        names = os.listdir(tier)
    except FileNotFoundError:
        return []
    steps = [_step_of(n) for n in names]
    return sorted(s for s in steps if s is not None and os.path.isfile(_marker_path(tier, s)))


def uncommitted_dirs(tier: str) -> list[str]:
    """Step directories of ``tier`` without a marker: saves or deletions cut short."""
    try:
        names = os.listdir(tier)
    except FileNotFoundError:
        return []
    return sorted(
        os.path.join(tier, n)
        for n in names
        if _step_of(n) is not None and not os.path.isfile(os.path.join(tier, n, MARKER))
    )


def _marker_path(tier: str, step: int) -> str:
    return os.path.join(step_dir(tier, step), MARKER)


def commit(tier: str, step: int, metrics: Mapping[str, float] | None) -> None:
    """Writes ``step``'s marker once its files are durable: the step exists from now on."""
    directory = step_dir(tier, step)
    files = {
        name: os.path.getsize(os.path.join(directory, name))
        for name in sorted(os.listdir(directory))
        if name != MARKER and not name.endswith(".tmp")
    }
    document = {
        "step": step,
        "files": files,
        "metrics": {k: float(v) for k, v in (metrics or {}).items()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_atomically(os.path.join(directory, MARKER), json.dumps(document).encode())
    fsync_directory(tier)


def marker_of(tier: str, step: int) -> dict[str, Any]:
    """The marker of a committed step (its files, metrics and time)."""
    with open(_marker_path(tier, step), encoding="utf-8") as f:
        document = json.load(f)
    if not isinstance(document, dict) or document.get("step") != step:
        raise ValueError(f"{_marker_path(tier, step)}: not the marker of step {step}")
    return document


def remove_step(tier: str, step: int) -> None:
    """Deletes a step: its marker first (durably), then its files."""
    directory = step_dir(tier, step)
    try:
        os.unlink(os.path.join(directory, MARKER))
        fsync_directory(directory)
    except FileNotFoundError:
        pass
    shutil.rmtree(directory, ignore_errors=True)
