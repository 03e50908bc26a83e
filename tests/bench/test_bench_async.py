"""benchmarks/bench_async.py runs tiny: every mode's loop saves, and every file it writes
equals the state at its save call."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_async.py"

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_async", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# In this process: the modes that need no process group (the DCP ones are run below).
@pytest.mark.parametrize(
    "mode",
    [
        "none",
        "copy",
        "eager",
        "lazy",
        "lazy_capped",
        "lightning_fastckpt",
        pytest.param("lightning_async", marks=pytest.mark.slow),
    ],
)
def test_each_mode_saves_the_state_at_its_call(tmp_path, mode):
    spec = {
        "mode": mode,
        "setting": "fits",
        "params": 1 << 20,
        "width": 128,
        "dir": str(tmp_path),
        "steps": 4,
        "every": 2,
        "batch": 2,
        "fence_bytes": 0,
        "full_hash": True,
    }
    result = _bench().run_mode(spec)
    expected = 0 if mode == "none" else 2
    assert result["checkpoints"] == expected and len(result["at_call"]) == expected
    assert result["mismatched"] == []
    checked = min(expected, 1) if mode == "copy" else expected  # a copy keeps the last only
    assert result["checked"] == result["verified"] == checked
    assert result["loop"] > 0 and result["extra_rss"] >= 0


@pytest.mark.slow
def test_the_whole_matrix_runs_and_writes_json(tmp_path):
    out = tmp_path / "out.json"
    argv = [sys.executable, str(SCRIPT), "--params", "1M", "--width", "128", "--steps", "2"]
    argv += ["--every", "1", "--fit-batch", "2", "--nofit-batch", "1", "--full-hash"]
    argv += ["--dir", str(tmp_path / "work"), "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| lazy |" in done.stdout and "| dcp_thread |" in done.stdout
    report = json.loads(out.read_text())
    for setting in ("fits", "nofit"):
        rows = report["settings"][setting]["rows"]
        assert set(rows) == set(_bench().MODES), done.stderr[-2000:]
        for mode, row in rows.items():
            if mode not in ("none", "copy"):
                assert row["verified"] == "2/2" and not row["mismatched"], (setting, mode)
