"""Units and numbers every benchmark reports in: byte sizes, GB/s, medians.

GB/s are 10**9 bytes per second, as storage vendors and fio count. DeepSpeed's ``ds_io``
prints "GB/sec" but divides by 1024**3: its figures are GiB/s (2**30 bytes per second, 7.4%
smaller for the same speed); :func:`gibps` gives that unit where a figure is set beside
DeepSpeed's. Sizes shown to people are in powers of 1024.

Example:
    >>> format_bytes(3 * GiB), gbps(2_000_000_000, 1.0), median([3.0, None, 1.0])
    ('3.00 GiB', 2.0, 2.0)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

__all__ = ["GiB", "KiB", "MiB", "format_bytes", "gbps", "gibps", "median"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def format_bytes(nbytes: float) -> str:
    """A byte count for people, in powers of 1024.

    Example:
        >>> format_bytes(1536), format_bytes(12)
        ('1.50 KiB', '12 B')
    """
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.2f} {unit}"
    raise AssertionError("unreachable")


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10**9 bytes per second, as storage vendors and fio count).

    Example:
        >>> gbps(2_000_000_000, 1.0)
        2.0
    """
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


def gibps(nbytes: int, seconds: float) -> float:
    """Throughput in GiB/s (2**30 bytes per second): what DeepSpeed's ``ds_io`` prints as
    "GB/sec".

    Example:
        >>> gibps(3 * GiB, 2.0), round(gibps(2_000_000_000, 1.0), 3)
        (1.5, 1.863)
    """
    return nbytes / seconds / GiB if seconds > 0 else math.inf


def median(values: Iterable[float | None]) -> float:
    """The median of the values that were measured (None left out), or NaN for none.

    Example:
        >>> median([3.0, 1.0, 2.0])
        2.0
        >>> median([None, 4.0])
        4.0
    """
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else math.nan
