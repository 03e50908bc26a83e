"""`fastckpt inspect`, `convert` and `verify`.

Each command runs at least once as a user runs it, in a subprocess through
``python -m fastckpt`` (and the console script once); the other cases call the same
``main()`` in-process, since a subprocess spends most of its time importing torch.
"""

from __future__ import annotations

import fractions
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import fastckpt
from tests.python_processes import run


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FASTCKPT_NO_PROGRESS="1")
    return run([sys.executable, "-m", "fastckpt", *map(str, args)], env=env, timeout=120)


def run_main(capsys, *args) -> tuple[int, str, str]:
    from fastckpt.cli import main

    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def describe(path) -> dict:
    from fastckpt.cli.inspect import describe_file

    return describe_file(path)


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(64, 64, generator=g),  # 16 KiB: a multiple of 4096
        "layer.bias": torch.randn(7, generator=g),
        "embed": torch.randn(10, 3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(5, dtype=torch.int64),
    }


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "model.safetensors"
    fastckpt.save(sample_state(), path, metadata={"step": "10", "note": "hello"})
    return path


@pytest.fixture
def plain(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "plain.safetensors"
    save_file(sample_state(), str(path), metadata={"origin": "safetensors"})
    return path


# ------------------------------------------------------------------------ inspect


def test_inspect_json_layout(ckpt):
    result = run_cli("inspect", "--json", ckpt)
    assert result.returncode == 0, result.stderr
    (info,) = json.loads(result.stdout)
    tensors = {t["name"]: t for t in info["tensors"]}
    assert set(tensors) == set(sample_state())
    assert set(tensors["embed"]) == {"name", "dtype", "shape", "bytes", "offset", "alignment"}
    assert tensors["embed"]["dtype"] == "BF16" and tensors["embed"]["shape"] == [10, 3]
    assert info["checksums"] is True and info["checksummed"] == 4
    assert info["metadata"]["step"] == "10"
    assert info["total_bytes"] == sum(t["bytes"] for t in tensors.values())
    assert info["file_size"] == os.path.getsize(ckpt)
    # The data section starts aligned, and the 4096-multiple tensor comes first.
    assert info["data_offset"] % 4096 == 0
    assert tensors["layer.weight"]["offset"] == info["data_offset"]
    assert tensors["layer.weight"]["alignment"] == 4096
    for t in tensors.values():
        assert t["offset"] % t["alignment"] == 0
        assert t["alignment"] & (t["alignment"] - 1) == 0 and t["alignment"] <= 4096
    # The offsets are absolute: the bytes there are the tensor's.
    raw = ckpt.read_bytes()
    bias = tensors["layer.bias"]
    expected = sample_state()["layer.bias"].numpy().tobytes()
    assert raw[bias["offset"] : bias["offset"] + bias["bytes"]] == expected


def test_inspect_table(ckpt, capsys):
    status, out, _ = run_main(capsys, "inspect", ckpt)
    assert status == 0
    for name in sample_state():
        assert name in out
    assert "CRC32C for 4 of 4 tensors" in out
    assert "step: 10" in out and "note: hello" in out
    assert "BF16" in out and "[64, 64]" in out


def test_inspect_plain_safetensors_and_directory(tmp_path, capsys, ckpt, plain):
    status, out, _ = run_main(capsys, "inspect", "--json", tmp_path)
    assert status == 0
    by_name = {os.path.basename(i["path"]): i for i in json.loads(out)}
    assert set(by_name) == {"model.safetensors", "plain.safetensors"}
    assert by_name["plain.safetensors"]["checksums"] is False
    assert by_name["plain.safetensors"]["fastckpt_version"] is None
    assert by_name["plain.safetensors"]["metadata"]["origin"] == "safetensors"
    status, out, _ = run_main(capsys, "inspect", plain)
    assert status == 0 and "checksums: none" in out


def test_inspect_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    status, out, _ = run_main(capsys, "inspect", bad)
    assert status == 1 and "header length" in out
    status, out, _ = run_main(capsys, "inspect", "--json", bad)
    assert status == 1 and "header length" in json.loads(out)[0]["error"]
    assert run_main(capsys, "inspect", tmp_path / "missing.safetensors")[0] == 2


# ------------------------------------------------------------------------ verify


def flip_byte(path, tensor: str, at: int = 5) -> None:
    entry = next(t for t in describe(path)["tensors"] if t["name"] == tensor)
    with open(path, "r+b") as f:
        f.seek(entry["offset"] + at)
        byte = f.read(1)
        f.seek(entry["offset"] + at)
        f.write(bytes([byte[0] ^ 0x10]))


def test_verify_catches_a_flipped_byte(ckpt, capsys):
    status, out, _ = run_main(capsys, "verify", ckpt)
    assert status == 0, out
    assert out.startswith("OK")
    flip_byte(ckpt, "layer.bias")
    result = run_cli("verify", ckpt)
    assert result.returncode == 1
    assert "DAMAGED" in result.stdout and "layer.bias" in result.stdout
    assert "layer.weight" not in result.stdout


def test_verify_without_checksums_is_not_intact(plain, capsys):
    status, out, _ = run_main(capsys, "verify", plain)
    assert status == 1
    assert "UNVERIFIABLE" in out and "no checksums" in out


def test_verify_bad_header_is_damage(ckpt, capsys):
    with open(ckpt, "r+b") as f:
        f.seek(8)
        f.write(b"[")  # the JSON no longer starts with '{'
    status, out, _ = run_main(capsys, "verify", ckpt)
    assert status == 1
    assert "DAMAGED" in out and "bad header" in out


def test_verify_directory_and_usage_errors(tmp_path, capsys, ckpt, plain):
    status, out, _ = run_main(capsys, "verify", tmp_path)
    assert status == 1
    assert "2 files: 1 OK, 1 unverifiable" in out
    assert run_main(capsys, "verify", tmp_path / "nope")[0] == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_main(capsys, "verify", empty)[0] == 2
    assert run_main(capsys, "verify")[0] == 2


# ------------------------------------------------------------------------ convert


def test_convert_pt_round_trip(tmp_path, capsys):
    state = {"model": sample_state(), "epoch": 3, "lrs": [0.1, 0.01], "tied": None}
    state["model"]["tied.weight"] = state["model"]["layer.weight"]
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    mid = tmp_path / "ckpt.safetensors"
    back = tmp_path / "back.pt"
    first = run_cli("convert", src, mid)
    assert first.returncode == 0, first.stderr
    assert "fastckpt layout" in first.stdout
    status, _, err = run_main(capsys, "convert", mid, back)
    assert status == 0, err
    for path in (mid, back):
        if path.suffix == ".safetensors":
            loaded = fastckpt.load(path)
        else:
            loaded = torch.load(path, weights_only=True)
        assert loaded["epoch"] == 3 and loaded["lrs"] == [0.1, 0.01] and loaded["tied"] is None
        for name, tensor in state["model"].items():
            assert loaded["model"][name].dtype == tensor.dtype
            assert torch.equal(loaded["model"][name], tensor)
        # Shared storage stays shared.
        tied, weight = loaded["model"]["tied.weight"], loaded["model"]["layer.weight"]
        assert tied.data_ptr() == weight.data_ptr()
    from fastckpt.cli.verify import verify_file

    assert verify_file(mid).ok


def test_convert_safetensors_keeps_metadata(tmp_path, capsys, plain):
    dst = tmp_path / "converted.safetensors"
    status, _, err = run_main(capsys, "convert", plain, dst)
    assert status == 0, err
    info = describe(dst)
    assert info["metadata"]["origin"] == "safetensors"
    assert info["checksums"] is True
    from safetensors.torch import load_file

    loaded = load_file(str(dst))
    for name, tensor in sample_state().items():
        assert torch.equal(loaded[name], tensor)


def test_convert_refuses_to_overwrite(tmp_path, capsys, ckpt):
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"precious")
    status, _, err = run_main(capsys, "convert", ckpt, dst)
    assert status == 2
    assert "--force" in err
    assert dst.read_bytes() == b"precious"
    status, _, err = run_main(capsys, "convert", ckpt, dst, "--force")
    assert status == 0, err
    assert torch.equal(torch.load(dst, weights_only=True)["embed"], sample_state()["embed"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "out.pt"]


def test_convert_pickle_needs_opt_in(tmp_path, capsys):
    src = tmp_path / "odd.pt"
    # a Fraction: neither torch.load(weights_only=True) nor fastckpt stores it as data
    torch.save({"w": torch.ones(3), "ratio": fractions.Fraction(1, 3)}, src)
    dst = tmp_path / "odd.safetensors"
    status, _, err = run_main(capsys, "convert", src, dst)
    assert status == 1
    assert "--allow-pickle" in err
    assert not dst.exists()
    status, _, err = run_main(capsys, "convert", src, dst, "--allow-pickle")
    assert status == 0, err
    assert "warning" in err and "trust" in err
    loaded = fastckpt.load(dst, weights_only=False)
    assert loaded["ratio"] == fractions.Fraction(1, 3)


def test_convert_usage_errors(tmp_path, capsys, ckpt):
    assert run_main(capsys, "convert", tmp_path / "missing.pt", tmp_path / "x.safetensors")[0] == 2
    assert run_main(capsys, "convert", ckpt, ckpt, "--force")[0] == 2
    assert run_main(capsys, "convert", ckpt)[0] == 2
    assert run_main(capsys, "convert", ckpt, tmp_path / "x", "--bogus")[0] == 2
    assert run_main(capsys, "convert", ckpt, tmp_path)[0] == 2  # DST is a directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


# ------------------------------------------------------------------------ entry points


@pytest.mark.parametrize("command", ["tune", "bench", "inspect", "convert", "verify"])
def test_help(capsys, command):
    status, out, _ = run_main(capsys, command, "--help")
    assert status == 0
    assert out.startswith(f"usage: fastckpt {command}")


def test_console_script_usage_error():
    script = shutil.which("fastckpt")
    if script is None:
        pytest.skip("the fastckpt console script is not on PATH")
    result = subprocess.run(
        [script, "tune"], capture_output=True, check=False, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "the following arguments are required: --nvme_dir" in result.stderr
