"""What a first session with the command line meets: files with the usual permissions, a
whole pickled model converted to its weights, scratch folders that do not outlive the
command, help that leads with the common case, and a nested checkpoint's values shown."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

import fastckpt
from tests.python_processes import run


def run_cli(*args: object, umask: int | None = None, timeout: float = 300):
    return run(
        [sys.executable, "-m", "fastckpt", *map(str, args)],
        env=dict(os.environ, FASTCKPT_NO_PROGRESS="1"),
        umask=umask,
        timeout=timeout,
    )


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_convert_to_torch_follows_the_umask(tmp_path, umask):
    src = tmp_path / "x.safetensors"
    fastckpt.save({"w": torch.arange(4.0)}, src)
    for dst in ("y.pt", "z.safetensors"):
        done = run_cli("convert", src, tmp_path / dst, umask=umask)
        assert done.returncode == 0, done.stderr
        assert mode(tmp_path / dst) == 0o666 & ~umask, (dst, oct(mode(tmp_path / dst)))
    assert torch.equal(torch.load(tmp_path / "y.pt")["w"], torch.arange(4.0))


def test_convert_of_a_whole_model_writes_its_state_dict(tmp_path):
    # the module's class must be importable by the converting process: save it from a script
    script = tmp_path / "make.py"
    script.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, 3)\n"
        "        self.register_buffer('steps', torch.tensor(7))\n"
        "if __name__ == '__main__':\n"
        "    import sys\n"
        "    from make import Net\n"
        "    torch.manual_seed(0)\n"
        "    net = Net()\n"
        "    torch.save(net, 'whole.pt')\n"
        "    torch.save({'model': net, 'epoch': 2}, 'nested.pt')\n"
        "    torch.save(net.state_dict(), 'expected.pt')\n"
    )
    subprocess.run([sys.executable, str(script)], cwd=tmp_path, check=True, timeout=120)
    expected = torch.load(tmp_path / "expected.pt")

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastckpt",
            "convert",
            "--allow-pickle",
            "whole.pt",
            "w.safetensors",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "0 tensors" not in done.stdout and "3 tensors" in done.stdout, done.stdout
    assert "state dict" in done.stderr and "Net" in done.stderr, done.stderr
    back = fastckpt.load(tmp_path / "w.safetensors")
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastckpt",
            "convert",
            "--allow-pickle",
            "nested.pt",
            "n.safetensors",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "['model']" in done.stderr, done.stderr
    back = fastckpt.load(tmp_path / "n.safetensors")
    assert back["epoch"] == 2 and torch.equal(back["model"]["fc.weight"], expected["fc.weight"])


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(
            ["bench", "--checkpoint", "8M", "--loops", "1", "--no-drop-caches", "--folder"],
            marks=pytest.mark.slow,  # the same folder handling as bench-raw, with a full bench
        ),
        ["bench", "--io_size", "1M", "--loops", "1", "--no-drop-caches", "--folder"],
        ["tune", "--io_size", "1M", "--quick", "--no-drop-caches", "--no_read", "--nvme_dir"],
    ],
    ids=["bench-checkpoint", "bench-raw", "tune"],
)
def test_a_folder_the_command_created_is_removed_when_left_empty(tmp_path, args):
    created, existing = tmp_path / "created", tmp_path / "existing"
    existing.mkdir()
    for folder in (created, existing):
        done = run_cli(*args, folder)
        assert done.returncode == 0, done.stderr
    assert not created.exists()  # made by the command, left empty: gone
    assert existing.is_dir()  # there before: kept


def test_a_folder_the_command_created_is_removed_after_a_failure(tmp_path):
    created = tmp_path / "created"
    done = run_cli("bench", "--checkpoint", "1", "--folder", created)  # below the minimum size
    assert done.returncode == 2
    assert not created.exists()


def test_bench_help_leads_with_the_checkpoint_comparison():
    done = run_cli("bench", "--help")
    assert done.returncode == 0
    usage, _, rest = done.stdout.partition("\n\n")
    assert usage.split("[")[2].startswith("--checkpoint SIZE"), usage
    assert rest.lstrip().startswith("--checkpoint SIZE saves and loads"), rest[:200]
    options = [line.split()[0] for line in rest.splitlines() if line.startswith("  --")]
    assert options[0] == "--checkpoint", options


def test_inspect_shows_a_nested_checkpoints_values(tmp_path):
    path = tmp_path / "n.safetensors"
    model = torch.nn.Linear(2, 2)
    fastckpt.save(
        {"model": model.state_dict(), "epoch": 3, "args": {"lr": 0.1, "name": "run"}}, path
    )
    done = run_cli("inspect", path)
    assert done.returncode == 0, done.stderr
    assert "    epoch: 3\n" in done.stdout, done.stdout
    assert "    args: {'lr': 0.1, 'name': 'run'}\n" in done.stdout, done.stdout
    described = json.loads(run_cli("inspect", "--json", path).stdout)
    assert described[0]["values"] == {"epoch": "3", "args": "{'lr': 0.1, 'name': 'run'}"}
