"""Multi-rank checkpoints inside a training loop: how long each checkpoint blocks the loop,
the extra memory it takes, and how long a repeated save plans, for fastckpt's asynchronous
CheckpointManager against DCP's ``async_save`` (thread mode), a synchronous fastckpt
multi-rank save and torch-checkpointing's asynchronous CheckpointManager, in one run.

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
  it was asynchronous;
- ``torch-checkpointing`` (PyPI ``torch-checkpointing==0.1.1``; skipped, saying why, when it
  is not installed): its ``CheckpointManager`` with a ``DefaultResharder`` on every item,
  asynchronous (a staging thread, a writer process), ``Adam.step()`` under
  ``manager.lock()`` as it documents, on its buffered storage (its default O_DIRECT writes
  fail with EINVAL on ext4); its resharding metadata gather, written for CUDA tensors, is
  done with ``all_gather_object`` here (:func:`_tc_gather_on_cpu`).

Blocked time per checkpoint: the time in the save call (for fastckpt-async also the wait for
the previous save at the next call), plus, for fastckpt-lazy and torch-checkpointing, the
time the next ``Adam.step()`` took beyond its median without a pending save (the fence; the
lock); for dcp-async, the call plus the wait for the previous future. A loop whose last step
saves runs one step more, so every checkpoint meets its fence. The slowest rank's figure, the median over
every checkpoint after the first of a loop (the first also reported). Extra memory: the
peak RSS during a loop (sampled every 5 ms; plus child processes' private RSS:
torch-checkpointing's writer) above the RSS before it, less the same figure
of the loop without checkpoints (Adam's own temporaries), the largest of any rank and
round. Planning: the seconds fastckpt's collective save spent before writing (the
agreement included), at the first save of a loop and the median of the later ones (plans
reused), per save the figure of the rank that came last to the agreement (the others'
include waiting for it). Bytes written: the tensor bytes of every rank file of a step (read
from their headers; DCP's and torch-checkpointing's: their data files' sizes) over the
state's unique bytes, at the first step of a loop and the median of the later ones (round 0;
1.00x: every replicated tensor written by one rank). Copied at the call: the bytes a lazy
save copied before returning (what no fenced optimizer owns), and how many DTensors were
among them (0: the fence's cover sees through their local shards).

Round 0 of every method but ``fastckpt-sync`` also checks that every step restores equal to
its own state (digests of each rank's shards, per ``BLOCK_ROWS`` rows, taken at the call):
on this world size, on another (half as many ranks, twice as many for 2: spawned again,
each method's resharding restore into zeroed DTensors of that world) and, for fastckpt, in
the parent on one process (every value whole, split again into the shards to compare).

Run: python benchmarks/bench_collective.py --ranks 2 4 8 --per-rank 128M --replicated 16M \
    --steps 8 --every 4 --compute-ms 300 --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
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

ALL_METHODS = (
    "fastckpt-async",
    "fastckpt-lazy",
    "dcp-async",
    "fastckpt-sync",
    "torch-checkpointing",
)
# the methods whose steps of round 0 are restored and compared (fastckpt-sync writes the
# same files as fastckpt-async)
VERIFIED = ("fastckpt-async", "fastckpt-lazy", "dcp-async", "torch-checkpointing")
TENSOR_BYTES = 32 << 20  # each rank's shard of one weight
COLS = 1024
BLOCK_ROWS = 1024  # rows per digest: a shard restored on another world size is whole blocks


def _torch_checkpointing_missing() -> str | None:
    """Why the ``torch-checkpointing`` method cannot run here (None: it can)."""
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError as exc:
        return (
            f"torch-checkpointing is not installed ({exc}; pip install torch-checkpointing==0.1.1)"
        )
    return None


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _children() -> list[int]:
    """This process's child processes (torch-checkpointing's writer process)."""
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.extend(int(p) for p in f.read().split())
        except OSError:
            continue
    return pids


def _private_rss(pid: int) -> int:
    """A child's anonymous RSS (its own memory; the shared memory it maps from this
    process is counted in this process's RSS already)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _PeakRss:
    """Samples this process's RSS, plus its child processes' private RSS, every 5 ms until
    stopped; ``peak - base`` is the extra."""

    def __init__(self) -> None:
        gc.collect()
        self.base = self.peak = self._now(_children())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def _now(children: list[int]) -> int:
        return _rss() + sum(_private_rss(p) for p in children)

    def _sample(self) -> None:
        children, ticks = _children(), 0
        while not self._stop.wait(0.005):
            ticks += 1
            if ticks % 20 == 0:  # a child started or ended: look every 100 ms
                children = _children()
            self.peak = max(self.peak, self._now(children))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now(_children()))
        return self.peak - self.base


