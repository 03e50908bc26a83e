"""Rank-side code of the DCP tests: deterministic values, the spawned ranks' entry point and
the functions they run. Kept apart from the test module so each spawned process imports only
torch, DCP and fastckpt (not pytest or the CLI)."""

from __future__ import annotations

import copy
import datetime
import os
import signal
import socket
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fastckpt.dcp import FastCkptReader, FastCkptWriter

# -- values -------------------------------------------------------------------------------------


def full_values(version: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "sharded": torch.randn(10, 6, generator=g),  # 10 rows: uneven over 4 ranks
        "repl": torch.randn(4, 3, generator=g),
        "half": torch.randn(8, 2, generator=g).to(torch.bfloat16),
        "plain": torch.arange(7, dtype=torch.int32) + version,
    }


# DCP loads the keys the target state dict has: these stand in for the non-tensor values.
EXTRAS_TARGET = {"step": 0, "cfg": {"lr": 0.0, "betas": None, "name": ""}}


def extra_values(version: int = 0) -> dict:
    return {"step": 42 + version, "cfg": {"lr": 0.1, "betas": [0.9, 0.99], "name": "run-a"}}


def make_state(mesh, version: int = 0) -> dict:
    full = full_values(version)
    return {
        "model": {
            "sharded": distribute_tensor(full["sharded"], mesh, [Shard(0)]),
            "repl": distribute_tensor(full["repl"], mesh, [Replicate()]),
            "half": distribute_tensor(full["half"], mesh, [Shard(0)]),
        },
        "plain": full["plain"].clone(),
        **extra_values(version),
    }


def empty_like_full(mesh, placements: dict[str, list]) -> dict:
    full = full_values()
    model = {
        k: distribute_tensor(torch.zeros_like(full[k]), mesh, placements[k])
        for k in ("sharded", "repl", "half")
    }
    return {
        "model": model,
        "plain": torch.zeros(7, dtype=torch.int32),
        **copy.deepcopy(EXTRAS_TARGET),
    }


def check_loaded(state: dict, version: int = 0) -> None:
    full = full_values(version)
    for key in ("sharded", "repl", "half"):
        value = state["model"][key]
        assert isinstance(value, DTensor)
        assert torch.equal(value.full_tensor(), full[key]), key
    assert torch.equal(state["plain"], full["plain"])
    extras = extra_values(version)
    assert state["step"] == extras["step"]
    assert state["cfg"] == extras["cfg"]


def check_full(state: dict, version: int = 0) -> None:
    full = full_values(version)
    for key in ("sharded", "repl", "half"):
        assert torch.equal(state["model"][key], full[key]), key
    assert torch.equal(state["plain"], full["plain"])
    assert {k: state[k] for k in ("step", "cfg")} == extra_values(version)


# -- running ranks ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, fn, args) -> None:
    # DCP and DTensor warn about things these tests do on purpose; the children are not
    # under pytest's warning filters, so keep their output to what matters.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*overwriting.*", category=UserWarning)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> None:
    """Runs ``fn(rank, world, *args)`` in ``world`` spawned processes; raises what any raised."""
    mp.start_processes(
        rank_main, args=(world, free_port(), fn, args), nprocs=world, start_method="spawn"
    )


def make_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


# -- rank functions (module level: spawn imports them by name) ----------------------------------


def save_then_load_other_sharding(rank, world, path):
    dcp.save(make_state(make_mesh(world)), storage_writer=FastCkptWriter(path))
    dist.barrier()
    other = {"sharded": [Shard(1)], "repl": [Shard(0)], "half": [Replicate()]}
    load_resharded(rank, world, path, other)


def load_resharded(rank, world, path, placements):
    state = empty_like_full(make_mesh(world), placements)
    dcp.load(state, storage_reader=FastCkptReader(path))
    check_loaded(state)
    if placements["sharded"] == [Shard(0)]:  # each rank holds only its rows
        local = state["model"]["sharded"].to_local()
        rows = [3, 3, 3, 1][rank] if world == 4 else local.shape[0]
        assert local.shape == (rows, 6)


def async_save_then_mutate(rank, world, path):
    state = make_state(make_mesh(world))
    writer = FastCkptWriter(path)
    future = dcp.async_save(state, storage_writer=writer)
    # change everything at once: the checkpoint must hold the values at call time
    for value in state["model"].values():
        value.to_local().fill_(-7)
    state["plain"].zero_()
    state["cfg"]["betas"].append(0.5)
    state["cfg"]["lr"] = 9.0
    future.result()
    # a second save through the same writer, of the mutated values, commits too
    dcp.async_save(state, storage_writer=writer, checkpoint_id=path + "-second").result()
    writer.close()


class DieMidSave(DefaultSavePlanner):
    """Kills its own process (SIGKILL, no cleanup) while rank 1 is writing its file."""

    def resolve_data(self, write_item):
        if dist.get_rank() == 1 and write_item.index.fqn == "model.repl":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(write_item)


def save_and_die(rank, world, path):
    dcp.save(make_state(make_mesh(world), 0), storage_writer=FastCkptWriter(path))
    dist.barrier()
    dcp.save(
        make_state(make_mesh(world), 1), storage_writer=FastCkptWriter(path), planner=DieMidSave()
    )
