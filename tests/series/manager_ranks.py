"""One rank of the multi-rank manager tests, run as its own process (gloo on loopback):
``python manager_ranks.py RANK WORLD PORT CASE ARGS...`` with CASE ``local ROOT FAST``,
``url ROOT OPTIONS_JSON``, ``split BASE``, ``same ROOT FAST`` or ``replicas BASE`` (with
``FASTCKPT_NODE`` set to the rank). Every rank builds the same values, so
each process knows what a step must hold; the test reads what the ranks report on stdout."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import fastckpt
from fastckpt.series import steps as layout

ROWS, COLS = 64, 256


def full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + step


def sharded_state(mesh, step: int) -> dict:
    return {"model": {"w": distribute_tensor(full(step), mesh, [Shard(0)])}, "step": step}


def local_tiers(rank: int, world: int, mesh, root: str, fast: str) -> None:
    """Steps 1 and 2 saved and restored on this world size; then rank 1 dies once its file
    of step 3 is durable, before rank 0 may write the marker."""
    manager = fastckpt.CheckpointManager(root, fast=fast, keep_last=3, keep_fast=1)
    for step in (1, 2):
        manager.save(step, sharded_state(mesh, step), metrics={"loss": 1.0 / step})
    manager.wait()  # rank 0: drained to root
    target = sharded_state(mesh, 0)
    step, state = manager.restore(state=target)
    assert step == 2 and state is target and state["step"] == 2
    assert torch.equal(state["model"]["w"].full_tensor(), full(2))
    local = state["model"]["w"].to_local()
    assert local.shape == (ROWS // world, COLS)  # each rank holds only its rows
    print(f"rank {rank} restored {step}", flush=True)
    if rank == 1:  # dies once its file of step 3 is durable, before telling rank 0
        dist.gather_object = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    future = manager.save(3, sharded_state(mesh, 3))  # returns at once: captured
    try:
        future.result(timeout=120)
    except Exception as exc:  # the gather fails: the peer is gone
        print(f"rank {rank} save 3 failed: {type(exc).__name__}", flush=True)
    manager.close()
    os._exit(0)  # the process group lost a rank; nothing left to tear down cleanly


def url_root(rank: int, world: int, mesh, root: str, options: str) -> None:
    """Step 5 saved to a root at a URL (every rank uploads its file, rank 0 commits and
    holds the lease) and restored on this world size."""
    with fastckpt.CheckpointManager(root, storage_options=json.loads(options)) as manager:
        manager.save(5, sharded_state(mesh, 5))
        target = sharded_state(mesh, 0)
        assert manager.restore(state=target)[0] == 5
        assert torch.equal(target["model"]["w"].full_tensor(), full(5))
    print(f"rank {rank} restored 5 from {root}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def split_tiers(rank: int, world: int, mesh, base: str) -> None:
    """Each rank is given a root of its own (as a node-local path would be): the manager
    refuses on every rank, before any step is saved."""
    root = os.path.join(base, f"root-{rank}")
    try:
        fastckpt.CheckpointManager(root, keep_last=3)
    except ValueError as exc:
        print(f"rank {rank} refused: {exc}", flush=True)
    else:
        print(f"rank {rank} made a manager", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def same_listing(rank: int, world: int, mesh, root: str, fast: str) -> None:
    """Steps 1..5 saved with keep_last=2: after wait() every rank lists the same steps;
    restore() without state= is refused at once on every rank."""
    manager = fastckpt.CheckpointManager(root, fast=fast, keep_last=2, keep_fast=1)
    for step in range(1, 6):
        manager.save(step, sharded_state(mesh, step))
    manager.wait()
    print(f"rank {rank} steps {manager.steps()}", flush=True)
    try:
        manager.restore()
    except ValueError as exc:
        print(f"rank {rank} restore refused: {exc}", flush=True)
    step, _ = manager.restore(state=sharded_state(mesh, 0))
    print(f"rank {rank} restored {step}", flush=True)
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


def own_state(rank: int, step: int) -> dict:
    return {"w": torch.full((1024,), float(rank * 1000 + step))}


def replicas_pace(rank: int, world: int, mesh, base: str) -> None:
    """Per-rank managers (replicas=1, each rank on its own node, ``FASTCKPT_NODE``): steps
    1..4 saved by every rank, then closed (keep_fast=1 holds); then, in new tiers, rank 0
    saves steps 1..6 before rank 1 saves 1..3, and every rank restores."""
    tiers = (os.path.join(base, "a", f"root-{rank}"), os.path.join(base, "a", f"node-{rank}"))
    manager = fastckpt.CheckpointManager(  # replication slower than the saves: it lags
        tiers[0],
        fast=tiers[1],
        replicas=1,
        keep_last=3,
        keep_fast=1,
        replication_bytes_per_second=40_000,
    )
    manager.save(1, own_state(rank, 1)).result()
    time.sleep(2)  # step 1 is replicated: the fast tier keeps it for the peers
    for step in range(2, 5):  # committed and drained before the peers hold step 4
        manager.save(step, own_state(rank, step)).result()
    manager.wait()
    manager.close()
    print(f"rank {rank} fast after close {layout.committed_steps(tiers[1])}", flush=True)
    tiers = (os.path.join(base, "b", f"root-{rank}"), os.path.join(base, "b", f"node-{rank}"))
    manager = fastckpt.CheckpointManager(
        tiers[0], fast=tiers[1], replicas=1, keep_last=3, keep_fast=1
    )
    if rank == 0:  # ahead of rank 1 by more than retention keeps
        for step in range(1, 7):
            manager.save(step, own_state(rank, step)).result()
        manager.wait()
    dist.barrier()
    if rank == 1:
        for step in range(1, 4):
            manager.save(step, own_state(rank, step)).result()
        manager.wait()
    try:
        step, state = manager.restore()
    except FileNotFoundError as exc:
        print(f"rank {rank} restore failed: {exc}", flush=True)
    else:
        same = torch.equal(state["w"], own_state(rank, step)["w"])
        print(f"rank {rank} restored {step} {'intact' if same else 'WRONG'}", flush=True)
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


def main(rank: int, world: int, port: int, case: str, *args: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    mesh = init_device_mesh("cpu", (world,))
    cases = {
        "local": local_tiers,
        "url": url_root,
        "split": split_tiers,
        "same": same_listing,
        "replicas": replicas_pace,
    }
    cases[case](rank, world, mesh, *args)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
