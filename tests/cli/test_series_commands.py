"""`fastckpt ls`, `clean` and `prune` on real checkpoint series written by CheckpointManager."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fastckpt.cli import main
from fastckpt.series import steps
from fastckpt.series.manager import CheckpointManager


def _integration_fixtures():
    """The real moto S3 server fixtures of the integration tests, reused here."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "integrations" / "conftest.py"
    spec = importlib.util.spec_from_file_location("fastckpt_cli_s3_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_fixtures = _integration_fixtures()
s3_endpoint, s3_options, new_bucket, s3 = (
    _fixtures.s3_endpoint,
    _fixtures.s3_options,
    _fixtures.new_bucket,
    _fixtures.s3,
)


def run_main(capsys, *args) -> tuple[int, str, str]:
    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture
def series(tmp_path):
    """A series with steps 100, 200, 300 in root (200 and 300 also in the fast tier), a save
    cut short in the fast tier (400) and a drain cut short in root (500: committed in the fast
    tier, a partial copy in root)."""
    root, fast = tmp_path / "root", tmp_path / "fast"
    with CheckpointManager(root, fast=fast, keep_last=None, keep_fast=3) as manager:
        for step in (100, 200, 300, 500):
            manager.save(step, {"w": torch.full((1000,), float(step))}, metrics={"loss": 1 / step})
    # A drain of 500 cut short: root holds a partial copy, the fast tier the committed step.
    steps.remove_step(str(root), 500)
    os.makedirs(steps.step_dir(str(root), 500))
    (root / "step-000000000500" / "state.safetensors").write_bytes(b"\0" * 100)
    # A save of 400 cut short in the fast tier.
    os.makedirs(steps.step_dir(str(fast), 400))
    return root, fast


def test_ls_lists_each_step_with_tiers_size_and_metrics(series, capsys):
    root, fast = series
    status, out, _ = run_main(capsys, "ls", root, "--fast", fast)
    assert status == 0
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "TIERS", "SIZE", "COMMITTED", "VERIFIED", "METRICS"]
    by_step = {line.split()[0]: line for line in lines[1:]}
    assert set(by_step) == {"100", "200", "300", "400", "500"}
    assert "root" in by_step["100"] and "fast" not in by_step["100"]
    assert "fast, root" in by_step["300"] and "loss=0.00333333" in by_step["300"]
    assert "fast (partial)" in by_step["400"] and " no " in by_step["400"]
    assert "fast, root (partial)" in by_step["500"] and " yes " in by_step["500"]


def test_ls_json_matches_the_markers(series, capsys):
    root, fast = series
    status, out, _ = run_main(capsys, "ls", root, "--fast", fast, "--json")
    assert status == 0
    listing = {s["step"]: s for s in json.loads(out)}
    size = os.path.getsize(root / "step-000000000100" / "state.safetensors")
    assert listing[100] == {
        "step": 100,
        "tiers": {"root": "committed"},
        "size": size,
        "committed": True,
        "verified": "-",
        "metrics": {"loss": 0.01},
    }
    assert listing[500]["tiers"] == {"fast": "committed", "root": "partial"}
    assert listing[400]["committed"] is False


def test_ls_verify_names_a_damaged_copy(series, capsys):
    root, fast = series
    status, out, _ = run_main(capsys, "ls", root, "--fast", fast, "--verify", "--json")
    assert status == 0
    assert {s["step"]: s["verified"] for s in json.loads(out)} == {
        100: "yes",
        200: "yes",
        300: "yes",
        400: "-",
        500: "yes",
    }
    # Flip a byte of 200's root copy in the data section (the header stays valid).
    path = root / "step-000000000200" / "state.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    status, out, _ = run_main(capsys, "ls", root, "--fast", fast, "--verify")
    assert status == 1
    damaged = [line for line in out.splitlines() if line.startswith("200 ")]
    assert "DAMAGED" in damaged[0]
    assert "step 200: DAMAGED root:" in out and "w" in out


def test_ls_of_an_empty_or_missing_root(tmp_path, capsys):
    status, out, _ = run_main(capsys, "ls", tmp_path)
    assert status == 0 and "(no steps)" in out
    status, _, err = run_main(capsys, "ls", tmp_path / "none")
    assert status == 2 and "no such directory" in err


