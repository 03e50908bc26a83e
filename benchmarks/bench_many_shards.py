#!/usr/bin/env python3
"""Many shards: what bounding open descriptors costs a load of thousands of shards.

Saves ``--shards`` tiny shards (one 16-byte tensor each) with ``fastckpt.save(...,
max_shard_size=16)`` and times ``fastckpt.load`` of the directory (from the page cache) in
a child process per run:

* ``bounded``: this tree, at most ``open_files`` shards open (default 64), under a limit of
  256 open files;
* ``unbounded``: this tree with ``FASTCKPT_OPEN_FILES`` above the shard count (every shard
  kept open, as before the bound), under a high limit;
* ``before`` (with ``--before DIR``): the package as it was before the bound, a copy of its
  ``fastckpt`` folder in ``DIR`` (``git archive <commit> fastckpt | tar -x -C DIR``, plus
  the built ``_C`` module copied in), under a high limit.

Each child also reports the most descriptors it had open at once (``/proc/self/fd``,
sampled every 0.5 ms). The order of the runs rotates each round.

Example::

    python benchmarks/bench_many_shards.py --dir /tmp/many-shards --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

CHILD = """
import json, os, resource, sys, threading, time
limit, directory, before = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if before:  # the old package, not the editable install of this tree
    sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__module__]
    sys.path.insert(0, before)
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
import torch, fastckpt
peak = [0]

def sample():
    while True:
        peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")))
        time.sleep(0.0005)

threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
state = fastckpt.load(directory)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak": peak[0], "tensors": len(state),
                  "package": os.path.dirname(fastckpt.__file__)}))
"""


def _run(kind: str, directory: str, before: str | None, shards: int) -> dict:
    env = dict(os.environ)
    env.pop("FASTCKPT_OPEN_FILES", None)
    limit = 256
    if kind != "bounded":  # room for every shard's descriptors (two each), and then some
        limit = min(4 * shards + 1024, _hard_limit())
    if kind == "unbounded":
        env["FASTCKPT_OPEN_FILES"] = str(shards + 1)
    old = before if kind == "before" else ""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(limit), directory, old or ""],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _hard_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where the shards are written")
    parser.add_argument("--shards", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--before", help="a folder holding the package before the bound")
    args = parser.parse_args()

    import torch

    import fastckpt

    state = {f"t{i:05d}": torch.full((4,), float(i)) for i in range(args.shards)}
    fastckpt.save(state, args.dir, max_shard_size=16)
    kinds = ["bounded", "unbounded"] + (["before"] if args.before else [])
    for round_ in range(args.rounds):
        order = kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)]
        for kind in order:
            got = _run(kind, args.dir, args.before, args.shards)
            print(
                f"round {round_ + 1} {kind:9} load {got['seconds']:6.2f} s  "
                f"peak open descriptors {got['peak']:6d}  ({got['tensors']} tensors)"
            )


if __name__ == "__main__":
    main()
