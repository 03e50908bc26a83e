"""Every example runs and says what it should."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    "script, expected",
    [
        ("quickstart.py", ["epoch 1", "checksums intact: True", "kept the old weights: True"]),
        ("deepnvme.py", ["completed writes: 4", "completed reads: 4", "identical: True"]),
        (
            "partial_reads.py",
            [
                "rows identical: True",
                "read 4 MiB of 32 MiB",
                "row identical: True",
                "undamaged piece still reads: True",
                "damaged piece refused: True",
            ],
        ),
        (
            "dcp_resharding.py",
            [
                "2 ranks resharded step 100: identical: True",
                "one process loaded step 100: identical: True",
            ],
        ),
        (
            "remote_and_shards.py",
            ["identical: True", "3 shards + model.safetensors.index.json", "round trip: True"],
        ),
        (
            "damaged_files.py",
            [
                "damaged header refused: True",
                "verify says: DAMAGED",
                "stale temporary removed: True",
                "torch.save file recognised: True",
            ],
        ),
    ],
)
def test_example_runs(tmp_path, script, expected):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,  # the DCP example starts process groups, slow on a busy 2-core machine
    )
    assert out.returncode == 0, out.stderr
    for line in expected:
        assert line in out.stdout


def test_lightning_example_trains_and_resumes(tmp_path):
    pytest.importorskip("lightning")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_train.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "last.ckpt: epoch 1, global step 8" in out.stdout
    assert "resumed to epoch 3, global step 12" in out.stdout
    assert "'last.ckpt'" in out.stdout


@pytest.mark.parametrize("script", ["partial_reads.py", "damaged_files.py"])
def test_example_without_a_folder_leaves_nothing_behind(tmp_path, script):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert list(scratch.iterdir()) == []


def _manager_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "train_with_manager", EXAMPLES / "train_with_manager.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_manager_example_trains_and_resumes_in_process(tmp_path):
    """The example's training function, without the kill: a run of 8 steps, then one resumed
    to 12 from the manager's newest step (the fast tier's, drained to root)."""
    pytest.importorskip("lightning")
    from fastckpt.series import steps

    example = _manager_example()
    root, fast = str(tmp_path / "root"), str(tmp_path / "fast")
    assert example.train(root, fast, max_steps=8, resume=False) == 0
    assert steps.committed_steps(root) == [4, 8] and steps.committed_steps(fast) == [8]
    assert example.train(root, fast, max_steps=12, resume=True) == 8
    assert steps.committed_steps(root) == [8, 12]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_manager_example_survives_kill_9(tmp_path, where):
    pytest.importorskip("lightning")
    if where == "s3":
        pytest.importorskip("moto.server")
        pytest.importorskip("s3fs")
    extra = ["--local"] if where == "local" else []
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_with_manager.py"), str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "first run killed at step 14: True" in out.stdout
    newest = int(out.stdout.split("newest committed step after the kill: ")[1].split()[0])
    assert newest in (8, 12)  # 12 unless its commit, in the background, was not done at 14
    assert f"resumed from step {newest}: newest committed: True" in out.stdout
    assert "finished: step 24, global step 24" in out.stdout


def test_manager_example_without_lightning_says_so_in_one_line(tmp_path):
    """Lightning made unimportable the way Python spells it (a None entry in sys.modules):
    the example stops before starting any child, with one line saying what to install."""
    script = EXAMPLES / "train_with_manager.py"
    run = (
        "import runpy, sys\n"
        "sys.modules['lightning'] = None\n"
        f"sys.argv = [{str(script)!r}, {str(tmp_path)!r}, '--local']\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "train_with_manager.py needs Lightning: pip install lightning "
        "(or pip install '.[lightning]' in the clone)"
    )
    assert "first run killed" not in out.stdout and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_manager_example_stops_at_a_failed_child_with_its_error(tmp_path):
    """A child that fails on its own (here: the durable root is a file) ends the example
    with one line carrying the child's error, not a report of a kill that never happened."""
    pytest.importorskip("lightning")
    (tmp_path / "root").write_text("not a directory")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_with_manager.py"), str(tmp_path), "--local"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    assert "first run killed" not in out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("the training child exited with status 1: ")
    assert "the root tier of a CheckpointManager must be a directory" in lines[0]


def test_readme_quickstart_leaves_the_working_directory_empty(tmp_path):
    readme = (EXAMPLES.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quickstart", 1)[1]
    code = section.split("```python\n", 1)[1].split("\n```", 1)[0]
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert list(work.iterdir()) == []
