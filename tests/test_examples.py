"""Every example runs and says what it should."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    "script, expected",
    [
        ("quickstart.py", ["epoch 1", "checksums intact: True", "kept the old weights: True"]),
        ("deepnvme.py", ["completed writes: 4", "completed reads: 4", "identical: True"]),
        (
            "partial_reads.py",
            [
                "rows identical: True",
                "read 4 MiB of 32 MiB",
                "row identical: True",
                "undamaged piece still reads: True",
                "damaged piece refused: True",
            ],
        ),
        (
            "dcp_resharding.py",
            [
                "2 ranks resharded step 100: identical: True",
                "one process loaded step 100: identical: True",
            ],
        ),
        (
            "remote_and_shards.py",
            ["identical: True", "3 shards + model.safetensors.index.json", "round trip: True"],
        ),
        (
            "damaged_files.py",
            [
                "damaged header refused: True",
                "verify says: DAMAGED",
                "stale temporary removed: True",
                "torch.save file recognised: True",
            ],
        ),
    ],
)
def test_example_runs(tmp_path, script, expected):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,  # the DCP example starts process groups, slow on a busy 2-core machine
    )
    assert out.returncode == 0, out.stderr
    for line in expected:
        assert line in out.stdout


def test_lightning_example_trains_and_resumes(tmp_path):
    pytest.importorskip("lightning")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_train.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "last.ckpt: epoch 1, global step 8" in out.stdout
    assert "resumed to epoch 3, global step 12" in out.stdout
    assert "'last.ckpt'" in out.stdout


@pytest.mark.parametrize("script", ["partial_reads.py", "damaged_files.py"])
def test_example_without_a_folder_leaves_nothing_behind(tmp_path, script):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert list(scratch.iterdir()) == []
