"""The DeepNVMe API against the disk's ceiling: every engine x intra_op_parallelism, and fio.

A 2 GiB page-locked tensor (``aio_handle.new_cpu_locked_tensor``) is written with
``sync_pwrite`` (O_DIRECT, then fsync of the file) and read back cold with ``sync_pread``
(page cache dropped first when run as root) by each available engine with
``intra_op_parallelism`` in {1, 2, 4, 8}. fio runs on the same directory in the same run
when installed; its best sequential figure is the ceiling each configuration is compared to.
Configurations are interleaved and rotated per round; medians of ``--repeats`` rounds.

Every figure is in GB/s, 10**9 bytes per second (fio's unit too). DeepSpeed's ``ds_io``
prints "GB/sec" figures that are GiB/s (2**30 bytes per second): divide these by 1.074 to
set them beside DeepSpeed's.

Run:
    python benchmarks/bench_aio.py --dir /path/on/the/disk [--size 2G] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

import fastckpt
from fastckpt.aio import aio_handle
from fastckpt.bench.caches import PageCache, drop_page_cache, fsync_path
from fastckpt.bench.filesystems import filesystem_of
from fastckpt.bench.fio import FIO_LOCKED, fio_sequential, fio_version
from fastckpt.bench.units import median
from fastckpt.config import parse_size

PARALLELISM = (1, 2, 4, 8)
# fio's sequential figure is the best of these (block size, queue depth, engine, options).
# Page-locked, registered buffers matter on virtual machines, where pinning ordinary pages
# for each direct transfer is slow: our tensor is locked, so fio gets to lock its memory too.
FIO_JOBS = (
    ("1M", 32, "io_uring", ()),
    ("4M", 32, "io_uring", ()),
    ("1M", 32, "libaio", ()),
    ("1M", 32, "io_uring", FIO_LOCKED),
    ("4M", 32, "io_uring", FIO_LOCKED),
)


def measure(
    engine: str, parallelism: int, buffer: torch.Tensor, path: str, args: argparse.Namespace
) -> tuple[float, float]:
    """(write GB/s, read GB/s) of one configuration, GB being 10**9 bytes."""
    handle = aio_handle(
        block_size=args.block_size,
        queue_depth=args.queue_depth,
        intra_op_parallelism=parallelism,
        engine=engine,
    )
    nbytes = buffer.numel()
    start = time.perf_counter()
    handle.sync_pwrite(buffer, path)
    fsync_path(path)
    write = nbytes / (time.perf_counter() - start) / 1e9
    drop_page_cache([path])
    start = time.perf_counter()
    handle.sync_pread(buffer, path)
    read = nbytes / (time.perf_counter() - start) / 1e9
    return write, read


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        default=str(Path(__file__).resolve().parents[2] / "bench-tmp"),
        help="directory on the disk to measure (default: ../bench-tmp)",
    )
    parser.add_argument("--size", default="2G", help="bytes per transfer (default 2G)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians reported")
    parser.add_argument("--block-size", type=parse_size, default=1 << 20)
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--no-fio", action="store_true", help="skip fio even when installed")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    nbytes = parse_size(args.size)

    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="fastckpt-aio-", dir=args.dir)
    path = os.path.join(work, "data.bin")
    engines = [
        name for name, info in fastckpt.engines().items() if info.available and name != "gds"
    ]
    configs = [(e, p) for e in engines for p in PARALLELISM]
    fio_on = not args.no_fio and fio_version() is not None
    fstype, device, _ = filesystem_of(args.dir)
    print(
        f"{nbytes / 2**30:.2f} GiB x {args.repeats} rounds in {work} ({fstype} {device}); "
        f"reads cold by {'drop_caches' if PageCache().can_drop else 'fadvise(DONTNEED)'}; "
        f"block_size={args.block_size} queue_depth={args.queue_depth}",
        flush=True,
    )

    handle = aio_handle()
    buffer = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for round_index in range(args.repeats):
            shift = round_index % len(configs)
            for engine, par in configs[shift:] + configs[:shift]:
                write, read = measure(engine, par, buffer, path, args)
                slot = results.setdefault(f"{engine} x{par}", {"write": [], "read": []})
                slot["write"].append(write)
                slot["read"].append(read)
                print(
                    f"round {round_index + 1}: {engine:9s} par {par}: write {write:5.2f}  read {read:5.2f} GB/s",
                    flush=True,
                )
            if fio_on:
                for bs, depth, ioengine, extra in FIO_JOBS:
                    for rw in ("write", "read"):
                        if rw == "read":
                            drop_page_cache([path])
                        got = fio_sequential(
                            rw, path, nbytes, bs=bs, iodepth=depth, ioengine=ioengine, extra=extra
                        )
                        if "error" in got:
                            print(f"fio {rw}: {got['error']}", flush=True)
                            continue
                        locked = " locked" if extra else ""
                        slot = results.setdefault(
                            f"fio {ioengine} bs{bs} qd{depth}{locked}", {"write": [], "read": []}
                        )
                        slot[rw].append(got["gbps"])
                print(f"round {round_index + 1}: fio done", flush=True)
    finally:
        handle.free_cpu_locked_tensor(buffer)
        for name in os.listdir(work):
            os.unlink(os.path.join(work, name))
        os.rmdir(work)

    table = {name: {rw: median(v) for rw, v in sides.items()} for name, sides in results.items()}
    fio_best = {
        rw: max(
            (m[rw] for name, m in table.items() if name.startswith("fio") and m[rw]), default=None
        )
        for rw in ("write", "read")
    }
    print(
        f"\n## aio engines x intra_op_parallelism — {nbytes / 2**30:.2f} GiB locked tensor, "
        f"median of {args.repeats}\n"
    )
    print(
        f"machine: {os.cpu_count()} CPUs, kernel {platform.release()}; torch {torch.__version__}\n"
    )
    print("| configuration | write GB/s | min–max | % of fio | read GB/s | min–max | % of fio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, sides in results.items():
        cells = []
        for rw in ("write", "read"):
            values = sides[rw]
            if not values:
                cells += ["n/a", "", ""]
                continue
            ratio = f"{100 * table[name][rw] / fio_best[rw]:.0f}%" if fio_best[rw] else "n/a"
            cells += [f"{table[name][rw]:.2f}", f"{min(values):.2f}–{max(values):.2f}", ratio]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nGB/s: 10^9 bytes per second (DeepSpeed's ds_io prints GiB/s, 2^30 bytes, as GB/sec).")
    print()
    for rw in ("write", "read"):
        ours = {n: m[rw] for n, m in table.items() if not n.startswith("fio")}
        best = max(ours, key=ours.get)
        if fio_best[rw]:
            share = ours[best] / fio_best[rw]
            verdict = "met" if share >= 0.9 else "NOT met"
            print(
                f"- best {rw}: {best} at {ours[best]:.2f} GB/s = {100 * share:.0f}% of fio's best "
                f"{fio_best[rw]:.2f} GB/s (target >= 90%: {verdict})"
            )
        else:
            print(f"- best {rw}: {best} at {ours[best]:.2f} GB/s (fio not run)")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"raw": results, "median": table, "fio_best": fio_best}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
