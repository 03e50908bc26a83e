"""Compress and decompress one tensor's bytes as a frame (layout in
:mod:`fastckpt.format.compressed`), chunk by chunk on every core.

Chunks are independent: each is split into byte planes (:mod:`fastckpt.codec.byteplane`) or
kept whole, and each plane is a zstd frame, or raw when zstd does not shrink it. zstd
releases the GIL and numpy does for the plane copies, so a thread per core runs in parallel.
The CRC32C of the uncompressed bytes is computed per chunk while they are in the CPU cache
and joined (:func:`fastckpt.io.checksums.crc32c_combine`).

Hostile frames are stopped before any allocation beyond the tensor's own size: the head and
table are checked (:func:`fastckpt.format.compressed.parse_frame_head`), every zstd frame
must declare exactly its plane's length, and decompression is capped at that length.

Example:
    >>> import numpy as np
    >>> data = np.frombuffer(np.linspace(-1, 1, 4096, dtype=np.float32).tobytes(), np.uint8)
    >>> frame, crc = compress(data, "byteplane", 4)
    >>> len(frame) < len(data)
    True
    >>> out = np.empty_like(data)
    >>> decompress(frame, out, 4, crc32c=crc, where="tensor 'w'")
    >>> bool((out == data).all())
    True
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from fastckpt import _C
from fastckpt.codec import byteplane
from fastckpt.errors import ChecksumError, HeaderError
from fastckpt.format import compressed as layout
from fastckpt.io.checksums import crc32c_combine

__all__ = [
    "CODECS",
    "DEFAULT_CHUNK_BYTES",
    "chunk_size",
    "choose_rotation",
    "compress",
    "compress_chunk",
    "compress_stream",
    "decompress",
    "decompress_chunks",
    "ordered_map",
]

#: Codec names accepted by :func:`compress`.
CODECS = {"zstd": layout.CODEC_ZSTD, "byteplane": layout.CODEC_ROTATED_PLANES}
#: Uncompressed bytes per chunk. Measured on bf16 and fp32 weights: 2 MiB shrinks 0.05% more
#: than 1 MiB (each plane's entropy table covers more bytes) and 0.02% less than 4 MiB, and a
#: slice decompresses at most a chunk more than it asks for at each end.
DEFAULT_CHUNK_BYTES = 2 << 20
#: zstd level of the ``"zstd"`` codec.
ZSTD_LEVEL = 3

_local = threading.local()
_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ImportError(
            "compressed checkpoints need the zstandard package, which is not installed here: "
            "pip install 'fastckpt-io[compress]' (in a clone of fastckpt: pip install "
            "'.[compress]'; the PyPI project named fastckpt is another one)"
        ) from None
    return zstandard


def _compressor(codec: int) -> Any:
    """This thread's zstd compressor for ``codec`` (contexts are not thread-safe)."""
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if codec not in cache:
        zstd = _zstd()
        if codec in layout.PLANE_CODECS:
            # Exponent planes are nearly match-free: few, long matches (a tiny hash table,
            # min_match 7) leave zstd's entropy coder to do the work. A 32 KiB window also
            # caps zstd's blocks at 32 KiB, each with its own entropy tables, which follow
            # the exponents' drift along a tensor. Measured on bf16 and fp32 weights and Adam
            # states (benchmarks/bench_compression.py): the fast strategy stores within 0.05%
            # of greedy's bytes at 4x its speed or more; of the exponent plane, a 128 KiB
            # window stores 0.5% more, an 8 KiB one 2% less at 60% of the speed, levels 1-19
            # 5% more (they spend bits on short matches).
            params = zstd.ZstdCompressionParameters(
                strategy=zstd.STRATEGY_FAST,
                window_log=15,
                hash_log=6,
                chain_log=6,
                search_log=1,
                min_match=7,
                target_length=0,
                write_checksum=True,
                write_content_size=True,
            )
            cache[codec] = zstd.ZstdCompressor(compression_params=params)
        else:
            cache[codec] = zstd.ZstdCompressor(
                level=ZSTD_LEVEL, write_checksum=True, write_content_size=True
            )
    return cache[codec]


def _decompressor() -> Any:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = _zstd().ZstdDecompressor()
    return d


def _threads() -> int:
    from fastckpt.io.parallel_io import worker_count

    return max(1, worker_count())


def _map(fn: Callable[[int], Any], count: int, threads: int | None) -> list[Any]:
    """``[fn(i) for i in range(count)]`` on the shared pool (in this thread when one)."""
    workers = _threads() if threads is None else threads
    if count <= 1 or workers <= 1:
        return [fn(i) for i in range(count)]
    return list(_shared_pool(workers).map(fn, range(count)))


