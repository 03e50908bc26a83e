"""The small print of DeepSpeed's DeepNVMe API: file modes, locked-tensor bookkeeping,
``is_pinned`` over whole buffers and ``get_alignment``."""

from __future__ import annotations

import ctypes
import gc
import os
import re
import stat

import numpy as np
import pytest
import torch

from fastckpt.aio import aio_handle, aio_write


@pytest.fixture
def umask_022():
    """A usual umask, so that the mode the file is created with shows in its permissions."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize(
    "write",
    [
        lambda h, t, p: h.write(t, p),
        lambda h, t, p: h.sync_pwrite(t, p),
        lambda h, t, p: (h.async_pwrite(t, p), h.wait()),
        lambda h, t, p: h.pwrite(t, p, False, False),
        lambda h, t, p: aio_write(t, p, 1 << 20, 8, False, False, True),
    ],
    ids=["write", "sync_pwrite", "async_pwrite", "pwrite", "aio_write"],
)
def test_files_the_handle_creates_are_private(tmp_path, umask_022, write):
    path = tmp_path / "swap.bin"
    data = torch.arange(5000, dtype=torch.int32)
    write(aio_handle(), data, str(path))
    assert _mode(path) == 0o600  # DeepSpeed's open(..., O_CREAT, 0600)
    back = torch.empty_like(data)
    aio_handle().sync_pread(back, str(path))
    assert torch.equal(back, data)


def test_an_existing_file_keeps_its_mode_and_other_bytes(tmp_path, umask_022):
    path = tmp_path / "shared.bin"
    path.write_bytes(b"x" * 8192)
    os.chmod(path, 0o640)
    aio_handle().sync_pwrite(torch.zeros(16, dtype=torch.uint8), str(path), 4096)
    assert _mode(path) == 0o640
    content = path.read_bytes()
    assert len(content) == 8192 and content[4096:4112] == bytes(16)
    assert content[:4096] == b"x" * 4096 and content[4112:] == b"x" * (8192 - 4112)


def test_creating_in_a_missing_directory_names_the_file(tmp_path):
    path = tmp_path / "missing" / "swap.bin"
    with pytest.raises(FileNotFoundError) as info:
        aio_handle().sync_pwrite(torch.zeros(4), str(path))
    assert info.value.filename == str(path)


def test_a_locked_tensor_is_freed_through_any_handle():
    # DeepSpeed's handles share one pinned-tensor manager.
    first, second = aio_handle(), aio_handle()
    t = first.new_cpu_locked_tensor(1024, torch.empty(0, dtype=torch.float32))
    assert second.is_pinned(t)
    assert second.free_cpu_locked_tensor(t) is True
    assert first.free_cpu_locked_tensor(t) is False  # already freed


def test_a_locked_tensor_outlives_the_handle_that_made_it():
    t = aio_handle().new_cpu_locked_tensor(1024, torch.empty(0, dtype=torch.uint8))
    gc.collect()
    t.fill_(7)
    assert int(t.sum()) == 7 * 1024
    assert aio_handle().free_cpu_locked_tensor(t) is True


def test_foreign_tensors_are_not_freed():
    h = aio_handle()
    t = h.new_cpu_locked_tensor(1024, torch.empty(0, dtype=torch.uint8))
    assert h.free_cpu_locked_tensor(torch.empty(1024, dtype=torch.uint8)) is False
    assert h.free_cpu_locked_tensor(t[1:]) is False  # not the allocation's first byte
    assert h.free_cpu_locked_tensor(torch.empty(0)) is False
    assert h.free_cpu_locked_tensor(t[:16]) is True  # a view from the first byte names it


def test_a_dropped_locked_tensor_leaves_the_registry():
    h = aio_handle()
    t = h.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.uint8))
    address = t.data_ptr()
    del t
    gc.collect()
    from fastckpt.deepnvme import locked_memory

    assert locked_memory.extent_of(address) is None


def _tensor_at(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over raw memory (only its address and length are looked at)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def test_is_pinned_checks_the_whole_buffer():
    h = aio_handle()
    t = h.new_cpu_locked_tensor(8192, torch.empty(0, dtype=torch.uint8))
    start = t.data_ptr()
    assert h.is_pinned(t) and h.is_pinned(t[100:]) and h.is_pinned(t[:4096])
    assert h.is_pinned(_tensor_at(start + 4096, 4096))  # ends on the last byte
    # Starts inside the locked tensor, ends past it: the tail is not locked.
    assert not h.is_pinned(_tensor_at(start + 4096, 4097))
    assert not h.is_pinned(_tensor_at(start, 8193))
    assert h.free_cpu_locked_tensor(t)


def test_is_pinned_over_a_smaller_than_page_locked_tensor():
    # The allocation is 1000 bytes though its page is locked: DeepSpeed counts the tensor's bytes.
    h = aio_handle()
    t = h.new_cpu_locked_tensor(250, torch.empty(0, dtype=torch.float32))
    assert h.is_pinned(t)
    assert not h.is_pinned(_tensor_at(t.data_ptr(), 1001))
    assert h.free_cpu_locked_tensor(t)


@pytest.mark.parametrize("parallelism", [1, 2, 3, 8])
def test_get_alignment_is_deepspeeds(parallelism):
    h = aio_handle(intra_op_parallelism=parallelism, engine="threads")
    assert h.get_alignment() == 512 * parallelism


def test_any_alignment_works_however_get_alignment_reads(tmp_path):
    # get_alignment is advice for DeepSpeed's helpers; fastckpt takes any offset and length.
    h = aio_handle(intra_op_parallelism=3)
    data = np.arange(1000, dtype=np.uint8)
    h.sync_pwrite(data, str(tmp_path / "a.bin"), 7)
    back = np.empty_like(data)
    h.sync_pread(back, str(tmp_path / "a.bin"), 7)
    assert (back == data).all() and os.path.getsize(tmp_path / "a.bin") == 1007


def test_gibps_is_the_unit_of_deepspeeds_gb_per_sec():
    # ds_io's "GB/sec" is total_bytes / seconds / 1024**3.
    from fastckpt.bench.units import gbps, gibps

    assert gibps(1024**3 * 6, 2.0) == 3.0
    assert gbps(10**9 * 6, 2.0) == 3.0
    assert gibps(10**9, 1.0) == pytest.approx(10**9 / 2**30)


def test_raw_bench_prints_both_units(tmp_path, capsys, monkeypatch):
    from fastckpt.cli import main

    monkeypatch.setenv("FASTCKPT_NO_PROGRESS", "1")
    argv = ["bench", "--folder", str(tmp_path), "--io_size", "1M", "--loops", "1"]
    assert main(argv + ["--engine", "threads"]) == 0
    stdout = capsys.readouterr().out
    loop = re.search(r"^Loop 1: write ([0-9.e+-]+) GB/s = ([0-9.e+-]+) GiB/s", stdout, re.M)
    median = re.search(r"^Median write: ([0-9.e+-]+) GB/s = ([0-9.e+-]+) GiB/s", stdout, re.M)
    assert loop and median, stdout
    for found in (loop, median):
        decimal, binary = float(found[1]), float(found[2])
        assert binary == pytest.approx(
            decimal * 1e9 / 2**30, rel=1e-2
        )  # both rounded to 3 significant digits
    assert "GiB/s: 2^30 bytes per second, what ds_io prints as GB/sec" in stdout
