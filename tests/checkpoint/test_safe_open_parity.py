"""``fastckpt.open`` answers as ``safetensors.safe_open`` does, on the same files: metadata()
(None without metadata), get_slice() with every index form safetensors takes, and no answers
from a closed reader. The differences that remain are listed in docs/migrating.md."""

from __future__ import annotations

import warnings

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import fastckpt

INDICES = [
    [],
    [[]],
    (),
    [0],
    [1, 2],
    [3, 1, 1, -1],
    [slice(None)],
    [slice(1, 3), 2],
    [[0, 2]],
    ([0, 4], slice(1, 3)),
    (slice(1, 4, 2), 0),
    (Ellipsis, 1),
    (-1, slice(None, 2)),
    range(1, 3),
]


@pytest.fixture
def plain_file(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"w": torch.arange(20.0).reshape(5, 4)}, str(path))
    return str(path)


@pytest.mark.parametrize("index", INDICES, ids=repr)
def test_get_slice_indexes_as_safe_open_does(plain_file, index):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notice about list indices, inside safetensors
        with safe_open(plain_file, "pt") as theirs:
            expected = theirs.get_slice("w")[index]
    with fastckpt.open(plain_file) as ours:
        got = ours.get_slice("w")[index]
    assert got.shape == expected.shape and torch.equal(got, expected)


def test_a_list_index_reads_only_the_rows_it_names(tmp_path):
    path = tmp_path / "rows.safetensors"
    fastckpt.save({"table": torch.arange(400_000.0).reshape(100_000, 4)}, path)
    with fastckpt.open(path) as reader:
        rows = reader.get_slice("table")[[99_998, 3, 4, 3]]
        assert rows[:, 0].tolist() == [399_992.0, 12.0, 16.0, 12.0]
        assert reader.bytes_read < 100_000 * 16 // 10  # two runs of rows, not the table
        checked = reader.get_slice("table", verify=True)[[99_998, 3, 4, 3]]
        assert torch.equal(checked, rows)


def test_bad_list_indices_raise_as_torch_would(plain_file):
    with fastckpt.open(plain_file) as reader:
        s = reader.get_slice("w")
        with pytest.raises(IndexError, match="index 5 is out of bounds"):
            s[[0, 5]]
        with pytest.raises(TypeError, match="ints, got str"):
            s[(["a"], 0)]


def test_metadata_is_none_without_metadata_as_in_safe_open(plain_file, tmp_path):
    with safe_open(plain_file, "pt") as theirs, fastckpt.open(plain_file) as ours:
        assert theirs.metadata() is None and ours.metadata() is None
    with_meta = tmp_path / "meta.safetensors"
    safetensors.torch.save_file({"w": torch.ones(1)}, str(with_meta), metadata={"step": "3"})
    with safe_open(str(with_meta), "pt") as theirs, fastckpt.open(with_meta) as ours:
        assert theirs.metadata() == ours.metadata() == {"step": "3"}
    fastckpt.save({"w": torch.ones(1)}, tmp_path / "own.safetensors")
    with fastckpt.open(tmp_path / "own.safetensors") as ours:
        assert ours.metadata() == {
            "format": "pt"
        }  # as safetensors writes for torch; fastckpt.* hidden


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_a_closed_reader_answers_nothing(tmp_path, sharded):
    state = {"a": torch.ones(300), "b": torch.zeros(300)}
    path = tmp_path / "ckpt"
    if sharded:
        fastckpt.save(state, path, max_shard_size="1KB")
    else:
        fastckpt.save(state, path)
    reader = fastckpt.open(path)
    assert sorted(reader.keys()) == ["a", "b"]
    reader.close()
    for ask in (reader.keys, reader.metadata, lambda: reader.info("a")):
        with pytest.raises(ValueError, match="closed"):
            ask()