def _digest(tensor: Any) -> str:
    import torch

    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def _blocks(tensor: Any) -> list[str]:
    """Digests of ``tensor``'s consecutive ``BLOCK_ROWS``-row slices (one for a 1-d
    tensor): a shard restored on another world size is compared block by block."""
    if tensor.dim() < 2:
        return [_digest(tensor)]
    return [_digest(part) for part in tensor.split(BLOCK_ROWS)]


LOCKED = ("fastckpt-lazy", "torch-checkpointing")  # a later Adam.step() may wait on the save
PARTS = ("model", "optim", "ddp")  # the state's tensors (its "step" is an int)


def _dtensor_names(names: Any) -> int:
    """How many of a lazy save's tensors copied at the call are DTensors (every name but
    the DDP-style plain tensors, which no optimizer owns and which are copied at the call)."""
    return sum(not str(n).startswith("ddp") for n in names)


def _restorer(method: str, where: str, step: int, manager: Any, tc: Any) -> Any:
    """A function that loads ``step`` of ``method``'s checkpoints in ``where`` into a
    state (in place, resharded to this world): fastckpt's ``manager.restore``, DCP's
    ``dcp.load``, torch-checkpointing's resharding ``load`` (``tc``)."""

    def restore(target: dict[str, Any]) -> None:
        if method.startswith("fastckpt"):
            manager.restore(step, state=target)
        elif method == "dcp-async":
            import torch.distributed.checkpoint as dcp

            dcp.load(target, checkpoint_id=os.path.join(where, f"step-{step}"))
        else:
            tc.load(os.path.join(where, f"step-{step}"), into={k: target[k] for k in PARTS})

    return restore


def _tc_gather_on_cpu() -> None:
    """torch-checkpointing 0.1.1 gathers its resharding metadata (once, at the first save)
    through CUDA tensors (``DefaultMetadataManager._all_gather_pickled_data`` hard-codes
    ``device="cuda"``); on CPU ranks over gloo this does the same gather with
    ``all_gather_object``."""
    import torch.distributed as dist
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    def gather(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
        out: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    DefaultMetadataManager._all_gather_pickled_data = gather  # type: ignore[method-assign]


def _tc_manager() -> Any:
    """torch-checkpointing's CheckpointManager as its documentation sets one up for
    resharding loads (a ``DefaultResharder`` on every item; asynchronous saves: a staging
    thread and a writer process), on its buffered storage: its default O_DIRECT writes fail
    with EINVAL on ext4 (unaligned lengths)."""
    from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager, ItemSpec
    from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    _tc_gather_on_cpu()
    config = CheckpointManager.Config(
        default=ItemSpec(resharder=DefaultResharder()),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        # its writer process imports torch: 30 s (the default) is too short on a busy machine
        save=AsyncCheckpointSaverConfig(
            process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=600)
        ),
    )
    return CheckpointManager(config)


