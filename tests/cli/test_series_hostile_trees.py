"""`fastckpt clean` and `prune` in trees others wrote into: they keep the series' rules (links
never followed, unreadable markers kept, ASCII step names, NaN ranked worst)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from fastckpt.cli import main
from fastckpt.series import steps
from fastckpt.series.manager import CheckpointManager


def _series(root, losses: dict[int, float]) -> None:
    with CheckpointManager(root, keep_last=None) as manager:
        for step, loss in losses.items():
            manager.save(step, {"w": torch.full((64,), float(step))}, {"loss": loss}).result()


def _linked_step(tmp_path, root, step: int):
    """A committed step outside ``root`` and a link to it named as ``step`` in ``root``."""
    elsewhere = tmp_path / "elsewhere"
    _series(elsewhere, {step: 0.1})
    os.symlink(steps.step_dir(str(elsewhere), step), steps.step_dir(str(root), step))
    return elsewhere


def test_prune_never_follows_a_linked_step_directory(tmp_path, capsys):
    root = tmp_path / "root"
    _series(root, {1: 0.5, 3: 0.5, 4: 0.5})
    elsewhere = _linked_step(tmp_path, root, 2)
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    assert steps.committed_steps(str(elsewhere)) == [2]  # the link's target is not ours
    assert os.path.islink(steps.step_dir(str(root), 2))
    assert steps.committed_steps(str(root)) == [4]
    capsys.readouterr()


def test_clean_leaves_a_linked_step_directory_and_says_nothing_of_it(tmp_path, capsys):
    root = tmp_path / "root"
    _series(root, {1: 0.5})
    elsewhere = tmp_path / "elsewhere-partial"
    elsewhere.mkdir()
    (elsewhere / "state.safetensors").write_bytes(b"someone else's")
    os.symlink(elsewhere, steps.step_dir(str(root), 2))  # looks like a save cut short
    main(["clean", str(root)])
    out = capsys.readouterr().out
    assert os.path.islink(steps.step_dir(str(root), 2))
    assert (elsewhere / "state.safetensors").read_bytes() == b"someone else's"
    assert "step-000000000002" not in out and "removed" not in out.replace("nothing", "")


def test_clean_keeps_a_step_whose_marker_does_not_parse(tmp_path, capsys):
    root = tmp_path / "root"
    _series(root, {1: 0.5, 2: 0.5})
    marker = os.path.join(steps.step_dir(str(root), 1), steps.MARKER)
    Path(marker).write_text("{not json")
    status = main(["clean", str(root)])
    err = capsys.readouterr().err
    assert status == 1 and "step 1" in err
    assert Path(marker).read_text() == "{not json"  # reported, never deleted silently
    assert os.path.exists(os.path.join(steps.step_dir(str(root), 1), steps.STATE_FILE))


def test_clean_never_takes_other_digits_for_a_step(tmp_path, capsys):
    root = tmp_path / "root"
    _series(root, {1: 0.5})
    (root / ("step-" + "\u0966" * 11 + "\u0967")).mkdir()  # Devanagari 000000000001
    main(["clean", str(root)])
    capsys.readouterr()
    assert steps.committed_steps(str(root)) == [1]
    assert os.path.exists(os.path.join(steps.step_dir(str(root), 1), steps.STATE_FILE))


def test_prune_ranks_a_nan_metric_worst(tmp_path, capsys):
    root = tmp_path / "root"
    _series(root, {1: 0.5, 2: math.nan, 3: 0.3, 4: 0.9})
    assert main(["prune", str(root), "--keep-last", "1", "--best", "loss:min:1"]) == 0
    capsys.readouterr()
    assert steps.committed_steps(str(root)) == [3, 4]  # 3 is the true best
