"""Train with a CheckpointManager, get killed, resume from the newest committed step.

A small Lightning model trains in a child process and checkpoints every few steps through
``FastCkptCheckpoint(manager=CheckpointManager(root, fast=...))``: saves commit to a fast tier
(``/dev/shm``, or a temporary directory where there is none) and drain in the background to
the durable root: an S3 bucket on a loopback moto server when the manager takes URLs and
moto is installed, else a local directory. The child is killed with SIGKILL mid-run; a new
child resumes with ``trainer.fit(..., ckpt_path="last")`` from the newest step that loads
verified, and trains to the end.

Needs Lightning: pip install lightning (or pip install ".[lightning]" in the clone); for the
S3 root, moto[server] and s3fs.
Run: python examples/train_with_manager.py [DIRECTORY] [--local]
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator

import fastckpt

EVERY = 4  # steps between checkpoints
MAX_STEPS = 24  # the whole run
KILL_AT = 14  # the first run is killed once it reaches this step


# -------------------------------------------------------------------------- the training child
def train(root: str, fast: str, max_steps: int, resume: bool, pace: float = 0.0) -> int:
    """Trains to ``max_steps`` (resuming from the manager's newest step with ``resume``),
    printing each step; returns the step it started from."""
    import warnings

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from fastckpt.lightning import FastCkptCheckpoint

    warnings.filterwarnings("ignore", message=".*does not have many workers.*")

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            print(f"step {self.global_step}", flush=True)
            time.sleep(pace)  # a slower "training step", so the kill lands mid-run

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))  # 4 steps an epoch
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    started = {}

    class Started(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            started["step"] = trainer.global_step

    with fastckpt.CheckpointManager(root, fast=fast, keep_last=2, keep_fast=1) as manager:
        trainer = pl.Trainer(
            max_steps=max_steps,
            callbacks=[FastCkptCheckpoint(manager=manager, every_n_train_steps=EVERY), Started()],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=fast,
        )
        resume_from = "last" if resume and manager.latest() is not None else None
        trainer.fit(Regressor(), data, ckpt_path=resume_from)
    return started["step"]


# -------------------------------------------------------------------------- the durable root
@contextlib.contextmanager
def durable_root(directory: str, local: bool) -> Iterator[str]:
    """An ``s3://`` root on a loopback moto server when possible, else ``directory/root``.
    The server's address and credentials reach the children through the environment."""
    fallback = os.path.join(directory, "root")
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        ThreadedMotoServer = None
    if local or ThreadedMotoServer is None:
        print("durable root: local" + ("" if local else " (moto is not installed)"))
        yield fallback
        return
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield _bucket_or_local(server, fallback)
    finally:
        server.stop()


def _bucket_or_local(server, fallback: str) -> str:
    """A fresh bucket's URL if the manager takes URL roots, else ``fallback``."""
    host, port = server.get_host_and_port()
    options = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": f"http://{host}:{port}",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    os.environ["FASTCKPT_STORAGE_OPTIONS"] = json.dumps(options)  # for the children too
    import s3fs

    bucket = f"run-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket=bucket)
    url = f"s3://{bucket}/checkpoints"
    try:
        fastckpt.CheckpointManager(url).close()
    except (ValueError, TypeError) as exc:  # a manager of local directories only
        print(f"durable root: local (the manager refuses a URL root: {exc})")
        return fallback
    print("durable root: s3 (a loopback moto server)")
    return url


@contextlib.contextmanager
def fast_tier(directory: str) -> Iterator[str]:
    """A fresh directory on /dev/shm (memory), else under ``directory``."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        path = tempfile.mkdtemp(prefix="fastckpt-example-", dir="/dev/shm")
        print("fast tier: /dev/shm")
    else:
        path = os.path.join(directory, "fast")
        os.makedirs(path, exist_ok=True)
        print("fast tier: a local directory (no /dev/shm)")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -------------------------------------------------------------------------- the parent
def require_lightning() -> None:
    """Exits with one line saying what to install when Lightning is missing: the training
    children need it, and would otherwise each fail with a traceback."""
    try:
        found = importlib.util.find_spec("lightning") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise SystemExit(
            f"{os.path.basename(__file__)} needs Lightning: pip install lightning "
            "(or pip install '.[lightning]' in the clone)"
        )


class ChildFailed(Exception):
    """A training child exited on its own with an error: its status and last error line."""


def run_child(root: str, fast: str, resume: bool, kill_at: int | None) -> tuple[int, list[str]]:
    """Runs a training child; kills it with SIGKILL once it prints ``step kill_at``.

    Raises:
        ChildFailed: the child failed (not killed here), with the last line it wrote on stderr.
    """
    command = [sys.executable, os.path.abspath(__file__), "--train", root, fast]
    command += ["--resume"] if resume else []
    with tempfile.TemporaryFile("w+") as errors:  # a file, not a pipe: it never fills up
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=errors, text=True, env=_child_env()
        )
        assert child.stdout is not None
        lines = []
        killed = False
        for line in child.stdout:
            lines.append(line.strip())
            if kill_at is not None and line.strip() == f"step {kill_at}":
                os.kill(child.pid, signal.SIGKILL)
                killed = True
                break
        child.stdout.close()
        status = child.wait()
        if status != 0 and not killed:
            errors.seek(0)
            said = [line.strip() for line in errors if line.strip()]
            last = said[-1] if said else "no error output"
            raise ChildFailed(f"the training child exited with status {status}: {last}")
    return status, lines


def _child_env() -> dict[str, str]:
    """The children import the fastckpt this process imported (installed, or a source tree
    on PYTHONPATH), not whatever directory holds this script."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(fastckpt.__file__)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": here if not path else f"{here}{os.pathsep}{path}"}


def main(directory: str, local: bool = False) -> None:
    require_lightning()
    try:
        _kill_and_resume(directory, local)
    except ChildFailed as exc:
        raise SystemExit(str(exc)) from None


def _kill_and_resume(directory: str, local: bool) -> None:
    with durable_root(directory, local) as root, fast_tier(directory) as fast:
        status, _ = run_child(root, fast, resume=False, kill_at=KILL_AT)
        if status != -signal.SIGKILL:
            raise ChildFailed(f"the first run ended (status {status}) before step {KILL_AT}")
        print(f"first run killed at step {KILL_AT}: True")

        # What the next run will find: the newest committed step of either tier.
        with fastckpt.CheckpointManager(root, fast=fast) as manager:
            newest = manager.latest()
        print(f"newest committed step after the kill: {newest}")

        _, lines = run_child(root, fast, resume=True, kill_at=None)  # ChildFailed if it fails
        resumed_from = int(next(s for s in lines if s.startswith("resumed from")).split()[-1])
        print(f"resumed from step {resumed_from}: newest committed: {resumed_from == newest}")
        print(f"the lost work: {KILL_AT - resumed_from} steps (checkpoints every {EVERY})")

        with fastckpt.CheckpointManager(root, fast=fast) as manager:
            step, state = manager.restore()
        print(f"finished: step {step}, global step {state['global_step']}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--train":
        first = train(sys.argv[2], sys.argv[3], MAX_STEPS, "--resume" in sys.argv, pace=0.05)
        print(f"resumed from {first}", flush=True)
    else:
        arguments = [a for a in sys.argv[1:] if a != "--local"]
        if arguments:
            main(arguments[0], local="--local" in sys.argv)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                main(tmp, local="--local" in sys.argv)
