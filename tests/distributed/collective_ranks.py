"""One rank of the asynchronous multi-rank save tests, run as its own process (gloo on
loopback): ``python collective_ranks.py RANK WORLD PORT CASE ROOT``. Every rank builds the
same values, so each process knows what a step must hold; ranks report on stdout as
``rank R: ...`` lines that the test reads."""

from __future__ import annotations

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fastckpt

ROWS, COLS = 48, 64
REPLICATED = 4  # tensors every rank holds whole (Replicate), each written by one rank


def full(step: int, salt: int = 0) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + step + salt


def state_of(mesh, step: int, extra: bool = False) -> dict:
    state = {
        "model": {"w": distribute_tensor(full(step), mesh, [Shard(0)])},
        "optim": {"exp_avg": distribute_tensor(full(step, 7), mesh, [Shard(0)])},
        "replicated": {
            f"r{i}": distribute_tensor(full(step, 100 * i), mesh, [Replicate()])
            for i in range(REPLICATED)
        },
        "step": step,
    }
    if extra:  # a structure change: the plans are made afresh
        state["model"]["b"] = distribute_tensor(full(step, 3), mesh, [Shard(0)])
    return state


def report(rank: int, text: str) -> None:
    print(f"rank {rank}: {text}", flush=True)


def check(mesh, manager, step: int, extra: bool) -> None:
    target = state_of(mesh, 0, extra)
    got, state = manager.restore(step, state=target)
    assert got == step and state["step"] == step
    expected = state_of(mesh, step, extra)
    for part in ("model", "optim", "replicated"):
        for key, value in expected[part].items():
            assert torch.equal(state[part][key].full_tensor(), value.full_tensor()), (step, key)


def async_saves(rank: int, world: int, mesh, root: str) -> None:
    """Steps 1-4 with one structure, 5-6 with another: each save returns once captured (the
    state is changed right after and the step still holds the values at the call); every
    step restores equal to its own state."""
    with fastckpt.CheckpointManager(root, keep_last=None) as manager:
        futures = []
        for step in range(1, 7):
            extra = step >= 5
            state = state_of(mesh, step, extra)
            futures.append(manager.save(step, state))
            for part in ("model", "optim", "replicated"):  # after the call: not saved
                for value in state[part].values():
                    value.to_local().add_(1000)
            # training collectives on the default group while the save runs in the
            # background (on the checkpoint group: the two never mix)
            for _ in range(3):
                total = torch.ones(1)
                dist.all_reduce(total)
                assert total.item() == world
        for future in futures:
            assert future.result() is None
        for step in range(1, 7):
            check(mesh, manager, step, step >= 5)
        report(rank, "outcomes " + " ".join(manager._steps.outcomes))
        report(rank, "load outcomes " + " ".join(manager._steps.load_outcomes))
        report(rank, "restored every step")
    dist.barrier()
    dist.destroy_process_group()


def lazy_saves(rank: int, world: int, mesh, root: str) -> None:
    """A lazy save (fence=optimizer) of DDP-style state (the same on every rank, written
    once): the optimizer's step after the call changes the parameters in place, fenced;
    the step holds the values at the call."""
    w = torch.nn.Parameter(full(1))
    optimizer = torch.optim.SGD([w], lr=0.5)
    with fastckpt.CheckpointManager(root) as manager:
        for step in (1, 2):
            before = w.detach().clone()
            future = manager.save(step, {"w": w, "step": step}, fence=optimizer)
            w.grad = torch.ones_like(w)
            optimizer.step()  # passes the fence first
            future.result()
            target = {"w": torch.zeros_like(w), "step": 0}
            assert manager.restore(step, state=target)[0] == step
            assert torch.equal(target["w"], before)
        report(rank, "lazy steps restored")
    dist.barrier()
    dist.destroy_process_group()


def one_rank_fails(rank: int, world: int, mesh, root: str) -> None:
    """Rank 1's state of step 3 cannot be saved (a value that does not pickle): every rank's
    future fails, step 3 is absent, every rank's next save raises that failure, and the
    save after that works."""
    with fastckpt.CheckpointManager(root, keep_last=None) as manager:
        for step in (1, 2):
            manager.save(step, state_of(mesh, step))
        state = state_of(mesh, 3)
        if rank == 1:
            state["unpicklable"] = lambda: None
        future = manager.save(3, state)
        error = future.exception(timeout=120)
        report(rank, f"step 3 future: {type(error).__name__}: {error}")
        try:
            manager.save(4, state_of(mesh, 4))
            report(rank, "step 4 did not raise")
        except Exception as exc:
            report(rank, f"step 4 raised {type(exc).__name__}")
        manager.save(4, state_of(mesh, 4)).result()
        report(rank, f"steps {manager.steps()}")
        check(mesh, manager, 4, False)
    dist.barrier()
    dist.destroy_process_group()


def main(rank: int, world: int, port: int, case: str, root: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    mesh = init_device_mesh("cpu", (world,))
    {"async": async_saves, "lazy": lazy_saves, "fail": one_rank_fails}[case](
        rank, world, mesh, root
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
