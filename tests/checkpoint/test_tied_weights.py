"""Tied weights (one tensor under several names): every reader sees every key, fastckpt gives
the names one tensor again, and a file whose stored copy disagrees with its target is refused.

safetensors' readers know no aliases, so the file stores the tied tensor under each name;
fastckpt reads those bytes once."""

from __future__ import annotations

import safetensors.torch
import torch

import fastckpt
from fastckpt.checkpoint import save as checkpoint_save


class TiedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # tied embeddings / lm_head


def test_safetensors_load_file_gives_every_key_of_a_tied_state_dict(tmp_path):
    torch.manual_seed(0)
    model = TiedModel()
    path = tmp_path / "tied.safetensors"
    fastckpt.save(model.state_dict(), path)
    plain = safetensors.torch.load_file(str(path))
    assert plain.keys() == model.state_dict().keys()
    fresh = TiedModel()
    result = fresh.load_state_dict(plain, strict=True)  # the README's own check, tied
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(fresh.head.weight, model.embed.weight)


def test_safetensors_load_model_reads_it_and_names_the_copy(tmp_path):
    """load_model expects save_model's files (one name per tied group) and so reports the
    second name as unexpected; with strict=False it loads every weight (docs/migrating.md)."""
    torch.manual_seed(1)
    model = TiedModel()
    path = tmp_path / "tied.safetensors"
    fastckpt.save(model.state_dict(), path)
    fresh = TiedModel()
    missing, unexpected = safetensors.torch.load_model(fresh, str(path), strict=False)
    assert not missing and unexpected == ["head.weight"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_fastckpt_reads_a_tied_tensor_once_and_shares_it(tmp_path):
    torch.manual_seed(2)
    model = TiedModel()
    path = tmp_path / "tied.safetensors"
    fastckpt.save(model.state_dict(), path)
    back = fastckpt.load(path)
    assert list(back) == list(model.state_dict())
    assert back["head.weight"] is back["embed.weight"]
    mapped = fastckpt.load(path, mmap=True)
    assert mapped["head.weight"] is mapped["embed.weight"]
    with fastckpt.open(path) as reader:
        assert reader.keys().count("head.weight") == 1
        assert reader.aliases == {"head.weight": "embed.weight"}
        assert set(reader.read()) == set(model.state_dict()) - {"head.weight"}  # read once
    fresh = TiedModel()
    fastckpt.load_into(fresh, path)
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.head.weight, model.embed.weight)


def _save_with_false_alias(path, a: torch.Tensor, b: torch.Tensor) -> None:
    """A hostile file: two different tensors, the header claiming ``b`` is a copy of ``a``."""
    plan, executor = checkpoint_save.plan_and_executor({"a": a, "b": b}, str(path))
    plan.aliases = {"b": "a"}
    checkpoint_save.write_plan(plan, str(path), executor, checkpoint_save.default_pool(None))


def test_a_stored_copy_with_other_bytes_is_refused(tmp_path):
    path = tmp_path / "lies.safetensors"
    _save_with_false_alias(path, torch.zeros(16), torch.ones(16))
    assert torch.equal(safetensors.torch.load_file(str(path))["b"], torch.ones(16))
    try:
        fastckpt.load(path)
    except fastckpt.HeaderError as exc:
        assert "'b'" in str(exc) and "'a'" in str(exc) and "CRC32C" in str(exc)
        assert str(path) in str(exc)
    else:
        raise AssertionError("fastckpt served 'a' under 'b' although the copy differs")


def test_a_stored_copy_of_another_shape_is_refused(tmp_path):
    path = tmp_path / "shape.safetensors"
    _save_with_false_alias(path, torch.zeros(16), torch.zeros(4, 4))
    try:
        fastckpt.open(path)
    except fastckpt.HeaderError as exc:
        assert "F32[4, 4]" in str(exc) and "F32[16]" in str(exc)
    else:
        raise AssertionError("a copy of another shape was accepted")