def _shared_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The codec's thread pool, of at least ``workers`` threads."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:  # noqa: SLF001 - sized once
            _pool = concurrent.futures.ThreadPoolExecutor(workers, "fastckpt-codec")
        return _pool


def _crc(data: np.ndarray) -> int:
    return _C.crc32c(data.ctypes.data, data.nbytes) if data.nbytes else 0


#: Bytes of a mantissa plane compressed to decide whether the rest is worth compressing.
PROBE_BYTES = 64 << 10


def _worth_trying(zstd: Any, plane: np.ndarray) -> bool:
    """Whether a plane other than the exponent's may shrink: its first :data:`PROBE_BYTES`
    must shrink by 1%. Mantissa planes are nearly random, and zstd spends as long failing
    to shrink them as it spends on the exponent plane."""
    if plane.nbytes <= 2 * PROBE_BYTES:
        return True
    return len(zstd.compress(plane[:PROBE_BYTES])) < 0.99 * PROBE_BYTES


def chunk_size(chunk_bytes: int, codec: str, itemsize: int) -> int:
    """``chunk_bytes`` rounded down to whole elements of every plane of ``codec``."""
    planes = layout.planes_of(CODECS[codec], itemsize)
    return chunk_bytes - chunk_bytes % planes


#: The rotations :func:`choose_rotation` tries, in bits.
ROTATIONS = (1, 2, 3, 4)
#: Bytes of a tensor :func:`choose_rotation` compresses with each rotation.
ROTATION_PROBE_BYTES = 64 << 10
#: Smaller tensors take :func:`default_rotation` instead of a probe, which costs about what
#: compressing 256 KiB does (0.23 ms here): a fine-tune's many small adapters and their Adam
#: states spent more time probing than compressing.
ROTATION_PROBE_MIN_BYTES = 1 << 20


def default_rotation(dtype: str) -> int:
    """The rotation of a tensor too small to probe: three bits for bf16 and fp32 (their top
    exponent bits are nearly constant in weights and optimizer states), one for the rest.

    Example:
        >>> default_rotation("BF16"), default_rotation("F16")
        (3, 1)
    """
    return 3 if dtype in ("BF16", "F32") else 1


def choose_rotation(sample: np.ndarray, itemsize: int) -> int:
    """The rotation (in bits, of :data:`ROTATIONS`) that stores ``sample``'s byte planes in
    the fewest bytes: its first :data:`ROTATION_PROBE_BYTES` (whole elements) compressed
    with each. Measured (``benchmarks/bench_compression.py``): two or three bits store
    0.3-0.9 % fewer bytes than one on bf16 and fp32 weights, whose top exponent bits are
    nearly constant, and fp16 weights or values spanning many octaves want one; a probe
    this size picks within 0.08 % of the best rotation for the whole tensor.

    Example:
        >>> import numpy as np, torch
        >>> w = (torch.randn(1 << 15) * 0.02).to(torch.bfloat16)
        >>> choose_rotation(w.view(torch.uint8).numpy(), 2) in ROTATIONS
        True
    """
    if itemsize == 1:
        return 1
    n = min(sample.nbytes, ROTATION_PROBE_BYTES) // itemsize * itemsize
    if n == 0:
        return 1
    part = np.ascontiguousarray(sample[:n])
    zstd = _compressor(layout.CODEC_ROTATED_PLANES)
    best, best_size = 1, None
    for rotation in ROTATIONS:
        if rotation >= 8 * itemsize:
            break
        size = 0
        for plane in byteplane.split(part, itemsize, rotation):
            size += min(len(zstd.compress(plane)), plane.nbytes)
        if best_size is None or size < best_size:
            best, best_size = rotation, size
    return best


def tensor_rotation(
    head: Callable[[int], np.ndarray], nbytes: int, itemsize: int, dtype: str
) -> int:
    """The rotation of a tensor of ``nbytes`` and ``dtype``: probed (:func:`choose_rotation`)
    on its first bytes, which ``head(n)`` gives as contiguous uint8, from
    :data:`ROTATION_PROBE_MIN_BYTES` on; below, :func:`default_rotation`.

    Example:
        >>> import numpy as np
        >>> tensor_rotation(lambda n: np.zeros(n, np.uint8), 4096, 2, "F16")
        1
    """
    if nbytes < ROTATION_PROBE_MIN_BYTES:
        return default_rotation(dtype)
    return choose_rotation(head(min(nbytes, ROTATION_PROBE_BYTES)), itemsize)


