"""A smoke run of benchmarks/bench_incremental.py: every mode saves and restores, and the
incremental ones write a fraction of what full saves write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "bench_incremental.py"


def test_bench_incremental_smoke(tmp_path):
    out_json = tmp_path / "out.json"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", f"--dir={tmp_path / 'run'}", f"--json={out_json}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    modes = json.loads(out_json.read_text())["incremental"]["modes"]
    assert sorted(modes) == ["frozen", "full", "hash", "versions"]
    for mode in ("hash", "versions", "frozen"):
        assert modes[mode]["median_bytes"] < modes["full"]["median_bytes"] / 4, mode
        assert modes[mode]["first_bytes"] == modes["full"]["first_bytes"]
        assert modes[mode]["restore_seconds"] > 0
    assert "full/restore" in out.stdout
