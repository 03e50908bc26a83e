"""Compressed checkpoints: every dtype round-trips, slices decompress only what they need,
plain safetensors refuses the file, hostile frames raise naming the tensor, and a save killed
mid-way leaves the old file."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

import fastckpt
from fastckpt import format
from fastckpt.codec import byteplane, frames
from fastckpt.errors import ChecksumError, HeaderError
from fastckpt.format import compressed as layout

pytest.importorskip("zstandard")


def _compressible(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Data of ``dtype`` that shrinks: weight-like floats, small integers, sparse bools."""
    g = torch.Generator().manual_seed(numel)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) < 0.1
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g) * 0.02).to(dtype)
    if dtype == torch.complex64:
        return torch.complex(torch.randn(numel, generator=g), torch.zeros(numel)) * 0.02
    return (torch.arange(numel) % 11).to(dtype)


DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
]


def _header_json(path) -> dict:
    with open(path, "rb") as f:
        data = f.read(1 << 20)
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


@pytest.mark.parametrize("mode", [True, "zstd", "byteplane"])
def test_every_dtype_round_trips_compressed(tmp_path, mode):
    state = {str(dt).split(".")[1]: _compressible(dt, 6000) for dt in DTYPES}
    state["empty"] = torch.zeros(0, 3, dtype=torch.bfloat16)
    state["scalar"] = torch.tensor(3.5)
    state["small"] = torch.arange(5)
    state["matrix"] = _compressible(torch.bfloat16, 3 << 20).reshape(3072, 1024)
    path = tmp_path / "c.safetensors"
    fastckpt.save(state, path, compress=mode)
    back = fastckpt.load(path, verify=True)
    assert list(back) == list(state)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    stored = _header_json(path)
    packed = json.loads(stored["__metadata__"][layout.KEY_COMPRESSED])
    # every tensor worth compressing is stored compressed; tiny and empty ones as they are
    assert {"bfloat16", "float32", "int64", "bool", "matrix"} <= set(packed)
    assert {"empty", "scalar", "small"}.isdisjoint(packed)
    assert stored["matrix"]["dtype"] == layout.COMPRESSED_DTYPE
    assert packed["matrix"] == {**packed["matrix"], "dtype": "BF16", "shape": [3072, 1024]}
    with fastckpt.open(path) as r:
        assert r.info("matrix").dtype == torch.bfloat16 and r.info("matrix").shape == (3072, 1024)
        assert r.verify() == []


def test_a_compressed_file_is_smaller_and_plain_safetensors_refuses_it(tmp_path):
    w = _compressible(torch.bfloat16, 1 << 20)
    plain, packed = tmp_path / "plain.safetensors", tmp_path / "packed.safetensors"
    fastckpt.save({"w": w}, plain)
    fastckpt.save({"w": w}, packed, compress=True)
    assert packed.stat().st_size < 0.75 * plain.stat().st_size
    assert torch.equal(safetensors.torch.load_file(str(plain))["w"], w)  # default: off
    with pytest.raises(safetensors.SafetensorError, match="fastckpt.compressed"):
        safetensors.torch.load_file(str(packed))


def test_compress_refuses_an_unknown_mode(tmp_path):
    with pytest.raises(ValueError, match="compress must be"):
        fastckpt.save({"w": torch.ones(2)}, tmp_path / "x.safetensors", compress="lz4")
    assert not (tmp_path / "x.safetensors").exists()


def test_tied_tensors_are_compressed_once_and_stay_tied(tmp_path):
    w = _compressible(torch.float32, 1 << 16)
    path = tmp_path / "tied.safetensors"
    fastckpt.save({"embed": w, "head": w}, path, compress=True)
    back = fastckpt.load(path)
    assert back["embed"] is back["head"] and torch.equal(back["embed"], w)


