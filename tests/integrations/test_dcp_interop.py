"""fastckpt.dcp beside DCP's own readers and writers: what DCP's default choices do with a
fastckpt checkpoint, DCP's wording of errors, and the options DCP has that fastckpt refuses.
Real files, real ``dcp.save`` / ``dcp.load`` in one process (no process group needed)."""

from __future__ import annotations

import os
import pickle
from typing import IO

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.api import CheckpointException

from fastckpt.dcp import FastCkptReader, FastCkptWriter
from fastckpt.integrations.dcp import read_dcp_metadata
from fastckpt.integrations.dcp.storage_item import StoredItem


def _save(path: str, **options) -> dict[str, object]:
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}
    dcp.save(state, storage_writer=FastCkptWriter(path, **options), no_dist=True)
    return state


def _target() -> dict[str, object]:
    return {"w": torch.zeros(3, 4), "step": 0}


def _failure(caught: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    """The one rank's exception inside DCP's CheckpointException."""
    ((exception, _traceback),) = caught.value.failures.values()
    return exception


def test_dcp_load_without_storage_reader_names_the_reader_to_pass(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    # No storage_reader: DCP picks its own FileSystemReader, which cannot read rank files
    # of raw tensor bytes; the failure says which reader to pass, not "'tuple' object has
    # no attribute 'relative_path'".
    with pytest.raises(CheckpointException) as caught:
        dcp.load(_target(), checkpoint_id=path, no_dist=True)
    failure = _failure(caught)
    assert isinstance(failure, TypeError)
    message = str(failure)
    assert "FastCkptReader" in message and "storage_reader" in message
    assert "relative_path" not in message
    rank_file = next(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert message.startswith(rank_file)
    # ... and the checkpoint loads with the reader it names.
    out = _target()
    dcp.load(out, storage_reader=FastCkptReader(path), no_dist=True)
    assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4)) and out["step"] == 7


def test_metadata_entries_are_file_and_tensor_pairs(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    # The restricted unpickler admits the entry class; a plain unpickler reads it too.
    entries = list(read_dcp_metadata(path).storage_data.values())
    with open(os.path.join(path, ".metadata"), "rb") as f:
        plain = pickle.load(f)
    assert entries and all(type(e) is StoredItem for e in entries)
    assert sorted(entries) == sorted(plain.storage_data.values())
    assert {name for _, name in entries} == {"w", "step"}


def test_checkpoints_with_plain_tuple_entries_still_load(tmp_path):
    path = str(tmp_path / "ckpt")
    _save(path)
    # Checkpoints written before the entries had their own class hold plain tuples.
    metadata = read_dcp_metadata(path)
    metadata.storage_data = {k: tuple(v) for k, v in metadata.storage_data.items()}
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        assert b"StoredItem" not in f.read()
    out = _target()
    dcp.load(out, storage_reader=FastCkptReader(path), no_dist=True)
    assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4)) and out["step"] == 7


def test_overwrite_refusal_uses_dcps_wording(tmp_path):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    _save(ours)
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(theirs), no_dist=True)
    phrase = "Checkpoint already exists"
    with pytest.raises(CheckpointException) as caught:
        dcp.save(
            {"w": torch.ones(2)},
            storage_writer=dcp.FileSystemWriter(theirs, overwrite=False),
            no_dist=True,
        )
    assert phrase in str(_failure(caught))  # DCP's own words
    with pytest.raises(CheckpointException) as caught:
        _save(ours, overwrite=False)
    failure = _failure(caught)
    assert isinstance(failure, RuntimeError)
    assert phrase in str(failure) and ours in str(failure) and "overwrite=True" in str(failure)


class _Identity(StreamTransformExtension):
    """A user stream transform that passes bytes through unchanged."""

    @staticmethod
    def registry_name() -> str:
        return "test.identity"

    @staticmethod
    def from_descriptor(version: str) -> _Identity:
        return _Identity()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return output

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return input


def test_stream_transform_extensions_are_refused_naming_the_alternative(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(TypeError, match="_extensions") as caught:
        FastCkptWriter(path, _extensions=[_Identity()])
    assert "FileSystemWriter" in str(caught.value)
    registry = ExtensionRegistry()
    registry.register(_Identity)
    with pytest.raises(TypeError, match="_extension_registry") as caught:
        FastCkptReader(path, _extension_registry=registry)
    assert "FileSystemReader" in str(caught.value)
    # What DCP's own writer does with the same extension, for comparison: it works there.
    dcp.save(
        {"w": torch.ones(2)},
        storage_writer=dcp.FileSystemWriter(path, _extensions=[_Identity()]),
        no_dist=True,
    )
    out = {"w": torch.zeros(2)}
    dcp.load(
        out, storage_reader=dcp.FileSystemReader(path, _extension_registry=registry), no_dist=True
    )
    assert out["w"].tolist() == [1.0, 1.0]
