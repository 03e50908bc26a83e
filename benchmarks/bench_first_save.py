#!/usr/bin/env python3
"""A process's first save against its second: what a one-shot script, or a job's first
checkpoint, pays beyond the steady state.

Each measurement is a fresh Python process that builds a state, then times
``fastckpt.save`` twice (two files; each save is durable: fsync of the file, rename, fsync
of the directory). States: 117 MB (a few dozen tensors of a small model) and 1 GiB; targets:
a directory on the disk and one on /dev/shm. Rounds are interleaved (every configuration
once per round, the order rotated each round) so a busy machine hits all alike; figures are
medians over rounds. ``--tree NAME=PATH`` (repeatable) runs the same measurement with the
``fastckpt`` package of another checkout (its ``fastckpt/`` must hold a built ``_C``), e.g.
an earlier commit's, interleaved with the others.

Example::

    python benchmarks/bench_first_save.py --disk-dir /work/bench-tmp --rounds 3
    python benchmarks/bench_first_save.py --tree before=/tmp/old --tree after=. --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZES = {"117 MB": 117_000_000, "1 GiB": 1 << 30}


def _state(nbytes: int):
    """Float32 tensors of a small model's shapes (a few large, many small), ``nbytes`` in all."""
    import torch

    tensors, left, i = {}, nbytes, 0
    while left > 0:
        n = min(left, (16 << 20) if i % 4 == 0 else (2 << 20)) // 4 or 1
        tensors[f"layer{i}.weight"] = torch.empty(n).fill_(i + 0.5)  # pages touched
        left -= n * 4
        i += 1
    return tensors


def child(nbytes: int, directory: str) -> None:
    """Times two saves in this (fresh) process; prints one JSON line."""
    if os.environ.get("FASTCKPT_BENCH_TREE"):
        # an editable install's import hook would win over PYTHONPATH: drop it for this tree
        sys.meta_path[:] = [
            f for f in sys.meta_path if not type(f).__module__.startswith("_editable")
        ]
    t0 = time.perf_counter()
    import fastckpt

    imported = time.perf_counter() - t0
    state = _state(nbytes)
    times = []
    for name in ("first", "second"):
        path = os.path.join(directory, f"{name}.safetensors")
        start = time.perf_counter()
        fastckpt.save(state, path)
        times.append(time.perf_counter() - start)
        os.unlink(path)
    print(
        json.dumps(
            {"first": times[0], "second": times[1], "import": imported, "module": fastckpt.__file__}
        )
    )


def _run(tree: str, nbytes: int, directory: str) -> dict:
    # Compiled bytecode cached (outside the trees), as an installed package has it: without
    # it, the first save's imports compile the save path's modules.
    env = dict(
        os.environ,
        PYTHONPATH=tree,
        FASTCKPT_NO_PROGRESS="1",
        PYTHONPYCACHEPREFIX=os.path.join(tempfile.gettempdir(), "fastckpt-bench-pycache"),
    )
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if Path(tree).resolve() != REPO:
        env["FASTCKPT_BENCH_TREE"] = tree
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(nbytes), directory],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result["module"].startswith(str(Path(tree).resolve())):
        raise RuntimeError(f"{tree}: imported fastckpt from {result['module']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("NBYTES", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--disk-dir", default=None, help="a directory on the disk")
    parser.add_argument("--shm-dir", default="/dev/shm", help="a directory on tmpfs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--sizes", default=",".join(SIZES), help="of: " + ", ".join(SIZES))
    parser.add_argument("--targets", default="disk,shm", help="of: disk, shm")
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1])
        return
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(REPO)}
    disk = tempfile.mkdtemp(prefix="fastckpt-first-", dir=args.disk_dir or str(REPO))
    shm = tempfile.mkdtemp(prefix="fastckpt-first-", dir=args.shm_dir)
    configs = [
        (tree, size, target, directory)
        for tree in trees
        for size in args.sizes.split(",")
        for target, directory in (("disk", disk), ("shm", shm))
        if target in args.targets.split(",")
    ]
    print(f"load average at start: {os.getloadavg()}, {os.cpu_count()} CPUs")
    results: dict[tuple, list[dict]] = {c[:3]: [] for c in configs}
    for tree in trees.values():  # untimed: fills the bytecode cache
        _run(tree, 1 << 20, shm)
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for tree, size, target, directory in order:
            results[(tree, size, target)].append(_run(trees[tree], SIZES[size], directory))
    print(f"load average at end: {os.getloadavg()}")
    print(
        f"{'tree':>8} {'state':>7} {'to':>5} {'1st s':>7} {'2nd s':>7} {'1st GB/s':>9} "
        f"{'2nd GB/s':>9}  (medians of {args.rounds})"
    )
    for (tree, size, target), runs in results.items():
        first = statistics.median(x["first"] for x in runs)
        second = statistics.median(x["second"] for x in runs)
        n = SIZES[size] / 1e9
        print(
            f"{tree:>8} {size:>7} {target:>5} {first:7.3f} {second:7.3f} {n / first:9.2f} "
            f"{n / second:9.2f}"
        )
    os.rmdir(disk)
    os.rmdir(shm)


if __name__ == "__main__":
    main()
