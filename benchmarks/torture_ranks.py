"""Torture part ``adversarial-ranks`` of benchmarks/torture.py: ranks that disagree, call on
a subset, or read files swapped under them, and trees planted with links and markers.

Each scenario starts ``WORLD`` real processes (gloo on loopback, ``FASTCKPT_GROUP_TIMEOUT``
and ``FASTCKPT_HANDSHAKE_TIMEOUT`` short) that each do one thing a user or an adversary
would, and print one ``RESULT`` line: what the call returned (a digest of every value) or
the error it raised. The parent judges the ranks together:

- ``all-fail``: ranks that disagree (two checkpoints under one read-once load, different
  ``restore(step=)``, tiers that are not one directory): every rank must raise; a rank that
  returns is a silent wrong state, ranks that split are a rank going on alone.
- ``right-or-all-fail``: a file renamed over the path while ranks open it, a structure that
  changed on one rank: every rank returns the right values (one whole save, the values at
  the call) or every rank raises.
- ``right``: links and a marker at a high step planted in every tier and in the replica
  store: a fresh run saves and restores as if they were not there (they are another
  tool's: reported, never followed, never a reason to refuse the run's own steps).
- ``subset``: a collective called on rank 0 only (a manager made there, a save or a
  read-once load there): rank 0 must raise within the handshake's timeout plus slack, with a
  message that says what to do; the other ranks stay alive meanwhile, as training ranks do.

Counted as bad: a silent wrong state, a rank alone, a hang (no result past the group's
timeout plus slack; for a call on a subset, no error within the handshake's timeout plus
slack), a file outside the tiers changed. A hang is killed and counted, and
the next scenario goes on.

Run alone: python benchmarks/torture_ranks.py [--rounds 1] [--only NAME]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORLD = 2
GROUP_TIMEOUT = 10.0  # FASTCKPT_GROUP_TIMEOUT in the ranks
HANDSHAKE_TIMEOUT = 4.0  # FASTCKPT_HANDSHAKE_TIMEOUT in the ranks
SUBSET_SLACK = 6.0  # a call on a subset fails within the handshake's timeout plus this
START_SLACK = 40.0  # importing torch and starting a group on a busy 2-core machine
SCRIPT = os.path.abspath(__file__)

#: scenario -> how its ranks are judged
SCENARIOS: dict[str, str] = {
    "read-once-two-steps": "all-fail",
    "read-once-renamed-over": "right-or-all-fail",
    "load-into-two-steps": "all-fail",
    "restore-different-steps": "all-fail",
    "tiers-not-shared": "all-fail",
    "structure-changed-on-one-rank": "right-or-all-fail",
    "planted-links-and-markers": "right",
    "subset-read-once": "subset",
    "subset-manager": "subset",
    "subset-save": "subset",
}


# --------------------------------------------------------------------------- ranks


def _state(seed: int, keys: int = 6, numel: int = 1 << 14, prefix: str = "") -> dict[str, Any]:
    """Random tensors; ``prefix`` makes a rank's keys its own (a multi-rank step stores a
    key that every rank holds once, as a replicated value)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {f"{prefix}w{i}": torch.randn(numel, generator=generator) for i in range(keys)}


def _digest(value: Any) -> str:
    """A digest of a (nested) state's tensors and plain values, in key order."""
    import torch

    digest = hashlib.blake2b(digest_size=12)

    def feed(v: Any, path: str) -> None:
        if isinstance(v, dict):
            for key in sorted(v, key=str):
                feed(v[key], f"{path}.{key}")
        elif isinstance(v, torch.Tensor):
            local = getattr(v, "_local_tensor", v)  # a DTensor: this rank's shard
            data = local.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            digest.update(path.encode() + data.tobytes())
        else:
            digest.update(f"{path}={v!r}".encode())

    feed(value, "")
    return digest.hexdigest()


