"""CheckpointManager in a multi-rank run: 2 real processes (gloo on loopback) save sharded
state (DTensors) through DCP, to local tiers and (slow) to an S3 root (moto's server in
this process), restore it on 2 ranks, and one is killed before rank 0 may commit a step; this
process then restores on 1 rank, resharded."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import sys

import pytest
import torch
from manager_ranks import COLS, ROWS, full

import fastckpt
from fastckpt.integrations.dcp import METADATA_FILE
from fastckpt.series import steps as layout
from tests.python_processes import launch

RANKS = pathlib.Path(__file__).with_name("manager_ranks.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(*args: str, nodes: bool = False) -> tuple[list[int], list[tuple[str, str]]]:
    """Runs 2 ranks of manager_ranks.py (with ``nodes``, each as a node of its own); their
    exit codes and (stdout, stderr)."""
    port = _free_port()
    children = [
        launch(
            [sys.executable, str(RANKS), str(rank), "2", str(port), *args],
            env={**os.environ, "FASTCKPT_NODE": str(rank)} if nodes else None,
        )
        for rank in (0, 1)
    ]
    outputs = [child.communicate(timeout=180) for child in children]
    return [child.returncode for child in children], outputs


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """2 ranks: steps 1 and 2 saved and restored; step 3 cut short by rank 1's death."""
    base = tmp_path_factory.mktemp("ranks")
    root, fast = base / "root", base / "fast"
    codes, outputs = _run_ranks("local", str(root), str(fast))
    return root, fast, codes, outputs


def test_two_ranks_save_sharded_steps_and_restore_them_on_two(two_rank_run):
    root, fast, codes, outputs = two_rank_run
    assert codes[0] == 0, outputs[0][1]
    assert "rank 0 restored 2" in outputs[0][0] and "rank 1 restored 2" in outputs[1][0]
    assert layout.committed_steps(str(root)) == [1, 2]
    assert layout.committed_steps(str(fast)) == [2]
    marker = layout.marker_of(str(root), 2)
    assert marker["layout"] == "dcp"
    files = sorted(marker["files"])
    assert files[0] == METADATA_FILE and len(files) == 3  # one fastckpt file per rank
    for name in files[1:]:
        with fastckpt.open(root / "step-000000000002" / name) as reader:
            assert reader.has_checksums and reader.verify() == []


def test_a_rank_killed_before_the_marker_leaves_no_step(two_rank_run):
    root, fast, codes, outputs = two_rank_run
    assert codes[1] == -9  # rank 1 was killed
    assert "rank 0 save 3 failed" in outputs[0][0]
    # every rank's file is there (rank 1 died once its own was durable), but rank 0 never
    # heard from rank 1: neither .metadata nor the marker were written, the step does not exist
    files = os.listdir(fast / "step-000000000003")
    assert len([f for f in files if f.endswith(".safetensors")]) == 2, files
    assert METADATA_FILE not in files
    assert layout.committed_steps(str(fast)) == [2] and layout.uncommitted_steps(str(fast)) == [3]
    with fastckpt.CheckpointManager(root, fast=fast) as manager:
        assert manager.steps() == [1, 2] and layout.uncommitted_steps(str(fast)) == []


def test_one_rank_restores_a_two_rank_step_resharded(two_rank_run):
    root, fast, _, _ = two_rank_run
    with fastckpt.CheckpointManager(root, fast=fast) as manager:
        step, state = manager.restore()  # every value, as full tensors
        assert step == 2 and state["step"] == 2 and torch.equal(state["model"]["w"], full(2))
        target = {"model": {"w": torch.zeros(ROWS, COLS)}, "step": 0}
        step, state = manager.restore(1, state=target)
        assert step == 1 and state is target and torch.equal(target["model"]["w"], full(1))


@pytest.mark.slow
def test_two_ranks_save_to_an_s3_root_and_one_restores_it(s3):
    bucket, options, _ = s3
    root = f"{bucket}/run"
    codes, outputs = _run_ranks("url", root, json.dumps(options))
    assert codes == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert all(f"rank {r} restored 5 from {root}" in outputs[r][0] for r in (0, 1))
    tier = layout.Tier(root, options)
    assert layout.committed_steps(tier) == [5]
    assert sorted(layout.marker_of(tier, 5)["files"])[0] == METADATA_FILE
    with fastckpt.CheckpointManager(root, storage_options=options) as manager:
        target = {"model": {"w": torch.zeros(ROWS, COLS)}, "step": 0}
        step, state = manager.restore(state=target)
        assert step == 5 and state["step"] == 5 and torch.equal(target["model"]["w"], full(5))


def test_ranks_whose_roots_are_not_one_directory_are_refused_on_every_rank(tmp_path):
    codes, outputs = _run_ranks("split", str(tmp_path))
    assert codes == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    for rank in (0, 1):
        out = outputs[rank][0]
        assert f"rank {rank} refused" in out, out
        assert f"rank 1 has {tmp_path / 'root-1'}" in out and str(tmp_path / "root-0") in out
        assert "shared file system" in out and "replicas=" in out
    assert layout.committed_steps(str(tmp_path / "root-0")) == []
    assert sorted(os.listdir(tmp_path / "root-0")) == []  # the token file is gone


def test_every_rank_lists_the_same_steps_after_wait_and_restore_needs_state(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    codes, outputs = _run_ranks("same", str(root), str(fast))
    assert codes == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    for rank in (0, 1):
        out = outputs[rank][0]
        assert f"rank {rank} steps [4, 5]" in out, out
        assert (
            f"rank {rank} restore refused: restore() in a process group of 2 ranks needs state="
            in out
        )
        assert f"rank {rank} restored 5" in out


def test_ranks_saving_at_their_own_pace_keep_a_step_every_rank_can_restore(tmp_path):
    codes, outputs = _run_ranks("replicas", str(tmp_path), nodes=True)
    assert codes == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    restored = []
    for rank in (0, 1):
        out = outputs[rank][0]
        # close() applies keep_fast=1 once the last step is drained and replicated
        assert f"rank {rank} fast after close [4]" in out, out
        (line,) = [x for x in out.splitlines() if x.startswith(f"rank {rank} restore")]
        assert line.endswith("intact"), line  # not "no step is available to every rank"
        restored.append(line.split()[3])
    assert restored[0] == restored[1]
