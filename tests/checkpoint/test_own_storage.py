"""Loaded tensors behave like torch.load's: each owns a storage at offset 0, over the memory
the read landed in (no copy), and that memory is freed with the last tensor."""

import gc
import io
import sys
import textwrap

import pytest
import torch

from fastckpt import _C
from fastckpt.checkpoint.load import load
from fastckpt.checkpoint.read import open_checkpoint
from fastckpt.checkpoint.save import save
from tests.python_processes import run


def _state() -> dict[str, torch.Tensor]:
    return {
        "rng": torch.get_rng_state(),
        "w": torch.randn(64, 33),
        "b": torch.arange(7, dtype=torch.bfloat16),
        "i": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }


def test_set_rng_state_takes_a_loaded_state(tmp_path):
    """torch.set_rng_state of a view with a storage offset crashes the process; in a
    subprocess, so a crash fails this test instead of killing the run."""
    path = tmp_path / "rng.safetensors"
    code = textwrap.dedent(
        f"""
        import torch
        from fastckpt.checkpoint.load import load
        from fastckpt.checkpoint.save import save
        torch.manual_seed(7)
        save({{"w": torch.randn(1000), "rng": torch.get_rng_state()}}, {str(path)!r})
        expected = torch.rand(3)
        torch.manual_seed(0)
        torch.set_rng_state(load({str(path)!r})["rng"])
        assert torch.equal(torch.rand(3), expected)
        print("ok")
        """
    )
    done = run([sys.executable, "-c", code], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize("mode", ["read", "mmap", "pinned", "keys", "reader"])
def test_every_loaded_tensor_owns_its_storage(tmp_path, mode):
    path = tmp_path / "s.safetensors"
    state = _state()
    save(state, path)
    if mode == "reader":
        with open_checkpoint(path) as r:
            back = r.get_tensors(list(state))
    else:
        options = {
            "read": {},
            "mmap": {"mmap": True},
            "pinned": {"pin_memory": True},
            "keys": {"keys": ["w", "b"]},
        }[mode]
        try:
            back = load(path, **options)
        except UserWarning:  # memory could not be locked here: nothing to check for pinning
            pytest.skip("page-locking refused on this machine")
    for name, t in back.items():
        assert torch.equal(t, state[name]), name
        assert t.storage_offset() == 0, name
        assert t.untyped_storage().nbytes() == t.nbytes, name
    if mode == "pinned":
        assert _C.is_locked(back["w"].data_ptr())


def test_tensors_share_the_memory_they_were_read_into(tmp_path):
    """No copy after the read: neighbouring tensors sit in one arena."""
    path = tmp_path / "s.safetensors"
    save({"a": torch.ones(1024), "b": torch.zeros(1024)}, path)
    back = load(path)
    gap = abs(back["a"].data_ptr() - back["b"].data_ptr())
    assert gap == 4096


def test_torch_save_of_one_loaded_tensor_writes_about_its_own_size(tmp_path):
    path = tmp_path / "big.safetensors"
    save({"big": torch.zeros(1 << 20), "small": torch.ones(10)}, path)
    small = load(path)["small"]
    out = io.BytesIO()
    torch.save(small, out)
    assert len(out.getvalue()) < 4096
    assert torch.equal(torch.load(io.BytesIO(out.getvalue())), torch.ones(10))


def test_tied_tensors_still_share_memory(tmp_path):
    path = tmp_path / "tied.safetensors"
    w = torch.randn(4, 4)
    save({"enc": w, "dec": w, "model": {"x": w}}, path)
    back = load(path)
    assert back["enc"] is back["dec"] is back["model"]["x"]
    back["enc"][0, 0] = 123.0
    assert back["dec"][0, 0] == 123.0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("mmap", [False, True])
def test_the_memory_is_freed_with_the_last_tensor(tmp_path, mmap):
    size = 48 << 20
    path = tmp_path / "s.safetensors"
    save({"big": torch.ones(size // 4), "small": torch.zeros(16)}, path)
    gc.collect()
    before = _rss()
    back = load(path, mmap=mmap, verify=False)
    big, small = back["big"], back["small"]
    del back
    assert big.sum().item() == size // 4  # touches every page
    del big
    gc.collect()
    assert _rss() - before > size // 2  # small still holds the memory read with it
    assert torch.equal(small, torch.zeros(16))
    del small
    gc.collect()
    assert _rss() - before < size // 4


def test_range_reads_own_their_storage(tmp_path):
    path = tmp_path / "s.safetensors"
    save({"w": torch.arange(10000, dtype=torch.int32)}, path)
    with open_checkpoint(path) as r:
        part = r.read_range("w", 400, 800)
    assert part.storage_offset() == 0 and part.untyped_storage().nbytes() == 400
    assert torch.equal(part.view(torch.int32), torch.arange(100, 200, dtype=torch.int32))
