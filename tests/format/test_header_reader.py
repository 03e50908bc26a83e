"""Tests of fastckpt.format.read_header_from, the one header reader over any positional
reader (a file descriptor, a storage, a URL)."""

from __future__ import annotations

import os

import pytest

from fastckpt import format as fmt
from fastckpt.errors import HeaderError


def _file_bytes() -> bytes:
    entries = fmt.plan_layout([("w", "F32", (2, 3)), ("b", "U8", (5,))])
    return fmt.encode_header(entries, fmt.build_metadata({"step": "7"})) + bytes(29)


class _Reads:
    """``read_at`` over bytes, recording each call; ``cut`` bytes are missing at the end
    (a file that shrank after its size was taken)."""

    def __init__(self, data: bytes, cut: int = 0):
        self.data, self.cut, self.calls = data, cut, []

    def __call__(self, offset: int, nbytes: int) -> bytes:
        self.calls.append((offset, nbytes))
        return self.data[: len(self.data) - self.cut][offset : offset + nbytes]


def test_length_then_header_in_two_reads():
    data = _file_bytes()
    reads = _Reads(data)
    header = fmt.read_header_from(reads, len(data))
    assert list(header.entries) == ["w", "b"]
    assert header.metadata["step"] == "7"
    assert reads.calls == [(0, 8), (8, header.data_offset - 8)]


def test_a_large_probe_reads_the_header_at_once():
    data = _file_bytes()
    reads = _Reads(data)
    fmt.read_header_from(reads, len(data), probe=1 << 20)
    assert reads.calls == [(0, len(data))]


def test_a_file_ending_inside_the_header_names_it():
    data = _file_bytes()
    with pytest.raises(HeaderError, match=r"^/x/y\.safetensors: the file ended while reading"):
        fmt.read_header_from(_Reads(data, cut=len(data) - 100), len(data), where="/x/y.safetensors")


def test_eof_error_from_the_reader_is_a_header_error():
    def read_at(offset: int, nbytes: int) -> bytes:
        raise EOFError

    with pytest.raises(HeaderError, match="the file ended while reading the header"):
        fmt.read_header_from(read_at, 100)


def test_errors_name_where_only_when_given():
    with pytest.raises(HeaderError, match=r"^not a safetensors file"):
        fmt.read_header_from(_Reads(b"1234"), 4)
    with pytest.raises(HeaderError, match=r"^s3://b/k: not a safetensors file"):
        fmt.read_header_from(_Reads(b"1234"), 4, where="s3://b/k")


def test_reads_a_descriptor(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(_file_bytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        header = fmt.read_header_from(lambda o, n: os.pread(fd, n, o), os.fstat(fd).st_size)
    finally:
        os.close(fd)
    assert [e.shape for e in header.entries.values()] == [(2, 3), (5,)]
