"""Small states and mappings load without the I/O engine: a small file in memory is read on
the calling thread (one pread per run of tensors, checksummed in the same pass), and
``mmap=True`` maps through one plain descriptor. Both must give what the engine's path
gives, and check what they promise to check. Real files, real page cache, real FIFO."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch
from _page_cache import drop_from_page_cache

import fastckpt
from fastckpt.checkpoint import load as local_load
from fastckpt.io.page_cache import resident_fraction
from fastckpt.storage.resident_file import PageCacheFile, ResidentFile


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    shared = torch.randn(8, 3, generator=g)
    return {
        "model": {"w": torch.randn(64, 33, generator=g), "emb": shared, "head": shared},
        "half": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "odd": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "step": 12,
        "lr": 0.5,
        "name": "run-1",
        "nested": [torch.arange(5), (torch.ones(2, dtype=torch.float64), None)],
    }


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _flip(path, name: str) -> None:
    """Flips a byte of the tensor stored under ``name`` (the copy, for a tied alias)."""
    with fastckpt.open(path) as r:
        offset = r.header.data_offset + r.header.entries[name].begin
    with open(path, "r+b") as f:
        f.seek(offset + 1)
        b = f.read(1)
        f.seek(offset + 1)
        f.write(bytes([b[0] ^ 0xFF]))


def _light(path, *, mmap: bool = False):
    storage = local_load._light_storage(os.fspath(path), mmap=mmap)
    if storage is not None:
        storage.close()
    return storage


def test_a_small_file_in_memory_is_read_without_the_engine(tmp_path):
    path = tmp_path / "s.safetensors"
    fastckpt.save(_state(), path)
    with open(path, "rb") as f:  # in the page cache
        f.read()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert resident_fraction(fd, 0, os.path.getsize(path)) == 1.0
    finally:
        os.close(fd)
    assert isinstance(_light(path), ResidentFile)
    assert isinstance(_light(path, mmap=True), PageCacheFile)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_small_file_on_tmpfs_is_read_without_the_engine():
    path = f"/dev/shm/fastckpt-small-{os.getpid()}-{threading.get_ident()}.safetensors"
    try:
        fastckpt.save(_state(), path)
        assert isinstance(_light(path), ResidentFile)
        _assert_same(fastckpt.load(path), fastckpt.load(path, direct_io=False))
    finally:
        os.remove(path)


def test_larger_or_cold_files_take_the_engine(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    fastckpt.save(_state(), path)
    monkeypatch.setattr(local_load, "SMALL_FILE_BYTES", os.path.getsize(path) - 1)
    assert _light(path) is None
    monkeypatch.undo()
    drop_from_page_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        cold = resident_fraction(fd, 0, os.path.getsize(path))
    finally:
        os.close(fd)
    if cold is None or cold >= 0.5:
        pytest.skip("the kernel kept the pages")
    assert _light(path) is None
    _assert_same(fastckpt.load(path), _state())


def test_forced_direct_io_takes_the_engine(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    fastckpt.save(_state(), path)
    monkeypatch.setenv("FASTCKPT_DIRECT_IO", "1")
    assert _light(path) is None
    monkeypatch.setenv("FASTCKPT_DIRECT_IO", "0")
    assert isinstance(_light(path), ResidentFile)
    monkeypatch.setenv("FASTCKPT_READ_MODE", "sideways")
    with pytest.raises(ValueError, match="FASTCKPT_READ_MODE"):
        fastckpt.load(path)


def test_the_small_path_returns_what_the_engine_returns(tmp_path):
    path = tmp_path / "s.safetensors"
    state = _state()
    fastckpt.save(state, path)
    small = fastckpt.load(path)
    engine = fastckpt.load(path, direct_io=False)  # an I/O option: the engine's path
    _assert_same(small, engine)
    _assert_same(small, state)
    assert small["model"]["emb"] is small["model"]["head"]  # tied, as saved
    for t in (small["model"]["w"], small["odd"], small["half"]):
        # a storage of its own, as torch.load's tensors have
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
    small["model"]["w"].add_(1)  # its own memory: the file is not changed
    _assert_same(fastckpt.load(path)["model"]["w"], state["model"]["w"])


def test_the_small_path_reads_keys_and_pinned_memory(tmp_path):
    path = tmp_path / "s.safetensors"
    state = _state()
    fastckpt.save(state, path)
    assert isinstance(_light(path), ResidentFile)
    only = fastckpt.load(path, keys=["model/w", "odd"])
    assert list(only) == ["model/w", "odd"]
    assert torch.equal(only["model/w"], state["model"]["w"])
    with fastckpt.open(path) as r:  # reads one run per key's range, nothing more
        before = r.bytes_read
        r.get_tensor("odd")
        assert r.bytes_read - before == state["odd"].nbytes
    with _no_warning_or_unpinned():
        pinned = fastckpt.load(path, pin_memory=True)
    _assert_same(pinned, state)


class _no_warning_or_unpinned:
    """pin_memory=True warns only where the system refuses to lock memory."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("ignore", message=".*could not be page-locked.*")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


