"""One rank of the lazy DTensor save tests, run as its own process (gloo on loopback):
``python lazy_dtensor_ranks.py RANK WORLD PORT CASE ROOT``. Each case builds a model sharded
or replicated as large runs do (FSDP2's ``fully_shard``, tensor parallelism with DTensor
parameters, DDP), takes its state with ``get_state_dict``, saves it lazily with
``CheckpointManager.save(step, state, fence=optimizer)`` and steps the optimizer right
after; ranks report on stdout as ``rank R: ...`` lines that the test reads."""

from __future__ import annotations

import copy
import datetime
import os
import sys
import threading
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fastckpt
from fastckpt.checkpoint.lazy_guard import LazyGuard, LazySaveError
from fastckpt.integrations.dcp import FastCkptWriter

IN, HIDDEN, OUT = 16, 64, 8


def report(rank: int, text: str) -> None:
    print(f"rank {rank}: {text}", flush=True)


class Net(torch.nn.Module):
    """Two linear layers and a buffer (no optimizer changes it: copied at the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(IN, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, OUT)
        self.register_buffer("seen", torch.zeros(OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        with torch.no_grad():
            self.seen.add_(1)  # changed by every forward pass, as BatchNorm's statistics are
        return y


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    optimizer.zero_grad()
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optimizer.step()


def fsdp2(mesh, fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = Net()
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)


def tensor_parallel(mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = Net()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    # and a DTensor parameter made by hand, replicated
    model.scale = torch.nn.Parameter(distribute_tensor(torch.ones(OUT), mesh, [Replicate()]))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)


def ddp(mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.parallel.DistributedDataParallel(Net())
    return model, torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)


def snapshot(value):
    """A deep copy of a state's tensors (DTensors stay DTensors), other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    return copy.deepcopy(value)


def zeroed(value):
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value.detach())
    if isinstance(value, dict):
        return {k: zeroed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [zeroed(v) for v in value]
    return copy.deepcopy(value)


def mismatches(expected, got, path: str = "") -> list[str]:
    """The paths of the tensors of ``got`` that differ from ``expected`` (this rank's part)."""
    if isinstance(expected, torch.Tensor):
        a = expected.to_local() if isinstance(expected, DTensor) else expected
        b = got.to_local() if isinstance(got, DTensor) else got
        return [] if torch.equal(a, b) else [path]
    if isinstance(expected, dict):
        return [m for k, v in expected.items() for m in mismatches(v, got[k], f"{path}.{k}")]
    if isinstance(expected, list):
        return [m for i, v in enumerate(expected) for m in mismatches(v, got[i], f"{path}.{i}")]
    return []


def tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        local = value.to_local() if isinstance(value, DTensor) else value
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def lazy_save(rank: int, world: int, mesh, root: str, kind: str) -> None:
    """Saves the model's and optimizer's state lazily under the fence, with a DTensor no
    optimizer steps besides (``extra``): only the buffer and that DTensor are copied at
    the call; three steps later the step restores to the state at the call."""
    makers = {
        "fsdp": lambda: fsdp2(mesh, fused=False),
        "fsdp_fused": lambda: fsdp2(mesh, fused=True),
        "tp": lambda: tensor_parallel(mesh),
        "ddp": lambda: ddp(mesh),
    }
    torch.manual_seed(0)  # the same initial values on every rank
    model, optimizer = makers[kind]()
    train_step(model, optimizer, seed=1)
    model_state, optim_state = get_state_dict(model, optimizer)
    extra = distribute_tensor(torch.arange(32.0), mesh, [Shard(0)])
    state = {"model": model_state, "optim": optim_state, "extra": extra, "step": 1}
    expected = snapshot(state)
    with fastckpt.CheckpointManager(root) as manager:
        future = manager.save(1, state, fence=optimizer)
        stager = manager._steps._stagers[-1]
        copied = sorted(stager.call_copied)
        report(rank, f"copied at the call: {' '.join(copied)}")
        unowned = {k: v for k, v in model_state.items() if k.endswith("seen")}
        report(
            rank,
            f"call bytes {stager.call_copy_bytes} expected {tensor_bytes(unowned) + 32 // world * 4}",
        )
        for i in range(3):
            train_step(model, optimizer, seed=2 + i)  # the first passes the fence
        with torch.no_grad():
            extra.mul_(-1)  # copied at the call: not saved
        future.result()
        changed = mismatches(expected["model"], get_state_dict(model, optimizer)[0], "model")
        report(rank, f"changed by the steps: {len(changed)}")
        target = zeroed(state)
        assert manager.restore(1, state=target)[0] == 1
        wrong = mismatches(expected, target)
        report(rank, "restored the state at the call" if not wrong else f"differs: {wrong}")
    dist.barrier()
    dist.destroy_process_group()


def changed_unfenced(rank: int, world: int, mesh, root: str) -> None:
    """An FSDP2 parameter changed in place outside the fence (an in-place op on the
    DTensor, which moves the DTensor's version counter, not its local tensor's) before the
    writer copied it: the save fails on every rank naming it, and no step is committed."""
    torch.manual_seed(0)
    model, optimizer = fsdp2(mesh, fused=False)
    train_step(model, optimizer, seed=1)
    model_state, optim_state = get_state_dict(model, optimizer)
    release = threading.Event()
    write_data = FastCkptWriter.write_data

    def held(self, *args, **kwargs):  # the writer starts once the change is made
        release.wait(60)
        return write_data(self, *args, **kwargs)

    FastCkptWriter.write_data = held
    with fastckpt.CheckpointManager(root) as manager:
        future = manager.save(1, {"model": model_state, "optim": optim_state}, fence=optimizer)
        with torch.no_grad():
            model.up.weight.mul_(2)  # no fence: not an optimizer's step
        release.set()
        error = future.exception(timeout=120)
        report(rank, f"save failed: {type(error).__name__}: {error}")
        report(rank, f"steps {manager.steps()}")
    FastCkptWriter.write_data = write_data
    dist.barrier()
    dist.destroy_process_group()


def guard_versions(rank: int, world: int, mesh, root: str) -> None:
    """The guard of a DTensor checks the DTensor's version counter and its local tensor's:
    a change through either fails the save naming the tensor."""
    for how in ("dtensor", "local"):
        w = torch.nn.Parameter(distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)]))
        guard = LazyGuard(
            {"w": w.detach()}, fence_bytes=None, optimizers=[torch.optim.SGD([w], lr=0.1)]
        )
        assert guard.call_copied == frozenset()
        with torch.no_grad():
            (w if how == "dtensor" else w.to_local()).add_(1)
        try:
            guard.begin("w")
            report(rank, f"{how}: not detected")
        except LazySaveError as exc:
            report(rank, f"{how}: {exc}")
        guard.finish()
    dist.barrier()
    dist.destroy_process_group()


def main(rank: int, world: int, port: int, case: str, root: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    mesh = init_device_mesh("cpu", (world,))
    if case == "unfenced":
        changed_unfenced(rank, world, mesh, root)
    elif case == "versions":
        guard_versions(rank, world, mesh, root)
    else:
        lazy_save(rank, world, mesh, root, case)
    sys.stdout.flush()
    # DDP's reducer and gloo keep native threads that may abort a normal interpreter exit
    # ("terminate called without an active exception"); the group is torn down already
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
