"""FastCkptCheckpoint(manager=CheckpointManager(...)) with a real Lightning Trainer on CPU:
saves become the manager's steps, retention is the manager's, and ``ckpt_path="last"``
resumes from the newest step that loads verified."""

from __future__ import annotations

import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.lightning import FastCkptCheckpoint  # noqa: E402
from fastckpt.series import steps  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*number of training batches.*"),
    pytest.mark.filterwarnings("ignore:.*but have no `val_dataloader`.*"),
    pytest.mark.filterwarnings("ignore:.*is smaller than the logging interval.*"),
]


class TinyModel(pl.LightningModule):
    """Two linear layers, Adam and a StepLR; logs ``val_loss`` and a scripted ``score``."""

    def __init__(self, lr: float = 0.05, scores: list | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))
        if self.hparams.scores is not None:
            self.log("score", float(self.hparams.scores[self.current_epoch]))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def _loader(n: int = 16) -> DataLoader:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _trainer(tmp_path, max_epochs: int, callbacks, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        **kwargs,
        default_root_dir=tmp_path,
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _model(**hparams) -> TinyModel:
    torch.manual_seed(0)
    return TinyModel(**hparams)


class _Capture(Callback):
    """The weights, optimizer state and counters at the start and the end of training."""

    def on_train_start(self, trainer, pl_module):
        self.start = _state_of(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self.end = _state_of(trainer, pl_module)


def _state_of(trainer, module) -> dict:
    return {
        "weights": {k: v.clone() for k, v in module.state_dict().items()},
        "exp_avg": [s["exp_avg"].clone() for s in trainer.optimizers[0].state.values()],
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["epoch"] == b["epoch"] and a["global_step"] == b["global_step"]
    assert a["lr"] == b["lr"]
    for key in a["weights"]:
        assert torch.equal(a["weights"][key], b["weights"][key]), key
    assert all(torch.equal(x, y) for x, y in zip(a["exp_avg"], b["exp_avg"]))


def test_saves_are_steps_kept_by_the_manager_and_resume_from_the_newest(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    first = _Capture()
    with fastckpt.CheckpointManager(root, fast=fast, keep_last=2) as manager:
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=2)
        _trainer(tmp_path, 2, [callback, first]).fit(_model(), _loader(), _loader(8))
        # fit waited for the drains: root holds the retained steps, verified and committed.
        assert steps.committed_steps(str(root)) == [6, 8]
        assert manager.steps() == [6, 8]
    marker = steps.marker_of(str(root), 8)
    assert set(marker["metrics"]) >= {"val_loss", "epoch", "step"}
    state = fastckpt.load(os.path.join(steps.step_dir(str(root), 8), steps.STATE_FILE))
    assert state["global_step"] == 8 and "state_dict" in state

    resumed = _Capture()
    with fastckpt.CheckpointManager(root, fast=fast, keep_last=2) as manager:
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=2)
        _trainer(tmp_path, 3, [callback, resumed]).fit(
            _model(), _loader(), _loader(8), ckpt_path="last"
        )
        assert manager.steps() == [10, 12]
    _assert_same(resumed.start, first.end)
    assert resumed.end["global_step"] == 12


def test_resume_skips_a_damaged_newest_step(tmp_path):
    root = tmp_path / "root"
    with fastckpt.CheckpointManager(root, keep_last=3) as manager:
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=4)
        _trainer(tmp_path, 2, [callback]).fit(_model(), _loader(), _loader(8))
    newest = root / "step-000000000008" / "state.safetensors"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF  # the last tensor byte: the header stays valid, a CRC does not
    newest.write_bytes(bytes(data))

    resumed = _Capture()
    with fastckpt.CheckpointManager(root, keep_last=None) as manager:
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=4)
        # Stops before step 8, whose damaged copy is still committed (a save of step 8
        # would be refused as already saved).
        _trainer(tmp_path, 2, [callback, resumed], max_steps=7).fit(
            _model(), _loader(), _loader(8), ckpt_path="last"
        )
    assert resumed.start["global_step"] == 4


