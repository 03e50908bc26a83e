"""What a CheckpointManager costs a training loop, and how soon its checkpoints are durable.

A training-like loop (CPU matmuls, then an optimizer step that changes every tensor) holds
an LLM-like state of ``--size`` bytes and checkpoints it every ``--every`` steps, keeping the
``--keep-last`` newest. Each mode runs in its own process (peak RSS per mode):

- ``manager_disk``: ``CheckpointManager(root)`` with root on the disk (``--dir``);
- ``manager_fast_disk``: ``CheckpointManager(root, fast=/dev/shm/...)``, root on the disk;
- ``manager_fast_disk_nice19``: the same with ``drain_nice=19``: the drain takes the CPU
  time the loop leaves idle (by default it runs at the loop's priority);
- ``manager_fast_s3``: the same with root in an S3 bucket on a loopback moto server that
  the benchmark starts (skipped, with a note, without moto/s3fs or URL roots);
- ``async_save``: ``fastckpt.async_save`` of each step's file on the disk, nothing else (what
  a manager's save is measured against);
- ``torch_save``: ``torch.save`` + fsync of each step's file, the oldest deleted by hand;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` of each step's directory (one
  rank), the oldest deleted by hand.

Reported per mode (medians over the checkpoints): the time a checkpoint blocks the loop, the
time from the call until the step is durable in root (committed there: for the fast modes
when the drain's copy is verified and committed, seen by polling root every few ms), the
loop's total, and the peak RSS above the state's (staging memory and the drain's buffers).
The manager modes then time a restore: ``manager.restore()`` (which verifies every CRC32C)
from the fast tier and from root, beside ``fastckpt.load(verify=True)`` of the same file from
the same place (root's page cache dropped first where permitted), alternated, medians of 3.
Peak RSS counts the fast tier's files that the manager keeps mapped
(:mod:`fastckpt.io.kept_mappings`: shared memory the tier holds anyway); the anonymous part
of it (sampled every 10 ms) is the memory a mode allocates.

With ``--lazy`` the fastckpt saves are lazy, fenced on the loop's optimizer
(``fence=optimizer``): the time the next step waits for the fence counts as blocked.

One run; do not compare figures from different runs (this machine's disk is noisy).

Run: python benchmarks/bench_manager.py [--size 2G] [--steps 12] [--every 4] [--json OUT]
Smoke: python benchmarks/bench_manager.py --size 64M --steps 4 --every 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastckpt.bench.caches import drop_page_cache, make_durable
from fastckpt.bench.children import report, run_child
from fastckpt.bench.measure import AnonymousPeak, Measure
from fastckpt.bench.units import format_bytes, median
from fastckpt.config import parse_size

MODES = (
    "manager_disk",
    "manager_fast_disk",
    "manager_fast_disk_nice19",
    "manager_fast_s3",
    "async_save",
    "torch_save",
    "dcp_async",
)
_POLL_SECONDS = 0.005
_RESTORE_ROUNDS = 3  # restores and loads timed per tier (medians)


# ------------------------------------------------------------------------------- the child
class _DurableWatch:
    """Records when each step first appears committed in root (polled in a thread)."""

    def __init__(self, root: Any, interval: float):
        from fastckpt.series import steps as layout

        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._root, self._layout, self._interval = root, layout, interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.perf_counter()
            for step in self._layout.committed_steps(self._root):
                self.seen.setdefault(step, now)
            self._stop.wait(self._interval)

    def wait_for(self, step: int, timeout: float = 3600) -> None:
        deadline = time.monotonic() + timeout
        while step not in self.seen and time.monotonic() < deadline:
            time.sleep(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _optimizer(state: dict) -> Any:
    """An optimizer whose step changes every tensor of ``state`` (weight decay on zero
    gradients): what a lazy save's fence holds off."""
    import torch

    for t in state.values():
        t.grad = torch.zeros_like(t)
    return torch.optim.SGD(list(state.values()), lr=0.1, weight_decay=0.01)


def _loop(
    args: argparse.Namespace, state: dict, checkpoint, optimizer: Any = None
) -> dict[str, Any]:
    """The training loop; ``checkpoint(step)`` saves and returns the seconds it blocked
    (with ``--lazy``, the next optimizer step's wait for the fence counts as blocked too)."""
    import torch

    optimizer = optimizer or _optimizer(state)
    a, b = torch.randn(args.matmul, args.matmul), torch.randn(args.matmul, args.matmul)
    blocked, called, fences, plain = [], {}, [], []
    with Measure() as m, AnonymousPeak() as anonymous:
        for step in range(1, args.steps + 1):
            for _ in range(args.matmuls_per_step):
                (a @ b).sum()
            t0 = time.perf_counter()
            optimizer.step()  # changes every tensor; fences a pending lazy save first
            took = time.perf_counter() - t0
            if step > args.every and (step - 1) % args.every == 0:
                fences.append(took)  # the step after a checkpoint
            else:
                plain.append(took)
            if step % args.every == 0:
                called[step] = time.perf_counter()
                checkpoint(step)
                blocked.append(time.perf_counter() - called[step])
    # what the step after a checkpoint took beyond an ordinary step: its wait for the fence
    usual = median(plain) if plain else 0.0
    fences = [max(0.0, f - usual) for f in fences]
    blocked = [b + f for b, f in zip(blocked, fences + [0.0] * len(blocked))]
    return {
        "blocked": blocked,
        "called": called,
        **m.as_dict(),
        "extra_anonymous_rss": anonymous.extra,
    }


