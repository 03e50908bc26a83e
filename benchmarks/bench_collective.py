"""Multi-rank checkpoints inside a training loop: how long each checkpoint blocks the loop,
the extra memory it takes, and how long a repeated save plans, for fastckpt's asynchronous
CheckpointManager against DCP's ``async_save`` (thread mode) and a synchronous fastckpt
multi-rank save, in one run.

For each world size (``--ranks``) that many ranks (spawned processes, gloo on loopback) hold
an FSDP2-like state: ``--per-rank`` bytes of parameters sharded along dim 0 (DTensors over
each rank's shard, ``Shard(0)``) plus Adam's ``exp_avg`` and ``exp_avg_sq`` (three times
``--per-rank`` in all), and ``--replicated`` bytes of DDP-style plain tensors, the same on every
rank (each is to be written by one rank only). A real training loop runs ``--steps`` steps (``--compute-ms`` of
matrix products standing for the forward and backward passes, a gradient, an all-reduce
on the default group, ``Adam.step()``) and checkpoints every ``--every`` steps;
each method runs its own loop, the methods in a rotating order over ``--repeat`` rounds:

- ``fastckpt-async``: ``CheckpointManager.save(step, state)``: the state is copied into the
  writer's staging pool, the rest happens in the background on the checkpoint group;
- ``fastckpt-lazy``: ``CheckpointManager.save(step, state, fence=optimizer)``: nothing is
  copied at the call; the next ``Adam.step()`` passes the fence;
- ``dcp-async``: ``dcp.async_save(state, checkpoint_id=..., process_group=<a gloo group>)``
  with DCP's own stager and FileSystemWriter, thread executor; its previous future is
  awaited before the next call, as DCP requires;
- ``fastckpt-sync``: a synchronous multi-rank fastckpt save (``dcp.save`` with
  FastCkptWriter, a barrier, rank 0's marker): what ``CheckpointManager.save`` did before
  it was asynchronous.

Blocked time per checkpoint: the time in the save call (for fastckpt-async also the wait for
the previous save at the next call), plus, for fastckpt-lazy, the time the next
``Adam.step()`` took beyond its median without a pending save (the fence); for dcp-async,
the call plus the wait for the previous future. The slowest rank's figure, the median over
every checkpoint after the first of a loop (the first also reported). Extra memory: the
peak RSS during a loop (sampled every 5 ms) above the RSS before it, less the same figure
of the loop without checkpoints (Adam's own temporaries), the largest of any rank and
round. Planning: the seconds fastckpt's collective save spent before writing (the
agreement included), at the first save of a loop and the median of the later ones (plans
reused), per save the figure of the rank that came last to the agreement (the others'
include waiting for it). Bytes written: the tensor bytes of every rank file of a step (read
from their headers) over the step's unique bytes (each stored name once), at the first step
of a loop and the median of the later ones (round 0; 1.00x: every replicated tensor written
by one rank). Round 0 of ``fastckpt-async`` and
``fastckpt-lazy`` also checks that every step restores equal to its own state (a digest of
each rank's shards taken at the call), on this world size and, in the parent, on one
process (every value whole, split again into the shards to compare).

Run: python benchmarks/bench_collective.py --ranks 2 4 8 --per-rank 256M --repeat 3
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

from fastckpt.bench.report import log
from fastckpt.bench.results import rotate
from fastckpt.bench.units import format_bytes, median
from fastckpt.config import parse_size

METHODS = ("fastckpt-async", "fastckpt-lazy", "dcp-async", "fastckpt-sync")
TENSOR_BYTES = 32 << 20  # each rank's shard of one weight
COLS = 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """Samples this process's RSS every 5 ms until stopped; ``peak - base`` is the extra."""

    def __init__(self) -> None:
        gc.collect()
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        return self.peak - self.base