@pytest.mark.parametrize("verify", [False, True])
def test_slices_and_ranges_decompress_only_the_chunks_they_need(tmp_path, verify):
    rows, cols = 4096, 1024  # 8 MiB of bf16: four chunks of 2 MiB
    w = _compressible(torch.bfloat16, rows * cols).reshape(rows, cols)
    path = tmp_path / "s.safetensors"
    fastckpt.save({"w": w}, path, compress=True)
    with fastckpt.open(path) as r:
        whole = r.info("w").nbytes
        s = r.get_slice("w", verify=verify)
        assert s.shape == (rows, cols) and s.get_dtype() == "BF16"
        before = r.bytes_read
        assert torch.equal(s[10:20], w[10:20])
        # one chunk's planes; verified, the checksummed pieces that hold them
        limit = 2 * path.stat().st_size if verify else whole // 3
        assert r.bytes_read - before < limit
        assert torch.equal(s[1000:1100], w[1000:1100])  # across a chunk boundary
        assert torch.equal(s[-1, 5:9], w[-1, 5:9])
        assert torch.equal(s[[3, 1500, 3]], w[[3, 1500, 3]])
        raw = w.view(torch.uint8).reshape(-1)
        assert torch.equal(
            r.read_range("w", 1_048_570, 1_048_590, verify=verify), raw[1_048_570:1_048_590]
        )
        out = torch.empty(8, dtype=torch.bfloat16)
        r.read_range("w", 2 * 2000 * cols, 2 * 2000 * cols + 16, out=out, verify=verify)
        assert torch.equal(out, w[2000, :8])
        assert r.read_range("w", 7, 7).numel() == 0
        with pytest.raises(ValueError):
            r.read_range("w", 0, whole + 1)


def test_map_and_prefetch_give_decompressed_tensors(tmp_path):
    w = _compressible(torch.float32, 1 << 16)
    path = tmp_path / "m.safetensors"
    fastckpt.save({"w": w, "b": torch.ones(3)}, path, compress=True)
    assert torch.equal(fastckpt.load(path, mmap=True)["w"], w)
    with fastckpt.open(path) as r:
        r.prefetch(["w", "b"])
        assert torch.equal(r.get_tensor("w"), w) and torch.equal(r.get_tensor("b"), torch.ones(3))
        assert torch.equal(r.get_tensors(["w"], verify=True)["w"], w)


def test_compressed_saves_reach_file_objects_and_urls(tmp_path):
    import io

    w = _compressible(torch.bfloat16, 1 << 16)
    buffer = io.BytesIO()
    fastckpt.save({"w": w}, buffer, compress=True)
    assert torch.equal(fastckpt.load_bytes(buffer.getvalue())["w"], w)
    fastckpt.save({"w": w}, "memory://compression-test/w.safetensors", compress="zstd")
    assert torch.equal(fastckpt.load("memory://compression-test/w.safetensors")["w"], w)
    shards = {f"layer{i}": _compressible(torch.bfloat16, 1 << 18) for i in range(3)}
    fastckpt.save(shards, tmp_path / "sharded/", max_shard_size="600KB", compress=True)
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    back = fastckpt.load(tmp_path / "sharded")
    assert all(torch.equal(back[k], v) for k, v in shards.items())


def test_a_damaged_stored_byte_is_caught(tmp_path):
    w = _compressible(torch.bfloat16, 1 << 18)
    path = tmp_path / "d.safetensors"
    fastckpt.save({"w": w}, path, compress=True)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40  # in the last stored plane
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="'w'"):
        fastckpt.load(path, verify=True)
    with pytest.raises((ChecksumError, HeaderError), match="'w'"):
        fastckpt.load(path, verify=False)  # zstd's checksum or the uncompressed CRC32C


# --------------------------------------------------------------------------- hostile frames


def _write(path, frame: bytes, *, dtype="BF16", shape=(1024,), crc=0, table=None) -> None:
    """A file holding tensor 'w' as ``frame``, with a valid header checksum."""
    entries = format.plan_layout([("w", layout.COMPRESSED_DTYPE, (len(frame),))])
    nbytes = format.ITEMSIZE[dtype] * int(np.prod(shape))
    described = {"w": layout.CompressedTensor(dtype, tuple(shape), nbytes, crc)}
    meta = format.build_metadata()
    meta[layout.KEY_COMPRESSED] = table if table is not None else layout.encode_table(described)
    path.write_bytes(format.encode_header(entries, meta) + frame)


