"""A small run of benchmarks/torture.py: the harness works and finds nothing bad."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TORTURE = Path(__file__).resolve().parent.parent / "benchmarks" / "torture.py"


def test_torture_smoke(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(TORTURE),
            "--only=fuzz",
            "--only=frames",
            "--only=flips",
            "--cases=48",
            "--frame-cases=36",
            "--flips=24",
            f"--dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert '"cases tried": 48' in out.stdout and '"cases tried": 36' in out.stdout
    assert out.stdout.count('"changed values undetected": 0') == 2
    assert "bad outcomes in total: 0" in out.stdout


def test_torture_smoke_fast_tier_readers(tmp_path):
    """A fast tier's files are reused as spares, never under a reader that maps them."""
    out = subprocess.run(
        [sys.executable, str(TORTURE), "--only=manager-readers", f"--dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    if '"skipped"' not in out.stdout:
        assert '"reads whose step changed under them": 0' in out.stdout
        assert '"files reused as spares": 0' not in out.stdout
    assert "bad outcomes in total: 0" in out.stdout


def test_torture_full_disk(tmp_path):
    """Every saver (plain, eager and lazy async, a manager's step, a fast tier's step over its
    spare file) meets a full file system: each fails with ENOSPC, leaves nothing behind, and
    the managers' earlier steps restore."""
    out = subprocess.run(
        [sys.executable, str(TORTURE), "--only=enospc", f"--dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    if "cannot mount a small tmpfs" in out.stdout:
        pytest.skip("mounting a small tmpfs needs root")
    savers = ("save", "async_save", "async_save(lazy)", "manager.save")
    for saver in (*savers, "manager.save (fast tier, over its spare)"):
        assert f'"{saver}: ENOSPC": 1' in out.stdout, out.stdout
    assert '"manager: step restored after the failed step": 0' in out.stdout
    assert '"fast tier: a spare file before the big save": true' in out.stdout
    assert '"fast tier: step 3 restored after the failed step 4": true' in out.stdout
    assert "bad outcomes in total: 0" in out.stdout


@pytest.mark.slow
def test_torture_smoke_multi_file_sets(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(TORTURE),
            "--only=shard-kills",
            "--only=shard-concurrency",
            "--only=dcp-kills",
            "--only=planted-pickles",
            "--set-kills=3",
            "--seconds=2",
            f"--dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for count in ("mixed sets", "lost updates", "writes into other files"):
        assert f'"{count}": 0' in out.stdout
    assert '"pickles run without consent": 0' in out.stdout
    assert "bad outcomes in total: 0" in out.stdout


@pytest.mark.slow
def test_torture_smoke_lazy_saves_and_the_manager(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(TORTURE),
            "--only=kills",
            "--only=manager-kills",
            "--kills=6",
            "--set-kills=3",
            f"--dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for count in (
        "checkpoints mixing two steps",
        "durable steps lost",
        "partial or mixed steps restored",
    ):
        assert f'"{count}": 0' in out.stdout
    assert "bad outcomes in total: 0" in out.stdout
