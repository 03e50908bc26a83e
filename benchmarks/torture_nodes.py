"""Torture part ``node-kills`` of benchmarks/torture.py: simulated nodes lost at random points
of a run with ``CheckpointManager(replicas=1)``.

Each round runs 4 ranks on 2 simulated nodes (``FASTCKPT_NODE``; each rank's fast tier under
its node's directory, each rank's root on the disk; replication and drains paced so that a
kill often lands while a step is being replicated or drained). A random node is lost at a
random moment (its processes SIGKILLed, its directory deleted, then the job's other
processes killed too, as a job is restarted when a node fails): during saves and
replication, and in half of the rounds again during the restore that follows. A last
restore on all nodes must then give every rank the newest step that survives for every
rank somewhere (its own fast tier, a peer's complete replica, its root), computed from what
is on disk, bit-identical to what was saved.

Counted as bad: a rank restoring an older step than survives (a committed step lost while a
copy of it survives), a rank restoring a state that is not the saved one (a partial or mixed
step), a rank whose restore fails while a step survives, ranks restoring different steps, and a
save of the next step refused after the restore (training goes on from the step restored).

Run alone: python benchmarks/torture_nodes.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

NODES, PER_NODE = 2, 2
NUMEL = 1 << 18  # 1 MiB per rank
SCRIPT = os.path.abspath(__file__)


def _state(rank: int, step: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(rank * 100_003 + step)
    return {"w": torch.randn(NUMEL, generator=generator), "step": torch.tensor([step])}


def _dirs(base: str, rank: int) -> tuple[str, str]:
    node = rank // PER_NODE
    return (
        os.path.join(base, "root", f"rank-{rank:05d}"),
        os.path.join(base, f"node-{node}", f"rank-{rank:05d}"),
    )


def _child(rank: int, world: int, port: int, base: str, mode: str) -> None:
    import torch.distributed as dist

    from fastckpt import CheckpointManager

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["FASTCKPT_NODE"] = str(rank // PER_NODE)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    root, fast = _dirs(base, rank)
    manager = CheckpointManager(
        root,
        fast=fast,
        replicas=1,
        keep_last=2,
        drain_bytes_per_second=8e6,  # root lags: peers are what keep the newest step
        replication_bytes_per_second=4e6,
    )
    if mode == "save":
        start = (manager.latest() or 0) + 1
        for step in range(start, start + 1000):
            manager.save(step, _state(rank, step)).result()
            print(f"COMMITTED {step}", flush=True)
            time.sleep(0.2)
    else:
        import torch

        result: dict[str, Any] = {"rank": rank}
        try:
            step, state = manager.restore()
            expected = _state(rank, step)
            result["step"] = step
            result["identical"] = all(torch.equal(state[k], expected[k]) for k in expected)
            result["source"] = manager.recovery.sources[rank]  # type: ignore[union-attr]
            try:  # training goes on from the step restored
                manager.save(step + 1, _state(rank, step + 1)).result()
                result["resumed"] = True
            except Exception as exc:
                result["resumed"] = f"{type(exc).__name__}: {exc}"
        except FileNotFoundError as exc:
            result["step"], result["error"] = None, str(exc)
        print("RESULT " + json.dumps(result), flush=True)
        manager.close()
        dist.destroy_process_group()


def _start(base: Path, mode: str) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = NODES * PER_NODE
    return [
        subprocess.Popen(
            [sys.executable, SCRIPT, "--child", str(r), str(world), str(port), str(base), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(world)
    ]


def _lose_node(base: Path, children: list[subprocess.Popen], node: int, rng: random.Random) -> None:
    """SIGKILLs the node's processes, deletes its memory, then ends the job's other ranks."""
    for rank in range(node * PER_NODE, (node + 1) * PER_NODE):
        children[rank].kill()
    for rank in range(node * PER_NODE, (node + 1) * PER_NODE):
        children[rank].wait()
    shutil.rmtree(base / f"node-{node}", ignore_errors=True)
    time.sleep(rng.uniform(0, 0.3))  # the survivors notice (or not) before the restart
    for child in children:
        if child.poll() is None:
            child.kill()
    for child in children:
        child.wait()


def _survives(base: Path) -> int | None:
    """The newest step every rank can get from disk: own fast tier, a peer's complete
    replica, or its root (what a restore must take)."""
    from fastckpt.distributed.replica_store import ReplicaStore
    from fastckpt.series import steps as layout

    world = NODES * PER_NODE
    held: dict[int, set[int]] = {r: set() for r in range(world)}
    for rank in range(world):
        store = Path(_dirs(str(base), rank)[1]) / ".replicas"
        if store.is_dir():
            for source, steps in ReplicaStore(store).held().items():
                held[source] |= set(steps)
    available = []
    for rank in range(world):
        root, fast = _dirs(str(base), rank)
        mine = set(held[rank])
        for tier in (root, fast):
            if os.path.isdir(tier):
                mine |= set(layout.committed_steps(tier))
        available.append(mine)
    common = set.intersection(*available)
    return max(common) if common else None


def _restore(base: Path) -> list[dict[str, Any]]:
    children = _start(base, "restore")
    results = []
    for child in children:
        out, err = child.communicate(timeout=300)
        lines = [line[7:] for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(lines[-1]) if lines else {"error": err[-1500:]})
    return results


def node_kills(work: Path, rounds: int, seed: int) -> dict[str, Any]:
    """Runs ``rounds`` rounds (see the module's description); the report's counts."""
    rng = random.Random(seed)
    report: dict[str, Any] = {
        "rounds": rounds,
        "kills during saves and replication": 0,
        "kills during a restore": 0,
        "steps committed on every rank before the kills": 0,
        "steps restored from peers": 0,
        "steps restored from own memory or root": 0,
        "committed steps lost while a copy survived": 0,
        "states not the saved one": 0,
        "restores failed while a step survived": 0,
        "ranks disagreeing on the step": 0,
        "saves refused after the restore": 0,
        "newest committed step not surviving (in flight when killed)": 0,
    }
    for index in range(rounds):
        base = work / f"nodes-{index}"
        base.mkdir()
        children = _start(base, "save")
        committed = [0] * len(children)

        def follow(rank: int, child: subprocess.Popen, committed: list[int] = committed) -> None:
            assert child.stdout is not None
            for line in child.stdout:
                if line.startswith("COMMITTED"):
                    committed[rank] = int(line.split()[1])

        readers = [
            threading.Thread(target=follow, args=rc, daemon=True) for rc in enumerate(children)
        ]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 120
        while min(committed) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 2.0))  # a random point of the saves and replications
        _lose_node(base, children, rng.randrange(NODES), rng)
        for reader in readers:
            reader.join()
        report["kills during saves and replication"] += 1
        report["steps committed on every rank before the kills"] += min(committed)
        if rng.random() < 0.5:  # lose a node again, this time while the next run restores
            children = _start(base, "restore")
            time.sleep(rng.uniform(2.5, 6.0))
            _lose_node(base, children, rng.randrange(NODES), rng)
            report["kills during a restore"] += 1
        expected = _survives(base)
        results = _restore(base)
        steps = {r.get("step") for r in results}
        report["ranks disagreeing on the step"] += len(steps) > 1
        for result in results:
            step = result.get("step")
            if step is None:
                report["restores failed while a step survived"] += expected is not None
                if expected is not None:
                    error = result.get("error", "")
                    if "Connection closed by peer" not in error:
                        report.setdefault("first failure", (expected, error[-1500:]))
                continue
            if expected is not None and step < expected:
                report["committed steps lost while a copy survived"] += 1
            if not result.get("identical"):
                report["states not the saved one"] += 1
            if result.get("resumed") is not True:
                report["saves refused after the restore"] += 1
                report.setdefault("first refusal", str(result.get("resumed"))[-600:])
            source = result.get("source") or ""
            report[
                "steps restored from peers"
                if source.startswith("peer")
                else "steps restored from own memory or root"
            ] += 1
        everywhere = min(committed) if committed else 0
        if expected is not None and everywhere > expected:
            report["newest committed step not surviving (in flight when killed)"] += 1
        shutil.rmtree(base, ignore_errors=True)
    return report


def bad_outcomes(report: dict[str, Any]) -> int:
    """The count of outcomes that must never happen."""
    return sum(
        report[k]
        for k in (
            "committed steps lost while a copy survived",
            "states not the saved one",
            "restores failed while a step survived",
            "ranks disagreeing on the step",
            "saves refused after the restore",
        )
    )


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        rank, world, port, base, mode = sys.argv[2:7]
        _child(int(rank), int(world), int(port), base, mode)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fastckpt-torture-nodes-", dir=args.dir))
    try:
        report = node_kills(work, args.rounds, args.seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 1 if bad_outcomes(report) else 0


if __name__ == "__main__":
    sys.exit(main())