def _good_frame(n: int = 1024) -> tuple[bytes, int, torch.Tensor]:
    w = _compressible(torch.bfloat16, n)
    frame, crc = frames.compress(w.view(torch.uint8).numpy(), "byteplane", 2, chunk_bytes=512)
    return frame.tobytes(), crc, w


def _expect(path, error, match):
    with pytest.raises(error, match=match) as caught:
        fastckpt.load(path)
    assert "'w'" in str(caught.value)


def test_a_well_formed_hand_written_frame_loads(tmp_path):
    frame, crc, w = _good_frame()
    _write(tmp_path / "ok.safetensors", frame, crc=crc)
    assert torch.equal(fastckpt.load(tmp_path / "ok.safetensors")["w"], w)


@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.parametrize("count", [1, 3, 4097])
def test_byte_planes_round_trip_for_every_rotation(itemsize, count):
    data = np.random.default_rng(count).integers(0, 256, count * itemsize, dtype=np.uint8)
    for rotation in range(1, 8 * itemsize):
        planes = byteplane.split(data, itemsize, rotation)
        out = np.zeros_like(data)
        byteplane.merge(planes, out, itemsize, rotation)
        assert (out == data).all(), rotation
    with pytest.raises(ValueError, match="rotation"):
        byteplane.split(data, itemsize, 8 * itemsize)


def test_frames_of_the_first_byte_plane_codec_still_load(tmp_path):
    # codec 2, written before the rotation was chosen per tensor: one bit, 0 in its field
    w = _compressible(torch.bfloat16, 4096)
    stored, crc = frames.compress_chunk(w.view(torch.uint8).numpy(), "byteplane", 2, 1)
    table = layout.frame_table(layout.CODEC_BYTEPLANE, 2, 8192, 8192, [len(s) for s in stored])
    head = layout.encode_frame_head(table)
    assert head[6:8] == bytes(2)
    frame = head + b"".join(bytes(s) for s in stored)
    _write(tmp_path / "old.safetensors", frame, shape=(4096,), crc=crc)
    assert torch.equal(fastckpt.load(tmp_path / "old.safetensors")["w"], w)


def test_each_tensor_takes_the_rotation_that_stores_fewest_bytes(tmp_path):
    w = (torch.randn(1024, 1024) * 0.02).to(torch.bfloat16)  # |x| < 2: the top exponent bit is 0
    raw = w.view(torch.uint8).numpy().reshape(-1)
    probe = raw[: frames.ROTATION_PROBE_BYTES]
    sizes = {}
    for rotation in frames.ROTATIONS:
        planes = byteplane.split(probe, 2, rotation)
        sizes[rotation] = sum(len(frames._compressor(3).compress(p)) for p in planes)
    chosen = frames.choose_rotation(raw, 2)
    assert sizes[chosen] == min(sizes.values()) and chosen > 1
    fastckpt.save({"w": w}, tmp_path / "w.safetensors", compress=True)
    assert _frame_head(tmp_path / "w.safetensors", "w", 2) == (layout.CODEC_ROTATED_PLANES, chosen)

    def stored(rotation):
        piece = raw[: frames.DEFAULT_CHUNK_BYTES]
        return sum(len(p) for p in frames.compress_chunk(piece, "byteplane", 2, rotation)[0])

    assert stored(chosen) < stored(1)
    assert torch.equal(fastckpt.load(tmp_path / "w.safetensors")["w"], w)


def test_a_tensor_too_small_to_probe_takes_its_dtypes_rotation(tmp_path):
    small = {"h": torch.randn(64, 64).half(), "b": torch.randn(64, 64).bfloat16()}
    fastckpt.save(small, tmp_path / "s.safetensors", compress=True)
    assert _frame_head(tmp_path / "s.safetensors", "h", 2)[1] == 1
    assert _frame_head(tmp_path / "s.safetensors", "b", 2)[1] == 3
    back = fastckpt.load(tmp_path / "s.safetensors")
    assert all(torch.equal(back[k], v) for k, v in small.items())