def compress_chunk(
    piece: np.ndarray, codec: str, itemsize: int, rotation: int = 1
) -> tuple[list[Any], int]:
    """The stored planes (``bytes`` when zstd shrank them, else the raw plane) of one chunk
    and the chunk's CRC32C; thread-safe (a zstd context per thread). ``rotation``: the bits
    the byte-plane codec rotates each element by (:func:`choose_rotation`).

    Example:
        >>> import numpy as np
        >>> stored, crc = compress_chunk(np.zeros(4096, np.uint8), "byteplane", 2)
        >>> [len(s) < 2048 for s in stored]
        [True, True]
    """
    code = CODECS[codec]
    planes = layout.planes_of(code, itemsize)
    stored: list[Any] = []
    zstd = _compressor(code)
    for p, plane in enumerate(byteplane.split(piece, planes, rotation)):
        if p and not _worth_trying(zstd, plane):  # a mantissa plane: stored raw
            stored.append(plane)
            continue
        packed = zstd.compress(plane)
        stored.append(packed if len(packed) < plane.nbytes else plane)
    return stored, _crc(piece)


def ordered_map(
    fn: Callable[[Any], Any], items: Iterable[Any], *, window: int | None = None
) -> Generator[Any, None, None]:
    """``fn(item)`` for each item, run on the codec's pool and yielded in order, at most
    ``window`` (default: two per core) running or done ahead of the consumer: memory stays a
    few items per core however many there are, and the consumer (a writer) works while the
    next items run. Items are drawn from ``items`` only as room frees up.

    Example:
        >>> list(ordered_map(lambda x: x * x, range(5), window=2))
        [0, 1, 4, 9, 16]
    """
    workers = _threads()
    ahead = max(1, 2 * workers if window is None else window)
    pool = _shared_pool(workers)
    source = iter(items)
    pending: collections.deque[concurrent.futures.Future[Any]] = collections.deque()
    exhausted = False
    try:
        while True:
            while not exhausted and len(pending) < ahead:
                item = next(source, _END)
                if item is _END:
                    exhausted = True
                else:
                    pending.append(pool.submit(fn, item))
            if not pending:
                return
            yield pending.popleft().result()
    finally:
        for job in pending:  # a consumer that stopped early: let nothing run on
            job.cancel()
        concurrent.futures.wait(pending)


_END = object()


def compress_stream(
    source: Callable[[int, int], np.ndarray],
    raw_bytes: int,
    codec: str,
    itemsize: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    window: int | None = None,
    rotation: int = 1,
) -> Iterator[tuple[np.ndarray, list[Any], int]]:
    """Compresses ``raw_bytes`` bytes chunk by chunk on the codec's pool
    (:func:`ordered_map`) and yields, in order, each chunk's raw bytes, stored planes and
    CRC32C (:func:`compress_chunk`, with ``rotation``). ``source(lo, hi)`` gives raw bytes
    ``[lo, hi)`` as contiguous uint8 (called on a pool thread), at most ``window`` chunks
    ahead.

    Example:
        >>> import numpy as np
        >>> data = np.zeros(10, np.uint8)
        >>> [len(raw) for raw, _, _ in compress_stream(lambda lo, hi: data[lo:hi], 10, "zstd", 1, chunk_bytes=4)]
        [4, 4, 2]
    """
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {sorted(CODECS)}, got {codec!r}")
    chunk_bytes = chunk_size(chunk_bytes, codec, itemsize)
    chunks = layout.chunk_count(raw_bytes, chunk_bytes)

    def one(index: int) -> tuple[np.ndarray, list[Any], int]:
        piece = source(index * chunk_bytes, min(raw_bytes, (index + 1) * chunk_bytes))
        stored, crc = compress_chunk(piece, codec, itemsize, rotation)
        return piece, stored, crc

    return ordered_map(one, range(chunks), window=window)


def compress(
    data: np.ndarray,
    codec: str,
    itemsize: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    threads: int | None = None,
) -> tuple[np.ndarray, int]:
    """The frame of ``data`` (contiguous uint8, elements of ``itemsize`` bytes) and the
    CRC32C of ``data``.

    ``codec`` is ``"byteplane"`` (planes of bytes, for floating point) or ``"zstd"``.

    Example:
        >>> import numpy as np
        >>> frame, crc = compress(np.zeros(1 << 16, np.uint8), "zstd", 1)
        >>> len(frame) < 100, hex(crc)
        (True, '0x72c0c4a4')
    """
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {sorted(CODECS)}, got {codec!r}")
    code = CODECS[codec]
    planes = layout.planes_of(code, itemsize)
    if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
        raise TypeError("data must be a contiguous one-dimensional uint8 array")
    if data.nbytes % itemsize:
        raise ValueError(f"{data.nbytes} bytes are not a whole number of {itemsize}-byte elements")
    chunk_bytes = chunk_size(chunk_bytes, codec, itemsize)
    chunks = layout.chunk_count(data.nbytes, chunk_bytes)
    rotation = choose_rotation(data, itemsize) if code in layout.PLANE_CODECS else None

    def one(index: int) -> tuple[list[Any], int]:
        piece = data[index * chunk_bytes : (index + 1) * chunk_bytes]
        return compress_chunk(piece, codec, itemsize, rotation or 1)

    results = _map(one, chunks, threads)
    segments = [plane for stored, _ in results for plane in stored]
    table = layout.frame_table(
        code, planes, chunk_bytes, data.nbytes, [len(s) for s in segments], rotation
    )
    frame = np.empty(table.frame_bytes, np.uint8)
    head = layout.encode_frame_head(table)
    frame[: len(head)] = np.frombuffer(head, np.uint8)
    at = len(head)
    for segment in segments:
        view = np.frombuffer(segment, np.uint8) if isinstance(segment, bytes) else segment
        frame[at : at + len(view)] = view
        at += len(view)
    crc = 0
    for index, (_, value) in enumerate(results):
        crc = crc32c_combine(crc, value, table.chunk_raw_bytes(index))
    return frame, crc


