"""A smoke run of benchmarks/bench_incremental.py: every mode saves and restores, on the local
disk and at an S3 server on loopback, and the incremental ones write (upload) a fraction of
what full saves write."""

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
    results = json.loads(out_json.read_text())
    parts = ["incremental"] + (["s3"] if "skipped" not in results["s3"] else [])
    for part in parts:
        modes = results[part]["modes"]
        assert sorted(modes) == ["frozen", "full", "hash", "versions"]
        for mode in ("hash", "versions", "frozen"):
            assert modes[mode]["median_bytes"] < modes["full"]["median_bytes"] / 4, (part, mode)
            assert modes[mode]["first_bytes"] == modes["full"]["first_bytes"]
            assert modes[mode]["restore_seconds"] > 0
    assert "full/restore" in out.stdout
    assert ("uploaded/ckpt" in out.stdout) == ("s3" in parts)
