"""benchmarks/bench_collective.py runs end to end at a tiny size (its timings are not checked;
its restores and bytes written are)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "bench_collective.py"


@pytest.mark.slow  # about 2 minutes on a busy 2-core machine: two worlds of ranks, five methods
def test_bench_collective_smoke(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--ranks",
            "2",
            "--per-rank",
            "32M",
            "--replicated",
            "1M",
            "--steps",
            "4",
            "--every",
            "2",
            "--compute-ms",
            "5",
            "--repeat",
            "1",
            "--folder",
            str(tmp_path),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])[0]
    assert row["world"] == 2 and row["other"] == 4
    methods = ["fastckpt-async", "fastckpt-lazy", "dcp-async"]
    if "torch-checkpointing" in row:
        methods.append("torch-checkpointing")
    else:
        assert "# skipping torch-checkpointing: " in done.stdout
    for method in methods:
        # every step restored on the same world, on 4 ranks (resharded) and on one process
        assert row[method]["restored"] == "2/2", method
        assert row[method]["restored_other"] == "2/2", method
    for method in ("fastckpt-async", "fastckpt-lazy"):
        assert row[method]["restored_world_1"] == "2/2"
        assert row[method]["bytes_first"] == row[method]["bytes_later"] == 1.0
    # the lazy save copies at the call only the plain tensors no optimizer owns: no DTensor
    assert row["fastckpt-lazy"]["call_copy_dtensors"] == 0
    assert 0 < row["fastckpt-lazy"]["call_copy"] <= 1 << 20
    assert "| fastckpt-lazy |" in done.stdout and "load average" in done.stdout
    assert list(tmp_path.iterdir()) == []  # its checkpoints removed
