"""Whether the machine's cores are busy with other work, read once per load, cheaply.

A checkpoint is often loaded beside a training job that keeps every core busy. Work that
only pays where cores are free (the staging pool's copy out of its buffers, on every core)
then costs the load: on our 2-core VM a cold 2 GiB load through the staging pool ran at
1.24 GB/s beside a CPU-bound loop on each core, against 1.64 for safetensors' mapping, and
0.80 against 1.57 at a load average of 6. So a cold read asks :func:`machine_busy` first.

The rule (:func:`is_busy`): the machine is busy when at least as many *other* threads are
runnable right now as this process has cores, and the 1-minute load average says the same.
The instant count alone flickers (a burst of another program); the average alone lags and
counts this process's own earlier loads (back-to-back loads on a quiet machine keep it near
the core count). Both are one read of ``/proc/loadavg`` (a few microseconds).

Example:
    >>> is_busy(CpuLoad(runnable=1, load_1min=0.3), cores=2)
    False
    >>> is_busy(CpuLoad(runnable=5, load_1min=4.1), cores=2)
    True
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["CpuLoad", "cores", "cpu_load", "is_busy", "machine_busy", "contended_mode"]

_LOADAVG = "/proc/loadavg"


@dataclasses.dataclass(frozen=True)
class CpuLoad:
    """What the kernel says of the run queue: threads runnable now (the caller's included)
    and the 1-minute load average."""

    runnable: int
    load_1min: float


def cores() -> int:
    """The cores this process may run on (its affinity; a container's or ``taskset``'s limit).

    Example:
        >>> cores() >= 1
        True
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def cpu_load(path: str = _LOADAVG) -> CpuLoad | None:
    """The run queue as ``/proc/loadavg`` gives it (``0.52 0.58 0.59 3/415 1234``: the
    averages, then runnable/all threads); None where there is no such file.

    Example:
        >>> load = cpu_load()
        >>> load is None or load.runnable >= 1
        True
    """
    try:
        with open(path, encoding="ascii") as f:
            fields = f.read().split()
        return CpuLoad(runnable=int(fields[3].split("/")[0]), load_1min=float(fields[0]))
    except (OSError, ValueError, IndexError):
        return None


def is_busy(load: CpuLoad | None, *, cores: int) -> bool:
    """Whether ``load`` means the machine's ``cores`` are taken by other work (see the
    module's rule). ``None`` (nothing known) is not busy.

    Example:
        >>> is_busy(CpuLoad(runnable=3, load_1min=2.5), cores=2)  # two others, steadily
        True
        >>> is_busy(CpuLoad(runnable=3, load_1min=0.4), cores=2)  # a passing burst
        False
    """
    if load is None:
        return False
    others = load.runnable - 1  # the caller itself is running
    return others >= cores and load.load_1min >= cores


def machine_busy() -> bool:
    """:func:`is_busy` of this machine now, for this process's cores.

    Example:
        >>> machine_busy() in (True, False)
        True
    """
    return is_busy(cpu_load(), cores=cores())


def contended_mode(mode: str, *, busy: bool) -> tuple[str, str]:
    """How a cold file is read given the mode wanted on a quiet machine: on a busy one,
    ``"staged"`` becomes ``"direct"`` (O_DIRECT straight into the load's memory), since the
    staged copy is worth its CPU only where cores are free; every other mode is kept.
    Returns the mode and why.

    Example:
        >>> contended_mode("staged", busy=True)[0], contended_mode("staged", busy=False)[0]
        ('direct', 'staged')
        >>> contended_mode("buffered", busy=True)[0]
        'buffered'
    """
    if busy and mode == "staged":
        return "direct", "the cores are busy: no staged copy"
    return mode, "the cores are busy" if busy else "the cores are free"