def _digest(tensor: Any) -> str:
    import torch

    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def _rank_main(rank: int, world: int, port: int, options: dict[str, Any]) -> None:
    warnings.filterwarnings("ignore")  # DCP's overwrite and deprecation notices
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import fastckpt
    from fastckpt.distributed.groups import checkpoint_group
    from fastckpt.series import steps as layout
    from fastckpt.series.sharded import Ranks, save_step

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=1800),
    )
    group = checkpoint_group()  # every rank, in the foreground, before any thread uses it
    mesh = init_device_mesh("cpu", (world,))
    rows = TENSOR_BYTES // 4 // COLS
    count = max(1, options["per_rank"] // TENSOR_BYTES)
    gen = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(rows, COLS, generator=gen)) for _ in range(count)]
    same = torch.Generator().manual_seed(1234)  # the same values on every rank (DDP-style)
    replicated = [
        torch.randn(max(1, options["replicated"] * share // 10 // 4), generator=same)
        for share in (4, 3, 2, 1)
        if options["replicated"]
    ]
    grads = [torch.randn(rows, COLS, generator=gen) * 1e-3 for _ in range(count)]
    optimizer = torch.optim.Adam(params, lr=1e-4)
    chatter = torch.zeros(1 << 18)  # a training collective at every step (1 MiB)
    a, b = torch.randn(512, 512, generator=gen), torch.randn(512, 512, generator=gen)
    start = time.perf_counter()
    for _ in range(20):
        torch.mm(a, b)
    per_mm = (time.perf_counter() - start) / 20
    products = max(0, round(options["compute_ms"] / 1000 / per_mm))

    def train_step() -> float:
        for _ in range(products):  # the forward and backward passes
            torch.mm(a, b)
        for p, g in zip(params, grads):
            p.grad = g
        dist.all_reduce(chatter)
        start = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - start

    train_step()  # Adam's state exists from here on

    def shard(t: torch.Tensor) -> Any:
        return DTensor.from_local(
            t.detach(),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=(rows * world, COLS),
            stride=(COLS, 1),
        )

    def state_dict(step: int) -> dict[str, Any]:
        return {
            "model": {f"layer{i}.weight": shard(p) for i, p in enumerate(params)},
            "optim": {
                f"layer{i}": {
                    "exp_avg": shard(optimizer.state[p]["exp_avg"]),
                    "exp_avg_sq": shard(optimizer.state[p]["exp_avg_sq"]),
                }
                for i, p in enumerate(params)
            },
            "ddp": {f"buffer{i}": t for i, t in enumerate(replicated)},
            "step": step,
        }

    def local_digests() -> dict[str, str]:
        out = {f"ddp.buffer{i}": _digest(t) for i, t in enumerate(replicated)}
        for i, p in enumerate(params):
            out[f"model.layer{i}.weight"] = _digest(p.detach())
            out[f"optim.layer{i}.exp_avg"] = _digest(optimizer.state[p]["exp_avg"])
            out[f"optim.layer{i}.exp_avg_sq"] = _digest(optimizer.state[p]["exp_avg_sq"])
        return out

    folder = options["folder"]
    steps, every = options["steps"], options["every"]
    results: dict[str, Any] = {
        "blocked": {},
        "first": {},
        "memory": {},
        "plan_first": {},
        "plan_again": {},
        "restored": {},
        "digests": {},
        "dirs": {},
    }
    opt_times: list[float] = []
    for _ in range(3):
        opt_times.append(train_step())
    normal_step = median(opt_times)

    for round_ in range(options["repeat"]):
        # the loop's own peak (Adam's temporaries) without checkpoints: subtracted below
        dist.barrier()
        memory = _PeakRss()
        for _ in range(steps):
            train_step()
        results["memory"].setdefault("none", []).append(memory.stop())
        for method in rotate(METHODS, round_):
            verify = round_ == 0 and method in ("fastckpt-async", "fastckpt-lazy")
            where = os.path.join(folder, f"{method}-{round_}")
            dist.barrier()
            memory = _PeakRss()
            blocked: list[float] = []
            digests: dict[int, dict[str, str]] = {}
            manager = None
            previous = None
            if method.startswith("fastckpt-a") or method == "fastckpt-lazy":
                manager = fastckpt.CheckpointManager(where, keep_last=None if verify else 2)
            for step in range(1, steps + 1):
                took = train_step()
                if blocked and step % every == 1 and method == "fastckpt-lazy":
                    blocked[-1] += max(0.0, took - normal_step)  # the fence
                if step % every:
                    continue
                state = state_dict(step)
                start = time.perf_counter()
                if manager is not None:
                    extra = {"fence": optimizer} if method == "fastckpt-lazy" else {}
                    manager.save(step, state, **extra)
                elif method == "dcp-async":
                    if previous is not None:
                        previous.result()
                    previous = dcp.async_save(
                        state,
                        checkpoint_id=os.path.join(where, f"step-{step}"),
                        process_group=group,
                    )
                else:
                    path = layout.step_dir(where, step)
                    save_step(path, state, Ranks(True), None)
                    dist.barrier()
                    if rank == 0:
                        layout.commit(where, step, None, "dcp")
                blocked.append(time.perf_counter() - start)
                del state
                if verify:
                    digests[step] = local_digests()
            if manager is not None:
                manager.wait()
            elif previous is not None:
                previous.result()
            extra_memory = memory.stop()  # (before the checks below, which allocate)
            if manager is not None:
                assert manager._steps is not None
                plans = list(manager._steps.plan_seconds)
                if verify:
                    ok = 0
                    for step, expected in digests.items():
                        target = state_dict(0)
                        for part in ("model", "optim", "ddp"):  # zeros: a restore fills them
                            for value in target[part].values():
                                for t in value.values() if isinstance(value, dict) else [value]:
                                    (t.to_local() if hasattr(t, "to_local") else t).zero_()
                        keep = [p.detach().clone() for p in params]
                        manager.restore(step, state=target)
                        ok += local_digests() == expected
                        for p, k in zip(params, keep):
                            p.data.copy_(k)
                    results["restored"][method] = f"{ok}/{len(digests)}"
                    results["digests"][method] = {str(s): d for s, d in digests.items()}
                    results["dirs"][method] = where
                manager.close()
                results["plan_first"].setdefault(method, []).append(plans[0])
                results["plan_again"].setdefault(method, []).extend(plans[1:])
            dist.barrier()
            if rank == 0 and not verify:
                shutil.rmtree(where, ignore_errors=True)
            results["blocked"].setdefault(method, []).extend(blocked[1:])
            results["first"].setdefault(method, []).append(blocked[0])
            results["memory"].setdefault(method, []).append(extra_memory)
            log(
                f"world {world} round {round_} rank {rank} {method}: blocked "
                f"{[round(b, 4) for b in blocked]} memory +{format_bytes(extra_memory)}"
            )
    # the slowest rank decides: gather every rank's figures at rank 0
    every_rank: list[Any] = [None] * world if rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(results, every_rank, dst=0)
    if rank == 0:
        with open(options["result"], "w", encoding="utf-8") as f:
            json.dump(every_rank, f)
    dist.barrier()
    dist.destroy_process_group()


def _run_ranks(world: int, options: dict[str, Any]) -> Any:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(world, port, options), nprocs=world)
    with open(options["result"], encoding="utf-8") as f:
        return json.load(f)


def _restored_on_one_process(where: str, digests: dict[str, dict[str, str]], world: int) -> str:
    """Every step of ``where`` restored on one process, split into ``world`` shards again
    and compared with each rank's digests at the save."""
    import fastckpt

    ok = 0
    with fastckpt.CheckpointManager(where) as manager:
        for step in digests[0]:
            _, state = manager.restore(int(step))
            flat = {}
            for i, w in state["model"].items():
                flat[f"model.{i}"] = w
            for layer, moments in state["optim"].items():
                for k, v in moments.items():
                    flat[f"optim.{layer}.{k}"] = v
            for name, value in state.get("ddp", {}).items():
                flat[f"ddp.{name}"] = value
            good = True
            for rank in range(world):
                mine = {
                    n: _digest(t if n.startswith("ddp.") else t.chunk(world)[rank])
                    for n, t in flat.items()
                }
                good &= mine == digests[rank][step]
            ok += good
    return f"{ok}/{len(digests[0])}"


def _bytes_written(where: str) -> tuple[float, float, int]:
    """Tensor bytes in every rank file of each step of ``where`` over the step's unique
    bytes (each stored name once), read from the files' headers: the first step's ratio,
    the median of the later steps', and the first step's unique bytes."""
    import fastckpt
    from fastckpt.series import steps as layout

    ratios: list[float] = []
    first_unique = 0
    for step in layout.committed_steps(where):
        written, unique = 0, {}
        for name in layout.marker_of(where, step)["files"]:
            if not name.endswith(".safetensors"):
                continue
            with fastckpt.open(os.path.join(layout.step_dir(where, step), name)) as reader:
                for key in reader.keys():
                    written += reader.info(key).nbytes
                    unique[key] = reader.info(key).nbytes
        ratios.append(written / max(1, sum(unique.values())))
        first_unique = first_unique or sum(unique.values())
    return ratios[0], median(ratios[1:] or ratios), first_unique


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--per-rank", default="256M", help="parameter bytes per rank")
    parser.add_argument(
        "--per-rank-at", nargs="*", default=[], help="WORLD=SIZE overrides (memory: e.g. 8=64M)"
    )
    parser.add_argument(
        "--replicated",
        default="16M",
        help="bytes of DDP-style plain tensors, the same on every rank (0: none)",
    )
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=500.0,
        help="forward and backward work per step before Adam.step() (matrix products)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where checkpoints go (default: a temp dir)")
    args = parser.parse_args(argv)
    overrides = {int(k): parse_size(v) for k, v in (o.split("=") for o in args.per_rank_at)}
    base = tempfile.mkdtemp(prefix="bench-collective-", dir=args.folder)
    print(f"# load average before: {os.getloadavg()}, cores: {os.cpu_count()}")
    rows = []
    try:
        for world in args.ranks:
            per_rank = overrides.get(world, parse_size(args.per_rank))
            folder = os.path.join(base, f"w{world}")
            os.makedirs(folder)
            options = {
                "compute_ms": args.compute_ms,
                "per_rank": per_rank,
                "replicated": parse_size(args.replicated),
                "steps": args.steps,
                "every": args.every,
                "repeat": args.repeat,
                "folder": folder,
                "result": os.path.join(folder, "result.json"),
            }
            log(f"world {world}: {format_bytes(per_rank)} of parameters per rank (+ Adam)")
            every_rank = _run_ranks(world, options)
            load = os.getloadavg()

            def worst(key: str, method: str, ranks: list[Any] = every_rank) -> float:
                # per checkpoint the slowest rank, then the median
                return median([max(v) for v in zip(*(r[key][method] for r in ranks))])

            def planning(key: str, method: str, ranks: list[Any] = every_rank) -> float:
                # per save the rank that came last to the agreement (the others' figures
                # include waiting for it), then the median
                return median([min(v) for v in zip(*(r[key][method] for r in ranks))])

            restored_one = {
                m: _restored_on_one_process(
                    every_rank[0]["dirs"][m], [r["digests"][m] for r in every_rank], world
                )
                for m in ("fastckpt-async", "fastckpt-lazy")
            }
            row = {"world": world, "per_rank": per_rank, "load": load}
            for m in METHODS:
                row[m] = {
                    "blocked": worst("blocked", m),
                    "first": worst("first", m),
                    "memory": max(
                        max(r["memory"][m]) - median(r["memory"]["none"]) for r in every_rank
                    ),
                }
            for m in ("fastckpt-async", "fastckpt-lazy"):
                row[m]["plan_first"] = planning("plan_first", m)
                row[m]["plan_again"] = planning("plan_again", m)
                row[m]["restored"] = every_rank[0]["restored"][m]
                row[m]["restored_world_1"] = restored_one[m]
                first, later, unique = _bytes_written(every_rank[0]["dirs"][m])
                row[m]["bytes_first"], row[m]["bytes_later"] = first, later
                row[m]["unique"] = unique
            rows.append(row)
            shutil.rmtree(folder, ignore_errors=True)
            _print_row(row)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"# load average after: {os.getloadavg()}")
    print(json.dumps(rows))
    return 0