def test_monitor_and_best_keep_the_best_step(tmp_path):
    scores = [0.1, 0.9, 0.3, 0.2]
    with fastckpt.CheckpointManager(tmp_path / "root", keep_last=1, best=("score", "max", 1)) as m:
        callback = FastCkptCheckpoint(manager=m, monitor="score", mode="max")
        _trainer(tmp_path, 4, [callback]).fit(_model(scores=scores), _loader(), _loader(8))
        # One step per epoch (4 batches): the best epoch (1) is step 8, the newest step 16.
        assert m.steps() == [8, 16]
        assert steps.marker_of(str(m.root), 8)["metrics"]["score"] == pytest.approx(0.9)


def test_synchronous_saves_are_committed_when_the_hook_returns(tmp_path):
    seen = []

    class Look(Callback):  # Lightning runs checkpoint callbacks last: look at the next batch
        def on_train_batch_start(self, trainer, *args):
            seen.append((trainer.global_step, steps.committed_steps(str(tmp_path / "root"))))

    with fastckpt.CheckpointManager(tmp_path / "root", keep_last=None) as manager:
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=2, asynchronous=False)
        _trainer(tmp_path, 1, [callback, Look()]).fit(_model(), _loader(), _loader(8))
    assert seen[2] == (2, [2]) and seen[3] == (3, [2])


def test_fresh_start_with_last_and_no_step_warns_and_trains(tmp_path):
    with fastckpt.CheckpointManager(tmp_path / "root") as manager:
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=2)
        with pytest.warns(UserWarning, match="no last checkpoint"):
            _trainer(tmp_path, 1, [callback]).fit(_model(), _loader(), _loader(8), ckpt_path="last")
        assert manager.latest() == 4


def test_file_arguments_and_non_managers_are_refused(tmp_path):
    with fastckpt.CheckpointManager(tmp_path) as manager:
        for kwargs in ({"dirpath": str(tmp_path)}, {"save_top_k": 3}, {"save_last": True}):
            with pytest.raises(ValueError, match="best=\\(monitor, mode, save_top_k\\)"):
                FastCkptCheckpoint(manager=manager, **kwargs)
        with pytest.raises(ValueError, match="dirpath"):
            FastCkptCheckpoint(str(tmp_path), manager=manager)
    with pytest.raises(TypeError, match="no save, restore, latest, wait"):
        FastCkptCheckpoint(manager=object())


def test_a_failed_save_reaches_fit(tmp_path):
    """A state the manager cannot save (its step taken) fails fit, not silently."""
    root = tmp_path / "root"
    with fastckpt.CheckpointManager(root, keep_last=None) as manager:
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=2)
        _trainer(tmp_path, 1, [callback]).fit(_model(), _loader(), _loader(8))
        # A second run from scratch on the same manager would save step 2 again.
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=2)
        with pytest.raises(ValueError, match="step 2 is already saved"):
            _trainer(tmp_path, 1, [callback]).fit(_model(), _loader(), _loader(8))


def test_an_s3_root_without_a_fast_tier_resumes_from_last(s3, tmp_path):
    bucket, options, _ = s3
    root = f"{bucket}/run"
    first = _Capture()
    with fastckpt.CheckpointManager(root, keep_last=2, storage_options=options) as manager:
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=4)
        _trainer(tmp_path, 1, [callback, first]).fit(_model(), _loader(), _loader(8))
        assert manager.steps() == [4]
    resumed = _Capture()
    with fastckpt.CheckpointManager(root, keep_last=2, storage_options=options) as manager:
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=4)
        _trainer(tmp_path, 2, [callback, resumed]).fit(
            _model(), _loader(), _loader(8), ckpt_path="last"
        )
        assert manager.steps() == [4, 8]
    _assert_same(resumed.start, first.end)


class _StateAtSave(Callback):
    """The weights at each save call, by global step."""

    def __init__(self):
        self.at_save: dict[int, dict] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        weights = checkpoint["state_dict"]
        self.at_save[checkpoint["global_step"]] = {k: v.clone() for k, v in weights.items()}


def test_best_loads_the_managers_best_step(tmp_path):
    scores = [0.1, 0.9, 0.3, 0.2, 0.2]  # (validate() after fit logs one more)
    saved = _StateAtSave()
    with fastckpt.CheckpointManager(tmp_path / "root", keep_last=1, best=("score", "max", 1)) as m:
        callback = FastCkptCheckpoint(manager=m, monitor="score", mode="max")
        trainer = _trainer(tmp_path, 3, [callback, saved])
        model = _model(scores=scores)
        trainer.fit(model, _loader(), _loader(8))
        assert callback.best_model_path.endswith("#step=8")  # epoch 1's step
        trainer.validate(model, _loader(8), ckpt_path="best")
        for key, value in saved.at_save[8].items():
            assert torch.equal(model.state_dict()[key], value), key
        assert not torch.equal(saved.at_save[8]["net.0.weight"], saved.at_save[12]["net.0.weight"])


