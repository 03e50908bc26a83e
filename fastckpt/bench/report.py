"""What a benchmark prints: Markdown tables, numbers or "n/a", progress lines on stderr,
and the machine and versions its figures belong to.

Example:
    >>> print(markdown_table(["method", "GB/s"], [["a", fmt(1.234, ".2f")]]))
    | method | GB/s |
    |---|---:|
    | a | 1.23 |
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from fastckpt.bench.units import format_bytes

__all__ = ["fmt", "log", "machine", "markdown_table", "version_of"]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A Markdown table; ``align`` holds one letter per column (``l`` or ``r``, default r
    for all but the first).

    Example:
        >>> print(markdown_table(["method", "GB/s"], [["a", "1.00"]]))
        | method | GB/s |
        |---|---:|
        | a | 1.00 |
    """
    align = align or "l" + "r" * (len(header) - 1)
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` (and ``suffix``), or "n/a" when it was not measured.

    Example:
        >>> fmt(1.234, ".2f", "x"), fmt(None, ".2f")
        ('1.23x', 'n/a')
    """
    if value is None or value != value:  # None or NaN
        return "n/a"
    return format(value, spec) + suffix


def log(message: str) -> None:
    """A timestamped progress line on stderr (tables go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def version_of(distribution: str) -> str:
    """The installed version of a distribution, or "not installed".

    Example:
        >>> version_of("no-such-distribution-here")
        'not installed'
    """
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, Any]:
    """The machine and the versions a benchmark's figures belong to."""
    import platform

    return {
        "cpus": len(os.sched_getaffinity(0)),
        "memory": format_bytes(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {
            d: version_of(d)
            for d in (
                "fastckpt-io",
                "torch",
                "safetensors",
                "runai-model-streamer",
                "fastsafetensors",
            )
        },
    }
