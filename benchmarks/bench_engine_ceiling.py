#!/usr/bin/env python3
"""Where fastckpt's disk path stands against the device, step by step, in one run.

Each round (the order rotated from round to round) measures, on one file system:

* the device: fio's sequential O_DIRECT write (io_uring, 4 MiB x 32, ``end_fsync``) and
  cold read of ``--size`` bytes, and the same with plain threads (:mod:`fastckpt.bench.ceilings`);
* the raw engine: one ``aio_handle`` write (+ fsync) and cold read of one aligned buffer of
  ``--size`` bytes with the configuration saves and loads use on that file system (no format,
  no staging copy, no checksum): the engine's own figure beside fio's;
* ``fastckpt.save`` of an LLM-like state of ``--size`` bytes with O_DIRECT, with and without
  checksums (the CRC32C + XXH3 pass), and through the page cache; ``safetensors`` + fsync;
* cold ``fastckpt.load`` in each read mode and safetensors' ``load_file`` with every page
  touched.

So a gap between fastckpt and fio splits into the engine's share (raw engine against fio),
the staging copy and checksums' share (save with and without checksums against the raw
engine), and the atomic commit's. Figures: GB/s (1e9 bytes/s), median and min-max of the
rounds. Cold reads drop the page cache (root) before each.

Example::

    python benchmarks/bench_engine_ceiling.py --dir /work/bench-tmp --size 1G --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent


def _steps(directory: str, nbytes: int) -> dict[str, Callable[[], float]]:
    """name -> a step returning the seconds it timed (set-up outside the clock)."""
    import time

    from safetensors.torch import load_file, save_file

    import fastckpt
    from fastckpt.bench.caches import PageCache, make_durable
    from fastckpt.bench.ceilings import direct_preadv_file, direct_pwrite_file
    from fastckpt.bench.checks import touch
    from fastckpt.bench.fio import FIO_LOCKED, fio_path, fio_sequential
    from fastckpt.bench.rawio import make_buffer, make_handle, timed_read, timed_write
    from fastckpt.bench.synthetic import llm_like_state_dict
    from fastckpt.config import READ_MODES, force_read_mode, resolve_io

    cache = PageCache()
    state = llm_like_state_dict(nbytes)
    raw = make_buffer(nbytes)
    handle = make_handle(resolve_io(directory, {}))
    path = {k: os.path.join(directory, f"x.{k}") for k in ("fio", "dio", "raw", "fc", "st")}

    def clock(fn: Callable[[], Any]) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    def fio(kind: str) -> float:
        if kind == "read":
            cache.drop([path["fio"]])
        elif os.path.exists(path["fio"]):
            # a new file, as a checkpoint is: fio overwriting its own file of the round
            # before (blocks already allocated) measured 2.95 GB/s here against 2.19 fresh
            os.unlink(path["fio"])
        out = fio_sequential(kind, path["fio"], nbytes, bs="4M", extra=FIO_LOCKED)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out["seconds"]

    def cold(p: str, fn: Callable[[], Any]) -> float:
        cache.drop([p])
        return clock(fn)

    def fc_load(mode: str) -> Callable[[], float]:
        def run() -> float:
            force_read_mode(mode)
            try:
                return cold(path["fc"], lambda: touch(fastckpt.load(path["fc"])))
            finally:
                force_read_mode(None)

        return run

    def st_save() -> None:
        save_file(state, path["st"])
        make_durable(path["st"])

    steps: dict[str, Callable[[], float]] = {}
    if fio_path() is not None:
        steps["fio write (O_DIRECT, io_uring 4M x32)"] = lambda: fio("write")
        steps["fio read (O_DIRECT, io_uring 4M x32)"] = lambda: fio("read")
    steps |= {
        "threads O_DIRECT write (4M x16)": lambda: direct_pwrite_file(path["dio"], nbytes),
        "threads O_DIRECT read (4M x16)": lambda: cold(
            path["dio"], lambda: direct_preadv_file(path["dio"])
        ),
        "raw engine write (aio_handle)": lambda: timed_write(handle, raw, [path["raw"]]),
        "raw engine read (aio_handle)": lambda: timed_read(handle, raw, [path["raw"]], cache),
        "fastckpt.save, O_DIRECT": lambda: clock(
            lambda: fastckpt.save(state, path["fc"], direct_io=True)
        ),
        "fastckpt.save, O_DIRECT, no checksums": lambda: clock(
            lambda: fastckpt.save(state, path["fc"] + ".nc", direct_io=True, checksum=False)
        ),
        "fastckpt.save, buffered": lambda: clock(
            lambda: fastckpt.save(state, path["fc"] + ".b", direct_io=False)
        ),
        "fastckpt.save, default": lambda: clock(lambda: fastckpt.save(state, path["fc"])),
        "safetensors save_file + fsync": lambda: clock(st_save),
        **{f"fastckpt.load, {mode}": fc_load(mode) for mode in READ_MODES},
        "fastckpt.load, default": lambda: cold(
            path["fc"], lambda: touch(fastckpt.load(path["fc"]))
        ),
        "safetensors load_file (touched)": lambda: cold(
            path["st"], lambda: touch(load_file(path["st"]))
        ),
    }
    return steps


def _settle() -> None:
    """Each step starts on a quiet disk: the blocks of files earlier steps replaced or removed
    are freed (and, on a ``discard`` mount, discarded) and written-back before the clock
    starts, not during the next step."""
    from fastckpt.io import released_files

    released_files.wait()
    os.sync()


def main(argv: list[str] | None = None) -> int:
    from fastckpt.bench.filesystems import filesystem_of
    from fastckpt.bench.units import format_bytes
    from fastckpt.config import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/work/bench-tmp")
    parser.add_argument("--size", default="1G", help="bytes per step (default 1G)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    nbytes = parse_size(args.size)
    directory = os.path.join(args.dir, f"engine-{os.getpid()}")
    os.makedirs(directory)
    figures: dict[str, list[float]] = {}
    try:
        steps = _steps(directory, nbytes)
        names = list(steps)
        # writes before the reads of what they wrote, within a round; rounds rotate the
        # order of the groups (device, engine, saves, loads)
        groups = [names[i : i + 2] for i in range(0, 6, 2)] + [names[6:11], names[11:]]
        for r in range(args.rounds):
            for group in groups[r % len(groups) :] + groups[: r % len(groups)]:
                for name in group:
                    print(f"round {r + 1}: {name}", file=sys.stderr, flush=True)
                    _settle()
                    figures.setdefault(name, []).append(nbytes / steps[name]() / 1e9)
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"{format_bytes(nbytes)} on {args.dir} ({filesystem_of(args.dir)[0]}), "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, "
        f"load average {os.getloadavg()[0]:.1f}, {args.rounds} interleaved rounds\n"
    )
    fio_w = statistics.median(figures.get("fio write (O_DIRECT, io_uring 4M x32)", [float("nan")]))
    fio_r = statistics.median(figures.get("fio read (O_DIRECT, io_uring 4M x32)", [float("nan")]))
    print("| step | GB/s (median) | min-max | x fio |")
    print("|---|---:|---:|---:|")
    for name, values in figures.items():
        med = statistics.median(values)
        ref = fio_r if "read" in name or "load" in name else fio_w
        print(f"| {name} | {med:.2f} | {min(values):.2f}-{max(values):.2f} | {med / ref:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
