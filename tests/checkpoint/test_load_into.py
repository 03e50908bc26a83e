"""fastckpt.load_into: a checkpoint read straight into a model's own memory."""

import pytest
import safetensors.torch
import torch

import fastckpt


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.norm = torch.nn.BatchNorm1d(4)


def test_reads_into_the_parameters_own_memory(tmp_path):
    source = torch.nn.Linear(64, 32)
    path = tmp_path / "m.safetensors"
    fastckpt.save(source.state_dict(), path)
    model = torch.nn.Linear(64, 32)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    result = fastckpt.load_into(model, path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name]  # filled in place
        assert torch.equal(p, getattr(source, name))
        assert p.requires_grad


def test_tied_weights_and_buffers(tmp_path):
    source = Tied()
    source.norm.running_mean.fill_(3.0)
    path = tmp_path / "t.safetensors"
    fastckpt.save(source.state_dict(), path)
    model = Tied()
    fastckpt.load_into(model, path)
    assert model.head.weight is model.emb.weight
    assert torch.equal(model.emb.weight, source.emb.weight)
    assert torch.equal(model.norm.running_mean, torch.full((4,), 3.0))
    assert model.norm.num_batches_tracked.item() == source.norm.num_batches_tracked.item()


def test_a_state_dict_and_a_safetensors_file(tmp_path):
    data = {"a": torch.randn(3, 3), "b": torch.arange(4)}
    path = str(tmp_path / "st.safetensors")
    safetensors.torch.save_file(data, path)
    dest = {"a": torch.zeros(3, 3), "b": torch.zeros(4, dtype=torch.int64)}
    fastckpt.load_into(dest, path)
    assert torch.equal(dest["a"], data["a"]) and torch.equal(dest["b"], data["b"])


def test_other_dtypes_and_strided_destinations_are_converted(tmp_path):
    path = tmp_path / "c.safetensors"
    w = torch.randn(4, 6)
    fastckpt.save({"w": w, "v": w}, path)
    dest = {"w": torch.zeros(4, 6, dtype=torch.float64), "v": torch.zeros(6, 4).t()}
    fastckpt.load_into(dest, path, verify=True)
    assert torch.allclose(dest["w"], w.double()) and torch.equal(dest["v"], w)


def test_strict_mismatch_changes_nothing(tmp_path):
    path = tmp_path / "m.safetensors"
    fastckpt.save({"weight": torch.ones(2, 3), "extra": torch.ones(1)}, path)
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="Unexpected key.*'extra'") as caught:
        fastckpt.load_into(model, path)
    assert "Missing key(s) in state_dict: 'bias'" in str(caught.value)
    assert torch.equal(model.weight, before)
    result = fastckpt.load_into(model, path, strict=False)
    assert result.missing_keys == ["bias"] and result.unexpected_keys == ["extra"]
    assert torch.equal(model.weight, torch.ones(2, 3))


def test_shape_mismatch_is_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    fastckpt.save({"weight": torch.ones(3, 3), "bias": torch.ones(2)}, path)
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        fastckpt.load_into(torch.nn.Linear(3, 2), path)


def test_damage_is_caught(tmp_path):
    path = tmp_path / "d.safetensors"
    fastckpt.save({"w": torch.ones(4096)}, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(fastckpt.ChecksumError, match="'w'"):
        fastckpt.load_into({"w": torch.zeros(4096)}, path)


def test_a_directory_and_a_wrong_destination(tmp_path):
    model = torch.nn.Linear(2, 2)
    fastckpt.save(model.state_dict(), f"{tmp_path}/out/")
    fastckpt.load_into(torch.nn.Linear(2, 2), tmp_path / "out")
    with pytest.raises(TypeError, match="model_or_state_dict"):
        fastckpt.load_into([1, 2], tmp_path / "out")
