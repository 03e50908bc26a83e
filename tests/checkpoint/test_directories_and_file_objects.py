"""Saving into a directory (Hugging Face's model.safetensors) and to/from file objects and
bytes, as torch.save and safetensors allow."""

import io
import json
import os

import pytest
import safetensors.torch
import torch

import fastckpt


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(5, 3), "b": torch.arange(3, dtype=torch.int32)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- directories


def test_a_trailing_slash_saves_model_safetensors_in_a_new_directory(tmp_path):
    state = _state()
    fastckpt.save(state, f"{tmp_path}/out/")
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]
    assert _same(safetensors.torch.load_file(tmp_path / "out" / "model.safetensors"), state)
    for spelled in (f"{tmp_path}/out/", tmp_path / "out", f"file://{tmp_path}/out/"):
        assert _same(fastckpt.load(spelled), state)
        with fastckpt.open(spelled) as r:
            assert sorted(r.keys()) == ["b", "w"]


def test_an_existing_directory_is_saved_into(tmp_path):
    (tmp_path / "run").mkdir()
    state = {"model": _state(), "epoch": 3}
    fastckpt.save(state, tmp_path / "run")  # no IsADirectoryError
    back = fastckpt.load(tmp_path / "run")
    assert back["epoch"] == 3 and _same(back["model"], state["model"])


def test_a_one_file_save_replaces_the_shards_of_an_earlier_save(tmp_path):
    big = {f"t{i}": torch.full((1000,), float(i)) for i in range(4)}
    fastckpt.save(big, tmp_path, max_shard_size="8KB")
    assert "model.safetensors.index.json" in os.listdir(tmp_path)
    state = _state()
    fastckpt.save(state, tmp_path)
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert _same(fastckpt.load(tmp_path), state)


def test_a_sharded_directory_is_still_read_through_its_index(tmp_path):
    big = {f"t{i}": torch.full((1000,), float(i)) for i in range(4)}
    fastckpt.save(big, tmp_path, max_shard_size="8KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert _same(fastckpt.load(tmp_path), big)


def test_a_name_without_slash_is_still_a_file(tmp_path):
    fastckpt.save(_state(), tmp_path / "ckpt")
    assert (tmp_path / "ckpt").is_file()


def test_a_url_ending_with_a_slash_is_a_directory():
    state = _state()
    fastckpt.save(state, "memory://fastckpt-dir-test/run/")
    assert fastckpt.storage.exists("memory://fastckpt-dir-test/run/model.safetensors")
    assert _same(fastckpt.load("memory://fastckpt-dir-test/run/"), state)


def test_async_save_into_a_directory(tmp_path):
    state = _state()
    fastckpt.async_save(state, f"{tmp_path}/a/").result()
    assert _same(fastckpt.load(tmp_path / "a"), state)


def test_transformers_reads_the_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=32,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
    )
    model = transformers.BertModel(config)
    config.save_pretrained(tmp_path)
    fastckpt.save(model.state_dict(), f"{tmp_path}/")
    back = transformers.BertModel.from_pretrained(tmp_path)
    for name, t in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


# --------------------------------------------------------------------------- file objects


def test_save_to_bytesio_writes_what_a_file_holds(tmp_path):
    state = _state()
    buffer = io.BytesIO()
    fastckpt.save(state, buffer, metadata={"k": "v"})
    fastckpt.save(state, tmp_path / "f.safetensors", metadata={"k": "v"})
    assert buffer.getvalue() == (tmp_path / "f.safetensors").read_bytes()
    assert _same(safetensors.torch.load(buffer.getvalue()), state)


def test_save_and_load_through_open_files(tmp_path):
    state = {"model": _state(), "step": 7, "names": ["a", "b"]}
    with open(tmp_path / "c.ckpt", "wb") as f:
        fastckpt.save(state, f)
    with open(tmp_path / "c.ckpt", "rb") as f:
        back = fastckpt.load(f, verify=True)
        assert not f.closed  # the caller's file stays open
    assert (
        back["step"] == 7 and back["names"] == ["a", "b"] and _same(back["model"], state["model"])
    )
    with open(tmp_path / "c.ckpt", "rb") as f, fastckpt.open(f) as r:
        assert torch.equal(r.get_tensor("model/w"), state["model"]["w"])
        assert r.verify() == []


def test_a_checkpoint_after_other_bytes_in_a_file(tmp_path):
    state = _state()
    buffer = io.BytesIO()
    buffer.write(b"prefix")
    fastckpt.save(state, buffer)
    buffer.seek(6)
    assert _same(fastckpt.load(buffer), state)


def test_a_stream_that_cannot_seek_is_read(tmp_path):
    state = _state()
    read_fd, write_fd = os.pipe()
    data = fastckpt.save_bytes(state)
    with os.fdopen(write_fd, "wb") as w:
        w.write(data)
    with os.fdopen(read_fd, "rb") as r:
        assert not r.seekable()
        assert _same(fastckpt.load(r), state)


def test_a_damaged_file_object_is_caught():
    data = bytearray(fastckpt.save_bytes({"w": torch.ones(1024)}))
    data[-1] ^= 1
    with pytest.raises(fastckpt.ChecksumError, match="'w'"):
        fastckpt.load(io.BytesIO(bytes(data)), verify=True)


def test_save_bytes_and_load_bytes_mirror_safetensors():
    state = _state()
    data = fastckpt.save_bytes(state)
    assert isinstance(data, bytes)
    assert _same(safetensors.torch.load(data), state)
    assert _same(fastckpt.load_bytes(data), state)
    assert _same(fastckpt.load_bytes(safetensors.torch.save(state)), state)
    assert _same(fastckpt.load_bytes(bytearray(data), keys=["w", "b"]), state)
    loaded = fastckpt.load_bytes(memoryview(data))
    assert loaded["w"].storage_offset() == 0


def test_file_object_errors_name_the_argument(tmp_path):
    with open(tmp_path / "t.txt", "w") as text, pytest.raises(TypeError, match="f: .*binary"):
        fastckpt.save(_state(), text)
    with open(tmp_path / "t.bin", "wb") as f, pytest.raises(io.UnsupportedOperation, match="f:"):
        fastckpt.load(f)
    with pytest.raises(TypeError, match="engine="):
        fastckpt.save(_state(), io.BytesIO(), engine="threads")
    with pytest.raises(TypeError, match="data must be bytes"):
        fastckpt.load_bytes("not bytes")
    with pytest.raises(io.UnsupportedOperation, match="memory-mapped"):
        fastckpt.load(io.BytesIO(fastckpt.save_bytes(_state())), mmap=True)
    with pytest.raises(fastckpt.HeaderError):
        fastckpt.load_bytes(b"hello")