def test_clean_dry_run_then_removes_partials_and_stale_drains(series, capsys):
    root, fast = series
    status, out, _ = run_main(capsys, "clean", root, "--fast", fast, "--dry-run")
    assert status == 0
    assert f"would remove {fast}/step-000000000400 (partial save" in out
    assert f"would remove {root}/step-000000000500 (stale drain" in out
    assert (root / "step-000000000500").is_dir() and (fast / "step-000000000400").is_dir()
    status, out, _ = run_main(capsys, "clean", root, "--fast", fast)
    assert status == 0 and "removed 2 directories" in out
    assert not (root / "step-000000000500").exists()
    assert not (fast / "step-000000000400").exists()
    assert steps.committed_steps(str(root)) == [100, 200, 300]
    assert steps.committed_steps(str(fast)) == [200, 300, 500]
    status, out, _ = run_main(capsys, "clean", root, "--fast", fast)
    assert status == 0 and "nothing to clean" in out


def test_clean_removes_the_spare_file_a_killed_manager_left(series, capsys):
    root, fast = series
    spare = fast / steps.SPARE_FILE
    spare.write_bytes(b"x" * 8192)  # what a run killed between two saves leaves
    status, out, _ = run_main(capsys, "clean", root, "--fast", fast, "--dry-run")
    assert status == 0 and f"would remove {spare} (spare file, 8.00 KiB)" in out
    assert spare.exists()
    status, out, _ = run_main(capsys, "clean", root, "--fast", fast)
    assert status == 0 and "removed 2 directories and a spare file" in out
    assert not spare.exists()
    assert steps.committed_steps(str(fast)) == [200, 300, 500]


def test_clean_and_prune_refuse_a_tier_a_manager_holds(series, capsys):
    root, fast = series
    with CheckpointManager(root, keep_last=None):
        status, _, err = run_main(capsys, "clean", root)
        assert status == 1 and "another CheckpointManager manages" in err
        status, _, err = run_main(capsys, "prune", root, "--keep-last", "1")
        assert status == 1 and "another CheckpointManager manages" in err
    assert steps.committed_steps(str(root)) == [100, 200, 300]


def test_prune_keeps_what_the_policy_keeps(series, capsys):
    root, fast = series
    status, out, _ = run_main(capsys, "prune", root, "--keep-last", "1", "--dry-run")
    assert status == 0 and "would remove 2 steps" in out and "keeping 300" in out
    assert steps.committed_steps(str(root)) == [100, 200, 300]
    # The highest loss is step 100's: kept by --best, beside the newest.
    status, out, _ = run_main(
        capsys, "prune", root, "--fast", fast, "--keep-last", "1", "--best", "loss:max:1"
    )
    assert status == 0
    assert "removed step 200 (and its fast copy)" in out
    assert steps.committed_steps(str(root)) == [100, 300]
    assert steps.committed_steps(str(fast)) == [300, 500]
    # What is left still restores.
    with CheckpointManager(root) as manager:
        assert manager.restore()[0] == 300


def test_prune_keeps_the_bases_of_kept_incremental_steps(tmp_path, capsys):
    import fastckpt

    frozen = torch.randn(4096)
    with CheckpointManager(tmp_path, keep_last=None, incremental=True, full_every=10) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"frozen": frozen, "step": torch.tensor(step)}).result()
    status, out, _ = run_main(capsys, "prune", tmp_path, "--keep-last", "1")
    assert status == 0
    # step 3 refers to step 1's frozen tensor: step 1 stays, step 2 goes
    assert steps.committed_steps(str(tmp_path)) == [1, 3]
    state = fastckpt.load(tmp_path / "step-000000000003" / steps.STATE_FILE, verify=True)
    assert torch.equal(state["frozen"], frozen) and int(state["step"]) == 3


def test_prune_rejects_a_malformed_best(tmp_path, capsys):
    status, _, err = run_main(capsys, "prune", tmp_path, "--keep-last", "1", "--best", "loss:low:1")
    assert status == 2 and "METRIC:min|max:COUNT" in err


@pytest.mark.parametrize("command", ["ls", "clean", "prune"])
def test_help_states_the_exit_statuses(command, capsys):
    assert main([command, "--help"]) == 0
    assert "exit status: 0" in " ".join(capsys.readouterr().out.split())


def test_ls_runs_as_a_command_beside_a_running_manager(tmp_path):
    """In a subprocess, as a user runs it, while a manager holds the tier."""
    with CheckpointManager(tmp_path, keep_last=None) as manager:
        manager.save(7, {"w": torch.ones(3)}, metrics={"acc": 0.5}).result()
        out = subprocess.run(
            [sys.executable, "-m", "fastckpt", "ls", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, FASTCKPT_NO_PROGRESS="1"),
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].split()[:2] == ["7", "root"]
    assert "acc=0.5" in out.stdout


