"""torch.distributed.checkpoint on fastckpt files: two ranks save a sharded model (and save
again in the background) and load it back sharded another way; then one process loads it whole.

Run: python examples/dcp_resharding.py [DIRECTORY]
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fastckpt.dcp import FastCkptReader, FastCkptWriter, consolidate


def full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(16, 8, generator=g), "norm": torch.ones(8)}


def rank_main(rank: int, world: int, port: int, directory: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    weights = full_weights()
    path = os.path.join(directory, "step-100")
    state = {
        "model": {
            "embed": distribute_tensor(weights["embed"], mesh, [Shard(0)]),  # FSDP-style
            "norm": distribute_tensor(weights["norm"], mesh, [Replicate()]),
        },
        "step": 100,
    }
    dcp.save(state, storage_writer=FastCkptWriter(path))
    # in the background: returns once the tensors are copied; training may go on
    future = dcp.async_save(state, storage_writer=FastCkptWriter(path + "-async"))
    state["model"]["embed"].to_local().zero_()  # does not reach the checkpoint
    future.result()

    # load with another sharding: columns instead of rows, the replicated vector split
    resharded = {
        "model": {
            "embed": distribute_tensor(torch.zeros(16, 8), mesh, [Shard(1)]),
            "norm": distribute_tensor(torch.zeros(8), mesh, [Shard(0)]),
        },
        "step": 0,
    }
    dcp.load(resharded, storage_reader=FastCkptReader(path + "-async"))
    same = torch.equal(resharded["model"]["embed"].full_tensor(), weights["embed"])
    if rank == 0:
        print(f"{world} ranks resharded step {resharded['step']}: identical: {same}")
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


def run(world: int, directory: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(world, port, directory), nprocs=world)


def main(directory: str) -> None:
    run(2, directory)
    path = os.path.join(directory, "step-100")
    print("saved:", sorted(os.listdir(path)))

    # one process, whole tensors, no process group: a single consolidated file
    consolidate(path, os.path.join(directory, "step-100.safetensors"))
    target = {"model": {"embed": torch.zeros(16, 8), "norm": torch.zeros(8)}, "step": 0}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=FastCkptReader(path), no_dist=True)
    same = torch.equal(target["model"]["embed"], full_weights()["embed"])
    print(f"one process loaded step {target['step']}: identical: {same}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:  # a scratch folder that goes away with the run
        with tempfile.TemporaryDirectory() as scratch:
            main(scratch)