def _print_row(row: dict[str, Any]) -> None:
    state = 3 * row["per_rank"]
    print(
        f"\n## {row['world']} ranks, {format_bytes(state)} of state per rank "
        f"(parameters + Adam), load average {row['load'][0]:.2f}"
    )
    print(
        "| method | blocked per checkpoint (s) | first checkpoint (s) | extra peak RSS | "
        "plan first (s) | plan again (s) | restored (same world / 1 process) | "
        "bytes written / unique, first step / later |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for m in METHODS:
        r = row[m]
        plan = (
            (
                f"{r['plan_first']:.4f} | {r['plan_again']:.4f} | "
                f"{r['restored']} / {r['restored_world_1']} | "
                f"{r['bytes_first']:.2f}x / {r['bytes_later']:.2f}x of {format_bytes(r['unique'])}"
            )
            if "plan_first" in r
            else "- | - | - | -"
        )
        print(
            f"| {m} | {r['blocked']:.4f} | {r['first']:.4f} | {format_bytes(r['memory'])} | "
            f"{plan} |"
        )
    dcp_async, sync = row["dcp-async"]["blocked"], row["fastckpt-sync"]["blocked"]
    for m in ("fastckpt-async", "fastckpt-lazy"):
        b = row[m]["blocked"]
        print(
            f"- {m}: {b / dcp_async:.3f}x dcp-async, {b / sync:.3f}x fastckpt-sync; "
            f"repeated plan {row[m]['plan_again'] / row[m]['plan_first']:.3f}x the first"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
