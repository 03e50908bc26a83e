"""The per-piece checksum table (``fastckpt.piece_crc32c``): encoding, strict parsing, and the
reader's checks that it matches the tensors; files holding it stay safetensors files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import torch

import fastckpt
from fastckpt import format as fmt
from fastckpt.errors import HeaderError

KEY = fmt.KEY_PIECE_CRC32C


def test_round_trip():
    meta = fmt.build_metadata(
        crcs={"w": 1, "b": 2}, pieces={"w": [0xDEADBEEF, 0, 7]}, piece_size=8192
    )
    assert json.loads(meta[KEY]) == {
        "piece_size": 8192,
        "crcs": {"w": "deadbeef0000000000000007"},
    }
    table = fmt.split_metadata(meta).pieces
    assert table.piece_size == 8192 and table.crcs("w") == [0xDEADBEEF, 0, 7]
    assert table.crc("w", 2) == 7 and table.crcs("b") is None
    with pytest.raises(IndexError, match="no piece 3"):
        table.crc("w", 3)
    # no tensor larger than a piece: no key (a small header stays small)
    assert KEY not in fmt.build_metadata(crcs={"w": 1}, pieces={}, piece_size=8192)
    assert fmt.split_metadata(fmt.build_metadata(crcs={"w": 1})).pieces is None


def test_piece_count():
    size = fmt.DEFAULT_ALIGNMENT
    assert [fmt.piece_count(n, size) for n in (0, 1, size, size + 1, 3 * size)] == [0, 0, 0, 2, 3]
    assert fmt.DEFAULT_PIECE_SIZE % fmt.DEFAULT_ALIGNMENT == 0


def test_table_is_small():
    # 100 GB of tensors in 4 MiB pieces: a few hundred KB of header
    pieces = {f"layer{i}": [0] * 256 for i in range(100)}  # 100 tensors of 1 GiB
    text = fmt.build_metadata(pieces=pieces, piece_size=fmt.DEFAULT_PIECE_SIZE)[KEY]
    assert len(text) < 300_000


@pytest.mark.parametrize(
    "pieces, piece_size, match",
    [
        ({"w": [1]}, None, "piece_size"),
        ({"w": [1]}, 4096 + 1, "piece_size"),
        ({"w": [1]}, 0, "piece_size"),
        ({"w": [1]}, True, "piece_size"),
        ({"w": [1]}, 2**31, "piece_size"),
        ({"w": []}, 4096, "'w'"),
        ({"w": [2**32]}, 4096, "'w'"),
        ({"w": [-1]}, 4096, "'w'"),
        ({"w": [1.0]}, 4096, "'w'"),
    ],
)
def test_build_rejects(pieces, piece_size, match):
    with pytest.raises(ValueError, match=match):
        fmt.build_metadata(pieces=pieces, piece_size=piece_size)


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "invalid JSON"),
        ("[]", "keys piece_size and crcs"),
        ('{"piece_size": 4096}', "keys piece_size and crcs"),
        ('{"piece_size": 4096, "crcs": {}, "x": 1}', "keys piece_size and crcs"),
        ('{"piece_size": 4096, "crcs": {}, "crcs": {}}', "duplicate"),
        ('{"piece_size": 4095, "crcs": {}}', "piece_size must be"),
        ('{"piece_size": 0, "crcs": {}}', "piece_size must be"),
        ('{"piece_size": 4096.0, "crcs": {}}', "piece_size must be"),
        ('{"piece_size": true, "crcs": {}}', "piece_size must be"),
        ('{"piece_size": "4096", "crcs": {}}', "piece_size must be"),
        ('{"piece_size": 2147483648, "crcs": {}}', "piece_size must be"),
        ('{"piece_size": 4096, "crcs": []}', "crcs must be a JSON object"),
        ('{"piece_size": 4096, "crcs": {"w": 5}}', r"\[.w.\]"),
        ('{"piece_size": 4096, "crcs": {"w": ""}}', "at least one piece"),
        ('{"piece_size": 4096, "crcs": {"w": "0000000"}}', "8 lowercase hex"),
        ('{"piece_size": 4096, "crcs": {"w": "000000000"}}', "8 lowercase hex"),
        ('{"piece_size": 4096, "crcs": {"w": "DEADBEEF"}}', "8 lowercase hex"),
        ('{"piece_size": 4096, "crcs": {"w": "0000000g"}}', "8 lowercase hex"),
        ('{"piece_size": 4096, "crcs": {"w": " 0000000"}}', "8 lowercase hex"),
    ],
)
def test_split_rejects_malformed(text, match):
    with pytest.raises(HeaderError, match=match) as info:
        fmt.split_metadata({KEY: text})
    assert KEY in str(info.value)


def _file(tmp_path, pieces: dict, nbytes: int = 3 * 4096 + 10) -> str:
    """A file holding tensor "w" of ``nbytes`` and tensor "b" of 8 bytes, with this table."""
    entries = fmt.plan_layout([("w", "U8", (nbytes,)), ("b", "U8", (8,))])
    meta = fmt.build_metadata(crcs={"w": 0, "b": 0}, pieces=pieces, piece_size=4096)
    path = str(tmp_path / "f.safetensors")
    with open(path, "wb") as f:
        f.write(fmt.encode_header(entries, meta) + bytes(nbytes + 8))
    return path


@pytest.mark.parametrize(
    "pieces, match",
    [
        ({"w": [0, 0, 0]}, r"'w' \(12298 bytes\) has 4 pieces of 4096 bytes, but .* lists 3"),
        ({"w": [0] * 5}, "lists 5"),
        ({"w": [0] * 4, "b": [0]}, r"'b' \(8 bytes\) has 0 pieces"),
        ({"w": [0] * 4, "gone": [0]}, "piece checksums for missing tensor 'gone'"),
        ({"b": [0]}, "has 0 pieces"),
    ],
)
def test_reader_checks_table_against_tensors(tmp_path, pieces, match):
    path = _file(tmp_path, pieces)
    with pytest.raises(HeaderError, match=match) as info:
        fastckpt.open(path)
    assert path in str(info.value)


def test_reader_requires_every_large_tensor(tmp_path):
    entries = fmt.plan_layout([("w", "U8", (3 * 4096,)), ("v", "U8", (4097,))])
    meta = fmt.build_metadata(pieces={"w": [0] * 3}, piece_size=4096)
    path = str(tmp_path / "f.safetensors")
    with open(path, "wb") as f:
        f.write(fmt.encode_header(entries, meta) + bytes(3 * 4096 + 4097))
    with pytest.raises(HeaderError, match=r"tensor 'v' \(4097 bytes\) has no piece checksums"):
        fastckpt.open(path)


def test_safetensors_reads_files_with_piece_tables(tmp_path):
    path = str(tmp_path / "pieces.safetensors")
    data = np.arange(40_000, dtype=np.float32)
    fastckpt.save({"w": torch.from_numpy(data.copy())}, path, piece_size=4096)  # 40 pieces
    with fastckpt.open(path) as r:
        assert len(r.meta.pieces.crcs("w")) == -(-data.nbytes // 4096)
    with safetensors.safe_open(path, "np") as f:
        assert np.array_equal(f.get_tensor("w"), data)
        assert KEY in f.metadata()
    assert np.array_equal(safetensors.numpy.load_file(path)["w"], data)
