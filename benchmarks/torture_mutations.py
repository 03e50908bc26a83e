"""Torture part ``mutation-kills``: a training run that changes its state every way torch
does, saving incremental and lazy steps, killed with SIGKILL at random times.

The child trains a model with BatchNorm (statistics changed by the forward pass with no
version bump) under a fused AdamW (no version bump either), keeps a foreach EMA, writes
weights through ``.data`` and an ``out=`` op, and saves each step with a
:class:`fastckpt.CheckpointManager` -- incremental steps, every other one lazy
(``fence=optimizer``). Before each save it records the XXH3-128 of every tensor it is about
to save (durably, in ``expected/<step>.json``). The parent kills it at a random moment,
then restores every committed step with a fresh manager and compares each tensor's hash
with the record. A run resumes from the newest step (its state loaded back into the model
and optimizer) and goes on saving incremental steps over it.

Bad outcomes: a committed step that restores different bytes than were saved, a committed
step with no record (saved before its values were known), a run with nothing to resume
from after a step was committed, a child that failed other than by the kill.
"""

from __future__ import annotations

import json
import random
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

CHILD = textwrap.dedent(
    r"""
    import json, os, sys, torch, fastckpt
    from fastckpt.checkpoint.digests import hash_tensor
    from fastckpt.checkpoint.tree import flatten

    root, expected, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.BatchNorm1d(512),
                                torch.nn.Tanh(), torch.nn.Linear(512, 512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ema = [p.detach().clone() for p in model.parameters()]

    def state(step):
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "ema": ema, "step": step}

    def record(step):
        flat = flatten(state(step))
        hashes = {name: hash_tensor(t) for name, t in flat.tensors.items()}
        tmp = os.path.join(expected, f".{step}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(hashes, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(expected, f"{step}.json"))

    def train():
        model.train()
        model(torch.randn(64, 64)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            params = list(model.parameters())
            torch._foreach_lerp_(ema, [p.detach() for p in params], 0.1)
            params[0].data.mul_(0.999)
            torch.clamp(params[3], -1, 1, out=params[3])

    with fastckpt.CheckpointManager(root, incremental=True, full_every=4, keep_last=3) as m:
        start = 0
        latest = m.latest()
        if latest is not None:
            step, saved = m.restore()
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            for mine, back in zip(ema, saved["ema"]):
                mine.copy_(back)
            start = step
            print("resumed", step, flush=True)
        train()  # the optimizer's state exists from the first step on
        for step in range(start + 1, start + 1000):
            record(step)
            lazy = step % 2 == 0
            future = m.save(step, state(step), **({"fence": optimizer} if lazy else {}))
            model.train()
            with torch.no_grad():
                model(torch.randn(64, 64))  # BatchNorm only: the weights do not move
            train()  # the fenced step
            if not lazy:
                future.result()
            print("saved", step, flush=True)
    """
)

CHECK = textwrap.dedent(
    r"""
    import json, os, sys, fastckpt
    from fastckpt.checkpoint.digests import hash_tensor
    from fastckpt.checkpoint.tree import flatten

    root, expected = sys.argv[1], sys.argv[2]
    report = {"steps": 0, "wrong": [], "unrecorded": [], "failed": []}
    with fastckpt.CheckpointManager(root, keep_last=1000) as m:
        for step in m.steps():
            report["steps"] += 1
            record = os.path.join(expected, f"{step}.json")
            if not os.path.exists(record):
                report["unrecorded"].append(step)
                continue
            want = json.load(open(record))
            try:
                _, saved = m.restore(step=step)
            except Exception as exc:
                report["failed"].append([step, f"{type(exc).__name__}: {exc}"[:200]])
                continue
            flat = flatten(saved)
            got = {name: hash_tensor(t) for name, t in flat.tensors.items()}
            if got != want:
                report["wrong"].append([step, sorted(k for k in want if got.get(k) != want[k])[:4]])
    print(json.dumps(report))
    """
)


def mutation_kills(work: Path, count: int, seed: int) -> dict[str, Any]:
    """``count`` runs of the child, each killed at a random time, checked after each kill."""
    rng = random.Random(seed)
    root, expected = work / "mutations-root", work / "mutations-expected"
    expected.mkdir(parents=True)
    report: dict[str, Any] = {
        "kills": 0,
        "steps checked": 0,
        "steps restored wrong": 0,
        "steps committed without a record": 0,
        "steps that did not restore": 0,
        "runs that did not resume": 0,
        "children failed": 0,
        "examples": [],
    }
    committed_before = False
    for run in range(count):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(root), str(expected), str(seed + run)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # gated on the run's progress, not on time: a busy machine imports torch slowly
        lines = _lines_until_saved(child, rng.randint(1, 4))
        time.sleep(rng.uniform(0.0, 0.3))  # then anywhere in the next steps
        if child.poll() is None:
            child.kill()
            report["kills"] += 1
        out, err = child.communicate()
        out = lines + out
        if child.returncode not in (-9, 0):
            report["children failed"] += 1
            report["examples"].append(err.strip().splitlines()[-1:])
        if committed_before and "saved " in out and "resumed" not in out:
            report["runs that did not resume"] += 1  # it started over past committed steps
        checked = subprocess.run(
            [sys.executable, "-c", CHECK, str(root), str(expected)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if checked.returncode:
            report["children failed"] += 1
            report["examples"].append(checked.stderr.strip().splitlines()[-1:])
            continue
        result = json.loads(checked.stdout)
        report["steps checked"] += result["steps"]
        report["steps restored wrong"] += len(result["wrong"])
        report["steps committed without a record"] += len(result["unrecorded"])
        report["steps that did not restore"] += len(result["failed"])
        for key in ("wrong", "unrecorded", "failed"):
            report["examples"].extend(result[key][:2])
        committed_before = committed_before or result["steps"] > 0
    report["examples"] = report["examples"][:10]
    return report


def _lines_until_saved(child: subprocess.Popen, saves: int, timeout: float = 300.0) -> str:
    """The child's output up to its ``saves``-th "saved" line (or its end, or ``timeout``)."""
    assert child.stdout is not None
    seen, lines = 0, []
    deadline = time.monotonic() + timeout
    while seen < saves and time.monotonic() < deadline:
        ready, _, _ = select.select([child.stdout], [], [], 1.0)
        if not ready:
            continue
        line = child.stdout.readline()
        if not line:
            break
        lines.append(line)
        seen += line.startswith("saved ")
    return "".join(lines)


def bad_outcomes(report: dict[str, Any]) -> int:
    """What counts against the run in :func:`mutation_kills`'s report."""
    return sum(
        report[key]
        for key in (
            "steps restored wrong",
            "steps committed without a record",
            "steps that did not restore",
            "runs that did not resume",
            "children failed",
        )
    )
