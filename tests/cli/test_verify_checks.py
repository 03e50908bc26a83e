"""`fastckpt verify` checks every hash a file records (CRC32C and XXH3-128) and says which
one failed, decodes a compressed tensor in bounded memory, and takes a series' root as
its committed steps. Real files; the memory test runs the command in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fastckpt
from fastckpt import CheckpointManager
from fastckpt.cli import main
from tests._false_hashes import record_false_xxh3


def run_main(capsys, *args) -> tuple[int, str, str]:
    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _flip_byte(path: str, name: str) -> None:
    with fastckpt.open(path) as reader:
        at = reader.header.data_offset + reader.header.entries[name].begin
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "compressed"])
def test_a_false_xxh3_is_found_and_named(tmp_path, capsys, compress):
    path = str(tmp_path / "w.safetensors")
    state = {"w": torch.randn(64, 1024), "b": torch.zeros(16)}
    fastckpt.save(state, path, compress=compress)
    assert run_main(capsys, "verify", path)[0] == 0
    # every CRC32C still matches; only the recorded XXH3-128 of "w" is false
    record_false_xxh3(path, "w", "0123456789abcdef" * 2)
    assert fastckpt.open(path).verify_failures() == {"w": "XXH3-128"}
    status, out, _ = run_main(capsys, "verify", path)
    assert status == 1
    assert out.startswith("DAMAGED") and "1 tensor does not match its checksum: w (XXH3-128)" in out


def test_a_damaged_byte_is_named_with_its_crc32c(tmp_path, capsys):
    path = str(tmp_path / "w.safetensors")
    fastckpt.save({"w": torch.randn(4096), "b": torch.zeros(16)}, path)
    _flip_byte(path, "w")
    status, out, _ = run_main(capsys, "verify", path)
    assert status == 1 and "w (CRC32C)" in out and "b (" not in out


def test_a_series_root_means_its_committed_steps(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=None) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"w": torch.full((1024,), float(step))})
    status, out, err = run_main(capsys, "verify", root)
    assert status == 0, out + err
    assert "3 files: 3 OK" in out and "step-000000000002" in out
    assert "checkpoint series" in err and f"fastckpt ls --verify {root}" in err
    _flip_byte(str(root / "step-000000000002" / "state.safetensors"), "w")
    status, out, _ = run_main(capsys, "verify", root)
    assert status == 1 and "3 files: 2 OK, 1 damaged" in out
    damaged = [line for line in out.splitlines() if line.startswith("DAMAGED")]
    assert len(damaged) == 1 and "step-000000000002" in damaged[0]
    status, out, _ = run_main(capsys, "verify", root / "step-000000000003")  # a step
    assert status == 0 and out.startswith("OK")


def test_a_series_root_without_a_committed_step_says_so(tmp_path, capsys):
    (tmp_path / "run" / "step-000000000001").mkdir(parents=True)
    status, _, err = run_main(capsys, "verify", tmp_path / "run")
    assert status == 2 and "checkpoint series" in err and "no committed step" in err


def test_verify_of_a_compressed_tensor_holds_a_few_chunks_not_the_tensor(tmp_path):
    nbytes = 256 << 20
    path = str(tmp_path / "zeros.safetensors")
    fastckpt.save({"zeros": torch.zeros(nbytes // 4)}, path, compress=True)
    assert os.path.getsize(path) < nbytes // 100  # the file is small; the tensor is not
    child = textwrap.dedent(
        f"""
        import json, resource, sys
        import torch  # noqa: F401 - the interpreter's baseline includes torch and fastckpt
        import fastckpt
        from fastckpt.cli import main
        with fastckpt.open({path!r}) as r:  # its header only: no tensor is read
            assert r.keys() == ["zeros"]
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        status = main(["verify", {path!r}])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({{"status": status, "baseline": baseline, "peak": peak}}))
        """
    )
    env = {**os.environ, "FASTCKPT_NO_PROGRESS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["status"] == 0
    assert result["peak"] - result["baseline"] < nbytes // 2, result
