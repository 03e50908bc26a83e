"""One rank of the multi-rank manager tests, run as its own process (gloo on loopback):
``python manager_ranks.py RANK WORLD PORT local ROOT FAST`` or ``... url ROOT OPTIONS_JSON``. Every rank builds the same values, so
each process knows what a step must hold; the test reads what the ranks report on stdout."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import fastckpt

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
    {"local": local_tiers, "url": url_root}[case](rank, world, mesh, *args)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
