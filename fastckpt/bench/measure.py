"""Timing a section: wall and CPU seconds (every thread), peak RSS, busy threads.

Example:
    >>> with Measure() as m:
    ...     _ = bytearray(8 << 20)
    >>> m.seconds >= 0 and m.cpu_seconds >= 0
    True
"""

from __future__ import annotations

import gc
import mmap
import os
import resource
import threading
import time
from typing import Any, TypeVar

from fastckpt.bench.units import KiB

__all__ = [
    "AnonymousPeak",
    "Measure",
    "ThreadSampler",
    "anonymous_rss",
    "cpu_seconds",
    "current_rss",
    "peak_rss",
    "reset_peak_rss",
]

PAGE = mmap.PAGESIZE


def current_rss() -> int:
    """This process's resident set size in bytes."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * PAGE


def anonymous_rss() -> int:
    """The anonymous part of this process's RSS in bytes (``RssAnon``: its own allocations,
    not the file and shared-memory pages it maps, such as a tmpfs file's)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * KiB
    return 0


def peak_rss() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB


def reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark (``echo 5 > /proc/self/clear_refs``), so the peak
    describes one timed section; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, every thread (native I/O threads too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Measure:
    """Times a section: wall seconds, CPU seconds (all threads), peak RSS above the entry RSS.

    Example:
        >>> with Measure() as m:
        ...     _ = bytearray(8 << 20)
        >>> sorted(m.as_dict())[:3]
        ['cpu_seconds', 'extra_rss', 'peak_rss']
    """

    def __enter__(self) -> Measure:
        gc.collect()
        self.peak_was_reset = reset_peak_rss()
        self.rss_before = current_rss()
        self._cpu0 = cpu_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = cpu_seconds() - self._cpu0
        self.peak = peak_rss()
        self.extra_rss = max(0, self.peak - self.rss_before)

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "rss_before": self.rss_before,
            "peak_rss": self.peak,
            "extra_rss": self.extra_rss,
            "peak_was_reset": self.peak_was_reset,
        }


_S = TypeVar("_S", bound="_Sampler")


class _Sampler:
    """Calls :meth:`_sample` every ``interval`` seconds on a thread of its own while in its
    ``with`` block (and once more on leaving it, where :attr:`_last_sample` says so)."""

    _last_sample = True

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()

    def _sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self: _S) -> _S:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._last_sample:
            self._sample()


class ThreadSampler(_Sampler):
    """Counts, every ``interval`` seconds, this process's threads that are running or waiting
    on the device (state R or D in ``/proc/self/task/*/stat``), its own thread left out.

    ``streams`` is the mean count over the samples: how many independent streams of work a
    section keeps busy. Sampling costs a little CPU, so use it outside timed sections.

    Example:
        >>> with ThreadSampler() as s:
        ...     sum(range(3_000_000)) > 0
        True
        >>> s.samples > 0 and s.streams >= 0
        True
    """

    _last_sample = False  # (it would count the thread leaving the block)

    def __init__(self, interval: float = 0.002) -> None:
        super().__init__(interval)
        self.samples = 0
        self.busy_total = 0
        self.busy_max = 0
        self._own = 0

    def _count(self, own: int) -> int:
        busy = 0
        for tid in os.listdir("/proc/self/task"):
            if int(tid) == own:
                continue
            try:
                with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue  # the thread ended meanwhile
            busy += state in ("R", "D")
        return busy

    def _sample(self) -> None:
        if not self._own:
            self._own = threading.get_native_id()  # the sampling thread itself
        busy = self._count(self._own)
        self.samples += 1
        self.busy_total += busy
        self.busy_max = max(self.busy_max, busy)

    @property
    def streams(self) -> float:
        return self.busy_total / self.samples if self.samples else 0.0


class AnonymousPeak(_Sampler):
    """Samples :func:`anonymous_rss` every ``interval`` seconds in a thread: ``extra`` is its
    peak above its value on entry. The kernel keeps no peak of it; a sampled peak may miss a
    spike shorter than ``interval``.

    Other threads that free memory meanwhile lower it: measure in a process of its own.

    Example:
        >>> with AnonymousPeak(interval=0.001) as p:
        ...     block = b"x" * (1 << 20)
        >>> p.extra >= 0
        True
    """

    def __init__(self, interval: float = 0.01) -> None:
        super().__init__(interval)
        self.extra = 0
        self._before = 0

    def _sample(self) -> None:
        self.extra = max(self.extra, anonymous_rss() - self._before)

    def __enter__(self) -> AnonymousPeak:
        self._before = anonymous_rss()
        return super().__enter__()
