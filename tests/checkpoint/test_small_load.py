"""The one-pass load of a small file (small_load.py) and the small save: the data section
read by one pread, or as two halves on two threads whose checksums are joined, tensors that
own their memory (no file mapping unless mmap=True), a helper thread that a forked child
starts again, a fast header-entry check that accepts nothing the full one refuses, and a
small save that takes O_DIRECT's path when asked. Real files, real fork."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import fastckpt
from fastckpt.checkpoint import small_load
from fastckpt.format import header as header_module


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(3000, generator=g),  # 12000 bytes: across the middle of the data
        "b": torch.randn(1024, generator=g),  # 4096 bytes
        "c": torch.arange(7, dtype=torch.int16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }


def _entries(path) -> tuple[int, dict]:
    with fastckpt.open(path) as r:
        return r.header.data_offset, dict(r.header.entries)


def _flip_at(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_halves_on_two_threads_check_every_tensor(tmp_path, monkeypatch, where):
    monkeypatch.setattr(small_load, "SPLIT_BYTES", 4096)  # this small state is read as halves
    path = tmp_path / "s.safetensors"
    fastckpt.save(_state(), path)
    _same(fastckpt.load(path), _state())
    _same(fastckpt.load(path, verify=False), _state())
    base, entries = _entries(path)
    size = max(e.end for e in entries.values())
    half = size // 2 // 4096 * 4096
    at = {"first": 0, "middle": half, "last": size - 1}[where]
    if where == "middle":  # the byte just before the cut: its segment is joined across it
        at -= 1
    victim = next(e.name for e in entries.values() if e.begin <= at < e.end)
    _flip_at(path, base + at)
    with pytest.raises(fastckpt.ChecksumError, match=repr(victim)):
        fastckpt.load(path)
    damaged = fastckpt.load(path, verify=False)  # not asked to check: the bytes as stored
    assert not torch.equal(damaged[victim], _state()[victim])


def test_a_tensor_starting_at_the_cut_is_checked_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(small_load, "SPLIT_BYTES", 4096)
    path = tmp_path / "s.safetensors"
    # two 8 KiB tensors: the cut between the halves falls where the second one starts
    fastckpt.save({"x": torch.ones(2048), "y": torch.full((2048,), 2.0)}, path)
    base, entries = _entries(path)
    assert {e.begin for e in entries.values()} == {0, 8192}
    _same(fastckpt.load(path), {"x": torch.ones(2048), "y": torch.full((2048,), 2.0)})
    _flip_at(path, base + 8192)
    with pytest.raises(fastckpt.ChecksumError, match="'y'"):
        fastckpt.load(path)


def test_a_load_owns_its_memory_and_mmap_maps(tmp_path):
    path = tmp_path / "s.safetensors"
    fastckpt.save({"w": torch.zeros(4096)}, path)
    owned = fastckpt.load(path)
    mapped = fastckpt.load(path, mmap=True)
    base, entries = _entries(path)
    with open(path, "r+b") as f:  # rewritten in place after both loads (no page touched)
        f.seek(base + entries["w"].begin)
        f.write(b"\x7f" * 4096)
    assert torch.count_nonzero(owned["w"]) == 0  # its own copy, read at the call
    assert torch.count_nonzero(mapped["w"][:1024]) == 1024  # a mapping sees the file
    assert owned["w"].storage_offset() == 0
    assert owned["w"].untyped_storage().nbytes() == 4096 * 4


def test_a_forked_child_reads_halves_with_a_helper_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(small_load, "SPLIT_BYTES", 4096)
    path = tmp_path / "s.safetensors"
    fastckpt.save(_state(), path)
    fastckpt.load(path)  # the parent's helper thread now runs
    pid = os.fork()
    if pid == 0:  # the child: no helper thread came with the fork
        code = 1
        try:
            back = fastckpt.load(path)
            code = 0 if torch.equal(back["a"], _state()["a"]) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize(
    "name, dtype, shape, offsets",
    [
        ("w", "F32", [2, 3], [0, 24]),
        ("w", "F32", [], [0, 4]),
        ("w", "F32", [0, 3], [0, 0]),  # zero elements: the full check decides
        ("w", "F32", [2**62, 2], [0, 2**65]),  # overflows
        ("w", "F32", [2**63], [0, 8]),
        ("w", "F32", [2, True], [0, 8]),  # JSON true is no dimension
        ("w", "F32", [2, 3], [24, 0]),
        ("w", "F32", [2, 3], [0, 25]),
        ("w", "F32", [2, 3], [0]),
        ("w", "F32", (2, 3), [0, 24]),
        ("w", "F4", [4], [0, 2]),  # packed: the full check decides
        ("w", "F4", [3], [0, 2]),
        ("w", "NOPE", [1], [0, 1]),
        ("w", 7, [1], [0, 1]),
        ("é", "U8", [1], [0, 1]),
        ("\ud800", "U8", [1], [0, 1]),  # a lone surrogate: refused by the full check
        ("w", "U8", [1] * 9, [0, 1]),
        ("w", "U8", [1], [-1, 0]),
        ("w", "U8", [1], [0, 2**64]),
    ],
)
def test_the_fast_entry_check_accepts_only_what_the_full_one_does(name, dtype, shape, offsets):
    fast = header_module._plain_entry(name, dtype, shape, offsets)
    try:
        full = header_module._checked_parse_entry(name, {"dtype": dtype, "shape": shape,
                                                         "data_offsets": offsets})  # fmt: skip
    except fastckpt.HeaderError:
        assert fast is None
        return
    if fast is not None:
        assert (fast.name, fast.dtype, fast.shape, fast.begin, fast.end) == (
            full.name, full.dtype, full.shape, full.begin, full.end,
        )  # fmt: skip


def _save_reason(path, caplog, **options) -> str:
    with caplog.at_level(logging.DEBUG, logger="fastckpt"):
        fastckpt.save({"w": torch.ones(4)}, path, **options)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saving ")]
    caplog.clear()
    return lines[-1]


def test_a_small_save_goes_direct_only_when_asked(tmp_path, caplog, monkeypatch):
    path = tmp_path / "s.safetensors"
    assert "buffered (a small state" in _save_reason(path, caplog)
    assert "buffered (direct_io=False)" in _save_reason(path, caplog, direct_io=False)
    monkeypatch.setenv("FASTCKPT_DIRECT_IO", "0")
    assert "buffered (FASTCKPT_DIRECT_IO=0)" in _save_reason(path, caplog)
    monkeypatch.setenv("FASTCKPT_DIRECT_IO", "1")
    reason = _save_reason(path, caplog)  # the full path: O_DIRECT where the file system takes it
    assert "FASTCKPT_DIRECT_IO=1" in reason or "refuses O_DIRECT" in reason, reason
    monkeypatch.delenv("FASTCKPT_DIRECT_IO")
    assert torch.equal(fastckpt.load(path)["w"], torch.ones(4))
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temporary left
