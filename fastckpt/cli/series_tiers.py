"""What the series commands (``ls``, ``clean``, ``prune``) read from a checkpoint series: the
copies of each step in each tier, committed or not, and the lock a manager holds on a tier.

A tier is a local directory or a URL (``s3://bucket/run``; credentials and endpoint from
``FASTCKPT_STORAGE_OPTIONS`` or the environment, as for every URL the command line takes).
It is read without a manager: ``fastckpt ls`` works beside a running training job. The
commands that delete (``clean``, ``prune``) take the tier's manager lock (or lease, at a URL)
first, so they never remove a save or a drain in progress.

Example:
    >>> import tempfile, os
    >>> from fastckpt.series import steps
    >>> tier = tier_location("ROOT", tempfile.mkdtemp())
    >>> os.makedirs(steps.step_dir(tier, 5))
    >>> [(c.step, c.committed) for c in tier_copies(tier, "root")]
    [(5, False)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastckpt.cli._common import USAGE, CliError

if TYPE_CHECKING:
    from fastckpt.series.steps import Tier

__all__ = ["StepCopy", "locked_tiers", "tier_copies", "tier_location"]


@dataclasses.dataclass
class StepCopy:
    """One step's directory in one tier: committed (its marker is there) or a partial save,
    drain or deletion; its size in bytes, its layout (``file``: one ``state.safetensors``;
    ``dcp``: a multi-rank DCP checkpoint) and the metrics its marker records."""

    step: int
    tier: str  # "fast" or "root"
    directory: str
    committed: bool
    size: int
    layout: str = "file"
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    time: str | None = None

    @property
    def checkpoint(self) -> str:
        """What ``fastckpt verify`` checks: the state file, or the DCP step's directory."""
        from fastckpt.series.steps import FILE_LAYOUT, STATE_FILE, join

        return join(self.directory, STATE_FILE) if self.layout == FILE_LAYOUT else self.directory


def tier_location(option: str, path: str) -> Tier:
    """``path`` as a tier (a local directory made absolute, or a URL), or a usage error
    (status 2) naming ``option`` when a local directory does not exist.

    Example:
        >>> try:
        ...     tier_location("ROOT", "/no/such/run")
        ... except CliError as err:
        ...     print(err.status, err)
        2 ROOT /no/such/run: no such directory
    """
    from fastckpt.series.steps import Tier  # here: `fastckpt --help` loads no I/O engine

    tier = Tier(path)
    if not tier.is_url and not os.path.isdir(tier.location):
        what = "not a directory" if os.path.exists(tier.location) else "no such directory"
        raise CliError(f"{option} {path}: {what}", USAGE)
    return tier


def tier_copies(tier: Tier | str, name: str) -> list[StepCopy]:
    """Every step of ``tier`` with files (committed or not), ascending by step."""
    from fastckpt.series import steps as layout

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
                layout=str(marker.get("layout") or layout.FILE_LAYOUT),
                metrics=dict(marker.get("metrics") or {}),
                time=marker.get("time"),
            )
        )
    copies += [_partial(tier, name, step) for step in layout.uncommitted_steps(tier)]
    return sorted(copies, key=lambda c: c.step)


def _partial(tier: Tier | str, name: str, step: int) -> StepCopy:
    from fastckpt.series import steps as layout

    try:
        size = sum(layout.step_files(tier, step).values())
    except OSError:  # removed meanwhile by its manager
        size = 0
    return StepCopy(step, name, layout.step_dir(tier, step), committed=False, size=size)


@contextlib.contextmanager
def locked_tiers(*tiers: Tier) -> Iterator[None]:
    """Holds each tier's manager lock (a ``flock`` locally, the lease object at a URL) for the
    block: a running ``CheckpointManager`` makes this a failure (status 1) instead of a race
    with its saves and drains.

    Example:
        >>> import tempfile
        >>> with locked_tiers(tier_location("ROOT", tempfile.mkdtemp())):
        ...     pass
    """
    from fastckpt.series.lease import LocalLock, UrlLease

    held: list[Any] = []
    try:
        for tier in tiers:
            try:
                if tier.is_url:
                    held.append(UrlLease(tier.location, tier.storage_options))
                else:
                    held.append(LocalLock(tier.location))
            except RuntimeError as exc:
                raise CliError(str(exc)) from None
        yield
    finally:
        for lock in held:
            lock.release()
