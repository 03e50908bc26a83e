"""Compressed tensors in checkpoints: which tensors a save stores compressed, and reading them
back through a reader, decompressed.

``save(..., compress=...)`` stores each tensor worth compressing as its frame (see
:mod:`fastckpt.codec.frames`) under dtype :data:`~fastckpt.format.compressed.COMPRESSED_DTYPE`;
its true dtype, shape and the CRC32C of its uncompressed bytes go into the header
(:data:`~fastckpt.format.compressed.KEY_COMPRESSED`). :func:`plan_frames` picks them;
:mod:`fastckpt.checkpoint.compressed_writer` compresses them while it writes them. The file's
own CRC32Cs (whole and per piece) are those of the stored, compressed bytes.

A reader reads a compressed tensor's stored bytes (verified against those CRC32Cs when asked)
and decompresses them on every core, checking the uncompressed bytes' CRC32C. A range or a
slice (``get_slice``) decompresses only the chunks that hold it (2 MiB each by default),
after reading only their stored bytes; it checks the stored bytes' pieces when ``verify=True``,
and zstd's own checksum of each compressed plane always, but not the whole tensor's CRC32C.

Example:
    >>> import torch, fastckpt
    >>> w = torch.randn(256, 256).to(torch.bfloat16)
    >>> fastckpt.save({"w": w}, "/tmp/fastckpt-compressed.safetensors", compress=True)
    >>> with fastckpt.open("/tmp/fastckpt-compressed.safetensors") as r:
    ...     r.info("w").dtype, torch.equal(r.get_tensor("w"), w), torch.equal(r.get_slice("w")[3:5], w[3:5])
    (torch.bfloat16, True, True)
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastckpt import format
from fastckpt.checkpoint import dtypes
from fastckpt.checkpoint.range_read import (
    RangeSource,
    TensorSlice,
    check_byte_range,
    read_byte_range,
)
from fastckpt.errors import ChecksumError, HeaderError
from fastckpt.format import compressed as layout

__all__ = [
    "MIN_BYTES",
    "check_compress",
    "codec_for",
    "FrameJob",
    "frame_entries",
    "placeholder_table",
    "plan_frames",
    "table_of",
]

#: Tensors smaller than this are stored as they are: a frame's head would eat the gain.
MIN_BYTES = 4 << 10
#: dtypes that the automatic choice (``compress=True``) stores as byte planes.
_FLOATS = frozenset({"F16", "BF16", "F32", "F64"})
_MODES = ("zstd", "byteplane")


def check_compress(compress: Any) -> str | None:
    """The compression mode that ``save``'s ``compress`` asks for: ``None`` (off),
    ``"auto"`` (``True``: byte planes for floating point, zstd for the rest), ``"zstd"`` or
    ``"byteplane"`` (byte planes for every dtype of 2 bytes or more).

    Example:
        >>> check_compress(True), check_compress(None), check_compress("zstd")
        ('auto', None, 'zstd')
    """
    if compress is None or compress is False:
        return None
    if compress is True:
        return "auto"
    if isinstance(compress, str) and compress in _MODES:
        return compress
    raise ValueError(f"compress must be True, False, None, 'zstd' or 'byteplane', got {compress!r}")


def codec_for(dtype: str, mode: str) -> str | None:
    """The codec that stores a tensor of safetensors ``dtype`` in ``mode``; None for dtypes
    stored uncompressed (the packed sub-byte ones).

    Example:
        >>> codec_for("BF16", "auto"), codec_for("I64", "auto"), codec_for("I64", "byteplane")
        ('byteplane', 'zstd', 'byteplane')
    """
    itemsize = format.ITEMSIZE.get(dtype)
    if itemsize is None:
        return None
    if mode == "zstd" or itemsize == 1 or itemsize not in (2, 4, 8):
        return "zstd"
    if mode == "byteplane" or dtype in _FLOATS:
        return "byteplane"
    return "zstd"


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in row-major order as a contiguous CPU uint8 tensor."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _split_work(jobs: Mapping[Any, Any], run: Any, size: Any) -> dict[Any, Any]:
    """``run(job, threads)`` for every job: those of several chunks one after the other, each
    on every core; those of one chunk side by side, one core each."""
    from fastckpt.codec.frames import DEFAULT_CHUNK_BYTES
    from fastckpt.io.parallel_io import worker_count

    small = [key for key, job in jobs.items() if size(job) <= DEFAULT_CHUNK_BYTES]
    done = {key: run(job, None) for key, job in jobs.items() if key not in small}
    if len(small) > 1 and worker_count() > 1:
        with concurrent.futures.ThreadPoolExecutor(worker_count(), "fastckpt-codec-small") as pool:
            done.update(zip(small, pool.map(lambda key: run(jobs[key], 1), small)))
    else:
        done.update({key: run(jobs[key], None) for key in small})
    return done


@dataclasses.dataclass(frozen=True)
class FrameJob:
    """A tensor a save stores as a frame: its codec, safetensors dtype and element size,
    its shape as safetensors records it, and its uncompressed size."""

    codec: str
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    nbytes: int

    @property
    def bound(self) -> int:
        """The most bytes its frame can take."""
        from fastckpt.codec import frames

        planes = self.itemsize if self.codec == "byteplane" else 1
        chunk = frames.chunk_size(frames.DEFAULT_CHUNK_BYTES, self.codec, self.itemsize)
        return layout.frame_bound(self.nbytes, planes, chunk)


def plan_frames(
    tensors: Mapping[str, torch.Tensor],
    specs: Sequence[tuple[str, str, tuple[int, ...]]],
    mode: str,
) -> tuple[list[tuple[str, str, tuple[int, ...]]], dict[str, FrameJob]]:
    """Which tensors a save in ``mode`` stores as frames (nothing is compressed yet): the
    specs ``(name, dtype, shape)`` of the others, and a :class:`FrameJob` per frame, in
    ``specs`` order. The frames' bytes are written by
    :mod:`fastckpt.checkpoint.compressed_writer`.

    Example:
        >>> import torch
        >>> t = {"z": torch.zeros(4096), "s": torch.ones(2)}
        >>> plain, jobs = plan_frames(t, [("z", "F32", (4096,)), ("s", "F32", (2,))], "auto")
        >>> [s[0] for s in plain], jobs["z"].codec, jobs["z"].nbytes
        (['s'], 'byteplane', 16384)
    """
    plain = []
    jobs: dict[str, FrameJob] = {}
    for name, dtype, shape in specs:
        t = tensors[name]
        codec = codec_for(dtype, mode)
        if codec is None or _nbytes(t) < MIN_BYTES:
            plain.append((name, dtype, shape))
            continue
        jobs[name] = FrameJob(codec, dtype, format.ITEMSIZE[dtype], tuple(shape), _nbytes(t))
    return plain, jobs


def frame_entries(
    entries: Sequence[format.TensorEntry], jobs: Mapping[str, FrameJob]
) -> list[format.TensorEntry]:
    """``entries`` followed by one entry per frame, each as large as it can get: the layout
    a plan sizes its header with (the writer puts in the real sizes)."""
    at = entries[-1].end if entries else 0
    result = list(entries)
    for name, job in jobs.items():
        result.append(
            format.TensorEntry(name, layout.COMPRESSED_DTYPE, (job.bound,), at, at + job.bound)
        )
        at += job.bound
    return result


def placeholder_table(jobs: Mapping[str, FrameJob]) -> dict[str, layout.CompressedTensor]:
    """The compressed table of ``jobs`` before their CRC32Cs are known (same width)."""
    return {n: layout.CompressedTensor(j.dtype, j.shape, j.nbytes, 0) for n, j in jobs.items()}


# --------------------------------------------------------------------------- reading


def table_of(header: format.Header, where: str) -> dict[str, layout.CompressedTensor]:
    """The compressed tensors of a parsed header, each of a dtype and shape torch can hold
    (HeaderError naming ``where`` otherwise)."""
    try:
        table = layout.parse_table(header.metadata, header.entries)
        for name, c in table.items():
            dtypes.to_torch(c.dtype)
            dtypes.torch_shape(c.dtype, c.shape, tensor=name)
    except HeaderError as exc:
        raise HeaderError(f"{where}: {exc}") from None
    return table


def stored_entry(e: format.TensorEntry) -> format.TensorEntry:
    """A compressed tensor's entry as the bytes it stores (read like any U8 tensor)."""
    return format.TensorEntry(e.name, "U8", e.shape, e.begin, e.end)


