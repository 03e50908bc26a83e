"""Every example runs and says what it should."""

from __future__ import annotations

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
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for line in expected:
        assert line in out.stdout
