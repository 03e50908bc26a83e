"""One rank of the asynchronous multi-rank save tests, run as its own process (gloo on
loopback): ``python collective_ranks.py RANK WORLD PORT CASE ROOT [NOFILE]`` (NOFILE: the soft
limit of open files this rank runs under). Every rank builds the same values, so each process knows what a step must hold; ranks report on stdout as
``rank R: ...`` lines that the test reads."""

from __future__ import annotations

import datetime
import os
import resource
import sys
import time
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


def local_values(state: dict) -> dict:
    """Every tensor of this rank's ``state`` (its local part), cloned: what it held then."""
    found = {}
    for part in ("model", "optim", "replicated"):
        for key, value in state[part].items():
            local = value.to_local() if hasattr(value, "to_local") else value
            found[f"{part}.{key}"] = local.clone()
    return found


def with_new_key(state: dict, step: int) -> dict:
    """``state`` with a key of its own added, early in its order and large (the plans made
    again give the replicated tensors to the other ranks)."""
    model = {"w": state["model"]["w"], "added": full(step, 55).repeat(4, 1)}
    return {**state, "model": model}


def one_rank_changes_structure(rank: int, world: int, mesh, root: str, changer: int) -> None:
    """Rank ``changer``'s state gains a key at step 2 (the other's does not): the other
    copied at the call only the items of its cached plan, ``changer`` its whole state, and
    the plans are made again; every tensor is changed right after each save() returns.
    Every step restores equal to the values at its call (or its save fails on every rank)."""
    with fastckpt.CheckpointManager(root, keep_last=None) as manager:
        held = {}
        for step in (1, 2, 3):
            state = state_of(mesh, step)
            if rank == changer and step >= 2:
                state = with_new_key(state, step)
            held[step] = local_values(state)
            future = manager.save(step, state)
            for part in ("model", "optim", "replicated"):  # after the call: not saved
                for value in state[part].values():
                    (value.to_local() if hasattr(value, "to_local") else value).add_(1000)
            error = future.exception(timeout=120)
            report(
                rank,
                f"step {step}: {type(error).__name__}: {error}" if error else f"step {step} saved",
            )
            if error is not None:
                return  # the step failed on every rank: what the test accepts, and checks
        report(rank, "outcomes " + " ".join(manager._steps.outcomes))
        for step in (1, 2, 3):
            target = state_of(mesh, 0)
            if rank == changer and step >= 2:
                target = with_new_key(target, 0)
            assert manager.restore(step, state=target)[0] == step
            for name, value in local_values(target).items():
                assert torch.equal(value, held[step][name]), (step, name)
        report(rank, "every step holds the values at its call")
    dist.barrier()
    dist.destroy_process_group()


DDP_SIZES = (4096, 1024, 3072, 512, 2048)  # elements of the plain tensors every rank holds
UNEVEN_ROWS = 50  # a sharded tensor whose shards differ in size on 3 ranks (17, 17, 16)


def ddp_state(mesh, step: int) -> dict:
    """Plain tensors the same on every rank (as DDP holds them), a DTensor replicated over
    every rank, and sharded DTensors (one of uneven shards): a function of ``step`` alone."""
    return {
        "model": {
            "w": distribute_tensor(full(step), mesh, [Shard(0)]),
            "uneven": distribute_tensor(
                torch.arange(UNEVEN_ROWS * 8, dtype=torch.float32).reshape(UNEVEN_ROWS, 8) + step,
                mesh,
                [Shard(0)],
            ),
        },
        "ddp": {f"p{i}": torch.full((n,), float(step * 10 + i)) for i, n in enumerate(DDP_SIZES)},
        "replicated": {"r": distribute_tensor(full(step, 9), mesh, [Replicate()])},
        "step": step,
    }


def _locals(state: dict) -> dict:
    out = {}
    for part in ("model", "ddp", "replicated"):
        for key, value in state[part].items():
            out[f"{part}.{key}"] = value.to_local() if hasattr(value, "to_local") else value
    return out


