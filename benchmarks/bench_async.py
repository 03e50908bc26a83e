"""How long checkpointing stalls a training loop: every asynchronous checkpointer, one loop.

One training loop (a stack of fp32 linear layers, Adam, forward + backward + step on a
fixed batch) saves the state (parameters and both Adam moments) every ``--every`` steps.
Each mode runs in its own process (peak RSS is per mode) over the same loop:

- ``none``: no checkpoints (the baseline for time and memory);
- ``copy``: a plain copy of the state into already-allocated memory (the floor a snapshot
  can reach);
- ``eager``: ``fastckpt.async_save`` (snapshot into pinned staging memory, then returns);
- ``lazy``: ``fastckpt.async_save(..., fence=optimizer)``: returns at once, the tensors
  stream through a 256 MiB ring; the next step's fence snapshots what is not written yet;
- ``lazy_capped``: the same with ``fence_bytes=--fence-bytes``: past the cap the fence
  waits for the ring instead of snapshotting;
- ``dcp_thread`` / ``dcp_process``: ``torch.distributed.checkpoint.async_save`` with the
  thread and the process checkpointer (``AsyncCheckpointerType``; a one-rank gloo group);
- ``dcp_stager``: ``dcp.async_save`` with a ``DefaultStager`` (staging in the background,
  pinned where CUDA is there), fenced on its staging future before the next step;
- ``lightning_async``: Lightning's ``AsyncCheckpointIO`` over ``TorchCheckpointIO``
  (``torch.save`` in a thread after a clone);
- ``lightning_fastckpt``: fastckpt's ``AsyncFastCkptIO`` (lazy, fenced at the step).

Two settings: ``fits`` (forward + backward of one step outlasts the write of the state,
measured by a calibration run, and checkpoints are ``--every`` steps apart) and ``nofit``
(a step an eighth as long, a checkpoint every ``--nofit-every`` steps: the write cannot
hide). Reported per mode and setting: time blocked per checkpoint at the call and at the
fence (the wait before the next optimizer step), their sum, the loop's total, peak RSS of
the process tree above the ``none`` loop's, the host memory lazy fences snapshotted, and
whether every file equals the state at its call: a CRC32 of each tensor (every element
with ``--full-hash``, else a strided sample of one element in 4099, which any optimizer
step changes) taken at the call, untimed, compared with the file read back after the loop.

A first save before the loop (untimed) starts thread pools, processes and staging memory.

Run: python benchmarks/bench_async.py --params 2G [--settings fits,nofit] [--modes ...]
Smoke: python benchmarks/bench_async.py --params 4M --width 256 --steps 4 --every 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from fastckpt.bench.children import child_main, spawn
from fastckpt.bench.units import format_bytes, median
from fastckpt.config import parse_size

MODES = (
    "none",
    "copy",
    "eager",
    "lazy",
    "lazy_capped",
    "dcp_thread",
    "dcp_process",
    "dcp_stager",
    "lightning_async",
    "lightning_fastckpt",
)
SETTINGS = ("fits", "nofit")
SAMPLE_STRIDE = 4099  # elements between the ones a sampled CRC reads (prime: no alignment)


# -- the training loop -----------------------------------------------------------------------


def build(spec: dict[str, Any]) -> tuple[Any, Any, dict[str, Any], Any]:
    """The model, Adam after one step (so both moments exist), the flat state (the same
    tensor objects: their version counters move with every update) and the batch."""
    import torch

    torch.manual_seed(0)
    width = spec["width"]
    depth = max(1, round(spec["params"] / (width * width * 4)))
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, bias=False), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = torch.randn(spec.get("batch", 1), width)
    train_step(model, optimizer, batch)
    state: dict[str, Any] = {}
    for name, p in model.named_parameters():
        state[f"param/{name}"] = p
        for key, value in optimizer.state[p].items():
            state[f"{key}/{name}"] = value
    return model, optimizer, state, batch


def forward_backward(model: Any, batch: Any) -> None:
    model(batch).square().mean().backward()


def train_step(model: Any, optimizer: Any, batch: Any) -> None:
    forward_backward(model, batch)
    optimizer.step()
    optimizer.zero_grad()


def digest(state: dict[str, Any], full: bool) -> dict[str, int]:
    """CRC32 of each tensor: of every element, or of a strided sample."""
    out = {}
    for name, t in state.items():
        flat = t.detach().reshape(-1)
        if not full and flat.numel() > SAMPLE_STRIDE:
            flat = flat[::SAMPLE_STRIDE]
        out[name] = zlib.crc32(flat.contiguous().view(-1).numpy().view("u1").data)
    return out


class TreeRss:
    """Samples the RSS of this process and its descendants (a process checkpointer's
    worker counts too) every 10 ms; ``peak`` is the largest sum seen."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.sample())

    @staticmethod
    def sample() -> int:
        total, todo = 0, [os.getpid()]
        while todo:
            pid = todo.pop()
            try:
                with open(f"/proc/{pid}/statm", encoding="ascii") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                        todo += [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue  # a process that just ended
        return total


# -- the checkpointers -----------------------------------------------------------------------


class Saver:
    """One mode: ``save`` at a checkpoint (timed as blocked at the call), ``fence`` before
    the next optimizer step (timed as blocked at the fence), ``drain`` (wait for every save
    pending), ``close`` at the end (drain, then free what it holds), ``read`` a file back
    for verification."""

    suffix = ".safetensors"

    def __init__(self, state: dict[str, Any], optimizer: Any, spec: dict[str, Any]):
        self.state, self.optimizer, self.spec = state, optimizer, spec
        self.snapshot_bytes = 0

    def save(self, path: str) -> None:
        raise NotImplementedError

    def prepare(self) -> None:
        """Allocates what the mode keeps (after the RSS baseline: it counts)."""

    def fence(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        self.drain()

    def read(self, path: str) -> dict[str, Any]:
        import fastckpt

        return fastckpt.load(path)


class Copy(Saver):
    def prepare(self) -> None:
        self.spare = {k: v.detach().clone() for k, v in self.state.items()}  # touched once

    def save(self, path: str) -> None:
        for k, v in self.state.items():
            self.spare[k].copy_(v)

    def read(self, path: str) -> dict[str, Any]:
        return self.spare  # checked against the state of the last call only


class FastckptAsync(Saver):
    def __init__(self, *args: Any, lazy: bool = False, fence_bytes: int | None = None):
        super().__init__(*args)
        import fastckpt.checkpoint.asynchronous  # noqa: F401 - imported before the RSS baseline

        self.lazy, self.fence_bytes = lazy, fence_bytes
        self.futures: list[Any] = []

    def save(self, path: str) -> None:
        import fastckpt

        if self.lazy:
            future = fastckpt.async_save(
                self.state, path, fence=self.optimizer, fence_bytes=self.fence_bytes
            )
        else:
            future = fastckpt.async_save(self.state, path)
        self.futures.append(future)

    def fence(self) -> None:
        # What the optimizer's step pre-hook does, timed on its own: every pending save
        # (with a checkpoint each step, the older ones may still be writing).
        for future in self.futures:
            if not future.done():
                future.fence()

    def drain(self) -> None:
        for future in self.futures:
            future.result()
            guard = getattr(future, "_guard", None)
            self.snapshot_bytes += getattr(guard, "snapshot_bytes", 0)
        self.futures = []


class Dcp(Saver):
    suffix = ".dcp"

    def __init__(self, *args: Any, kind: str = "thread"):
        super().__init__(*args)
        import torch.distributed as dist
        from torch.distributed.checkpoint import state_dict_saver

        if not dist.is_initialized():
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
            )
        self.kind = kind
        self.stager = None
        self.checkpointer = state_dict_saver.AsyncCheckpointerType.THREAD
        if kind == "process":
            self.checkpointer = state_dict_saver.AsyncCheckpointerType.PROCESS
        if kind == "stager":
            import torch
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(cuda, False, True, cuda))
        self.pending: list[Any] = []
        self.staging: Any = None

    def save(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        for done in self.pending:  # DCP checkpoints one at a time
            done.result()
        self.pending = []
        options: dict[str, Any] = {"checkpoint_id": path}
        options["async_checkpointer_type"] = self.checkpointer
        if self.stager is not None:
            options["async_stager"] = self.stager
        response = dcp.async_save(self.state, **options)
        if hasattr(response, "staging_completion"):
            self.staging = response.staging_completion
            self.pending.append(response.upload_completion)
        else:
            self.pending.append(response)

    def fence(self) -> None:
        if self.staging is not None:  # the tensors are read until staging completes
            self.staging.result()
            self.staging = None

    def drain(self) -> None:
        self.fence()
        for done in self.pending:
            done.result()
        self.pending = []

    def close(self) -> None:
        self.drain()
        if self.stager is not None:
            self.stager.close()

    def read(self, path: str) -> dict[str, Any]:
        import torch
        import torch.distributed.checkpoint as dcp

        template = {k: torch.empty_like(v) for k, v in self.state.items()}
        dcp.load(template, checkpoint_id=path)
        return template


class LightningAsync(Saver):
    suffix = ".ckpt"

    def __init__(self, *args: Any):
        super().__init__(*args)
        from lightning.pytorch.plugins import TorchCheckpointIO
        from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, path: str) -> None:
        self.io.save_checkpoint({"state_dict": self.state}, path)

    def drain(self) -> None:
        self.io.teardown()  # waits for the thread; the next save starts another

    def read(self, path: str) -> dict[str, Any]:
        import torch

        return torch.load(path, weights_only=True)["state_dict"]


