"""Asynchronous multi-rank saves of CheckpointManager (fastckpt.distributed.collective_save,
collective_load): real rank processes over gloo on loopback save sharded and replicated
DTensors; the saves return once captured, saves and loads reuse their plans while the
structure stays the same, each replicated tensor is written once, and a failing rank fails
the step on every rank (the step absent)."""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys

import torch
from collective_ranks import REPLICATED, ROWS, full

import fastckpt
from fastckpt.distributed.collective_save import CollectiveSaveError
from fastckpt.distributed.plan_cache import PlanCache
from fastckpt.series import steps as layout

RANKS = pathlib.Path(__file__).with_name("collective_ranks.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(case: str, root: pathlib.Path, world: int = 2) -> list[str]:
    """Runs ``world`` ranks of collective_ranks.py; every rank's stdout (each must exit 0)."""
    port = _free_port()
    children = [
        subprocess.Popen(
            [sys.executable, str(RANKS), str(rank), str(world), str(port), case, str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [child.communicate(timeout=240) for child in children]
    for child, (_, err) in zip(children, outputs):
        assert child.returncode == 0, err[-4000:]
    return [out for out, _ in outputs]


def test_saves_return_at_capture_reuse_plans_and_restore_every_step(tmp_path):
    outputs = _run("async", tmp_path, world=3)
    for rank, out in enumerate(outputs):
        assert f"rank {rank}: restored every step" in out
        # steps 1-4 share a structure, 5-6 another: planned at 1 and 5, cached otherwise
        assert f"rank {rank}: outcomes planned cached cached cached planned cached" in out
        # and so do the loads of those steps (each step's own .metadata read every time)
        assert f"rank {rank}: load outcomes planned cached cached cached planned cached" in out
    assert layout.committed_steps(str(tmp_path)) == [1, 2, 3, 4, 5, 6]
    # every replicated tensor is in exactly one rank file, spread over the ranks
    holders: dict[str, list[str]] = {}
    step = layout.step_dir(str(tmp_path), 6)
    for name in layout.marker_of(str(tmp_path), 6)["files"]:
        if name.endswith(".safetensors"):
            with fastckpt.open(pathlib.Path(step) / name) as reader:
                for key in reader.keys():
                    if key.startswith("replicated."):
                        holders.setdefault(key, []).append(name)
    assert sorted(holders) == [f"replicated.r{i}" for i in range(REPLICATED)]
    assert all(len(files) == 1 for files in holders.values()), holders
    assert len({files[0] for files in holders.values()}) >= 2  # balanced, not all on rank 0
    # a different world size restores it (this process alone, every value whole)
    with fastckpt.CheckpointManager(tmp_path) as manager:
        got, state = manager.restore(4)
        assert got == 4 and torch.equal(state["model"]["w"], full(4))
        assert torch.equal(state["replicated"]["r2"], full(4, 200))


def test_lazy_saves_hold_the_values_at_the_call(tmp_path):
    outputs = _run("lazy", tmp_path)
    assert all(f"rank {r}: lazy steps restored" in out for r, out in enumerate(outputs))


def test_a_rank_that_fails_fails_the_step_on_every_rank(tmp_path):
    outputs = _run("fail", tmp_path)
    # rank 1's own error, and rank 0 told which rank failed
    assert "rank 1: step 3 future: " in outputs[1] and "CollectiveSaveError" not in outputs[1]
    assert "rank 0: step 3 future: CollectiveSaveError: rank 1 failed" in outputs[0]
    for rank, out in enumerate(outputs):  # surfaced at the next call on every rank
        assert f"rank {rank}: step 4 raised" in out
        assert f"rank {rank}: steps [1, 2, 4]" in out
    assert layout.committed_steps(str(tmp_path)) == [1, 2, 4]


def test_a_failed_save_in_one_process_publishes_nothing_and_forgets_its_plans(tmp_path):
    from fastckpt.dcp import FastCkptWriter, is_dcp_checkpoint
    from fastckpt.distributed.collective_save import save_collectively

    writer, cache = FastCkptWriter(tmp_path / "a"), PlanCache()
    assert save_collectively({"w": torch.zeros(ROWS)}, writer, cache) == "planned"

    def refuse() -> None:
        raise OSError(28, "no space left", str(tmp_path / "b"))

    writer.reset(str(tmp_path / "b"))
    try:
        save_collectively({"w": torch.ones(ROWS)}, writer, cache, commit=refuse)
        raise AssertionError("the commit's failure was not raised")
    except OSError as exc:
        assert exc.errno == 28
    assert cache.hash is None  # the next save plans afresh
    writer.reset(str(tmp_path / "c"))
    assert save_collectively({"w": torch.ones(ROWS)}, writer, cache) == "planned"
    assert is_dcp_checkpoint(str(tmp_path / "c"))
    assert CollectiveSaveError.__mro__[1] is fastckpt.FastCkptError


def test_stateful_values_are_saved_and_loaded_through_their_state_dicts(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with fastckpt.CheckpointManager(tmp_path, distributed=True) as manager:
        manager.save(1, {"model": model, "step": 1}).result()
        fresh = torch.nn.Linear(3, 2)
        target = {"model": fresh, "step": 0}
        assert manager.restore(1, state=target)[0] == 1
    assert target["step"] == 1 and torch.equal(fresh.weight, model.weight)
