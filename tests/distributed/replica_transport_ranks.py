"""One rank of a replication run, for test_replica_transport.py:
``python replica_transport_ranks.py RANK WORLD PORT BASE MODE [ARGS...]``; rank r is node r.

Modes:
    replicate TRANSPORT RATE SIZE...: a Replicator (replicas=1, ``transport``, ``RATE``
        bytes/s or 0 for none) replicates step 1, a file per SIZE; prints what it holds,
        each held file's SHA-256, the bytes sent by each path and the round's seconds.
    kill RATE NBYTES KILL_AFTER: step 1 is replicated, then step 2 (paced to RATE); the last
        rank SIGKILLs itself KILL_AFTER seconds into step 2's round; the others print the
        error their round raised and what their store holds.
Each rank prints one JSON line prefixed ``RESULT``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from fastckpt.distributed.replication import Replicator


def content(rank: int, step: int, index: int, size: int) -> bytes:
    seed = hashlib.sha256(f"{rank}/{step}/{index}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def write_step(fast: str, rank: int, step: int, sizes: list[int]) -> tuple[str, list[str]]:
    directory = os.path.join(fast, f"step-{step:012d}")
    os.makedirs(directory)
    names = [f"part-{i}.bin" for i in range(len(sizes))]
    for i, (name, size) in enumerate(zip(names, sizes)):
        with open(os.path.join(directory, name), "wb") as f:
            f.write(content(rank, step, i, size))
    return directory, names


def held_digests(replicator: Replicator) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    for rank, steps in replicator.store.held().items():
        for step in steps:
            for name, path in replicator.store.files(rank, step):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                found.setdefault(f"{rank}/{step}", {})[name] = digest
    return found


def main() -> None:
    rank_, world_, port, base, mode, *args = sys.argv[1:]
    rank, world = int(rank_), int(world_)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, FASTCKPT_NODE=rank_)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    fast = os.path.join(base, f"node-{rank}")
    result: dict = {"rank": rank}
    if mode == "replicate":
        transport, rate = args[0], float(args[1]) or None
        sizes = [int(a) for a in args[2:]]
        replicator = Replicator(
            os.path.join(fast, ".replicas"), replicas=1, bytes_per_second=rate, transport=transport
        )
        directory, names = write_step(fast, rank, 1, sizes)
        started = time.perf_counter()
        result["sent"] = replicator.replicate(1, directory, names).result(timeout=120)
        result["seconds"] = time.perf_counter() - started
        result["held"] = held_digests(replicator)
        result["sent_by"] = replicator.sent_by
        result["expected"] = {
            name: hashlib.sha256(content(s, 1, i, size)).hexdigest()
            for s in replicator.sources
            for i, (name, size) in enumerate(zip(names, sizes))
        }
        result["sources"] = replicator.sources
        replicator.close()
    elif mode == "kill":
        rate, nbytes, kill_after = float(args[0]), int(args[1]), float(args[2])
        replicator = Replicator(os.path.join(fast, ".replicas"), replicas=1, bytes_per_second=rate)
        directory, names = write_step(fast, rank, 1, [4096])
        replicator.replicate(1, directory, names).result(timeout=60)
        directory, names = write_step(fast, rank, 2, [nbytes])
        if rank == world - 1:
            threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
        try:
            replicator.replicate(2, directory, names).result(timeout=60)
            result["error"] = None
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["held"] = replicator.store.held()
        result["leftover"] = [
            n for n in os.listdir(replicator.store.directory) if n.startswith(".incoming-")
        ]
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # the group is broken: no collective teardown
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
