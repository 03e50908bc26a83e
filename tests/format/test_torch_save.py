"""Tests of fastckpt.format.torch_save: telling a torch.save file from its first bytes."""

from __future__ import annotations

import io
import struct
import tarfile

import pytest
import torch

from fastckpt import format as fmt
from fastckpt.errors import HeaderError
from fastckpt.format.torch_save import SNIFF_BYTES, torch_save_format


def _torch_save(**options) -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0), "step": 3}, buffer, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("zipped", [True, False])
def test_every_pickle_protocol_and_both_formats_are_recognised(protocol, zipped):
    data = _torch_save(pickle_protocol=protocol, _use_new_zipfile_serialization=zipped)
    assert torch_save_format(data[:SNIFF_BYTES]) == ("zip" if zipped else "pickle")
    # The header-length check sees only 8 bytes: enough for the hint too.
    assert torch_save_format(data[:8]) == ("zip" if zipped else "pickle")
    with pytest.raises(HeaderError, match="torch.save file"):
        fmt.parse_header_length(data[:8], len(data))


def test_a_tar_archive_is_recognised_from_its_first_block():
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("sys_info")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    data = buffer.getvalue()
    assert torch_save_format(data[:SNIFF_BYTES]) == "tar"
    assert torch_save_format(data[:200]) is None  # the mark sits at byte 257


@pytest.mark.parametrize("header_length", [640, 0x0380, 0x0480, 0x0580, 4088, 12280])
def test_a_safetensors_header_length_is_not_a_pickle(header_length):
    """0x80 0x02 opens both a protocol-2 pickle and a 640-byte safetensors header."""
    head = struct.pack("<Q", header_length) + b'{"__metadata__":{}}'
    assert torch_save_format(head) is None


@pytest.mark.parametrize(
    "head",
    [b"", b"\x80", b"\x80\x01\x8a\x0a", b"\x80\x06\x8a\x0a", b"PK\x05\x06", b"\x80\x02}q\x00("],
)
def test_other_bytes_are_not_torch_save(head):
    assert torch_save_format(head) is None
