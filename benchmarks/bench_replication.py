"""Peer replication of the fast tier: recovery of a lost node from a peer's memory against
recovery from a throttled durable root, and what replication costs a training loop.

Simulated nodes: one process per node (``FASTCKPT_NODE``), gloo on loopback, each node's
fast tier its own directory on /dev/shm, the root a directory on the disk.

**Recovery** (``--ranks 2 4 8``): every rank saves a ``--size`` share (``fastckpt.save``)
into its fast tier and into root, and replicates it to one peer (``Replicator``,
replicas=1). Node 1 then loses its memory (its fast directory, with the replicas it held),
and its step is brought back, alternately:

- *from a peer*: ``Replicator.recover`` (every rank agrees on the step; the peer holding
  node 1's replica sends it over gloo into node 1's fast tier), then ``fastckpt.load`` of
  it with every CRC32C verified;
- *from root*: the file copied from root into the fast tier at ``--storage-bandwidth``
  bytes a second (``fastckpt.series.transfer.copy_file(rate=)``: what node 1's share of a
  cluster file system delivers while every node restores at once), then the same load.

The time is node 1's, medians of ``--rounds`` interleaved rounds.

**Training** (``--train``): every rank runs a loop of CPU matmuls, saving its ``--size``
state with ``CheckpointManager(fast=/dev/shm, root=disk)`` every ``--every`` steps, with
``replicas=1`` and without, alternating runs; the loop's time per mode, medians.

Run: python benchmarks/bench_replication.py [--ranks 2 4 8] [--size 64M] [--train]
Smoke: python benchmarks/bench_replication.py --ranks 2 --size 4M --rounds 1 --train --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

from fastckpt.config import parse_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(rank: int, nbytes: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(rank)
    return {"w": torch.randn(max(nbytes // 4, 1), generator=generator)}


def _rank_recovery(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from fastckpt import api
    from fastckpt.distributed.replication import Replicator
    from fastckpt.series.transfer import copy_file

    fast = os.path.join(args.shm, f"node-{rank}")
    root = os.path.join(args.dir, f"rank-{rank:05d}")
    os.makedirs(fast, exist_ok=True)
    os.makedirs(root, exist_ok=True)
    replicator = Replicator(os.path.join(fast, ".replicas"), replicas=1)
    step = 1
    directory = os.path.join(fast, f"step-{step:012d}")
    os.makedirs(directory)
    api.save(_state(rank, args.size), os.path.join(directory, "state.safetensors"))
    with open(os.path.join(directory, "COMMITTED"), "w") as f:
        f.write("{}")
    api.save(_state(rank, args.size), os.path.join(root, "state.safetensors"))
    replicator.replicate(step, directory, ["state.safetensors", "COMMITTED"]).result()
    lost = 1
    peer, from_root = [], []
    for _ in range(args.rounds):
        for how in ("peer", "root"):
            dist.barrier()
            if rank == lost:  # node 1's memory is gone (its steps; it held no replica of its own)
                shutil.rmtree(directory)
            dist.barrier()
            started = time.perf_counter()
            if how == "peer":
                own = [] if rank == lost else [step]
                replicator.recover(own, [step], lambda s: directory, step=step)
            elif rank == lost:
                os.makedirs(directory)
                copy_file(
                    os.path.join(root, "state.safetensors"),
                    os.path.join(directory, "state.safetensors"),
                    rate=args.storage_bandwidth,
                )
            if rank == lost:
                api.load(os.path.join(directory, "state.safetensors"), verify=True)
                (peer if how == "peer" else from_root).append(time.perf_counter() - started)
    replicator.close()
    return {"peer": peer, "root": from_root}


def _rank_train(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fastckpt import CheckpointManager

    torch.set_num_threads(1)
    fast = os.path.join(args.shm, f"node-{rank}", args.mode)
    root = os.path.join(args.dir, args.mode, f"rank-{rank:05d}")
    replicas = 1 if args.mode == "on" else 0
    manager = CheckpointManager(
        root,
        fast=fast,
        keep_last=1,
        replicas=replicas,
        distributed=False,
        replication_bytes_per_second=args.replication_bandwidth,
    )
    state = _state(rank, args.size)
    a = torch.randn(256, 256)
    torch.distributed.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(1, args.steps + 1):
        for _ in range(args.work):
            a = torch.tanh(a @ a) * 0.5
        state["w"].add_(1.0)
        if step % args.every == 0:
            manager.save(step, state)
    loop = time.perf_counter() - started
    manager.close()  # (the last step's replication and drain end here)
    process_cpu = time.process_time() - cpu_started
    replicator = manager._replicator  # the bench reads its counters
    cpu = replicator.cpu_seconds if replicator is not None else 0.0
    sent = replicator.bytes_sent if replicator is not None else 0
    seconds = replicator.seconds_sending if replicator is not None else 0.0
    return {
        "loop": loop,
        "process_cpu_s": process_cpu,
        "replication_cpu_s": cpu,
        "bytes_sent": sent,
        "replication_s": seconds,
    }


def _child(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    os.environ["FASTCKPT_NODE"] = str(args.rank)
    dist.init_process_group(
        "gloo", rank=args.rank, world_size=args.world, timeout=timedelta(seconds=300)
    )
    job = _rank_recovery if args.mode == "recovery" else _rank_train
    result = job(args.rank, args.world, args)
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def _run(world: int, mode: str, args: argparse.Namespace, shm: str, disk: str) -> list[dict]:
    port = _free_port()
    shm, disk = tempfile.mkdtemp(dir=shm), tempfile.mkdtemp(dir=disk)  # a fresh run each time
    common = [
        "--size",
        str(args.size),
        "--rounds",
        str(args.rounds),
        "--storage-bandwidth",
        str(args.storage_bandwidth),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--work",
        str(args.work),
        "--shm",
        shm,
        "--dir",
        disk,
    ]
    if args.replication_bandwidth:
        common += ["--replication-bandwidth", str(args.replication_bandwidth)]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", "--rank", str(r), "--world", str(world)]
            + ["--port", str(port), "--mode", mode, *common],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    for child in children:
        out, _ = child.communicate(timeout=1200)
        lines = [line[7:] for line in out.splitlines() if line.startswith("RESULT ")]
        if child.returncode or not lines:
            raise SystemExit(f"a rank failed ({child.returncode}): {out[-2000:]}")
        results.append(json.loads(lines[-1]))
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(disk, ignore_errors=True)
    return results


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--size", type=parse_size, default=parse_size("64M"), help="per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--storage-bandwidth",
        type=parse_size,
        default=parse_size("100M"),
        help="root's bandwidth per node, bytes/s (a cluster file system's share)",
    )
    parser.add_argument("--train", action="store_true", help="also time a training loop")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--work", type=int, default=40, help="matmuls per training step")
    parser.add_argument("--replication-bandwidth", type=parse_size, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="recovery", help=argparse.SUPPRESS)
    parser.add_argument("--shm", default="", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    print(f"load average before: {os.getloadavg()}; cpus: {os.cpu_count()}")
    print(
        f"share per rank {args.size / 2**20:.0f} MiB, root throttled to "
        f"{args.storage_bandwidth / 1e6:.0f} MB/s per node, {args.rounds} rounds"
    )
    shm_base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    figures: dict[str, Any] = {}
    for world in args.ranks:
        shm = tempfile.mkdtemp(prefix="fastckpt-bench-replication-", dir=shm_base)
        disk = tempfile.mkdtemp(prefix="fastckpt-bench-replication-")
        try:
            results = _run(world, "recovery", args, shm, disk)
            lost = results[1]
            peer, root = _median(lost["peer"]), _median(lost["root"])
            figures[f"recovery_{world}"] = {"peer_s": peer, "root_s": root}
            print(
                f"{world} ranks: node 1 recovers from a peer in {peer:.3f} s "
                f"({args.size / peer / 1e6:.0f} MB/s; rounds {[round(x, 3) for x in lost['peer']]}), "
                f"from root in {root:.3f} s ({[round(x, 3) for x in lost['root']]}): "
                f"{root / peer:.1f}x; load average {os.getloadavg()[0]:.2f}"
            )
            if args.train:
                loops: dict[str, list[float]] = {"off": [], "on": []}
                cpus: dict[str, list[float]] = {"off": [], "on": []}
                cpu, sent, busy = [], [], []
                for _ in range(args.rounds):
                    for mode in ("off", "on"):
                        runs = _run(world, mode, args, shm, disk)
                        loops[mode].append(max(r["loop"] for r in runs))
                        cpus[mode].append(sum(r["process_cpu_s"] for r in runs) / len(runs))
                        if mode == "on":
                            cpu += [r["replication_cpu_s"] for r in runs]
                            sent += [r["bytes_sent"] for r in runs]
                            busy += [r["replication_s"] for r in runs]
                off, on = _median(loops["off"]), _median(loops["on"])
                per_gib = sum(cpu) / max(sum(sent), 1) * 2**30
                cpu_off, cpu_on = _median(cpus["off"]), _median(cpus["on"])
                rate = sum(sent) / max(sum(busy), 1e-9)
                figures[f"train_{world}"] = {
                    "off_s": off,
                    "on_s": on,
                    "cpu_off_s": cpu_off,
                    "cpu_on_s": cpu_on,
                    "cpu_s_per_gib": per_gib,
                    "replication_bytes_per_s": rate,
                }
                print(
                    f"{world} ranks: training loop {off:.2f} s without replication "
                    f"({[round(x, 2) for x in loops['off']]}), {on:.2f} s with replicas=1 "
                    f"({[round(x, 2) for x in loops['on']]}): {100 * (on / off - 1):+.1f} %; "
                    f"load average {os.getloadavg()[0]:.2f}"
                )
                print(
                    f"{world} ranks: CPU time per rank (loop and close) {cpu_off:.2f} s without, "
                    f"{cpu_on:.2f} s with replication ({[round(x, 2) for x in cpus['off']]}, "
                    f"{[round(x, 2) for x in cpus['on']]}): {100 * (cpu_on / cpu_off - 1):+.1f} %"
                )
                cap = args.replication_bandwidth
                print(
                    f"{world} ranks: replication thread CPU {per_gib:.2f} s per GiB sent (and "
                    f"as much received); {sum(sent) / len(sent) / 2**20:.0f} MiB sent per rank "
                    f"per run at {rate / 1e6:.0f} MB/s while sending"
                    + (f" (cap {cap / 1e6:.0f} MB/s)" if cap else "")
                )
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    print("JSON " + json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