def _restore_times(root: Any, fast: str | None, s3: bool) -> dict[str, float]:
    """manager.restore() and fastckpt.load(verify=True) of its newest step, from each tier."""
    import fastckpt
    from fastckpt.series import steps as layout

    samples: dict[str, list[float]] = {}
    places = ([("fast", fast)] if fast else []) + [("root", root)]
    for name, tier in places:
        step = layout.committed_steps(tier)[-1]
        path = layout.join(layout.step_dir(tier, step), layout.STATE_FILE)
        for _ in range(_RESTORE_ROUNDS):  # alternated: neither pays the other's first touch
            for what in ("restore", "load"):
                if name == "root" and not s3:
                    drop_page_cache([path])
                t0 = time.perf_counter()
                if what == "restore":
                    with fastckpt.CheckpointManager(tier) as manager:  # that tier alone
                        restored = manager.restore()
                else:
                    restored = fastckpt.load(path, verify=True)
                samples.setdefault(f"{what}_{name}", []).append(time.perf_counter() - t0)
                del restored
    return {key: median(values) for key, values in samples.items()}


def child(args: argparse.Namespace) -> None:
    import torch

    from fastckpt.bench.synthetic import llm_like_state_dict

    torch.manual_seed(0)
    state = llm_like_state_dict(args.size)
    work = Path(args.dir) / args.mode
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    done_at: dict[int, float] = {}
    result: dict[str, Any] = {"mode": args.mode}

    optimizer = _optimizer(state)
    options = {"fence": optimizer} if args.lazy else {}
    if args.mode.startswith("manager"):
        import fastckpt
        from fastckpt.series.steps import Tier

        s3 = args.mode == "manager_fast_s3"
        root = f"{args.s3_url}/{uuid.uuid4().hex[:8]}" if s3 else str(work / "root")
        fast = (
            tempfile.mkdtemp(prefix="bench-manager-", dir=args.fast_dir)
            if "fast" in args.mode
            else None
        )
        try:
            watch = _DurableWatch(Tier(root), 0.05 if s3 else _POLL_SECONDS)
            nice = 19 if args.mode.endswith("_nice19") else None
            with fastckpt.CheckpointManager(
                root, fast=fast, keep_last=args.keep_last, drain_nice=nice
            ) as manager:
                res = _loop(
                    args, state, lambda step: manager.save(step, state, **options), optimizer
                )
                t0 = time.perf_counter()
                manager.wait()
                res["final_wait"] = time.perf_counter() - t0
            watch.wait_for(max(res["called"]), timeout=60)
            watch.stop()
            done_at = watch.seen
            del state
            result.update(_restore_times(root, fast, s3))
        finally:
            if fast:
                shutil.rmtree(fast, ignore_errors=True)
    elif args.mode == "async_save":  # fastckpt.async_save alone, the manager's reference
        import fastckpt

        pending: list[Any] = []

        def save(step: int) -> None:
            future = fastckpt.async_save(state, work / f"step-{step}.safetensors", **options)
            future.add_done_callback(lambda _f, s=step: done_at.setdefault(s, time.perf_counter()))
            pending.append(future)

        res = _loop(args, state, save, optimizer)
        t0 = time.perf_counter()
        for future in pending:
            future.result()
        res["final_wait"] = time.perf_counter() - t0
    elif args.mode == "torch_save":
        kept: list[Path] = []

        def save(step: int) -> None:
            path = work / f"step-{step}.pt"
            torch.save(state, path)
            make_durable(path)
            done_at[step] = time.perf_counter()
            kept.append(path)
            while len(kept) > args.keep_last:
                kept.pop(0).unlink()

        res = _loop(args, state, save, optimizer)
        res["final_wait"] = 0.0
    elif args.mode == "dcp_async":
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        store = dist.FileStore(str(work / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        futures: list[Any] = []
        kept_dirs: list[Path] = []

        def save(step: int) -> None:
            if futures:
                futures[-1].result()  # DCP allows one async save in flight
            directory = work / f"step-{step}"
            response = dcp.async_save(state, checkpoint_id=str(directory))
            future = getattr(response, "upload_completion", response)
            future.add_done_callback(lambda _f, s=step: done_at.setdefault(s, time.perf_counter()))
            futures.append(future)
            kept_dirs.append(directory)
            while len(kept_dirs) > args.keep_last + 1:  # the one in flight is not counted
                shutil.rmtree(kept_dirs.pop(0), ignore_errors=True)

        res = _loop(args, state, save, optimizer)
        t0 = time.perf_counter()
        for future in futures:
            future.result()
        res["final_wait"] = time.perf_counter() - t0
        dist.destroy_process_group()
    else:
        raise SystemExit(f"unknown mode {args.mode}")
    result.update(res)
    result["durable"] = [done_at[s] - t for s, t in res["called"].items() if s in done_at]
    result.pop("called")
    shutil.rmtree(work, ignore_errors=True)
    report(result)


# ------------------------------------------------------------------------------- the parent
def _start_s3() -> tuple[Any, str, dict[str, Any]] | str:
    """A moto server and a bucket, or why not."""
    try:
        import s3fs
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        return f"needs moto[server] and s3fs ({exc.name} is missing)"
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": f"http://{host}:{port}",
        "client_kwargs": {"region_name": "us-east-1"},
        # moto assembles a completed multipart object in Python (copying each part twice):
        # for a 2 GiB object on a busy 2-core machine that outlasts botocore's 60 s read
        # timeout, and the retried completion then finds the parts gone
        "config_kwargs": {"read_timeout": 900},
    }
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket=bucket)
    url = f"s3://{bucket}"
    try:
        import fastckpt

        os.environ["FASTCKPT_STORAGE_OPTIONS"] = json.dumps(options)
        fastckpt.CheckpointManager(f"{url}/probe").close()
    except (ValueError, TypeError) as exc:
        server.stop()
        return f"the manager takes no URL root here ({exc})"
    return server, url, options


