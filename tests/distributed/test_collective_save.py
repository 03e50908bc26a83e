"""Asynchronous multi-rank saves of CheckpointManager (fastckpt.distributed.collective_save,
collective_load): real rank processes over gloo on loopback save sharded and replicated
DTensors; the saves return once captured, saves and loads reuse their plans while the
structure stays the same, each replicated tensor is written once, and a failing rank fails
the step on every rank (the step absent)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
from collective_ranks import COLS, DDP_SIZES, REPLICATED, ROWS, UNEVEN_ROWS, full

import fastckpt
from fastckpt.distributed.collective_save import CollectiveSaveError
from fastckpt.distributed.plan_cache import PlanCache
from fastckpt.series import steps as layout
from tests.python_processes import launch

RANKS = pathlib.Path(__file__).with_name("collective_ranks.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(
    case: str, root: pathlib.Path, world: int, nofile: int = 0, env: dict | None = None
) -> list[subprocess.Popen]:
    port = _free_port()
    return [
        launch(
            [sys.executable, str(RANKS), str(rank), str(world), str(port), case, str(root)]
            + ([str(nofile)] if nofile else []),
            env=None if env is None else {**os.environ, **env},
        )
        for rank in range(world)
    ]


def _run(case: str, root: pathlib.Path, world: int = 2, nofile: int = 0) -> list[str]:
    """Runs ``world`` ranks of collective_ranks.py; every rank's stdout (each must exit 0)."""
    children = _start(case, root, world, nofile)
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


@pytest.mark.parametrize(
    ("changer", "nofile"), [(0, 256), pytest.param(1, 0, marks=pytest.mark.slow)]
)
def test_a_structure_change_on_one_rank_saves_the_values_at_the_call(tmp_path, changer, nofile):
    # one rank gains a key at step 2, the other does not (it copies only its cached plan's
    # items), the plans are made again and give the replicated tensors to the other rank,
    # and every tensor changes right after save() returns (NOFILE: under 256 open files)
    outputs = _run(f"replan{changer}", tmp_path, nofile=nofile)
    failed = [out for out in outputs if "CollectiveSaveError" in out]
    if failed:  # refused on every rank, naming the rank and the key, and nothing committed
        assert len(failed) == 2 and "would write" in outputs[0] + outputs[1], outputs
        assert 2 not in layout.committed_steps(str(tmp_path))
        return
    for rank, out in enumerate(outputs):
        assert f"rank {rank}: every step holds the values at its call" in out, out
        assert f"rank {rank}: outcomes planned planned cached" in out, out
    assert layout.committed_steps(str(tmp_path)) == [1, 2, 3]


def test_a_rank_that_hangs_in_a_save_fails_the_others_after_the_group_timeout(tmp_path):
    children = _start("hang", tmp_path, 2, env={"FASTCKPT_GROUP_TIMEOUT": "5"})
    try:
        out, err = children[0].communicate(timeout=120)  # not torch's 30 minutes
    finally:
        children[1].kill()  # still asleep in its write
        children[1].communicate()
    assert children[0].returncode == 0, err[-4000:]
    line = next(x for x in out.splitlines() if x.startswith("rank 0: step 2 failed after"))
    assert float(line.split()[6]) < 60, line  # the group's 5 s, and slack for a busy machine
    assert "rank 0: steps [1]" in out


def _index(name: str):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(name, torch.Size([0]))


def test_an_item_not_captured_at_the_call_is_never_written_from_the_live_tensors(tmp_path):
    from fastckpt.dcp import FastCkptWriter, is_dcp_checkpoint
    from fastckpt.distributed.collective_save import save_collectively

    writer, cache = FastCkptWriter(tmp_path / "a"), PlanCache()
    state = {"w": torch.zeros(ROWS), "b": torch.ones(ROWS)}
    assert save_collectively(state, writer, cache) == "planned"
    # the cached plan is reused, but "b" was not copied at the call: refused, naming it
    writer.reset(str(tmp_path / "b"))
    with pytest.raises(CollectiveSaveError, match=r"rank 0 would write 'b' from the live"):
        save_collectively(state, writer, cache, captured={_index("w")})
    assert not is_dcp_checkpoint(str(tmp_path / "b")) and cache.hash is None
    # planned afresh, "b" is offered by no rank that copied it: refused too, nothing published
    writer.reset(str(tmp_path / "c"))
    with pytest.raises(CollectiveSaveError, match=r"rank 0: 'b' is saved by no rank"):
        save_collectively(state, writer, cache, captured={_index("w")})
    assert not is_dcp_checkpoint(str(tmp_path / "c"))
    writer.reset(str(tmp_path / "d"))
    captured = {_index("w"), _index("b")}
    assert save_collectively(state, writer, cache, captured=captured) == "planned"
    assert save_collectively(state, writer, cache, captured=captured) == "cached"
    writer.close()


