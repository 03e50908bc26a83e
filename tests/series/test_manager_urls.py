"""CheckpointManager with its durable tier at a URL: a real S3 server (moto, on loopback) and
fsspec's memory file system; a local fast tier drained to S3, verified, kept by policy, and
restored after the fast tier is lost, past a damaged step, and after kill -9 mid-drain."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fastckpt
from fastckpt.series import steps as layout
from fastckpt.series.steps import Tier


def _state(step: int, numel: int = 1024) -> dict:
    return {"w": torch.full((numel,), float(step)), "step": step}


def _objects(fs, url: str) -> list[str]:
    fs.invalidate_cache()
    base = url.split("://", 1)[1]
    return sorted(p[len(base) + 1 :] for p in fs.find(base))


def test_s3_root_drain_retention_and_restore_after_the_fast_tier_is_wiped(s3, tmp_path):
    bucket, options, fs = s3
    root, fast = f"{bucket}/run", tmp_path / "fast"
    with fastckpt.CheckpointManager(
        root, fast=fast, keep_last=2, keep_fast=1, storage_options=options
    ) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step, 1 << 16), metrics={"loss": 1.0 / step})
        manager.wait()
        assert layout.committed_steps(str(fast)) == [3]
        assert layout.committed_steps(Tier(root, options)) == [2, 3]
        assert manager.steps() == [2, 3]
        marker = layout.marker_of(Tier(root, options), 3)
        assert marker["metrics"] == {"loss": 1.0 / 3} and set(marker["files"]) == {
            layout.STATE_FILE
        }
        # the lease object names this process while the manager runs
        lease = json.loads(fs.cat_file(f"{root[5:]}/.fastckpt-manager.lock"))
        assert lease["pid"] == __import__("os").getpid()
    assert _objects(fs, root) == [
        f"step-{s:012d}/{n}" for s in (2, 3) for n in (layout.MARKER, layout.STATE_FILE)
    ]  # the lease went with close()
    for path in fast.iterdir():
        if path.is_dir():
            layout.remove_step(str(fast), int(path.name[5:]))
    with fastckpt.CheckpointManager(root, fast=fast, storage_options=options) as manager:
        step, state = manager.restore()
        assert step == 3 and torch.equal(state["w"], _state(3, 1 << 16)["w"])
        assert manager.restore(2)[1]["step"] == 2


def test_s3_root_without_a_fast_tier_commits_and_falls_back_past_damage(s3, caplog):
    bucket, options, fs = s3
    root = f"{bucket}/plain"
    with fastckpt.CheckpointManager(root, keep_last=3, storage_options=options) as manager:
        for step in (10, 20):
            manager.save(step, _state(step)).result()
        assert manager.steps() == [10, 20]
    # damage the newest step's data in place (a new object with one byte changed)
    key = f"{root[5:]}/step-{20:012d}/{layout.STATE_FILE}"
    data = bytearray(fs.cat_file(key))
    data[-3] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    # a step whose files exist but whose marker does not is no step, and goes on start
    fs.pipe_file(f"{root[5:]}/step-{30:012d}/{layout.STATE_FILE}", b"partial")
    caplog.set_level(logging.WARNING, logger="fastckpt")
    assert layout.uncommitted_steps(Tier(root, options)) == [30]
    with fastckpt.CheckpointManager(root, storage_options=options) as manager:
        assert layout.uncommitted_steps(Tier(root, options)) == []
        step, state = manager.restore()
        assert step == 10 and state["step"] == 10
    assert "step 20 in" in caplog.text and "cannot be restored" in caplog.text


def test_a_second_manager_on_a_url_root_is_refused_until_the_first_closes(s3):
    bucket, options, _ = s3
    root = f"{bucket}/leased"
    first = fastckpt.CheckpointManager(root, storage_options=options)
    with pytest.raises(RuntimeError, match="another CheckpointManager manages .*pid"):
        fastckpt.CheckpointManager(root, storage_options=options)
    first.close()
    fastckpt.CheckpointManager(root, storage_options=options).close()


def test_a_damaged_upload_is_caught_by_the_read_back(tmp_path, monkeypatch):
    from fastckpt.errors import ChecksumError
    from fastckpt.series import transfer

    source = tmp_path / "a.safetensors"
    fastckpt.save(_state(1, 1 << 16), source)
    crc = transfer.copy_file(str(source), "memory://series-damage/a.safetensors")
    transfer.verify_copy("memory://series-damage/a.safetensors", crc)
    with pytest.raises(ChecksumError, match="bytes differ"):
        transfer.verify_copy("memory://series-damage/a.safetensors", crc ^ 1)
    data = bytearray(source.read_bytes())
    data[-5] ^= 0xFF  # the source tier's copy damaged: its header's CRCs catch it
    source.write_bytes(bytes(data))
    crc = transfer.copy_file(str(source), "memory://series-damage/b.safetensors")
    with pytest.raises(ChecksumError, match=r"damaged tensors \['w'\]"):
        transfer.verify_copy("memory://series-damage/b.safetensors", crc)


def test_memory_url_tiers_drain_and_retain():
    root, fast = "memory://series-mem/root", "memory://series-mem/fast"
    with fastckpt.CheckpointManager(root, fast=fast, keep_last=1) as manager:
        for step in (1, 2):
            manager.save(step, _state(step))
        manager.wait()
        assert layout.committed_steps(root) == [2] and layout.committed_steps(fast) == [2]
    with fastckpt.CheckpointManager(root) as manager:
        assert manager.restore()[0] == 2


_KILLED_DRAIN = textwrap.dedent(
    """
    import json, signal, sys, torch, fastckpt
    root, fast, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    manager = fastckpt.CheckpointManager(
        root, fast=fast, storage_options=options, drain_bytes_per_second=16 << 20
    )
    manager.save(1, {"w": torch.full((1 << 16,), 1.0)}).result()
    manager.wait()
    manager.save(2, {"w": torch.full((8 << 20,), 2.0)}).result()  # 32 MiB, 2 s to drain
    print("go", flush=True)
    signal.pause()
    """
)


def test_kill_9_during_a_drain_to_s3_then_the_next_manager_finishes_it(s3, tmp_path):
    bucket, options, fs = s3
    root, fast = f"{bucket}/killed", tmp_path / "fast"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_DRAIN, root, str(fast), json.dumps(options)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "go"
    bucket_name = bucket[5:]
    deadline = time.monotonic() + 30
    while not fs.call_s3("list_multipart_uploads", Bucket=bucket_name).get("Uploads"):
        assert time.monotonic() < deadline, "the drain of step 2 never started its upload"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)  # mid-upload: parts of step 2 sent, none completed
    child.wait()
    child.stdout.close()
    assert layout.committed_steps(Tier(root, options)) == [1]
    with fastckpt.CheckpointManager(root, fast=fast, storage_options=options) as manager:
        manager.wait()  # the drain of step 2 again, from the start
        assert layout.committed_steps(Tier(root, options)) == [1, 2]
        fast_tier_lost = [p for p in fast.iterdir() if p.is_dir()]
        for path in fast_tier_lost:
            layout.remove_step(str(fast), int(path.name[5:]))
        step, state = manager.restore()
        assert step == 2 and torch.equal(state["w"], torch.full((8 << 20,), 2.0))
    assert layout.uncommitted_steps(Tier(root, options)) == []
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket_name)
    assert uploads.get("Uploads", []) == []  # the killed upload was aborted


_DRAIN_ONLY = textwrap.dedent(
    """
    import json, os, sys, fastckpt
    from fastckpt.series import transfer
    fast, root, options, small = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    # a small copy first: everything a drain imports and sets up is in memory before
    crc = transfer.copy_file(small, root + "-warm-up", target_options=options)
    transfer.verify_copy(root + "-warm-up", crc, options)
    import tempfile  # and a manager's own imports (its series, groups, replication modules)
    with fastckpt.CheckpointManager(tempfile.mkdtemp(), fast=tempfile.mkdtemp()):
        pass
    def kib(field):  # VmHWM: this process's peak RSS (ru_maxrss counts the parent's at fork)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":")) << 10
    before = kib("VmRSS")
    with fastckpt.CheckpointManager(root, fast=fast, storage_options=options) as manager:
        manager.wait()  # the committed fast step that root lacks is drained on start
    print(json.dumps({"before": before, "peak": kib("VmHWM")}))
    """
)


@pytest.mark.slow
def test_a_drain_to_s3_holds_at_most_256_mib_whatever_the_step_size(s3, tmp_path):
    bucket, options, _ = s3
    root, fast = f"{bucket}/big", tmp_path / "fast"
    path = layout.join(layout.step_dir(str(fast), 1), layout.STATE_FILE)
    (fast / "step-000000000001").mkdir(parents=True)
    fastckpt.save({"w": torch.arange(96 << 20, dtype=torch.float32)}, path)  # 384 MiB
    layout.commit(str(fast), 1, None)
    small = tmp_path / "small.safetensors"
    fastckpt.save({"w": torch.ones(1 << 20)}, small)
    child = subprocess.run(
        [sys.executable, "-c", _DRAIN_ONLY, str(fast), root, json.dumps(options), str(small)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    memory = json.loads(child.stdout)
    assert memory["peak"] - memory["before"] < 256 << 20, memory
    assert layout.committed_steps(Tier(root, options)) == [1]


def test_a_manager_whose_lease_was_taken_stops_writing():
    from fastckpt import storage
    from fastckpt.series.lease import LOCK_NAME

    root = "memory://series-lease/run"
    manager = fastckpt.CheckpointManager(root, lease_seconds=0.3)
    manager.save(1, _state(1)).result()
    # a successor on another host took the lease while this manager stalled
    taken = {"owner": "other", "host": "elsewhere", "pid": 1, "renewed": time.time()}
    storage.write_whole(f"{root}/{LOCK_NAME}", json.dumps(taken).encode())
    time.sleep(0.5)  # the next renewal finds it
    with pytest.raises(RuntimeError, match="taken by host elsewhere"):
        manager.save(2, _state(2))
    manager.close()
    assert json.loads(storage.read_whole(f"{root}/{LOCK_NAME}"))["owner"] == "other"
    assert layout.committed_steps(root) == [1]


def _frozen_state(step: int) -> dict:
    return {
        "frozen": torch.arange(1 << 18, dtype=torch.float32),
        "w": torch.full((64,), float(step)),
    }


def test_incremental_steps_drained_to_s3_restore_there_after_the_fast_tier_is_wiped(s3, tmp_path):
    from fastckpt.series.bases import needed_steps

    bucket, options, fs = s3
    root, fast = f"{bucket}/incremental", tmp_path / "fast"
    with fastckpt.CheckpointManager(
        root, fast=fast, keep_last=3, incremental=True, full_every=4, storage_options=options
    ) as manager:
        for step in range(1, 8):
            manager.save(step, _frozen_state(step))
        manager.wait()
    tier = Tier(root, options)
    assert layout.committed_steps(tier) == [5, 6, 7]  # 5 full, 6 and 7 need it
    for step in (6, 7):
        assert layout.marker_of(tier, step)["depends_on"] == [5]
        assert needed_steps(tier, step) == [5]  # the references resolve to root's copy
        key = f"{root[5:]}/step-{step:012d}/{layout.STATE_FILE}"
        assert fs.size(key) * 50 < fs.size(f"{root[5:]}/step-{5:012d}/{layout.STATE_FILE}")
    import shutil

    shutil.rmtree(fast)
    with fastckpt.CheckpointManager(root, fast=fast, storage_options=options) as manager:
        for step in (5, 6, 7):
            state = manager.restore(step)[1]
            assert all(torch.equal(state[k], v) for k, v in _frozen_state(step).items())


def test_a_damaged_step_at_s3_is_quarantined_and_saved_again(s3, caplog):
    bucket, options, fs = s3
    root = f"{bucket}/quarantine"
    with fastckpt.CheckpointManager(root, keep_last=3, storage_options=options) as manager:
        for step in (10, 20):
            manager.save(step, _state(step)).result()
    key = f"{root[5:]}/step-{20:012d}/{layout.STATE_FILE}"
    data = bytearray(fs.cat_file(key))
    data[-3] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    caplog.set_level(logging.WARNING, logger="fastckpt")
    with fastckpt.CheckpointManager(root, keep_last=3, storage_options=options) as manager:
        assert manager.restore()[0] == 10
        assert manager.steps() == [10]
        manager.save(20, _state(20)).result()  # the step number is free again
        step, state = manager.restore()
        assert step == 20 and torch.equal(state["w"], _state(20)["w"])
    moved = [p for p in _objects(fs, root) if ".damaged-" in p]
    assert len(moved) == 1  # the data, kept under a prefix that is no step; the marker went
    assert moved[0].startswith("step-000000000020.damaged-")
    assert moved[0].endswith("/" + layout.STATE_FILE)
    assert "moved to" in caplog.text