def _frame_head(path, name: str, itemsize: int) -> tuple[int, int]:
    """(codec, rotation) of the frame of the compressed tensor ``name``."""
    with fastckpt.open(path) as r:
        entry = r.header.entries[name]
        raw_bytes = r.compressed[name].nbytes
        with open(path, "rb") as f:
            f.seek(r.header.data_offset + entry.begin)
            head = layout.parse_frame_head(f.read(entry.nbytes), raw_bytes, itemsize, where=name)
    return head.codec, head.rotation


def test_a_rotation_out_of_range_is_refused(tmp_path):
    frame, crc, _ = _good_frame()
    assert frame[4] == layout.CODEC_ROTATED_PLANES
    for rotation in (0, 16, 0xFFFF):
        bad = bytearray(frame)
        struct.pack_into("<H", bad, 6, rotation)
        _write(tmp_path / f"r{rotation}.safetensors", bytes(bad), crc=crc)
        _expect(tmp_path / f"r{rotation}.safetensors", HeaderError, "rotation")
    zstd_frame, zcrc = frames.compress(np.zeros(2048, np.uint8), "zstd", 1)
    bad = bytearray(zstd_frame.tobytes())
    struct.pack_into("<H", bad, 6, 2)
    _write(tmp_path / "z.safetensors", bytes(bad), crc=zcrc)
    _expect(tmp_path / "z.safetensors", HeaderError, "rotation")


def test_a_truncated_frame_is_refused(tmp_path):
    frame, crc, _ = _good_frame()
    _write(tmp_path / "t.safetensors", frame[:-10], crc=crc)
    _expect(tmp_path / "t.safetensors", HeaderError, "adds up to")
    _write(tmp_path / "h.safetensors", frame[:20], crc=crc)
    _expect(tmp_path / "h.safetensors", HeaderError, "cut short")


def test_a_bad_magic_codec_or_size_is_refused(tmp_path):
    frame, crc, _ = _good_frame()
    _write(tmp_path / "m.safetensors", b"XXXX" + frame[4:], crc=crc)
    _expect(tmp_path / "m.safetensors", HeaderError, "does not start with")
    _write(tmp_path / "c.safetensors", frame[:4] + b"\x09" + frame[5:], crc=crc)
    _expect(tmp_path / "c.safetensors", HeaderError, "unknown compression codec")
    _write(tmp_path / "s.safetensors", frame, crc=crc, shape=(2048,))
    _expect(tmp_path / "s.safetensors", HeaderError, "holds 2048 bytes, the tensor has 4096")


def test_a_huge_declared_tensor_is_refused_before_allocating(tmp_path):
    frame, crc, _ = _good_frame()
    _write(tmp_path / "huge.safetensors", frame, crc=crc, shape=(1 << 40,))
    _expect(tmp_path / "huge.safetensors", HeaderError, "the tensor has")


def test_a_bad_chunk_table_is_refused(tmp_path):
    frame, crc, _ = _good_frame()
    head = bytearray(frame)
    struct.pack_into("<I", head, layout.HEAD_BYTES, 9999)  # plane longer than its raw bytes
    _write(tmp_path / "long.safetensors", bytes(head), crc=crc)
    _expect(tmp_path / "long.safetensors", HeaderError, "more than its")
    head = bytearray(frame)
    struct.pack_into("<I", head, 24, 7)  # a chunk count that 2048 bytes in 512 do not make
    _write(tmp_path / "count.safetensors", bytes(head), crc=crc)
    _expect(tmp_path / "count.safetensors", HeaderError, "chunks")


