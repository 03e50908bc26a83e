"""Errors someone coming from torch.save/safetensors meets first say what to do."""

import pytest
import torch
from safetensors.torch import save_file

import fastckpt
from fastckpt.errors import ChecksumError, NoChecksumsError


def test_verify_of_a_file_without_checksums_is_not_called_damage(tmp_path):
    path = str(tmp_path / "st.safetensors")
    save_file({"w": torch.ones(3)}, path)
    with pytest.raises(NoChecksumsError, match="records no checksums") as caught:
        fastckpt.load(path, verify=True)
    assert isinstance(caught.value, ValueError) and not isinstance(caught.value, ChecksumError)
    assert caught.value.filename == path
    assert "verify=None" in str(caught.value) and "damaged" in str(caught.value)
    assert torch.equal(fastckpt.load(path)["w"], torch.ones(3))  # verify=None reads it
    with fastckpt.open(path) as r, pytest.raises(NoChecksumsError):
        r.verify()


def test_damage_is_still_a_checksum_error(tmp_path):
    path = tmp_path / "d.safetensors"
    fastckpt.save({"w": torch.ones(1024)}, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="damaged"):
        fastckpt.load(path, verify=True)


@pytest.mark.parametrize("wrap", [lambda m: m, lambda m: {"model": m}])
def test_saving_a_whole_module_suggests_its_state_dict(tmp_path, wrap):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"state_dict\(\)") as caught:
        fastckpt.save(wrap(model), tmp_path / "m.safetensors")
    assert "Linear" in str(caught.value) and "load_state_dict" in str(caught.value)
    assert not (tmp_path / "m.safetensors").exists()


def test_saving_an_optimizer_suggests_its_state_dict(tmp_path):
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"state_dict\(\)"):
        fastckpt.save({"opt": opt}, tmp_path / "o.safetensors")
