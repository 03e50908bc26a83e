"""One conformance suite for every storage (a local file, ``memory://``, ``s3://`` on a real
moto server): the same calls give the same bytes, checksums and errors."""

from __future__ import annotations

import io
import uuid

import pytest
import torch

from fastckpt import _C, storage
from fastckpt.io.parallel_io import Span

KINDS = ["local", "memory", "s3"]
DATA = bytes(range(256)) * 40 + b"tail"  # 10244 bytes: not a whole number of pages


@pytest.fixture(params=KINDS)
def location(request, tmp_path) -> tuple[str, dict | None]:
    if request.param == "local":
        return str(tmp_path / "blob.bin"), None
    if request.param == "memory":
        return f"memory://storage-{uuid.uuid4().hex[:8]}/blob.bin", None
    bucket, options, _ = request.getfixturevalue("s3")
    return f"{bucket}/blob.bin", options


def _written(location) -> storage.Storage:
    url, options = location
    sink = storage.open_storage(url, storage_options=options, create=True)
    sink.write_atomically(
        [DATA[:1000], torch.frombuffer(bytearray(DATA[1000:]), dtype=torch.uint8)], len(DATA)
    )
    return storage.open_storage(url, storage_options=options)


def test_size_and_small_reads(location):
    with _written(location) as s:
        assert s.size() == len(DATA)
        assert s.read_bytes(0, 8) == DATA[:8]
        assert s.read_bytes(10000, 244) == DATA[10000:10244]
        mode, why = s.choose_mode((0, len(DATA)))
        assert mode in ("direct", "buffered", "ranged") and why


def test_ranged_reads_land_in_given_memory_with_checksums(location):
    with _written(location) as s:
        out = torch.zeros(len(DATA), dtype=torch.uint8)
        base = out.data_ptr()
        spans = [Span(0, base, 5000, (100,)), Span(5000, base + 5000, len(DATA) - 5000)]
        mode, _ = s.choose_mode((0, len(DATA)))
        crcs = s.read_spans(
            spans, owner=out, mode="buffered" if mode == "direct" else mode, checksum=True
        )
        assert bytes(out.numpy()) == DATA
        assert crcs == [
            [_C.crc32c(base, 100), _C.crc32c(base + 100, 4900)],
            [_C.crc32c(base + 5000, len(DATA) - 5000)],
        ]
        assert s.read_spans(spans, owner=out, mode=mode, checksum=False) == [[], []]


def test_a_failed_write_leaves_the_old_file(location):
    url, options = location
    _written(location).close()

    def pieces():
        yield b"new bytes"
        raise RuntimeError("the source failed")

    sink = storage.open_storage(url, storage_options=options, create=True)
    with pytest.raises((RuntimeError, OSError)):
        sink.write_atomically(pieces(), 100)
    assert storage.read_whole(url, options) == DATA


def test_what_only_a_local_file_can_do(location):
    url, _ = location
    with _written(location) as s:
        if url.startswith("/"):
            assert s.local_file().size() == len(DATA)
        else:
            with pytest.raises(io.UnsupportedOperation, match="not a local file"):
                s.local_file()


def test_missing_files_are_file_not_found(location):
    url, options = location
    with pytest.raises(FileNotFoundError) as info:
        storage.open_storage(url, storage_options=options)
    assert url in str(info.value)


def test_delete(location):
    url, options = location
    _written(location).close()
    sink = storage.open_storage(url, storage_options=options, create=True)
    sink.delete()
    assert not storage.exists(url, options)
    with pytest.raises(FileNotFoundError):
        sink.delete()
