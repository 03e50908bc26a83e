"""Reused page-locked buffers registered with io_uring (fixed buffers).

A registration pins the buffer's pages for the ring; it must go with the buffer, or a new
buffer mapped at the same address would be written from the old pages.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from fastckpt import _C
from fastckpt.deepnvme import aio_handle
from fastckpt.io.engines import engines

pytestmark = pytest.mark.skipif(
    not engines()["io_uring"].available, reason="io_uring is not available here"
)

MIB = 1 << 20


def _handle() -> aio_handle:
    # two worker threads: two rings, each registering what it moves
    return aio_handle(MIB, 8, False, True, 2, engine="io_uring")


def _locked(handle: aio_handle, nbytes: int, fill: int) -> torch.Tensor:
    t = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    t.fill_(fill)
    return t


def test_a_reused_buffer_is_registered_on_first_use_and_released_with_it(tmp_path):
    handle = _handle()
    buf = _locked(handle, 8 * MIB, 0x5A)
    address = buf.data_ptr()
    assert _C.registered_memory_count(address) == 0  # registered lazily, by the I/O
    path = str(tmp_path / "w.bin")
    assert handle.sync_pwrite(buf, path) == 1
    assert _C.registered_memory_count(address) >= 1  # in the ring of each worker that moved it
    assert _C.registered_memory_count() >= 2
    with open(path, "rb") as f:
        assert f.read() == bytes([0x5A]) * (8 * MIB)
    handle.free_cpu_locked_tensor(buf)
    del buf
    gc.collect()
    assert _C.registered_memory_count(address) == 0


def test_a_new_buffer_at_a_freed_buffers_address_writes_its_own_bytes(tmp_path):
    # Freed and allocated again, a mapping of the same size usually comes back at the same
    # address: a registration left behind would write the old pages' bytes. (3 MiB: below
    # the size whose mappings are trimmed to huge-page boundaries, which moves them.)
    handle = _handle()
    path = str(tmp_path / "w.bin")
    size, addresses = 3 * MIB, []
    while len(addresses) < 24 and len(addresses) - len(set(addresses)) < 3:
        i = len(addresses)
        buf = _locked(handle, size, i + 1)
        addresses.append(buf.data_ptr())
        assert handle.sync_pwrite(buf, path, file_offset=i * size) == 1
        handle.free_cpu_locked_tensor(buf)
        del buf
        gc.collect()
    assert len(set(addresses)) < len(addresses), "no address was reused: the test proves nothing"
    with open(path, "rb") as f:
        for i in range(len(addresses)):
            assert f.read(size) == bytes([i + 1]) * size, f"region {i}"


def test_reads_into_registered_memory_and_parts_of_it(tmp_path):
    handle = _handle()
    path = str(tmp_path / "r.bin")
    data = os.urandom(8 * MIB)
    with open(path, "wb") as f:
        f.write(data)
    buf = _locked(handle, 16 * MIB, 0)
    assert handle.sync_pwrite(buf[: 4 * MIB], str(tmp_path / "warm.bin")) == 1
    assert _C.registered_memory_count(buf.data_ptr()) > 0
    # the whole file into the middle of the buffer: a part of registered memory
    assert handle.sync_pread(buf[4 * MIB : 12 * MIB], path) == 1
    assert bytes(buf[4 * MIB : 12 * MIB].numpy()) == data
    assert not buf[: 4 * MIB].any() and not buf[12 * MIB :].any()


def test_a_fork_drops_registrations_and_a_child_freeing_a_buffer_leaves_the_parent_be(tmp_path):
    # Pages pinned for DMA would be copied into the child at fork: registrations are dropped
    # just before it (the buffers stay locked), and made again at their next use.
    handle = _handle()
    buf = _locked(handle, 4 * MIB, 7)
    address = buf.data_ptr()
    assert handle.sync_pwrite(buf, str(tmp_path / "a.bin")) == 1
    assert _C.registered_memory_count(address) > 0
    pid = os.fork()
    if pid == 0:  # the child frees its copy of the buffer; the rings are the parent's
        code = 1
        try:
            handle.free_cpu_locked_tensor(buf)
            del buf
            gc.collect()
            code = 0 if not _C.is_locked(address) else 3  # 3: the buffer was not freed
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _C.registered_memory_count(address) == 0
    buf.fill_(9)
    assert handle.sync_pwrite(buf, str(tmp_path / "b.bin")) == 1
    assert _C.registered_memory_count(address) > 0  # registered again by its next use
    with open(tmp_path / "b.bin", "rb") as f:
        assert f.read() == bytes([9]) * (4 * MIB)


def test_forks_during_saves_neither_hang_nor_damage_them(tmp_path):
    # Each fork drops the registrations of buffers whose writes may be in flight (the kernel
    # keeps what a request uses until it completes); the saves go on, registering again.
    import threading

    import fastckpt

    state = {"w": torch.randn(24 << 20)}  # 96 MiB: several staging buffers per save
    errors: list[BaseException] = []
    done = threading.Event()

    def saving() -> None:
        try:
            for i in range(4):
                path = str(tmp_path / f"s{i}.safetensors")
                fastckpt.save(state, path, direct_io=True)
                assert torch.equal(fastckpt.load(path, verify=True)["w"], state["w"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    saver = threading.Thread(target=saving)
    saver.start()
    forks = 0
    while not done.is_set():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        forks += 1
    saver.join(timeout=120)
    assert not saver.is_alive() and not errors, errors
    assert forks > 0
