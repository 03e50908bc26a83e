"""The newest step every rank can restore, agreed while ranks save at their own pace.

With per-rank managers (``CheckpointManager(replicas=k)``: each rank saves its own steps to
its own tiers), each rank's retention alone could keep three steps on every rank and yet no
step that every rank holds, and a restore, which needs one step on every rank, would find
none. So after each commit a rank reports the steps it can restore (its own tiers), and once
every rank has reported, each takes the newest step all hold and keeps it from retention
until a newer one is agreed. The steps a rank reported are kept until the round ends (a
step deleted between the report and the answer could be the one agreed on).

Rounds run on a thread and a gloo group of their own: a rank's report waits for the other
ranks' next commits, never blocking a save. A rank that closes ends every rank's rounds.

Example (one process: no rounds, the steps themselves are common):
    >>> newest_common([[1, 2, 3], [2, 3, 4]]), newest_common([[1], [2]])
    (3, None)
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Sequence

import torch

__all__ = ["CommonStep", "newest_common"]

_log = logging.getLogger("fastckpt")


def newest_common(reports: Sequence[Sequence[int]]) -> int | None:
    """The newest step in every report, or None."""
    common = set(reports[0]) if reports else set()
    for report in reports[1:]:
        common &= set(report)
    return max(common, default=None)


class CommonStep:
    """Agrees, after each commit, on the newest step every rank can restore (see the module's
    description). Made collectively, by every rank in the same order.

    Args:
        restorable: this rank's restorable steps (its tiers' committed steps).
        pin: keeps the given steps from retention until ``unpin`` (a round's report).
        unpin: releases what ``pin`` kept.
        agreed: called with each step every rank holds (kept until the next one).
        timeout_seconds: how long a round waits for the other ranks' next commit.
    """

    def __init__(
        self,
        restorable: Callable[[], list[int]],
        pin: Callable[[list[int]], None],
        unpin: Callable[[list[int]], None],
        agreed: Callable[[int], None],
        timeout_seconds: float = 1800.0,
    ):
        self._restorable, self._pin, self._unpin, self._agreed = restorable, pin, unpin, agreed
        dist = torch.distributed
        # made here, in the foreground, by every rank in the same order (never in a thread)
        self._group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds)
        )
        self._world = dist.get_world_size()
        self._wake = threading.Condition()
        self._report: list[int] | None = None  # taken, pinned, not yet sent
        self._busy = False  # a round is under way
        self._news = False  # a commit came during the round
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fastckpt-common-step", daemon=True)
        self._thread.start()

    def report(self) -> None:
        """After a commit: this rank's restorable steps go into the next round, pinned now
        (so no retention that follows the commit removes one before the round)."""
        with self._wake:
            if self._stopping or self._thread is None:
                return
            if self._busy or self._report is not None:
                self._news = True  # reported again once the round ends
                return
            self._take_report()

    def _take_report(self) -> None:
        try:
            steps = sorted(self._restorable())
        except OSError as exc:  # a listing failed: this commit is reported with the next
            _log.warning("this rank's steps could not be listed for the ranks: %s", exc)
            return
        self._pin(steps)
        self._report = steps
        self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._report is None and not self._stopping:
                    self._wake.wait()
                mine = None if self._stopping else self._report
                self._busy = True
            every: list[list[int] | None] = [None] * self._world
            try:
                torch.distributed.all_gather_object(every, mine, group=self._group)
            except Exception as exc:  # a rank died, or never committed again in time
                _log.error("the ranks stopped agreeing on a common step: %s", exc)
                self._end(mine)
                return
            if any(report is None for report in every):  # a rank closed: every rank stops
                self._end(mine)
                return
            common = newest_common([r for r in every if r is not None])
            if common is not None:
                self._agreed(common)
            else:
                _log.warning("no step is held by every rank yet (each rank's steps: %s)", every)
            with self._wake:
                self._unpin(mine or [])
                self._busy, self._report = False, None
                if self._news and not self._stopping:
                    self._news = False
                    self._take_report()

    def _end(self, mine: list[int] | None) -> None:
        with self._wake:
            self._stopping = True
            self._busy = False
            if self._report is not None:
                self._unpin(self._report)
                self._report = None

    def close(self, timeout: float | None = None) -> None:
        """Stops the rounds (every rank's, at their next round)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)
