"""Code written for safetensors runs with fastckpt's names: ``safe_open``'s and ``save_file``'s
calls, positional arguments included, behave alike (checked against safetensors itself), and
there is one public reader type."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

import fastckpt

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.int32)}


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (("pt",), {}),
        (("pt", "cpu"), {}),
        ((), {"framework": "pt"}),
        ((), {"framework": "pt", "device": "cpu"}),
        (("pt",), {"device": "cpu"}),
    ],
)
def test_open_takes_safe_opens_arguments(tmp_path, tensors, args, kwargs):
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path, metadata={"k": "v"})
    for opener in (fastckpt.open, fastckpt.Reader):
        with safe_open(path, *args, **kwargs) as theirs, opener(path, *args, **kwargs) as ours:
            assert sorted(ours.keys()) == sorted(theirs.keys())
            assert ours.metadata() == theirs.metadata()
            for name in theirs.keys():
                assert torch.equal(ours.get_tensor(name), theirs.get_tensor(name))
            assert torch.equal(ours.get_slice("w")[1:3], theirs.get_slice("w")[1:3])


def test_open_refuses_another_framework_by_name(tmp_path, tensors):
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path)
    with safe_open(path, framework="np") as theirs:  # safetensors gives numpy here
        assert theirs.get_tensor("b").tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=re.escape("framework='np'")):
        fastckpt.open(path, framework="np")


def test_save_takes_metadata_by_position_as_save_file_does(tmp_path, tensors):
    theirs, ours = str(tmp_path / "theirs.safetensors"), str(tmp_path / "ours.safetensors")
    save_file(tensors, theirs, {"k": "v"})
    fastckpt.save(tensors, ours, {"k": "v"})
    with safe_open(theirs, "pt") as a, safe_open(ours, "pt") as b:
        user = {k: v for k, v in b.metadata().items() if not k.startswith("fastckpt.")}
        assert a.metadata() == {"k": "v"}
        assert user == {"k": "v", "format": "pt"}  # fastckpt also says what wrote the tensors
        assert all(torch.equal(a.get_tensor(n), b.get_tensor(n)) for n in a.keys())

    data = fastckpt.save_bytes(tensors, {"k": "v"})  # as safetensors.torch.save(t, metadata)
    assert safetensors.torch.load(data).keys() == tensors.keys()
    with fastckpt.open(__import__("io").BytesIO(data)) as reader:
        assert reader.metadata() == {"format": "pt", "k": "v"}


def test_save_names_torch_saves_pickle_module_as_the_third_argument(tmp_path, tensors):
    with pytest.raises(TypeError, match="pickle_module"):
        fastckpt.save(tensors, str(tmp_path / "m.safetensors"), pickle)


def test_one_public_reader_type(tmp_path, tensors):
    assert fastckpt.CheckpointReader is fastckpt.Reader
    file, directory = tmp_path / "m.safetensors", tmp_path / "shards"
    fastckpt.save(tensors, file)
    fastckpt.save(tensors, directory, max_shard_size=64)
    for where in (file, directory, f"memory://drop-in/{tmp_path.name}.safetensors"):
        if str(where).startswith("memory://"):
            fastckpt.save(tensors, where)
        with fastckpt.open(where) as reader:
            assert isinstance(reader, fastckpt.Reader)
            assert isinstance(reader, fastckpt.CheckpointReader)
        with fastckpt.CheckpointReader(where) as reader:  # the older name still opens
            assert torch.equal(reader.get_tensor("w"), tensors["w"])


def test_every_public_error_is_in_the_errors_page():
    page = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    errors = [
        name
        for name in fastckpt.__all__
        if isinstance(getattr(fastckpt, name), type)
        and issubclass(getattr(fastckpt, name), Exception)
    ]
    assert "UnsafePickleError" in errors
    assert [name for name in errors if f"`fastckpt.{name}`" not in page] == []


def test_a_loop_over_keys_reads_in_safe_opens_order(tmp_path):
    """``{k: f.get_tensor(k) for k in f.keys()}``, the usual loading loop, yields the same
    dict in the same order with either library, on a file that each of them wrote; every
    reader type has ``offset_keys()``."""
    tensors = {"z": torch.ones(1024), "a": torch.arange(3.0), "m": torch.zeros(2, 2)}
    theirs_path, ours_path = str(tmp_path / "st.safetensors"), str(tmp_path / "fc.safetensors")
    save_file(tensors, theirs_path)
    fastckpt.save(tensors, ours_path)
    for path in (theirs_path, ours_path):
        with safe_open(path, "pt") as theirs, fastckpt.open(path) as ours:
            a = {k: theirs.get_tensor(k) for k in theirs.keys()}  # noqa: SIM118 - not a dict
            b = {k: ours.get_tensor(k) for k in ours.keys()}  # noqa: SIM118 - not a dict
            assert list(a) == list(b) == ["a", "m", "z"]
            assert all(torch.equal(a[k], b[k]) for k in a)
    url = f"memory://drop-in-order/{tmp_path.name}.safetensors"
    fastckpt.save(tensors, url)
    fastckpt.save(tensors, tmp_path / "shards", max_shard_size=4096)
    for where in (url, tmp_path / "shards"):
        with fastckpt.open(where) as reader:
            assert sorted(reader.offset_keys()) == sorted(reader.keys()) == ["a", "m", "z"]
    with fastckpt.open(url) as reader:
        assert reader.keys() == ["a", "m", "z"] and reader.offset_keys()[0] == "z"
