"""The write-mode step of ``fastckpt tune``: which way of saving a checkpoint is fastest on
each file system, timed until the file is durable.

A save can write with O_DIRECT through page-locked staging buffers (with the block size and
queue depth the sweep found) or from the tensors' own memory through the page cache, then
fsync (:mod:`fastckpt.io.write_mode`). Which wins depends on the device: O_DIRECT on local
NVMe, either on virtual disks. So both are timed here, saving a real checkpoint with
:func:`fastckpt.save` (atomic commit, fsync of the file and its directory), interleaved, and
the winner is remembered beside the tuned I/O settings; saves of states larger than
:data:`~fastckpt.io.write_mode.SMALL_STATE_BYTES` on that file system then take it.

Example:
    >>> import tempfile
    >>> figures = measure_write_modes([tempfile.mkdtemp()], 1 << 20, 1)
    >>> sorted(figures[0].gbps), figures[0].winner in ("direct", "buffered")
    (['buffered', 'direct'], True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

from fastckpt.bench.synthetic import random_layers
from fastckpt.bench.units import median
from fastckpt.config import WRITE_MODES

__all__ = ["WriteModeFigures", "measure_write_modes", "remember_write_modes"]


@dataclasses.dataclass
class WriteModeFigures:
    """One directory's save speeds per write mode (GB/s, medians of interleaved runs) and
    the I/O settings the direct saves used."""

    directory: str
    gbps: dict[str, float] = dataclasses.field(default_factory=dict)
    runs: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def winner(self) -> str | None:
        return max(self.gbps, key=lambda mode: self.gbps[mode]) if self.gbps else None

    def describe(self) -> str:
        figures = ", ".join(
            f"{mode} {gbps:.2f} ({min(self.runs[mode]):.2f}-{max(self.runs[mode]):.2f})"
            for mode, gbps in self.gbps.items()
        )
        return f"{self.directory}: saves until durable, GB/s (min-max): {figures} -> {self.winner}"


def measure_write_modes(dirs: Sequence[str], nbytes: int, loops: int) -> list[WriteModeFigures]:
    """Times ``fastckpt.save`` of an ``nbytes`` state into each directory in every write
    mode, interleaved ``loops`` times; medians per mode."""
    return [_measure_one(directory, nbytes, loops) for directory in dirs]


def remember_write_modes(figures: Sequence[WriteModeFigures]) -> None:
    """Records each measured directory's winner for its file system (see
    :func:`fastckpt.config.save_tuned_write_mode`)."""
    from fastckpt.config import filesystem_key, save_tuned_write_mode

    for one in figures:
        if one.winner is not None:
            save_tuned_write_mode(filesystem_key(one.directory), one.winner, one.gbps, one.settings)


def _measure_one(directory: str, nbytes: int, loops: int) -> WriteModeFigures:

    from fastckpt.api import save
    from fastckpt.config import resolve_io, staging_bytes

    figures = WriteModeFigures(directory)
    io = resolve_io(directory, {})
    figures.settings = {
        "engine": io.engine,
        "block_size": io.block_size,
        "queue_depth": io.queue_depth,
        "staging_bytes": staging_bytes(),
    }
    path = os.path.join(directory, f".fastckpt-tune-write-{os.getpid()}.safetensors")
    state = random_layers(nbytes)  # 16 MiB bf16 tensors, as an LLM's layers
    size = sum(t.numel() * t.element_size() for t in state.values())
    runs: dict[str, list[float]] = {mode: [] for mode in WRITE_MODES}
    try:
        save(state, path)  # warm-up: the first save of a process pays for its threads
        for _ in range(loops):
            for mode in WRITE_MODES:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # every run writes a new file, as a checkpoint does
                started = time.perf_counter()
                save(state, path, direct_io=mode == "direct", progress=False)
                runs[mode].append(size / (time.perf_counter() - started) / 1e9)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    figures.runs = runs
    figures.gbps = {mode: median(values) for mode, values in runs.items()}
    return figures
