"""The read path of a cold local file is chosen by measurement: ``fastckpt tune`` times
O_DIRECT, buffered and mapped loads and remembers the winner per file system; loads follow
it (or ``FASTCKPT_READ_MODE``), say why, and verify checksums in the same pass whatever
the path. Real files, a real page cache (evicted with posix_fadvise), the real CLI."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from _page_cache import drop_from_page_cache

import fastckpt
from fastckpt.config import READ_MODES, filesystem_key, save_tuned_read_mode, tuned_read_mode
from fastckpt.io.files import File
from fastckpt.io.parallel_io import Span, read_buffered, read_mapped


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(3 << 18, generator=g),  # 3 MiB: several pieces and spans
        "odd": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g),
        "half": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 5),
    }


def test_mapped_reads_give_the_bytes_and_checksums_of_buffered_reads(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, 5 << 20, dtype=np.uint8)
    path = tmp_path / "raw.bin"
    data.tofile(path)

    def spans(buffer: np.ndarray) -> list[Span]:
        base = buffer.ctypes.data
        return [
            Span(0, base, 3 << 20, (100, 5000, 2 << 20)),
            Span(3 << 20, base + (3 << 20), 2 << 20),
        ]

    buffered, mapped = np.empty_like(data), np.empty_like(data)
    with File(str(path)) as f:
        expected = read_buffered(f, spans(buffered))
        assert read_mapped(f, spans(mapped)) == expected
        assert read_mapped(f, spans(np.empty_like(data)), checksum=False) == [[], []]
    assert np.array_equal(mapped, data)


def test_a_mapped_read_past_the_end_names_the_file(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 4096)
    out = np.empty(8192, dtype=np.uint8)
    with File(str(path)) as f, pytest.raises(OSError) as caught:
        read_mapped(f, [Span(0, out.ctypes.data, 8192)])
    assert caught.value.errno == errno.ENODATA and caught.value.filename == str(path)


@pytest.mark.parametrize("mode", list(READ_MODES))
def test_every_forced_read_mode_loads_and_verifies(tmp_path, monkeypatch, mode):
    path = tmp_path / "ckpt.safetensors"
    state = _state()
    fastckpt.save(state, path)
    drop_from_page_cache(path)
    monkeypatch.setenv("FASTCKPT_READ_MODE", mode)
    with fastckpt.open(path) as reader:
        assert reader.read_mode == mode
    back = fastckpt.load(path, verify=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    # a damaged byte is found in the same pass, on every path
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    drop_from_page_cache(path)
    with pytest.raises(fastckpt.ChecksumError, match="is damaged"):
        fastckpt.load(path, verify=True)


def test_resident_bytes_are_read_buffered_whatever_was_tuned(tmp_path, monkeypatch):
    path = tmp_path / "hot.safetensors"
    fastckpt.save(_state(), path)
    monkeypatch.setenv("FASTCKPT_READ_MODE", "mapped")
    with open(path, "rb") as f:
        f.read()  # every page resident
    with fastckpt.open(path) as reader:
        assert reader.read_mode == "buffered"


def test_a_bad_read_mode_variable_is_named(tmp_path, monkeypatch):
    path = tmp_path / "x.safetensors"
    fastckpt.save({"w": torch.ones(4)}, path)
    drop_from_page_cache(path)
    monkeypatch.setenv("FASTCKPT_READ_MODE", "fast")
    with pytest.raises(
        ValueError, match="FASTCKPT_READ_MODE must be one of direct, staged, buffered"
    ):
        fastckpt.load(path)


def test_loads_follow_the_tuned_read_mode_and_say_why(tmp_path, capsys):
    path = tmp_path / "tuned.safetensors"
    state = _state()
    fastckpt.save(state, path)
    assert tuned_read_mode(path) is None
    save_tuned_read_mode(filesystem_key(tmp_path), "mapped", {"direct": 1.0, "mapped": 3.5})
    mode, why = tuned_read_mode(path)
    assert mode == "mapped" and "mapped 3.5 GB/s" in why
    drop_from_page_cache(path)
    with fastckpt.open(path) as reader:
        assert reader.read_mode == "mapped"
    back = fastckpt.load(path)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    drop_from_page_cache(path)
    from fastckpt.cli import main

    assert main(["inspect", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "read mode now: mapped" in shown and "fastckpt tune measured" in shown
    with pytest.raises(ValueError, match="read mode must be one of"):
        save_tuned_read_mode(filesystem_key(tmp_path), "fastest", {})


def test_tune_measures_every_read_mode_and_remembers_the_winner(tmp_path):
    config = tmp_path / "tuned.json"
    target = tmp_path / "disk"
    target.mkdir()
    env = {**os.environ, "FASTCKPT_CONFIG": str(config), "FASTCKPT_NO_PROGRESS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastckpt",
            "tune",
            "--nvme_dir",
            str(target),
            "--quick",
            "--io_size",
            "8M",
            "--loops",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "cold checkpoint loads per read mode" in done.stdout
    entry = json.loads(config.read_text())["filesystems"][filesystem_key(target)]
    if "read" not in entry:  # the cache could not be emptied here: the output says so
        assert "read modes not measured" in done.stdout
        return
    assert set(entry["read"]["gbps"]) == set(READ_MODES)
    best = max(entry["read"]["gbps"], key=entry["read"]["gbps"].get)
    assert entry["read"]["mode"] == best
    assert f"-> {best}" in done.stdout
    assert not [n for n in os.listdir(target) if n.startswith(".fastckpt-tune-read")]
