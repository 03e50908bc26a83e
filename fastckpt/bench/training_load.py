"""A training-like CPU load beside a measurement: what a checkpoint load competes with.

A training job keeps every core busy while a checkpoint is loaded or saved (data loading,
the optimizer, the host side of the model). :class:`TrainingLoad` starts ``n`` processes
that each multiply float32 matrices with one torch thread, in a loop, until stopped; they
start before the first measurement and run through every one, so the load average settles
at about ``n`` plus the measurement's own threads.

Example:
    >>> with TrainingLoad(1, matrix=64) as busy:
    ...     busy.running()
    1
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

__all__ = ["TrainingLoad", "load_average", "uptime_line"]


def _spin(matrix: int, stop: Any) -> None:
    """One busy process: float32 matmuls on one thread until ``stop`` is set."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(matrix, matrix)
    b = torch.randn(matrix, matrix)
    while not stop.is_set():
        for _ in range(8):
            a = torch.tanh(a @ b)  # tanh keeps the values bounded, as an activation does


class TrainingLoad:
    """``n`` processes multiplying ``matrix`` x ``matrix`` float32 matrices on one thread
    each, from ``start()`` (or entering a ``with``) until ``stop()``.

    Args:
        n: processes; 0 starts none (a quiet machine).
        matrix: the matrices' side (256: about 1 ms per product on one core, in cache, as
            a small layer's forward is).
    """

    def __init__(self, n: int, *, matrix: int = 256) -> None:
        if n < 0:
            raise ValueError(f"n must be 0 or more, got {n}")
        self.n, self.matrix = n, matrix
        self._context = multiprocessing.get_context("spawn")
        self._stop = self._context.Event()
        self._procs: list[Any] = []

    def start(self, *, settle: float = 0.5) -> TrainingLoad:
        """Starts the processes and waits ``settle`` seconds for them to import torch."""
        for _ in range(self.n):
            proc = self._context.Process(
                target=_spin, args=(self.matrix, self._stop), name="training-load", daemon=True
            )
            proc.start()
            self._procs.append(proc)
        if self._procs and settle > 0:
            time.sleep(settle)
        return self

    def running(self) -> int:
        """How many of the processes are alive."""
        return sum(p.is_alive() for p in self._procs)

    def stop(self) -> None:
        """Stops the processes and waits for them: they hold nothing worth a clean exit, and
        one still importing torch would take seconds to see the event."""
        self._stop.set()
        for proc in self._procs:
            proc.terminate()  # ours, by its own id
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs.clear()

    def __enter__(self) -> TrainingLoad:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()


def load_average() -> tuple[float, float, float]:
    """The 1-, 5- and 15-minute load averages.

    Example:
        >>> len(load_average())
        3
    """
    one, five, fifteen = os.getloadavg()
    return one, five, fifteen


def uptime_line() -> str:
    """``uptime``'s load averages as one line, for a benchmark's record.

    Example:
        >>> uptime_line().startswith("load average: ")
        True
    """
    return "load average: " + ", ".join(f"{v:.2f}" for v in load_average())
