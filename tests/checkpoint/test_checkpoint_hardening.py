"""Saves and loads under bad luck: crashed writers' temporary files, a missing directory,
damaged headers, pinning that the system refuses, and lost async errors."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import fastckpt
from fastckpt.errors import HeaderError


def _temporaries(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_a_save_removes_temporaries_of_dead_writers_only(tmp_path):
    target = tmp_path / "ckpt.safetensors"
    dead = tmp_path / "ckpt.safetensors.0123456789ab.tmp"
    dead.write_bytes(b"x" * 4096)
    live = tmp_path / "ckpt.safetensors.ba9876543210.tmp"
    live.write_bytes(b"y")
    other = tmp_path / "other.safetensors.0123456789ab.tmp"  # another path's: not ours
    other.write_bytes(b"z")
    holder = subprocess.Popen(  # a live writer holds its flock
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
            str(live),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        fastckpt.save({"w": torch.ones(3)}, target)
        assert _temporaries(tmp_path) == sorted([live.name, other.name])
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    fastckpt.save({"w": torch.ones(3)}, target)
    assert _temporaries(tmp_path) == [other.name]
    assert torch.equal(fastckpt.load(target)["w"], torch.ones(3))


_SAVER = textwrap.dedent(
    """
    import sys, torch, fastckpt
    state = {"w": torch.randn(4 << 20)}
    print("ready", flush=True)
    while True:
        fastckpt.save(state, sys.argv[1])
    """
)


def test_kill_9_during_saves_leaves_no_temporaries_after_the_next_save(tmp_path):
    target = tmp_path / "ckpt.safetensors"
    for delay in (0.05, 0.3, 0.6):
        child = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(target)], stdout=subprocess.PIPE, text=True
        )
        child.stdout.readline()
        try:
            child.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGKILL)
            child.wait()
        child.stdout.close()
        if target.exists():
            fastckpt.load(target, verify=True)  # never torn
    fastckpt.save({"w": torch.zeros(2)}, target)
    assert _temporaries(tmp_path) == []


def test_a_temporary_file_is_locked_for_the_writers_life(tmp_path):
    from fastckpt.io.commit import AtomicFile

    out = AtomicFile(tmp_path / "x.bin", direct=False)
    fd = os.open(out.tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out.commit()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the commit
    finally:
        os.close(fd)
    assert (tmp_path / "x.bin").exists() and _temporaries(tmp_path) == []


def test_saving_into_a_missing_directory_names_it(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError) as info:
        fastckpt.save({"w": torch.ones(1)}, missing / "x.safetensors")
    assert info.value.filename == str(missing)
    assert ".tmp" not in str(info.value) and "x.safetensors" in str(info.value)


def _rewrite_header(path, change):
    import json
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    document = json.loads(data[8 : 8 + n])
    change(document)
    text = json.dumps(document, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text + b" " * (n - len(text)) + data[8 + n :])


def _state():
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)},
        "param_groups": [{"lr": 0.1, "params": [0]}],
        "epoch": 3,
    }


def test_damaged_structure_is_refused_by_load_and_verify(tmp_path):
    from fastckpt.cli.verify import verify_file

    path = tmp_path / "ckpt.safetensors"
    fastckpt.save(_state(), path)
    assert verify_file(path).status == "OK"

    def rename_key(document):
        meta = document["__metadata__"]
        meta["fastckpt.checkpoint.tree"] = meta["fastckpt.checkpoint.tree"].replace(
            '"epoch"', '"epocj"'
        )

    _rewrite_header(path, rename_key)
    with pytest.raises(HeaderError, match="checksum"):
        fastckpt.load(path)
    assert verify_file(path).status == "DAMAGED"


def test_verify_checks_the_tree_against_the_stored_tensors(tmp_path):
    # A header whose checksum is right but whose tree names a tensor the file lacks: load
    # refuses it, so verify must not call it OK.
    from fastckpt.cli.verify import verify_file
    from fastckpt.format import KEY_HEADER_CRC, METADATA_KEY
    from fastckpt.format.schema import canonical_crc

    path = tmp_path / "ckpt.safetensors"
    fastckpt.save(_state(), path)

    def point_elsewhere(document):
        meta = document[METADATA_KEY]
        meta["fastckpt.checkpoint.tree"] = meta["fastckpt.checkpoint.tree"].replace(
            '"n":"model/b"', '"n":"model/c"'
        )
        meta.pop(KEY_HEADER_CRC)
        meta[KEY_HEADER_CRC] = canonical_crc(document)

    _rewrite_header(path, point_elsewhere)
    with pytest.raises(HeaderError, match="does not hold"):
        fastckpt.load(path)
    verdict = verify_file(path)
    assert verdict.status == "DAMAGED" and "does not hold" in verdict.detail


def test_single_flips_in_a_saved_header_never_change_what_loads(tmp_path):
    import random
    import struct

    path = tmp_path / "ckpt.safetensors"
    fastckpt.save(_state(), path)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    end = 8 + len(data[8 : 8 + n].rstrip(b" "))
    rng = random.Random(3)
    flipped_path = tmp_path / "flipped.safetensors"
    for _ in range(150):
        flipped = bytearray(data)
        bit = rng.randrange(64, 8 * end)
        flipped[bit // 8] ^= 1 << (bit % 8)
        flipped_path.write_bytes(bytes(flipped))
        try:
            loaded = fastckpt.load(flipped_path)
        except (HeaderError, fastckpt.ChecksumError):
            continue
        assert loaded["epoch"] == 3 and loaded["param_groups"] == [{"lr": 0.1, "params": [0]}]
        assert torch.equal(loaded["model"]["w"], _state()["model"]["w"])


_PIN = textwrap.dedent(
    """
    import resource, sys, warnings, torch, fastckpt
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (4096, hard))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fastckpt.load(sys.argv[1], pin_memory=True)
    assert torch.equal(out["w"], torch.ones(1 << 20))
    print([str(w.message) for w in caught if issubclass(w.category, UserWarning)])
    """
)


def test_pin_memory_that_cannot_pin_warns(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    fastckpt.save({"w": torch.ones(1 << 20)}, path)
    command = [sys.executable, "-c", _PIN, str(path)]
    if os.geteuid() == 0:  # root pins regardless of the limit unless CAP_IPC_LOCK is gone
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv to drop CAP_IPC_LOCK")
        command = [setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", *command]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "could not be page-locked" in out.stdout and "RLIMIT_MEMLOCK" in out.stdout


def test_a_lost_async_error_is_logged_once_readably(tmp_path, caplog):
    import gc

    missing = tmp_path / "no" / "x.safetensors"
    with caplog.at_level(logging.ERROR, logger="fastckpt"):
        future = fastckpt.async_save({"w": torch.ones(2)}, missing)
        future.wait() if hasattr(future, "wait") else future.exception()
        del future
        gc.collect()
    assert "never retrieved" in caplog.text
    assert "failed> failed" not in caplog.text
    assert f"async save to {str(missing)!r} failed" in caplog.text