def _table(rows: dict[str, dict[str, Any]], notes: list[str], args: argparse.Namespace) -> str:
    lines = [
        f"{format_bytes(args.size)} state, {args.steps} steps, a checkpoint every {args.every} "
        f"steps, keep_last={args.keep_last}, fastckpt saves "
        f"{'lazy, fenced on the optimizer' if args.lazy else 'eager (a snapshot)'}; "
        "medians over the checkpoints of one run",
        "",
        "| mode | blocks per checkpoint (s) | the same, from the 3rd on (s) "
        "| until durable in root (s) | loop total (s) | loop CPU (s) | final wait (s) "
        "| peak RSS above the state (MiB) | of it anonymous (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, row in rows.items():
        later = row["blocked"][2:] or row["blocked"]  # past the first saves' allocations
        lines.append(
            f"| {mode} | {median(row['blocked']):.3f} | {median(later):.3f} "
            f"| {median(row['durable']):.3f} | {row['seconds']:.2f} | {row['cpu_seconds']:.1f} "
            f"| {row['final_wait']:.2f} | {row['extra_rss'] / 2**20:.0f} "
            f"| {row.get('extra_anonymous_rss', 0) / 2**20:.0f} |"
        )
    restores = {m: r for m, r in rows.items() if "restore_root" in r}
    if restores:
        lines += [
            "",
            "| mode | restore from fast (s) | fastckpt.load from fast (s) "
            "| restore from root (s) | fastckpt.load from root (s) |",
            "|---|---:|---:|---:|---:|",
        ]
        keys = ("restore_fast", "load_fast", "restore_root", "load_root")
        for mode, r in restores.items():
            cells = [f"{r[k]:.3f}" if k in r else "-" for k in keys]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += [f"\nnote: {n}" for n in notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("2G"))
    p.add_argument("--dir", default=None, help="a directory on the disk (default: a temporary one)")
    p.add_argument("--fast-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--matmul", type=int, default=1024)
    p.add_argument("--matmuls-per-step", type=int, default=4)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--lazy",
        action="store_true",
        help="fastckpt saves fenced on the loop's optimizer (async_save(fence=...))",
    )
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--s3-url", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.mode = args.child
        child(args)
        return 0

    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    notes: list[str] = []
    if args.fast_dir is None:
        args.fast_dir = tempfile.gettempdir()
        notes.append(f"no /dev/shm: the fast tier is in {args.fast_dir}")
    server = None
    if "manager_fast_s3" in modes:
        started = _start_s3()
        if isinstance(started, str):
            notes.append(f"manager_fast_s3 skipped: {started}")
            modes.remove("manager_fast_s3")
        else:
            server, args.s3_url, _ = started
    directory = Path(args.dir or tempfile.mkdtemp(prefix="bench-manager-"))
    directory.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    try:
        for mode in modes:
            argv_child = [
                sys.executable, __file__, "--child", mode, "--dir", str(directory),
                "--fast-dir", args.fast_dir, "--size", str(args.size), "--steps", str(args.steps),
                "--every", str(args.every), "--keep-last", str(args.keep_last),
                "--matmul", str(args.matmul), "--matmuls-per-step", str(args.matmuls_per_step),
            ]  # fmt: skip
            if args.s3_url:
                argv_child += ["--s3-url", args.s3_url]
            if args.lazy:
                argv_child.append("--lazy")
            res = run_child(argv_child, timeout=3600, env=dict(os.environ))
            if "error" in res:
                notes.append(f"{mode} failed: {res['error']}")
                continue
            rows[mode] = res
            print(f"{mode}: blocked {median(res['blocked']):.3f} s a checkpoint", file=sys.stderr)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
        if server is not None:
            server.stop()
    print(_table(rows, notes, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "notes": notes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
