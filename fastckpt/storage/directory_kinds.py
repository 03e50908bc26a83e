"""What a local directory that is not a single checkpoint holds, and what reads it: a
torch.distributed.checkpoint (DCP) checkpoint, a checkpoint series (the root of a
``CheckpointManager``) or one step of a series.

``fastckpt.load`` of such a directory and the commands (``inspect``, ``verify``) say so with
this one function instead of "no model.safetensors". The names are spelled here (a test keeps
them equal to :mod:`fastckpt.series.steps`' and the DCP integration's) because both of those
sit above this layer, and the DCP package imports torch.distributed.checkpoint (seconds).

Example:
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> step = os.path.join(root, "step-000000000014")
    >>> os.makedirs(step)
    >>> for name in ("state.safetensors", "COMMITTED"):
    ...     open(os.path.join(step, name), "wb").close()
    >>> directory_kind(root).kind, directory_kind(step).kind, directory_kind(tempfile.mkdtemp())
    ('series', 'step', None)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = [
    "DCP_METADATA",
    "DirectoryKind",
    "SERIES_MARKER",
    "STEP_DIRECTORY",
    "STEP_STATE_FILE",
    "directory_kind",
]

#: The file that makes a directory a DCP checkpoint (the DCP integration's ``METADATA_FILE``).
DCP_METADATA = ".metadata"
#: A series step's commit marker (:data:`fastckpt.series.steps.MARKER`).
SERIES_MARKER = "COMMITTED"
#: The checkpoint of a single-file step (:data:`fastckpt.series.steps.STATE_FILE`).
STEP_STATE_FILE = "state.safetensors"
#: A step directory's name: ``step-`` and 12 ASCII digits (as :mod:`fastckpt.series.steps`).
STEP_DIRECTORY = re.compile(r"step-([0-9]{12})", re.ASCII)


@dataclass(frozen=True)
class DirectoryKind:
    """``kind`` is ``"dcp"``, ``"series"`` or ``"step"``; ``what`` describes the directory and
    ``read_with`` is the Python that reads it.

    Example:
        >>> print(DirectoryKind("dcp", "a DCP checkpoint", "fastckpt.dcp.load_full('d')").message)
        a DCP checkpoint; read it with fastckpt.dcp.load_full('d')
    """

    kind: str
    what: str
    read_with: str

    @property
    def message(self) -> str:
        """What the directory is and what reads it, in one phrase."""
        return f"{self.what}; read it with {self.read_with}"


def _isfile(directory: str, name: str) -> bool:
    return os.path.isfile(os.path.join(directory, name))


def _step_kind(directory: str, step: int) -> DirectoryKind:
    """The kind of a step directory ``directory`` (``step-<12 digits>``) of a series."""
    root = os.path.dirname(os.path.abspath(directory))
    restore = f"fastckpt.CheckpointManager({root!r}).restore(step={step})"
    if not _isfile(directory, SERIES_MARKER):
        what = (
            f"step {step} of a checkpoint series, not committed (no {SERIES_MARKER} marker: a "
            "save that did not finish, which the series ignores)"
        )
        return DirectoryKind("step", what, f"{restore} for a committed step")
    if _isfile(directory, DCP_METADATA):
        what = f"step {step} of a checkpoint series, saved by several ranks (a DCP checkpoint)"
        return DirectoryKind(
            "step", what, f"{restore} or fastckpt.dcp.load_full({os.fspath(directory)!r})"
        )
    state = os.path.join(directory, STEP_STATE_FILE)
    what = f"step {step} of a checkpoint series, in one file ({STEP_STATE_FILE})"
    return DirectoryKind("step", what, f"{restore} or fastckpt.load({state!r})")


def _step_names(directory: str) -> list[str]:
    """The ``step-<12 digits>`` directories directly inside ``directory``, sorted."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [n for n in names if STEP_DIRECTORY.fullmatch(n)]
    return sorted(n for n in found if os.path.isdir(os.path.join(directory, n)))


def directory_kind(path: str | os.PathLike[str]) -> DirectoryKind | None:
    """What the local directory ``path`` is when it is a DCP checkpoint (``.metadata`` and
    rank files), a checkpoint series' root (``step-<12 digits>`` directories) or a step of a
    series; None for anything else (a plain or missing directory, a URL).

    Only the names are looked at (no file is read): this is what an error message says.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> open(os.path.join(folder, ".metadata"), "wb").close()
        >>> print(directory_kind(folder).message.replace(folder, "ckpt"))
        a torch.distributed.checkpoint (DCP) checkpoint (.metadata and rank files); read it with fastckpt.dcp.load_full('ckpt')
    """
    directory = os.fspath(path)
    if "://" in directory or not os.path.isdir(directory):
        return None
    match = STEP_DIRECTORY.fullmatch(os.path.basename(os.path.normpath(directory)))
    if match is not None:
        return _step_kind(directory, int(match.group(1)))
    if _isfile(directory, DCP_METADATA):
        what = "a torch.distributed.checkpoint (DCP) checkpoint (.metadata and rank files)"
        return DirectoryKind("dcp", what, f"fastckpt.dcp.load_full({directory!r})")
    steps = _step_names(directory)
    if not steps:
        return None
    committed = [n for n in steps if _isfile(os.path.join(directory, n), SERIES_MARKER)]
    held = (
        f"{len(committed)} committed step{'' if len(committed) == 1 else 's'}, the newest "
        f"{committed[-1]}"
        if committed
        else f"{len(steps)} step directories, none committed"
    )
    what = f"the root of a checkpoint series ({held})"
    return DirectoryKind("series", what, f"fastckpt.CheckpointManager({directory!r}).restore()")
