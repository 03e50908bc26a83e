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
