"""benchmarks/bench_memory.py beside a training-like load: each regime measured quiet and
busy, every load's record saying which pass it ran in and whether the machine looked busy,
the tables saying so with the load averages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_memory.py")


@pytest.mark.slow
def test_each_regime_is_measured_quiet_and_beside_busy_processes(tmp_path):
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm here")
    out = tmp_path / "raw.json"
    args = ["--size", "4M", "--repeats", "1", "--regime", "tmpfs", "--busy", "0,1"]
    args += ["--loads", "fastckpt,preadv", "--saves", "none", "--no-streams", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, FASTCKPT_NO_PROGRESS="1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "### tmpfs: load" in done.stdout and "(quiet); load average" in done.stdout
    assert "### tmpfs, busy 1: load" in done.stdout and "beside 1 busy processes" in done.stdout
    assert "load average (1, 5, 15 min) at the start" in done.stdout
    runs = json.loads(out.read_text())["runs"]
    assert {(r["busy"], r["method"]) for r in runs} == {
        (0, "fastckpt"),
        (0, "preadv"),
        (1, "fastckpt"),
        (1, "preadv"),
    }
    assert all(r["machine_busy"] in (True, False) and not r["wrong"] for r in runs)
