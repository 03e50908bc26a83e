"""Verified range reads: CheckpointReader.read_range and get_slice read only the checksummed
pieces covering what is asked for, and name the damaged piece."""

from __future__ import annotations

import pytest
import torch

import fastckpt
from fastckpt import _C
from fastckpt import format as fmt
from fastckpt.checkpoint.save import save as local_save

PIECE = 16 << 10
NBYTES = 3 * PIECE + 1001  # an awkward size: the last piece is short and unaligned


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ranges") / "r.safetensors")
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=g)
    local_save({"w": w, "small": torch.arange(5.0)}, path, piece_size=PIECE)
    return path, w


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize(
    "start, stop",
    [(0, 0), (0, 1), (PIECE - 1, PIECE + 1), (PIECE, 2 * PIECE), (100, NBYTES), (0, NBYTES),
     (4095, 4097), (NBYTES - 1, NBYTES)],
)  # fmt: skip
def test_range_matches_tensor_and_reads_covering_pieces(saved, direct_io, verify, start, stop):
    path, w = saved
    for out in (None, torch.full((stop - start,), 7, dtype=torch.uint8)):
        with fastckpt.open(path, direct_io=direct_io) as r:
            got = r.read_range("w", start, stop, out=out, verify=verify)
            assert torch.equal(got, w[start:stop])
            if out is not None:
                assert got is out
            if not verify or start == stop:
                assert r.bytes_read == stop - start  # exactly the range
            else:
                lo, hi = start // PIECE * PIECE, min(NBYTES, -(-stop // PIECE) * PIECE)
                assert r.bytes_read == hi - lo  # rounded out to whole pieces


def test_out_of_any_dtype_is_filled_in_place(saved):
    path, w = saved
    out = torch.empty(PIECE // 4, dtype=torch.float32)
    with fastckpt.open(path) as r:
        r.read_range("w", 2 * PIECE, 3 * PIECE, out=out, verify=True)
    assert torch.equal(out.view(torch.uint8), w[2 * PIECE : 3 * PIECE])


def _damage(path: str, name: str, at: int) -> None:
    with fastckpt.open(path) as r:
        offset = r.info(name).offset + at
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x5A]))


@pytest.mark.parametrize("direct_io", [True, False])
def test_damaged_piece_fails_only_reads_covering_it(saved, tmp_path, direct_io):
    src, w = saved
    path = str(tmp_path / "damaged.safetensors")
    with open(src, "rb") as f, open(path, "wb") as g:
        g.write(f.read())
    _damage(path, "w", 2 * PIECE + 77)  # inside piece 2
    with fastckpt.open(path, direct_io=direct_io) as r:
        assert torch.equal(r.read_range("w", 0, 2 * PIECE, verify=True), w[: 2 * PIECE])
        assert torch.equal(r.read_range("w", 3 * PIECE, NBYTES, verify=True), w[3 * PIECE :])
        assert torch.equal(r.get_slice("w", verify=True)[: 2 * PIECE], w[: 2 * PIECE])
        for start, stop in [(2 * PIECE, 2 * PIECE + 1), (PIECE, 3 * PIECE + 5), (0, NBYTES)]:
            out = torch.empty(stop - start, dtype=torch.uint8)
            with pytest.raises(fastckpt.ChecksumError) as info:
                r.read_range("w", start, stop, out=out, verify=True)
            message = str(info.value)
            assert path in message and "'w'" in message
            assert f"piece 2 of 4 (tensor bytes [{2 * PIECE}, {3 * PIECE}))" in message
            assert info.value.tensor == "w" and info.value.filename == path
        # unverified, the range is read as it is on disk
        damaged = r.read_range("w", 2 * PIECE, 3 * PIECE)
        assert (damaged != w[2 * PIECE : 3 * PIECE]).sum() == 1


def _strip_piece_table(src: str, dst: str) -> None:
    """Writes ``src`` without its piece table (as a writer from before it existed would)."""
    with fastckpt.open(src) as r:
        entries, metadata = list(r.header.entries.values()), dict(r.header.metadata)
        data_offset, data_size = r.header.data_offset, r.header.data_size
    del metadata[fmt.KEY_PIECE_CRC32C]
    header = fmt.encode_header(entries, metadata)
    assert len(header) == data_offset  # both fit the first aligned block
    with open(src, "rb") as f, open(dst, "wb") as g:
        f.seek(data_offset)
        g.write(header + f.read(data_size))


@pytest.mark.parametrize("how", ["stripped", "piece_size=0"])
def test_files_without_piece_table_read_and_verify_whole_tensor(saved, tmp_path, how):
    src, w = saved
    path = str(tmp_path / "old.safetensors")
    if how == "stripped":
        _strip_piece_table(src, path)
    else:
        local_save({"w": w, "small": torch.arange(5.0)}, path, piece_size=0)
    with fastckpt.open(path) as r:
        assert r.has_checksums and r.meta.pieces is None
        assert torch.equal(r.read_range("w", 10, 20, verify=True), w[10:20])
        assert r.bytes_read == NBYTES  # the whole tensor, to check its one CRC32C
        assert torch.equal(r.read_range("w", 10, 20), w[10:20])
        assert r.bytes_read == NBYTES + 10
    _damage(path, "w", NBYTES - 1)
    with fastckpt.open(path) as r:
        with pytest.raises(fastckpt.ChecksumError, match=r"tensor 'w' in .* is damaged: CRC32C"):
            r.read_range("w", 0, 1, verify=True)