class LightningFastckpt(Saver):
    suffix = ".ckpt"

    def __init__(self, *args: Any):
        super().__init__(*args)
        from fastckpt.lightning import AsyncFastCkptIO

        # used directly, without a Trainer: the optimizer to fence is named
        self.io = AsyncFastCkptIO(fence=self.optimizer)
        self.futures: list[Any] = []

    def save(self, path: str) -> None:
        self.io.save_checkpoint({"state_dict": self.state}, path)
        self.futures.append(self.io._latest[path])  # for the fence's snapshot bytes

    def fence(self) -> None:
        self.io.fence()  # what its hook on every optimizer's step does, timed on its own

    def drain(self) -> None:
        self.io.teardown()  # waits for every save; the plugin stays usable
        for future in self.futures:
            self.snapshot_bytes += getattr(future._guard, "snapshot_bytes", 0)
        self.futures = []

    def read(self, path: str) -> dict[str, Any]:
        import fastckpt

        return fastckpt.load(path)["state_dict"]


def make_saver(mode: str, state: dict[str, Any], optimizer: Any, spec: dict[str, Any]) -> Saver:
    args = (state, optimizer, spec)
    if mode == "copy":
        return Copy(*args)
    if mode in ("eager", "lazy", "lazy_capped"):
        cap = spec["fence_bytes"] if mode == "lazy_capped" else None
        return FastckptAsync(*args, lazy=mode != "eager", fence_bytes=cap)
    if mode.startswith("dcp_"):
        return Dcp(*args, kind=mode[len("dcp_") :])
    if mode == "lightning_async":
        return LightningAsync(*args)
    if mode == "lightning_fastckpt":
        return LightningFastckpt(*args)
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