def test_best_without_a_best_metric_says_to_keep_one(tmp_path):
    with fastckpt.CheckpointManager(tmp_path / "root", keep_last=2) as manager:
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=4)
        trainer = _trainer(tmp_path, 1, [callback])
        model = _model()
        trainer.fit(model, _loader(), _loader(8))
        with pytest.raises(ValueError, match=r"best=\(monitor"):
            trainer.validate(model, _loader(8), ckpt_path="best")


def test_a_factory_makes_the_manager_at_setup_and_closes_it_after(tmp_path):
    root = tmp_path / "root"
    made = []

    def factory(**options):
        made.append(options)
        return fastckpt.CheckpointManager(root, keep_last=2, **options)

    first = _Capture()
    callback = FastCkptCheckpoint(manager=factory, every_n_train_steps=2)
    with pytest.warns(UserWarning, match="no last checkpoint"):  # a fresh start
        _trainer(tmp_path, 1, [callback, first]).fit(
            _model(), _loader(), _loader(8), ckpt_path="last"
        )
    assert made == [{"distributed": False}] and callback.manager is None  # closed
    resumed = _Capture()
    callback = FastCkptCheckpoint(manager=factory, every_n_train_steps=2)
    _trainer(tmp_path, 2, [callback, resumed]).fit(
        _model(), _loader(), _loader(8), ckpt_path="last"
    )
    _assert_same(resumed.start, first.end)
    with fastckpt.CheckpointManager(root) as manager:  # no other manager holds the root
        assert manager.steps() == [6, 8]


def test_a_manager_made_before_a_multi_process_run_names_the_recipe(tmp_path):
    with fastckpt.CheckpointManager(tmp_path / "root") as manager:
        callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=2)
        trainer = pl.Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=2,
            callbacks=[callback],
            logger=False,
            enable_progress_bar=False,
            default_root_dir=tmp_path,
        )
        with pytest.raises(ValueError, match=r"functools\.partial\(fastckpt\.CheckpointManager"):
            callback.setup(trainer, _model(), "fit")


_DDP_SCRIPT = """
import functools, json, sys

import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

import fastckpt
from fastckpt.lightning import FastCkptCheckpoint

root, out, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Record(pl.Callback):
    def on_train_start(self, trainer, module):
        self.start = trainer.global_step

    def on_train_end(self, trainer, module):
        if trainer.global_rank == 0:
            with open(out, "w") as f:
                json.dump({"start": self.start, "end": trainer.global_step,
                           "weight": module.net.weight.tolist()}, f)


x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
callback = FastCkptCheckpoint(
    manager=functools.partial(fastckpt.CheckpointManager, root, keep_last=2),
    every_n_train_steps=2,
)
trainer = pl.Trainer(
    strategy="ddp", accelerator="cpu", devices=2, max_steps=max_steps,
    callbacks=[callback, Record()], logger=False, enable_progress_bar=False,
    enable_model_summary=False, enable_checkpointing=True, default_root_dir=sys.argv[4],
)
torch.manual_seed(0)
trainer.fit(Net(), loader, ckpt_path="last")
"""


@pytest.mark.slow
def test_the_ddp_recipe_saves_on_rank_0_and_resumes_every_rank(tmp_path):
    import json
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_DDP_SCRIPT)
    root = tmp_path / "root"

    def run(max_steps: int, out: str) -> dict:
        done = subprocess.run(
            [
                sys.executable,
                str(script),
                str(root),
                str(tmp_path / out),
                str(max_steps),
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads((tmp_path / out).read_text())

    first = run(4, "first.json")  # ckpt_path="last" with no step yet: a fresh start
    assert first["start"] == 0 and first["end"] == 4
    second = run(8, "second.json")
    assert second["start"] == 4 and second["end"] == 8
    with fastckpt.CheckpointManager(root) as manager:
        assert manager.steps() == [6, 8]
        step, state = manager.restore()
        assert step == 8 and state["global_step"] == 8
        assert torch.equal(state["state_dict"]["net.weight"], torch.tensor(second["weight"]))
