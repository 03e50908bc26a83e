"""`fastckpt bench` on tiny sizes, run as a user runs it (in a subprocess) and in-process."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FASTCKPT_NO_PROGRESS="1")
    return subprocess.run(
        [sys.executable, "-m", "fastckpt", *map(str, args)],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=120,
    )


def loop_rates(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^Loop \d+: \w+ ([0-9.e+-]+) GB/s", stdout, re.MULTILINE)]


def test_bench_write_and_read_with_validation(tmp_path):
    write = run_cli(
        "bench",
        "--folder",
        tmp_path,
        "--io_size",
        "1M",
        "--loops",
        "2",
        "--validate",
        "--engine",
        "threads",
        "--block_size",
        "64K",
        "--queue_depth",
        "4",
        "--io_parallel",
        "3",
        "--single_submit",
        "--overlap_events",
        "false",
    )
    assert write.returncode == 0, write.stderr
    assert len(loop_rates(write.stdout)) == 2 and all(r > 0 for r in loop_rates(write.stdout))
    assert "Median write:" in write.stdout and "Validation passed" in write.stdout
    # The configuration measured is the one asked for.
    assert (
        '"block_size": 65536, "queue_depth": 4, "single_submit": true, "overlap_events": false, '
        '"intra_op_parallelism": 3, "engine": "threads"'
    ) in write.stdout

    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_bench_read_with_validation(tmp_path, capsys):
    # In-process, through the same main() as the console script (a subprocess would spend
    # most of its time importing torch).
    from fastckpt.cli import main

    args = ["--folder", tmp_path, "--io_size", "1M", "--loops", "2", "--read", "--validate"]
    status = main(["bench", *map(str, args), "--intra_op_parallelism", "2"])
    out = capsys.readouterr().out
    assert status == 0
    assert "Median read:" in out and "Cold reads:" in out and "Validation passed" in out
    assert '"intra_op_parallelism": 2' in out
    assert len(loop_rates(out)) == 2
    assert list(tmp_path.iterdir()) == []


def test_bench_checkpoint_table(tmp_path):
    result = run_cli(
        "bench", "--folder", tmp_path, "--checkpoint", "512K", "--loops", "1", "--validate"
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split() and line.split()[0] in ("fastckpt", "torch.save/load", "safetensors")
    }
    assert set(rows) == {"fastckpt", "torch.save/load", "safetensors"}
    for cells in rows.values():
        assert float(cells[1]) > 0 and float(cells[2]) > 0  # save and load GB/s
    assert rows["fastckpt"][-3:] == ["1.00x", "/", "1.00x"]
    assert "Validation passed" in out
    assert list(tmp_path.iterdir()) == []


def test_bench_usage_errors(tmp_path, capsys):
    import torch

    from fastckpt.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    work = tmp_path / "work"
    work.mkdir()
    cases = [
        ["--folder", str(blocker)],
        ["--folder", str(work), "--loops", "0"],
        ["--folder", str(work), "--engine", "warp_drive"],
        ["--folder", str(work), "--io_size", "-1M"],
        ["--folder", str(work), "--overlap_events", "maybe"],
        ["--folder", str(work), "--checkpoint", "1M", "--read"],
        ["--folder", str(work), "--checkpoint", "10"],
    ]
    if not torch.cuda.is_available():
        cases += [["--folder", str(work), "--gpu"], ["--folder", str(work), "--gds"]]
    for args in cases:
        assert main(["bench", *args]) == 2, args
        assert "error" in capsys.readouterr().err
    assert list(work.iterdir()) == []


def test_bench_creates_a_missing_folder(tmp_path, capsys):
    from fastckpt.cli import main

    folder = tmp_path / "new" / "demo"
    assert main(["bench", "--folder", str(folder), "--io_size", "1M", "--loops", "1"]) == 0
    assert folder.is_dir() and list(folder.iterdir()) == []
    assert "GB/s" in capsys.readouterr().out


def test_synthetic_state_dict_is_llm_like():
    import torch

    from fastckpt.cli.synthetic import (
        MIN_NBYTES,
        llm_like_state_dict,
        plan_shapes,
        state_dict_nbytes,
    )

    for nbytes in (MIN_NBYTES, 100_000, 3 << 20):
        sd = llm_like_state_dict(nbytes)
        d = sd["model.norm.weight"].shape[0]
        assert 0 <= nbytes - state_dict_nbytes(sd) < 8 * d
        assert {t.dtype for t in sd.values()} == {torch.float32, torch.bfloat16}
        assert any(t.dim() == 1 for t in sd.values()) and any(t.dim() == 2 for t in sd.values())
    plan = plan_shapes(16 << 30)
    assert plan["model.layers.0.self_attn.q_proj.weight"] == ("bfloat16", (4096, 4096))
    assert plan["model.layers.0.mlp.up_proj.weight"] == ("bfloat16", (11008, 4096))
    with pytest.raises(ValueError):
        plan_shapes(MIN_NBYTES - 1)
