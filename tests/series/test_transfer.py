"""The drain's copies between local files: exact bytes, no page cache, damage caught."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fastckpt import _C
from fastckpt.errors import ChecksumError
from fastckpt.io.files import File
from fastckpt.io.page_cache import resident_fraction
from fastckpt.series import transfer


@pytest.mark.parametrize("size", [0, 1, 4096, (16 << 20) + 12345, (32 << 20) + 4096])
def test_a_local_copy_is_exact_and_checked_whatever_its_size(tmp_path, size):
    data = os.urandom(size)
    source, target = tmp_path / "src.bin", tmp_path / "deep" / "dst.bin"
    source.write_bytes(data)
    crc = transfer.copy_file(str(source), str(target))
    address = np.frombuffer(data, np.uint8).ctypes.data if size else 0
    assert crc == (_C.crc32c(address, size) if size else 0)
    assert target.read_bytes() == data
    transfer.verify_copy(str(target), crc)


def test_a_local_copy_leaves_the_target_out_of_the_page_cache_where_direct_io_works(tmp_path):
    source, target = tmp_path / "src.bin", tmp_path / "dst.bin"
    source.write_bytes(os.urandom(8 << 20))
    with File(str(source)) as probe:
        if not probe.direct:
            pytest.skip("this file system refuses O_DIRECT")
    crc = transfer.copy_file(str(source), str(target))
    transfer.verify_copy(str(target), crc)  # read back with O_DIRECT too
    fd = os.open(target, os.O_RDONLY)
    try:
        cached = resident_fraction(fd, 0, 8 << 20)
    finally:
        os.close(fd)
    assert cached is not None and cached < 0.1, cached


def test_a_copy_that_differs_from_its_source_is_refused(tmp_path):
    source, target = tmp_path / "src.bin", tmp_path / "dst.bin"
    source.write_bytes(os.urandom((16 << 20) + 100))
    crc = transfer.copy_file(str(source), str(target))
    with open(target, "r+b") as f:  # one byte flipped past the first chunk
        f.seek((16 << 20) + 50)
        byte = f.read(1)
        f.seek((16 << 20) + 50)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ChecksumError, match="dst.bin"):
        transfer.verify_copy(str(target), crc)


def test_the_copy_of_a_checkpoint_is_checked_tensor_by_tensor_in_one_pass(tmp_path):
    import torch

    import fastckpt

    source, target = tmp_path / "src.safetensors", tmp_path / "dst.safetensors"
    state = {"a": torch.randn(3 << 20), "empty": torch.zeros(0), "b": torch.arange(1000)}
    fastckpt.save(state, source)
    crc = transfer.copy_file(str(source), str(target))
    transfer.verify_copy(str(target), crc)
    with fastckpt.open(target) as reader:
        begin = reader.header.data_offset + reader.header.entries["b"].begin
    with open(target, "r+b") as f:  # one byte of tensor 'b' flipped
        f.seek(begin + 10)
        byte = f.read(1)
        f.seek(begin + 10)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ChecksumError, match=r"damaged tensors \['b'\]"):
        transfer.verify_copy(str(target), crc)


def test_a_local_copy_checks_each_tensor_of_its_source_as_it_goes_out(tmp_path):
    import torch

    import fastckpt

    source, target = tmp_path / "src.safetensors", tmp_path / "dst.safetensors"
    fastckpt.save({"a": torch.randn(1 << 20), "b": torch.arange(4096)}, source)
    with fastckpt.open(source) as reader:
        begin = reader.header.data_offset + reader.header.entries["a"].begin
    with open(source, "r+b") as f:  # damage in the fast tier, after its save
        f.seek(begin + 4)
        byte = f.read(1)
        f.seek(begin + 4)
        f.write(bytes([byte[0] ^ 0x80]))
    with pytest.raises(ChecksumError, match=r"src.safetensors.*damaged tensors \['a'\]"):
        transfer.copy_file(str(source), str(target))