def _child(scenario: str, rank: int, world: int, port: int, base: str) -> dict[str, Any]:
    """Runs ``scenario`` on this rank; what it returned (a digest) or raised."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import fastckpt

    torch.set_num_threads(1)
    os.environ["FASTCKPT_NODE"] = str(rank)  # every rank its own simulated node
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    work = Path(base)

    def run() -> Any:
        if scenario == "read-once-two-steps":  # rank r opened step r's file
            return fastckpt.load(str(work / f"step-{rank}.safetensors"), group=True)
        if scenario == "read-once-renamed-over":  # a save renames a new file over the path
            if rank == 1:
                time.sleep(0.3)
                os.replace(work / "next.safetensors", work / "model.safetensors")
            return fastckpt.load(str(work / "model.safetensors"), group=True)
        if scenario == "load-into-two-steps":
            target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
            fastckpt.load_into(target, str(work / f"step-{rank}.safetensors"), group=True)
            return target
        if scenario == "restore-different-steps":
            state = _state(100 + rank, prefix=f"r{rank}.")
            with fastckpt.CheckpointManager(work / "root", keep_last=None) as manager:
                for step in (1, 2):
                    manager.save(step, {k: v + step for k, v in state.items()})
                manager.wait()
                manager.restore(step=1 + rank, state=state)
            return state
        if scenario == "tiers-not-shared":  # each rank's "shared" root is its own directory
            with fastckpt.CheckpointManager(work / f"root-{rank}") as manager:
                manager.save(1, _state(rank)).result()
                manager.wait()
            return "saved"
        if scenario == "structure-changed-on-one-rank":
            return _structure_changed(fastckpt, torch, work, rank)
        if scenario == "planted-links-and-markers":
            return _planted(fastckpt, work, rank)
        if scenario == "subset-read-once":
            if rank == 0:
                return fastckpt.load(str(work / "step-0.safetensors"), group=True)
            return _stay_alive()
        if scenario == "subset-manager":
            if rank == 0:  # the habit: `if rank == 0: CheckpointManager(root).save(...)`
                with fastckpt.CheckpointManager(work / "root") as manager:
                    manager.save(1, _state(0)).result()
                return "saved"
            return _stay_alive()
        if scenario == "subset-save":
            manager = fastckpt.CheckpointManager(work / "root")
            if rank == 0:
                manager.save(1, _state(0)).result()
                manager.wait()
                return "saved"
            return _stay_alive()
        raise ValueError(f"unknown scenario {scenario!r}")

    started = time.monotonic()
    try:
        value = run()
        result: dict[str, Any] = {"outcome": "returned", "digest": _digest(value)}
    except BaseException as exc:  # noqa: BLE001 - every outcome is reported, judged above
        result = {"outcome": "raised", "type": type(exc).__name__, "message": str(exc)[:400]}
    result["rank"], result["seconds"] = rank, round(time.monotonic() - started, 2)
    return result


def _stay_alive() -> str:
    """A rank that does not join: it trains on (sleeps) while rank 0 calls alone, so a
    collective waiting for it would hang rather than see a closed connection."""
    time.sleep(HANDSHAKE_TIMEOUT + GROUP_TIMEOUT + 5)
    return "not called"


def _structure_changed(fastckpt: Any, torch: Any, work: Path, rank: int) -> dict[str, str]:
    """Step 2 adds a key on rank 1 only (which re-plans who writes the replicated values),
    and every tensor changes right after save() returns: the step restored must hold the
    values at the call."""
    state = _state(10 + rank, prefix=f"r{rank}.")
    state.update(_state(7, keys=8, prefix="replicated."))  # the same on every rank (DDP)
    with fastckpt.CheckpointManager(work / "root", keep_last=None) as manager:
        manager.save(1, state).result()
        if rank == 1:
            state[f"r{rank}.extra"] = torch.ones(1 << 14)
        at_call = {k: v.clone() for k, v in state.items()}
        future = manager.save(2, state)
        for tensor in state.values():  # training goes on after the call
            tensor.add_(1000.0)
        future.result()
        manager.wait()
        restored = {k: torch.zeros_like(v) for k, v in at_call.items()}
        manager.restore(step=2, state=restored)
    if _digest(restored) != _digest(at_call):
        return {"wrong": "the restored step is not the state at save()'s call"}
    return {"values": "as at the call"}


def _planted(fastckpt: Any, work: Path, rank: int) -> dict[str, str]:
    """Per-node tiers with a peer replica; links and markers were planted in every tier and
    in the replica store. Three steps are saved; a new manager must restore step 3."""
    root, fast = work / f"root-{rank}", work / f"fast-{rank}"
    with fastckpt.CheckpointManager(root, fast=fast, replicas=1, keep_last=2) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(1000 * rank + step)).result()
        manager.wait()
    with fastckpt.CheckpointManager(root, fast=fast, replicas=1, keep_last=2) as manager:
        step, state = manager.restore()
    if step != 3 or _digest(state) != _digest(_state(1000 * rank + 3)):
        return {"wrong": f"restored step {step}, not the saved step 3"}
    return {"values": "step 3 as saved"}


# --------------------------------------------------------------------------- the parent


def _prepare(scenario: str, base: Path, outside: Path) -> None:
    """Files the scenario's ranks start from."""
    import torch

    import fastckpt

    if scenario in ("read-once-two-steps", "load-into-two-steps", "subset-read-once"):
        for step in range(WORLD):  # same names and shapes, other values
            fastckpt.save(_state(step), str(base / f"step-{step}.safetensors"))
    elif scenario == "read-once-renamed-over":
        fastckpt.save(_state(0), str(base / "model.safetensors"))
        fastckpt.save(_state(1), str(base / "next.safetensors"))
    elif scenario == "planted-links-and-markers":
        for rank in range(WORLD):
            root, fast = base / f"root-{rank}", base / f"fast-{rank}"
            (fast / ".replicas").mkdir(parents=True)
            root.mkdir()
            # links named like steps and like a peer's replica, pointing outside the tiers
            (root / "step-000000000007").symlink_to(outside, target_is_directory=True)
            (fast / "step-000000000002").symlink_to(outside, target_is_directory=True)
            (fast / ".replicas" / f"rank-{1 - rank:05d}").symlink_to(
                outside, target_is_directory=True
            )
            # a parseable marker at a high step, with no state beside it
            planted = root / "step-000999999999"
            planted.mkdir()
            (planted / "COMMITTED").write_text(json.dumps({"step": 999999999}))
    del torch


