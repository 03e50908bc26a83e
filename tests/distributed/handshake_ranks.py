"""One rank of the tests of calls that not every rank makes, run as its own process (gloo on
loopback, as torchrun starts ranks): ``python handshake_ranks.py RANK WORLD PORT CASE ROOT
[NOFILE]`` (NOFILE: the soft limit of open files this rank runs under). Ranks report on
stdout as ``rank R: ...`` lines that the test reads."""

from __future__ import annotations

import datetime
import os
import resource
import sys
import time
import warnings

import torch
import torch.distributed as dist

import fastckpt
from fastckpt import config
from fastckpt.distributed.handshake import HandshakeError, handshake


def report(rank: int, text: str) -> None:
    print(f"rank {rank}: {text}", flush=True)


def fails_fast(rank: int, call) -> None:
    """Runs ``call``, which must raise HandshakeError; reports its message and how long."""
    started = time.monotonic()
    try:
        call()
    except HandshakeError as exc:
        report(rank, f"failed after {time.monotonic() - started:.1f} s: {exc}")
    else:
        report(rank, "did not fail")


def wait_out(rank: int) -> None:
    """A rank that does not make the call: it stays (the store lives in rank 0's process)
    until the others have failed, then meets them at a barrier of the default group."""
    time.sleep(config.handshake_timeout_seconds() + 1)
    report(rank, "stayed away")


def manager_on_rank_0(rank: int, world: int, root: str) -> None:
    """``if rank == 0: CheckpointManager(root).save(...)``."""
    if rank == 0:
        fails_fast(rank, lambda: fastckpt.CheckpointManager(root).save(1, {"w": torch.ones(4)}))
    else:
        wait_out(rank)
    dist.barrier()


def save_on_rank_0(rank: int, world: int, root: str) -> None:
    """A manager on every rank, save() on rank 0 alone; then every rank saves a step."""
    with fastckpt.CheckpointManager(root) as manager:
        if rank == 0:
            fails_fast(rank, lambda: manager.save(1, {"w": torch.ones(4)}))
        else:
            wait_out(rank)
        dist.barrier()
    report(rank, "closed")


def restore_other_steps(rank: int, world: int, root: str) -> None:
    """Every rank saves steps 1 and 2, then restores step 1 + rank: every rank fails,
    naming the ranks and their steps; then every rank restores step 2."""
    with fastckpt.CheckpointManager(root) as manager:
        for step in (1, 2):
            manager.save(step, {"w": torch.full((4,), float(step))})
        manager.wait()
        target = {"w": torch.zeros(4)}
        fails_fast(rank, lambda: manager.restore(1 + rank, state=target))
        assert manager.restore(2, state=target)[0] == 2 and target["w"][0] == 2
        report(rank, "restored 2")


def different_calls(rank: int, world: int, root: str) -> None:
    """Rank 0 saves while rank 1 restores: both fail at once, naming what each called."""
    with fastckpt.CheckpointManager(root) as manager:
        manager.save(1, {"w": torch.ones(4)}).result()
        if rank == 0:
            fails_fast(rank, lambda: manager.save(2, {"w": torch.ones(4)}))
        else:
            fails_fast(rank, lambda: manager.restore(1, state={"w": torch.zeros(4)}))


def load_on_rank_0(rank: int, world: int, root: str) -> None:
    """``fastckpt.load(path, group=True)`` on rank 0 alone (the group made on every rank)."""
    from fastckpt.distributed.groups import checkpoint_group

    checkpoint_group()
    path = os.path.join(root, "model.safetensors")
    if rank == 0:
        fastckpt.save({"w": torch.ones(4)}, path)
        fails_fast(rank, lambda: fastckpt.load(path, group=True))
    else:
        wait_out(rank)
    dist.barrier()


def round_trips(rank: int, world: int, root: str) -> None:
    """Many handshakes in a row: how long one takes, and that the store's keys stay few."""
    store = dist.distributed_c10d._get_default_store()
    handshake("warm-up")
    before = store.num_keys()
    count = 300
    started = time.perf_counter()
    for i in range(count):
        handshake("round trip", agree_on={"i": i})
    seconds = (time.perf_counter() - started) / count
    dist.barrier()
    report(rank, f"one handshake {seconds * 1e6:.0f} us")
    report(rank, f"keys grew by {store.num_keys() - before}")


CASES = {
    "manager": manager_on_rank_0,
    "save": save_on_rank_0,
    "restore": restore_other_steps,
    "different": different_calls,
    "load": load_on_rank_0,
    "round_trips": round_trips,
}


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
        timeout=datetime.timedelta(seconds=120),
    )
    CASES[case](rank, world, root)
    report(rank, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    nofile = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], nofile)