def test_ls_clean_and_prune_on_an_s3_root(s3, tmp_path, monkeypatch, capsys):
    bucket, options, fs = s3
    root, fast = f"{bucket}/run", tmp_path / "fast"
    with CheckpointManager(root, fast=fast, keep_last=None, storage_options=options) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"w": torch.full((100,), float(step))}, metrics={"loss": step})
    # A drain cut short: a partial copy of a step without its marker.
    fs.pipe(f"{root[5:]}/step-000000000004/state.safetensors", b"partial")
    monkeypatch.setenv("FASTCKPT_STORAGE_OPTIONS", json.dumps(options))

    status, out, _ = run_main(capsys, "ls", root, "--fast", fast, "--verify", "--json")
    assert status == 0
    listing = {s["step"]: s for s in json.loads(out)}
    assert listing[3]["tiers"] == {"fast": "committed", "root": "committed"}
    assert listing[2]["verified"] == "yes" and listing[2]["metrics"] == {"loss": 2.0}
    assert listing[4] == {
        "step": 4,
        "tiers": {"root": "partial"},
        "size": 7,
        "committed": False,
        "verified": "-",
        "metrics": {},
    }
    status, out, _ = run_main(capsys, "clean", root)
    assert status == 0 and "removed 1 directory" in out
    status, out, _ = run_main(capsys, "prune", root, "--fast", fast, "--keep-last", "1")
    assert status == 0 and "removed 2 steps" in out
    assert steps.committed_steps(steps.Tier(root, options)) == [3]
    assert steps.uncommitted_steps(steps.Tier(root, options)) == []
    # The lease the commands took is released: a manager starts on the tier again.
    with CheckpointManager(root, fast=fast, storage_options=options) as manager:
        assert manager.restore()[0] == 3


def test_ls_verifies_a_dcp_step_as_one_checkpoint(tmp_path, capsys):
    """A step of a multi-rank run (here one process, distributed=True) is a DCP checkpoint."""
    with CheckpointManager(tmp_path, distributed=True) as manager:
        manager.save(5, {"w": torch.ones(1000)}, metrics={"loss": 1.0}).result()
    status, out, _ = run_main(capsys, "ls", tmp_path, "--verify", "--json")
    assert status == 0
    assert [(s["step"], s["verified"]) for s in json.loads(out)] == [(5, "yes")]
    (data,) = (tmp_path / "step-000000000005").glob("*.safetensors")
    damaged = bytearray(data.read_bytes())
    damaged[-1] ^= 0xFF
    data.write_bytes(bytes(damaged))
    status, out, _ = run_main(capsys, "ls", tmp_path, "--verify")
    assert status == 1 and "step 5: DAMAGED root:" in out


def test_ls_shows_set_aside_steps_and_replicas_held_for_peers(tmp_path, capsys):
    root, fast = tmp_path / "root", tmp_path / "fast"
    with CheckpointManager(root, fast=fast, keep_last=None, keep_fast=3) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"w": torch.full((100,), float(step))})
    steps.set_aside(str(root), 2, "damaged")
    os.makedirs(steps.step_dir(str(root), 3) + ".abandoned-20260101T000000Z")
    os.makedirs(steps.step_dir(str(fast), 9))
    (fast / "step-000000000009" / steps.MARKER).write_text("{not json")
    steps.set_aside(str(fast), 9)
    # a replica this node holds for rank 1 (the layout of fastckpt.distributed.replica_store)
    replica = fast / ".replicas" / "from-rank-00001" / "step-000000000003"
    replica.mkdir(parents=True)
    (replica / "state.safetensors").write_bytes(b"x" * 10)
    (replica / "REPLICA").write_text(
        json.dumps({"step": 3, "rank": 1, "node": 1, "files": [["state.safetensors", 10]]})
    )
    status, out, err = run_main(capsys, "ls", root, "--fast", fast)
    assert status == 0, err
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "root (set aside: damaged)" in lines["2"] and "fast" in lines["2"]
    assert "root (set aside: abandoned)" in lines["3"] and "fast (replica of rank 1)" in lines["3"]
    assert "fast (set aside: unreadable)" in lines["9"] and " no " in lines["9"]
    status, out, _ = run_main(capsys, "ls", root, "--fast", fast, "--json")
    listed = {s["step"]: s for s in json.loads(out)}
    assert [(a["tier"], a["why"]) for a in listed[2]["set_aside"]] == [("root", "damaged")]
    assert [(r["tier"], r["rank"]) for r in listed[3]["replicas"]] == [("fast", 1)]
    assert listed[9]["committed"] is False and listed[9]["tiers"] == {}
    assert "set_aside" not in listed[1] and "replicas" not in listed[1]
    assert sorted(os.listdir(fast / ".replicas")) == ["from-rank-00001"]  # read, not changed