# -- the child side --------------------------------------------------------------------------


def run_mode(spec: dict[str, Any]) -> dict[str, Any]:
    """One mode, one setting: the timed loop, then every file read back and checked."""
    import warnings

    warnings.filterwarnings("ignore")  # DCP's and Lightning's notices
    model, optimizer, state, batch = build(spec)
    mode = spec["mode"]
    folder = os.path.join(spec["dir"], f"{spec['setting']}-{mode}")
    os.makedirs(folder, exist_ok=True)
    saver = None if mode == "none" else make_saver(mode, state, optimizer, spec)
    # The model, its state and the mode's imports: what every mode starts from. What the
    # mode keeps (staging memory, a spare copy, a worker process) comes after and counts.
    rss_base = TreeRss.sample()
    if saver is not None:  # untimed: thread pools, worker processes, staging memory
        saver.prepare()
        saver.save(os.path.join(folder, "warmup" + saver.suffix))
        saver.drain()
        saver.snapshot_bytes = 0
    at_call, at_fence, compute, stepping, digests, paths = [], [], [], [], [], []
    untimed = 0.0
    with TreeRss() as rss:
        t_loop = time.perf_counter()
        for step in range(1, spec["steps"] + 1):
            t0 = time.perf_counter()
            forward_backward(model, batch)
            t1 = time.perf_counter()
            if saver is not None:
                saver.fence()
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            t3 = time.perf_counter()
            compute.append(t1 - t0)
            stepping.append(t3 - t2)
            if saver is not None and at_call:
                at_fence[-1] += t2 - t1
            if saver is None or step % spec["every"]:
                continue
            t4 = time.perf_counter()
            digests.append(digest(state, spec["full_hash"]))  # untimed
            path = os.path.join(folder, f"step-{step}{saver.suffix}")
            paths.append(path)
            t5 = time.perf_counter()
            saver.save(path)
            at_call.append(time.perf_counter() - t5)
            at_fence.append(0.0)
            untimed += t5 - t4
        t6 = time.perf_counter()
        if saver is not None:
            saver.close()
        final_wait = time.perf_counter() - t6
        loop = time.perf_counter() - t_loop - untimed
    mismatched: list[str] = []
    checked = list(zip(paths, digests))
    if saver is not None:
        if mode == "copy":
            checked = checked[-1:]
        for path, expected in checked:
            got = digest(saver.read(path), spec["full_hash"])
            mismatched += [
                f"{os.path.basename(path)}:{k}" for k in expected if got[k] != expected[k]
            ]
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "mode": mode,
        "setting": spec["setting"],
        "at_call": at_call,
        "at_fence": at_fence,
        "compute": median(compute),
        "optimizer_step": median(stepping),
        "loop": loop,
        "final_wait": final_wait,
        "rss_base": rss_base,
        "peak_tree_rss": rss.peak,
        "extra_rss": rss.peak - rss_base,
        "snapshot_bytes": saver.snapshot_bytes if saver is not None else 0,
        "checkpoints": len(paths),
        "checked": len(checked) if saver is not None else 0,
        "verified": (len(checked) if saver is not None else 0)
        - len({m.split(":")[0] for m in mismatched}),
        "mismatched": mismatched[:20],
    }


