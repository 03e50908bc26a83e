"""The command line facing hostile files and careless use: escaped output, clean errors,
the right usage, and ``tune`` with a time budget."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import torch

import fastckpt
from fastckpt.cli import main


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fastckpt", *map(str, args)],
        capture_output=True,
        text=True,
        env=dict(os.environ, FASTCKPT_NO_PROGRESS="1"),
        timeout=timeout,
    )


def _raw_file(path, document, data=b""):
    text = json.dumps(document, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_inspect_escapes_control_characters(tmp_path, capsys):
    path = tmp_path / "evil.safetensors"
    fastckpt.save({"w\x1b]0;owned\x07": torch.ones(1)}, path, metadata={"note\x1b[2J": "a\rb"})
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out
    assert "w\\x1b]0;owned\\x07" in out and "note\\x1b[2J: a\\rb" in out
    assert "1 tensor," in out and "1 tensors" not in out


def test_verify_reports_impossible_shapes_without_a_traceback(tmp_path):
    path = tmp_path / "huge.safetensors"
    _raw_file(path, {"z": {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}})
    for command in ("verify", "inspect"):
        out = run_cli(command, path)
        assert out.returncode == 1 and "Traceback" not in out.stderr + out.stdout
        assert "int64" in out.stdout + out.stderr


def test_convert_of_a_text_file_names_it(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello everyone\n")
    out = run_cli("convert", notes, tmp_path / "out.safetensors")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert str(notes) in out.stderr and "not a torch.save or safetensors file" in out.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_load_and_inspect_name_torch_save_files(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, path)
    out = run_cli("inspect", path)
    assert out.returncode == 1 and "torch.save file" in out.stdout + out.stderr
    assert "fastckpt convert" in out.stdout + out.stderr


def test_a_misspelled_flag_shows_the_commands_usage(capsys):
    assert main(["verify", "--bogus", "x.safetensors"]) == 2
    err = capsys.readouterr().err
    assert "usage: fastckpt verify" in err and "--bogus" in err


def test_tune_creates_its_directory_keeps_a_budget_and_says_why(tmp_path):
    missing = tmp_path / "nvme"  # its last component only: a missing parent is an error
    out = run_cli(
        "tune",
        "--nvme_dir",
        missing,
        "--io_size",
        "1M",
        "--engine",
        "threads",
        "--quick",
        "--budget",
        "0.01",
    )
    assert out.returncode == 0, out.stderr
    assert missing.is_dir() and f"Created --nvme_dir {missing}" in out.stdout
    # The budget stops the sweep after the first configuration of the quick sweep's four.
    assert "Time budget of 0 s spent after 1 of 4 configurations" in out.stdout
    assert "Why: " in out.stdout and "harmonic mean" in out.stdout
    help_text = " ".join(run_cli("tune", "--help").stdout.split())  # unwrapped
    assert "last component is created when missing" in help_text


def test_inspect_and_verify_refuse_a_fifo_at_once(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    for command in ("inspect", "verify"):
        # Opening a FIFO for reading waits for a writer: a hang ends in TimeoutExpired here.
        out = run_cli(command, fifo, timeout=60)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert "not a regular file" in out.stdout + out.stderr
        assert str(fifo) in out.stdout + out.stderr
