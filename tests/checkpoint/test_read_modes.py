"""The memory-speed data path: loads through the page cache or O_DIRECT (chosen per file),
mmap loads, saves from the tensors' own memory, and a reader's lifetime."""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch
from _page_cache import drop_from_page_cache
from safetensors.torch import load_file

import fastckpt
from fastckpt.checkpoint.read import _plan_spans
from fastckpt.checkpoint.save import _through_page_cache, plan_save
from fastckpt.checkpoint.tensor_runs import tensor_runs
from fastckpt.io.commit import AtomicFile
from fastckpt.storage.local import span_bytes


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "huge": torch.randn(3 << 18, generator=g),  # 3 MiB: spans several pieces below
        "odd": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g),
        "half": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 5),
        "step": torch.tensor(7),
        "transposed": torch.randn(64, 32, generator=g).t(),  # not contiguous
    }


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("direct_io", [None, True, False])
@pytest.mark.parametrize("save_direct", [True, False])
def test_every_read_and_write_mode_round_trips(io_dir, direct_io, save_direct):
    state = _state()
    path = os.path.join(io_dir, "modes.safetensors")
    fastckpt.save(state, path, direct_io=save_direct)
    assert _equal(load_file(path), {k: v.contiguous() for k, v in state.items()})
    assert _equal(fastckpt.load(path, direct_io=direct_io, verify=True), state)
    with fastckpt.open(path) as reader:
        assert reader.verify() == []


def test_read_mode_follows_the_page_cache(tmp_path, monkeypatch):
    path = tmp_path / "cache.safetensors"
    fastckpt.save(_state(), path)
    with fastckpt.open(path) as reader:
        if reader.storage.local_file().direct_fd < 0:
            pytest.skip("this file system refuses O_DIRECT")
        drop_from_page_cache(path)
        # untuned: O_DIRECT through the staging pool, or straight O_DIRECT when the cores
        # are busy (tests/io/test_cpu_load.py checks which, the busy signal passed in)
        assert reader.read_mode in ("staged", "direct")
        path.read_bytes()  # a buffered read makes it hot
        assert reader.read_mode == "buffered"
    assert fastckpt.open(path, direct_io=True).read_mode == "direct"
    monkeypatch.setenv("FASTCKPT_DIRECT_IO", "1")
    assert fastckpt.open(path).read_mode == "direct"
    monkeypatch.setenv("FASTCKPT_DIRECT_IO", "0")
    drop_from_page_cache(path)
    assert fastckpt.open(path).read_mode == "buffered"


def test_memory_file_systems_read_and_write_through_the_page_cache():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/fastckpt-mode-{os.getpid()}.safetensors"
    try:
        fastckpt.save(_state(), path)
        assert fastckpt.open(path).read_mode == "buffered"
        out = AtomicFile(path)
        try:
            assert _through_page_cache(plan_save(_state()), out, None)
        finally:
            out.abort()
    finally:
        os.unlink(path)


def test_one_large_tensor_is_split_across_workers():
    """A single tensor must not serialize: it becomes many spans whose CRCs are joined."""
    entries = plan_save({"w": torch.zeros(64 << 18)}).entries  # 64 MiB
    runs = tensor_runs(entries)
    runs[0].arena_pos = 0
    spans, labels = _plan_spans(runs, 4096, 0, step=span_bytes(64 << 20, "buffered"))
    assert len(spans) >= 2 * fastckpt.io.parallel_io.worker_count()
    assert {name for segments in labels for name, *_ in segments} == {"w"}
    assert sum(s.nbytes for s in spans) == 64 << 20


@pytest.mark.parametrize("direct_io", [True, False])
def test_damage_inside_a_split_tensor_is_named(tmp_path, direct_io):
    path = tmp_path / "damaged.safetensors"
    fastckpt.save({"big": torch.zeros(8 << 18), "small": torch.ones(3)}, path)
    with fastckpt.open(path) as reader:
        at = reader.info("big").offset + (5 << 20) + 123
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\x01")
    with pytest.raises(fastckpt.ChecksumError) as info:
        fastckpt.load(path, direct_io=direct_io)
    assert info.value.tensor == "big" and str(path) in str(info.value)
    assert fastckpt.load(path, direct_io=direct_io, verify=False)["small"].tolist() == [1, 1, 1]


def test_a_file_truncated_while_open_is_an_error_naming_it(tmp_path):
    path = tmp_path / "shrinks.safetensors"
    fastckpt.save({"w": torch.ones(1 << 20)}, path)
    with fastckpt.open(path, direct_io=False) as reader:
        os.truncate(path, 8192)
        with pytest.raises(OSError) as info:
            reader.get_tensor("w")
    assert info.value.errno == errno.ENODATA and info.value.filename == str(path)


def test_mmap_load_is_lazy_private_and_verifiable(tmp_path):
    state = _state()
    path = tmp_path / "mapped.safetensors"
    fastckpt.save(state, path)
    mapped = fastckpt.load(path, mmap=True)
    assert _equal(mapped, state)
    mapped["huge"][0] = 123.0  # copy-on-write: the file keeps its bytes
    assert fastckpt.load(path)["huge"][0] == state["huge"][0]
    assert _equal(fastckpt.load(path, mmap=True, keys=["odd"]), {"odd": state["odd"]})
    with fastckpt.open(path) as reader:
        at = reader.info("odd").offset + 100
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([(state["odd"][100].item() + 1) % 256]))
    fastckpt.load(path, mmap=True)  # no verification unless asked: nothing is read
    with pytest.raises(fastckpt.ChecksumError, match="odd"):
        fastckpt.load(path, mmap=True, verify=True)
    with pytest.raises(ValueError, match="mmap"):
        fastckpt.load(path, mmap=True, pin_memory=True)


def test_reading_after_close_is_refused(tmp_path):
    path = tmp_path / "closed.safetensors"
    fastckpt.save({"w": torch.ones(4)}, path)
    reader = fastckpt.open(path)
    reader.close()
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.get_tensor("w")


def test_close_waits_for_prefetches(tmp_path):
    path = tmp_path / "prefetch.safetensors"
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(16)}
    fastckpt.save(state, path)
    reader = fastckpt.open(path)
    reader.prefetch(list(state))
    reader.close()  # must not close descriptors under reads still running
    assert not reader._in_flight


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_dropped_readers_release_descriptors_and_memory(tmp_path):
    path = tmp_path / "dropped.safetensors"
    fastckpt.save({"w": torch.ones(1 << 18)}, path)
    before = _open_fds()
    for _ in range(30):
        reader = fastckpt.open(path)
        reader.prefetch(["w"])
        del reader
    for _ in range(50):  # prefetch threads finish, then nothing holds the readers
        gc.collect()
        if _open_fds() <= before + 2:
            break
        import time

        time.sleep(0.1)
    assert _open_fds() <= before + 2