def calibrate(spec: dict[str, Any]) -> dict[str, Any]:
    """Forward + backward seconds per batch row, and a blocking save of the state."""
    import torch

    import fastckpt

    model, optimizer, state, batch = build({**spec, "batch": spec["calib_batch"]})
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        forward_backward(model, batch)
        times.append(time.perf_counter() - t0)
        optimizer.zero_grad()
    path = os.path.join(spec["dir"], "calibrate.safetensors")
    t0 = time.perf_counter()
    fastckpt.save(state, path)
    write = time.perf_counter() - t0
    os.remove(path)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    per_row = median(times) / spec["calib_batch"]
    # A large batch costs less per row than a small one (the matmuls run more efficiently):
    # time the batch a fitting step needs and scale by what it really took.
    rows = max(1, math.ceil(1.5 * write / per_row))
    wide = torch.randn(rows, batch.shape[1])
    t0 = time.perf_counter()
    forward_backward(model, wide)
    per_row = (time.perf_counter() - t0) / rows
    optimizer.zero_grad()
    return {"per_row": per_row, "write": write, "state_bytes": nbytes}


# -- the parent side -------------------------------------------------------------------------


def summarize(runs: list[dict[str, Any]], baseline_rss: float | None) -> dict[str, Any]:
    calls = [median(r["at_call"]) for r in runs if r["at_call"]]
    fences = [median(r["at_fence"]) for r in runs if r["at_fence"]]
    blocked = [
        median([c + f for c, f in zip(r["at_call"], r["at_fence"])]) for r in runs if r["at_call"]
    ]
    extra = median(r["extra_rss"] for r in runs)
    return {
        "at_call": median(calls) if calls else 0.0,
        "at_fence": median(fences) if fences else 0.0,
        "blocked": median(blocked) if blocked else 0.0,
        "loop": median(r["loop"] for r in runs),
        "final_wait": median(r["final_wait"] for r in runs),
        "compute": median(r["compute"] for r in runs),
        "extra_rss": extra,
        "rss_above_none": None if baseline_rss is None else extra - baseline_rss,
        "snapshot_bytes": median(r["snapshot_bytes"] for r in runs),
        "verified": f"{sum(r['verified'] for r in runs)}/{sum(r['checked'] for r in runs)}",
        "mismatched": [m for r in runs for m in r["mismatched"]][:20],
    }


