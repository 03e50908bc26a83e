"""``inspect`` and ``verify`` of a directory: the checkpoint files are found by their first
bytes, not their suffix (Lightning's ``.ckpt`` files written by fastckpt.lightning), and what
is skipped is named, with why."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import fastckpt
from fastckpt.cli import main


def _lightning_checkpoint(step: int) -> dict:
    """What a Lightning Trainer hands its CheckpointIO: weights, optimizer, loops, hparams."""
    g = torch.Generator().manual_seed(step)
    weight = torch.randn(1, 4, generator=g)
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {"net.weight": weight, "net.bias": torch.zeros(1)},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}],
        "lr_schedulers": [],
        "hyper_parameters": {"hidden": 4},
    }


def _mixed_folder(root, write_ckpt) -> None:
    """Two fastckpt ``.ckpt`` files, a torch.save ``.ckpt``, notes, a hidden file, a subfolder."""
    root.mkdir(exist_ok=True)
    for step in (1, 2):
        write_ckpt(_lightning_checkpoint(step), root / f"epoch=0-step={step}.ckpt")
    torch.save({"w": torch.ones(2)}, root / "old.ckpt")
    (root / "notes.txt").write_text("run 7: lr 0.1\n")
    (root / ".lock").write_text("")
    (root / "sub").mkdir()


def _check_mixed_folder(root, capsys) -> None:
    assert main(["verify", str(root)]) == 0
    captured = capsys.readouterr()
    assert "2 files: 2 OK" in captured.out, captured
    assert "epoch=0-step=1.ckpt" in captured.out and "old.ckpt" not in captured.out
    skipped = captured.err
    assert "skipped 2 files" in skipped
    assert "old.ckpt: a torch.save file (a zip archive)" in skipped
    assert "fastckpt convert" in skipped and "notes.txt" in skipped
    assert ".lock" not in skipped and "sub:" not in skipped

    assert main(["inspect", "--json", str(root)]) == 0
    captured = capsys.readouterr()
    described = json.loads(captured.out)
    assert [os.path.basename(d["path"]) for d in described] == [
        "epoch=0-step=1.ckpt",
        "epoch=0-step=2.ckpt",
    ]
    assert all(d["checksums"] and d["fastckpt_version"] for d in described)
    assert "old.ckpt: a torch.save file" in captured.err


def test_a_folder_of_fastckpt_ckpt_files(tmp_path, capsys):
    """The file kind, not the suffix, decides (the fastckpt.lightning plugin's files are
    fastckpt.save files named .ckpt)."""
    _mixed_folder(tmp_path / "ckpts", lambda obj, path: fastckpt.save(obj, path, progress=False))
    _check_mixed_folder(tmp_path / "ckpts", capsys)


def test_a_folder_written_by_the_lightning_plugin(tmp_path, capsys):
    lightning = pytest.importorskip("fastckpt.lightning")
    plugin = lightning.FastCkptIO()
    _mixed_folder(tmp_path / "ckpts", plugin.save_checkpoint)
    _check_mixed_folder(tmp_path / "ckpts", capsys)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_folder_written_by_a_lightning_trainer(tmp_path, capsys):
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from fastckpt.lightning import FastCkptCheckpoint

    class Tiny(pl.LightningModule):
        def __init__(self, hidden: int = 4):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    folder = tmp_path / "ckpts"
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[FastCkptCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1)],
    )
    x = torch.randn(8, 4)
    trainer.fit(Tiny(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))
    torch.save({"w": torch.ones(2)}, folder / "old.ckpt")
    assert main(["verify", str(folder)]) == 0
    captured = capsys.readouterr()
    assert "2 files: 2 OK" in captured.out and "old.ckpt: a torch.save file" in captured.err


def test_a_folder_of_torch_files_says_what_it_holds(tmp_path, capsys):
    torch.save({"w": torch.ones(2)}, tmp_path / "last.ckpt")
    (tmp_path / "README").write_text("hello")
    for command in ("verify", "inspect"):
        assert main([command, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"no fastckpt/safetensors files in directory {tmp_path}" in err
        assert "last.ckpt: a torch.save file" in err and "README" in err
        assert "fastckpt convert" in err and "*.safetensors" not in err


def test_damage_in_a_folder_is_still_found(tmp_path, capsys):
    """A .safetensors file with wrong first bytes is taken (and reported damaged); a .ckpt
    whose header JSON is broken sniffs as safetensors and is reported damaged too."""
    fastckpt.save({"w": torch.ones(2)}, tmp_path / "good.ckpt", progress=False)
    (tmp_path / "zeros.safetensors").write_bytes(bytes(64))
    broken = tmp_path / "broken.ckpt"
    fastckpt.save({"w": torch.ones(2)}, broken, progress=False)
    with open(broken, "r+b") as f:
        f.seek(9)
        f.write(b"!!")
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "3 files: 1 OK, 2 damaged" in out
    assert "DAMAGED       " + str(broken) in out


def test_a_fifo_in_a_folder_is_skipped_at_once(tmp_path):
    fastckpt.save({"w": torch.ones(2)}, tmp_path / "model.ckpt", progress=False)
    os.mkfifo(tmp_path / "pipe.ckpt")
    # Sniffing a FIFO would wait for a writer: a hang ends in TimeoutExpired here.
    out = subprocess.run(
        [sys.executable, "-m", "fastckpt", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, FASTCKPT_NO_PROGRESS="1"),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "pipe.ckpt: not a regular file" in out.stderr


def test_a_copy_keeps_its_kind_whatever_its_name(tmp_path, capsys):
    fastckpt.save({"w": torch.ones(2)}, tmp_path / "model.safetensors", progress=False)
    shutil.copy(tmp_path / "model.safetensors", tmp_path / "model.weights")
    assert main(["inspect", "--json", str(tmp_path)]) == 0
    names = [os.path.basename(d["path"]) for d in json.loads(capsys.readouterr().out)]
    assert names == ["model.safetensors", "model.weights"]
