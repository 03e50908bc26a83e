"""One rank of a run on simulated nodes, for test_replication.py, the node torture and the
replication bench: ``python replication_ranks.py RANK WORLD PORT BASE MODE [ARGS...]``.

The node is ``FASTCKPT_NODE`` (set by the caller); the rank's fast tier is
``BASE/node-<n>/rank-<r>`` (so deleting ``BASE/node-<n>`` loses the node's memory) and its
root ``BASE/root/rank-<r>``. Each rank prints one JSON line of results (prefixed ``RESULT``).

Modes:
    manager-save STEPS NUMEL [RATE]: a CheckpointManager(replicas=1) saves steps 1..STEPS.
    manager-restore [resume]: a fresh manager restores; checks the state bit-identical to
        the saved; with ``resume``, then saves the next step.
    replicator-save STEPS NBYTES RATE [KILL_AFTER]: a Replicator replicates steps 1..STEPS;
        with KILL_AFTER, ranks of the node ``FASTCKPT_VICTIM`` SIGKILL themselves that many
        seconds after queuing the last step (mid-replication).
    replicator-recover: a Replicator recovers the newest step every rank can get.
    peers K: a Replicator with replicas=K says its targets and sources.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from fastckpt.distributed.groups import node_rank


def state_of(rank: int, step: int, numel: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank * 100_003 + step)
    return {"w": torch.randn(numel, generator=generator), "step": torch.tensor([step])}


def bytes_of(rank: int, step: int, nbytes: int) -> bytes:
    generator = torch.Generator().manual_seed(rank * 100_003 + step)
    return (
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).numpy().tobytes()
    )


def dirs(base: str, rank: int) -> tuple[str, str]:
    fast = os.path.join(base, f"node-{node_rank()}", f"rank-{rank:05d}")
    return os.path.join(base, "root", f"rank-{rank:05d}"), fast


def main() -> None:
    rank, world, port, base, mode, *args = sys.argv[1:]
    rank_, world_ = int(rank), int(world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank_, world_size=world_, timeout=timedelta(seconds=60))
    root, fast = dirs(base, rank_)
    result: dict = {"rank": rank_, "node": node_rank()}
    if mode == "manager-save":
        from fastckpt import CheckpointManager

        steps, numel = int(args[0]), int(args[1])
        rate = float(args[2]) if len(args) > 2 else None
        manager = CheckpointManager(
            root, fast=fast, replicas=1, keep_last=2, replication_bytes_per_second=rate
        )
        for step in range(1, steps + 1):
            manager.save(step, state_of(rank_, step, numel)).result()
        manager.close()
        result["bytes_sent"] = manager._replicator.bytes_sent  # type: ignore[union-attr]
    elif mode == "manager-restore":
        from fastckpt import CheckpointManager

        manager = CheckpointManager(root, fast=fast, replicas=1)
        started = time.perf_counter()
        step, state = manager.restore()
        result["seconds"] = time.perf_counter() - started
        expected = state_of(rank_, step, state["w"].numel())
        result["identical"] = all(torch.equal(state[k], expected[k]) for k in expected)
        result["step"] = step
        result["source"] = manager.recovery.sources[rank_]  # type: ignore[union-attr]
        if args and args[0] == "resume":  # training goes on: the next step is saved
            manager.save(step + 1, state_of(rank_, step + 1, state["w"].numel())).result()
            result["resumed"] = step + 1
        manager.close()
    elif mode == "replicator-save":
        from fastckpt.distributed.replication import Replicator

        steps, nbytes, rate = int(args[0]), int(args[1]), float(args[2])
        kill_after = float(args[3]) if len(args) > 3 else None
        replicator = Replicator(os.path.join(fast, ".replicas"), replicas=1, bytes_per_second=rate)
        futures = []
        for step in range(1, steps + 1):
            directory = os.path.join(fast, f"step-{step:012d}")
            os.makedirs(directory)
            with open(os.path.join(directory, "data.bin"), "wb") as f:
                f.write(bytes_of(rank_, step, nbytes))
            with open(os.path.join(directory, "COMMITTED"), "w") as f:
                f.write(json.dumps({"step": step}))
            futures.append(replicator.replicate(step, directory, ["data.bin", "COMMITTED"]))
            if step < steps:
                futures[-1].result()
        victim = os.environ.get("FASTCKPT_VICTIM")
        if kill_after is not None and victim is not None and int(victim) == node_rank():
            threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
        seen: list[str] = []  # a half-received replica seen on disk while the round runs

        def watch() -> None:
            while not futures[-1].done():
                names = os.listdir(replicator.store.directory)
                seen.extend(n for n in names if n.startswith(".incoming-") and n not in seen)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            futures[-1].result(timeout=120)
            result["last"] = "replicated"
        except Exception as exc:
            result["last"] = f"failed: {type(exc).__name__}"
        watcher.join()
        result["seen_incoming"] = seen
        result["held"] = replicator.store.held()
        result["incoming"] = [
            n for n in os.listdir(replicator.store.directory) if n.startswith(".incoming-")
        ]
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # the group may be broken: no collective teardown
    elif mode == "replicator-recover":
        from fastckpt.distributed.replication import Replicator

        replicator = Replicator(os.path.join(fast, ".replicas"), replicas=1)
        os.makedirs(fast, exist_ok=True)
        own = [
            int(n[5:])
            for n in os.listdir(fast)
            if n.startswith("step-") and os.path.exists(os.path.join(fast, n, "COMMITTED"))
        ]
        recovery = replicator.recover(own, [], lambda s: os.path.join(fast, f"step-{s:012d}"))
        result["step"], result["source"] = recovery.step, recovery.sources[rank_]
        with open(os.path.join(fast, f"step-{recovery.step:012d}", "data.bin"), "rb") as f:
            data = f.read()
        result["identical"] = data == bytes_of(rank_, recovery.step, len(data))
        replicator.close()
    elif mode == "peers":
        from fastckpt.distributed.replication import Replicator

        replicator = Replicator(os.path.join(fast, ".replicas"), replicas=int(args[0]))
        result["targets"], result["sources"] = replicator.targets, replicator.sources
        replicator.close()
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
