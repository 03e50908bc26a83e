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

**Training** (``--train``): every rank runs a loop of ``--steps`` steps of ``--work`` CPU
matmuls (one thread), saving its ``--size`` state with ``CheckpointManager(fast=/dev/shm,
root=disk)`` every ``--every`` steps, in interleaved runs of three modes: no replication,
``replicas=1`` with its bytes over gloo, and ``replicas=1`` over TCP (``sendfile``; the
default transport). Per mode, medians over the runs: the loop's own step time (steps without
a save), its wall time (the slowest rank's), and what replication takes from it: the wall
time it adds, and its CPU time (the replication thread's and the gloo threads' beyond what
they use without replication) as a share of the loop's CPU time, and per GiB sent (each
rank receives as much as it sends). The last save is ``--steps % --every`` steps before the
loop's end, so its round runs inside the loop.

Run: python benchmarks/bench_replication.py [--ranks 2 4 8] [--size 32M] [--train]
Smoke: python benchmarks/bench_replication.py --ranks 2 --size 4M --rounds 1 --train --steps 6 --every 4
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
    from fastckpt.distributed.replica_store import identity
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
    known = identity(os.path.join(root, "state.safetensors"))
    lost = 1
    peer, from_root = [], []
    for _ in range(args.rounds):
        for how in ("peer", "root"):
            dist.barrier()
            if rank == lost:  # node 1's memory is gone (its steps; it held no replica of its own)
                shutil.rmtree(directory)
            dist.barrier()
            started = time.perf_counter()
            if how == "peer":  # (steps named with their content's identity, as a manager does)
                own = {} if rank == lost else {step: known}
                recovery = replicator.recover(own, {step: known}, lambda s: directory, step=step)
                assert recovery.sources[lost] != "fallback", recovery
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


