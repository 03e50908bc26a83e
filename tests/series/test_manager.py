"""CheckpointManager on real directories: retention, the fast tier and its drain, restore
that falls back past damage, one manager per tier, and kill -9 during saves and drains."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fastckpt
from fastckpt.series import steps as layout


def _state(step: int, numel: int = 1024) -> dict:
    return {"w": torch.full((numel,), float(step)), "step": step}


def test_retention_keeps_the_last_every_nth_and_the_best(tmp_path):
    with fastckpt.CheckpointManager(
        tmp_path, keep_last=2, keep_every=30, best=("loss", "min", 1)
    ) as manager:
        for step in range(10, 110, 10):
            manager.save(step, _state(step), metrics={"loss": abs(step - 40) + 1.0})
        manager.wait()
        assert manager.steps() == [
            30,
            40,
            60,
            90,
            100,
        ]  # 90, 100 last; 30, 60, 90 every 30; 40 best
        assert manager.latest() == 100
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == [
        f"step-{s:012d}" for s in (30, 40, 60, 90, 100)
    ]


def test_a_fast_tier_drains_to_root_verified_and_keeps_few(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    with fastckpt.CheckpointManager(root, fast=fast, keep_last=3, keep_fast=1) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, _state(step, 1 << 16))
        manager.wait()
        assert layout.committed_steps(str(fast)) == [4]
        assert layout.committed_steps(str(root)) == [2, 3, 4]
        step, state = manager.restore()
    assert step == 4 and state["step"] == 4 and torch.equal(state["w"], _state(4, 1 << 16)["w"])
    with fastckpt.open(root / "step-000000000003" / layout.STATE_FILE) as reader:
        assert reader.verify() == []


def test_the_drain_keeps_to_its_bandwidth_cap(tmp_path):
    state = _state(1, 1 << 20)  # 4 MiB
    with fastckpt.CheckpointManager(
        tmp_path / "root", fast=tmp_path / "fast", drain_bytes_per_second=8 << 20
    ) as manager:
        started = time.monotonic()
        manager.save(1, state)
        manager.wait()
        assert time.monotonic() - started >= 0.45  # 4 MiB at 8 MiB/s
        assert manager.restore()[0] == 1


def test_restore_skips_damage_for_the_other_tier_then_older_steps(tmp_path, caplog):
    root, fast = tmp_path / "root", tmp_path / "fast"
    with fastckpt.CheckpointManager(root, fast=fast, keep_fast=2) as manager:
        for step in (1, 2):
            manager.save(step, _state(step, 1 << 16))
        manager.wait()

    def damage(tier, step):
        path = tier / f"step-{step:012d}" / layout.STATE_FILE
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 10)
            f.write(b"\xff" * 4)

    damage(fast, 2)
    caplog.set_level(logging.WARNING, logger="fastckpt")
    with fastckpt.CheckpointManager(root, fast=fast) as manager:
        assert manager.restore()[0] == 2  # root's copy of step 2
        damage(root, 2)
        step, state = manager.restore()
        assert step == 1 and state["step"] == 1
    assert "step 2 in" in caplog.text and "cannot be restored" in caplog.text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
@pytest.mark.parametrize("nice", [19, 7, None])
def test_the_drain_runs_at_its_own_low_cpu_priority(tmp_path, monkeypatch, nice):
    import threading

    from fastckpt.series import transfer

    seen = []
    real_copy = transfer.copy_file

    def observed_copy(*args, **kwargs):  # the real copy, noting its thread's priority
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(transfer, "copy_file", observed_copy)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with fastckpt.CheckpointManager(
        tmp_path / "root", fast=tmp_path / "fast", drain_nice=nice
    ) as manager:
        manager.save(1, _state(1))
        manager.wait()
        assert layout.committed_steps(str(tmp_path / "root")) == [1]
    assert seen == [before if nice is None else max(nice, before)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # the caller's thread is untouched
    for bad in (-1, 20, 1.5, True):
        with pytest.raises(ValueError, match="drain_nice"):
            fastckpt.CheckpointManager(tmp_path / "other", drain_nice=bad)


def test_the_fast_tier_writes_each_step_over_a_deleted_one_unless_it_is_being_read(tmp_path):
    fast = tmp_path / "fast"

    def inode(step):
        return os.stat(fast / f"step-{step:012d}" / layout.STATE_FILE).st_ino

    with fastckpt.CheckpointManager(tmp_path / "root", fast=fast, keep_fast=1) as manager:
        inodes = {}
        for step in (1, 2, 3):
            manager.save(step, _state(step, 1 << 16)).result()
            manager.wait()
            inodes[step] = inode(step)
        assert inodes[3] == inodes[1]  # step 1's file, deleted, became step 3's
        assert (fast / layout.SPARE_FILE).exists()  # step 2's, kept for step 4
        with open(fast / "step-000000000003" / layout.STATE_FILE, "rb") as reader:
            before = reader.read()
            manager.save(4, _state(4, 1 << 16)).result()  # over step 2's file
            manager.wait()
            assert inode(4) == inodes[2]
            manager.save(5, _state(5, 1 << 16)).result()  # a new file: step 3's is read
            manager.wait()
            reader.seek(0)
            held = reader.read()
        assert inode(5) not in inodes.values()
        assert held == before  # the reader's bytes never changed
        step, state = manager.restore()
        assert step == 5 and torch.equal(state["w"], _state(5, 1 << 16)["w"])
    assert not (fast / layout.SPARE_FILE).exists()  # close() gives its memory back


def test_one_manager_per_tier_and_clear_refusals(tmp_path):
    manager = fastckpt.CheckpointManager(tmp_path)
    with pytest.raises(RuntimeError, match="another CheckpointManager manages"):
        fastckpt.CheckpointManager(tmp_path)
    with pytest.raises(FileNotFoundError, match="no committed step"):
        manager.restore()
    manager.save(5, _state(5)).result()
    with pytest.raises(ValueError, match="step 5 is already saved"):
        manager.save(5, _state(5))
    with pytest.raises(ValueError, match="non-negative int"):
        manager.save(-1, _state(1))
    with pytest.raises(FileNotFoundError, match="no committed step 7"):
        manager.restore(7)
    manager.close()
    with pytest.raises(ValueError, match="closed"):
        manager.save(6, _state(6))
    with pytest.raises(ValueError, match="same directory"):
        fastckpt.CheckpointManager(tmp_path / "a", fast=tmp_path / "a")
    fastckpt.CheckpointManager(tmp_path).close()  # the lock went with close()


_KILLED_RUN = textwrap.dedent(
    """
    import os, signal, sys, torch, fastckpt
    root, fast, phase = sys.argv[1], sys.argv[2] or None, sys.argv[3]
    manager = fastckpt.CheckpointManager(root, fast=fast, drain_bytes_per_second=32 << 20)
    manager.save(1, {"w": torch.full((1 << 16,), 1.0)}).result()
    manager.wait()
    future = manager.save(2, {"w": torch.full((16 << 20,), 2.0)})  # 64 MiB
    if phase == "drain":
        future.result()  # committed in the fast tier; the drain runs at 32 MiB/s
    print("go", flush=True)
    signal.pause()
    """
)


@pytest.mark.parametrize("phase", ["save", "drain"])
def test_kill_9_never_loses_the_newest_durable_step_nor_returns_a_partial_one(tmp_path, phase):
    root, fast = tmp_path / "root", tmp_path / "fast"
    tiers = (str(root), str(fast) if phase == "drain" else "")
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_RUN, *tiers, phase], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "go"
    time.sleep(0.3)
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    with fastckpt.CheckpointManager(root, fast=fast if phase == "drain" else None) as manager:
        manager.wait()  # the next manager finishes an interrupted drain
        step, state = manager.restore()
        assert step in (1, 2)
        assert torch.equal(state["w"], torch.full_like(state["w"], float(step)))
        if phase == "drain":
            assert layout.committed_steps(str(root)) == [1, 2]
    for tier in (root, fast):
        if tier.exists():
            assert layout.uncommitted_dirs(str(tier)) == []


def test_a_lazy_fenced_save_through_the_manager_holds_the_call_time_state(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with fastckpt.CheckpointManager(tmp_path, fast=tmp_path / "fast") as manager:
        manager.save(1, {"model": model.state_dict()}, fence=optimizer)
        model(torch.randn(2, 256)).sum().backward()
        optimizer.step()  # waits on the fence, then changes every parameter
        manager.wait()
        step, state = manager.restore()
    assert step == 1
    assert all(torch.equal(state["model"][k], v) for k, v in expected.items())


def test_distributed_true_in_one_process_saves_dcp_steps_and_drains_them(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    with fastckpt.CheckpointManager(root, fast=fast, distributed=True, keep_last=1) as manager:
        for step in (1, 2):
            w = torch.full((4, 3), float(step))
            future = manager.save(step, {"w": w, "step": step})
            w += 100  # a DCP save returns once the state is captured: this is not saved
            assert future.result() is None  # committed in its first tier
        manager.wait()
    assert layout.committed_steps(str(root)) == [2]
    marker = layout.marker_of(str(root), 2)
    assert marker["layout"] == "dcp" and ".metadata" in marker["files"]
    with fastckpt.CheckpointManager(root) as manager:
        step, state = manager.restore()
        assert step == 2 and state["step"] == 2 and torch.equal(state["w"], torch.full((4, 3), 2.0))
        target = {"w": torch.zeros(4, 3), "step": 0}
        assert manager.restore(2, state=target)[1] is target and target["step"] == 2


@pytest.mark.parametrize("distributed", [None, True])
def test_a_dcp_step_missing_a_file_falls_back_and_raises_a_restore_error_naming_it(
    tmp_path, distributed
):
    with fastckpt.CheckpointManager(tmp_path, distributed=True) as manager:
        for step in (1, 2):
            manager.save(step, _state(step)).result()
    with fastckpt.CheckpointManager(tmp_path, distributed=distributed) as manager:
        # lost while the manager runs (one missing at its start would be set aside)
        (missing,) = (tmp_path / "step-000000000002").glob("*.safetensors")
        missing.unlink()
        step, state = manager.restore()  # state=None: every value, loaded in one process
        assert step == 1 and torch.equal(state["w"], _state(1)["w"])
        (other,) = (tmp_path / "step-000000000001").glob("*.safetensors")
        other.unlink()
        with pytest.raises(fastckpt.errors.RestoreError) as caught:
            manager.restore()
    assert isinstance(caught.value, FileNotFoundError)
    assert "step 2" in str(caught.value) and missing.name in str(caught.value)
    assert "step 1" in str(caught.value) and other.name in str(caught.value)
    assert caught.value.filename == str(missing)


def test_close_applies_keep_fast_once_the_last_drain_is_done(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    with fastckpt.CheckpointManager(root, fast=fast, keep_fast=1, keep_last=5) as manager:
        for step in range(1, 6):
            manager.save(step, _state(step))
    assert layout.committed_steps(str(fast)) == [5]
    assert layout.committed_steps(str(root)) == [1, 2, 3, 4, 5]


def test_a_drained_step_root_retired_first_is_not_kept_as_undrained(tmp_path):
    """A step kept in the fast tier for a while (as peers' replicas keep one) may be retired
    from root by root's retention first; once released, keep_fast still applies to it."""
    root, fast = tmp_path / "root", tmp_path / "fast"
    with fastckpt.CheckpointManager(root, fast=fast, keep_fast=1, keep_last=1) as manager:
        manager.save(1, _state(1)).result()
        manager.wait()
        manager._keep_replicated(1)  # held in both tiers, as the step peers hold
        for step in (2, 3):
            manager.save(step, _state(step)).result()
            manager.wait()
        assert layout.committed_steps(str(fast)) == [1, 3]
        manager._keep_replicated(3)  # released: root retires step 1 at its next retention
        manager.save(4, _state(4)).result()
        manager.wait()
        assert layout.committed_steps(str(root)) == [3, 4]
        manager._keep_replicated(4)
    assert layout.committed_steps(str(fast)) == [4]


def test_a_launched_rank_that_made_its_manager_before_the_group_is_told_what_to_do(
    tmp_path, monkeypatch
):
    """The relaunched rank of Lightning's DDP (or torchrun's) makes a manager at script level,
    before any process group exists, over a root that rank 0's manager holds: the error
    says why and names the recipe, not only that another manager holds the root."""
    with fastckpt.CheckpointManager(tmp_path / "root"):
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(RuntimeError, match="another CheckpointManager manages") as info:
            fastckpt.CheckpointManager(tmp_path / "root")
    message = str(info.value)
    assert "rank 1 of 2 launched processes" in message
    assert "init_process_group" in message and "functools.partial" in message
