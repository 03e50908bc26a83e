#!/usr/bin/env python3
"""Read once across ranks against every rank reading: bytes asked of storage and load time
of a replicated model, at 2, 4 and 8 ranks (processes on this machine, gloo on loopback).

Storage is throttled so that it is the bottleneck, as on a cluster: every read of tensor
bytes first reserves its bytes from a token bucket and sleeps until the bucket has passed
them, then reads the file through the page cache (the benchmark has just written it, so its
pages are in memory and the read itself costs only a copy).

* ``--storage filer`` (default): one bucket shared by every rank (a lock and a clock in a
  file under ``/dev/shm``), the shared file system or object store that a job's ranks all
  read from: ``--bandwidth`` is what the job gets of it, whatever the number of readers.
* ``--storage link``: a bucket per rank, each node's own link to storage (every rank is a
  node here): ``--bandwidth`` per rank.

Every round loads the checkpoint once each way, alternating which goes first (the machine
drifts): ``fastckpt.load(storage)`` on every rank alone, and
``fastckpt.load(storage, group=True)``. A load's time is the slowest rank's, from a barrier
to the moment it holds every tensor. Bytes are counted by the storage wrapper (tensor bytes
asked of storage by all ranks together; the headers, read by every rank, are counted apart).
Printed per world size and mode: the median time with min-max, bytes read as a multiple of
the checkpoint's unique bytes, and the ratio of read-once to every-rank-reads medians; with
the machine's load average before and after.

Example::

    python benchmarks/bench_read_once.py --size 1G --bandwidth 500M --ranks 2,4,8 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import gc
import os
import resource
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.config import parse_size  # noqa: E402
from fastckpt.distributed.groups import checkpoint_group  # noqa: E402
from fastckpt.storage.base import Storage  # noqa: E402
from fastckpt.storage.local import LocalStorage  # noqa: E402

#: Tensors of the replicated model: this many bytes each (a transformer's large matrices).
TENSOR_BYTES = 16 << 20


class Bucket:
    """A token bucket of ``rate`` bytes/s: :meth:`take` returns once its bytes have passed.

    Shared between processes through ``path`` (8 bytes: the time the bucket is next free,
    under an ``flock``), so that readers queue for the bandwidth as they would at one filer.
    """

    def __init__(self, path: str, rate: float):
        self.path, self.rate = path, rate

    def take(self, nbytes: int) -> None:
        with open(self.path, "r+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            raw = f.read(8)
            free_at = struct.unpack("d", raw)[0] if len(raw) == 8 else 0.0
            done = max(time.monotonic(), free_at) + nbytes / self.rate
            f.seek(0)
            f.write(struct.pack("d", done))
            fcntl.flock(f, fcntl.LOCK_UN)
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class ThrottledStorage(Storage):
    """A local file whose ranged reads pass through a :class:`Bucket` first, counted."""

    def __init__(self, path: str, bucket: Bucket, counts: dict[str, int]):
        self.inner = LocalStorage(path)
        self.location = self.inner.location
        self.header_probe = self.inner.header_probe
        self.bucket, self.counts = bucket, counts

    def size(self) -> int:
        return self.inner.size()

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        self.counts["header"] += nbytes
        return self.inner.read_bytes(offset, nbytes)

    def read_spans(self, spans, *, owner, mode, checksum, on_progress=None):
        nbytes = sum(span.nbytes for span in spans)
        self.counts["data"] += nbytes
        self.bucket.take(nbytes)
        return self.inner.read_spans(
            spans, owner=owner, mode=mode, checksum=checksum, on_progress=on_progress
        )

    def choose_mode(self, region):
        return "buffered", "throttled storage (the page cache, paced by the bucket)"

    def span_bytes(self, total: int, mode: str) -> int:
        return self.inner.span_bytes(total, mode)

    def write_atomically(self, pieces, total):
        raise NotImplementedError("the benchmark's storage is read-only")

    def delete(self) -> None:
        raise NotImplementedError("the benchmark's storage is read-only")

    def close(self) -> None:
        self.inner.close()


def write_model(path: str, nbytes: int) -> int:
    """A replicated model's checkpoint of ``nbytes`` (tensors of TENSOR_BYTES, and a few
    small ones); returns its unique tensor bytes."""
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(max(1, nbytes // TENSOR_BYTES)):
        state[f"layers.{i}.weight"] = torch.randn(TENSOR_BYTES // 4, generator=g).view(-1, 1024)
        state[f"layers.{i}.norm"] = torch.randn(1024, generator=g)
    fastckpt.save(state, path)
    return sum(t.nbytes for t in state.values())


def rank_main(rank: int, world: int, port: int, args: Any, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    bucket_path = args.bucket if args.storage == "filer" else f"{args.bucket}.{rank}"
    if args.storage == "link":
        with open(bucket_path, "wb") as f:
            f.write(b"\0" * 8)
    bucket = Bucket(bucket_path, parse_size(args.bandwidth))
    group = checkpoint_group()
    rows = []
    for r in range(args.rounds):
        modes = args.modes if r % 2 == 0 else args.modes[::-1]
        for mode in modes:
            counts = {"data": 0, "header": 0}
            storage = ThrottledStorage(args.file, bucket, counts)
            dist.barrier(group)
            start = time.perf_counter()
            state = fastckpt.load(storage, group=group if mode == "read-once" else None)
            elapsed = time.perf_counter() - start
            assert len(state) == args.tensors, len(state)
            del state
            gc.collect()  # a loaded object's tensors can sit in a reference cycle until then
            figures = torch.tensor([elapsed, counts["data"], counts["header"]], dtype=torch.float64)
            slowest = figures[:1].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(figures, group=group)
            rows.append((mode, float(slowest), int(figures[1]), int(figures[2])))
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr((rows, int(peak) << 10)))
    dist.barrier(group)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G", help="checkpoint size (default 1G = 1 GiB)")
    parser.add_argument("--bandwidth", default="500M", help="storage bytes/s (default 500M)")
    parser.add_argument("--storage", choices=("filer", "link"), default="filer")
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="where the file lives (its pages stay cached)"
    )
    parser.add_argument(
        "--modes", default="alone,read-once", help="what to time (a memory check: one)"
    )
    args = parser.parse_args()
    args.modes = tuple(args.modes.split(","))
    worlds = [int(w) for w in args.ranks.split(",")]
    rate = parse_size(args.bandwidth)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fastckpt-read-once-") as work:
        args.file = os.path.join(work, "model.safetensors")
        unique = write_model(args.file, parse_size(args.size))
        with fastckpt.open(args.file) as r:
            args.tensors = len(r.keys())
        args.bucket = os.path.join(work, "bucket")
        print(
            f"fastckpt {commit}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
            f"UTC, {os.cpu_count()} CPUs; checkpoint {unique / 2**30:.2f} GiB "
            f"({args.tensors} tensors) in {args.dir}; storage: {args.storage} at "
            f"{rate / 1e6:.0f} MB/s {'shared by all ranks' if args.storage == 'filer' else 'per rank'}"
        )
        print(f"load average before: {load_average()}")
        print(
            f"{'ranks':>5} {'mode':>10} {'median s':>9} {'min-max s':>13} "
            f"{'read/unique':>11} {'headers':>9} {'vs alone':>8}"
        )
        for world in worlds:
            with open(args.bucket, "wb") as f:
                f.write(b"\0" * 8)
            out = os.path.join(work, f"rows.{world}")
            mp.start_processes(
                rank_main,
                args=(world, free_port(), args, out),
                nprocs=world,
                start_method="spawn",
            )
            with open(out) as f:
                rows, peak = eval(f.read())  # noqa: S307 - written by this benchmark's rank 0
            medians = {}
            for mode in args.modes:
                times = [t for m, t, _, _ in rows if m == mode]
                data = [d for m, _, d, _ in rows if m == mode]
                headers = [h for m, _, _, h in rows if m == mode]
                medians[mode] = statistics.median(times)
                ratio = medians[mode] / medians.get("alone", medians[mode])
                print(
                    f"{world:>5} {mode:>10} {medians[mode]:>9.2f} "
                    f"{min(times):>6.2f}-{max(times):<6.2f} {max(data) / unique:>11.2f} "
                    f"{max(headers) / 1024:>7.0f}K {ratio:>8.2f}"
                )
            print(f"{'':>5} peak RSS of a rank (both modes): {peak / 2**30:.2f} GiB")
        print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
