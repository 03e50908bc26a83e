"""benchmarks/bench_manager.py runs end to end at a tiny size (its figures are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "bench_manager.py"


@pytest.mark.slow  # about 20 s on a busy 2-core machine: a child process imports torch
def test_bench_manager_smoke(tmp_path):
    out_json = tmp_path / "out.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--size",
            "4M",
            "--steps",
            "2",
            "--every",
            "1",
            "--matmul",
            "64",
            "--modes",
            "manager_fast_disk",
            "--dir",
            str(tmp_path / "work"),
            "--json",
            str(out_json),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "| manager_fast_disk |" in done.stdout
    assert "restore from fast" in done.stdout
    row = json.loads(out_json.read_text())["rows"]["manager_fast_disk"]
    assert len(row["blocked"]) == 2 and len(row["durable"]) == 2
    assert all(d >= b for d, b in zip(row["durable"], row["blocked"]))
    assert {"restore_fast", "load_fast", "restore_root", "load_root"} <= set(row)


def test_bench_manager_refuses_an_unknown_mode():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--modes", "nope"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "unknown modes" in done.stderr
