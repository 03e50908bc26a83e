"""The command line facing hostile files and careless use: escaped output, clean errors,
the right usage, and ``tune`` with a time budget."""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

import fastckpt
from fastckpt.cli import main
from tests.python_processes import run


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run(
        [sys.executable, "-m", "fastckpt", *map(str, args)],
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
    assert out.returncode == 2 and "torch.save file" in out.stdout + out.stderr
    assert "fastckpt convert" in out.stdout + out.stderr


def test_verify_names_a_torch_save_file_without_calling_it_damaged(tmp_path, capsys):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, path)
    assert main(["verify", str(path)]) == 2  # the wrong kind of file: an input error
    out = capsys.readouterr().out
    assert out.startswith("NOT CHECKED") and "DAMAGED" not in out and "bad header" not in out
    assert "a torch.save file (a zip archive), not a fastckpt/safetensors file" in out
    assert f"`fastckpt convert {path} OUT.safetensors`" in out
    # Damage elsewhere wins: a torch.save file never hides it.
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    fastckpt.save({"w": torch.ones(2)}, tmp_path / "good.safetensors")
    assert main(["verify", str(path), str(bad)]) == 1
    assert main(["verify", str(path), str(tmp_path / "good.safetensors")]) == 2
    assert "2 files: 1 OK, 1 not checked" in capsys.readouterr().out
    assert main(["inspect", str(path), str(bad)]) == 1


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_help_states_the_exit_statuses(command, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 " in text and "; 1 " in text and "; 2 usage and input errors" in text
    assert "--allow_pickle" in text


def _two_word_options(parser: argparse.ArgumentParser) -> list[list[str]]:
    return [
        [o for o in action.option_strings if o.startswith("--")]
        for action in parser._actions
        if any(o.startswith("--") and ("-" in o[2:] or "_" in o[2:]) for o in action.option_strings)
    ]


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_two_word_options_take_both_spellings(command):
    from fastckpt.cli import build_parser

    parser = build_parser().commands[command]
    options = _two_word_options(parser)
    assert options, command
    for spellings in options:
        for option in spellings:
            twin = "--" + (
                option[2:].replace("-", "_") if "-" in option[2:] else option[2:].replace("_", "-")
            )
            assert twin in spellings, (command, option)


def test_underscore_spellings_work(tmp_path, capsys):
    src = tmp_path / "odd.pt"
    torch.save({"w": torch.ones(3), "counts": collections.Counter(a=2)}, src)
    assert main(["convert", str(src), str(tmp_path / "odd.safetensors"), "--allow_pickle"]) == 0
    fastckpt.save({"w": torch.ones(3)}, tmp_path / "w.safetensors")
    assert main(["convert", "--to_dcp", str(tmp_path / "w.safetensors"), str(tmp_path / "d")]) == 0
    assert main(["verify", "--allow_pickle", str(tmp_path / "d")]) == 0
    assert main(["inspect", "--allow_pickle", str(tmp_path / "d")]) == 0


def test_convert_exit_statuses(tmp_path, capsys):
    fastckpt.save({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    (tmp_path / "b.pt").write_bytes(b"precious")
    assert main(["convert", str(tmp_path / "a.safetensors"), str(tmp_path / "b.pt")]) == 2
    assert main(["convert", str(tmp_path / "none.pt"), str(tmp_path / "c.safetensors")]) == 2
    assert main(["convert", str(tmp_path / "b.pt"), str(tmp_path / "c.safetensors")]) == 2
    zipped = tmp_path / "cut.pt"
    torch.save({"w": torch.ones(1000)}, zipped)
    zipped.write_bytes(zipped.read_bytes()[:600])  # a damaged torch.save file
    assert main(["convert", str(zipped), str(tmp_path / "c.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "exists; pass --force" in err and "no such file" in err
    assert (tmp_path / "b.pt").read_bytes() == b"precious"


_USER_MODULE = """
import torch


class Box:
    def __init__(self):
        self.t = torch.ones(2)
        self.label = "box"
"""


@pytest.fixture
def user_class_file(tmp_path, monkeypatch):
    """``obj.pt`` in a folder beside ``boxes_of_the_user.py``, whose class it holds."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "boxes_of_the_user.py").write_text(_USER_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    module = importlib.import_module("boxes_of_the_user")
    torch.save({"box": module.Box(), "w": torch.zeros(3)}, folder / "obj.pt")
    monkeypatch.delitem(sys.modules, "boxes_of_the_user")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(folder)])
    return folder


def test_console_script_allow_pickle_imports_from_the_working_directory(user_class_file):
    script = shutil.which("fastckpt")
    if script is None:
        pytest.skip("the fastckpt console script is not on PATH")
    out = subprocess.run(
        [script, "convert", "--allow-pickle", "obj.pt", "obj.safetensors"],
        capture_output=True,
        text=True,
        cwd=user_class_file,
        env=dict(os.environ, FASTCKPT_NO_PROGRESS="1"),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (user_class_file / "obj.safetensors").is_file()


def test_a_module_that_cannot_be_imported_is_named(user_class_file, tmp_path, monkeypatch, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    src = str(user_class_file / "obj.pt")
    assert main(["convert", "--allow-pickle", src, "out.safetensors"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "boxes_of_the_user" in err and "PYTHONPATH" in err
    assert str(elsewhere) not in sys.path
    assert not (elsewhere / "out.safetensors").exists()


def test_a_refused_class_is_one_line_without_escape_codes(user_class_file, capsys):
    src = str(user_class_file / "obj.pt")
    assert main(["convert", src, str(user_class_file / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and err.count("\n") == 1, err
    assert "boxes_of_the_user.Box" in err and "--allow-pickle" in err and "trust" in err


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
    assert f"Created --nvme_dir {missing}" in out.stdout
    assert not missing.exists()  # created, then removed: the sweep left it empty
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
