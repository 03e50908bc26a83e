"""How a save writes a local file (fastckpt/io/write_mode.py): the rules in their order, the
tuned entry, the log line, and what a real save then does to the page cache."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import fastckpt
from fastckpt import config
from fastckpt.io import page_cache
from fastckpt.io.write_mode import SMALL_STATE_BYTES, choose_write_mode


@pytest.fixture
def tuned_file(tmp_path, monkeypatch):
    """A tuned-configuration file of this test's own."""
    path = tmp_path / "tuned.json"
    monkeypatch.setenv("FASTCKPT_CONFIG", str(path))
    monkeypatch.delenv("FASTCKPT_DIRECT_IO", raising=False)
    config.reload()
    yield path
    config.reload()


def test_explicit_and_environment_come_first(tuned_file, tmp_path, monkeypatch):
    target = str(tmp_path / "x.safetensors")
    big = SMALL_STATE_BYTES + 1
    assert choose_write_mode(target, 1, direct_available=True, explicit=True)[0] == "direct"
    assert choose_write_mode(target, big, direct_available=True, explicit=False) == (
        "buffered",
        "direct_io=False",
    )
    monkeypatch.setenv("FASTCKPT_DIRECT_IO", "1")
    assert choose_write_mode(target, 1, direct_available=True) == ("direct", "FASTCKPT_DIRECT_IO=1")
    monkeypatch.setenv("FASTCKPT_DIRECT_IO", "0")
    assert choose_write_mode(target, big, direct_available=True)[0] == "buffered"


def test_device_tensors_are_staged(tuned_file, tmp_path):
    mode, why = choose_write_mode(
        str(tmp_path / "x"), 1, direct_available=True, explicit=False, on_device=True
    )
    assert mode == "direct" and "GPU" in why


def test_no_direct_and_memory_file_systems_write_buffered(tuned_file, tmp_path):
    big = SMALL_STATE_BYTES + 1
    mode, why = choose_write_mode(str(tmp_path / "x"), big, direct_available=False)
    assert (mode, why) == ("buffered", "the file system refuses O_DIRECT")
    if os.path.isdir("/dev/shm") and config.filesystem_key("/dev/shm").startswith("tmpfs:"):
        mode, why = choose_write_mode("/dev/shm/x", big, direct_available=True)
        assert mode == "buffered" and "tmpfs" in why


def test_small_states_buffered_large_direct_by_default(tuned_file, tmp_path):
    target = str(tmp_path / "x")
    mode, why = choose_write_mode(target, SMALL_STATE_BYTES, direct_available=True)
    assert mode == "buffered" and "small state" in why
    mode, why = choose_write_mode(target, SMALL_STATE_BYTES + 1, direct_available=True)
    assert mode == "direct" and "no write mode tuned" in why


def test_the_tuned_winner_applies_to_large_states(tuned_file, tmp_path):
    target = str(tmp_path / "x")
    fs = config.filesystem_key(target)
    config.save_tuned_write_mode(fs, "buffered", {"direct": 0.4, "buffered": 0.5})
    mode, why = choose_write_mode(target, SMALL_STATE_BYTES + 1, direct_available=True)
    assert mode == "buffered"
    assert why == "fastckpt tune measured saves here: direct 0.4 GB/s, buffered 0.5 GB/s"
    # a small state stays buffered whatever was tuned; an explicit choice still wins
    config.save_tuned_write_mode(fs, "direct", {"direct": 0.6, "buffered": 0.5})
    assert choose_write_mode(target, 1, direct_available=True)[0] == "buffered"
    assert choose_write_mode(target, SMALL_STATE_BYTES + 1, direct_available=True)[0] == "direct"
    assert (
        choose_write_mode(target, SMALL_STATE_BYTES + 1, direct_available=True, explicit=False)[0]
        == "buffered"
    )


def test_a_damaged_tuned_entry_is_ignored(tuned_file, tmp_path):
    tuned_file.write_text(
        '{"filesystems": {"%s": {"write": {"mode": "sideways"}}}}'
        % (config.filesystem_key(str(tmp_path)))
    )
    config.reload()
    assert config.tuned_write_mode(str(tmp_path / "x")) is None
    with pytest.raises(ValueError, match="write mode must be one of"):
        config.save_tuned_write_mode("ext4:x:/", "sideways", {})


def test_a_save_logs_its_path_and_why(tuned_file, tmp_path, caplog):
    target = tmp_path / "x.safetensors"
    with caplog.at_level(logging.DEBUG, logger="fastckpt"):
        fastckpt.save({"w": torch.ones(4)}, target)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saving ")]
    assert lines and "buffered" in lines[-1] and "small state" in lines[-1], lines


def test_a_small_save_stays_in_memory_for_the_next_load(tuned_file, tmp_path):
    # Written through the page cache, the file is resident: the next load reads it from
    # memory instead of the device. A direct save leaves (most of) it out.
    state = {"w": torch.randn(256, 1024)}
    small = tmp_path / "small.safetensors"
    fastckpt.save(state, small)
    with open(small, "rb") as f:
        resident = page_cache.resident_fraction(f.fileno(), 0, os.path.getsize(small))
    if resident is None:
        pytest.skip("residency cannot be checked here")
    assert resident == 1.0
    back = fastckpt.load(small)
    assert torch.equal(back["w"], state["w"])
    with fastckpt.open(small) as reader:
        assert reader.read_mode == "buffered"


def test_without_a_size_only_the_first_rules_apply(tuned_file, tmp_path):
    # Asynchronous saves build their in-memory paths on this answer: a small state on a
    # disk must not look like a memory file system to them, whatever was tuned.
    target = str(tmp_path / "x")
    config.save_tuned_write_mode(config.filesystem_key(target), "buffered", {"buffered": 1.0})
    mode, why = choose_write_mode(target, None, direct_available=True)
    assert mode == "direct" and "no size-based choice" in why
    assert choose_write_mode(target, None, direct_available=False)[0] == "buffered"
    assert choose_write_mode(target, None, direct_available=True, explicit=False)[0] == "buffered"