def print_table(setting: str, info: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    print(
        f"\n### {setting}: batch {info['batch']}, forward+backward {info['compute']:.2f} s per "
        f"step, fastckpt.save {info['write']:.2f} s, a checkpoint every {info['every']} steps, "
        f"{info['steps']} steps\n"
    )
    print(
        "| mode | blocked at call (s) | at fence (s) | blocked per ckpt (s) | x copy | loop (s) "
        "| final wait (s) | RSS above none (MiB) | fence snapshot (MiB) | verified |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    copy = rows.get("copy", {}).get("blocked")
    for mode, row in rows.items():
        ratio = f"{row['blocked'] / copy:.3f}" if copy and mode != "none" else ""
        rss = row["rss_above_none"]
        print(
            f"| {mode} | {row['at_call']:.4f} | {row['at_fence']:.4f} | {row['blocked']:.4f} | "
            f"{ratio} | {row['loop']:.2f} | {row['final_wait']:.2f} | "
            f"{'' if rss is None else f'{rss / 2**20:.0f}'} | "
            f"{row['snapshot_bytes'] / 2**20:.0f} | {row['verified']} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=parse_size, default=parse_size("2G"), help="fp32 bytes")
    p.add_argument("--width", type=int, default=4096, help="features of each linear layer")
    p.add_argument("--dir", default=None, help="where to write (default: ../bench-async-tmp)")
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--every", type=int, default=3, help="steps between checkpoints (fits)")
    p.add_argument("--nofit-every", type=int, default=1, help="steps between checkpoints (nofit)")
    p.add_argument("--fit-batch", type=int, default=None, help="rows per step (fits)")
    p.add_argument("--nofit-batch", type=int, default=None, help="rows per step (nofit)")
    p.add_argument("--calib-batch", type=int, default=16)
    p.add_argument("--fence-bytes", type=parse_size, default=parse_size("256M"))
    p.add_argument("--full-hash", action="store_true", help="CRC every element, not a sample")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--timeout", type=float, default=3600, help="seconds per mode")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        sys.exit(child_main(args.child, {"mode": run_mode, "calibrate": calibrate}))

    modes = [m for m in args.modes.split(",") if m]
    settings = [s for s in args.settings.split(",") if s]
    for name in modes:
        if name not in MODES:
            p.error(f"unknown mode {name!r}; modes: {', '.join(MODES)}")
    for name in settings:
        if name not in SETTINGS:
            p.error(f"unknown setting {name!r}; settings: {', '.join(SETTINGS)}")
    if "none" not in modes:
        modes.insert(0, "none")  # the baseline of every RSS figure
    directory = Path(args.dir or Path(__file__).resolve().parent.parent.parent / "bench-async-tmp")
    directory.mkdir(parents=True, exist_ok=True)
    base = {
        "params": args.params,
        "width": args.width,
        "dir": str(directory),
        "steps": args.steps,
        "fence_bytes": args.fence_bytes,
        "full_hash": args.full_hash,
        "calib_batch": args.calib_batch,
    }
    script = Path(__file__).resolve()
    out: dict[str, Any] = {"args": vars(args), "settings": {}}
    try:
        cal: dict[str, Any] = {"write": float("nan")}
        if args.fit_batch is None or ("nofit" in settings and args.nofit_batch is None):
            cal = spawn(script, {**base, "op": "calibrate"}, args.timeout)
            if "error" in cal:
                raise SystemExit(f"calibration failed: {cal['error']}")
            print(
                f"state {format_bytes(cal['state_bytes'])}; forward+backward "
                f"{cal['per_row'] * 1e3:.1f} ms per row; fastckpt.save {cal['write']:.2f} s",
                file=sys.stderr,
            )
        fit_batch = args.fit_batch or max(1, math.ceil(1.5 * cal["write"] / cal["per_row"]))
        for setting in settings:
            batch = fit_batch if setting == "fits" else (args.nofit_batch or max(1, fit_batch // 8))
            every = args.every if setting == "fits" else args.nofit_every
            spec = {**base, "op": "mode", "setting": setting, "batch": batch, "every": every}
            results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for r in range(args.repeats):
                for mode in modes:  # interleaved, so disk noise hits every mode alike
                    res = spawn(script, {**spec, "mode": mode}, args.timeout)
                    if "error" in res:
                        print(f"{setting} {mode}: {res['error']}", file=sys.stderr)
                        continue
                    results[mode].append(res)
                    print(
                        f"{setting} round {r + 1} {mode}: loop {res['loop']:.2f} s, blocked "
                        f"{sum(res['at_call']) + sum(res['at_fence']):.3f} s, verified "
                        f"{res['verified']}/{res['checked']}",
                        file=sys.stderr,
                    )
            baseline = median(r["extra_rss"] for r in results["none"]) if results["none"] else None
            rows = {m: summarize(runs, baseline) for m, runs in results.items() if runs}
            compute = rows["none"]["compute"] if "none" in rows else float("nan")
            info = {"batch": batch, "every": every, "steps": args.steps, "write": cal["write"]}
            info["compute"] = compute
            print_table(setting, info, rows)
            out["settings"][setting] = {"info": info, "rows": rows, "raw": results}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out["calibration"] = cal
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