def test_get_slice(tmp_path):
    path = str(tmp_path / "s.safetensors")
    w = torch.randn(50, 33).to(torch.bfloat16)  # 66-byte rows: pieces cut rows
    local_save(
        {"w": w, "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4)}, path, piece_size=4096
    )
    with fastckpt.open(path) as r:
        s = r.get_slice("w", verify=True)
        assert s.shape == (50, 33) and s.dtype == torch.bfloat16 and len(s) == 50
        assert s.get_shape() == [50, 33] and s.get_dtype() == "BF16"
        for index in [slice(3, 9), slice(None), slice(-5, None), slice(40, 10), slice(1, 40, 7),
                      7, -1, (slice(2, 4), slice(5, 8)), (4, 3), (..., 2), ()]:  # fmt: skip
            assert torch.equal(s[index], w[index]), index
        before = r.bytes_read
        s2 = r.get_slice("w")
        assert torch.equal(s2[10:20], w[10:20])
        assert r.bytes_read - before == 10 * 33 * 2  # only the rows
        assert r.get_slice("scalar")[()].item() == 3.5
        assert r.get_slice("empty")[:].shape == (0, 4)
        with pytest.raises(ValueError, match="step"):
            s[::-1]
        with pytest.raises(IndexError, match="out of bounds"):
            s[50]
        with pytest.raises(TypeError, match="first index"):
            s[{1, 2}]


def test_read_range_rejects_bad_arguments(saved, tmp_path):
    path, _ = saved
    with fastckpt.open(path) as r:
        with pytest.raises(ValueError, match=r"\[5, 4\) is not within tensor 'w'"):
            r.read_range("w", 5, 4)
        with pytest.raises(ValueError, match="not within"):
            r.read_range("w", 0, NBYTES + 1)
        with pytest.raises(TypeError, match="start must be an int"):
            r.read_range("w", 1.0, 4)
        with pytest.raises(ValueError, match="out holds 8 bytes, the range has 4"):
            r.read_range("w", 0, 4, out=torch.empty(8, dtype=torch.uint8))
        with pytest.raises(ValueError, match="contiguous"):
            r.read_range("w", 0, 4, out=torch.empty(2, 4, dtype=torch.uint8)[:, 0])
        with pytest.raises(KeyError, match="'nope'"):
            r.read_range("nope", 0, 1)
    plain = str(tmp_path / "plain.safetensors")
    local_save({"w": torch.ones(4)}, plain, checksum=False)
    with fastckpt.open(plain) as r:
        assert r.meta.pieces is None
        with pytest.raises(fastckpt.NoChecksumsError, match="records no checksums"):
            r.read_range("w", 0, 4, verify=True)


def _expected_pieces(t: torch.Tensor, piece: int) -> list[int]:
    raw = _raw(t)
    return [_C.crc32c(raw[i:].data_ptr(), min(piece, raw.numel() - i)) for i in range(0, raw.numel(), piece)]  # fmt: skip


def test_every_save_path_records_piece_checksums(tmp_path):
    big = torch.randn(9 << 18)  # 9 MiB: 3 pieces of the default 4 MiB
    strided = torch.randn(700, 2100).t()  # saved a slab at a time
    expected = {
        "big": _expected_pieces(big, fmt.DEFAULT_PIECE_SIZE),
        "strided": _expected_pieces(strided, fmt.DEFAULT_PIECE_SIZE),
    }
    state = {"big": big, "strided": strided, "small": torch.ones(3)}
    paths = {}
    for direct_io in (True, False):  # staging buffers / from the tensors' memory
        paths[f"direct_io={direct_io}"] = str(tmp_path / f"d{direct_io}.safetensors")
        fastckpt.save(state, paths[f"direct_io={direct_io}"], direct_io=direct_io)
    paths["async"] = str(tmp_path / "async.safetensors")
    fastckpt.async_save(state, paths["async"]).result()
    paths["url"] = "memory://pieces/url.safetensors"  # the remote writer: checksums first
    fastckpt.save(state, paths["url"])
    for how, path in paths.items():
        with fastckpt.open(path) as r:
            table = r.meta.pieces
            assert table is not None and table.piece_size == fmt.DEFAULT_PIECE_SIZE, how
            assert {n: table.crcs(n) for n in table.digests} == expected, how
            assert r.meta.crcs["big"] == _C.crc32c(big.data_ptr(), big.numel() * 4), how
            assert not r.verify(), how


@pytest.mark.parametrize("direct_io", [True, False])
def test_piece_table_larger_than_header_padding(tmp_path, direct_io):
    # 1000 pieces: 8 KB of table, more than one aligned block of header
    w = torch.randint(0, 256, (1000 * 4096,), dtype=torch.uint8)
    path = str(tmp_path / "many.safetensors")
    local_save({"w": w}, path, piece_size=4096, direct_io=direct_io)
    with fastckpt.open(path) as r:
        assert r.header.data_offset > 8192
        assert r.meta.pieces.crcs("w") == _expected_pieces(w, 4096)
        assert torch.equal(r.read_range("w", 5000, 9000, verify=True), w[5000:9000])
