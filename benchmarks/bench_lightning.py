"""How long checkpointing blocks a Lightning training loop, per CheckpointIO.

A ``Trainer`` trains a stack of square linear layers with Adam on CPU and checkpoints every
few steps through ``ModelCheckpoint`` (``save_top_k=1``: each new checkpoint replaces the
previous one). Each mode runs in its own process, interleaved over rounds:

- ``none``: no checkpoints (the loop's own time);
- ``copy``: instead of saving, a plain copy of the state (weights and Adam state) into
  already-allocated memory: the floor a snapshot can reach;
- ``torch``: Lightning's default ``TorchCheckpointIO`` (``torch.save``; not fsynced);
- ``lightning_async``: Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())`` (clone every
  tensor, then ``torch.save`` in a background thread);
- ``fastckpt``: ``FastCkptIO`` (written, fsynced and renamed before the loop goes on);
- ``fastckpt_async``: ``AsyncFastCkptIO`` (the loop waits for the snapshot only).

"Blocked" is the time ``ModelCheckpoint``'s end-of-step hook takes on the steps it
checkpoints: collecting the state, the plugin's ``save_checkpoint``, and its
``remove_checkpoint`` of the checkpoint replaced. The first checkpoint of a run
is reported apart (asynchronous modes allocate their buffers there); the figure per mode
is the median, over rounds, of each run's median over its later checkpoints. ``final
wait`` is what ``teardown`` waits for the last background writes after the last step.

Run: python benchmarks/bench_lightning.py [--size 512M] [--steps 13] [--every 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from fastckpt.bench.children import report, run_child
from fastckpt.bench.measure import Measure
from fastckpt.bench.results import rotate
from fastckpt.bench.units import format_bytes, median
from fastckpt.config import parse_size

MODES = ("none", "copy", "torch", "lightning_async", "fastckpt", "fastckpt_async")


def child(args: argparse.Namespace) -> None:
    import warnings

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from fastckpt.lightning import AsyncFastCkptIO, FastCkptIO

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    width = args.width
    layers = max(1, round(args.size / (width * width * 4)))

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"width": width, "layers": layers})
            self.net = torch.nn.Sequential(
                *[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]
            )

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Clock(Callback):
        def on_train_start(self, trainer, pl_module):
            self.t0 = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            self.loop = time.perf_counter() - self.t0

    plugins = {
        "torch": lambda: [TorchCheckpointIO()],
        "lightning_async": lambda: [AsyncCheckpointIO(TorchCheckpointIO())],
        "fastckpt": lambda: [FastCkptIO()],
        "fastckpt_async": lambda: [AsyncFastCkptIO()],
    }.get(args.mode, lambda: [])()
    clock = Clock()
    callbacks: list = [clock]
    checkpoint = ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.every, save_top_k=1)
    if args.mode != "none":
        callbacks.append(checkpoint)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        plugins=plugins,
        logger=False,
        enable_checkpointing=args.mode != "none",
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    blocked: list[float] = []
    saves = [0]
    save, hook = trainer.save_checkpoint, checkpoint.on_train_batch_end
    spare: dict = {}

    def state_tensors() -> dict:
        module, opt = trainer.lightning_module, trainer.optimizers[0]
        out = {f"w/{k}": v for k, v in module.state_dict().items()}
        for i, s in opt.state_dict()["state"].items():
            out.update({f"o/{i}/{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
        return out

    def plain_copy(filepath, weights_only=False, storage_options=None):
        tensors = state_tensors()
        if not spare:  # allocate and touch every page once, outside the timing
            spare.update({k: torch.empty_like(v) for k, v in tensors.items()})
            for k, v in tensors.items():
                spare[k].copy_(v)
        t0 = time.perf_counter()
        for k, v in tensors.items():
            spare[k].copy_(v)
        blocked.append(time.perf_counter() - t0)

    def counted_save(*a, **kw):
        saves[0] += 1
        save(*a, **kw)

    def timed_hook(*a, **kw):
        before, t0 = saves[0], time.perf_counter()
        hook(*a, **kw)
        if saves[0] != before:
            blocked.append(time.perf_counter() - t0)

    if args.mode == "copy":
        trainer.save_checkpoint = plain_copy
    else:
        trainer.save_checkpoint = counted_save
        checkpoint.on_train_batch_end = timed_hook
    data = DataLoader(TensorDataset(torch.randn(args.steps * args.batch, width)), args.batch)
    with Measure() as m:
        trainer.fit(Stack(), data)  # includes teardown: the wait for the last writes
    state_bytes = sum(t.numel() * t.element_size() for t in state_tensors().values())
    report(
        {
            "mode": args.mode,
            "blocked": blocked,
            "loop": clock.loop,
            "final_wait": m.seconds - clock.loop,
            "state_bytes": state_bytes,
            "layers": layers,
            **m.as_dict(),
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("512M"))
    p.add_argument("--width", type=int, default=4096, help="width of each square layer")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--dir", default=None, help="directory on the disk (default: ../bench-lightning-tmp)"
    )
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.mode = args.child
        child(args)
        return

    root = Path(args.dir or Path(__file__).resolve().parent.parent.parent / "bench-lightning-tmp")
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for r in range(args.repeats):
            for mode in rotate(modes, r):  # interleaved: disk noise hits every mode
                directory = root / mode
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
                argv = [sys.executable, __file__, "--child", mode, "--dir", str(directory)]
                for name in ("size", "width", "batch", "steps", "every"):
                    argv += [f"--{name}", str(getattr(args, name))]
                res = run_child(argv, timeout=1800)
                if "error" in res:
                    print(f"{mode}: {res['error']}", file=sys.stderr)
                    continue
                results[mode].append(res)
                later = res["blocked"][1:] or res["blocked"]
                print(
                    f"round {r + 1} {mode}: loop {res['loop']:.2f} s, blocked per checkpoint "
                    f"{median(later) or 0:.3f} s (first {res['blocked'][0] if res['blocked'] else 0:.3f} s)",
                    file=sys.stderr,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = median
    rows = {}
    for mode, runs in results.items():
        if not runs:
            continue
        rows[mode] = {
            "blocked": med(med(r["blocked"][1:] or r["blocked"]) for r in runs)
            if mode != "none"
            else 0.0,
            "first": med(r["blocked"][0] for r in runs) if mode != "none" else 0.0,
            "loop": med(r["loop"] for r in runs),
            "final_wait": med(r["final_wait"] for r in runs),
            "peak_rss": med(r["peak_rss"] for r in runs),
        }
    any_run = next(r for runs in results.values() for r in runs)
    checkpoints = args.steps // args.every
    print(
        f"\n{any_run['layers']} x Linear({args.width}, {args.width}) = "
        f"{format_bytes(any_run['layers'] * args.width**2 * 4)} of parameters; checkpoint (weights + Adam state) "
        f"{format_bytes(any_run['state_bytes'])}; {args.steps} steps, a checkpoint every "
        f"{args.every} ({checkpoints} per run); medians of {args.repeats} runs\n"
    )
    names = {
        "none": "no checkpoints",
        "copy": "plain copy of the state (floor)",
        "torch": "TorchCheckpointIO",
        "lightning_async": "AsyncCheckpointIO(TorchCheckpointIO)",
        "fastckpt": "FastCkptIO",
        "fastckpt_async": "AsyncFastCkptIO",
    }
    print(
        "| CheckpointIO | blocks per checkpoint (s) | first checkpoint (s) | loop (s) | final wait (s) | peak RSS (MiB) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for mode, row in rows.items():
        print(
            f"| {names[mode]} | {row['blocked']:.3f} | {row['first']:.3f} | {row['loop']:.2f} "
            f"| {row['final_wait']:.2f} | {row['peak_rss'] / 2**20:.0f} |"
        )
    print()
    checks = [
        ("fastckpt", "torch", 1 / 3, "FastCkptIO vs TorchCheckpointIO"),
        ("fastckpt_async", "copy", 1.25, "AsyncFastCkptIO vs a plain copy"),
        ("fastckpt_async", "lightning_async", 1 / 5, "AsyncFastCkptIO vs AsyncCheckpointIO"),
    ]
    for ours, theirs, target, label in checks:
        if ours in rows and theirs in rows and rows[theirs]["blocked"]:
            ratio = rows[ours]["blocked"] / rows[theirs]["blocked"]
            verdict = "met" if ratio <= target else "NOT met"
            print(f"{label}: {ratio:.3f}x (target <= {target:.3g}x: {verdict})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "raw": results}, indent=2))


if __name__ == "__main__":
    main()
