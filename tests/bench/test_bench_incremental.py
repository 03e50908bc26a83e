"""A smoke run of benchmarks/bench_incremental.py: every mode saves and restores, on the local
disk and at an S3 server on loopback, and the incremental ones write (upload) a fraction of
what full saves write."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.python_processes import run

BENCH = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "bench_incremental.py"


def _smoke(tmp_path: Path, part: str) -> tuple[dict, str]:
    out_json = tmp_path / "out.json"
    out = run(
        [
            sys.executable,
            str(BENCH),
            "--smoke",
            f"--parts={part}",
            f"--dir={tmp_path / 'run'}",
            f"--json={out_json}",
        ],
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out_json.read_text())[part], out.stdout


def _check_modes(results: dict) -> None:
    modes = results["modes"]
    assert sorted(modes) == ["compressed", "default", "frozen", "full", "hash"]
    for mode in ("hash", "default", "frozen", "compressed"):
        assert modes[mode]["median_bytes"] < modes["full"]["median_bytes"] / 4, mode
        assert modes[mode]["restore_seconds"] > 0
    for mode in ("hash", "default", "frozen"):
        assert modes[mode]["first_bytes"] == modes["full"]["first_bytes"]
    # the changed tensors (random Adam moments) are stored compressed, never larger
    assert modes["compressed"]["median_bytes"] <= modes["default"]["median_bytes"]


def test_bench_incremental_smoke(tmp_path):
    results, stdout = _smoke(tmp_path, "incremental")
    _check_modes(results)
    assert "full/restore" in stdout


@pytest.mark.slow  # about 15 s: a moto server in its own process, four series of saves
def test_bench_incremental_s3_smoke(tmp_path):
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    results, stdout = _smoke(tmp_path, "s3")
    _check_modes(results)
    assert "uploaded/ckpt" in stdout
