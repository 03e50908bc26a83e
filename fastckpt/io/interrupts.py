"""Waiting for work in flight so that an interrupt cannot orphan it.

Ctrl-C (``KeyboardInterrupt``) and ``SystemExit`` are raised in the main thread wherever
it waits. A wait that they cut short leaves its transfer running on a worker thread, still
using a file descriptor and memory the caller then releases: the descriptor's number is
reused by the next file opened, and the transfer writes into that file. These helpers
keep waiting until the work is over, then hand the interrupt on.

Example:
    >>> import concurrent.futures
    >>> with concurrent.futures.ThreadPoolExecutor(1) as pool:
    ...     future = pool.submit(sum, [1, 2, 3])
    ...     result_when_done(future)
    6
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Iterable

__all__ = ["wait_through_interrupts", "result_when_done"]


def wait_through_interrupts(
    futures: Iterable[concurrent.futures.Future[Any]],
) -> BaseException | None:
    """Blocks until every future is done, whatever is raised meanwhile; returns the first
    interrupt raised during the wait (None if none), for the caller to raise once it has
    released what the work used."""
    pending = list(futures)
    interrupt: BaseException | None = None
    while True:
        try:
            concurrent.futures.wait(pending)
            return interrupt
        except BaseException as exc:  # noqa: BLE001 - kept and handed to the caller
            if interrupt is None:
                interrupt = exc


def result_when_done(future: concurrent.futures.Future[Any]) -> Any:
    """``future.result()``, except that an interrupt meanwhile is raised only once the work
    is over (and takes precedence over the work's own error)."""
    interrupt = wait_through_interrupts([future])
    if interrupt is not None:
        raise interrupt
    return future.result()