def _join(rank: int, world: int, port: int) -> tuple[Any, Any]:
    """Joins the gloo group on loopback (one torch thread per rank); the checkpoint group
    (made in the foreground, before any thread uses it) and a 1-D device mesh."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fastckpt.distributed.groups import checkpoint_group

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=1800),
    )
    return checkpoint_group(), init_device_mesh("cpu", (world,))


def _rank_main(rank: int, world: int, port: int, options: dict[str, Any]) -> None:
    warnings.filterwarnings("ignore")  # DCP's overwrite and deprecation notices
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    import fastckpt
    from fastckpt.series import steps as layout
    from fastckpt.series.sharded import Ranks, save_step

    group, mesh = _join(rank, world, port)
    rows = TENSOR_BYTES // 4 // COLS
    count = max(1, options["per_rank"] // TENSOR_BYTES)
    gen = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(rows, COLS, generator=gen)) for _ in range(count)]
    same = torch.Generator().manual_seed(1234)  # the same values on every rank (DDP-style)
    replicated = [torch.randn(n, generator=same) for n in _replicated_sizes(options["replicated"])]
    grads = [torch.randn(rows, COLS, generator=gen) * 1e-3 for _ in range(count)]
    optimizer = torch.optim.Adam(params, lr=1e-4)
    chatter = torch.zeros(1 << 18)  # a training collective at every step (1 MiB)
    a, b = torch.randn(512, 512, generator=gen), torch.randn(512, 512, generator=gen)
    start = time.perf_counter()
    for _ in range(20):
        torch.mm(a, b)
    per_mm = (time.perf_counter() - start) / 20
    products = (
        0
        if options["compute_on"] == "accelerator"
        else round(options["compute_ms"] / 1000 / per_mm)
    )

    def train_step(lock: Any = None) -> float:
        if options["compute_on"] == "accelerator":  # the host waits for the device's passes
            time.sleep(options["compute_ms"] / 1000)
        for _ in range(products):  # the forward and backward passes, on the host's cores
            torch.mm(a, b)
        for p, g in zip(params, grads):
            p.grad = g
        dist.all_reduce(chatter)
        start = time.perf_counter()
        with lock if lock is not None else contextlib.nullcontext():
            optimizer.step()  # (torch-checkpointing: under its lock, as it documents)
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

    def local_digests() -> dict[str, list[str]]:
        out = {f"ddp.buffer{i}": _blocks(t) for i, t in enumerate(replicated)}
        for i, p in enumerate(params):
            out[f"model.layer{i}.weight"] = _blocks(p.detach())
            out[f"optim.layer{i}.exp_avg"] = _blocks(optimizer.state[p]["exp_avg"])
            out[f"optim.layer{i}.exp_avg_sq"] = _blocks(optimizer.state[p]["exp_avg_sq"])
        return out

    def restored_here(restore: Any, expected: dict[str, list[str]]) -> bool:
        """``restore(target)`` loads a step into zeroed live state on this world; compared
        with the digests taken at that step's save."""
        target = state_dict(0)
        for part in ("model", "optim", "ddp"):  # zeros: a restore fills them
            for value in target[part].values():
                for t in value.values() if isinstance(value, dict) else [value]:
                    (t.to_local() if hasattr(t, "to_local") else t).zero_()
        keep = [p.detach().clone() for p in params]
        restore(target)
        ok = local_digests() == expected
        for p, k in zip(params, keep):
            p.data.copy_(k)
        return ok

    folder = options["folder"]
    steps, every = options["steps"], options["every"]
    results: dict[str, Any] = {
        "blocked": {},
        "first": {},
        "memory": {},
        "plan_first": {},
        "plan_again": {},
        "restored": {},
        "call_copy": {},
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
        for method in rotate(options["methods"], round_):
            verify = round_ == 0 and method in VERIFIED
            where = os.path.join(folder, f"{method}-{round_}")
            dist.barrier()
            memory = _PeakRss()
            blocked: list[float] = []
            digests: dict[int, dict[str, list[str]]] = {}
            manager = tc = previous = lock = None
            if method.startswith("fastckpt-a") or method == "fastckpt-lazy":
                manager = fastckpt.CheckpointManager(where, keep_last=None if verify else 2)
            elif method == "torch-checkpointing":
                tc = _tc_manager()  # (its writer process starts here: counted in memory)
                lock = tc.lock()
            for step in range(1, steps + 1):
                took = train_step(lock)
                if blocked and step % every == 1 and method in LOCKED:
                    blocked[-1] += max(0.0, took - normal_step)  # the fence, or the lock
                if step % every:
                    continue
                state = state_dict(step)
                start = time.perf_counter()
                if manager is not None:
                    extra = {"fence": optimizer} if method == "fastckpt-lazy" else {}
                    manager.save(step, state, **extra)
                elif tc is not None:
                    # waits for the previous save's staging and write, then stages in a thread
                    previous = tc.save(os.path.join(where, f"step-{step}"), state)
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
                if method == "fastckpt-lazy":
                    assert manager is not None and manager._steps is not None
                    stager = manager._steps._stagers[-1]  # this save's (closed at the next)
                    results["call_copy"].setdefault(method, []).append(
                        [stager.call_copy_bytes, _dtensor_names(stager.call_copied)]
                    )
                del state
                if verify:
                    digests[step] = local_digests()
            if steps % every == 0:  # the last step saved: one more step meets its fence
                took = train_step(lock)
                if method in LOCKED:
                    blocked[-1] += max(0.0, took - normal_step)
            if manager is not None:
                manager.wait()
            elif previous is not None:
                previous.result()
            extra_memory = memory.stop()  # (before the checks below, which allocate)
            if verify:
                ok = 0
                for step, expected in digests.items():
                    ok += restored_here(_restorer(method, where, step, manager, tc), expected)
                results["restored"][method] = f"{ok}/{len(digests)}"
                results["digests"][method] = {str(s): d for s, d in digests.items()}
                results["dirs"][method] = where
            if manager is not None:
                assert manager._steps is not None
                plans = list(manager._steps.plan_seconds)
                manager.close()
                results["plan_first"].setdefault(method, []).append(plans[0])
                results["plan_again"].setdefault(method, []).extend(plans[1:])
            if tc is not None:
                tc.close()
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


def _replicated_sizes(nbytes: int) -> list[int]:
    """The float32 element counts of the DDP-style plain tensors (4:3:2:1 of ``nbytes``)."""
    return [max(1, nbytes * share // 10 // 4) for share in (4, 3, 2, 1)] if nbytes else []


def _restore_main(rank: int, world: int, port: int, options: dict[str, Any]) -> None:
    """One rank of a world of another size than the save's: restores every verified step
    of each method into zeroed DTensors sharded over this world (each method's resharding
    restore) and compares the rows it holds, block by block, with the saving ranks'
    digests. Rank 0 writes ``{method: "ok/steps"}`` to ``options["result"]``."""
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    import fastckpt

    _, mesh = _join(rank, world, port)
    total = TENSOR_BYTES // 4 // COLS * options["saved_world"]
    mine = total // world  # a multiple of BLOCK_ROWS (the parent picks the world so)
    first, count = rank * mine // BLOCK_ROWS, options["count"]

    def zeros() -> Any:
        local = torch.zeros(mine, COLS)
        return DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(total, COLS), stride=(COLS, 1)
        )

    tc = _tc_manager() if "torch-checkpointing" in options["dirs"] else None
    out = {}
    for method, where in options["dirs"].items():
        manager = fastckpt.CheckpointManager(where) if method.startswith("fastckpt") else None
        ok = 0
        for step, expected in options["expected"][method].items():
            target = {
                "model": {f"layer{i}.weight": zeros() for i in range(count)},
                "optim": {
                    f"layer{i}": {"exp_avg": zeros(), "exp_avg_sq": zeros()} for i in range(count)
                },
                "ddp": {f"buffer{i}": torch.zeros(n) for i, n in enumerate(options["sizes"])},
                "step": 0,
            }
            _restorer(method, where, int(step), manager, tc)(target)
            good = True
            for name, value in _flat(target).items():
                want = expected[name]
                if not name.startswith("ddp."):
                    want = want[first : first + mine // BLOCK_ROWS]
                good &= _blocks(value.to_local() if hasattr(value, "to_local") else value) == want
            flag = torch.tensor([int(good)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # restored only if on every rank
            ok += int(flag.item())
        if manager is not None:
            manager.close()
        out[method] = f"{ok}/{len(options['expected'][method])}"
    if tc is not None:
        tc.close()
    if rank == 0:
        with open(options["result"], "w", encoding="utf-8") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    """``{"model.layer0.weight": ..., "optim.layer0.exp_avg": ..., "ddp.buffer0": ...}``."""
    flat = {}
    for part in PARTS:
        for key, value in state.get(part, {}).items():
            if isinstance(value, dict):
                flat.update({f"{part}.{key}.{k}": v for k, v in value.items()})
            else:
                flat[f"{part}.{key}"] = value
    return flat


def _restore_world(world: int) -> int:
    """The world size a checkpoint saved by ``world`` ranks is restored on: half as many
    ranks (twice as many for 2), so each holds whole digest blocks."""
    return world // 2 if world >= 4 else world * 2


def _restored_on(
    world: int, saved_world: int, every_rank: list[Any], options: dict[str, Any]
) -> dict[str, str]:
    """Every verified step of each method restored on ``world`` ranks (:func:`_restore_main`)."""
    import torch.multiprocessing as mp

    methods = [m for m in VERIFIED if m in every_rank[0]["dirs"]]
    expected = {}
    for m in methods:
        expected[m] = {}
        for step in every_rank[0]["digests"][m]:
            whole: dict[str, list[str]] = {}
            for r in every_rank:  # the saving ranks' blocks, in rank order
                for name, blocks in r["digests"][m][step].items():
                    if name.startswith("ddp."):
                        whole[name] = blocks
                    else:
                        whole.setdefault(name, []).extend(blocks)
            expected[m][step] = whole
    restore = {
        "saved_world": saved_world,
        "count": max(1, options["per_rank"] // TENSOR_BYTES),
        "sizes": _replicated_sizes(options["replicated"]),
        "dirs": {m: every_rank[0]["dirs"][m] for m in methods},
        "expected": expected,
        "result": options["result"] + ".restore",
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_restore_main, args=(world, port, restore), nprocs=world)
    with open(restore["result"], encoding="utf-8") as f:
        return json.load(f)


def _restored_on_one_process(
    where: str, digests: list[dict[str, dict[str, list[str]]]], world: int
) -> str:
    """Every step of ``where`` restored on one process, split into ``world`` shards again
    and compared with each rank's digests at the save."""
    import fastckpt

    ok = 0
    with fastckpt.CheckpointManager(where) as manager:
        for step in digests[0]:
            _, state = manager.restore(int(step))
            flat = _flat(state)
            good = True
            for rank in range(world):
                mine = {
                    n: _blocks(t if n.startswith("ddp.") else t.chunk(world)[rank])
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


def _file_bytes(where: str, unique: int) -> tuple[float, float]:
    """For DCP's and torch-checkpointing's steps (``step-N`` folders): the bytes of each
    step's data files (``.distcp``; ``.pt`` but the per-rank ``step_*.pt`` ints) over the
    state's unique tensor bytes, the first step's and the median of the later ones'."""
    ratios = []
    for step in sorted(os.listdir(where), key=lambda n: int(n.rsplit("-", 1)[-1])):
        folder = os.path.join(where, step)
        names = [
            n
            for n in os.listdir(folder)
            if n.endswith(".distcp") or (n.endswith(".pt") and not n.startswith("step_"))
        ]
        ratios.append(sum(os.path.getsize(os.path.join(folder, n)) for n in names) / unique)
    return ratios[0], median(ratios[1:] or ratios)


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
    parser.add_argument(
        "--compute-on",
        choices=("host", "accelerator"),
        default="host",
        help="where the forward and backward passes run: host (matrix products on the rank's "
        "core) or accelerator (the host waits --compute-ms, as a GPU-bound step leaves its "
        "cores to the checkpoint's background work)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where checkpoints go (default: a temp dir)")
    args = parser.parse_args(argv)
    overrides = {int(k): parse_size(v) for k, v in (o.split("=") for o in args.per_rank_at)}
    methods = list(ALL_METHODS)
    missing = _torch_checkpointing_missing()
    if missing:
        print(f"# skipping torch-checkpointing: {missing}")
        methods.remove("torch-checkpointing")
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
                "compute_on": args.compute_on,
                "per_rank": per_rank,
                "replicated": parse_size(args.replicated),
                "steps": args.steps,
                "every": args.every,
                "repeat": args.repeat,
                "folder": folder,
                "methods": methods,
                "result": os.path.join(folder, "result.json"),
            }
            log(f"world {world}: {format_bytes(per_rank)} of parameters per rank (+ Adam)")
            load_start = os.getloadavg()
            every_rank = _run_ranks(world, options)
            row = _row(world, every_rank, options, methods)
            row["load"] = [load_start[0], os.getloadavg()[0]]
            rows.append(row)
            shutil.rmtree(folder, ignore_errors=True)
            _print_row(row, methods)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"# load average after: {os.getloadavg()}")
    print(json.dumps(rows))
    return 0


def _row(world: int, every_rank: list[Any], options: dict[str, Any], methods: list[str]) -> Any:
    """One world size's figures from every rank's results, with the restores on one process
    and on another world size (both run here, from the parent)."""

    def worst(key: str, method: str) -> float:
        # per checkpoint the slowest rank, then the median
        return median([max(v) for v in zip(*(r[key][method] for r in every_rank))])

    def planning(key: str, method: str) -> float:
        # per save the rank that came last to the agreement (the others' figures include
        # waiting for it), then the median
        return median([min(v) for v in zip(*(r[key][method] for r in every_rank))])

    other = _restore_world(world)
    count = max(1, options["per_rank"] // TENSOR_BYTES)
    unique = world * 3 * count * TENSOR_BYTES + 4 * sum(_replicated_sizes(options["replicated"]))
    row: dict[str, Any] = {"world": world, "per_rank": options["per_rank"], "other": other}
    restored_other = _restored_on(other, world, every_rank, options)
    for m in methods:
        row[m] = {
            "blocked": worst("blocked", m),
            "first": worst("first", m),
            "memory": max(max(r["memory"][m]) - median(r["memory"]["none"]) for r in every_rank),
        }
        if m in VERIFIED:
            where = every_rank[0]["dirs"][m]
            row[m]["restored"] = every_rank[0]["restored"][m]
            row[m]["restored_other"] = restored_other[m]
            if m.startswith("fastckpt"):
                first, later, _ = _bytes_written(where)
                digests = [r["digests"][m] for r in every_rank]
                row[m]["restored_world_1"] = _restored_on_one_process(where, digests, world)
            else:
                first, later = _file_bytes(where, unique)
            row[m]["bytes_first"], row[m]["bytes_later"] = first, later
        if m in ("fastckpt-async", "fastckpt-lazy"):
            row[m]["plan_first"] = planning("plan_first", m)
            row[m]["plan_again"] = planning("plan_again", m)
    copies = [c for r in every_rank for c in r["call_copy"].get("fastckpt-lazy", [])]
    if copies:  # what the lazy save copied at its calls: bytes, and DTensors among them
        row["fastckpt-lazy"]["call_copy"] = max(c[0] for c in copies)
        row["fastckpt-lazy"]["call_copy_dtensors"] = max(c[1] for c in copies)
    row["unique"] = unique
    return row


def _print_row(row: dict[str, Any], methods: list[str]) -> None:
    state = 3 * row["per_rank"]
    print(
        f"\n## {row['world']} ranks, {format_bytes(state)} of state per rank "
        f"(parameters + Adam), load average {row['load'][0]:.2f} to {row['load'][1]:.2f}"
    )
    print(
        "| method | blocked per checkpoint (s) | first checkpoint (s) | extra peak RSS | "
        f"plan first / again (s) | restored (same world / {row['other']} ranks / 1 process) | "
        f"bytes written / unique ({format_bytes(row['unique'])}), first step / later |"
    )
    print("|---|---|---|---|---|---|---|")
    for m in methods:
        r = row[m]
        plan = f"{r['plan_first']:.4f} / {r['plan_again']:.4f}" if "plan_first" in r else "-"
        restored = (
            f"{r['restored']} / {r['restored_other']} / {r.get('restored_world_1', '-')}"
            if "restored" in r
            else "-"
        )
        written = (
            f"{r['bytes_first']:.2f}x / {r['bytes_later']:.2f}x" if "bytes_first" in r else "-"
        )
        print(
            f"| {m} | {r['blocked']:.4f} | {r['first']:.4f} | {format_bytes(r['memory'])} | "
            f"{plan} | {restored} | {written} |"
        )
    dcp_async, sync = row["dcp-async"]["blocked"], row["fastckpt-sync"]["blocked"]
    for m in methods:
        if m in ("dcp-async", "fastckpt-sync"):
            continue
        b = row[m]["blocked"]
        line = f"- {m}: {b / dcp_async:.3f}x dcp-async, {b / sync:.3f}x fastckpt-sync"
        if "plan_first" in row[m]:
            line += f"; repeated plan {row[m]['plan_again'] / row[m]['plan_first']:.3f}x the first"
        if "call_copy" in row[m]:
            line += (
                f"; copied at the call: {format_bytes(row[m]['call_copy'])} "
                f"({row[m]['call_copy_dtensors']} DTensors)"
            )
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