def read_table(frame: np.ndarray, raw_bytes: int, itemsize: int, *, where: str) -> Any:
    """The checked table of a whole frame (HeaderError naming ``where``)."""
    view = memoryview(frame.data)
    table = layout.parse_frame_head(view, raw_bytes, itemsize, where=where)
    layout.check_frame_size(table, len(frame), where)
    return table


def _unpack_plane(stored: memoryview, plane_raw: int, where: str) -> Any:
    """One plane's raw bytes from its stored bytes (raw, or one zstd frame of exactly
    ``plane_raw`` bytes)."""
    if len(stored) == plane_raw:
        return stored
    zstd = _zstd()
    try:
        declared = zstd.frame_content_size(stored)
    except zstd.ZstdError as exc:
        raise HeaderError(f"{where}: not a zstd frame ({exc})") from None
    if declared != plane_raw:
        raise HeaderError(
            f"{where}: zstd frame declares {declared} bytes, the plane has {plane_raw}"
        )
    try:
        plane = _decompressor().decompress(
            stored, max_output_size=plane_raw, read_across_frames=False, allow_extra_data=False
        )
    except zstd.ZstdError as exc:
        raise ChecksumError(f"{where}: damaged zstd frame ({exc})") from None
    if len(plane) != plane_raw:
        raise HeaderError(
            f"{where}: zstd frame decompresses to {len(plane)} bytes, the plane has {plane_raw}"
        )
    return plane


def decompress_chunks(
    table: Any,
    read_plane: Callable[[int], memoryview],
    out: np.ndarray,
    chunks: Sequence[int],
    itemsize: int,
    *,
    where: str,
    threads: int | None = None,
) -> list[int]:
    """Decompresses ``chunks`` of a frame into ``out`` (their raw bytes, one after the other);
    ``read_plane(i)`` gives the stored bytes of plane ``i`` (chunk-major). Returns each
    chunk's CRC32C."""
    first = chunks[0] if chunks else 0

    def one(k: int) -> int:
        index = chunks[k]
        raw = table.chunk_raw_bytes(index)
        plane_raw = raw // table.planes
        at = (index - first) * table.chunk_bytes
        target = out[at : at + raw]
        planes = []
        for p in range(table.planes):
            i = index * table.planes + p
            plane = _unpack_plane(read_plane(i), plane_raw, f"{where}: chunk {index} plane {p}")
            planes.append(np.frombuffer(plane, np.uint8))
        byteplane.merge(planes, target, table.planes, table.rotation or 1)
        return _crc(target)

    return _map(one, len(chunks), threads)


def decompress(
    frame: np.ndarray,
    out: np.ndarray,
    itemsize: int,
    *,
    crc32c: int | None,
    where: str,
    threads: int | None = None,
) -> None:
    """Decompresses a whole frame into ``out`` (uint8, the tensor's size) and checks the
    CRC32C of the result against ``crc32c`` (None: no check).

    Raises:
        HeaderError: a malformed frame (bad table, a plane of the wrong size).
        ChecksumError: a damaged zstd frame, or bytes that do not match ``crc32c``.
    """
    table = read_table(frame, out.nbytes, itemsize, where=where)
    offsets = table.plane_offsets()
    view = memoryview(frame.data)

    def plane(i: int) -> memoryview:
        return view[offsets[i] : offsets[i + 1]]

    crcs = decompress_chunks(
        table, plane, out, range(table.chunks), itemsize, where=where, threads=threads
    )
    if crc32c is None:
        return
    actual = 0
    for index, value in enumerate(crcs):
        actual = crc32c_combine(actual, value, table.chunk_raw_bytes(index))
    if actual != crc32c:
        raise ChecksumError(
            f"{where}: decompressed bytes have CRC32C {actual:08x}, the header records {crc32c:08x}"
        )


def _ignore_fork() -> None:
    global _pool
    _pool = None  # a forked child has none of the parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ignore_fork)
