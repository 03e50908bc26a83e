"""The in-process library comparison of ``fastckpt bench --checkpoint``: fastckpt, torch and
safetensors (and, in the memory regime, the fast loaders and the ``preadv`` ceiling) save and
load one state dict in turns, on one file system, in one process.

Saves are timed until the data is durable (fsync); loads from a cold cache (disk regime) or
a warm one (memory regime), until every tensor has been touched.

Example:
    >>> import tempfile, torch
    >>> rows = [Row("fastckpt", "fastckpt", "fastckpt", "fastckpt")]
    >>> state = {"w": torch.ones(1024)}
    >>> timings = compare(rows, state, tempfile.mkdtemp(), loops=1, memory=True)
    >>> len(timings["fastckpt"].load), validate_loaded("fastckpt", state, {"w": torch.ones(2)})
    (1, "fastckpt loaded tensor 'w' differently")
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from fastckpt.bench.caches import PageCache, warm_page_cache
from fastckpt.bench.checks import touch
from fastckpt.bench.peers import LOADERS, SAVERS, Skip
from fastckpt.bench.units import gbps, median

__all__ = [
    "LIBRARIES",
    "MEMORY_PEERS",
    "Row",
    "Timings",
    "available_rows",
    "compare",
    "comparison_table",
    "validate_loaded",
]

#: (row name, file suffix, saver, loader) of the libraries compared: names in
#: :data:`fastckpt.bench.peers.SAVERS` and :data:`~fastckpt.bench.peers.LOADERS`.
LIBRARIES: list[tuple[str, str, str, str]] = [
    ("fastckpt", ".safetensors", "fastckpt", "fastckpt"),
    ("torch.save/load", ".pt", "torch", "torch"),
    ("safetensors", ".st.safetensors", "safetensors", "safetensors"),
]

#: Rows added in the memory regime: loaders of the safetensors row's file (no save).
MEMORY_PEERS: list[tuple[str, str]] = [
    ("runai-streamer", "runai"),
    ("fastsafetensors", "fastsafetensors"),
    ("preadv-ceiling", "preadv"),
]


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the table: its name, its saver (None: it loads another row's file), its
    loader, and the row whose file it reads."""

    name: str
    saver: str | None
    loader: str
    file_of: str


@dataclasses.dataclass
class Timings:
    """Seconds (wall and CPU) of each loop of one row."""

    save: list[float] = dataclasses.field(default_factory=list)
    load: list[float] = dataclasses.field(default_factory=list)
    save_cpu: list[float] = dataclasses.field(default_factory=list)
    load_cpu: list[float] = dataclasses.field(default_factory=list)


def available_rows(memory: bool, device: str, warn: Callable[[str], None]) -> list[Row]:
    """The rows whose library is installed (``warn`` is told of each left out).

    Example:
        >>> [r.name for r in available_rows(False, "cpu", print)][0]
        'fastckpt'
    """
    rows: list[Row] = []
    for name, _, saver, loader in LIBRARIES:
        if saver == "safetensors":
            try:
                import safetensors.torch  # noqa: F401
            except ImportError:
                warn("safetensors is not installed: its row is left out (pip install safetensors)")
                continue
        rows.append(Row(name, saver, loader, name))
    if memory and any(r.name == "safetensors" for r in rows):
        for name, loader in MEMORY_PEERS:
            try:
                LOADERS[loader].setup(os.devnull, device)
            except Skip as why:
                warn(f"{name}: left out: {why}")
                continue
            except Exception:  # noqa: BLE001 - os.devnull is no checkpoint; setup got this far
                pass
            rows.append(Row(name, None, loader, "safetensors"))
    return rows


