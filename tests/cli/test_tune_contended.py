"""``fastckpt tune`` times the read modes beside a training-like load too, and records that
winner apart from the quiet one, with the load it was measured beside. Real files, a real
page cache (evicted with posix_fadvise), real busy processes."""

from __future__ import annotations

import json
import os

import pytest

from fastckpt.bench.caches import PageCache
from fastckpt.bench.training_load import TrainingLoad
from fastckpt.cli.tune.read_modes import measure_read_modes, remember_read_modes
from fastckpt.config import READ_MODES, filesystem_key, save_tuned_read_mode, tuned_read_mode


def test_tune_records_the_contended_winner_apart(tmp_path):
    target = tmp_path / "disk"
    target.mkdir()
    key = filesystem_key(target)
    save_tuned_read_mode(key, "staged", {"staged": 2.0, "direct": 1.5})  # a quiet pass's
    busy = measure_read_modes([str(target)], 2 << 20, PageCache(), 1, busy=1)
    if busy[0].skipped:  # the cache cannot be emptied here: nothing is recorded
        assert "read modes not measured" in busy[0].describe()
        return
    assert set(busy[0].gbps) == set(READ_MODES) and busy[0].busy == 1
    assert "beside 1 busy processes" in busy[0].describe()
    remember_read_modes(busy)
    with open(os.environ["FASTCKPT_CONFIG"], encoding="utf-8") as f:
        entry = json.load(f)["filesystems"][key]
    assert entry["read"]["mode"] == "staged"  # the quiet winner stays beside it
    contended = entry["read_busy"]
    assert contended["mode"] == busy[0].winner
    assert contended["mode"] == max(contended["gbps"], key=contended["gbps"].get)
    assert contended["busy"]["processes"] == 1
    assert len(contended["busy"]["load_averages"]) == 2  # at the start and the end
    mode, why = tuned_read_mode(target / "x.safetensors", contended=True)
    assert mode == busy[0].winner and "beside a busy machine" in why
    assert not [n for n in os.listdir(target) if n.startswith(".fastckpt-tune-read")]


def test_a_training_load_runs_until_stopped():
    with TrainingLoad(1, matrix=32) as load:
        assert load.running() == 1
    assert load.running() == 0
    with TrainingLoad(0) as none:
        assert none.running() == 0
    with pytest.raises(ValueError, match="n must be 0 or more"):
        TrainingLoad(-1)


def test_tune_takes_a_busy_count(capsys):
    from fastckpt.cli import main

    assert main(["tune", "--nvme_dir", "/nonexistent", "--busy", "-1"]) != 0
    assert "expected 0 or a positive integer" in capsys.readouterr().err