def logical_entry(e: format.TensorEntry, c: layout.CompressedTensor) -> format.TensorEntry:
    """A compressed tensor's entry as the tensor it holds (its offsets are not the file's)."""
    return format.TensorEntry(e.name, c.dtype, c.shape, 0, c.nbytes)


def as_stored(
    entries: dict[str, format.TensorEntry], table: Mapping[str, Any]
) -> dict[str, format.TensorEntry]:
    """``entries`` with every compressed one as its stored bytes."""
    return {n: stored_entry(e) if n in table else e for n, e in entries.items()}


def asks_compressed(reader: Any, names: Sequence[str] | None) -> bool:
    """Whether reading ``names`` (None: all) from ``reader`` reads a compressed tensor."""
    if not reader.compressed:
        return False
    if names is None or isinstance(names, str):
        return True  # (a str is refused by the read itself)
    aliases = reader.aliases
    return any(aliases.get(n, n) in reader.compressed for n in names)


def _where(reader: Any, name: str) -> str:
    return f"{reader.path}: tensor {name!r}"


def decode(reader: Any, name: str, blob: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """The tensor that the frame ``blob`` (its stored bytes, on the CPU) holds, checked
    against the CRC32C of its uncompressed bytes."""
    from fastckpt.codec import frames

    c = reader.compressed[name]
    itemsize = format.ITEMSIZE[c.dtype]
    where = _where(reader, name)
    frame = blob.numpy()
    frames.read_table(frame, c.nbytes, itemsize, where=where)  # before allocating the tensor
    out = torch.empty(c.nbytes, dtype=torch.uint8)
    frames.decompress(frame, out.numpy(), itemsize, crc32c=c.crc32c, where=where, threads=threads)
    shape = dtypes.torch_shape(c.dtype, c.shape, tensor=name)
    return out.view(dtypes.to_torch(c.dtype)).view(shape)


#: Stored bytes of a compressed tensor read at a time while earlier chunks decompress.
STREAM_BYTES = 4 << 20


def read_decoded(
    reader: Any,
    names: Sequence[str] | None,
    *,
    pin_memory: bool,
    verify: bool,
    progress: bool | None,
) -> dict[str, torch.Tensor]:
    """:meth:`~fastckpt.checkpoint.read.CheckpointReader.read` of names some of which are
    compressed; keyed by stored name. The others are read as usual; compressed tensors of
    at most :data:`STREAM_BYTES` stored bytes are read together, then decompressed side by
    side; each larger one is read :data:`STREAM_BYTES` at a time while the chunks already
    read decompress on every core (:func:`decode_streaming`)."""
    entries = reader._entries_of(names)  # noqa: SLF001 - the reader's own helper
    packed = [e for n, e in entries.items() if n in reader.compressed]
    small = [e for e in packed if e.nbytes <= STREAM_BYTES]
    large = [e for e in packed if e.nbytes > STREAM_BYTES]
    plain = [n for n in entries if n not in reader.compressed]
    result = reader.read(plain, pin_memory=pin_memory, verify=verify, progress=progress)
    tensors: dict[str, torch.Tensor] = {}
    with reader._reading():  # noqa: SLF001
        reader.require_checksums(verify)
        with reader._lock:  # noqa: SLF001 - a prefetch of the stored bytes is not reused
            for e in packed:
                reader._prefetched.pop(e.name, None)  # noqa: SLF001
        blobs = reader._read_entries(  # noqa: SLF001
            small, pin_memory=False, verify=verify, progress=progress
        )
        for e in large:
            tensors[e.name] = decode_streaming(reader, e, verify=verify)
    jobs = {e.name: blobs.pop(e.name) for e in small}
    sizes = {name: reader.compressed[name].nbytes for name in jobs}
    tensors.update(
        _split_work(
            {name: (name, blob) for name, blob in jobs.items()},
            lambda job, threads: decode(reader, job[0], job[1], threads=threads),
            lambda job: sizes[job[0]],
        )
    )
    for name, tensor in tensors.items():
        result[name] = tensor if reader.device.type == "cpu" else tensor.to(reader.device)
    return result


def _stream_step(reader: Any, e: format.TensorEntry, verify: bool) -> int:
    """Stored bytes read at a time: whole checksummed pieces when verified (the whole
    tensor when it has none), else :data:`STREAM_BYTES`."""
    if not verify:
        return STREAM_BYTES
    pieces = reader.meta.pieces
    if pieces is None or e.name not in pieces.digests:
        return e.nbytes
    return max(1, STREAM_BYTES // pieces.piece_size) * pieces.piece_size


def decode_streaming(
    reader: Any, e: format.TensorEntry, *, verify: bool, window: int | None = None
) -> torch.Tensor:
    """Compressed tensor ``e`` read and decompressed in a pipeline: its stored bytes are read
    a step at a time (:func:`_stream_step`) while the chunks already read decompress on the
    codec's pool, one job per chunk, at most ``window`` chunks (default two per core)
    waiting before the next read. Memory:
    the tensor, plus a few steps of stored bytes. Checked as :func:`decode` checks."""
    c = reader.compressed[e.name]
    out = torch.empty(c.nbytes, dtype=torch.uint8)
    _stream_chunks(reader, e, verify=verify, window=window, target=out.numpy())
    shape = dtypes.torch_shape(c.dtype, c.shape, tensor=e.name)
    return out.view(dtypes.to_torch(c.dtype)).view(shape)


#: What :func:`check_streaming` reports: the frame does not decode to bytes of the CRC32C
#: the header records for them; they decode, but to bytes of another XXH3-128.
DECODING, XXH3_128 = "decompressed CRC32C", "XXH3-128"


def check_streaming(
    reader: Any, e: format.TensorEntry, *, xxh3_128: str | None
) -> tuple[str, str] | None:
    """Checks that compressed tensor ``e`` decodes to bytes of the CRC32C its header records
    and, when ``xxh3_128`` is given, of that XXH3-128, holding a few chunks of them at a time,
    never the tensor: memory stays bounded whatever the tensor's size. The stored bytes are
    read unverified (their own CRC32C is checked apart). Returns None when intact, else the
    check that failed (:data:`DECODING` or :data:`XXH3_128`) and why.

    Example:
        >>> import torch, fastckpt
        >>> fastckpt.save({"z": torch.zeros(1 << 20)}, "/tmp/fastckpt-cs.safetensors", compress=True)
        >>> with fastckpt.open("/tmp/fastckpt-cs.safetensors") as r:
        ...     check_streaming(r, r.header.entries["z"], xxh3_128=r.meta.hashes["z"])
        ...     check_streaming(r, r.header.entries["z"], xxh3_128="0" * 32)[0]
        'XXH3-128'
    """
    import xxhash

    hasher = xxhash.xxh3_128() if xxh3_128 is not None else None
    consume = None if hasher is None else hasher.update
    try:
        _stream_chunks(reader, e, verify=False, window=None, target=None, consume=consume)
    except (ChecksumError, HeaderError) as exc:
        return DECODING, str(exc)
    if hasher is not None and hasher.hexdigest() != xxh3_128:
        return XXH3_128, (
            f"{_where(reader, e.name)}: decompressed bytes have XXH3-128 "
            f"{hasher.hexdigest()}, the header records {xxh3_128}"
        )
    return None


def _stream_chunks(
    reader: Any,
    e: format.TensorEntry,
    *,
    verify: bool,
    window: int | None,
    target: np.ndarray | None,
    consume: Any = None,
) -> None:
    """Reads compressed tensor ``e``'s stored bytes a step at a time and decompresses its
    chunks on the codec's pool (see :func:`decode_streaming`): into ``target`` (the whole
    tensor's bytes) when given, else each into memory of its own, handed to ``consume`` in
    order once decoded and then dropped (at most ``window`` chunks, default two per core,
    are held). Checks the decoded bytes' CRC32C (ChecksumError)."""
    from fastckpt.codec import frames
    from fastckpt.io.checksums import crc32c_combine

    c = reader.compressed[e.name]
    itemsize = format.ITEMSIZE[c.dtype]
    where = _where(reader, e.name)
    step = _stream_step(reader, e, verify)
    workers = frames._threads()  # noqa: SLF001 - the codec's own pool and size
    ahead = max(1, 2 * workers if window is None else window)  # chunks
    pool = frames._shared_pool(workers)  # noqa: SLF001
    table: Any = None
    offsets: list[int] = []
    carry, got, first = b"", 0, 0  # stored bytes kept from the last step, read, next chunk
    pending: collections.deque[tuple[concurrent.futures.Future[list[int]], np.ndarray]] = (
        collections.deque()
    )
    crcs: list[int] = []

    def finish_next() -> None:  # the oldest chunk: its CRC32C, its bytes to ``consume``
        job, span = pending.popleft()
        crcs.extend(job.result())
        if consume is not None:
            consume(span)

    try:
        while got < e.nbytes:
            hi = min(e.nbytes, got + step)
            data = carry + _stored_range(reader, e, got, hi, verify)
            lo, got = got - len(carry), hi  # ``data`` holds stored bytes [lo, got)
            if table is None:
                length = layout.head_length(data)
                if length > e.nbytes:
                    raise HeaderError(
                        f"{where}: compressed frame's table runs past its {e.nbytes} bytes"
                    )
                if not length or length > len(data):
                    carry = data
                    continue
                table = layout.parse_frame_head(data[:length], c.nbytes, itemsize, where=where)
                layout.check_frame_size(table, e.nbytes, where)
                offsets = table.plane_offsets()
            view = memoryview(data)
            done = first
            while done < table.chunks and offsets[(done + 1) * table.planes] <= got:
                done += 1

            def plane(
                i: int, view: memoryview = view, lo: int = lo, offsets: list[int] = offsets
            ) -> memoryview:
                return view[offsets[i] - lo : offsets[i + 1] - lo]

            for k in range(first, done):  # one job per chunk: every core decompresses
                at = k * table.chunk_bytes
                raw = table.chunk_raw_bytes(k)
                span = np.empty(raw, np.uint8) if target is None else target[at : at + raw]
                job = pool.submit(
                    frames.decompress_chunks,
                    table,
                    plane,
                    span,
                    [k],
                    itemsize,
                    where=where,
                    threads=1,
                )
                pending.append((job, span))
                # bounded: the reads wait for the codec, and a step of highly compressed
                # bytes (all zeros: 94 KiB for 512 MiB) holds no more chunks than a few
                while len(pending) > ahead:
                    finish_next()
            first = done
            carry = (
                bytes(view[offsets[first * table.planes] - lo :]) if first < table.chunks else b""
            )
        if table is None:
            raise HeaderError(f"{where}: compressed frame of {e.nbytes} bytes is cut short")
        while pending:
            finish_next()
    finally:
        concurrent.futures.wait([job for job, _ in pending])
    actual = 0
    for index, value in enumerate(crcs):
        actual = crc32c_combine(actual, value, table.chunk_raw_bytes(index))
    if actual != c.crc32c:
        raise ChecksumError(
            f"{where}: decompressed bytes have CRC32C {actual:08x}, the header records "
            f"{c.crc32c:08x}"
        )


def map_decoded(reader: Any, names: Sequence[str] | None, *, verify: bool) -> dict[str, Any]:
    """:meth:`~fastckpt.checkpoint.read.CheckpointReader.map` of names some of which are
    compressed: those are read and decompressed into memory of their own."""
    entries = reader._entries_of(names)  # noqa: SLF001
    plain = [n for n in entries if n not in reader.compressed]
    packed = [n for n in entries if n in reader.compressed]
    result = reader.map(plain, verify=verify) if plain else {}
    result.update(reader.read(packed, verify=verify))
    return result


def _stored_range(reader: Any, e: format.TensorEntry, lo: int, hi: int, verify: bool) -> bytes:
    """Stored bytes ``[lo, hi)`` of a compressed tensor, verified by pieces when asked."""
    base = reader.header.data_offset
    mode = reader._mode((base + e.begin + lo, hi - lo))  # noqa: SLF001
    source = RangeSource(
        reader.storage, reader.path, base, reader.meta.crcs, reader.meta.pieces, mode
    )
    data = read_byte_range(
        source,
        stored_entry(e),
        lo,
        hi,
        out=None,
        verify=verify,
        span_bytes=reader.storage.span_bytes(hi - lo, mode),
        on_read=reader._count,  # noqa: SLF001
    )
    return data.numpy().tobytes()


def read_range(
    reader: Any,
    name: str,
    start: int,
    stop: int,
    *,
    out: torch.Tensor | None,
    verify: bool,
) -> torch.Tensor:
    """Bytes ``[start, stop)`` of the uncompressed tensor ``name``: only the chunks that
    hold them are read and decompressed."""
    from fastckpt.checkpoint.range_read import byte_view
    from fastckpt.codec import frames

    e = reader._entry(name)  # noqa: SLF001
    c = reader.compressed[e.name]
    where = _where(reader, e.name)
    check_byte_range(name, c.nbytes, start, stop, reader.path)
    dest = None if out is None else byte_view(out, stop - start)
    itemsize = format.ITEMSIZE[c.dtype]
    with reader._reading():  # noqa: SLF001
        reader.require_checksums(verify)
        pieces = reader.meta.pieces
        # Verified, whole checksummed pieces are read (the whole tensor when it has no piece
        # checksums): keep the last ones read, since the head and the planes often share one.
        step = pieces.piece_size if pieces is not None and e.name in pieces.digests else e.nbytes
        held: list[Any] = [0, b""]

        def fetch(lo: int, hi: int) -> bytes:
            if not verify:
                return _stored_range(reader, e, lo, hi, False)
            at, data = held
            if not (at <= lo and hi <= at + len(data)):
                at, end = lo // step * step, min(e.nbytes, -(-hi // step) * step)
                held[:] = at, data = at, _stored_range(reader, e, at, end, True)
            return data[lo - at : hi - at]

        head = fetch(0, min(e.nbytes, layout.HEAD_BYTES))
        length = layout.head_length(head)
        if length > e.nbytes:
            raise HeaderError(f"{where}: compressed frame's table runs past its {e.nbytes} bytes")
        if length > len(head):
            head = fetch(0, length)
        table = layout.parse_frame_head(head, c.nbytes, itemsize, where=where)
        layout.check_frame_size(table, e.nbytes, where)
        if stop == start:
            part = np.empty(0, np.uint8)
        else:
            first, last = start // table.chunk_bytes, (stop - 1) // table.chunk_bytes
            offsets = table.plane_offsets()
            lo, hi = offsets[first * table.planes], offsets[(last + 1) * table.planes]
            stored = memoryview(fetch(lo, hi))

            def plane(i: int) -> memoryview:
                return stored[offsets[i] - lo : offsets[i + 1] - lo]

            chunks = range(first, last + 1)
            raw = np.empty(sum(table.chunk_raw_bytes(i) for i in chunks), np.uint8)
            frames.decompress_chunks(table, plane, raw, chunks, itemsize, where=where)
            at = start - first * table.chunk_bytes
            part = raw[at : at + (stop - start)]
    result = torch.from_numpy(part)
    if dest is not None:
        dest.copy_(result)
        return out  # type: ignore[return-value]
    return result if reader.device.type == "cpu" else result.to(reader.device)


def get_slice(reader: Any, e: format.TensorEntry, verify: bool) -> TensorSlice:
    """A :class:`~fastckpt.checkpoint.range_read.TensorSlice` of compressed tensor ``e``:
    each slice decompresses only the chunks holding its rows."""
    c = reader.compressed[e.name]
    return TensorSlice(
        logical_entry(e, c),
        lambda lo, hi: read_range(reader, e.name, lo, hi, out=None, verify=verify),
    )