def test_the_small_path_detects_a_flipped_byte(tmp_path):
    path = tmp_path / "s.safetensors"
    fastckpt.save(_state(), path)
    _flip(path, "model/w")
    assert isinstance(_light(path), ResidentFile)
    with pytest.raises(fastckpt.ChecksumError, match="'model/w'") as caught:
        fastckpt.load(path)
    assert caught.value.filename == str(path)
    with pytest.raises(fastckpt.ChecksumError):
        fastckpt.load(path, keys=["model/w"])
    damaged = fastckpt.load(path, verify=False)  # asked not to check: the bytes as stored
    assert not torch.equal(damaged["model"]["w"], _state()["model"]["w"])
    assert torch.equal(damaged["odd"], _state()["odd"])


def test_the_small_path_checks_the_stored_copy_of_a_tied_tensor(tmp_path):
    path = tmp_path / "s.safetensors"
    fastckpt.save(_state(), path)
    with fastckpt.open(path) as r:
        alias = next(iter(r.aliases))
    _flip(path, alias)  # the copy a safetensors reader returns under the alias
    with pytest.raises(fastckpt.ChecksumError, match=repr(alias)):
        fastckpt.load(path, verify=True)


def test_the_small_path_verify_true_needs_checksums(tmp_path):
    path = tmp_path / "s.safetensors"
    fastckpt.save({"w": torch.ones(3)}, path, checksum=False)
    assert torch.equal(fastckpt.load(path)["w"], torch.ones(3))
    with pytest.raises(fastckpt.NoChecksumsError):
        fastckpt.load(path, verify=True)


def test_a_file_cut_short_is_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    fastckpt.save(_state(), path)
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(fastckpt.HeaderError, match="s.safetensors"):
        fastckpt.load(path)


def test_what_is_no_regular_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as caught:  # opening a FIFO for reading would block
        fastckpt.load(str(fifo))
    assert caught.value.errno == errno.EINVAL and str(fifo) in str(caught.value)
    with pytest.raises(FileNotFoundError):
        fastckpt.load(tmp_path / "missing.safetensors")


def test_mmap_gives_the_saved_tensors_as_private_views(tmp_path):
    path = tmp_path / "m.safetensors"
    state = _state()
    fastckpt.save(state, path)
    mapped = fastckpt.load(path, mmap=True)
    _assert_same(mapped, state)
    assert mapped["model"]["emb"] is mapped["model"]["head"]
    mapped["model"]["w"].zero_()  # copy-on-write: the file keeps its bytes
    _assert_same(fastckpt.load(path, mmap=True)["model"]["w"], state["model"]["w"])
    assert fastckpt.open(path).verify() == []


def test_mmap_checks_crcs_only_when_asked(tmp_path):
    path = tmp_path / "m.safetensors"
    fastckpt.save(_state(), path)
    _flip(path, "odd")
    mapped = fastckpt.load(path, mmap=True)  # as documented: no check without verify=True
    assert not torch.equal(mapped["odd"], _state()["odd"])
    with pytest.raises(fastckpt.ChecksumError, match="'odd'"):
        fastckpt.load(path, mmap=True, verify=True)
    with pytest.raises(fastckpt.ChecksumError, match="'odd'"):
        fastckpt.load(path, mmap=True, verify=True, keys=["odd"])


def test_mmap_verify_checks_the_stored_copy_of_a_tied_tensor(tmp_path):
    path = tmp_path / "m.safetensors"
    fastckpt.save(_state(), path)
    with fastckpt.open(path) as r:
        alias = next(iter(r.aliases))
    _flip(path, alias)
    with pytest.raises(fastckpt.ChecksumError, match=repr(alias)):
        fastckpt.load(path, mmap=True, verify=True)


def test_mmap_of_a_file_object_or_fifo_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    fastckpt.save(_state(), path)
    with open(path, "rb") as f, pytest.raises(Exception, match="path|local file"):
        fastckpt.load(f, mmap=True)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError):
        fastckpt.load(str(fifo), mmap=True)