def _gloo_threads_cpu() -> float:
    """CPU seconds of this process's gloo I/O threads (they move the gloo path's bytes)."""
    total = 0.0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
        if name.startswith("gloo"):
            utime, stime = fields.split()[11:13]
            total += (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
    return total


def _rank_train(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fastckpt import CheckpointManager

    torch.set_num_threads(1)
    fast = os.path.join(args.shm, f"node-{rank}", args.mode)
    root = os.path.join(args.dir, args.mode, f"rank-{rank:05d}")
    replicas = 0 if args.mode == "off" else 1
    manager = CheckpointManager(
        root,
        fast=fast,
        keep_last=1,
        replicas=replicas,
        distributed=False,
        replication_bytes_per_second=args.replication_bandwidth,
    )
    replicator = manager._replicator  # the bench picks the transport and reads the counters
    if replicator is not None:
        replicator.transport = args.mode
    state = _state(rank, args.size)
    a = torch.randn(256, 256)
    torch.distributed.barrier()
    steps: list[float] = []
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(1, args.steps + 1):
        began = time.perf_counter()
        for _ in range(args.work):
            a = torch.tanh(a @ a) * 0.5
        state["w"].add_(1.0)
        if step % args.every == 0:
            manager.save(step, state)
        else:  # (a step without a save: the loop's own step time)
            steps.append(time.perf_counter() - began)
    loop, loop_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    manager.close()  # (a step's replication still running ends here)
    process_cpu = time.process_time() - cpu_started
    return {
        "loop": loop,
        "loop_cpu_s": loop_cpu,
        "step_s": _median(steps),
        "process_cpu_s": process_cpu,
        "gloo_cpu_s": _gloo_threads_cpu(),
        "replication_cpu_s": replicator.cpu_seconds if replicator is not None else 0.0,
        "bytes_sent": replicator.bytes_sent if replicator is not None else 0,
        "sent_by": replicator.sent_by if replicator is not None else {},
        "replication_s": replicator.seconds_sending if replicator is not None else 0.0,
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


#: The training modes, interleaved: no replication, then replicas=1 over each transport.
MODES = ("off", "gloo", "auto")


def _train(world: int, args: argparse.Namespace, shm: str, disk: str) -> dict[str, Any]:
    """Interleaved runs of the training loop per mode; prints and returns the medians."""
    runs: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(_run(world, mode, args, shm, disk))
    off = _summary(runs["off"], None)
    figures = {"off": off}
    per_save = off["loop_cpu_s"] / args.steps * args.every
    print(
        f"{world} ranks: a {args.size / 2**20:.0f} MiB checkpoint every {args.every} steps = "
        f"every {per_save:.2f} CPU-s of the loop: {args.size / per_save / 1e6:.1f} MB per "
        "CPU-second of training"
    )
    print(
        f"{world} ranks, no replication: step {1e3 * off['step_s']:.1f} ms, loop "
        f"{off['loop_s']:.2f} s ({off['loops']}), loop CPU {off['loop_cpu_s']:.2f} s a rank"
    )
    for mode in MODES[1:]:
        on = figures[mode] = _summary(runs[mode], off)
        print(
            f"{world} ranks, replicas=1 over {'TCP' if mode == 'auto' else 'gloo'}: step "
            f"{1e3 * on['step_s']:.1f} ms, loop {on['loop_s']:.2f} s ({on['loops']}): "
            f"{on['wall_pct']:+.1f} % wall; replication CPU {on['cpu_s']:.3f} s a rank = "
            f"{on['cpu_pct']:.1f} % of the loop's CPU; {on['cpu_s_per_gib']:.2f} CPU-s per "
            f"GiB sent (and as much received); {on['mb_s']:.0f} MB/s while sending; "
            f"load average {os.getloadavg()[0]:.2f}"
        )
    return figures


def _summary(runs: list[list[dict]], off: dict[str, Any] | None) -> dict[str, Any]:
    """One mode's medians over its runs (each run: every rank's result). The loop's time is
    its slowest rank's; CPU figures are per rank; replication's CPU is its thread's and the
    gloo threads' beyond what they use without replication."""
    loops = [max(r["loop"] for r in run) for run in runs]
    figures: dict[str, Any] = {
        "loop_s": _median(loops),
        "loops": [round(x, 2) for x in loops],
        "step_s": _median([_median([r["step_s"] for r in run]) for run in runs]),
        "loop_cpu_s": _median([sum(r["loop_cpu_s"] for r in run) / len(run) for run in runs]),
        "gloo_cpu_s": _median([sum(r["gloo_cpu_s"] for r in run) / len(run) for run in runs]),
    }
    if off is None:
        return figures
    ranks = [r for run in runs for r in run]
    cpu = [r["replication_cpu_s"] + r["gloo_cpu_s"] - off["gloo_cpu_s"] for r in ranks]
    sent = sum(r["bytes_sent"] for r in ranks)
    figures.update(
        wall_pct=100 * (figures["loop_s"] / off["loop_s"] - 1),
        cpu_s=_median(cpu),
        cpu_pct=100 * _median(cpu) / off["loop_cpu_s"],
        cpu_s_per_gib=sum(cpu) / max(sent, 1) * 2**30,
        mb_s=sent / max(sum(r["replication_s"] for r in ranks), 1e-9) / 1e6,
        sent_by={way: sum(r["sent_by"].get(way, 0) for r in ranks) for way in ("tcp", "gloo")},
    )
    return figures


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--size", type=parse_size, default=parse_size("32M"), help="per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--storage-bandwidth",
        type=parse_size,
        default=parse_size("100M"),
        help="root's bandwidth per node, bytes/s (a cluster file system's share)",
    )
    parser.add_argument("--train", action="store_true", help="also time a training loop")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=40)
    parser.add_argument("--work", type=int, default=150, help="matmuls per training step")
    parser.add_argument("--replication-bandwidth", type=parse_size, default=parse_size("64M"))
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
                figures[f"train_{world}"] = _train(world, args, shm, disk)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    print("JSON " + json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
