"""The small-state, engine-against-fio and per-core benchmarks run tiny and print what they
promise: every method and ratio (small states), every step beside fio (engine), every cost
and the projection (per core). Figures are not checked: they are the benchmarks' job."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.python_processes import run as run_python

ROOT = Path(__file__).resolve().parent.parent.parent


def run(script: str, *args: str) -> str:
    done = run_python(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        timeout=300,
        env=dict(os.environ, FASTCKPT_NO_PROGRESS="1"),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_small_states(tmp_path):
    out = run("bench_small_states.py", "--dir", str(tmp_path), "--rounds", "1", "--calls", "1")
    for size in ("64 KiB", "1 MiB", "16 MiB"):
        for op in ("save", "load", "load+touch"):
            assert f"| {size} | {op} |" in out
    assert "interleaved rounds" in out and "commit" in out
    assert os.listdir(tmp_path) == []


def test_engine_against_fio(tmp_path):
    out = run("bench_engine_ceiling.py", "--dir", str(tmp_path), "--size", "8M", "--rounds", "1")
    for step in ("raw engine write", "fastckpt.save, O_DIRECT", "fastckpt.load, mapped"):
        assert f"| {step}" in out
    assert os.listdir(tmp_path) == []


def test_per_core_costs():
    out = run("bench_per_core.py", "--size", "8M", "--repeats", "1")
    for step in ("CRC32C", "XXH3-128", "copy + CRC32C, one pass", "page-cache read"):
        assert f"| {step} |" in out
    assert "cores busy" in out


@pytest.mark.slow
def test_ab_builds_both_commits_and_prints_every_case(tmp_path):
    out = run(
        "bench_ab.py", "HEAD", "HEAD", "--rounds", "1", "--size", "8M", "--dir", str(tmp_path)
    )
    for case in ("tmpfs-save", "tmpfs-load", "hot-load", "mmap-load"):
        assert f"| {case} |" in out
    assert list(tmp_path.iterdir()) == []  # its files are gone