def test_a_frame_that_decompresses_to_more_or_fewer_bytes_is_refused(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    w = _compressible(torch.bfloat16, 1024)
    planes = byteplane.split(w.view(torch.uint8).numpy(), 2)
    for size, label in ((2048 * 4, "more"), (100, "fewer")):
        exponent = zstandard.ZstdCompressor().compress(bytes(size))
        stored = [exponent, planes[1].tobytes()]
        table = layout.frame_table(layout.CODEC_BYTEPLANE, 2, 2048, 2048, [len(s) for s in stored])
        if len(exponent) >= 1024:
            continue
        path = tmp_path / f"{label}.safetensors"
        _write(path, layout.encode_frame_head(table) + b"".join(stored), crc=0)
        _expect(path, HeaderError, "declares")


def test_a_damaged_zstd_frame_or_wrong_crc_raises_checksum_error(tmp_path):
    frame, crc, _ = _good_frame()
    table = layout.parse_frame_head(frame, 2048, 2, where="w")
    first_zstd = next(
        i for i, n in enumerate(table.stored_lengths) if n < table.chunk_raw_bytes(0) // 2
    )
    at = table.plane_offsets()[first_zstd] + table.stored_lengths[first_zstd] - 6
    damaged = bytearray(frame)
    damaged[at] ^= 0xFF
    _write(tmp_path / "z.safetensors", bytes(damaged), crc=crc)
    with pytest.raises((ChecksumError, HeaderError), match="'w'"):
        fastckpt.load(tmp_path / "z.safetensors")
    _write(tmp_path / "crc.safetensors", frame, crc=crc ^ 1)
    _expect(tmp_path / "crc.safetensors", ChecksumError, "CRC32C")


def test_a_header_that_hides_or_invents_compression_is_refused(tmp_path):
    frame, crc, _ = _good_frame()
    _write(tmp_path / "none.safetensors", frame, table="{}")
    with pytest.raises(HeaderError, match="not described"):
        fastckpt.open(tmp_path / "none.safetensors")
    bad = json.dumps({"w": {"dtype": "F4", "shape": [2], "crc32c": "00000000"}})
    _write(tmp_path / "f4.safetensors", frame, table=bad)
    with pytest.raises(HeaderError, match="cannot be compressed"):
        fastckpt.open(tmp_path / "f4.safetensors")
    other = json.dumps({"v": {"dtype": "F32", "shape": [2], "crc32c": "00000000"}})
    _write(tmp_path / "v.safetensors", frame, table=other)
    with pytest.raises(HeaderError, match="no fastckpt.compressed tensor"):
        fastckpt.open(tmp_path / "v.safetensors")


# --------------------------------------------------------------------------- kill -9

_SAVER = textwrap.dedent(
    """
    import sys, torch, fastckpt
    state = {"w": (torch.randn(8 << 20) * 0.02).to(torch.bfloat16)}
    print("ready", flush=True)
    while True:
        fastckpt.save(state, sys.argv[1], compress=True)
    """
)


def test_kill_9_during_a_compressed_save_leaves_the_old_file(tmp_path):
    target = tmp_path / "ckpt.safetensors"
    old = _compressible(torch.float32, 1 << 16)
    fastckpt.save({"old": old}, target, compress=True)
    for delay in (0.1, 0.5):
        child = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(target)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout.readline().strip() == "ready"
        try:
            child.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGKILL)
            child.wait()
        child.stdout.close()
        back = fastckpt.load(target, verify=True)  # never torn: the old state or a new one
        assert list(back) in (["old"], ["w"])
        if "old" in back:
            assert torch.equal(back["old"], old)


def test_load_into_a_module_decompresses_in_place(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 8)).to(
        torch.bfloat16
    )
    path = tmp_path / "model.safetensors"
    fastckpt.save(model.state_dict(), path, compress=True)
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 8)).to(
        torch.bfloat16
    )
    fastckpt.load_into(fresh, path)
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