def compare(
    rows: Sequence[Row],
    state: dict[str, Any],
    folder: str,
    *,
    loops: int,
    memory: bool,
    device: str = "cpu",
    check: Callable[[Row, Any, str], None] | None = None,
    advance: Callable[[], None] = lambda: None,
    cache: PageCache | None = None,
) -> dict[str, Timings]:
    """Saves and loads ``state`` in ``folder`` with every row, ``loops`` times; the files are
    removed at the end.

    The rows take turns within each loop, so a drifting device treats all alike. ``check``
    (untimed) is given each row, what it loaded and its file; ``advance`` is called after
    each row's turn (a progress bar). ``cache`` keeps the disk regime's loads cold (default: a
    :class:`PageCache` that drops the machine's cache where permitted).
    """
    if not memory and cache is None:
        cache = PageCache()
    tag = f".fastckpt-bench-{os.getpid()}"
    paths = {name: os.path.join(folder, tag + suffix) for name, suffix, _, _ in LIBRARIES}
    timings = {row.name: Timings() for row in rows}
    try:
        for _loop in range(loops):
            for row in rows:
                path, times = paths[row.file_of], timings[row.name]
                if row.saver is not None:
                    save = SAVERS[row.saver].setup(state, path)
                    wall, cpu = time.perf_counter(), time.process_time()
                    save()  # returns once the file is durable
                    times.save.append(time.perf_counter() - wall)
                    times.save_cpu.append(time.process_time() - cpu)
                load = LOADERS[row.loader].setup(path, device)
                if memory:
                    warm_page_cache([path])
                elif cache is not None:
                    cache.drop([path])
                wall, cpu = time.perf_counter(), time.process_time()
                loaded = load()
                touch(loaded)
                times.load.append(time.perf_counter() - wall)
                times.load_cpu.append(time.process_time() - cpu)
                if check is not None:
                    check(row, loaded, path)
                del loaded
                advance()
    finally:
        for path in paths.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return timings


def validate_loaded(name: str, state: dict[str, Any], loaded: Any, path: str = "") -> str | None:
    """What is wrong with what row ``name`` loaded from ``path`` (None: the bytes saved).

    Example:
        >>> import torch
        >>> validate_loaded("a", {"w": torch.ones(2)}, {"w": torch.ones(2)}) is None
        True
    """
    import torch

    if isinstance(loaded, dict) and set(loaded) == {"file"}:  # the preadv ceiling: the file
        with open(path, "rb") as f:
            if loaded["file"].numpy().tobytes() != f.read():
                return f"{name} read other bytes than the file holds"
        return None
    if not isinstance(loaded, dict) or set(loaded) != set(state):
        return f"{name} loaded other keys than were saved"
    for key, tensor in state.items():
        got = loaded[key]
        if got.dtype != tensor.dtype or got.shape != tensor.shape or not torch.equal(got, tensor):
            return f"{name} loaded tensor {key!r} differently"
    return None


def comparison_table(timings: dict[str, Timings], nbytes: int) -> str:
    """The table: GB/s (median of the loops), CPU seconds and the first row's speedup.

    Example:
        >>> t = {"a": Timings([1.0], [0.5], [1.0], [0.5]), "b": Timings([], [1.0], [], [1.0])}
        >>> print(comparison_table(t, 10**9).splitlines()[4])  # doctest: +NORMALIZE_WHITESPACE
        b  — 1  — 1.00  — / 2.00x
    """

    def rate(seconds: list[float]) -> float:
        return gbps(nbytes, median(seconds)) if seconds else math.nan

    def num(value: float, spec: str) -> str:
        # A row without a save (a loader only) shows a dash, aligned like a number.
        return format("—", spec.split(".")[0]) if math.isnan(value) else format(value, spec)

    def ratio(base: float, value: float) -> str:
        return "—" if math.isnan(value) or math.isnan(base) else f"{base / value:.2f}x"

    rows = [
        (name, rate(t.save), rate(t.load), median(t.save_cpu), median(t.load_cpu))
        for name, t in timings.items()
    ]
    base_save, base_load = rows[0][1], rows[0][2]
    header = (
        f"{'library':<16}  {'save GB/s':>9}  {'load GB/s':>9}  {'save CPU s':>10}  "
        f"{'load CPU s':>10}  fastckpt speedup (save / load)"
    )
    lines = ["", header, "-" * len(header)]
    for name, save, load, save_cpu, load_cpu in rows:
        lines.append(
            f"{name:<16}  {num(save, '>9.3g')}  {num(load, '>9.3g')}  {num(save_cpu, '>10.2f')}  "
            f"{num(load_cpu, '>10.2f')}  {ratio(base_save, save)} / {ratio(base_load, load)}"
        )
    lines.append(
        "\nGB/s: 10^9 bytes of tensor data per second, median of the loops. CPU s: CPU time of "
        "this process (all threads). Speedup: fastckpt's GB/s over the library's."
    )
    return "\n".join(lines)
