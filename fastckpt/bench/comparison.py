"""The in-process library comparison of ``fastckpt bench --checkpoint``: fastckpt, torch and
safetensors (and, in the memory regime, the fast loaders and the ``preadv`` ceiling) save and
load one state dict in turns, on one file system, in one process.

Saves are timed until the data is durable (fsync); loads from a cold cache (disk regime) or
a warm one (memory regime), until every tensor has been touched.

In the disk regime the device's own ceiling runs in the same loops: a sequential O_DIRECT
write (+ fsync) and read of as many bytes (fio where installed, else
:mod:`fastckpt.bench.ceilings`), so every figure can be read against what the disk did at
that moment. In the memory regime ``fastckpt.load(mmap=True)``
runs beside safetensors' ``load_file``, which maps the file lazily: its figure is a mapping
(pages faulted in by the touch), set against fastckpt's default load, which copies into
memory of its own. The table shows each figure's median with its spread (min-max of the
loops) and ends with a one-line verdict (:func:`verdict`).

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
from fastckpt.bench.peers import LOADERS, SAVERS, Skip, Timed
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
    "verdict",
]

#: (row name, file suffix, saver, loader) of the libraries compared: names in
#: :data:`fastckpt.bench.peers.SAVERS` and :data:`~fastckpt.bench.peers.LOADERS`.
LIBRARIES: list[tuple[str, str, str, str]] = [
    ("fastckpt", ".safetensors", "fastckpt", "fastckpt"),
    ("torch.save/load", ".pt", "torch", "torch"),
    ("safetensors", ".st.safetensors", "safetensors", "safetensors"),
]

#: Rows added in the memory regime: (row name, loader, the row whose file it reads).
MEMORY_PEERS: list[tuple[str, str, str]] = [
    ("fastckpt(mmap=True)", "fastckpt-mmap", "fastckpt"),
    ("runai-streamer", "runai", "safetensors"),
    ("fastsafetensors", "fastsafetensors", "safetensors"),
    ("preadv-ceiling", "preadv", "safetensors"),
]

#: The disk regime's ceiling row: raw O_DIRECT write and read of as many bytes.
DEVICE_ROW = "device(O_DIRECT)"


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
    if not memory and device == "cpu":
        rows.append(Row(DEVICE_ROW, "direct", "direct", DEVICE_ROW))
    if memory:
        present = {r.name for r in rows}
        for name, loader, file_of in MEMORY_PEERS:
            if file_of not in present:
                continue
            try:
                LOADERS[loader].setup(os.devnull, device)
            except Skip as why:
                warn(f"{name}: left out: {why}")
                continue
            except Exception:  # noqa: BLE001 - os.devnull is no checkpoint; setup got this far
                pass
            rows.append(Row(name, None, loader, file_of))
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
    running: Callable[[str], None] = lambda what: None,
) -> dict[str, Timings]:
    """Saves and loads ``state`` in ``folder`` with every row, ``loops`` times; the files are
    removed at the end.

    The rows take turns within each loop, so a drifting device treats all alike. ``check``
    (untimed) is given each row, what it loaded and its file; ``advance`` is called after
    each row's turn (a progress bar), ``running`` before each step with what runs (e.g.
    ``"safetensors: save"``). ``cache`` keeps the disk regime's loads cold (default: a
    :class:`PageCache` that drops the machine's cache where permitted).
    """
    if not memory and cache is None:
        cache = PageCache()
    tag = f".fastckpt-bench-{os.getpid()}"
    paths = {name: os.path.join(folder, tag + suffix) for name, suffix, _, _ in LIBRARIES}
    paths[DEVICE_ROW] = os.path.join(folder, tag + ".direct.bin")
    timings = {row.name: Timings() for row in rows}
    try:
        for _loop in range(loops):
            for row in rows:
                path, times = paths[row.file_of], timings[row.name]
                if row.saver is not None:
                    running(f"{row.name}: save (loop {_loop + 1}/{loops})")
                    save = SAVERS[row.saver].setup(state, path)
                    wall, cpu = time.perf_counter(), time.process_time()
                    timed = save()  # returns once the file is durable
                    wall = time.perf_counter() - wall
                    times.save.append(timed.seconds if isinstance(timed, Timed) else wall)
                    times.save_cpu.append(time.process_time() - cpu)
                running(f"{row.name}: load (loop {_loop + 1}/{loops})")
                load = LOADERS[row.loader].setup(path, device)
                if memory:
                    warm_page_cache([path])
                elif cache is not None:
                    cache.drop([path])
                wall, cpu = time.perf_counter(), time.process_time()
                loaded = load()
                touch(loaded)
                wall = time.perf_counter() - wall
                times.load.append(loaded.seconds if isinstance(loaded, Timed) else wall)
                times.load_cpu.append(time.process_time() - cpu)
                if check is not None and row.name != DEVICE_ROW:  # the ceiling returns no tensor
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


def _rates(nbytes: int, seconds: list[float]) -> tuple[float, float, float]:
    """(median, min, max) GB/s of the loops' seconds (NaNs when there are none)."""
    if not seconds:
        return math.nan, math.nan, math.nan
    return gbps(nbytes, median(seconds)), gbps(nbytes, max(seconds)), gbps(nbytes, min(seconds))


