"""Kept mappings: a fast tier's file mapped once, used by the saves, checksum passes and
drains over it, never hiding a reader from a spare's lease and never outliving its file."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
import torch

import fastckpt
from fastckpt import config
from fastckpt.errors import ChecksumError
from fastckpt.io import kept_mappings, parallel_io, spare_files
from fastckpt.io.commit import AtomicFile
from fastckpt.series import transfer

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="leases and tmpfs are Linux's"),
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)"),
]


@pytest.fixture
def shm():
    directory = tempfile.mkdtemp(dir="/dev/shm")
    yield directory
    kept_mappings.release_owned(directory)
    shutil.rmtree(directory, ignore_errors=True)


def _saved(directory: str, name: str, state: dict) -> str:
    path = os.path.join(directory, name)
    fastckpt.save(state, path)
    return path


def _kept(path: str) -> bool:
    with kept_mappings.borrow_path(path) as kept:
        return kept is not None


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 << 20, generator=g), "n": torch.arange(7)}


def test_a_spare_in_memory_is_mapped_once_and_the_next_save_copies_into_that_mapping(
    shm, monkeypatch
):
    spare = os.path.join(shm, ".spare.safetensors")
    old = _saved(shm, "old.safetensors", _state(1))
    assert spare_files.retire(old, spare) and _kept(spare)
    used = []
    real = parallel_io.write_mapped

    def watched(file, spans, **kwargs):
        used.append(kwargs.get("mapped_at"))
        return real(file, spans, **kwargs)

    monkeypatch.setattr(parallel_io, "write_mapped", watched)
    state = _state(2)
    expected = {k: v.clone() for k, v in state.items()}
    path = os.path.join(shm, "new.safetensors")
    future = fastckpt.async_save(state, path, spare_file=spare)
    state["w"].add_(1)  # after the call: the file holds the call-time values
    future.result()
    assert used and used[0] is not None  # no span was mapped: the spare's mapping served
    assert _kept(path)  # the same file, now the step: still mapped for the drain
    loaded = fastckpt.load(path, verify=True)  # the CRC32Cs the pass took from the mapping
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    spare_files.discard(spare)  # done with spares here: the directory's files are unmapped
    assert not _kept(path) and os.path.exists(path)


def test_a_kept_file_nobody_else_opened_becomes_the_spare_and_a_read_one_is_deleted_and_unmapped(
    shm,
):
    spare = os.path.join(shm, ".spare.safetensors")
    first = _saved(shm, "a.safetensors", _state(1))
    assert spare_files.retire(first, spare)
    fastckpt.async_save(_state(2), os.path.join(shm, "b.safetensors"), spare_file=spare).result()
    b = os.path.join(shm, "b.safetensors")
    assert _kept(b)
    # Our own mapping is no opener: the lease is asked on its descriptor.
    assert spare_files.retire(b, spare) and _kept(spare)
    fastckpt.async_save(_state(3), os.path.join(shm, "c.safetensors"), spare_file=spare).result()
    c = os.path.join(shm, "c.safetensors")
    reader = os.open(c, os.O_RDONLY)
    try:
        key = os.fstat(reader).st_ino
        assert not spare_files.retire(c, spare)  # someone reads it: deleted, not reused
        assert not os.path.exists(spare)
        assert key not in [k[1] for k in kept_mappings._kept]  # and no longer mapped by us
        loaded = torch.frombuffer(bytearray(os.pread(reader, 64, 0)), dtype=torch.uint8)
        assert loaded.numel() == 64  # the reader still has its bytes
    finally:
        os.close(reader)


def test_an_aborted_save_over_a_kept_spare_releases_the_mapping(shm):
    spare = os.path.join(shm, ".spare.safetensors")
    assert spare_files.retire(_saved(shm, "old.safetensors", _state(1)), spare)
    out = AtomicFile(os.path.join(shm, "new.safetensors"), spare=spare, size=1 << 20)
    inode = os.fstat(out.file.fd).st_ino
    assert inode in [k[1] for k in kept_mappings._kept]
    out.abort()
    assert inode not in [k[1] for k in kept_mappings._kept]


def test_a_file_cut_to_another_size_is_not_served_by_its_stale_mapping(shm):
    path = _saved(shm, "f.safetensors", _state(1))
    assert kept_mappings.keep(path, owner=shm) is not None
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, 4096)
        with kept_mappings.borrow(fd) as kept:
            assert kept is None  # a store past the new end would be a SIGBUS
        assert not _kept(path)
    finally:
        os.close(fd)


def test_a_release_waits_for_the_borrower(shm):
    path = _saved(shm, "f.safetensors", _state(1))
    kept_mappings.keep(path, owner=shm)
    fd = os.open(path, os.O_RDONLY)
    try:
        with kept_mappings.borrow(fd) as kept:
            assert kept is not None
            kept_mappings.release(path)
            view = kept.view()
            assert bytes(view[8:16]) == os.pread(fd, 8, 8)  # still mapped while borrowed
            view.release()
        assert not _kept(path)
    finally:
        os.close(fd)


def test_files_on_a_disk_are_never_kept(tmp_path):
    if config.filesystem_key(str(tmp_path)).startswith("tmpfs:"):
        pytest.skip("the temporary directory is in memory here")
    path = _saved(str(tmp_path), "f.safetensors", _state(1))
    assert kept_mappings.keep(path, owner=str(tmp_path)) is None


def test_deleted_files_are_unmapped_at_the_next_keep(shm):
    gone = _saved(shm, "gone.safetensors", _state(1))
    kept_mappings.keep(gone, owner=shm)
    inode = os.stat(gone).st_ino
    os.unlink(gone)  # by someone else (fastckpt clean, a person)
    kept_mappings.keep(_saved(shm, "other.safetensors", _state(2)), owner=shm)
    assert inode not in [k[1] for k in kept_mappings._kept]


def test_a_forked_child_holds_neither_the_mapping_nor_its_descriptor(shm):
    path = _saved(shm, "f.safetensors", _state(1))
    assert kept_mappings.keep(path, owner=shm) is not None
    inode = os.stat(path).st_ino
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: is the file open or mapped here?
        os.close(read)
        held = any(
            os.stat(f"/proc/self/fd/{fd}").st_ino == inode
            for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")
        )
        with open("/proc/self/maps") as maps:
            held = held or any(path in line for line in maps)
        os.write(write, b"held" if held else b"free")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 16)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"free"


def test_a_drain_from_a_kept_mapping_checks_every_tensor(shm, tmp_path):
    spare = os.path.join(shm, ".spare.safetensors")
    assert spare_files.retire(_saved(shm, "old.safetensors", _state(1)), spare)
    path = os.path.join(shm, "step.safetensors")
    state = _state(2)
    fastckpt.async_save(state, path, spare_file=spare).result()
    assert _kept(path)
    copy = str(tmp_path / "root" / "step.safetensors")
    transfer.copy_file(path, copy)
    assert torch.equal(fastckpt.load(copy, verify=True)["w"], state["w"])
    with open(path, "r+b") as f:  # damage in the fast tier, seen through the mapping too
        f.seek(os.path.getsize(path) - 4096)
        f.write(b"\xff" * 16)
    with pytest.raises(ChecksumError, match="damaged tensors.*w"):
        transfer.copy_file(path, str(tmp_path / "root2" / "step.safetensors"))


def test_a_manager_closing_releases_its_fast_tiers_mappings(shm, tmp_path):
    root = str(tmp_path / "root")
    state = _state(1)
    with fastckpt.CheckpointManager(root, fast=shm, keep_last=1) as manager:
        for step in range(4):
            state["w"].add_(1)
            manager.save(step, state).result()
            manager.wait()
        assert any(k.owner == shm for k in kept_mappings._kept.values())
        step, restored = manager.restore()
        assert step == 3 and torch.equal(restored["w"], state["w"])
    assert not any(k.owner == shm for k in kept_mappings._kept.values())