def _outside(base: Path) -> Path:
    """A directory outside every tier, with a file each scenario must leave as it is."""
    outside = base / "outside"
    (outside / "step-000000000003").mkdir(parents=True)
    (outside / "canary.bin").write_bytes(b"not fastckpt's" * 64)
    (outside / "step-000000000003" / "state.safetensors").write_bytes(b"another run's")
    return outside


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(scenario: str, base: Path) -> tuple[list[dict[str, Any]], float]:
    """Starts the ranks; their results (a missing one: a hang or a crash) and the time."""
    env = dict(
        os.environ,
        FASTCKPT_GROUP_TIMEOUT=str(GROUP_TIMEOUT),
        FASTCKPT_HANDSHAKE_TIMEOUT=str(HANDSHAKE_TIMEOUT),
        FASTCKPT_NO_PROGRESS="1",
    )
    port = _port()
    children = [
        subprocess.Popen(
            [sys.executable, SCRIPT, "--child", scenario, str(r), str(WORLD), str(port), str(base)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for r in range(WORLD)
    ]
    deadline = time.monotonic() + START_SLACK + 2 * GROUP_TIMEOUT + HANDSHAKE_TIMEOUT
    started = time.monotonic()
    results = []
    for rank, child in enumerate(children):
        try:
            out, err = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            results.append({"rank": rank, "outcome": "hang"})
            continue
        lines = [line[7:] for line in out.splitlines() if line.startswith("RESULT ")]
        if lines:
            results.append(json.loads(lines[-1]))
        else:
            results.append({"rank": rank, "outcome": "crash", "stderr": err[-600:]})
    return results, time.monotonic() - started


def _judge(scenario: str, results: list[dict[str, Any]], expected: set[str]) -> list[str]:
    """What is bad about the ranks' outcomes (empty: nothing)."""
    kind = SCENARIOS[scenario]
    bad = [
        f"rank {r['rank']}: {r['outcome']}" for r in results if r["outcome"] in ("hang", "crash")
    ]
    if bad:
        return bad
    if kind == "subset":
        first = results[0]
        if first["outcome"] != "raised":
            return ["rank 0 called alone and returned: a collective went on without the others"]
        if first["seconds"] > HANDSHAKE_TIMEOUT + SUBSET_SLACK:
            return [f"rank 0 alone: a hang of {first['seconds']} s before it failed"]
        if "rank" not in first["message"]:
            return [f"rank 0 alone failed without naming the ranks: {first['message'][:120]}"]
        return []
    raised = [r for r in results if r["outcome"] == "raised"]
    if raised and len(raised) < len(results):
        return [f"ranks split: {[r['rank'] for r in raised]} raised, the others returned"]
    if raised:
        if kind in ("all-fail", "right-or-all-fail"):
            return []
        return [f"every rank raised where the run must go on: {raised[0]['message'][:160]}"]
    if kind == "all-fail":
        return ["every rank returned although the ranks disagree: a silent mix"]
    digests = {r["digest"] for r in results}
    if expected and not digests <= expected:
        return [f"returned values that are not one whole save ({len(digests)} states)"]
    if len(digests) > 1 and scenario == "read-once-renamed-over":
        return ["ranks returned different checkpoints from one read-once load"]
    return []


def _expected(scenario: str, base: Path) -> set[str]:
    """Digests a returning rank may give (empty: judged by the ranks themselves)."""
    if scenario == "read-once-renamed-over":
        return {_digest(_state(0)), _digest(_state(1))}
    if scenario in ("structure-changed-on-one-rank", "planted-links-and-markers"):
        ok = {"values": "as at the call"} if scenario.startswith("structure") else None
        return {_digest(ok or {"values": "step 3 as saved"})}
    return set()


def adversarial_ranks(work: Path, rounds: int = 1, only: list[str] | None = None) -> dict[str, Any]:
    """Runs every scenario ``rounds`` times; the report: per scenario the outcomes seen, and
    the counts of bad outcomes."""
    report: dict[str, Any] = {"rounds": rounds, "scenarios": {}}
    totals = {"silent wrong states": 0, "ranks alone": 0, "hangs": 0, "outside files changed": 0}
    totals["other bad outcomes"] = 0
    for scenario in only or list(SCENARIOS):
        seen: list[str] = []
        for index in range(rounds):
            base = work / f"{scenario}-{index}"
            base.mkdir(parents=True)
            outside = _outside(base)
            before = _snapshot(outside)
            _prepare(scenario, base, outside)
            results, seconds = _run_ranks(scenario, base)
            problems = _judge(scenario, results, _expected(scenario, base))
            if _snapshot(outside) != before:
                problems.append("a file outside the tiers changed")
            for problem in problems:
                if "hang" in problem:
                    totals["hangs"] += 1
                elif "split" in problem or "alone" in problem:
                    totals["ranks alone"] += 1
                elif "outside" in problem:
                    totals["outside files changed"] += 1
                elif "silent" in problem or "not one whole" in problem or "different" in problem:
                    totals["silent wrong states"] += 1
                else:
                    totals["other bad outcomes"] += 1
            outcome = "; ".join(problems) or ", ".join(
                sorted({r.get("type", r["outcome"]) for r in results})
            )
            seen.append(f"{outcome} ({seconds:.1f} s)")
            for r in results:
                if r["outcome"] == "raised" and index == 0:
                    report.setdefault("messages", {})[f"{scenario} rank {r['rank']}"] = r[
                        "message"
                    ][:200]
        report["scenarios"][scenario] = seen
    report.update(totals)
    return report


def bad_outcomes(report: dict[str, Any]) -> int:
    """The report's count of bad outcomes."""
    keys = ("silent wrong states", "ranks alone", "hangs", "outside files changed")
    return sum(report[k] for k in keys) + report["other bad outcomes"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", action="append", choices=list(SCENARIOS))
    parser.add_argument("--dir", help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fastckpt-ranks-", dir=args.dir))
    report = adversarial_ranks(work, args.rounds, args.only)
    print(json.dumps(report, indent=2))
    return 1 if bad_outcomes(report) else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        scenario, rank, world, port, base = sys.argv[2:7]
        outcome = _child(scenario, int(rank), int(world), int(port), base)
        print("RESULT " + json.dumps(outcome), flush=True)
        os._exit(0)  # a rank left alone must not wait for the group's teardown
    sys.exit(main())
