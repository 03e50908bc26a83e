#!/usr/bin/env python3
"""Small states: the fixed cost of one save and one load, fastckpt against safetensors and
torch, in one process, on one file system.

A training script that checkpoints a small model (an adapter, a probe, a 1 MiB
``Linear(512, 512)``) every few steps pays each call's fixed costs: threads, engine setup,
probes, preallocation, fsyncs. This bench times them at 64 KiB, 1 MiB and 16 MiB:

* saves, until durable: ``fastckpt.save`` (atomic: fsync of the file, rename, fsync of the
  directory), ``safetensors.torch.save_file`` + fsync of the file, ``torch.save`` + fsync;
* loads, of the file just written (so from the page cache, as a reload in the same job
  is): ``fastckpt.load`` (CRC32C verified, as by default), ``safetensors.torch.load_file``
  (a lazy mapping: nothing is read until touched) and ``torch.load``; then the same with
  every page of every tensor touched, which is what the mapping defers.

Rounds are interleaved (every method once per round, the order rotated each round) so a
noisy disk or a busy CPU hits all alike; each figure is the median over rounds of the
median of ``--calls`` calls per round. Ratios are fastckpt's time over safetensors' (lower
is better; the targets are <= 1.5 for saves and <= 2 for loads).

Example::

    python benchmarks/bench_small_states.py --dir /work/bench-tmp --rounds 5
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


def methods(directory: str) -> dict[str, tuple[Callable[[Any], None], Callable[[], Any]]]:
    """name -> (save(state), load() -> state), each on its own file in ``directory``."""
    import safetensors.torch

    import fastckpt

    fc, st, pt = (os.path.join(directory, n) for n in ("s.fastckpt", "s.st", "s.pt"))

    def st_save(state: Any) -> None:
        safetensors.torch.save_file(state, st)
        _fsync(st)

    def pt_save(state: Any) -> None:
        torch.save(state, pt)
        _fsync(pt)

    return {
        "fastckpt": (lambda s: fastckpt.save(s, fc), lambda: fastckpt.load(fc)),
        "safetensors": (st_save, lambda: safetensors.torch.load_file(st)),
        "torch": (pt_save, lambda: torch.load(pt, weights_only=True)),
    }


def _timed(fn: Callable[[], Any], calls: int) -> float:
    """Median seconds of ``calls`` calls."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
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
            save(state)
            _touch(load())
        order = list(named)
        for r in range(rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                save, load = named[name]
                figures.setdefault(f"{name} save", []).append(
                    _timed(lambda save=save, state=state: save(state), calls)
                )
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


def report(results: dict[str, dict[str, list[float]]], directory: str, args: Any) -> str:
    """The Markdown table: ms per call (median, min-max of rounds) and fastckpt's ratios."""
    from fastckpt.bench.filesystems import filesystem_of

    load = os.getloadavg()
    lines = [
        f"Small states, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"commit {_commit()}, {os.cpu_count()} CPUs, load average {load[0]:.1f}, "
        f"{directory} ({filesystem_of(directory)[0]}), {args.rounds} interleaved rounds x "
        f"{args.calls} calls (medians)",
        "",
        "| state | op | fastckpt ms | safetensors ms | torch ms | fastckpt / safetensors "
        "| fastckpt / torch |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for size, figures in results.items():
        for op in ("save", "load", "load+touch"):

            def ms(name: str, op: str = op, figures: dict[str, list[float]] = figures) -> str:
                v = figures[f"{name} {op}"]
                return f"{statistics.median(v) * 1e3:.2f} ({min(v) * 1e3:.2f}-{max(v) * 1e3:.2f})"

            med = {
                n: statistics.median(figures[f"{n} {op}"])
                for n in ("fastckpt", "safetensors", "torch")
            }
            lines.append(
                f"| {size} | {op} | {ms('fastckpt')} | {ms('safetensors')} | {ms('torch')} "
                f"| {med['fastckpt'] / med['safetensors']:.2f} | {med['fastckpt'] / med['torch']:.2f} |"
            )
    lines += [
        "",
        "save: until durable (fastckpt: fsync, rename, fsync of the directory; the others: "
        "fsync of the file). load: from the page cache; safetensors' load_file maps the file "
        "lazily, so its `load` reads nothing: `load+touch` reads every page.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/work/bench-tmp", help="directory to save in")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--calls", type=int, default=9, help="calls per method per round")
    args = parser.parse_args(argv)
    directory = os.path.join(args.dir, f"small-{os.getpid()}")
    os.makedirs(directory)
    try:
        results = measure(directory, args.rounds, args.calls)
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    print(report(results, args.dir, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