def ddp_saves(rank: int, world: int, mesh, root: str) -> None:
    """Steps 1-3 of DDP-style state: each rank reports the replicated items it staged at
    the first capture (its own alone), every value changes right after each save() returns,
    and every step restores equal to its state on this world size."""
    from fastckpt.series.sharded import Ranks, StepSaver

    saver = StepSaver(Ranks(True))  # the capture the manager makes, looked at directly
    captured = saver.capture(os.path.join(root, "captured"), ddp_state(mesh, 0), None, {})
    staged = sorted(captured.writer._snapshots[-1].plan.tensors)
    report(rank, "staged " + " ".join(n for n in staged if not n.startswith("model.")))
    assert saver.write(captured) == "planned"
    saver.close()
    with fastckpt.CheckpointManager(os.path.join(root, "steps"), keep_last=None) as manager:
        for step in (1, 2, 3):
            state = ddp_state(mesh, step)
            future = manager.save(step, state)
            for value in _locals(state).values():  # after the call: not saved
                value.add_(1000)
            future.result()
        report(rank, "outcomes " + " ".join(manager._steps.outcomes))
        for step in (1, 2, 3):
            target = ddp_state(mesh, 0)
            assert manager.restore(step, state=target)[0] == step
            expected = _locals(ddp_state(mesh, step))
            for name, value in _locals(target).items():
                assert torch.equal(value, expected[name]), (step, name)
            assert target["step"] == step
        report(rank, "ddp steps restored")
    dist.barrier()
    dist.destroy_process_group()


def with_own_values(state: dict, rank: int, step: int) -> dict:
    """``state`` with what only rank 1 holds: a plain tensor larger than any other (the
    owners it computes for the replicated tensors differ from rank 0's) and a list (values
    saved as bytes)."""
    if rank != 1:
        return state
    ddp = {**state["ddp"], "big": torch.full((8192,), float(step))}
    return {**state, "ddp": ddp, "loader": list(range(3))}


def ddp_saves_differ(rank: int, world: int, mesh, root: str) -> None:
    """Rank 1 holds replicated items rank 0 does not from the first save on: the ranks'
    digests differ in the save's handshake, so every save copies every replicated item and
    succeeds; every step saved restores equal to its state at the call."""
    with fastckpt.CheckpointManager(root, keep_last=None) as manager:
        saved = []
        for step in (1, 2, 3):
            state = with_own_values(ddp_state(mesh, step), rank, step)
            future = manager.save(step, state)
            for value in _locals(state).values():  # after the call: not saved
                value.add_(1000)
            error = future.exception(timeout=120)
            told = (
                f"step {step}: {type(error).__name__}: {error}" if error else f"step {step} saved"
            )
            report(rank, told)
            if error is None:
                saved.append(step)
            else:
                try:  # every rank raises the failure at its next call, then goes on
                    manager.save(step, state)
                except Exception:
                    pass
        report(rank, "outcomes " + " ".join(manager._steps.outcomes))
        for step in saved:
            target = with_own_values(ddp_state(mesh, 0), rank, 0)
            assert manager.restore(step, state=target)[0] == step
            expected = _locals(with_own_values(ddp_state(mesh, step), rank, step))
            for name, value in _locals(target).items():
                assert torch.equal(value, expected[name]), (step, name)
        report(rank, f"saved steps {saved} restored")
    dist.barrier()
    dist.destroy_process_group()


def hang_in_save(rank: int, world: int, mesh, root: str) -> None:
    """FASTCKPT_GROUP_TIMEOUT is short; rank 1 hangs while writing its file of step 2 (it
    sleeps): rank 0's save fails once the group's timeout passes."""
    with fastckpt.CheckpointManager(root, keep_last=None) as manager:
        manager.save(1, state_of(mesh, 1)).result()
        if rank == 1:
            from fastckpt.integrations.dcp import FastCkptWriter

            def hang(*args, **kwargs):
                report(rank, "hanging")
                time.sleep(600)

            FastCkptWriter.write_data = hang
        started = time.monotonic()
        error = manager.save(2, state_of(mesh, 2)).exception(timeout=600)
        report(
            rank, f"step 2 failed after {time.monotonic() - started:.1f} s: {type(error).__name__}"
        )
        report(rank, f"steps {manager.steps()}")
    os._exit(0)  # the group lost a rank; nothing left to tear down cleanly


def main(rank: int, world: int, port: int, case: str, root: str, nofile: int = 0) -> None:
    if nofile:  # as a job under a low limit of open files runs
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
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
    cases = {
        "async": async_saves,
        "lazy": lazy_saves,
        "fail": one_rank_fails,
        "replan0": lambda *a: one_rank_changes_structure(*a, changer=0),
        "replan1": lambda *a: one_rank_changes_structure(*a, changer=1),
        "hang": hang_in_save,
        "ddp": ddp_saves,
        "ddp-differ": ddp_saves_differ,
    }
    cases[case](rank, world, mesh, root)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    nofile = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], nofile)
