"""Torture part ``collective-kills``: asynchronous multi-rank saves with one rank killed
(SIGKILL) at a random moment.

Each run starts ``RANKS`` processes (gloo on loopback) that train a sharded state (DTensors
sharded over the ranks, one replicated, a step counter) and save every step with a
:class:`fastckpt.CheckpointManager` (every other step lazily, ``fence=optimizer``). Before
each save every rank records the digest of each of its shards (durably, in
``expected/<step>/<rank>.json``); once a save's future is done, rank 0 prints
``committed <step>``. The parent waits for a random number of saves, sleeps a random
fraction of a second, kills one random rank, and waits for the others to stop (their
collectives fail). It then restores every committed step in one process (every value
whole, split again into each rank's shards) and compares it with the records.

The next run resumes from the newest committed step (its state loaded on every rank) and
saves the steps after it.

Bad outcomes: a committed step that restores other bytes than were saved, or does not
restore (a partial step); a step rank 0 reported committed that is not (a lost step); a
committed step with no record; a run that did not resume from the newest committed step.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from torture_mutations import _lines_until_saved  # the same harness reads ranks' progress

RANKS = 3

CHILD = textwrap.dedent(
    r"""
    import datetime, hashlib, json, os, sys, warnings
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    import fastckpt

    warnings.filterwarnings("ignore")
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    root, expected, seed = sys.argv[4], sys.argv[5], int(sys.argv[6])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (world,))
    rows, cols = 256, 1024  # 1 MiB per shard
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    params = [torch.nn.Parameter(torch.randn(rows, cols, generator=gen)) for _ in range(3)]
    shared = torch.nn.Parameter(torch.ones(64, 64) * seed)  # the same on every rank
    optimizer = torch.optim.Adam(params + [shared], lr=1e-3)

    def shard(t):
        return DTensor.from_local(t.detach(), mesh, [Shard(0)], run_check=False,
                                  shape=(rows * world, cols), stride=(cols, 1))

    def state(step):
        return {
            "model": {f"w{i}": shard(p) for i, p in enumerate(params)},
            "optim": {f"w{i}": {"exp_avg": shard(optimizer.state[p]["exp_avg"]),
                                "exp_avg_sq": shard(optimizer.state[p]["exp_avg_sq"])}
                      for i, p in enumerate(params)},
            "shared": DTensor.from_local(shared.detach(), mesh, [Replicate()], run_check=False),
            "step": step,
        }

    def digest(t):
        data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
        return hashlib.blake2b(data, digest_size=12).hexdigest()

    def digests():
        out = {f"model.w{i}": digest(p) for i, p in enumerate(params)}
        for i, p in enumerate(params):
            out[f"optim.w{i}.exp_avg"] = digest(optimizer.state[p]["exp_avg"])
            out[f"optim.w{i}.exp_avg_sq"] = digest(optimizer.state[p]["exp_avg_sq"])
        out["shared"] = digest(shared)
        return out

    def record(step):
        folder = os.path.join(expected, str(step))
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(digests(), f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(folder, f"{rank}.json"))

    def train():
        for p in params + [shared]:
            p.grad = torch.ones_like(p) * 1e-2
        optimizer.step()

    train()  # Adam's state exists from here on
    with fastckpt.CheckpointManager(root, keep_last=None) as manager:
        start = 0
        if manager.latest() is not None:
            start, _ = manager.restore(state=state(0))
            print(f"resumed {start}", flush=True)
        futures = []
        for step in range(start + 1, start + 1000):
            record(step)
            lazy = step % 2 == 0
            futures.append((step, manager.save(step, state(step),
                                               **({"fence": optimizer} if lazy else {}))))
            print(f"saved {step}", flush=True)
            train()  # lazy: passes the fence first
            dist.all_reduce(torch.zeros(1))  # a training collective
            while futures and futures[0][1].done():
                done, future = futures.pop(0)
                if future.exception() is None:
                    print(f"committed {done}", flush=True)
    """
)

CHECK = textwrap.dedent(
    r"""
    import hashlib, json, os, sys, fastckpt, torch

    root, expected, world = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def digest(t):
        data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
        return hashlib.blake2b(data, digest_size=12).hexdigest()

    report = {"steps": [], "wrong": [], "unrecorded": [], "failed": []}
    with fastckpt.CheckpointManager(root, keep_last=None) as manager:
        for step in manager.steps():
            report["steps"].append(step)
            folder = os.path.join(expected, str(step))
            records = [os.path.join(folder, f"{r}.json") for r in range(world)]
            if not all(os.path.exists(p) for p in records):
                report["unrecorded"].append(step)
                continue
            try:
                _, saved = manager.restore(step)
            except Exception as exc:
                report["failed"].append([step, f"{type(exc).__name__}: {exc}"[:200]])
                continue
            whole = {f"model.{k}": v for k, v in saved["model"].items()}
            for k, moments in saved["optim"].items():
                for name, v in moments.items():
                    whole[f"optim.{k}.{name}"] = v
            for r, path in enumerate(records):
                got = {k: digest(v.chunk(world)[r]) for k, v in whole.items()}
                got["shared"] = digest(saved["shared"])
                want = json.load(open(path))
                if got != want or saved["step"] != step:
                    report["wrong"].append([step, r])
    print(json.dumps(report))
    """
)


def collective_kills(work: Path, count: int, seed: int) -> dict[str, Any]:
    """``count`` runs of ``RANKS`` ranks, one rank killed in each, checked after each."""
    rng = random.Random(seed)
    root, expected = work / "collective-root", work / "collective-expected"
    expected.mkdir(parents=True)
    report: dict[str, Any] = {
        "kills": 0,
        "saves started": 0,
        "steps checked": 0,
        "partial steps restored": 0,
        "committed steps lost": 0,
        "steps committed without a record": 0,
        "runs that did not resume from the newest step": 0,
        "ranks that hung": 0,
        "examples": [],
    }
    newest: int | None = None
    for run in range(count):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    CHILD,
                    str(r),
                    str(RANKS),
                    str(port),
                    str(root),
                    str(expected),
                    str(seed + run),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(RANKS)
        ]
        # gated on the run's progress, not on time: a busy machine imports torch slowly
        lines = _lines_until_saved(ranks[0], rng.randint(1, 5))
        time.sleep(rng.uniform(0.0, 0.4))  # then anywhere in a save's phases
        victim = rng.randrange(RANKS)
        if ranks[victim].poll() is None:
            ranks[victim].kill()
            report["kills"] += 1
        outputs = []
        for child in ranks:
            try:
                out, _ = child.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                report["ranks that hung"] += 1
                child.kill()
                out, _ = child.communicate()
            outputs.append(out)
        out0 = lines + outputs[0]
        report["saves started"] += out0.count("saved ")
        committed = {
            int(line.split()[1]) for line in out0.splitlines() if line.startswith("committed ")
        }
        resumed = [
            int(line.split()[1]) for line in out0.splitlines() if line.startswith("resumed ")
        ]
        if newest is not None and resumed != [newest]:
            report["runs that did not resume from the newest step"] += 1
            report["examples"].append(f"run {run}: resumed {resumed}, newest {newest}")
        checked = subprocess.run(
            [sys.executable, "-c", CHECK, str(root), str(expected), str(RANKS)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if checked.returncode:
            report["examples"].append(checked.stderr.strip().splitlines()[-1:])
            report["partial steps restored"] += 1  # nothing could be checked: counted bad
            continue
        result = json.loads(checked.stdout)
        report["steps checked"] += len(result["steps"])
        report["partial steps restored"] += len(result["wrong"]) + len(result["failed"])
        report["steps committed without a record"] += len(result["unrecorded"])
        lost = sorted(committed - set(result["steps"]))
        report["committed steps lost"] += len(lost)
        for key in ("wrong", "failed", "unrecorded"):
            report["examples"].extend(result[key][:2])
        if lost:
            report["examples"].append(f"run {run}: lost {lost}")
        newest = max(result["steps"]) if result["steps"] else newest
    report["examples"] = report["examples"][:10]
    return report


def bad_outcomes(report: dict[str, Any]) -> int:
    """The count of outcomes that must never happen."""
    return (
        report["partial steps restored"]
        + report["committed steps lost"]
        + report["steps committed without a record"]
        + report["runs that did not resume from the newest step"]
        + report["ranks that hung"]
    )
