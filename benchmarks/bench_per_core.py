#!/usr/bin/env python3
"""What each byte of a checkpoint costs a CPU core, and how many cores a faster machine needs.

Measures, on one core, over a buffer larger than the caches (``--size``, default 1 GiB):
CRC32C (fastckpt's hardware path), XXH3-128 (the content hash every save records), a plain
streaming copy, the copy with CRC32C in the same pass (what a direct save does per byte), and
a read from the page cache with CRC32C (what a hot load does per byte). Then projects the
cores each step needs at a target device speed (default: the 8x Gen5 NVMe machine of
DeepSpeed's DeepNVMe figures, 26 GB/s write and 48 GB/s read):

* save: copy+CRC32C into staging and XXH3-128, per byte written;
* load: CRC32C per byte read (O_DIRECT reads land by DMA; ``verify=False`` removes it).

Example::

    python benchmarks/bench_per_core.py --size 1G --write-gbps 26 --read-gbps 48
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch
import xxhash

from fastckpt import _C


def _rate(nbytes: int, fn: Callable[[], object], repeats: int) -> float:
    """GB/s of ``fn`` over ``nbytes`` (median of ``repeats``, after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / 1e9


def measure(nbytes: int, repeats: int) -> dict[str, float]:
    """Per-core GB/s of each step."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src).fill_(0)
    view = (ctypes.c_char * nbytes).from_address(src.data_ptr())
    rates = {
        "CRC32C": _rate(nbytes, lambda: _C.crc32c(src.data_ptr(), nbytes), repeats),
        "XXH3-128": _rate(nbytes, lambda: xxhash.xxh3_128(view).digest(), repeats),
        "copy (streaming)": _rate(
            nbytes, lambda: _C.memcpy(dst.data_ptr(), src.data_ptr(), nbytes, 1), repeats
        ),
        "copy + CRC32C, one pass": _rate(
            nbytes,
            lambda: _C.memcpy_crc(dst.data_ptr(), src.data_ptr(), nbytes, [], 1),
            repeats,
        ),
    }
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.write(src.numpy().tobytes())
        f.flush()
        fd = f.fileno()
        rates["page-cache read + CRC32C"] = _rate(
            nbytes, lambda: _C.pread_crc(fd, dst.data_ptr(), nbytes, 0, [], True, f.name), repeats
        )
        rates["page-cache read"] = _rate(
            nbytes, lambda: _C.pread_crc(fd, dst.data_ptr(), nbytes, 0, [], False, f.name), repeats
        )
    return rates


def main(argv: list[str] | None = None) -> int:
    from fastckpt.config import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write-gbps", type=float, default=26.0)
    parser.add_argument("--read-gbps", type=float, default=48.0)
    args = parser.parse_args(argv)
    rates = measure(parse_size(args.size), args.repeats)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, one core per step\n")
    print("| step | GB/s per core | ms per GB |")
    print("|---|---:|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | {1000 / rate:.0f} |")
    save = 1 / rates["copy + CRC32C, one pass"] + 1 / rates["XXH3-128"]
    load = 1 / rates["CRC32C"]
    print(
        f"\nsave at {args.write_gbps:g} GB/s: copy+CRC32C and XXH3-128 = {save * 1000:.0f} ms "
        f"of core time per GB -> {args.write_gbps * save:.1f} cores busy"
    )
    print(
        f"load at {args.read_gbps:g} GB/s: CRC32C = {load * 1000:.0f} ms per GB -> "
        f"{args.read_gbps * load:.1f} cores busy (0 with verify=False)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
