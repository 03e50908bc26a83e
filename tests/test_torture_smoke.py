"""A small run of benchmarks/torture.py: the harness works and finds nothing bad."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TORTURE = Path(__file__).resolve().parent.parent / "benchmarks" / "torture.py"


def test_torture_smoke(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(TORTURE),
            "--only=fuzz",
            "--only=flips",
            "--cases=48",
            "--flips=24",
            f"--dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert '"cases tried": 48' in out.stdout and '"changed values undetected": 0' in out.stdout
    assert "bad outcomes in total: 0" in out.stdout
