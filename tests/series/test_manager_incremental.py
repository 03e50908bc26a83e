"""CheckpointManager with incremental steps on real directories: small files for unchanged
tensors, retention that keeps the bases kept steps need (and only while they need them),
drains whose references resolve in root, restore that falls back past a missing base, and a
damaged step moved out of the series so its step number can be saved again."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fastckpt
from fastckpt.checkpoint.incremental import dependencies
from fastckpt.checkpoint.read import CheckpointReader
from fastckpt.cli import main as cli
from fastckpt.series import steps as layout

_FROZEN = 1 << 18  # 1 MiB of float32 that never changes


def _state(step: int) -> dict:
    frozen = torch.arange(_FROZEN, dtype=torch.float32)
    return {"frozen": frozen, "w": torch.full((64,), float(step)), "step": step}


def _equal(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a[k], b[k]) for k in ("frozen", "w"))


def _state_file(tier, step: int) -> str:
    return os.path.join(layout.step_dir(str(tier), step), layout.STATE_FILE)


def _damage(path: str, tensor: str) -> None:
    """Flips bytes inside ``tensor``'s data, leaving the header intact."""
    with CheckpointReader(path) as reader:  # the file alone, not its bases
        entry = reader.header.entries[tensor]
        offset = reader.header.data_offset + entry.begin
    with open(path, "r+b") as f:
        f.seek(offset + 8)
        f.write(b"\xff" * 4)


def test_an_incremental_run_writes_small_steps_that_restore_whole(tmp_path):
    with fastckpt.CheckpointManager(
        tmp_path, keep_last=None, incremental=True, full_every=5
    ) as manager:
        for step in range(1, 13):
            manager.save(step, _state(step))
        manager.wait()
        assert manager.steps() == list(range(1, 13))
        for step in range(1, 13):
            restored, state = manager.restore(step)
            assert restored == step and _equal(state, _state(step))
    sizes = {s: os.path.getsize(_state_file(tmp_path, s)) for s in range(1, 13)}
    full = [1, 6, 11]  # a chain is a full step and 4 incremental ones
    for step in range(1, 13):
        marker = layout.marker_of(str(tmp_path), step)
        if step in full:
            assert "depends_on" not in marker and sizes[step] > _FROZEN * 4
        else:
            first = max(f for f in full if f < step)
            assert marker["depends_on"] == [first] and marker["since_full"] == step - first
            assert sizes[step] * 50 < sizes[first]  # the frozen MiB is referred to
            assert dependencies(_state_file(tmp_path, step)) == [_state_file(tmp_path, first)]


def test_save_incremental_per_step_and_refusals(tmp_path):
    with fastckpt.CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(1, _state(1)).result()
        manager.save(2, _state(2), incremental=True).result()
        manager.save(3, _state(3)).result()  # the manager's default: full
        with pytest.raises(ValueError, match="chooses base="):
            manager.save(4, _state(4), base=_state_file(tmp_path, 1))
        manager.save(4, _state(4), incremental=True, frozen={"frozen"}).result()
        assert _equal(manager.restore(4)[1], _state(4))
    assert layout.marker_of(str(tmp_path), 2)["depends_on"] == [1]
    assert "depends_on" not in layout.marker_of(str(tmp_path), 3)
    assert layout.marker_of(str(tmp_path), 4)["depends_on"] == [3]
    with pytest.raises(ValueError, match="full_every"):
        fastckpt.CheckpointManager(tmp_path / "other", full_every=0)