def comparison_table(timings: dict[str, Timings], nbytes: int, *, memory: bool = False) -> str:
    """The table: GB/s (median of the loops, min-max beside it), CPU seconds, the first row's
    speedup, then the verdict line (:func:`verdict`) and, in the memory regime, what
    safetensors' figure is.

    Example:
        >>> t = {"a": Timings([1.0], [0.5], [1.0], [0.5]), "b": Timings([], [1.0], [], [1.0])}
        >>> print(comparison_table(t, 10**9).splitlines()[4])  # doctest: +NORMALIZE_WHITESPACE
        b  —  —  1  1-1  — 1.00  — / 2.00x
    """

    def num(value: float, spec: str) -> str:
        # A row without a save (a loader only) shows a dash, aligned like a number.
        return format("—", spec.split(".")[0]) if math.isnan(value) else format(value, spec)

    def spread(low: float, high: float) -> str:
        return format("—", ">11") if math.isnan(low) else format(f"{low:.3g}-{high:.3g}", ">11")

    def ratio(base: float, value: float) -> str:
        return "—" if math.isnan(value) or math.isnan(base) else f"{base / value:.2f}x"

    rows = [
        (
            name,
            _rates(nbytes, t.save),
            _rates(nbytes, t.load),
            median(t.save_cpu),
            median(t.load_cpu),
        )
        for name, t in timings.items()
    ]
    base_save, base_load = rows[0][1][0], rows[0][2][0]
    header = (
        f"{'library':<18}  {'save GB/s':>9}  {'(min-max)':>11}  {'load GB/s':>9}  "
        f"{'(min-max)':>11}  {'save CPU s':>10}  {'load CPU s':>10}  fastckpt speedup (save / load)"
    )
    lines = ["", header, "-" * len(header)]
    for name, save, load, save_cpu, load_cpu in rows:
        lines.append(
            f"{name:<18}  {num(save[0], '>9.3g')}  {spread(save[1], save[2])}  "
            f"{num(load[0], '>9.3g')}  {spread(load[1], load[2])}  {num(save_cpu, '>10.2f')}  "
            f"{num(load_cpu, '>10.2f')}  {ratio(base_save, save[0])} / {ratio(base_load, load[0])}"
        )
    lines.append(
        "\nGB/s: 10^9 bytes of tensor data per second, median of the loops (min-max beside it). "
        "CPU s: CPU time of this process (all threads). Speedup: fastckpt's GB/s over the row's."
    )
    if DEVICE_ROW in timings:
        lines.append(
            f"{DEVICE_ROW}: the device's ceiling in the same loops, a sequential O_DIRECT write "
            "(+ fsync) and cold read of as many bytes, no format or checksum (fio's own "
            "figures where fio is installed, else 16 threads of 4 MiB requests)."
        )
    if memory and "safetensors" in timings:
        lines.append(
            "safetensors' load is a lazy mapping of the file (pages faulted in by the touch), "
            "set against fastckpt.load's copy into memory of its own; fastckpt(mmap=True) is "
            "fastckpt's mapping."
        )
    medians = {name: (save[0], load[0]) for name, save, load, _, _ in rows}
    lines.append("Verdict: " + verdict(medians, memory=memory))
    return "\n".join(lines)


# Figures within this fraction of each other are "the same" to the verdict: the loops of
# one run on a virtual disk spread by more than that.
_SAME = 0.10


def verdict(medians: dict[str, tuple[float, float]], *, memory: bool = False) -> str:
    """One line saying what the figures mean: fastckpt against the device's ceiling (when
    measured) and the best peer, save and load. ``medians``: row -> (save, load) GB/s.

    In the memory regime the load's ceiling is the parallel-``preadv`` row, and safetensors'
    load (a lazy mapping) is set against ``fastckpt(mmap=True)``, not against a copy.

    Example:
        >>> print(verdict({"fastckpt": (0.5, 1.0), "torch.save/load": (0.49, 0.5),
        ...                "safetensors": (0.5, 0.9), "device(O_DIRECT)": (0.52, 1.0)}))
        save: all at the disk's limit (fastckpt 0.96x the device); load: fastckpt 1.00x the device, 1.11x the best peer
    """
    nan = (math.nan, math.nan)
    parts = []
    for index, what in ((0, "save"), (1, "load")):
        mine = medians.get("fastckpt", nan)[index]
        if math.isnan(mine):
            continue
        ceiling = medians.get(DEVICE_ROW, nan)[index]
        names = ["torch.save/load", "safetensors"]
        if memory and index == 1:  # a mapping is not a copy: it has a row of its own below
            ceiling, names = medians.get("preadv-ceiling", nan)[1], ["torch.save/load"]
        peers = [medians[n][index] for n in names if n in medians]
        peers = [v for v in peers if not math.isnan(v)]
        where = "the preadv ceiling" if memory else "the device"
        if not math.isnan(ceiling) and all(v >= (1 - _SAME) * ceiling for v in [mine, *peers]):
            parts.append(
                f"{what}: all at the disk's limit (fastckpt {mine / ceiling:.2f}x {where})"
                if not memory
                else f"{what}: all at {where} (fastckpt {mine / ceiling:.2f}x)"
            )
            continue
        bits = [f"{mine / ceiling:.2f}x {where}"] if not math.isnan(ceiling) else []
        if peers:
            bits.append(f"{mine / max(peers):.2f}x the best peer")
        parts.append(f"{what}: fastckpt " + ", ".join(bits))
    if memory:
        mapped = medians.get("fastckpt(mmap=True)", nan)[1]
        lazy = medians.get("safetensors", nan)[1]
        if not math.isnan(mapped) and not math.isnan(lazy):
            parts.append(f"mappings: fastckpt(mmap=True) {mapped / lazy:.2f}x safetensors'")
    return "; ".join(parts) if parts else "nothing measured"
