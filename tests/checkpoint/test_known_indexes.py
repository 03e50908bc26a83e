"""The index a save leaves for its successor (fastckpt.checkpoint.known_indexes) is exactly
what parsing the file and its chain finds, and it is used only while every header of the
chain is byte for byte the one seen: a base rewritten, replaced or damaged is parsed again,
with the same errors as before."""

from __future__ import annotations

import os

import pytest
import torch

import fastckpt
from fastckpt.checkpoint import incremental, known_indexes
from fastckpt.checkpoint.chained_reader import files_of, locate
from fastckpt.checkpoint.read import open_checkpoint
from fastckpt.errors import ChecksumError


def _parsed(path: str) -> tuple[dict, set]:
    """The index and chain files that opening ``path`` finds (nothing looked up)."""
    with open_checkpoint(os.path.abspath(path)) as reader:
        return {name: locate(reader, name) for name in reader.keys()}, files_of(reader)


def _tied_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(64, 16, generator=g)
    return {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: an alias of embed.weight
        "frozen": torch.randn(4096, generator=g),
        "lora.A": torch.randn(8, 16, generator=g),
        "step": torch.tensor(0),
    }


def test_the_index_a_save_leaves_is_what_parsing_its_chain_finds(tmp_path):
    state = _tied_state(0)
    (tmp_path / "a" / "b").mkdir(parents=True)
    paths = [  # from a/b/, 0 is out of reach (two directories up): referred to through 1
        str(tmp_path / "0.safetensors"),
        str(tmp_path / "a" / "1.safetensors"),
        str(tmp_path / "a" / "b" / "2.safetensors"),
        str(tmp_path / "a" / "b" / "3.safetensors"),
    ]
    for i, path in enumerate(paths):
        state["lora.A"].add_(1)
        state["step"].add_(1)
        if i == 3:
            state["embed.weight"].add_(1)  # the tied tensor changes: written again
        options = {"base": paths[i - 1]} if i else {}
        if i == 2:
            options["frozen"] = {"frozen"}
        fastckpt.save(state, path, **options)
        index, chain = known_indexes.lookup(path)
        parsed_index, parsed_chain = _parsed(path)
        assert index == parsed_index  # every name, aliases included, to the same place
        assert parsed_chain <= chain  # the next save builds on the index looked up
    loaded = fastckpt.load(paths[-1])
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_an_incremental_save_after_one_of_this_process_parses_no_header(tmp_path, monkeypatch):
    state = _tied_state(1)
    first, second = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    fastckpt.save(state, first)

    def no_parsing(*args, **kwargs):
        raise AssertionError("the base was parsed although its save left its index")

    monkeypatch.setattr(incremental, "open_checkpoint", no_parsing)
    state["lora.A"].add_(1)
    fastckpt.save(state, second, base=first)
    monkeypatch.undo()
    assert os.path.getsize(second) < os.path.getsize(first)  # the frozen bytes referred to
    loaded = fastckpt.load(second, verify=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_base_replaced_since_is_parsed_again_and_fails_as_before(tmp_path):
    state = _tied_state(2)
    first, second = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    fastckpt.save(state, first)
    state["lora.A"].add_(1)
    fastckpt.save(state, second, base=first)
    assert known_indexes.lookup(second) is not None
    other = _tied_state(3)
    fastckpt.save(other, first)  # the holder of second's references replaced
    assert known_indexes.lookup(second) is None  # its chain changed: not used
    with pytest.raises(ChecksumError) as caught:  # what parsing the chain says
        fastckpt.save(state, str(tmp_path / "c.safetensors"), base=second)
    assert "a.safetensors" in str(caught.value)


def test_a_base_whose_header_was_damaged_is_parsed_and_the_error_names_it(tmp_path):
    state = _tied_state(4)
    first = str(tmp_path / "a.safetensors")
    fastckpt.save(state, first)
    with open(first, "r+b") as f:  # same size, one byte of the header's JSON changed
        f.seek(8)
        f.write(b"[")
    assert known_indexes.lookup(first) is None
    with pytest.raises(fastckpt.HeaderError) as caught:
        fastckpt.save(state, str(tmp_path / "b.safetensors"), base=first)
    assert "a.safetensors" in str(caught.value)
