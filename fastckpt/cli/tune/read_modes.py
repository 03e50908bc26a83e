"""The read-mode step of ``fastckpt tune``: which way of reading a cold checkpoint is fastest
on each file system.

A local file's cold bytes can come in three ways (:mod:`fastckpt.storage.local`): O_DIRECT
with a deep queue, buffered ``pread`` on every core, or copies out of a mapping whose page
faults bring the bytes in with the kernel's readahead. Which wins depends on the device
(local NVMe, a virtual disk, a network file system), so each is timed here, loading a real
checkpoint file with :func:`fastckpt.load` (checksums verified, as by default) from a cold
page cache, and the winner is remembered beside the tuned I/O settings.

A figure counts only when the file was proved cold before the load (no page of it resident,
as ``fincore`` would say); where the cache cannot be emptied (no root, a memory file system),
nothing is recorded and the output says why.

A checkpoint is often loaded beside a training job that keeps every core busy, and the
staged copy is worth its CPU only where cores are free. So the modes are timed twice: on the
machine as it is, and beside ``busy`` processes running a training-like CPU loop
(:class:`~fastckpt.bench.training_load.TrainingLoad`, one per core by default). Both
winners are remembered; a load takes the contended one when it finds the cores busy
(:func:`fastckpt.io.cpu_load.machine_busy`).

Example:
    >>> import tempfile
    >>> from fastckpt.bench.caches import PageCache
    >>> figures = measure_read_modes([tempfile.mkdtemp()], 1 << 20, PageCache(allow_drop=False), 1)
    >>> figures[0].skipped is not None or sorted(figures[0].gbps) == sorted(READ_MODES)
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator, Sequence

from fastckpt.bench.caches import PageCache
from fastckpt.bench.synthetic import random_layers
from fastckpt.bench.training_load import TrainingLoad, load_average
from fastckpt.bench.units import median
from fastckpt.config import READ_MODES, force_read_mode

__all__ = ["ReadModeFigures", "measure_read_modes", "remember_read_modes"]

# Fewer than this share of the file resident counts as cold.
_COLD_ENOUGH = 0.01


@dataclasses.dataclass
class ReadModeFigures:
    """One directory's cold-load speeds per read mode (GB/s, medians), or why none;
    ``busy``: the training-like processes beside the loads (0: none) and the load averages
    at the start and end."""

    directory: str
    gbps: dict[str, float] = dataclasses.field(default_factory=dict)
    skipped: str | None = None
    busy: int = 0
    load_averages: tuple[tuple[float, ...], ...] = ()

    @property
    def winner(self) -> str | None:
        return max(self.gbps, key=lambda mode: self.gbps[mode]) if self.gbps else None

    def describe(self) -> str:
        if self.skipped:
            return f"{self.directory}: read modes not measured: {self.skipped}"
        figures = ", ".join(f"{mode} {gbps:.2f}" for mode, gbps in self.gbps.items())
        beside = f" beside {self.busy} busy processes" if self.busy else ""
        return f"{self.directory}: cold loads{beside}, GB/s: {figures} -> {self.winner}"


def measure_read_modes(
    dirs: Sequence[str], nbytes: int, cache: PageCache, loops: int, *, busy: int = 0
) -> list[ReadModeFigures]:
    """Times ``fastckpt.load`` of an ``nbytes`` checkpoint in each directory, from a cold
    page cache, in every read mode, interleaved ``loops`` times; medians per mode. ``busy``:
    that many training-like processes run beside every load (started before the first)."""
    with TrainingLoad(busy):
        start = load_average()
        figures = [_measure_one(directory, nbytes, cache, loops) for directory in dirs]
        end = load_average()
    for one in figures:
        one.busy, one.load_averages = busy, (start, end)
    return figures


def remember_read_modes(figures: Sequence[ReadModeFigures]) -> None:
    """Records each measured directory's winner for its file system (see
    :func:`fastckpt.config.save_tuned_read_mode`); figures measured beside busy processes
    as the contended winner."""
    from fastckpt.config import filesystem_key, save_tuned_read_mode

    for one in figures:
        if one.winner is None:
            continue
        how = None
        if one.busy:
            how = {"processes": one.busy, "load_averages": [list(a) for a in one.load_averages]}
        save_tuned_read_mode(
            filesystem_key(one.directory), one.winner, one.gbps, contended=bool(one.busy), busy=how
        )


def _measure_one(directory: str, nbytes: int, cache: PageCache, loops: int) -> ReadModeFigures:

    from fastckpt.api import load, save
    from fastckpt.io.page_cache import resident_fraction

    figures = ReadModeFigures(directory)
    path = os.path.join(directory, f".fastckpt-tune-read-{os.getpid()}.safetensors")
    state = random_layers(nbytes)  # 16 MiB bf16 tensors, as an LLM's layers
    try:
        save(state, path)
        del state
        runs: dict[str, list[float]] = {mode: [] for mode in READ_MODES}
        for _ in range(loops):
            for mode in READ_MODES:
                cache.drop([path])
                with open(path, "rb") as f:
                    resident = resident_fraction(f.fileno(), 0, os.path.getsize(path))
                if resident is None or resident > _COLD_ENOUGH:
                    figures.skipped = (
                        f"the file stays in memory after dropping the cache ({cache.describe()})"
                        if resident is not None
                        else "residency cannot be checked here (mincore refused)"
                    )
                    return figures
                with _forced(mode):
                    started = time.perf_counter()
                    loaded = load(path)
                    elapsed = time.perf_counter() - started
                size = sum(t.numel() * t.element_size() for t in loaded.values())
                del loaded
                runs[mode].append(size / elapsed / 1e9)
        figures.gbps = {mode: median(values) for mode, values in runs.items()}
        return figures
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def _forced(mode: str) -> Iterator[None]:
    """Cold loads inside read in ``mode`` (see :func:`fastckpt.config.force_read_mode`)."""
    force_read_mode(mode)
    try:
        yield
    finally:
        force_read_mode(None)
