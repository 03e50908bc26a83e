"""Every dtype the installed safetensors knows, against fastckpt both ways, bit for bit:
fastckpt writes and ``safetensors.torch.load_file`` reads; ``safetensors.torch.save_file``
writes and ``fastckpt.load`` reads. Real files in ``tmp_path``."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors
import safetensors.torch
import torch

import fastckpt
import fastckpt.format as fmt
from fastckpt.checkpoint import dtypes
from fastckpt.errors import HeaderError
from fastckpt.format.schema import DTYPES, PACKED_BITS

# The dtype names of safetensors 0.8 (its Rust core's Dtype enum), which has no Python
# accessor for them; test_safetensors_knows_exactly_these_dtypes keeps this list honest.
SAFETENSORS_DTYPES = [
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
]
#: Those torch 2.13 has no dtype for.
NO_TORCH_DTYPE = {"F6_E2M3", "F6_E3M2"}
TORCH_DTYPES = [name for name in SAFETENSORS_DTYPES if name not in NO_TORCH_DTYPE]


def _raw_file(path, entries: dict, data: bytes) -> None:
    """A safetensors file written byte by byte (header as given, no padding)."""
    header = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of dtype ``name`` whose bytes are random (0/1 for BOOL)."""
    dtype = dtypes.to_torch(name)
    generator = torch.Generator().manual_seed(seed)
    high = 2 if dtype == torch.bool else 256
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    raw = torch.randint(0, high, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensors() -> dict[str, torch.Tensor]:
    """One tensor of every dtype torch shares with safetensors, plus empty and 0-d ones."""
    out = {}
    for seed, name in enumerate(TORCH_DTYPES):
        out[name] = _random_tensor(name, (3, 5), seed)
        out[f"{name}.empty"] = _random_tensor(name, (2, 0), seed)
        if name != "F4":  # a 0-d F4 tensor has no safetensors form: see below
            out[f"{name}.scalar"] = _random_tensor(name, (), seed)
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert got[key].shape == tensor.shape, key
        assert _bits(got[key]) == _bits(tensor), key


def test_safetensors_knows_exactly_these_dtypes(tmp_path):
    assert DTYPES == set(SAFETENSORS_DTYPES)
    for name in SAFETENSORS_DTYPES:
        path = tmp_path / f"{name}.safetensors"
        nbytes = fmt.schema.tensor_nbytes(name, [8])
        _raw_file(
            path, {"x": {"dtype": name, "shape": [8], "data_offsets": [0, nbytes]}}, bytes(nbytes)
        )
        with safetensors.safe_open(str(path), framework="numpy") as f:  # header accepted
            assert list(f.keys()) == ["x"]
    path = tmp_path / "unknown.safetensors"
    _raw_file(path, {"x": {"dtype": "F2", "shape": [8], "data_offsets": [0, 2]}}, bytes(2))
    with pytest.raises(Exception, match="F2"):
        safetensors.safe_open(str(path), framework="numpy")


def test_every_dtype_torch_has_maps_both_ways():
    for name in TORCH_DTYPES:
        dtype = dtypes.to_torch(name)
        assert dtypes.to_safetensors(dtype) == name
    for name in NO_TORCH_DTYPE:
        with pytest.raises(HeaderError, match=f"{name}.*no torch dtype"):
            dtypes.to_torch(name)


def test_fastckpt_writes_safetensors_reads(tmp_path):
    tensors = _tensors()
    path = tmp_path / "ours.safetensors"
    fastckpt.save(tensors, path)
    _assert_same(safetensors.torch.load_file(str(path)), tensors)


def test_safetensors_writes_fastckpt_reads(tmp_path):
    tensors = _tensors()
    path = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    _assert_same(fastckpt.load(path), tensors)
    _assert_same(fastckpt.load(path, mmap=True), tensors)
    with fastckpt.open(path) as reader:
        _assert_same(reader.get_tensors(list(tensors)), tensors)


def test_f4_headers_count_values_and_torch_counts_pairs(tmp_path):
    tensor = _random_tensor("F4", (4, 3), seed=1)  # 4 x 3 bytes, 4 x 6 values
    path = tmp_path / "f4.safetensors"
    fastckpt.save({"w": tensor}, path)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.get_slice("w").get_dtype() == "F4"
        assert f.get_slice("w").get_shape() == [4, 6]
    with fastckpt.open(path) as reader:
        assert reader.info("w").shape == (4, 3) and reader.info("w").nbytes == 12
        rows = reader.get_slice("w")
        assert rows.get_dtype() == "F4" and rows.get_shape() == [4, 6]
        assert _bits(rows[1:3]) == _bits(tensor[1:3])


def test_f4_refusals(tmp_path):
    zero_d = torch.tensor(7, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(TypeError, match="0-d.*'w'"):
        fastckpt.save({"w": zero_d}, tmp_path / "scalar.safetensors")
    # Whole bytes, but an odd number of values per row: torch's pairs cannot hold it (the
    # safetensors reader refuses it too).
    odd = tmp_path / "odd.safetensors"
    _raw_file(odd, {"w": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}, bytes(3))
    with pytest.raises(HeaderError, match="'w'.*F4 shape \\[2, 3\\]"):
        fastckpt.load(odd)
    with pytest.raises(Exception, match="divisible by 2"):
        safetensors.torch.load_file(str(odd))
    # Half a byte at the end: no reader accepts it.
    half = tmp_path / "half.safetensors"
    _raw_file(half, {"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2))
    with pytest.raises(HeaderError, match="byte boundary"):
        fastckpt.load(half)


@pytest.mark.parametrize("name", sorted(NO_TORCH_DTYPE))
def test_f6_headers_parse_but_tensors_cannot_load(tmp_path, name):
    path = tmp_path / "f6.safetensors"
    _raw_file(path, {"w": {"dtype": name, "shape": [2, 4], "data_offsets": [0, 6]}}, bytes(6))
    raw = path.read_bytes()
    header = fmt.parse_header(raw[8 : 8 + fmt.parse_header_length(raw[:8], len(raw))], len(raw))
    assert header.entries["w"].nbytes == 6 and PACKED_BITS[name] == 6
    with pytest.raises(HeaderError, match=f"{name}.*no torch dtype"):
        fastckpt.load(path)
