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


def _stored(path, tensors):
    if str(path).endswith("st.safetensors"):
        safetensors.torch.save_file(tensors, str(path))
    else:
        fastckpt.save(tensors, path)
    return path


def test_keys_are_sorted_and_offset_keys_in_data_order_as_in_safe_open(tmp_path):
    """Names out of alphabetical order and sizes that make fastckpt's layout reorder them."""
    tensors = {
        "zeta": torch.ones(3),
        "alpha": torch.ones(1024),  # 4 KiB: laid out first by fastckpt
        "mid": torch.ones(5, dtype=torch.float16),
        "beta": torch.ones(2, dtype=torch.float64),
    }
    files = [_stored(tmp_path / "st.safetensors", tensors), _stored(tmp_path / "fc", tensors)]
    w = torch.ones(4, 4)
    nested = tmp_path / "nested.safetensors"
    fastckpt.save({"model": {"w": w, "tied": w}, "b": [torch.zeros(1024)], "step": 1}, nested)
    files.append(nested)
    for path in files:
        with safe_open(str(path), "pt") as theirs, fastckpt.open(path) as ours:
            assert ours.keys() == theirs.keys() == sorted(theirs.keys())
            assert ours.offset_keys() == theirs.offset_keys()
    with fastckpt.open(tmp_path / "fc") as ours:
        assert ours.offset_keys() != ours.keys()  # the layout put the 4 KiB tensor first


def test_keys_of_an_incremental_checkpoint_are_sorted(tmp_path):
    base, top = tmp_path / "0.safetensors", tmp_path / "1.safetensors"
    fastckpt.save({"b": torch.zeros(2), "a": torch.zeros(2), "c": torch.zeros(2)}, base)
    fastckpt.save({"b": torch.ones(2), "a": torch.zeros(2), "c": torch.zeros(2)}, top, base=base)
    with fastckpt.open(top) as reader:
        assert reader.keys() == ["a", "b", "c"]
        assert reader.offset_keys()[0] == "b"  # the one tensor this file holds itself


def test_metadata_is_safe_opens_less_fastckpts_keys(tmp_path):
    """On every file, ``metadata()`` is what ``safe_open`` says for the same file without the
    ``fastckpt.*`` keys: None without ``__metadata__`` (safetensors' save_file writes none
    without metadata=), and ``format`` where the file has it (fastckpt.save writes it)."""
    w = {"w": torch.ones(2)}
    safetensors.torch.save_file(w, str(tmp_path / "st.safetensors"))
    safetensors.torch.save_file(w, str(tmp_path / "st-meta.safetensors"), metadata={"a": "b"})
    safetensors.torch.save_file(w, str(tmp_path / "hf.safetensors"), metadata={"format": "pt"})
    fastckpt.save(w, tmp_path / "fc.safetensors")
    fastckpt.save(w, tmp_path / "fc-meta.safetensors", metadata={"a": "b"})
    fastckpt.save({"nested": [torch.ones(1)]}, tmp_path / "fc-tree.safetensors", checksum=False)
    expected = {
        "st": None,
        "st-meta": {"a": "b"},
        "hf": {"format": "pt"},
        "fc": {"format": "pt"},
        "fc-meta": {"format": "pt", "a": "b"},
        "fc-tree": {"format": "pt"},
    }
    for name, want in expected.items():
        path = str(tmp_path / f"{name}.safetensors")
        with safe_open(path, "pt") as theirs, fastckpt.open(path) as ours:
            raw = theirs.metadata()
            user = (
                None
                if raw is None
                else {k: v for k, v in raw.items() if not k.startswith("fastckpt.")}
            )
            assert ours.metadata() == user == want, name


CHANNELS_LAST = [
    (torch.channels_last, (2, 3, 4, 5)),
    (torch.channels_last_3d, (2, 3, 2, 4, 5)),
]


@pytest.mark.parametrize("memory_format, shape", CHANNELS_LAST, ids=["2d", "3d"])
@pytest.mark.parametrize("layout", ["flat", "single", "nested", "parameter"])
def test_a_channels_last_tensor_loads_channels_last_as_with_torch_load(
    tmp_path, memory_format, shape, layout
):
    """fastckpt.load keeps the memory format, as torch.load keeps strides; the bytes stay
    the logical row-major ones, so safetensors reads the same values."""
    t = torch.randn(*shape).to(memory_format=memory_format)
    obj = {
        "flat": {"x": t, "y": torch.zeros(3)},
        "single": {"x": t},
        "nested": {"model": {"x": t}, "step": 1},
        "parameter": {"model": {"x": torch.nn.Parameter(t)}},
    }[layout]
    path = tmp_path / "cl.safetensors"
    fastckpt.save(obj, path)
    torch.save(obj, tmp_path / "cl.pt")
    theirs = torch.load(tmp_path / "cl.pt", weights_only=True)
    for options in ({}, {"mmap": True}):
        ours = fastckpt.load(path, **options)
        got, want = (
            (ours["x"], theirs["x"]) if "x" in obj else (ours["model"]["x"], theirs["model"]["x"])
        )
        assert got.stride() == want.stride() == t.stride()
        assert type(got) is type(want) and torch.equal(got, t)
    name = "x" if "x" in obj else "model/x"
    assert torch.equal(safetensors.torch.load_file(str(path))[name], t)
    with safe_open(str(path), "pt") as st, fastckpt.open(path) as reader:
        assert torch.equal(st.get_tensor(name), t) and st.get_tensor(name).is_contiguous()
        assert torch.equal(reader.get_tensor(name), t)
    named = fastckpt.load(path, keys=[name])[name]
    assert named.stride() == t.stride() and torch.equal(named, t)


def test_channels_last_on_the_meta_device_and_other_strides(tmp_path):
    t = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    path = tmp_path / "cl.safetensors"
    fastckpt.save({"x": t, "transposed": torch.randn(3, 4).t()}, path)
    back = fastckpt.load(path, device="meta")
    assert back["x"].stride() == t.stride()
    # only channels-last formats are kept: other strides come back contiguous
    assert fastckpt.load(path)["transposed"].is_contiguous()
