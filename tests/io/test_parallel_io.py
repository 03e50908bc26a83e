"""fastckpt.io.parallel_io and the native pread_crc/pwrite_crc it runs on: every byte lands
where it should, every segment's CRC32C is right, and every error names the file."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt import _C
from fastckpt.config import IOConfig
from fastckpt.io import parallel_io
from fastckpt.io.checksums import crc32c_combine
from fastckpt.io.executor import Executor
from fastckpt.io.files import File
from fastckpt.io.parallel_io import Span

SIZES = [1, 4095, 4097, (1 << 20) + 3, 5 << 20]


def _random(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def _crc(data: np.ndarray, lo: int, hi: int) -> int:
    return _C.crc32c(data.ctypes.data + lo, hi - lo) if hi > lo else 0


def _spans(data: np.ndarray, size: int, offset: int = 0) -> list[Span]:
    """Spans of awkward sizes covering data, each cut into two segments where it can be."""
    spans, at = [], 0
    for n in [size, 1, size // 3 + 1, 4096] * 4:
        n = min(n, data.nbytes - at)
        if n <= 0:
            break
        cuts = (n // 2,) if n > 1 else ()
        spans.append(Span(offset + at, data.ctypes.data + at, n, cuts))
        at += n
    if at < data.nbytes:
        spans.append(Span(offset + at, data.ctypes.data + at, data.nbytes - at))
    return spans


def _expected_crcs(data: np.ndarray, spans: list[Span], offset: int) -> list[list[int]]:
    out = []
    for s in spans:
        lo = s.file_offset - offset
        bounds = (0, *s.cuts, s.nbytes)
        out.append([_crc(data, lo + a, lo + b) for a, b in zip(bounds, bounds[1:])])
    return out


@pytest.mark.parametrize("size", SIZES)
def test_write_then_read_buffered_round_trip(io_dir, size):
    data = _random(3 * size + 7, size)
    path = os.path.join(io_dir, "spans.bin")
    offset = 12345
    with File(path, write=True, create=True) as f:
        written = parallel_io.write_buffered(f, _spans(data, size, offset))
    back = np.zeros_like(data)
    with File(path) as f:
        read = parallel_io.read_buffered(f, _spans(back, size, offset))
    assert np.array_equal(back, data)
    assert written == read == _expected_crcs(data, _spans(data, size, offset), offset)


@pytest.mark.parametrize("size", SIZES)
def test_write_mapped_into_an_allocated_file_round_trips(io_dir, size):
    data = _random(3 * size + 7, size)
    path = os.path.join(io_dir, "mapped.bin")
    offset = 12345
    with File(path, write=True, create=True) as f:
        f.pwrite_all(b"head", 0)  # bytes before the spans are kept
        assert _C.preallocate(f.fd, offset + data.nbytes + 100, path)
        progress = []
        parallel_io.write_mapped(f, _spans(data, size, offset), on_progress=progress.append)
        assert sum(progress) == data.nbytes
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:4] == b"head"
    assert np.array_equal(np.frombuffer(raw[offset : offset + data.nbytes], np.uint8), data)
    assert raw[offset + data.nbytes :] == bytes(100)  # nothing written past the spans


def test_write_mapped_past_the_end_names_the_file_and_writes_nothing(tmp_path):
    path = str(tmp_path / "short.bin")
    data = _random(8192)
    with File(path, write=True, create=True) as f:
        _C.preallocate(f.fd, 4096, path)
        with pytest.raises(OSError) as info:
            parallel_io.write_mapped(f, [Span(0, data.ctypes.data, data.nbytes)])
    assert info.value.errno == errno.ENODATA and info.value.filename == path
    with open(path, "rb") as f:
        assert f.read() == bytes(4096)


@pytest.mark.parametrize("size", [4096, (1 << 20) + 3])
def test_read_direct_round_trip(tmp_path, engine, size):
    data = _random(4 * size, 1)
    path = tmp_path / "direct.bin"
    path.write_bytes(data.tobytes())
    back = np.zeros_like(data)
    spans = _spans(back, size)
    with File(path) as f:
        crcs = parallel_io.read_direct(Executor(IOConfig(engine=engine)), f, spans, owner=back)
    assert np.array_equal(back, data)
    assert crcs == _expected_crcs(data, spans, 0)


def test_checksums_can_be_skipped(tmp_path):
    data = _random(10000)
    path = tmp_path / "x.bin"
    path.write_bytes(data.tobytes())
    back = np.zeros_like(data)
    with File(path) as f:
        assert parallel_io.read_buffered(f, _spans(back, 3000), checksum=False) == [[]] * len(
            _spans(back, 3000)
        )
    assert np.array_equal(back, data)


def test_reading_past_the_end_names_the_file_and_waits_for_the_rest(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100_000)
    back = np.zeros(64 << 20, dtype=np.uint8)
    spans = [Span(i << 20, back.ctypes.data + (i << 20), 1 << 20) for i in range(64)]
    with File(path) as f, pytest.raises(OSError) as info:
        parallel_io.read_buffered(f, spans)
    assert info.value.errno == errno.ENODATA
    assert info.value.filename == str(path)
    assert "truncated" in str(info.value)


def test_native_checks_ranges_and_cuts(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"y" * 100)
    buf = np.zeros(100, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            _C.pread_crc(fd, buf.ctypes.data, 10, 0, [5, 5], True, str(path))
        assert info.value.errno == errno.EINVAL
        with pytest.raises(OSError) as info:
            _C.pread_crc(fd, buf.ctypes.data, 10, 2**63 - 5, [], True, str(path))
        assert info.value.errno == errno.EOVERFLOW
        with pytest.raises(OSError) as info:
            _C.pread_crc(-1, buf.ctypes.data, 10, 0, [], True, "nowhere")
        assert info.value.errno == errno.EBADF and info.value.filename == "nowhere"
        assert _C.pread_crc(fd, buf.ctypes.data, 0, 0) == [0]
    finally:
        os.close(fd)


def test_memory_checksums_match():
    data = _random(3 << 20, 5)
    spans = _spans(data, 1 << 20)
    assert parallel_io.checksum_memory(spans) == _expected_crcs(data, spans, 0)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32c_combine_joins_pieces(a, b):
    joined = np.frombuffer(a + b, dtype=np.uint8) if a + b else np.zeros(1, dtype=np.uint8)
    whole = _C.crc32c(joined.ctypes.data, len(a) + len(b))
    crc_a = _C.crc32c(joined.ctypes.data, len(a))
    crc_b = _C.crc32c(joined.ctypes.data + len(a), len(b))
    assert crc32c_combine(crc_a, crc_b, len(b)) == whole