def _bytes_per_name(step_dir: str, files: list[str]) -> dict[str, list[int]]:
    """Each stored name's base (a shard's ``@offset`` dropped) -> the bytes of every copy
    in the step's rank files, read from their headers."""
    found: dict[str, list[int]] = {}
    for name in files:
        if name.endswith(".safetensors"):
            with fastckpt.open(pathlib.Path(step_dir) / name) as reader:
                for key in reader.keys():
                    found.setdefault(key, []).append(reader.info(key).nbytes)
    return found


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_replicated_values_are_staged_and_written_once_from_the_first_save(tmp_path, world):
    outputs = _run("ddp", tmp_path, world=world)
    replicated = {f"ddp.p{i}" for i in range(len(DDP_SIZES))} | {"replicated.r", "step"}
    staged: list[str] = []
    for rank, out in enumerate(outputs):
        assert f"rank {rank}: ddp steps restored" in out, out
        assert f"rank {rank}: outcomes planned cached cached" in out, out
        line = next(x for x in out.splitlines() if x.startswith(f"rank {rank}: staged"))
        staged += line.split()[3:]
    # each replicated item copied at the first capture by one rank alone, spread over ranks
    assert sorted(staged) == sorted(replicated), outputs
    root = str(tmp_path / "steps")
    expected_tensors = {
        "model.w": ROWS * COLS * 4,
        "model.uneven": UNEVEN_ROWS * 8 * 4,
        "replicated.r": ROWS * COLS * 4,
        **{f"ddp.p{i}": n * 4 for i, n in enumerate(DDP_SIZES)},
    }
    for step in (1, 2, 3):  # the first step of the structure as every later one
        found = _bytes_per_name(layout.step_dir(root, step), layout.marker_of(root, step)["files"])
        copies = {k: v for k, v in found.items() if k.split("@")[0] in replicated}
        assert sorted(copies) == sorted(replicated) and all(len(v) == 1 for v in copies.values())
        written = sum(sum(v) for v in found.values())
        per_tensor: dict[str, int] = {}
        for key, sizes in found.items():
            per_tensor[key.split("@")[0]] = per_tensor.get(key.split("@")[0], 0) + sum(sizes)
        step_bytes = per_tensor.pop("step")
        assert per_tensor == expected_tensors, (step, per_tensor)
        assert written == sum(expected_tensors.values()) + step_bytes  # unique bytes, 1.00x
    # one process restores every step (another world size: every value whole)
    with fastckpt.CheckpointManager(root) as manager:
        for step in (1, 2, 3):
            got, state = manager.restore(step)
            assert got == step and state["step"] == step
            assert torch.equal(state["model"]["w"], full(step))
            assert torch.equal(state["replicated"]["r"], full(step, 9))
            uneven = torch.arange(UNEVEN_ROWS * 8, dtype=torch.float32).reshape(UNEVEN_ROWS, 8)
            assert torch.equal(state["model"]["uneven"], uneven + step)
            for i, n in enumerate(DDP_SIZES):
                assert torch.equal(state["ddp"][f"p{i}"], torch.full((n,), float(step * 10 + i)))


def test_ranks_holding_different_replicated_items_fall_back_to_copying_them_all(tmp_path):
    # rank 1 alone holds a large plain tensor and a list: the ranks would compute different
    # owners. The save's handshake carries each rank's digest of its replicated items, so
    # the first save already copies them all on every rank and every step is saved.
    outputs = _run("ddp-differ", tmp_path)
    for rank, out in enumerate(outputs):
        for step in (1, 2, 3):
            assert f"rank {rank}: step {step} saved" in out, out
        assert f"rank {rank}: outcomes planned cached cached\n" in out, out
        assert f"rank {rank}: saved steps [1, 2, 3] restored" in out, out
    assert layout.committed_steps(str(tmp_path)) == [1, 2, 3]
