"""A checkpoint series against hostile and odd trees: names planted in markers, symbolic and
hard links, steps named with other scripts' digits, markers that are not files, NaN metrics.
Nothing outside a tier is opened for writing, truncated, moved or deleted, and no committed
step is lost. Real files, real managers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.series import steps as layout

MARKER = layout.MARKER


def _state(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), value)}


def _plant_step(tier, step: int, files: dict) -> str:
    """A step directory holding a real state file, committed by a marker naming ``files``."""
    directory = layout.step_dir(str(tier), step)
    os.makedirs(directory)
    fastckpt.save(_state(step), os.path.join(directory, layout.STATE_FILE))
    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump({"step": step, "layout": "file", "files": files, "metrics": {}}, f)
    return directory


@pytest.mark.parametrize("planted", ["../../victim.txt", "/ABSOLUTE", "a/../../victim.txt"])
def test_a_marker_naming_a_file_outside_its_step_is_refused_and_touches_nothing(tmp_path, planted):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    planted = planted.replace("/ABSOLUTE", str(victim))
    fast, root = tmp_path / "fast", tmp_path / "root"
    fast.mkdir()
    _plant_step(fast, 5, {planted: 15})
    with fastckpt.CheckpointManager(root, fast=fast) as manager:
        manager.wait()  # step 5 is set aside at start, never drained
        assert manager.steps() == []
    assert victim.read_text() == "the user's file"
    assert sorted(os.listdir(tmp_path)) == ["fast", "root", "victim.txt"]
    (aside,) = fast.glob("step-000000000005.unreadable-*")  # reported, kept, not a step
    assert planted in (aside / MARKER).read_text()


def test_a_step_saved_in_root_is_not_saved_again_through_the_fast_tier(tmp_path):
    with fastckpt.CheckpointManager(tmp_path / "root", fast=tmp_path / "fast") as manager:
        manager.save(1, _state(1.0)).result()
        manager.wait()
    # the fast tier is lost (a node restarted, its tmpfs empty): root still holds step 1
    with fastckpt.CheckpointManager(tmp_path / "root", fast=tmp_path / "fast2") as manager:
        with pytest.raises(ValueError, match="step 1 is already saved"):
            manager.save(1, _state(2.0))
        manager.wait()
        assert torch.equal(manager.restore(step=1)[1]["w"], _state(1.0)["w"])


def test_a_step_older_than_the_newest_is_refused(tmp_path):
    with fastckpt.CheckpointManager(tmp_path / "root") as manager:
        manager.save(5, _state()).result()
        with pytest.raises(ValueError, match="older than the newest saved step 5"):
            manager.save(3, _state())


def test_a_symlinked_step_directory_is_neither_a_step_nor_followed(tmp_path):
    outside = tmp_path / "outside"
    _plant_step(outside, 1, {layout.STATE_FILE: 1})
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(layout.step_dir(str(outside), 1), layout.step_dir(str(root), 1))
    with fastckpt.CheckpointManager(root, keep_last=1) as manager:
        assert manager.steps() == []  # a link is no step of this tier
        for step in (2, 3):
            manager.save(step, _state(step)).result()
        manager.wait()
    assert os.path.exists(os.path.join(layout.step_dir(str(outside), 1), MARKER))
    assert os.path.islink(layout.step_dir(str(root), 1))
    # saving the step the link stands for refuses: the link is not followed nor removed
    with fastckpt.CheckpointManager(root) as manager, pytest.raises(ValueError, match="older"):
        manager.save(1, _state())


def test_nan_metrics_rank_worst_in_best_k(tmp_path):
    from fastckpt.series.retention import Retention

    losses = {1: 0.5, 2: float("nan"), 3: 0.3, 4: 0.9}
    policy = Retention(1, None, ("loss", "min", 1))
    assert policy.kept(list(losses), {s: {"loss": v} for s, v in losses.items()}) == {3, 4}
    with fastckpt.CheckpointManager(
        tmp_path / "root", keep_last=1, best=("loss", "min", 1)
    ) as manager:
        for step, loss in losses.items():
            manager.save(step, _state(step), {"loss": loss}).result()
        manager.wait()
        assert manager.steps() == [3, 4]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)")
def test_a_hard_link_to_a_fast_step_file_is_never_written_over(tmp_path):
    import tempfile

    fast = tempfile.mkdtemp(dir="/dev/shm")
    try:
        kept = os.path.join(fast, "kept-by-the-user")
        with fastckpt.CheckpointManager(tmp_path / "root", fast=fast, keep_fast=1) as manager:
            manager.save(1, _state(1.0)).result()
            os.link(os.path.join(layout.step_dir(fast, 1), layout.STATE_FILE), kept)
            for step in range(2, 6):
                manager.save(step, _state(float(step))).result()
                manager.wait()
        assert torch.equal(fastckpt.load(kept)["w"], _state(1.0)["w"])
    finally:
        import shutil

        shutil.rmtree(fast, ignore_errors=True)


def test_a_directory_named_with_other_digits_never_aliases_a_step(tmp_path):
    root = tmp_path / "root"
    with fastckpt.CheckpointManager(root) as manager:
        manager.save(1, _state()).result()
    stray = root / ("step-" + "\u0966" * 11 + "\u0967")  # Devanagari 000000000001
    stray.mkdir()
    (stray / "notes.txt").write_text("someone's")
    with fastckpt.CheckpointManager(root) as manager:
        assert manager.steps() == [1]
        assert torch.equal(manager.restore()[1]["w"], _state()["w"])
    assert (stray / "notes.txt").read_text() == "someone's"


def test_a_marker_that_is_a_directory_stops_nothing_and_is_never_deleted(tmp_path):
    root = tmp_path / "root"
    with fastckpt.CheckpointManager(root, keep_last=1) as manager:
        manager.save(1, _state()).result()
    odd = layout.step_dir(str(root), 7)
    os.makedirs(os.path.join(odd, MARKER))
    with fastckpt.CheckpointManager(root, keep_last=1) as manager:  # starts
        manager.save(8, _state()).result()
        manager.wait()
    (aside,) = root.glob("step-000000000007.unreadable-*")  # set aside, never deleted
    assert (aside / MARKER).is_dir()


def test_an_unreadable_marker_is_set_aside_never_deleted(tmp_path):
    root = tmp_path / "root"
    with fastckpt.CheckpointManager(root, keep_last=1) as manager:
        manager.save(1, _state()).result()
    with open(os.path.join(layout.step_dir(str(root), 1), MARKER), "w") as f:
        f.write("{not json")  # damaged between two runs
    with fastckpt.CheckpointManager(root, keep_last=1) as manager:
        for step in (2, 3):
            manager.save(step, _state()).result()
    (aside,) = root.glob("step-000000000001.unreadable-*")
    assert (aside / MARKER).read_text() == "{not json"
    assert (aside / layout.STATE_FILE).exists()


def test_spare_file_never_consumes_a_file_fastckpt_did_not_make(tmp_path):
    other = tmp_path / "users-file.bin"
    other.write_bytes(b"precious" * 1000)
    path = tmp_path / "ckpt.safetensors"
    fastckpt.async_save(_state(), path, spare_file=str(other)).result()
    assert other.read_bytes() == b"precious" * 1000
    assert torch.equal(fastckpt.load(path)["w"], _state()["w"])


@pytest.fixture
def small_root(tmp_path):
    """A 5 MiB file system for root (a tmpfs mounted here; skipped where that needs a
    privilege this process lacks)."""
    import subprocess

    mount = tmp_path / "small-root"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_root_is_raised_by_the_next_save_and_the_fast_tier_stays_bounded(
    tmp_path, small_root, capfd, caplog
):
    import concurrent.futures
    import errno

    big = {"w": torch.ones(3 << 18)}  # 3 MiB: root holds one step, not two
    manager = fastckpt.CheckpointManager(
        small_root, fast=tmp_path / "fast", keep_last=1, max_undrained=3
    )

    def drained() -> None:
        concurrent.futures.wait(list(manager._drain_futures))

    manager.save(1, big).result()
    drained()
    manager.save(2, big).result()
    drained()  # root is full: step 2's drain failed
    with pytest.raises(OSError) as caught:
        manager.save(3, big)
    assert caught.value.errno == errno.ENOSPC
    assert "draining step 2" in str(caught.value) and str(small_root) in str(caught.value)
    assert "draining step 2" in caplog.text  # logged when it failed, not only when raised
    for step in (3, 4):
        manager.save(step, big).result()  # the error was raised once: saves go on
        drained()
        with pytest.raises(OSError, match=f"draining step {step}"):
            manager.save(step + 1, big)
    with pytest.raises(OSError, match="max_undrained=3") as refused:
        manager.save(5, big)
    assert refused.value.errno == errno.EAGAIN
    manager.close()  # every error was raised already: none again
    assert "BufferError" not in capfd.readouterr().err
    assert layout.committed_steps(str(tmp_path / "fast")) == [2, 3, 4]
    assert layout.committed_steps(str(small_root)) == [1]


def test_a_state_save_refuses_is_refused_in_the_call(tmp_path):
    with fastckpt.CheckpointManager(tmp_path / "root") as manager:
        with pytest.raises(TypeError):
            manager.save(3, {"model": torch.nn.Linear(2, 2)})
        assert manager.steps() == []
        manager.save(3, _state()).result()  # the step number is free again


def test_a_root_that_is_a_file_is_refused_naming_it(tmp_path):
    root = tmp_path / "a-file"
    root.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="root tier .* must be a directory") as caught:
        fastckpt.CheckpointManager(root)
    assert caught.value.filename == str(root)
    assert root.read_text() == "not a directory"


def test_a_planted_unreadable_marker_is_set_aside_at_start_and_blocks_nothing(tmp_path, caplog):
    root, fast = tmp_path / "root", tmp_path / "fast"
    planted = {}
    for tier, text in ((root, "{not json"), (fast, '{"step": 999999999999, "files": {"/x": 1}}')):
        directory = Path(layout.step_dir(str(tier), 999999999999))
        directory.mkdir(parents=True)
        (directory / layout.MARKER).write_text(text)
        planted[tier] = text
    with fastckpt.CheckpointManager(root, fast=fast, keep_last=1) as manager:
        for step in (5, 6, 7):  # not "older than the newest": the planted step is no step
            manager.save(step, _state()).result()
    assert "set aside" in caplog.text and "999999999999" in caplog.text
    for tier, text in planted.items():  # reported and moved aside, never deleted
        (aside,) = tier.glob("step-999999999999.unreadable-*")
        assert (aside / layout.MARKER).read_text() == text
    assert layout.committed_steps(str(root)) == [7]
    assert layout.committed_steps(str(fast)) == [7]


def test_close_does_not_raise_again_what_result_raised(small_root):
    import errno

    manager = fastckpt.CheckpointManager(small_root)
    future = manager.save(1, {"w": torch.ones(3 << 19)})  # 6 MiB into a 5 MiB root
    with pytest.raises(OSError) as caught:
        future.result()
    assert caught.value.errno == errno.ENOSPC
    manager.close()  # delivered already: not raised a second time
    assert layout.committed_steps(str(small_root)) == []


def test_a_marker_made_unreadable_while_running_is_logged_once(tmp_path, caplog):
    root = tmp_path / "root"
    with fastckpt.CheckpointManager(root, keep_last=1) as manager:
        manager.save(1, _state()).result()
        planted = Path(layout.step_dir(str(root), 0))
        planted.mkdir()  # while the manager runs: not set aside at its start
        (planted / MARKER).write_text("{not json")
        for step in (2, 3, 4):
            manager.save(step, _state()).result()
    assert caplog.text.count("commit marker cannot be read") == 1
    assert (planted / MARKER).read_text() == "{not json"


def _plant_marker(tier, step: int, files: dict) -> str:
    """A parseable marker for ``step`` naming ``files``, beside whatever the directory holds."""
    directory = layout.step_dir(str(tier), step)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump({"step": step, "layout": "file", "files": files, "metrics": {}}, f)
    return directory


def test_a_planted_marker_at_a_high_step_beside_no_state_is_set_aside_at_start(tmp_path):
    root = tmp_path / "root"
    _plant_marker(root, 999999999999, {layout.STATE_FILE: 4096})  # no state file at all
    with fastckpt.CheckpointManager(root) as manager:
        assert manager.steps() == []
        manager.save(1, _state(1.0)).result()  # a fresh run saves
        assert manager.restore()[0] == 1
    (aside,) = root.glob("step-999999999999.damaged-*")  # kept, marker and all
    assert sorted(os.listdir(aside)) == [MARKER]


def test_a_planted_marker_over_another_runs_state_is_not_taken_for_a_saved_step(tmp_path):
    root = tmp_path / "root"
    with fastckpt.CheckpointManager(root) as manager:
        manager.save(1, _state(1.0)).result()
    # another run's state file, damaged, under a marker that matches its size: it passes the
    # start's check, and the save it refuses checks it through
    other = _plant_step(root, 999999999999, {})
    state_file = os.path.join(other, layout.STATE_FILE)
    size = os.path.getsize(state_file)
    with open(state_file, "r+b") as f:
        f.seek(size - 4)
        f.write(b"\xff\xff\xff\xff")
    _plant_marker(root, 999999999999, {layout.STATE_FILE: size})
    with fastckpt.CheckpointManager(root) as manager:
        assert manager.steps() == [1, 999999999999]
        manager.save(2, _state(2.0)).result()  # no "older than the newest saved step"
        assert manager.steps() == [1, 2]
        assert torch.equal(manager.restore()[1]["w"], _state(2.0)["w"])
    (aside,) = root.glob("step-999999999999.damaged-*")
    assert sorted(os.listdir(aside)) == [MARKER, layout.STATE_FILE]  # nothing deleted


def test_a_verified_step_still_refuses_an_older_save(tmp_path):
    with fastckpt.CheckpointManager(tmp_path / "root") as manager:
        manager.save(5, _state()).result()
        with pytest.raises(ValueError, match="already saved"):
            manager.save(5, _state())
        assert manager.steps() == [5]


def test_a_url_tier_sets_aside_an_unreadable_or_planted_marker(caplog):
    import fsspec

    url = "memory://series-hostile/set-aside"
    fs = fsspec.filesystem("memory")
    fs.pipe(f"/series-hostile/set-aside/step-{999999999999:012d}/{MARKER}", b"{not json")
    fs.pipe(
        f"/series-hostile/set-aside/step-{999999999998:012d}/{MARKER}",
        json.dumps(
            {"step": 999999999998, "layout": "file", "files": {layout.STATE_FILE: 10}}
        ).encode(),
    )
    with fastckpt.CheckpointManager(url) as manager:
        assert manager.steps() == []
        manager.save(1, _state(1.0)).result()
        assert manager.steps() == [1]
    aside = {(s, why) for s, why, _ in layout.set_aside_dirs(layout.Tier(url))}
    assert aside == {(999999999999, "unreadable"), (999999999998, "damaged")}
    fs.invalidate_cache()
    moved = [p for p in fs.find("/series-hostile/set-aside") if ".unreadable-" in p]
    assert len(moved) == 1 and moved[0].endswith(f"/{MARKER}")
    assert fs.cat(moved[0]) == b"{not json"  # moved, not deleted
