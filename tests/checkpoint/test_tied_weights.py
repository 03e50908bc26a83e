"""Tied weights (one tensor under several names): every reader sees every key, fastckpt gives
the names one tensor again, and a file whose stored copy disagrees with its target is refused.

safetensors' readers know no aliases, so the file stores the tied tensor under each name;
fastckpt reads those bytes once."""

from __future__ import annotations

import pytest
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


def _flip_data_bit(path, offset: int, bit: int) -> None:
    """Flips one bit of a file in place (as a disk or a network might)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def _tied_file(path) -> tuple[int, dict[str, tuple[int, int]]]:
    """A checkpoint with a tied pair; returns the data section's file offset and each stored
    tensor's data-section byte range."""
    torch.manual_seed(3)
    model = TiedModel()
    fastckpt.save(model.state_dict(), path)
    with fastckpt.open(path) as reader:
        spans = {n: (e.begin, e.end) for n, e in reader.header.entries.items()}
        return reader.header.data_offset, spans


def test_a_damaged_stored_copy_is_found_by_load_verify_and_the_cli(tmp_path, capsys):
    from fastckpt.cli import main

    path = tmp_path / "tied.safetensors"
    data_offset, spans = _tied_file(path)
    begin, _ = spans["head.weight"]
    _flip_data_bit(path, data_offset + begin + 17, 3)
    # a reader that knows no aliases gets the damaged copy ...
    assert not torch.equal(
        safetensors.torch.load_file(str(path))["head.weight"],
        safetensors.torch.load_file(str(path))["embed.weight"],
    )
    # ... so fastckpt checks it although it gives the alias the first name's tensor
    with fastckpt.open(path) as reader:
        assert reader.verify() == ["head.weight"]
    for mmap in (False, True):
        try:
            fastckpt.load(path, mmap=mmap, verify=True)
        except fastckpt.ChecksumError as exc:
            assert "'head.weight'" in str(exc) and str(path) in str(exc)
        else:
            raise AssertionError(f"load(mmap={mmap}) accepted a damaged stored copy")
    try:
        fastckpt.load(path, keys=["head.weight"])
    except fastckpt.ChecksumError as exc:
        assert "'head.weight'" in str(exc)
    else:
        raise AssertionError("load(keys=[alias]) accepted a damaged stored copy")
    # a tensor is intact only when every stored copy of it is
    with pytest.raises(fastckpt.ChecksumError, match="'head.weight'"):
        fastckpt.load(path, keys=["embed.weight"])
    assert list(fastckpt.load(path, keys=["embed.weight"], verify=False)) == ["embed.weight"]
    assert main(["verify", str(path)]) == 1
    assert "head.weight" in capsys.readouterr().out


def test_every_data_bit_flip_in_a_tied_checkpoint_is_found(tmp_path):
    """Random single-bit flips anywhere in the data section: load and verify see each one."""
    path = tmp_path / "tied.safetensors"
    pristine = tmp_path / "pristine.safetensors"
    data_offset, spans = _tied_file(pristine)
    size = max(end for _, end in spans.values())
    generator = torch.Generator().manual_seed(7)
    flips = 60
    seen_by_verify = seen_by_load = 0
    for _ in range(flips):
        path.write_bytes(pristine.read_bytes())
        at = int(torch.randint(size, (1,), generator=generator))
        _flip_data_bit(path, data_offset + at, int(torch.randint(8, (1,), generator=generator)))
        with fastckpt.open(path) as reader:
            seen_by_verify += bool(reader.verify())
        try:
            fastckpt.load(path)
        except fastckpt.ChecksumError:
            seen_by_load += 1
    assert (seen_by_verify, seen_by_load) == (flips, flips)


def _save_tied(kind: str, folder) -> str:
    """A tied pair saved as ``kind``: a compressed file, or an incremental file over a base
    (whose reader names only stored tensors); returns the file holding the copy."""
    torch.manual_seed(4)
    first = torch.randn(64, 64).to(torch.bfloat16)
    path = str(folder / f"{kind}.safetensors")
    if kind == "compressed":
        fastckpt.save({"emb": first, "head": first, "n": torch.ones(3)}, path, compress=True)
    else:
        base = str(folder / "base.safetensors")
        fastckpt.save({"emb": first, "head": first, "n": torch.ones(3)}, base)
        second = torch.randn(64, 64).to(torch.bfloat16)
        fastckpt.save({"emb": second, "head": second, "n": torch.ones(3)}, path, base=base)
    return path


@pytest.mark.parametrize("kind", ["compressed", "incremental"])
def test_a_damaged_stored_copy_is_found_in_compressed_and_incremental_files(tmp_path, kind):
    path = _save_tied(kind, tmp_path)
    with fastckpt.open(path) as reader:
        top = getattr(reader, "top", reader)
        copy = top.header.entries["head"]
        _flip_data_bit(path, top.header.data_offset + copy.begin + copy.nbytes // 2, 0)
    with fastckpt.open(path) as reader:
        assert reader.verify() == ["head"]
    with pytest.raises(fastckpt.ChecksumError, match="'head'"):
        fastckpt.load(path)
