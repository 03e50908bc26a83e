"""After switching to ``FastCkptCheckpoint``, ``MyModule.load_from_checkpoint(path)`` works in
a fresh process that imports ``fastckpt.lightning`` (as the training script did): a fastckpt
file goes to fastckpt's loader, any other file to Lightning's own, unchanged."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

MODULE = """
import lightning.pytorch as pl
import torch


class MyModule(pl.LightningModule):
    def __init__(self, hidden=4, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(3, hidden)

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
"""

TRAIN = """
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from fastckpt.lightning import FastCkptCheckpoint
from my_module import MyModule

torch.manual_seed(0)
model = MyModule(hidden=5)
callback = FastCkptCheckpoint(dirpath="ckpts", filename="last")
trainer = pl.Trainer(
    max_epochs=1, callbacks=[callback], logger=False, enable_progress_bar=False,
    enable_model_summary=False, default_root_dir=".",
)
trainer.fit(model, DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=4))
torch.save(model.state_dict(), "weights.pt")
trainer.save_checkpoint("torch.ckpt")  # no fastckpt plugin: Lightning's torch.save format
"""

LOAD = """
import torch

import fastckpt.lightning  # noqa: F401  (as the training script imports it)
from my_module import MyModule

expected = torch.load("weights.pt")
model = MyModule.load_from_checkpoint("ckpts/last.ckpt", lr=0.5)
assert model.hparams.hidden == 5 and model.hparams.lr == 0.5
assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
# a torch.save checkpoint still goes through Lightning's own loader
assert MyModule.load_from_checkpoint("torch.ckpt", weights_only=False).hparams.hidden == 5
print("loaded")
"""


def run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.filterwarnings("ignore")
def test_the_modules_own_load_from_checkpoint_reads_a_fastckpt_file(tmp_path):
    (tmp_path / "my_module.py").write_text(MODULE)
    trained = run(TRAIN, tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (tmp_path / "ckpts" / "last.ckpt").is_file()
    loaded = run(LOAD, tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.strip().endswith("loaded")


class _Net(pl.LightningModule):
    def __init__(self, width: int = 4, extra: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)
        if extra:
            self.extra = torch.nn.Linear(2, 2)


def _saved(tmp_path: Path, **hparams) -> tuple[str, dict]:
    from fastckpt.lightning import FastCkptIO

    net = _Net(**hparams)
    path = str(tmp_path / "net.ckpt")
    checkpoint = {
        "state_dict": net.state_dict(),
        "hyper_parameters": dict(net.hparams),
        "pytorch-lightning_version": "2.6.0",
    }
    FastCkptIO().save_checkpoint(checkpoint, path)
    return path, net.state_dict()


def test_hparams_file_overrides_the_saved_hyperparameters(tmp_path):
    path, weights = _saved(tmp_path, width=3)
    (tmp_path / "hparams.yaml").write_text("width: 3\nextra: true\n")
    with pytest.warns(UserWarning, match="not in the checkpoint"):
        net = _Net.load_from_checkpoint(
            path, hparams_file=str(tmp_path / "hparams.yaml"), strict=False
        )
    assert net.hparams.extra is True and hasattr(net, "extra")
    assert torch.equal(net.layer.weight, weights["layer.weight"])
    with pytest.raises(ValueError, match="hparams_file"):
        _Net.load_from_checkpoint(path, hparams_file=str(tmp_path / "hparams.txt"))


@pytest.mark.parametrize("saved_extra", [False, True], ids=["missing-keys", "extra-keys"])
def test_strict_false_loads_the_weights_there_are(tmp_path, saved_extra):
    from fastckpt.lightning import load_from_checkpoint

    path, weights = _saved(tmp_path, width=3, extra=saved_extra)
    with pytest.warns(UserWarning, match="Found keys"):
        net = load_from_checkpoint(_Net, path, strict=False, extra=not saved_extra)
    assert torch.equal(net.layer.weight, weights["layer.weight"])
    assert torch.equal(net.layer.bias, weights["layer.bias"])
    with pytest.raises(RuntimeError, match="extra"):
        load_from_checkpoint(_Net, path, extra=not saved_extra)  # strict by default


class _Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4, rows: int = 8):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset

        return DataLoader(TensorDataset(torch.randn(self.hparams.rows, 3)), self.hparams.batch_size)


class _Trained(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
@pytest.mark.filterwarnings("ignore:.*is smaller than the logging interval.*")
def test_the_datamodules_own_load_from_checkpoint_reads_a_fastckpt_file(tmp_path):
    from fastckpt.lightning import FastCkptIO

    trainer = pl.Trainer(
        max_epochs=1,
        plugins=[FastCkptIO()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Trained(), datamodule=_Data(batch_size=2, rows=6))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    data = _Data.load_from_checkpoint(tmp_path / "run.ckpt")
    assert isinstance(data, _Data) and dict(data.hparams) == {"batch_size": 2, "rows": 6}
    assert _Data.load_from_checkpoint(tmp_path / "run.ckpt", rows=10).hparams.rows == 10
    trainer.strategy.checkpoint_io = None  # Lightning's own format loads as before
    trainer.save_checkpoint(tmp_path / "torch.ckpt")
    assert _Data.load_from_checkpoint(tmp_path / "torch.ckpt", weights_only=False).hparams.rows == 6
