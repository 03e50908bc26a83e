"""fastckpt._C.memcpy_crc: a copy that checksums each segment in the same pass, at awkward
sizes, cuts and thread counts; and a direct save that relies on it, read back verified."""

from __future__ import annotations

import pytest
import torch

import fastckpt
from fastckpt import _C


@pytest.mark.parametrize("nbytes", [0, 1, 199, 4095, 4097, (5 << 20) + 3, 13 << 20])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_copies_and_checksums_every_segment(nbytes, threads):
    src = torch.randint(0, 256, (max(nbytes, 1),), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    cuts = sorted({c for c in (1, 4096, nbytes // 3, (4 << 20) + 1) if 0 < c < nbytes})
    crcs = _C.memcpy_crc(dst.data_ptr(), src.data_ptr(), nbytes, cuts, threads)
    bounds = [0, *cuts, nbytes]
    assert crcs == [_C.crc32c(src.data_ptr() + lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])]
    assert torch.equal(dst[:nbytes], src[:nbytes])


@pytest.mark.parametrize("cuts", [[5, 3], [0], [10], [4, 4]])
def test_bad_cuts_are_a_value_error(cuts):
    src = torch.zeros(10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="segment cuts must ascend strictly"):
        _C.memcpy_crc(src.data_ptr(), src.data_ptr(), 10, cuts, 1)


def test_a_direct_save_checksummed_while_copied_reads_back_verified(tmp_path):
    # 3 pieces of 4 MiB per tensor, staging buffers of 1 MiB: every piece and every tensor's
    # CRC is joined across buffers and threads, and checked by a verified load and range read.
    state = {
        "a": torch.randn(3 << 20),  # 12 MiB
        "b": torch.randint(0, 9, (5 << 18,), dtype=torch.int32),  # 5 MiB
        "c": torch.randn(7),
        "t": torch.randn(512, 1024).t(),  # not contiguous
    }
    path = tmp_path / "x.safetensors"
    fastckpt.save(state, path, direct_io=True, staging_bytes=1 << 20)
    back = fastckpt.load(path, verify=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    with fastckpt.open(path) as reader:
        part = reader.read_range("a", (4 << 20) - 8, (8 << 20) + 8, verify=True)
        assert torch.equal(part, state["a"].view(torch.uint8)[(4 << 20) - 8 : (8 << 20) + 8])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte in the last tensor is found
    path.write_bytes(bytes(data))
    with pytest.raises(fastckpt.ChecksumError):
        fastckpt.load(path, verify=True)