def test_lazy_fenced_incremental_saves_hold_the_call_time_state(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    frozen = torch.arange(_FROZEN, dtype=torch.float32)
    with fastckpt.CheckpointManager(tmp_path, keep_last=None, incremental=True) as manager:
        for step in (1, 2, 3):
            expected = {k: v.clone() for k, v in model.state_dict().items()}
            manager.save(step, {"model": model.state_dict(), "frozen": frozen}, fence=optimizer)
            model(torch.randn(2, 64)).sum().backward()
            optimizer.step()  # waits on the fence, then changes every parameter
            manager.wait()
            state = manager.restore(step)[1]
            assert all(torch.equal(state["model"][k], v) for k, v in expected.items())
            assert torch.equal(state["frozen"], frozen)
    assert layout.marker_of(str(tmp_path), 3)["depends_on"] == [1]


def test_retention_keeps_a_base_while_a_kept_step_needs_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fastckpt")
    with fastckpt.CheckpointManager(
        tmp_path, keep_last=2, incremental=True, full_every=4
    ) as manager:
        kept = {}
        for step in range(1, 10):
            manager.save(step, _state(step)).result()
            kept[step] = manager.steps()
        for step in manager.steps():
            assert _equal(manager.restore(step)[1], _state(step))
    # full steps 1, 5, 9; 2-4 need 1, 6-8 need 5
    assert kept[2] == [1, 2]
    assert kept[3] == [1, 2, 3]  # 1 only for 2 and 3
    assert kept[4] == [1, 3, 4]
    assert kept[5] == [1, 4, 5]  # 4 still needs 1
    assert kept[6] == [5, 6]  # 1 went once no kept step needed it
    assert kept[8] == [5, 7, 8] and kept[9] == [5, 8, 9]
    assert "keeping step 1 in" in caplog.text and "only because steps [2, 3] depend" in caplog.text


def test_retention_deletes_newest_first_so_a_crash_never_orphans_a_step(tmp_path, monkeypatch):
    with fastckpt.CheckpointManager(
        tmp_path, keep_last=None, incremental=True, full_every=3
    ) as manager:
        for step in range(1, 8):
            manager.save(step, _state(step))
    removed = []
    real_remove = layout.remove_step

    def recording(tier, step, **options):
        # at every deletion, each remaining committed step still has its bases
        for kept in layout.committed_steps(tier):
            dependencies(_state_file(tier, kept))
        removed.append(step)
        real_remove(tier, step, **options)

    monkeypatch.setattr(layout, "remove_step", recording)
    with fastckpt.CheckpointManager(tmp_path, keep_last=1, incremental=True) as manager:
        manager.save(8, _state(8)).result()  # full steps 1, 4, 7; 8 needs 7 only
    assert removed == [8, 6, 5, 4, 3, 2, 1]  # 8: the save clears its directory first


def test_a_drained_series_restores_from_root_after_the_fast_tier_is_wiped(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    with fastckpt.CheckpointManager(
        root, fast=fast, keep_last=3, keep_fast=1, incremental=True, full_every=4
    ) as manager:
        for step in range(1, 8):
            manager.save(step, _state(step))
        manager.wait()
        assert layout.committed_steps(str(root)) == [5, 6, 7]
        assert layout.committed_steps(str(fast)) == [5, 7]  # 5 only for 7
    for step in (6, 7):
        assert layout.marker_of(str(root), step)["depends_on"] == [5]
        assert dependencies(_state_file(root, step)) == [_state_file(root, 5)]
    shutil.rmtree(fast)
    with fastckpt.CheckpointManager(root, fast=fast) as manager:
        for step in (5, 6, 7):
            assert _equal(manager.restore(step)[1], _state(step))
        assert manager.restore()[0] == 7


def test_a_drain_whose_references_leave_root_is_refused(tmp_path):
    root, fast = tmp_path / "root", tmp_path / "fast"
    with fastckpt.CheckpointManager(root, fast=fast, keep_last=None, keep_fast=5) as manager:
        manager.save(1, _state(1))
        manager.wait()
    layout.remove_step(str(root), 1)  # root lost step 1; fast still has it
    os.makedirs(layout.step_dir(str(fast), 2))
    fastckpt.save(_state(2), _state_file(fast, 2), base=_state_file(fast, 1))
    layout.commit(str(fast), 2, None, extra={"depends_on": [1], "since_full": 1})
    shutil.rmtree(layout.step_dir(str(fast), 1))  # ... until it is lost there too
    manager = fastckpt.CheckpointManager(root, fast=fast, keep_fast=5)
    with pytest.raises(fastckpt.MissingBaseError):
        manager.wait()  # the drain of step 2: its base is in neither tier
    manager.close()
    assert layout.committed_steps(str(root)) == []
    assert not os.path.exists(layout.step_dir(str(root), 2))


def test_restore_falls_back_past_a_missing_base_and_leaves_the_step(tmp_path, caplog):
    with fastckpt.CheckpointManager(
        tmp_path, keep_last=None, incremental=True, full_every=3
    ) as manager:
        for step in range(1, 6):
            manager.save(step, _state(step))
        manager.wait()
    shutil.rmtree(layout.step_dir(str(tmp_path), 4))  # the base of 5, lost
    caplog.set_level(logging.WARNING, logger="fastckpt")
    with fastckpt.CheckpointManager(tmp_path) as manager:
        step, state = manager.restore()
        assert step == 3 and _equal(state, _state(3))
        assert manager.steps() == [1, 2, 3, 5]  # 5's own file is whole: not moved
    assert "step 5 in" in caplog.text and "missing" in caplog.text


def test_a_damaged_newest_step_is_quarantined_and_can_be_saved_again(tmp_path, caplog, capsys):
    with fastckpt.CheckpointManager(tmp_path, keep_last=None, incremental=True) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
        manager.wait()
    _damage(_state_file(tmp_path, 3), "w")
    caplog.set_level(logging.WARNING, logger="fastckpt")
    with fastckpt.CheckpointManager(tmp_path, keep_last=None, incremental=True) as manager:
        step, state = manager.restore()
        assert step == 2 and _equal(state, _state(2))
        assert manager.steps() == [1, 2]
        moved = [n for n in os.listdir(tmp_path) if ".damaged-" in n]
        assert len(moved) == 1 and moved[0].startswith("step-000000000003.damaged-")
        manager.save(3, _state(3)).result()  # training goes on from step 2
        manager.save(4, _state(4)).result()
        assert _equal(manager.restore(3)[1], _state(3))
        assert manager.steps() == [1, 2, 3, 4]
    assert "moved to" in caplog.text and "step 3" in caplog.text
    assert cli(["ls", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    # the copy moved out is shown as such, beside the step saved again
    (three,) = [s for s in listed if s["step"] == 3]
    assert three["committed"] and three["tiers"] == {"root": "committed"}
    assert [(a["why"], os.path.basename(a["directory"])) for a in three["set_aside"]] == [
        ("damaged", moved[0])
    ]
    assert all("set_aside" not in s for s in listed if s["step"] != 3)
    assert os.path.isdir(tmp_path / moved[0])  # kept for a person to look at


def test_a_damaged_base_quarantines_it_and_the_steps_that_need_it(tmp_path):
    with fastckpt.CheckpointManager(
        tmp_path, keep_last=None, incremental=True, full_every=3
    ) as manager:
        for step in range(1, 6):
            manager.save(step, _state(step))
        manager.wait()
    _damage(_state_file(tmp_path, 4), "frozen")  # full step 4: 5 needs its frozen tensor
    with fastckpt.CheckpointManager(tmp_path, keep_last=None, incremental=True) as manager:
        step, state = manager.restore()
        assert step == 3 and _equal(state, _state(3))
        assert manager.steps() == [1, 2, 3]
        for step in (4, 5):
            manager.save(step, _state(step)).result()
            assert _equal(manager.restore(step)[1], _state(step))
    assert sorted(n.split(".")[0] for n in os.listdir(tmp_path) if ".damaged-" in n) == [
        "step-000000000004",
        "step-000000000005",
    ]


def test_a_damaged_step_that_a_loading_step_needs_stays(tmp_path, caplog):
    with fastckpt.CheckpointManager(tmp_path, keep_last=None, incremental=True) as manager:
        for step in (1, 2):
            manager.save(step, _state(step))
        manager.wait()
    _damage(_state_file(tmp_path, 1), "w")  # step 2 holds its own "w": it needs 1's "frozen"
    caplog.set_level(logging.WARNING, logger="fastckpt")
    with fastckpt.CheckpointManager(tmp_path, keep_last=None) as manager:
        with pytest.raises(FileNotFoundError, match="could be restored"):
            manager.restore(1)
        assert manager.steps() == [1, 2]  # 1 stays: 2 needs it
        assert _equal(manager.restore()[1], _state(2))
    assert "left in the series: steps [2] need it" in caplog.text


_KILLED_RUN = textwrap.dedent(
    """
    import sys, torch, fastckpt
    root, fast, phase = sys.argv[1], sys.argv[2] or None, sys.argv[3]
    frozen = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB, never changes

    def state(step):
        return {"frozen": frozen, "w": torch.full((1 << 16,), float(step)), "step": step}

    if phase == "retention":  # many steps, then one save whose retention deletes them
        with fastckpt.CheckpointManager(
            root, fast=fast, keep_last=None, keep_fast=100, incremental=True, full_every=4
        ) as manager:
            for step in range(1, 31):
                manager.save(step, state(step))
        manager = fastckpt.CheckpointManager(
            root, fast=fast, keep_last=1, incremental=True, full_every=4
        )
        print("go", flush=True)
        manager.save(31, state(31)).result()
        manager.wait()
        print("done", flush=True)
    else:
        manager = fastckpt.CheckpointManager(
            root, fast=fast, keep_last=2, incremental=True, full_every=3
        )
        print("go", flush=True)
        for step in range(1, 10000):
            manager.save(step, state(step))
    """
)


@pytest.mark.parametrize(
    "phase, fast, delay",
    [
        ("save", False, 0.4),
        ("save", True, 0.9),
        ("retention", False, 0.1),  # lands mid-deletion here, most times
        ("retention", True, 0.2),
    ],
)
def test_kill_9_never_leaves_a_kept_step_without_its_base(tmp_path, phase, fast, delay):
    root, fast_tier = tmp_path / "root", (tmp_path / "fast" if fast else None)
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_RUN, str(root), str(fast_tier or ""), phase],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "go"
    time.sleep(delay)
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    frozen = torch.arange(4 << 20, dtype=torch.float32)
    with fastckpt.CheckpointManager(root, fast=fast_tier, keep_last=None) as manager:
        manager.wait()
        for tier in (root, fast_tier):
            if tier is None:
                continue
            assert layout.uncommitted_dirs(str(tier)) == []
            for step in layout.committed_steps(str(tier)):
                state = fastckpt.load(_state_file(tier, step), verify=True)
                assert state["step"] == step and torch.equal(state["frozen"], frozen)
                assert torch.equal(state["w"], torch.full((1 << 16,), float(step)))
        assert manager.steps(), "a committed step survives"
