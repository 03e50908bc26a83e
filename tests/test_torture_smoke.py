"""A small run of benchmarks/torture.py: the harness works and finds nothing bad."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.python_processes import run

TORTURE = Path(__file__).resolve().parent.parent / "benchmarks" / "torture.py"


def _torture(tmp_path: Path, *args: str, timeout: int = 300) -> str:
    """Runs benchmarks/torture.py with ``args`` in ``tmp_path``; its output, once it exited 0."""
    out = run(
        [sys.executable, str(TORTURE), *args, f"--dir={tmp_path}"],
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_torture_smoke(tmp_path):
    stdout = _torture(
        tmp_path,
        "--only=fuzz",
        "--only=frames",
        "--only=flips",
        "--cases=48",
        "--frame-cases=36",
        "--flips=24",
    )
    assert '"cases tried": 48' in stdout and '"cases tried": 36' in stdout
    assert stdout.count('"changed values undetected": 0') == 2
    assert "bad outcomes in total: 0" in stdout


def test_torture_smoke_fast_tier_readers(tmp_path):
    """A fast tier's files are reused as spares, never under a reader that maps them."""
    stdout = _torture(tmp_path, "--only=manager-readers")
    if '"skipped"' not in stdout:
        assert '"reads whose step changed under them": 0' in stdout
        assert '"files reused as spares": 0' not in stdout
    assert "bad outcomes in total: 0" in stdout


def test_torture_smoke_concurrent_savers_and_cold_readers(tmp_path):
    """Two processes save over one file while two read it cold (staged and direct reads):
    every load is one whole save's file."""
    stdout = _torture(tmp_path, "--only=concurrency", "--seconds=3")
    assert '"torn or mixed loads": 0' in stdout and '"temp files left": 0' in stdout
    assert '"good loads": 0' not in stdout
    assert "bad outcomes in total: 0" in stdout


def test_torture_full_disk(tmp_path):
    """Every saver (plain, eager and lazy async, a manager's step, a fast tier's step over its
    spare file) meets a full file system: each fails with ENOSPC, leaves nothing behind, and
    the managers' earlier steps restore."""
    stdout = _torture(tmp_path, "--only=enospc")
    if "cannot mount a small tmpfs" in stdout:
        pytest.skip("mounting a small tmpfs needs root")
    savers = ("save", "async_save", "async_save(lazy)", "manager.save")
    for saver in (*savers, "manager.save (fast tier, over its spare)"):
        assert f'"{saver}: ENOSPC": 1' in stdout, stdout
    assert '"manager: step restored after the failed step": 0' in stdout
    assert '"fast tier: a spare file before the big save": true' in stdout
    assert '"fast tier: step 3 restored after the failed step 4": true' in stdout
    assert "bad outcomes in total: 0" in stdout


@pytest.mark.slow
def test_torture_smoke_multi_file_sets(tmp_path):
    stdout = _torture(
        tmp_path,
        "--only=shard-kills",
        "--only=shard-concurrency",
        "--only=dcp-kills",
        "--only=planted-pickles",
        "--set-kills=3",
        "--seconds=2",
        timeout=600,
    )
    for count in ("mixed sets", "lost updates", "writes into other files"):
        assert f'"{count}": 0' in stdout
    assert '"pickles run without consent": 0' in stdout
    assert "bad outcomes in total: 0" in stdout


@pytest.mark.slow
def test_torture_smoke_lazy_saves_and_the_manager(tmp_path):
    stdout = _torture(
        tmp_path, "--only=kills", "--only=manager-kills", "--kills=6", "--set-kills=3", timeout=600
    )
    for count in (
        "checkpoints mixing two steps",
        "durable steps lost",
        "partial or mixed steps restored",
    ):
        assert f'"{count}": 0' in stdout
    assert "bad outcomes in total: 0" in stdout


def test_torture_smoke_mutations_under_kills(tmp_path):
    """Incremental and lazy steps of a run that changes its state every way torch does
    (fused AdamW, BatchNorm, .data, out=, a foreach EMA), killed at random: every committed
    step restores the bytes recorded at its save, and the next run resumes."""
    stdout = _torture(tmp_path, "--only=mutation-kills", "--set-kills=3")
    assert '"steps restored wrong": 0' in stdout
    assert '"steps checked": 0' not in stdout
    assert "bad outcomes in total: 0" in stdout


def test_torture_smoke_hostile_trees(tmp_path):
    """A series in trees others wrote into (markers naming ``../`` or absolute paths, linked
    step directories, hard links to step files, other scripts' digits, unreadable markers, a
    ``COMMITTED`` directory, a planter racing a live manager): nothing outside the tiers
    changes, no committed step is lost, no unreadable marker is deleted."""
    stdout = _torture(tmp_path, "--only=hostile-trees", "--tree-rounds=1")
    assert '"hostile cases": 9' in stdout
    for figure in (
        "escapes outside the tiers",
        "committed steps lost",
        "unreadable markers deleted",
        "manager errors",
    ):
        assert f'"{figure}": 0' in stdout, stdout
    assert "bad outcomes in total: 0" in stdout


@pytest.mark.slow
def test_torture_smoke_collective_kills(tmp_path):
    """Asynchronous multi-rank saves (3 gloo ranks, sharded, replicated and lazy) with one
    rank killed at a random moment: no committed step restores other bytes or is lost, and
    the next run resumes from the newest committed step."""
    stdout = _torture(tmp_path, "--only=collective-kills", "--collective-kills=2", timeout=600)
    assert '"kills": 2' in stdout and '"steps checked": 0' not in stdout
    assert "bad outcomes in total: 0" in stdout


@pytest.mark.slow
def test_torture_smoke_node_kills(tmp_path):
    """A simulated node (2 of 4 ranks) lost at a random point of a run with replicas=1: the
    next run restores on every rank the newest step that survives anywhere, bit-identical."""
    stdout = _torture(tmp_path, "--only=node-kills", "--node-rounds=1")
    for figure in (
        "committed steps lost while a copy survived",
        "states not the saved one",
        "restores failed while a step survived",
        "ranks disagreeing on the step",
    ):
        assert f'"{figure}": 0' in stdout, stdout
    assert '"steps committed on every rank before the kills": 0' not in stdout
    assert "bad outcomes in total: 0" in stdout


RANKS = TORTURE.parent / "torture_ranks.py"


def test_torture_smoke_adversarial_ranks(tmp_path):
    """A save called on rank 0 alone, and tiers planted with links and a marker at a high
    step: nothing silently wrong, nothing hung, nothing outside the tiers touched (the whole
    part, every scenario, is the slow test below)."""
    out = run(
        [
            sys.executable,
            str(RANKS),
            "--only=subset-save",
            "--only=planted-links-and-markers",
            f"--dir={tmp_path}",
        ],
        timeout=400,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for count in ("silent wrong states", "ranks alone", "hangs", "outside files changed"):
        assert f'"{count}": 0' in out.stdout, out.stdout


@pytest.mark.slow
def test_torture_adversarial_ranks_every_scenario(tmp_path):
    stdout = _torture(tmp_path, "--only=adversarial-ranks", timeout=900)
    assert "bad outcomes in total: 0" in stdout
