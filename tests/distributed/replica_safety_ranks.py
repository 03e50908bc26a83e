"""One rank of a ``CheckpointManager(replicas=1)`` run on simulated nodes, for
test_replica_safety.py: ``python replica_safety_ranks.py RANK WORLD PORT BASE MODE [ARGS...]``.

The node is ``FASTCKPT_NODE``; the rank's fast tier is ``BASE/node-<n>/rank-<r>`` and its
root ``BASE/root/rank-<r>`` (see replication_ranks.py). The state of a step is
:func:`state_of` with a ``salt``: a step number saved again after it was set aside holds
other values. Each rank prints one JSON line of results (prefixed ``RESULT``).

Modes:
    save STEPS SALT: saves steps 1..STEPS, closes; says what its fast tier holds.
    restore STEPS SALTS [RESUME_SALT]: restores (``STEPS``: ``none``, or one step per rank,
        comma-separated); says the step, its source and which of ``SALTS`` (comma-separated)
        its values are; with ``RESUME_SALT``, then saves the next step.
    url-root: root at ``memory://``: saves 1..3, node 2 loses its fast tier and its newest
        step everywhere, a new manager restores and every rank saves step 3 again.
    drain: a new manager drains what its fast tier holds; says the drain's error.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from fastckpt import CheckpointManager
from fastckpt.distributed.groups import node_rank

NUMEL = 256


def state_of(rank: int, step: int, salt: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank * 100_003 + step + salt * 7_919)
    return {"w": torch.randn(NUMEL, generator=generator), "step": torch.tensor([step])}


def dirs(base: str, rank: int) -> tuple[str, str]:
    fast = os.path.join(base, f"node-{node_rank()}", f"rank-{rank:05d}")
    return os.path.join(base, "root", f"rank-{rank:05d}"), fast


def holdings(fast: str) -> dict[str, list[str]]:
    """The steps of a fast tier and the replicas it keeps (directory names)."""
    store = os.path.join(fast, ".replicas")
    replicas = []
    if os.path.isdir(store):
        for source in sorted(os.listdir(store)):
            if source.startswith("from-rank-") and os.path.isdir(os.path.join(store, source)):
                replicas += [
                    f"{source}/{n}" for n in sorted(os.listdir(os.path.join(store, source)))
                ]
    steps = (
        sorted(n for n in os.listdir(fast) if n.startswith("step-")) if os.path.isdir(fast) else []
    )
    return {"steps": steps, "replicas": replicas}


def which_salt(rank: int, step: int, state: dict, salts: list[int]) -> int | None:
    for salt in salts:
        if torch.equal(state["w"], state_of(rank, step, salt)["w"]):
            return salt
    return None


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def main() -> None:
    rank, world, port, base, mode, *args = sys.argv[1:]
    me = int(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=me, world_size=int(world), timeout=timedelta(seconds=90))
    root, fast = dirs(base, me)
    result: dict = {"rank": me, "node": node_rank()}
    if mode == "save":
        steps, salt = int(args[0]), int(args[1])
        manager = CheckpointManager(root, fast=fast, replicas=1, keep_last=2)
        for step in range(1, steps + 1):
            manager.save(step, state_of(me, step, salt)).result()
        manager.close()
        result.update(holdings(fast))
    elif mode == "restore":
        asked = None if args[0] == "none" else int(args[0].split(",")[me])
        salts = [int(s) for s in args[1].split(",")]
        manager = CheckpointManager(root, fast=fast, replicas=1, keep_last=3)
        try:
            step, state = manager.restore(step=asked)
            result["step"] = step
            result["salt"] = which_salt(me, step, state, salts)
            result["source"] = manager.recovery.sources[me]  # type: ignore[union-attr]
            if len(args) > 2:
                resumed = state_of(me, step + 1, int(args[2]))
                try:
                    manager.save(step + 1, resumed).result()
                    result["resumed"] = step + 1
                except Exception as exc:
                    result["resumed"] = error_text(exc)
        except Exception as exc:
            result["error"] = error_text(exc)
        try:  # (a drain of a damaged copy, started with the manager, failed: said here)
            manager.close()
        except Exception as exc:
            result["close"] = error_text(exc)
        result.update(holdings(fast))
    elif mode == "url-root":
        from fastckpt.series import steps as layout

        url = f"memory://replica-safety/rank-{me:05d}"
        manager = CheckpointManager(url, fast=fast, replicas=1, keep_last=3)
        for step in (1, 2, 3):
            manager.save(step, state_of(me, step, 0)).result()
        manager.close()
        dist.barrier()
        if node_rank() == 2:  # node 2 is lost, and its step 3 was never drained
            shutil.rmtree(os.path.join(base, "node-2"))
            layout.remove_step(layout.Tier(url), 3)
        # nor replicated: no rank holds a copy of step 3 of node 2's rank
        shutil.rmtree(os.path.join(fast, ".replicas", "from-rank-00002"), ignore_errors=True)
        dist.barrier()
        manager = CheckpointManager(url, fast=fast, replicas=1, keep_last=3)
        step, state = manager.restore()
        result["step"], result["salt"] = step, which_salt(me, step, state, [0])
        try:
            manager.save(step + 1, state_of(me, step + 1, 1)).result()
            result["resumed"] = step + 1
        except Exception as exc:
            result["resumed"] = error_text(exc)
        manager.close()
        fs_listing = layout.Tier(url).fs()
        names = fs_listing[0].ls(fs_listing[1], detail=False)
        result["root"] = sorted(os.path.basename(p.rstrip("/")) for p in names)
        result["committed"] = layout.committed_steps(url)
    elif mode == "drain":
        manager = CheckpointManager(root, fast=fast, replicas=1, keep_last=3)
        try:
            manager.wait()
            result["drain"] = None
        except Exception as exc:
            result["drain"] = error_text(exc)
        step, state = manager.restore()
        result["step"], result["salt"] = step, which_salt(me, step, state, [0])
        manager.close()
        from fastckpt.series import steps as layout

        result["root_steps"] = layout.committed_steps(root)
        result.update(holdings(fast))
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
