"""Saving what ``fastckpt tune`` found, per file system, where :mod:`fastckpt.config` reads it.

The file and its format belong to :mod:`fastckpt.config` (:func:`~fastckpt.config.save_tuned`,
:func:`~fastckpt.config.save_tuned_gds`, :func:`~fastckpt.config.tuned_config_path`); this
module decides what of a tuning run goes in: the winning configuration and the conditions it
was measured under, once per file system measured.

Example:
    >>> import tempfile
    >>> from fastckpt.cli.tune.sweep import Result
    >>> winner = Result({"queue_depth": 8, "engine": "threads"}, read=[2.0], write=[1.0])
    >>> saved = save_winner(winner, [tempfile.gettempdir()], io_size=1 << 20, loops=1,
    ...                     gpu=False, cache_dropped=False, read=True, write=True)
    >>> import fastckpt.config as config
    >>> key, = saved
    >>> config.load_tuned()[key]["measured"]["read_gbps"]
    2.0
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastckpt.cli.tune.sweep import Result

__all__ = ["save_gds_winner", "save_winner"]


def _figures(winner: Result, read: bool, write: bool) -> dict[str, float]:
    figures = {}
    if read:
        figures["read_gbps"] = round(winner.read_gbps, 3)
    if write:
        figures["write_gbps"] = round(winner.write_gbps, 3)
    return figures


def save_winner(
    winner: Result,
    dirs: Sequence[str],
    *,
    io_size: int,
    loops: int,
    gpu: bool,
    cache_dropped: bool,
    read: bool,
    write: bool,
) -> dict[str, Path]:
    """Records ``winner``'s configuration for the file system of each of ``dirs``, with what
    it measured and how; returns the file written per file-system key."""
    from fastckpt.config import filesystem_key, save_tuned

    measured: dict[str, Any] = {
        "io_size": io_size,
        "loops": loops,
        "gpu": bool(gpu),
        "dirs": list(dirs),
        "cold_reads": "drop_caches" if cache_dropped else "o_direct",
        **_figures(winner, read, write),
    }
    saved: dict[str, Path] = {}
    for d in dirs:
        key = filesystem_key(d)
        if key not in saved:
            saved[key] = save_tuned(key, winner.config, measured)
    return saved


def save_gds_winner(
    winner: Result, dirs: Sequence[str], *, read: bool, write: bool
) -> dict[str, Path]:
    """Records GDS's figures per file system: loads to CUDA use GDS there when it read faster
    than the staging pipeline measured by ``fastckpt tune --gpu`` (gds_handle's own settings
    are arguments, so no configuration is saved). Returns the file written per key."""
    from fastckpt.config import filesystem_key, save_tuned_gds

    measured: dict[str, Any] = {
        "intra_op_parallelism": winner.config.get("intra_op_parallelism"),
        **_figures(winner, read, write),
    }
    return {key: save_tuned_gds(key, measured) for key in dict.fromkeys(map(filesystem_key, dirs))}
