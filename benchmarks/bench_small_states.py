#!/usr/bin/env python3
"""Small states: the fixed cost of one save and one load, fastckpt against safetensors and
torch, in one process, on one file system.

A training script that checkpoints a small model (an adapter, a probe, a 1 MiB
``Linear(512, 512)``) every few steps pays each call's fixed costs: threads, engine setup,
probes, preallocation, fsyncs. This bench times them at 64 KiB, 1 MiB and 16 MiB:

* saves, until durable: ``fastckpt.save`` (atomic: fsync of the file, rename, fsync of the
  directory), ``safetensors.torch.save_file`` + fsync of the file, ``torch.save`` + fsync;
  and the floor of an atomic save (``safetensors.torch.save``'s bytes written to a
  temporary file by one ``write``, fsync, rename, fsync of the directory: what any atomic,
  durable save must do, with no work of its own);
* loads, of the file just written (so from the page cache, as a reload in the same job
  is): ``fastckpt.load`` (CRC32C verified, as by default; and with ``verify=False``, to
  show what the check costs), ``fastckpt.load(mmap=True)``
  (a lazy copy-on-write mapping, no check, as documented), ``safetensors.torch.load_file``
  (a lazy mapping: nothing is read until touched) and ``torch.load``; then the same with
  every page of every tensor touched, which is what the mappings defer.

Each regime (``--regime``) is its own table: ``tmpfs`` (files in ``--shm``) and ``hot``
(files in ``--dir`` on a disk, in the page cache since they were just written and read).

Rounds are interleaved (every method once per round, the order rotated each round) so a
noisy disk or a busy CPU hits all alike; each figure is the median over rounds of the
median of ``--calls`` calls per round. Ratios are fastckpt's time over safetensors' (lower
is better; the targets are <= 1.5 for saves and <= 2 for loads). On a machine that other
jobs keep busy, ``--clock cpu`` times each call by this process's CPU time (every thread),
which their load inflates less than the wall clock; it leaves out waits for the disk, so a
save to a disk compares only on the wall clock.

Example::

    python benchmarks/bench_small_states.py --dir /work/bench-tmp --rounds 5
    python benchmarks/bench_small_states.py --regime tmpfs --rounds 3 --calls 5 --clock cpu
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
SIZES = {"64 KiB": 128, "1 MiB": 512, "16 MiB": 2048}  # Linear(n, n): n*n*4 + n*4 bytes


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _touch(state: dict[str, torch.Tensor]) -> int:
    """Reads one byte per page of every tensor (a lazy mapping's reads happen here)."""
    total = 0
    for t in state.values():
        flat = t.reshape(-1).view(torch.uint8)
        total += int(flat[::4096].sum(dtype=torch.int64))
    return total


Methods = dict[str, tuple[Callable[[Any], None] | None, Callable[[], Any] | None]]
PEERS = ("fastckpt", "fastckpt-noverify", "fastckpt-mmap", "safetensors", "torch", "atomic-floor")


def methods(directory: str) -> Methods:
    """name -> (save(state) or None, load() -> state), each on its own file in ``directory``
    (``fastckpt-mmap`` loads the file ``fastckpt`` saved)."""
    import safetensors.torch

    import fastckpt

    fc, st, pt, fl = (os.path.join(directory, n) for n in ("s.fastckpt", "s.st", "s.pt", "s.fl"))

    def floor_save(state: Any) -> None:
        data = safetensors.torch.save(state)
        fd = os.open(fl + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(fl + ".tmp", fl)
        _fsync(directory)

    def st_save(state: Any) -> None:
        safetensors.torch.save_file(state, st)
        _fsync(st)

    def pt_save(state: Any) -> None:
        torch.save(state, pt)
        _fsync(pt)

    return {
        "fastckpt": (lambda s: fastckpt.save(s, fc), lambda: fastckpt.load(fc)),
        "fastckpt-noverify": (None, lambda: fastckpt.load(fc, verify=False)),
        "fastckpt-mmap": (None, lambda: fastckpt.load(fc, mmap=True)),
        "safetensors": (st_save, lambda: safetensors.torch.load_file(st)),
        "torch": (pt_save, lambda: torch.load(pt, weights_only=True)),
        "atomic-floor": (floor_save, None),
    }


#: The clock calls are timed by (``--clock``): wall time, or the CPU time of this process
#: (every thread), which other jobs on a busy machine do not inflate; waits for the disk
#: (fsync) are not CPU time, so saves to a disk compare only on the wall clock.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["wall"]


def _timed(fn: Callable[[], Any], calls: int) -> float:
    """Median seconds of ``calls`` calls, on the chosen clock."""
    times = []
    for _ in range(calls):
        started = _clock()
        fn()
        times.append(_clock() - started)
    return statistics.median(times)


def measure(directory: str, rounds: int, calls: int) -> dict[str, dict[str, list[float]]]:
    """size -> "<method> <op>" -> per-round medians (seconds)."""
    out: dict[str, dict[str, list[float]]] = {}
    named = methods(directory)
    for size, n in SIZES.items():
        state = torch.nn.Linear(n, n).state_dict()
        state = {k: v.detach().clone() for k, v in state.items()}
        figures: dict[str, list[float]] = {}
        for save, load in named.values():  # warm-up: first-call costs are not the bench
            if save is not None:
                save(state)
            if load is not None:
                _touch(load())
        order = list(named)
        for r in range(rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                save, load = named[name]
                if save is not None:
                    figures.setdefault(f"{name} save", []).append(
                        _timed(lambda save=save, state=state: save(state), calls)
                    )
                if load is None:
                    continue
                figures.setdefault(f"{name} load", []).append(_timed(load, calls))
                figures.setdefault(f"{name} load+touch", []).append(
                    _timed(lambda load=load: _touch(load()), calls)
                )
        out[size] = figures
    return out


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(
    results: dict[str, dict[str, list[float]]],
    directory: str,
    args: Any,
    loads: tuple[float, float],
) -> str:
    """The Markdown table: ms per call (median, min-max of rounds) and fastckpt's ratios
    (``fastckpt-mmap``'s against safetensors' mapping too); ``loads``: the 1-minute load
    average before and after the run."""
    from fastckpt.bench.filesystems import filesystem_of

    lines = [
        f"Small states, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"commit {_commit()}, {os.cpu_count()} CPUs, load average {loads[0]:.1f} before, "
        f"{loads[1]:.1f} after, {directory} ({filesystem_of(directory)[0]}), {args.rounds} "
        f"interleaved rounds x {args.calls} calls (medians), {args.clock} clock",
        "",
        "| state | op | fastckpt ms | verify=False ms | mmap ms | safetensors ms | torch ms "
        "| atomic floor ms | fastckpt / safetensors | verify=False / safetensors "
        "| mmap / safetensors | floor / safetensors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, figures in results.items():
        for op in ("save", "load", "load+touch"):

            def ms(name: str, op: str = op, figures: dict[str, list[float]] = figures) -> str:
                v = figures.get(f"{name} {op}")
                if not v:
                    return "-"
                return f"{statistics.median(v) * 1e3:.2f} ({min(v) * 1e3:.2f}-{max(v) * 1e3:.2f})"

            med = {
                n: statistics.median(figures[f"{n} {op}"])
                for n in PEERS
                if figures.get(f"{n} {op}")
            }

            def ratio(a: str, b: str, med: dict[str, float] = med) -> str:
                return f"{med[a] / med[b]:.2f}" if a in med and b in med else "-"

            lines.append(
                f"| {size} | {op} | {ms('fastckpt')} | {ms('fastckpt-noverify')} "
                f"| {ms('fastckpt-mmap')} | {ms('safetensors')} | {ms('torch')} "
                f"| {ms('atomic-floor')} | {ratio('fastckpt', 'safetensors')} "
                f"| {ratio('fastckpt-noverify', 'safetensors')} "
                f"| {ratio('fastckpt-mmap', 'safetensors')} | {ratio('atomic-floor', 'safetensors')} |"
            )
    lines += [
        "",
        "save: until durable (fastckpt: fsync, rename, fsync of the directory; the others: "
        "fsync of the file). load: from memory; the mappings (fastckpt mmap, safetensors' "
        "load_file) read nothing until touched: `load+touch` reads one byte of every page.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/work/bench-tmp", help="disk directory (hot)")
    parser.add_argument("--shm", default="/dev/shm", help="memory file system (tmpfs)")
    parser.add_argument(
        "--regime", default="tmpfs,hot", help="comma list of tmpfs, hot (default both)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--calls", type=int, default=9, help="calls per method per round")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="time calls by the wall clock (default) or by this process's CPU time",
    )
    args = parser.parse_args(argv)
    global _clock
    _clock = CLOCKS[args.clock]
    places = {"tmpfs": args.shm, "hot": args.dir}
    regimes = [r.strip() for r in args.regime.split(",") if r.strip()]
    unknown = set(regimes) - set(places)
    if unknown:
        parser.error(f"unknown regime {sorted(unknown)[0]!r} (tmpfs, hot)")
    for regime in regimes:
        directory = os.path.join(places[regime], f"small-{os.getpid()}")
        os.makedirs(directory)
        before = os.getloadavg()[0]
        try:
            results = measure(directory, args.rounds, args.calls)
        finally:
            for name in os.listdir(directory):
                os.unlink(os.path.join(directory, name))
            os.rmdir(directory)
        print(f"### {regime}\n")
        print(report(results, places[regime], args, (before, os.getloadavg()[0])))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
