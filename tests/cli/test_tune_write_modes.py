"""The write-mode step of `fastckpt tune` (fastckpt/cli/tune/write_modes.py), on real saves."""

from __future__ import annotations

import os

import pytest

from fastckpt import config
from fastckpt.cli.tune.write_modes import (
    WriteModeFigures,
    measure_write_modes,
    remember_write_modes,
)
from fastckpt.io.write_mode import SMALL_STATE_BYTES, choose_write_mode


@pytest.fixture
def tuned_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTCKPT_CONFIG", str(tmp_path / "tuned.json"))
    monkeypatch.delenv("FASTCKPT_DIRECT_IO", raising=False)
    config.reload()
    yield
    config.reload()


def test_each_mode_is_timed_on_a_real_save_and_leaves_nothing(tuned_file, tmp_path):
    target = tmp_path / "disk"
    target.mkdir()
    (figures,) = measure_write_modes([str(target)], 2 << 20, 2)
    assert set(figures.gbps) == {"direct", "buffered"}
    assert all(len(runs) == 2 and min(runs) > 0 for runs in figures.runs.values())
    assert figures.settings["block_size"] > 0 and figures.settings["staging_bytes"] > 0
    assert os.listdir(target) == []
    assert "-> " + figures.winner in figures.describe()


def test_the_winner_is_what_large_saves_then_take(tuned_file, tmp_path):
    figures = WriteModeFigures(str(tmp_path), gbps={"direct": 0.3, "buffered": 0.9})
    figures.runs = {"direct": [0.3], "buffered": [0.9]}
    remember_write_modes([figures])
    mode, why = choose_write_mode(
        str(tmp_path / "x.safetensors"), SMALL_STATE_BYTES + 1, direct_available=True
    )
    assert mode == "buffered" and "direct 0.3 GB/s, buffered 0.9 GB/s" in why
