"""Spare files: a retired file's storage reused by the next save, never under a reader."""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import tempfile
import threading

import pytest
import torch

import fastckpt
from fastckpt.checkpoint import asynchronous
from fastckpt.io import spare_files
from fastckpt.io.commit import AtomicFile
from tests._fences import owner

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="leases and tmpfs are Linux's"
)


def _file(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_a_file_nobody_holds_becomes_the_spare_and_the_next_file_reuses_it(tmp_path):
    old = _file(tmp_path / "old.bin", b"a" * 8192)
    inode = os.stat(old).st_ino
    spare = str(tmp_path / ".spare")
    assert spare_files.retire(old, spare) and not os.path.exists(old)
    out = AtomicFile(tmp_path / "new.bin", spare=spare, size=100)
    assert out.reused and not os.path.exists(spare)
    assert os.fstat(out.file.fd).st_ino == inode and os.path.getsize(out.tmp_path) == 100
    os.pwrite(out.file.fd, b"b" * 100, 0)
    out.commit()
    assert (tmp_path / "new.bin").read_bytes() == b"b" * 100
    assert os.stat(tmp_path / "new.bin").st_ino == inode
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


@pytest.mark.parametrize("held", ["open", "mapped"])
def test_a_file_someone_reads_is_deleted_not_reused_and_the_reader_keeps_its_bytes(tmp_path, held):
    old = _file(tmp_path / "old.bin", b"a" * 8192)
    spare = str(tmp_path / ".spare")
    fd = os.open(old, os.O_RDONLY)
    mapping = None
    if held == "mapped":  # a mapping alone (its descriptor closed) holds the file too
        mapping = mmap.mmap(fd, 8192, prot=mmap.PROT_READ)
        os.close(fd)
    assert not spare_files.retire(old, spare)
    assert not os.path.exists(old) and not os.path.exists(spare)
    out = AtomicFile(tmp_path / "new.bin", spare=spare, size=8192)  # no spare: a new file
    assert not out.reused
    os.pwrite(out.file.fd, b"b" * 8192, 0)
    out.commit()
    if mapping is not None:
        assert mapping[:] == b"a" * 8192
        mapping.close()
    else:
        assert os.pread(fd, 8192, 0) == b"a" * 8192
        os.close(fd)


def test_one_spare_at_most_and_missing_files_are_no_error(tmp_path):
    spare = str(tmp_path / ".spare")
    assert spare_files.retire(_file(tmp_path / "a", b"1"), spare)
    assert not spare_files.retire(_file(tmp_path / "b", b"2"), spare)  # deleted instead
    assert not os.path.exists(tmp_path / "b")
    with open(spare, "rb") as kept:
        assert kept.read() == b"1"
    assert not spare_files.retire(str(tmp_path / "missing"), spare)
    spare_files.discard(spare)
    spare_files.discard(spare)
    assert not os.path.exists(spare)
    with pytest.raises(ValueError, match="size="):
        AtomicFile(tmp_path / "x", spare=spare)


def test_async_save_writes_over_a_spare_and_loads_back_exactly(tmp_path):
    spare = str(tmp_path / ".spare.safetensors")
    first = {"w": torch.randn(1 << 18), "b": torch.arange(10)}
    fastckpt.save(first, tmp_path / "old.safetensors")
    spare_files.retire(str(tmp_path / "old.safetensors"), spare)
    second = {"w": torch.randn(1 << 16)}  # smaller: the spare is cut to the new size
    fastckpt.async_save(second, tmp_path / "new.safetensors", spare_file=spare).result()
    assert not os.path.exists(spare)
    loaded = fastckpt.load(tmp_path / "new.safetensors", verify=True)
    assert list(loaded) == ["w"] and torch.equal(loaded["w"], second["w"])
    compressed = str(tmp_path / ".spare2")
    fastckpt.save(first, tmp_path / "c.safetensors")
    spare_files.retire(str(tmp_path / "c.safetensors"), compressed)
    fastckpt.async_save(
        first, tmp_path / "z.safetensors", spare_file=compressed, compress=True
    ).result()
    assert os.path.exists(compressed)  # a compressed save's size is not known up front
    assert torch.equal(fastckpt.load(tmp_path / "z.safetensors")["w"], first["w"])


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)")
def test_over_a_spare_in_memory_the_snapshot_is_the_file_itself(monkeypatch):
    directory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        spare = os.path.join(directory, ".spare.safetensors")
        state = {"w": torch.randn(1 << 20), "n": torch.arange(7)}
        fastckpt.save(state, os.path.join(directory, "old.safetensors"))
        inode = os.stat(os.path.join(directory, "old.safetensors")).st_ino
        assert spare_files.retire(os.path.join(directory, "old.safetensors"), spare)

        def no_staging(*args, **kwargs):
            raise AssertionError("a save over a spare in memory used staging memory")

        monkeypatch.setattr(asynchronous, "_async_pool", no_staging)
        expected = {k: v.clone() for k, v in state.items()}
        path = os.path.join(directory, "new.safetensors")
        future = fastckpt.async_save(state, path, spare_file=spare)
        state["w"].add_(1)  # after the call: the file holds the call-time values
        future.result()
        assert os.stat(path).st_ino == inode
        loaded = fastckpt.load(path, verify=True)
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)")
def test_in_memory_over_a_spare_strided_tensors_and_incremental_saves_round_trip():
    directory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        spare = os.path.join(directory, ".spare.safetensors")
        frozen = torch.randn(1 << 18)
        state = {"frozen": frozen, "t": torch.randn(256, 64).t(), "step": torch.tensor(1)}
        first = os.path.join(directory, "1.safetensors")
        fastckpt.save(state, first)
        fastckpt.save({"junk": torch.zeros(1 << 19)}, os.path.join(directory, "junk"))
        assert spare_files.retire(os.path.join(directory, "junk"), spare)
        state["step"].add_(1)
        second = os.path.join(directory, "2.safetensors")
        fastckpt.async_save(state, second, base=first, spare_file=spare).result()
        assert not os.path.exists(spare)
        with fastckpt.open(second) as reader:
            assert reader.verify() == []
        loaded = fastckpt.load(second, verify=True)
        assert torch.equal(loaded["frozen"], frozen) and torch.equal(loaded["t"], state["t"])
        assert int(loaded["step"]) == 2
        assert os.path.getsize(second) < frozen.nbytes  # the frozen tensor is referred to
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)")
@pytest.mark.parametrize("fence_at", ["at once", "after the save"])
def test_a_lazy_save_over_a_spare_in_memory_reads_through_the_fence_into_the_file(
    monkeypatch, fence_at
):
    from fastckpt.checkpoint import file_snapshot

    monkeypatch.setattr(file_snapshot, "LAZY_PIECE", 1 << 16)  # many pieces per tensor
    directory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        spare = os.path.join(directory, ".spare.safetensors")
        fastckpt.save({"junk": torch.zeros(1 << 20)}, os.path.join(directory, "old"))
        inode = os.stat(os.path.join(directory, "old")).st_ino
        assert spare_files.retire(os.path.join(directory, "old"), spare)

        def no_ring(*args, **kwargs):
            raise AssertionError("a lazy save over a spare in memory used the staging ring")

        monkeypatch.setattr(asynchronous, "lazy_ring", no_ring)
        g = torch.Generator().manual_seed(5)
        state = {
            "w": torch.randn(1 << 19, generator=g),
            "t": torch.randn(512, 96, generator=g).t(),  # strided: read by rows
            "step": torch.tensor(3),
        }
        expected = {k: v.clone() for k, v in state.items()}
        path = os.path.join(directory, "new.safetensors")
        future = fastckpt.async_save(state, path, fence=owner(state), spare_file=spare)
        if fence_at == "at once":
            future.fence()  # the rest is snapshotted: the tensors may change now
        else:
            future.result()
        for tensor in state.values():
            tensor.add_(1)
        future.result()
        assert os.stat(path).st_ino == inode  # written over the spare's pages
        loaded = fastckpt.load(path, verify=True)
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)")
def test_a_lazy_save_over_a_spare_in_memory_fails_naming_a_tensor_changed_unfenced(monkeypatch):
    from fastckpt.checkpoint import file_snapshot

    started = threading.Event()  # the writer copies nothing until the change is made
    fill = file_snapshot.LazyIntoFile.fill

    def after_the_change(self, **options):
        assert started.wait(30)
        return fill(self, **options)

    monkeypatch.setattr(file_snapshot.LazyIntoFile, "fill", after_the_change)
    directory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        spare = os.path.join(directory, ".spare.safetensors")
        fastckpt.save({"junk": torch.zeros(1 << 20)}, os.path.join(directory, "old"))
        assert spare_files.retire(os.path.join(directory, "old"), spare)
        state = {"a": torch.zeros(1 << 20), "b": torch.zeros(1 << 20)}
        path = os.path.join(directory, "new.safetensors")
        future = fastckpt.async_save(state, path, fence=owner(state), spare_file=spare)
        state["b"].add_(1)  # outside the fenced step
        started.set()
        with pytest.raises(fastckpt.LazySaveError) as caught:
            future.result()
        assert "'b'" in str(caught.value)
        assert not os.path.exists(path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)")
@pytest.mark.parametrize("lazy", [False, True])
def test_a_series_with_spares_writes_into_memory_before_it_has_one(monkeypatch, lazy):
    """The first saves of a series that keeps spares have none yet: they are written into
    their new file in memory all the same, so no staging memory is ever allocated."""

    def no_staging(*args, **kwargs):
        raise AssertionError("a save of a series with spares in memory used staging memory")

    monkeypatch.setattr(asynchronous, "_async_pool", no_staging)
    monkeypatch.setattr(asynchronous, "lazy_ring", no_staging)
    directory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        spare = os.path.join(directory, ".spare.safetensors")  # none yet
        state = {"w": torch.randn(1 << 20), "n": torch.arange(7)}
        expected = {k: v.clone() for k, v in state.items()}
        path = os.path.join(directory, "first.safetensors")
        fenced = {"fence": owner(state)} if lazy else {}
        future = fastckpt.async_save(state, path, spare_file=spare, **fenced)
        future.fence()
        state["w"].add_(1)  # after the call (eager) or the fence (lazy)
        future.result()
        loaded = fastckpt.load(path, verify=True)
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)
        assert not os.path.exists(spare)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
