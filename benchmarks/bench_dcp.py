"""torch.distributed.checkpoint: fastckpt's FastCkptWriter/Reader against DCP's own
FileSystemWriter/Reader, with the disk's ceilings for the same bytes, in one run.

For each world size (``--ranks``), that many ranks (spawned processes, gloo on loopback) hold
a state dict of DTensors sharded along dim 0, ``--per-rank`` bytes each, and in every round
(methods in a rotating order) time:

- save: ``dcp.save`` with FastCkptWriter, and with FileSystemWriter at each ``--thread-counts``
  (its best is reported); both fsync their files, so both are timed to durability;
- load: ``dcp.load`` with FastCkptReader and FileSystemReader, each from files whose pages
  were evicted first (posix_fadvise DONTNEED after fsync: cold reads, no global cache drop);
- async: how long ``dcp.async_save`` blocks the caller (and the time until its future is
  done), FastCkptWriter (which stages into fastckpt's page-locked buffers) against DCP's
  default (``checkpoint_id=`` only: its DefaultStager and FileSystemWriter).

Reshard (``--reshard-from 2 --reshard-to 4``): a checkpoint saved by 2 ranks is loaded cold
by 4, each of which needs half of one stored shard. Timed side by side: FastCkptReader (which
reads only the checksummed pieces each rank needs), FastCkptReader on the same checkpoint
saved without piece checksums (it then reads and verifies whole stored shards, as it did
before piece checksums existed) and FileSystemReader. Bytes read per rank are reported twice:
what the reader asked of its files (``FastCkptReader.bytes_read``) and what the kernel read
from storage (``read_bytes`` of ``/proc/self/io``).

The ceilings are the disk's: the same total bytes written as one file per rank, all at once,
with parallel O_DIRECT writes and fsync, then read back cold with parallel O_DIRECT reads
(fastckpt's native engine, page-locked buffers). Times are the slowest rank's, medians over
``--repeat`` rounds.

Run: python benchmarks/bench_dcp.py --ranks 2 4 --per-rank 512M --repeat 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from typing import Any

from fastckpt.bench.filesystems import filesystem_of
from fastckpt.bench.report import fmt, log
from fastckpt.bench.results import rotate
from fastckpt.bench.units import format_bytes, median
from fastckpt.config import parse_size

TENSOR_BYTES = 64 << 20  # each rank's shard of one weight


# ------------------------------------------------------------------------------- ranks


def _evict(directory: str) -> None:
    """Drops the page-cache pages of every file in ``directory`` (cold reads without root)."""
    for entry in os.scandir(directory):
        if entry.is_file():
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _state(world: int, per_rank: int, fill: bool, saved_by: int | None = None) -> dict[str, Any]:
    """The state of one rank of ``world``; ``per_rank`` is each rank's share when ``saved_by``
    ranks (default ``world``) hold it, so a state saved by 2 can be loaded by 4."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    saved_by = saved_by or world
    mesh = init_device_mesh("cpu", (world,))
    cols = 4096
    rows = TENSOR_BYTES // 4 // cols  # per rank of saved_by
    local_rows = rows * saved_by // world
    state: dict[str, Any] = {}
    for i in range(max(1, per_rank // TENSOR_BYTES)):
        local = torch.randn(local_rows, cols) if fill else torch.zeros(local_rows, cols)
        state[f"layers.{i}.weight"] = DTensor.from_local(
            local,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=(rows * saved_by, cols),
            stride=(cols, 1),
        )
    state["step"] = 1000
    return state


def _join_group(rank: int, world: int, port: int) -> None:
    """This rank joins the gloo process group of ``world`` ranks on a loopback port."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=1800),
    )


def _rank_main(rank: int, world: int, port: int, options: dict[str, Any]) -> None:
    warnings.filterwarnings("ignore")  # DCP's overwrite and deprecation notices
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fastckpt.dcp import FastCkptReader, FastCkptWriter

    _join_group(rank, world, port)
    folder = options["folder"]
    state = _state(world, options["per_rank"], fill=True)
    target = _state(world, options["per_rank"], fill=False)
    ours_writer = FastCkptWriter(os.path.join(folder, "ours-async"))
    times: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        dist.barrier()
        start = time.perf_counter()
        fn()
        seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank decides
        times.setdefault(name, []).append(float(seconds))

    def evict(directory: str) -> None:
        dist.barrier()
        if rank == 0:
            _evict(directory)

    def async_run(name: str, call) -> None:
        dist.barrier()
        start = time.perf_counter()
        future = call()
        blocked = time.perf_counter() - start
        future.result()
        total = time.perf_counter() - start
        ours_writer.wait_for_cleanup()  # untimed, as for the synchronous save
        both = torch.tensor([blocked, total], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        times.setdefault(f"{name}-block", []).append(float(both[0]))
        times.setdefault(f"{name}-total", []).append(float(both[1]))

    def save_ours() -> None:
        writer = FastCkptWriter(ours)
        timed("save-fastckpt", lambda: dcp.save(state, storage_writer=writer))
        # Untimed: the replaced files are removed after the commit, beside the caller; wait,
        # so that the next timed step does not share the disk with that removal.
        writer.wait_for_cleanup()

    ours = os.path.join(folder, "ours")
    theirs = os.path.join(folder, "theirs")
    steps = {
        "save-fastckpt": lambda: save_ours(),
        "load-fastckpt": lambda: (
            evict(ours),
            timed("load-fastckpt", lambda: dcp.load(target, storage_reader=FastCkptReader(ours))),
        ),
        "async-fastckpt": lambda: async_run(
            "async-fastckpt", lambda: dcp.async_save(state, storage_writer=ours_writer)
        ),
        "async-dcp": lambda: async_run(
            "async-dcp",
            lambda: dcp.async_save(state, checkpoint_id=os.path.join(folder, "theirs-async")),
        ),
    }
    for n in options["thread_counts"]:
        steps[f"save-dcp-t{n}"] = lambda n=n: timed(
            f"save-dcp-t{n}",
            lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs, thread_count=n)),
        )
    steps["load-dcp"] = lambda: (
        evict(theirs),
        timed("load-dcp", lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(theirs))),
    )
    order = list(steps)
    # Untimed warm-up: the loads need their checkpoints, and each async_save's first call
    # allocates its staging memory (FastCkptWriter keeps it for the next call; DCP's
    # default stager allocates on every call).
    dcp.save(state, storage_writer=FastCkptWriter(ours))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs))
    dcp.async_save(state, storage_writer=ours_writer).result()
    times.clear()
    for round_ in range(options["repeat"]):
        for name in rotate(order, round_):
            steps[name]()
        if rank == 0:
            log(f"{world} ranks: round {round_ + 1} of {options['repeat']} done")
    ours_writer.close()
    if rank == 0:
        with open(options["result"], "w", encoding="utf-8") as f:
            json.dump(times, f)
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


def _storage_reads() -> int:
    """Bytes this process has had read from storage (page-cache misses), per the kernel."""
    with open("/proc/self/io", encoding="ascii") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["read_bytes"])


def _reshard_main(rank: int, world: int, port: int, options: dict[str, Any]) -> None:
    """Saves with ``world`` ranks (phase "save") or loads cold with ``world`` ranks what
    ``options["saved_by"]`` ranks saved (phase "load"), timing each reader."""
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fastckpt.dcp import FastCkptReader, FastCkptWriter

    _join_group(rank, world, port)
    folder = options["folder"]
    paths = {name: os.path.join(folder, name) for name in ("pieces", "whole", "theirs")}
    if options["phase"] == "save":
        state = _state(world, options["per_rank"], fill=True)
        dcp.save(state, storage_writer=FastCkptWriter(paths["pieces"]))
        dcp.save(state, storage_writer=FastCkptWriter(paths["whole"], piece_size=0))
        dcp.save(state, storage_writer=dcp.FileSystemWriter(paths["theirs"]))
        dist.barrier()
        dist.destroy_process_group()
        return
    target = _state(world, options["per_rank"], fill=False, saved_by=options["saved_by"])
    readers = {
        "fastckpt": lambda: FastCkptReader(paths["pieces"]),
        "fastckpt-whole-shards": lambda: FastCkptReader(paths["whole"]),
        "dcp": lambda: dcp.FileSystemReader(paths["theirs"]),
    }
    where = {"fastckpt": "pieces", "fastckpt-whole-shards": "whole", "dcp": "theirs"}
    times: dict[str, list[float]] = {}
    read: dict[str, list[float]] = {}
    for make in readers.values():  # untimed: the first load of each imports what it needs
        dcp.load(target, storage_reader=make())
    for round_ in range(options["repeat"]):
        for name in rotate(list(readers), round_):
            dist.barrier()
            if rank == 0:
                _evict(paths[where[name]])
            dist.barrier()
            reader = readers[name]()
            before = _storage_reads()
            start = time.perf_counter()
            dcp.load(target, storage_reader=reader)
            seconds = time.perf_counter() - start
            counts = torch.tensor(
                [seconds, _storage_reads() - before, getattr(reader, "bytes_read", -1)],
                dtype=torch.float64,
            )
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # slowest rank, most bytes
            times.setdefault(name, []).append(float(counts[0]))
            read.setdefault(f"{name}-storage", []).append(float(counts[1]))
            read.setdefault(f"{name}-asked", []).append(float(counts[2]))
    if rank == 0:
        with open(options["result"], "w", encoding="utf-8") as f:
            json.dump({"times": times, "bytes": read}, f)
    dist.barrier()
    dist.destroy_process_group()


def _run_ranks(world: int, options: dict[str, Any], main: Any = None) -> Any:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(main or _rank_main, args=(world, port, options), nprocs=world)
    if not os.path.exists(options["result"]):
        return None
    with open(options["result"], encoding="utf-8") as f:
        return json.load(f)


def _reshard(base: str, save_ranks: int, load_ranks: int, per_rank: int, repeat: int) -> Any:
    """Figures of the reshard case (see the module's description)."""
    folder = tempfile.mkdtemp(prefix=f"reshard-{save_ranks}-{load_ranks}-", dir=base)
    options = {
        "folder": folder,
        "per_rank": per_rank,
        "repeat": repeat,
        "saved_by": save_ranks,
        "phase": "save",
        "result": os.path.join(folder, "result.json"),
    }
    log(f"reshard: saving with {save_ranks} ranks")
    _run_ranks(save_ranks, options, _reshard_main)
    log(f"reshard: loading with {load_ranks} ranks")
    result = _run_ranks(load_ranks, dict(options, phase="load"), _reshard_main)
    shutil.rmtree(folder)
    med = {k: median(v) for k, v in result["times"].items()}
    nbytes = {k: median(v) for k, v in result["bytes"].items()}
    total = save_ranks * per_rank
    print(
        f"\n## reshard: saved by {save_ranks} ranks x {format_bytes(per_rank)}, loaded cold by "
        f"{load_ranks} ranks (each needs {format_bytes(total // load_ranks)})"
    )
    print(f"  {'reader':<44} {'time':>10}  {'GB/s':>10}  {'asked/rank':>11}  {'storage/rank':>12}")
    labels = {
        "fastckpt": "FastCkptReader (piece checksums: ranges)",
        "fastckpt-whole-shards": "FastCkptReader (no piece checksums: shards)",
        "dcp": "FileSystemReader",
    }
    for name, label in labels.items():
        asked = nbytes[f"{name}-asked"]
        print(
            f"  {label:<44} {fmt(med[name], '8.3f', ' s')}  "
            f"{fmt(total / med[name] / 1e9, '6.2f', ' GB/s')}  "
            f"{format_bytes(int(asked)) if asked >= 0 else '-':>11}  "
            f"{format_bytes(int(nbytes[f'{name}-storage'])):>12}"
        )
    return {"medians": med, "bytes_per_rank": nbytes}


# ------------------------------------------------------------------------------ ceilings


def _ceilings(folder: str, world: int, per_rank: int, repeat: int) -> dict[str, float]:
    """Seconds for the disk to write (with fsync) and read (cold, O_DIRECT) ``world`` files of
    ``per_rank`` bytes at once: medians over ``repeat``."""
    from fastckpt.aio import aio_handle
    from fastckpt.bench.caches import PageCache
    from fastckpt.bench.rawio import make_buffer, timed_read, timed_write

    paths = [os.path.join(folder, f"ceiling-{i}.bin") for i in range(world)]
    handle = aio_handle(block_size=8 << 20, queue_depth=32, intra_op_parallelism=4)
    buffer = make_buffer(per_rank)
    cache = PageCache.__new__(PageCache)  # evict our files only: no machine-wide drop
    cache.can_drop, cache.reason = False, "not used"
    writes = [timed_write(handle, buffer, paths) for _ in range(repeat)]
    reads = [timed_read(handle, buffer, paths, cache) for _ in range(repeat)]
    for p in paths:
        os.unlink(p)
    return {"write": median(writes), "read": median(reads)}


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--per-rank", type=parse_size, default=parse_size("1G"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reshard-from", type=int, default=2, help="0 skips the reshard case")
    parser.add_argument("--reshard-to", type=int, default=4)
    parser.add_argument("--folder", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)

    base = args.folder or tempfile.mkdtemp(prefix="bench-dcp-")
    os.makedirs(base, exist_ok=True)
    fs = filesystem_of(base)
    print(
        f"# DCP benchmark: {format_bytes(args.per_rank)} per rank, ranks {args.ranks}, "
        f"median of {args.repeat}; {base} on {fs}; {os.cpu_count()} CPUs"
    )
    report: dict[str, Any] = {}
    for world in args.ranks:
        folder = tempfile.mkdtemp(prefix=f"r{world}-", dir=base)
        options = {
            "folder": folder,
            "per_rank": args.per_rank,
            "repeat": args.repeat,
            "thread_counts": args.thread_counts,
            "result": os.path.join(folder, "result.json"),
        }
        log(f"{world} ranks: running")
        times = _run_ranks(world, options)
        log(f"{world} ranks: disk ceilings")
        ceiling = _ceilings(folder, world, args.per_rank, args.repeat)
        shutil.rmtree(folder)
        med = {k: median(v) for k, v in times.items()}
        best_t = min(args.thread_counts, key=lambda n: med[f"save-dcp-t{n}"])
        total = world * args.per_rank

        def gbps(seconds: float | None, total: int = total) -> str:
            return fmt(total / seconds / 1e9 if seconds else None, ".2f", " GB/s")

        save_dcp = med[f"save-dcp-t{best_t}"]
        rows = [
            ("save  FastCkptWriter", med["save-fastckpt"]),
            (f"save  FileSystemWriter (thread_count={best_t}, best)", save_dcp),
            ("save  disk ceiling (parallel O_DIRECT write + fsync)", ceiling["write"]),
            ("load  FastCkptReader", med["load-fastckpt"]),
            ("load  FileSystemReader", med["load-dcp"]),
            ("load  disk ceiling (parallel O_DIRECT read)", ceiling["read"]),
            ("async_save blocking, FastCkptWriter", med["async-fastckpt-block"]),
            ("async_save blocking, DCP default", med["async-dcp-block"]),
            ("async_save until done, FastCkptWriter", med["async-fastckpt-total"]),
            ("async_save until done, DCP default", med["async-dcp-total"]),
        ]
        print(f"\n## {world} ranks x {format_bytes(args.per_rank)} = {format_bytes(total)}")
        for label, seconds in rows:
            rate = gbps(seconds) if not label.startswith("async") else ""
            print(f"  {label:<56} {fmt(seconds, '8.3f', ' s')}  {rate}")
        for n in args.thread_counts:
            print(
                f"    (FileSystemWriter thread_count={n}: {fmt(med[f'save-dcp-t{n}'], '.3f', ' s')})"
            )
        ratios = {
            "save_vs_filesystem": save_dcp / med["save-fastckpt"],
            "save_vs_ceiling": ceiling["write"] / med["save-fastckpt"],
            "load_vs_filesystem": med["load-dcp"] / med["load-fastckpt"],
            "load_vs_ceiling": ceiling["read"] / med["load-fastckpt"],
            "async_block_fraction": med["async-fastckpt-block"] / med["async-dcp-block"],
        }
        print(
            f"  save: {ratios['save_vs_filesystem']:.2f}x FileSystemWriter, "
            f"{ratios['save_vs_ceiling']:.2f} of the ceiling; load: "
            f"{ratios['load_vs_filesystem']:.2f}x FileSystemReader, "
            f"{ratios['load_vs_ceiling']:.2f} of the ceiling; async blocking: "
            f"{ratios['async_block_fraction']:.2f} of DCP's default"
        )
        report[str(world)] = {"times": times, "medians": med, "ceiling": ceiling, "ratios": ratios}
    if args.reshard_from:
        report["reshard"] = _reshard(
            base, args.reshard_from, args.reshard_to, args.per_rank, args.repeat
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    if not args.folder:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
