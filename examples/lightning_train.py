"""Train a tiny Lightning model with FastCkptCheckpoint, then resume it from its last checkpoint.

Needs Lightning: pip install lightning (or pip install ".[lightning]" in the clone).
Run: python examples/lightning_train.py [DIRECTORY]
"""

from __future__ import annotations

import os
import sys
import tempfile

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import fastckpt
from fastckpt.lightning import FastCkptCheckpoint


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()  # stored without pickle: plain values
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


def data() -> DataLoader:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16, num_workers=0)


def trainer(directory: str, max_epochs: int) -> pl.Trainer:
    # One line: checkpoints every 2 steps, written in the background as fastckpt files.
    checkpoint = FastCkptCheckpoint(
        dirpath=directory, every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=True
    )
    return pl.Trainer(
        max_epochs=max_epochs,
        callbacks=[checkpoint],
        default_root_dir=directory,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def main(directory: str) -> None:
    trainer(directory, max_epochs=2).fit(Regressor(), data())
    print("checkpoints:", sorted(os.listdir(directory)))

    last = os.path.join(directory, "last.ckpt")
    state = fastckpt.load(last)  # a plain fastckpt file, readable outside Lightning
    print(f"last.ckpt: epoch {state['epoch']}, global step {state['global_step']}")

    resumed = trainer(directory, max_epochs=3)
    resumed.fit(Regressor(), data(), ckpt_path=last)
    print(f"resumed to epoch {resumed.current_epoch}, global step {resumed.global_step}")


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(tmp)
