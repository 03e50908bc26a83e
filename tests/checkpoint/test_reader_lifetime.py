"""What a reader promises about its lifetime and its arguments: close() waits for reads in
flight and refuses later ones; a load checks its target before reading; read_mode says how
bytes are really read."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.storage import local as local_storage
from fastckpt.storage.local import LocalStorage


def test_close_while_reads_run_waits_for_them(tmp_path):
    """Reads racing close() finish or are refused with ValueError: never EBADF from a file
    closed under them."""
    path = tmp_path / "race.safetensors"
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}  # 32 MiB
    fastckpt.save(state, path)
    for attempt in range(6):
        reader = fastckpt.open(path)
        errors: list[BaseException] = []
        started = threading.Barrier(5)

        def read_all(reader=reader, started=started, errors=errors) -> None:
            started.wait()
            try:
                for _ in range(5):
                    got = reader.get_tensors(list(state), verify=True)
                    assert all(torch.equal(got[n], state[n]) for n in state)
            except ValueError as exc:
                assert "closed" in str(exc)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=read_all) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait()
        time.sleep(0.002 * attempt)  # close at different points of the reads
        reader.close()
        for t in threads:
            t.join()
        assert not errors, errors
        with pytest.raises(ValueError, match="closed"):
            reader.get_tensors(["t0"])


@pytest.mark.parametrize("where", ["mps", torch.device("xpu"), {"cpu": "mps"}])
def test_an_unsupported_target_is_refused_before_reading(tmp_path, where):
    # the file does not exist: a load that read first would raise FileNotFoundError
    with pytest.raises(ValueError, match="not supported"):
        fastckpt.load(tmp_path / "missing.safetensors", map_location=where)
    with pytest.raises(ValueError, match="not supported"):
        fastckpt.load(f"memory://nowhere-{os.getpid()}/x.safetensors", map_location=where)
    with pytest.raises(ValueError, match="not supported"):
        fastckpt.load(tmp_path, map_location=where)  # a directory (of shards)


def test_read_mode_is_the_mode_used_when_o_direct_is_refused(tmp_path):
    """A file system that refuses O_DIRECT is read through the page cache even with
    direct_io=True, and read_mode says so."""
    mount = tmp_path / "ramfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("cannot mount a ramfs here (needs root)")
    try:
        path = mount / "x.safetensors"
        fastckpt.save({"w": torch.ones(1 << 16)}, path)
        with fastckpt.open(path, direct_io=True) as reader:
            if reader.storage.local_file().direct_fd >= 0:
                pytest.skip("this kernel's ramfs takes O_DIRECT")
            assert reader.read_mode == "buffered"
            assert reader.get_tensor("w").sum().item() == 1 << 16
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_o_direct_refused_for_reads_is_found_at_open(tmp_path):
    """A descriptor that took O_DIRECT at open but refuses reads is dropped by the probe at
    open, so the reads and read_mode use the page cache."""
    path = tmp_path / "probe.safetensors"
    fastckpt.save({"w": torch.ones(1 << 16)}, path)
    local = LocalStorage(path, direct_io=True)
    file = local.local_file()
    if file.direct_fd < 0:
        pytest.skip("this file system refuses O_DIRECT")
    os.close(file.direct_fd)
    # a descriptor of the same file that refuses reads (opened for writing only), probed as
    # the first file of its file system in this process (the answer is kept per file system)
    file.direct_fd = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
    device = os.stat(path).st_dev
    kept = local_storage._DIRECT_READS.pop(device, None)
    try:
        local._probe_direct()
        assert file.direct_fd == -1
        assert local_storage._DIRECT_READS[device] is False
        with fastckpt.CheckpointReader(local) as reader:
            assert reader.read_mode == "buffered"
            assert reader.get_tensor("w").sum().item() == 1 << 16
    finally:
        local_storage._DIRECT_READS.pop(device, None)
        if kept is not None:
            local_storage._DIRECT_READS[device] = kept


def test_o_direct_reads_are_probed_once_per_file_system(tmp_path):
    """The probe reads from the device: a second file of the same file system is not
    probed again (its answer is the file system's), and still reads correctly."""
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    fastckpt.save({"w": torch.ones(4096)}, first)
    fastckpt.save({"w": torch.full((4096,), 2.0)}, second)
    with LocalStorage(first, direct_io=True) as local:
        if local.local_file().direct_fd < 0:
            pytest.skip("this file system refuses O_DIRECT")
    assert os.stat(first).st_dev in local_storage._DIRECT_READS
    probes = []
    original = local_storage._direct_read_works
    local_storage._direct_read_works = lambda *a: probes.append(a) or original(*a)
    try:
        with fastckpt.open(second) as reader:
            assert reader.get_tensor("w").sum().item() == 2 * 4096
    finally:
        local_storage._direct_read_works = original
    assert probes == []
