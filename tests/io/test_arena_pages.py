"""A load's arena in plain pages, in huge pages (MADV_HUGEPAGE) or populated on every core
before the reads: each loads the same bytes, verified, from tmpfs and from a disk, hot and
cold."""

from __future__ import annotations

import os

import pytest
import torch
from _page_cache import drop_from_page_cache

import fastckpt
from fastckpt.config import ARENA_PAGES, arena_pages
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, arena_tensor


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(10 << 20, generator=g),  # 40 MiB: past the heap arenas
        "odd": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g),
        "half": torch.randn(333, 17, generator=g).to(torch.bfloat16),
    }


@pytest.mark.parametrize("pages", ARENA_PAGES)
def test_every_arena_kind_loads_the_same_bytes(io_dir, monkeypatch, pages):
    path = os.path.join(io_dir, "ckpt.safetensors")
    state = _state()
    fastckpt.save(state, path)
    monkeypatch.setenv("FASTCKPT_ARENA_PAGES", pages)
    assert arena_pages() == pages
    for cold in (False, True):
        if cold:
            drop_from_page_cache(path)
        back = fastckpt.load(path, verify=True)
        assert set(back) == set(state)
        for name, tensor in state.items():
            assert back[name].dtype == tensor.dtype
            assert torch.equal(back[name], tensor), (pages, cold, name)


@pytest.mark.parametrize("pages", ARENA_PAGES)
@pytest.mark.parametrize("nbytes", [1, 4095, 4097, (33 << 20) + 199])
def test_arenas_are_aligned_writable_and_sized(pages, nbytes):
    arena = arena_tensor(nbytes, pages=pages)
    assert arena.numel() == nbytes and arena.data_ptr() % BUFFER_ALIGNMENT == 0
    arena.fill_(7)
    assert int(arena[-1]) == 7 and int(arena[0]) == 7


def test_an_unknown_arena_kind_is_named(monkeypatch):
    monkeypatch.setenv("FASTCKPT_ARENA_PAGES", "gigantic")
    with pytest.raises(ValueError, match="FASTCKPT_ARENA_PAGES.*gigantic"):
        arena_pages()
    with pytest.raises(ValueError, match="pages must be one of"):
        arena_tensor(64 << 20, pages="gigantic")
