"""What the series commands (``ls``, ``clean``, ``prune``) read from a checkpoint series: the
copies of each step in each tier, committed or not, and the lock a manager holds on a tier.

A tier is read without a manager: ``fastckpt ls`` works beside a running training job. The
commands that delete (``clean``, ``prune``) take the tier's manager lock first, so they never
remove a save or a drain in progress.

Example:
    >>> import tempfile, os
    >>> from fastckpt.series import steps
    >>> tier = tempfile.mkdtemp()
    >>> os.makedirs(steps.step_dir(tier, 5))
    >>> [(c.step, c.committed) for c in tier_copies(tier, "root")]
    [(5, False)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from fastckpt.cli._common import USAGE, CliError

__all__ = ["StepCopy", "locked_tiers", "tier_copies", "tier_directory"]


@dataclasses.dataclass
class StepCopy:
    """One step's directory in one tier: committed (its marker is there) or a partial save,
    drain or deletion; its size in bytes and the metrics its marker records."""

    step: int
    tier: str  # "fast" or "root"
    directory: str
    committed: bool
    size: int
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    time: str | None = None

    @property
    def state_file(self) -> str:
        from fastckpt.series.steps import STATE_FILE

        return os.path.join(self.directory, STATE_FILE)


def tier_directory(option: str, path: str) -> str:
    """``path`` as an absolute directory, or a usage error (status 2) naming ``option``.

    Example:
        >>> try:
        ...     tier_directory("ROOT", "/no/such/run")
        ... except CliError as err:
        ...     print(err.status, err)
        2 ROOT /no/such/run: no such directory
    """
    if "://" in path:
        raise CliError(f"{option} {path}: the series commands take local directories", USAGE)
    if not os.path.isdir(path):
        what = "not a directory" if os.path.exists(path) else "no such directory"
        raise CliError(f"{option} {path}: {what}", USAGE)
    return os.path.abspath(path)


def tier_copies(tier: str, name: str) -> list[StepCopy]:
    """Every step directory of ``tier`` (committed or not), ascending by step."""
    from fastckpt.series import steps as layout  # here: `fastckpt --help` loads no I/O engine

    copies = []
    for step in layout.committed_steps(tier):
        try:
            marker = layout.marker_of(tier, step)
        except (OSError, ValueError):
            # A marker that cannot be read: the step cannot be restored either.
            copies.append(_partial(tier, name, step))
            continue
        files = marker.get("files") or {}
        copies.append(
            StepCopy(
                step=step,
                tier=name,
                directory=layout.step_dir(tier, step),
                committed=True,
                size=sum(int(v) for v in files.values()),
                metrics=dict(marker.get("metrics") or {}),
                time=marker.get("time"),
            )
        )
    for directory in layout.uncommitted_dirs(tier):
        step = int(os.path.basename(directory).split("-", 1)[1])
        copies.append(_partial(tier, name, step))
    return sorted(copies, key=lambda c: c.step)


def _partial(tier: str, name: str, step: int) -> StepCopy:
    from fastckpt.series import steps as layout

    directory = layout.step_dir(tier, step)
    return StepCopy(step, name, directory, committed=False, size=_bytes_under(directory))


def _bytes_under(directory: str) -> int:
    total = 0
    for folder, _, names in os.walk(directory):
        for file_name in names:
            with contextlib.suppress(OSError):  # removed meanwhile by its manager
                total += os.lstat(os.path.join(folder, file_name)).st_size
    return total


@contextlib.contextmanager
def locked_tiers(*tiers: str) -> Iterator[None]:
    """Holds the manager lock of each tier for the block: a running ``CheckpointManager``
    makes this a failure (status 1) instead of a race with its saves and drains.

    Example:
        >>> import tempfile
        >>> with locked_tiers(tempfile.mkdtemp()):
        ...     pass
    """
    # The manager's own lock (an exclusive flock on a file in the tier), so the two exclude
    # each other whichever starts first.
    from fastckpt.series.manager import _lock

    held: list[Any] = []
    try:
        for tier in tiers:
            try:
                held.append(_lock(tier))
            except RuntimeError as exc:
                raise CliError(f"{tier}: {exc}") from None
        yield
    finally:
        for fd in held:
            os.close(fd)