@pytest.mark.cuda
def test_cuda_tensors_are_compressed_and_load_back_to_the_device(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    w = _compressible(torch.bfloat16, 1 << 18).cuda()
    path = tmp_path / "cuda.safetensors"
    fastckpt.save({"w": w}, path, compress=True)
    back = fastckpt.load(path, map_location="cuda")
    assert back["w"].is_cuda and torch.equal(back["w"], w)
    with fastckpt.open(path, device="cuda") as r:
        assert torch.equal(r.get_slice("w")[5:9], w[5:9])


def test_fastckpt_verify_checks_a_compressed_file(tmp_path):
    from fastckpt.cli.verify import verify_file

    path = tmp_path / "v.safetensors"
    fastckpt.save(
        {"w": _compressible(torch.bfloat16, 1 << 16), "b": torch.ones(2)}, path, compress=True
    )
    assert verify_file(path).ok
    data = bytearray(path.read_bytes())
    data[-50] ^= 1
    path.write_bytes(bytes(data))
    result = verify_file(path)
    assert not result.ok and "w" in str(result)


# --------------------------------------------------------------------------- pipelines


def _weights(nbytes: int) -> torch.Tensor:
    return _compressible(torch.bfloat16, nbytes // 2)


def test_compress_stream_reads_at_most_a_window_ahead_of_its_consumer():
    data = np.frombuffer(_weights(40 << 10).view(torch.uint8).numpy().tobytes(), np.uint8)
    asked: list[int] = []
    consumed = 0
    ahead = []

    def source(lo: int, hi: int) -> np.ndarray:
        asked.append(lo)
        return data[lo:hi]

    pieces = []
    for raw, _stored, crc in frames.compress_stream(
        source, data.nbytes, "byteplane", 2, chunk_bytes=1024, window=3
    ):
        ahead.append(len(asked) - consumed)
        consumed += 1
        pieces.append(raw.tobytes())
        assert crc == frames._crc(raw)
    assert b"".join(pieces) == data.tobytes() and consumed == 40
    assert max(ahead) <= 3  # never more chunks read than the window


@pytest.fixture
def two_codec_threads(monkeypatch):
    """The codec's pool as on a two-core machine: its windows (two chunks per core) are small
    and known, whatever this machine has."""
    monkeypatch.setattr(frames, "_threads", lambda: 2)
    monkeypatch.setattr(frames, "_pool", None)


def test_a_compressed_save_holds_a_few_chunks_not_the_tensor(tmp_path, two_codec_threads):
    import tracemalloc

    w = _weights(96 << 20)
    path = tmp_path / "big.safetensors"
    tracemalloc.start()
    try:
        fastckpt.save({"w": w}, path, compress=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    stored = path.stat().st_size
    assert stored < 0.75 * w.nbytes
    # planes and compressed bytes of 2 chunks per core in flight (2 MiB chunks), not the frame
    assert peak < 24 << 20 < stored / 2, (peak, stored)
    assert torch.equal(fastckpt.load(path, verify=True)["w"], w)


def test_a_compressed_save_writes_while_it_compresses(tmp_path, monkeypatch, two_codec_threads):
    w = _weights(32 << 20)  # 16 chunks
    seen: list[int] = []  # bytes in the directory's files when each chunk starts compressing
    compress_chunk = frames.compress_chunk

    def watched(piece, codec, itemsize, rotation=1):
        seen.append(sum(p.stat().st_size for p in tmp_path.iterdir()))
        return compress_chunk(piece, codec, itemsize, rotation)

    monkeypatch.setattr(frames, "compress_chunk", watched)
    path = tmp_path / "w.safetensors"
    fastckpt.save({"w": w}, path, direct_io=False, compress=True)
    assert len(seen) == 16
    # the last chunks compress after the first frames' planes reached the file
    assert seen[-1] > 4 << 20, seen
    assert torch.equal(fastckpt.load(path)["w"], w)


@pytest.mark.parametrize("verify", [False, True])
def test_a_compressed_load_decompresses_while_it_reads(tmp_path, monkeypatch, verify):
    w = _weights(32 << 20)
    path = tmp_path / "w.safetensors"
    fastckpt.save({"w": w}, path, compress=True)
    stored = path.stat().st_size
    with fastckpt.open(path) as r:
        read_when: list[int] = []
        decompress_chunks = frames.decompress_chunks

        def watched(*args, **kwargs):
            read_when.append(r.bytes_read)
            return decompress_chunks(*args, **kwargs)

        monkeypatch.setattr(frames, "decompress_chunks", watched)
        assert torch.equal(r.get_tensors(["w"], verify=verify)["w"], w)
    assert len(read_when) == 16  # one job per chunk
    assert min(read_when) < stored // 2  # the first chunks decompress before the last are read


def test_a_compressed_load_holds_a_few_steps_not_the_frame(tmp_path, two_codec_threads):
    import tracemalloc

    w = _weights(96 << 20)
    path = tmp_path / "big.safetensors"
    fastckpt.save({"w": w}, path, compress=True)
    stored = path.stat().st_size
    for verify in (False, True):
        tracemalloc.start()
        try:
            back = fastckpt.load(path, verify=verify)["w"]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert torch.equal(back, w)
        assert peak < 24 << 20 < stored / 2, (verify, peak, stored)


class _Unseekable:
    """A write-only stream that cannot seek (a pipe, a socket)."""

    def __init__(self):
        import io

        self.buffer = io.BytesIO()

    def write(self, data):
        return self.buffer.write(data)

    def writable(self):
        return True

    def seekable(self):
        return False


def test_compressed_saves_to_streams_that_cannot_seek_go_through_a_temporary_file():
    w = _weights(6 << 20)
    out = _Unseekable()
    fastckpt.save({"w": w, "tied": w, "b": torch.ones(3)}, out, compress=True)
    data = out.buffer.getvalue()
    assert len(data) < 0.75 * 2 * w.nbytes
    back = fastckpt.load_bytes(data)
    assert torch.equal(back["w"], w) and torch.equal(back["tied"], w)


def test_an_incompressible_tensor_round_trips_at_about_its_size(tmp_path):
    noise = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator())
    path = tmp_path / "noise.safetensors"
    fastckpt.save({"noise": noise}, path, compress=True)
    assert path.stat().st_size < noise.nbytes + 64 << 10
    assert torch.equal(fastckpt.load(path, verify=True)["noise"], noise)


# --------------------------------------------------------------------------- raw hashes, bases


def _recorded_hashes(path) -> dict:
    meta = _header_json(path)["__metadata__"]
    return json.loads(meta[format.references.KEY_XXH3_128])


def test_a_compressed_tensor_records_the_hash_of_its_raw_bytes(tmp_path):
    from fastckpt.checkpoint.digests import hash_tensor

    w = _weights(5 << 20)
    fastckpt.save({"w": w}, tmp_path / "c.safetensors", compress=True)
    fastckpt.save({"w": w}, tmp_path / "p.safetensors")
    packed, plain = (
        _recorded_hashes(tmp_path / "c.safetensors"),
        _recorded_hashes(tmp_path / "p.safetensors"),
    )
    assert packed["w"] == plain["w"] == hash_tensor(w)


@pytest.mark.parametrize("base_compressed", [True, False])
@pytest.mark.parametrize("new_compressed", [True, False])
def test_an_incremental_save_refers_to_unchanged_tensors_of_a_compressed_base(
    tmp_path, base_compressed, new_compressed
):
    from fastckpt.checkpoint.tensor_records import forget

    state = {"frozen": _weights(3 << 20), "lora": torch.zeros(64, 64), "b": torch.ones(3)}
    base = tmp_path / "0.safetensors"
    fastckpt.save(state, base, compress=True if base_compressed else None)
    forget()  # hashed and compared with the base's recorded hashes, not taken from memory
    state["lora"] += 1
    step = tmp_path / "1.safetensors"
    fastckpt.save(state, step, base=base, compress=True if new_compressed else None)
    with fastckpt.open(step) as r:
        assert r.stored_names() == ["lora"]
        assert sorted(r.references) == ["b", "frozen"]
    back = fastckpt.load(step, verify=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    with fastckpt.open(step) as r:
        assert torch.equal(r.get_slice("frozen")[10:20], state["frozen"][10:20])


# --------------------------------------------------------------------------- async, inspect


def test_async_save_compresses_a_snapshot_of_the_call(tmp_path):
    w = _weights(4 << 20)
    original = w.clone()
    path = tmp_path / "a.safetensors"
    future = fastckpt.async_save({"w": w, "tied": w}, path, compress=True)
    w.add_(1)  # after the call: not in the file
    future.result()
    back = fastckpt.load(path, verify=True)
    assert torch.equal(back["w"], original) and back["w"] is back["tied"]
    with fastckpt.open(path) as r:
        assert "w" in r.compressed
    later = tmp_path / "b.safetensors"
    fastckpt.async_save({"w": w}, later, compress="zstd", snapshot=False).result()
    assert torch.equal(fastckpt.load(later)["w"], w)


def test_async_save_refuses_compress_with_a_lazy_save(tmp_path):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for lazy in ({"lazy": True}, {"fence": optimizer}):
        with pytest.raises(ValueError, match="compress=.*lazy"):
            fastckpt.async_save(
                {"w": torch.ones(4096)}, tmp_path / "x.safetensors", compress=True, **lazy
            )
    assert not list(tmp_path.iterdir())


def test_async_save_to_a_url_compresses(tmp_path):
    w = _weights(1 << 20)
    fastckpt.async_save(
        {"w": w}, "memory://compression-test/async.safetensors", compress=True
    ).result()
    with fastckpt.open("memory://compression-test/async.safetensors") as r:
        assert "w" in r.compressed and torch.equal(r.get_tensor("w"), w)


def test_inspect_shows_true_dtype_shape_stored_bytes_and_ratio(tmp_path, capsys):
    from fastckpt.cli import main
    from fastckpt.cli.inspect import describe_file

    w = _weights(1 << 20).reshape(512, 1024)
    path = tmp_path / "i.safetensors"
    fastckpt.save({"w": w, "b": torch.ones(3)}, path, compress=True)
    info = describe_file(path)
    (entry,) = [t for t in info["tensors"] if t["name"] == "w"]
    assert entry["dtype"] == "BF16" and entry["shape"] == [512, 1024] and entry["compressed"]
    assert entry["raw_bytes"] == w.nbytes and entry["bytes"] < w.nbytes
    assert entry["ratio"] == pytest.approx(entry["bytes"] / w.nbytes)
    assert info["compressed"] == 1 and info["raw_bytes"] == w.nbytes + 12
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "BF16" in out and "[512, 1024]" in out and "ratio" in out
    assert f"{entry['ratio']:.3f}" in out and "compressed: 1 tensor" in out


@pytest.mark.parametrize("step", [7, 100, 1000, 5000])
def test_a_streamed_load_carries_heads_and_chunks_across_reads(tmp_path, monkeypatch, step):
    from fastckpt.checkpoint import compressed_tensors

    monkeypatch.setattr(frames, "DEFAULT_CHUNK_BYTES", 4096)  # 16 chunks of 2 planes
    w = _weights(64 << 10)
    path = tmp_path / "small-steps.safetensors"
    fastckpt.save({"w": w}, path, compress=True)
    monkeypatch.setattr(compressed_tensors, "STREAM_BYTES", step)  # the head spans reads too
    assert torch.equal(fastckpt.load(path)["w"], w)
    assert torch.equal(fastckpt.load(path, verify=True)["w"], w)


@pytest.mark.parametrize("where", [40, 0.5, -100])
def test_a_damaged_byte_of_a_streamed_tensor_is_caught(tmp_path, where):
    w = _weights(12 << 20)  # stored in more than one read
    path = tmp_path / "d.safetensors"
    fastckpt.save({"w": w}, path, compress=True)
    data = bytearray(path.read_bytes())
    header = struct.unpack("<Q", data[:8])[0] + 8
    at = header + where if where == 40 else int(len(data) * where) if where > 0 else where
    data[at] ^= 0x40  # in the frame's table, a middle plane, the last plane
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="'w'"):
        fastckpt.load(path, verify=True)
    with pytest.raises((ChecksumError, HeaderError), match="'w'"):
        fastckpt.load(path, verify=False)


def test_a_cancelled_compressed_writer_stops_at_the_next_chunk():
    import threading

    from fastckpt.checkpoint import compressed_writer
    from fastckpt.checkpoint.save import plan_save

    plan = plan_save({"w": _weights(4 << 20)}, compress=True)
    cancel = threading.Event()
    cancel.set()
    with compressed_writer.Spool() as spool:
        writer = compressed_writer.FrameWriter(plan, spool, cancel=cancel)
        with pytest.raises(KeyboardInterrupt, match="cancelled"):
            writer.fill()
