#!/usr/bin/env python3
"""Two commits of fastckpt side by side in the memory regimes: regression, or noise?

Each commit is built into a wheel of its own (``pip wheel`` of ``git archive``), unpacked
into a temporary folder and compiled to bytecode, as ``pip install`` leaves a package (an
editable checkout in an environment with ``PYTHONDONTWRITEBYTECODE`` compiles every module a
fresh process imports, inside whatever that process times first). Then, in rounds, every
case runs once per commit in a fresh process, the order of the two alternating between
rounds, so a machine that speeds up or slows down during the run weighs on both alike:

* ``tmpfs-save``: ``fastckpt.save`` of an LLM-like state into ``/dev/shm``;
* ``tmpfs-load``: ``fastckpt.load`` of a file in ``/dev/shm``, every page touched;
* ``hot-load``: the same from a file on ``--dir``'s file system whose pages are in memory;
* ``mmap-load``: ``fastckpt.load(mmap=True)`` from ``/dev/shm``.

Each commit loads files it saved itself (the formats of two commits may differ). Printed
per case: each commit's median GB/s with its range, the ratio of the medians, and the
median of the per-round ratios (the figure that cancels slow drifts of the machine). A
ratio whose per-round values fall on both sides of 1 is noise.

Example::

    python benchmarks/bench_ab.py d20232c HEAD --rounds 5 --size 1G
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastckpt.config import parse_size  # noqa: E402

CASES = ("tmpfs-save", "tmpfs-load", "hot-load", "mmap-load")

# Run in a fresh process per measurement: argv = package folder, case, file, size.
CHILD = r"""
import os, sys, time
package, case, path, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
# This interpreter may have another fastckpt installed (editable): only the built one counts.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()
                    and "skbc" not in repr(f)]
sys.path.insert(0, package)
import torch
import fastckpt
import fastckpt.api  # imported before the clock starts, as a training script has it
assert fastckpt.__file__.startswith(package), fastckpt.__file__

def state(nbytes):
    # LLM-like: a few large matrices, many medium ones, small norms (seeded, same each time)
    g = torch.Generator().manual_seed(0)
    out, left, i = {}, nbytes, 0
    for rows, cols in [(4096, 4096), (4096, 1024), (1024, 4096), (4096, 16)] * 10_000:
        n = min(rows * cols, left // 4)
        if n <= 0:
            break
        out[f"layers.{i}.w"] = torch.empty(n).uniform_(generator=g)
        left -= n * 4
        i += 1
    return out

if case in ("write", "tmpfs-save"):
    s = state(size)
    start = time.perf_counter()
    fastckpt.save(s, path, progress=False)
    seconds = time.perf_counter() - start
    if case == "tmpfs-save":
        os.unlink(path)
    print(sum(t.nbytes for t in s.values()) / seconds / 1e9)
else:
    options = {"mmap": True} if case == "mmap-load" else {}
    start = time.perf_counter()
    loaded = fastckpt.load(path, progress=False, **options)
    for t in loaded.values():
        int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    print(sum(t.nbytes for t in loaded.values()) / (time.perf_counter() - start) / 1e9)
"""


def build(commit: str, into: Path) -> Path:
    """``commit`` built and unpacked into ``into``/package, bytecode compiled; returns it."""
    source, wheels, package = into / "source", into / "wheel", into / "package"
    source.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(source)],
        check=True,
    )  # fmt: skip
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(package)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True)
    shutil.rmtree(source)
    return package


def measure(package: Path, case: str, path: str, size: int) -> float:
    """GB/s of one ``case`` by the fastckpt in ``package``, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["FASTCKPT_NO_PROGRESS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(package), case, path, str(size)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{case} with {package} failed: {out.stderr.strip()[-800:]}")
    return float(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the older commit (e.g. d20232c)")
    parser.add_argument("after", nargs="?", default="HEAD", help="the newer commit (HEAD)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", default="1G", help="state size (default 1G)")
    parser.add_argument("--dir", default=".", help="where the page-cache-hot file lives")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="fastckpt-ab-"))
    shm = Path(tempfile.mkdtemp(prefix="fastckpt-ab-", dir="/dev/shm"))
    hot_dir = Path(tempfile.mkdtemp(prefix="fastckpt-ab-", dir=args.dir))
    try:
        names = {"before": args.before, "after": args.after}
        packages = {side: build(commit, work / side) for side, commit in names.items()}
        files = {}
        for side, package in packages.items():
            files[side, "shm"] = str(shm / f"{side}.safetensors")
            files[side, "hot"] = str(hot_dir / f"{side}.safetensors")
            measure(package, "write", files[side, "shm"], size)
            shutil.copyfile(files[side, "shm"], files[side, "hot"])
        results: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for case in args.cases:
                for side in order:
                    if case == "tmpfs-save":
                        path = str(shm / f"{side}-save.safetensors")
                    elif case == "hot-load":
                        path = files[side, "hot"]
                        with open(path, "rb") as f:  # its pages in memory
                            while f.read(64 << 20):
                                pass
                    else:
                        path = files[side, "shm"]
                    results.setdefault((case, side), []).append(
                        measure(packages[side], case, path, size)
                    )
            load = os.getloadavg()[0]
            print(f"round {r + 1}/{args.rounds} done (load average {load:.2f})", flush=True)
        print(f"\n{names['before']} -> {names['after']}, {args.size}, {args.rounds} rounds")
        print("| case | before GB/s | after GB/s | after/before (medians) | per round |")
        print("|---|---:|---:|---:|---:|")
        for case in args.cases:
            b, a = results[case, "before"], results[case, "after"]
            rounds = [y / x for x, y in zip(b, a)]
            print(
                f"| {case} | {statistics.median(b):.2f} ({min(b):.2f}-{max(b):.2f}) "
                f"| {statistics.median(a):.2f} ({min(a):.2f}-{max(a):.2f}) "
                f"| {statistics.median(a) / statistics.median(b):.2f} "
                f"| {statistics.median(rounds):.2f} ({min(rounds):.2f}-{max(rounds):.2f}) |"
            )
    finally:
        for folder in (work, shm, hot_dir):
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
