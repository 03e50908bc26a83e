"""Compressed tensors in a file: how they are marked in the header, and their frame layout.

A compressed tensor is stored as one blob of bytes (a *frame*) under its own name, with the
dtype :data:`COMPRESSED_DTYPE` and the shape ``[blob bytes]``. No safetensors reader knows
that dtype, so a plain safetensors reader refuses the whole file loudly instead of returning
the blob as if it were the tensor. Its true dtype and shape, and the CRC32C of its
uncompressed bytes, are in ``__metadata__`` under :data:`KEY_COMPRESSED` (covered by the
header checksum like every fastckpt key)::

    {"name": {"dtype": "BF16", "shape": [4096, 4096], "crc32c": "1a2b3c4d"}, ...}

The frame (all integers little-endian)::

    magic "FCZ1" | codec u8 | planes u8 | rotation u16 | chunk_bytes u32 | reserved u32
    | raw_bytes u64 | chunks u32 | reserved u32                        (32 bytes)
    | chunks * planes stored lengths, u32 each
    | the stored planes, chunk after chunk, plane after plane

The tensor's bytes are cut in chunks of ``chunk_bytes`` (the last may be shorter); each chunk
is cut in ``planes`` planes of equal length (see :mod:`fastckpt.codec`), each element first
rotated left by ``rotation`` bits (codec 3; codec 2, written before the rotation was chosen
per tensor, always rotated by one and has 0 there, as codec 1 does). A plane whose stored
length equals its raw length is stored raw; a shorter one is a zstd frame. This module only
lays out and checks frames; it never decompresses, and every check raises ``HeaderError``
before anything the frame claims is allocated.

Example:
    >>> table = frame_table(CODEC_ZSTD, 1, 8, 10, [4, 2])
    >>> head = encode_frame_head(table)
    >>> parse_frame_head(head, 10, 1, where="w").stored_lengths
    (4, 2)
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from fastckpt.errors import HeaderError
from fastckpt.format.header import json_type, loads_strict
from fastckpt.format.schema import (
    _CRC_PATTERN,
    COMPRESSED_DTYPE,
    DTYPES,
    ITEMSIZE,
    META_PREFIX,
    int64_dims_error,
    is_count,
    short,
    tensor_nbytes,
)

#: ``__metadata__`` key of the table of compressed tensors (true dtype, shape, raw CRC32C).
KEY_COMPRESSED = META_PREFIX + "compressed"

MAGIC = b"FCZ1"
#: Every chunk is one zstd frame (or raw).
CODEC_ZSTD = 1
#: Every chunk is split into byte planes (see :mod:`fastckpt.codec`) of its elements rotated
#: left by one bit, each plane a zstd frame or raw. Read, no longer written.
CODEC_BYTEPLANE = 2
#: Byte planes of the elements rotated left by the frame's ``rotation`` bits, chosen per
#: tensor (:func:`fastckpt.codec.frames.choose_rotation`).
CODEC_ROTATED_PLANES = 3
CODEC_NAMES = {
    CODEC_ZSTD: "zstd",
    CODEC_BYTEPLANE: "byteplane (rotated 1 bit)",
    CODEC_ROTATED_PLANES: "byteplane",
}
#: The codecs that split chunks into byte planes.
PLANE_CODECS = (CODEC_BYTEPLANE, CODEC_ROTATED_PLANES)
#: Largest chunk a frame may declare (64 MiB): a reader holds a few chunks per thread.
MAX_CHUNK_BYTES = 64 << 20

_HEAD = struct.Struct("<4sBBHIIQII")
HEAD_BYTES = _HEAD.size  # 32
_DESCRIPTOR_KEYS = ("crc32c", "dtype", "shape")


@dataclasses.dataclass(frozen=True)
class CompressedTensor:
    """What ``__metadata__`` says of one compressed tensor: its true dtype and shape, its
    uncompressed size, and the CRC32C of its uncompressed bytes."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32c: int


def planes_of(codec: int, itemsize: int) -> int:
    """Planes per chunk: one per byte of an element for the plane codecs, else one.

    Example:
        >>> planes_of(CODEC_ROTATED_PLANES, 4), planes_of(CODEC_ZSTD, 4)
        (4, 1)
    """
    return itemsize if codec in PLANE_CODECS else 1


@dataclasses.dataclass(frozen=True)
class FrameTable:
    """A frame's head, checked: the codec, planes per chunk, bytes per chunk, the tensor's
    uncompressed size, every plane's stored length (chunk-major) and the bits each element
    was rotated by before its split into planes (0 when it is not split)."""

    codec: int
    planes: int
    chunk_bytes: int
    raw_bytes: int
    stored_lengths: tuple[int, ...]
    rotation: int = 0

    @property
    def chunks(self) -> int:
        return len(self.stored_lengths) // self.planes if self.planes else 0

    @property
    def head_bytes(self) -> int:
        """Bytes before the first stored plane."""
        return HEAD_BYTES + 4 * len(self.stored_lengths)

    @property
    def frame_bytes(self) -> int:
        return self.head_bytes + sum(self.stored_lengths)

    def chunk_raw_bytes(self, index: int) -> int:
        return min(self.chunk_bytes, self.raw_bytes - index * self.chunk_bytes)

    def plane_offsets(self) -> list[int]:
        """Offset in the frame of every stored plane (chunk-major), and the frame's end."""
        offsets = [self.head_bytes]
        for length in self.stored_lengths:
            offsets.append(offsets[-1] + length)
        return offsets


def frame_table(
    codec: int,
    planes: int,
    chunk_bytes: int,
    raw_bytes: int,
    stored_lengths: Sequence[int],
    rotation: int | None = None,
) -> FrameTable:
    """A :class:`FrameTable` for a writer (ValueError where it could not be read back).
    ``rotation``: the bits of :data:`CODEC_ROTATED_PLANES` (required there); the other
    codecs' own (1 for :data:`CODEC_BYTEPLANE`, 0 for zstd) when None.

    Example:
        >>> frame_table(CODEC_ROTATED_PLANES, 2, 4, 6, [1, 2, 1, 1], rotation=3).chunks
        2
    """
    if rotation is None:
        rotation = _implied_rotation(codec)
    table = FrameTable(codec, planes, chunk_bytes, raw_bytes, tuple(stored_lengths), rotation)
    try:
        _check_rotation(codec, rotation, planes, "frame")
        _check_table(table, raw_bytes, planes, "frame")
    except HeaderError as exc:
        raise ValueError(str(exc)) from None
    return table


def encode_frame_head(table: FrameTable) -> bytes:
    """The frame's bytes before its first stored plane."""
    head = _HEAD.pack(
        MAGIC,
        table.codec,
        table.planes,
        table.rotation if table.codec == CODEC_ROTATED_PLANES else 0,
        table.chunk_bytes,
        0,
        table.raw_bytes,
        len(table.stored_lengths) // table.planes,
        0,
    )
    return head + struct.pack(f"<{len(table.stored_lengths)}I", *table.stored_lengths)


def chunk_count(raw_bytes: int, chunk_bytes: int) -> int:
    return -(-raw_bytes // chunk_bytes) if raw_bytes else 0


def parse_frame_head(
    data: bytes | memoryview, raw_bytes: int, itemsize: int, *, where: str
) -> FrameTable:
    """Reads and checks a frame's head from its first bytes (all of the table, or fewer: then
    :func:`head_length` says how many to read). ``raw_bytes`` and ``itemsize`` are what the
    header says of the tensor; ``where`` names it in every message.

    Raises:
        HeaderError: a bad magic or codec, a chunk size out of range, a size that is not
            the tensor's, a plane longer than its raw bytes, or a table cut short.

    Example:
        >>> parse_frame_head(b"nope" + bytes(28), 4, 1, where="tensor 'w'")
        Traceback (most recent call last):
        ...
        fastckpt.errors.HeaderError: tensor 'w': compressed frame does not start with b'FCZ1' (starts with b'nope')
    """
    data = memoryview(data).cast("B")
    if len(data) < HEAD_BYTES:
        raise HeaderError(f"{where}: compressed frame of {len(data)} bytes is cut short")
    magic, codec, planes, field, chunk_bytes, _, declared, chunks, _ = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise HeaderError(
            f"{where}: compressed frame does not start with {MAGIC!r} "
            f"(starts with {bytes(data[:4])!r})"
        )
    if codec not in CODEC_NAMES:
        raise HeaderError(f"{where}: unknown compression codec {codec}")
    expected_planes = planes_of(codec, itemsize)
    if planes != expected_planes:
        raise HeaderError(
            f"{where}: {CODEC_NAMES[codec]} frame of {planes} planes for elements of "
            f"{itemsize} bytes (expected {expected_planes})"
        )
    if codec != CODEC_ROTATED_PLANES and field:
        raise HeaderError(f"{where}: {CODEC_NAMES[codec]} frame with {field} in its rotation field")
    rotation = field if codec == CODEC_ROTATED_PLANES else _implied_rotation(codec)
    _check_rotation(codec, rotation, planes, where)
    if declared != raw_bytes:
        raise HeaderError(
            f"{where}: compressed frame holds {declared} bytes, the tensor has {raw_bytes}"
        )
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes % planes:
        raise HeaderError(
            f"{where}: chunk size {chunk_bytes} must be a positive multiple of {planes} "
            f"up to {MAX_CHUNK_BYTES}"
        )
    if chunks != chunk_count(raw_bytes, chunk_bytes):
        raise HeaderError(
            f"{where}: compressed frame lists {chunks} chunks; {raw_bytes} bytes in chunks of "
            f"{chunk_bytes} make {chunk_count(raw_bytes, chunk_bytes)}"
        )
    count = chunks * planes
    if len(data) < HEAD_BYTES + 4 * count:
        raise HeaderError(
            f"{where}: compressed frame of {len(data)} bytes is cut short in its chunk table "
            f"({HEAD_BYTES + 4 * count} bytes)"
        )
    lengths = struct.unpack_from(f"<{count}I", data, HEAD_BYTES)
    table = FrameTable(codec, planes, chunk_bytes, raw_bytes, lengths, rotation)
    _check_table(table, raw_bytes, planes, where)
    return table


def frame_bound(raw_bytes: int, planes: int, chunk_bytes: int) -> int:
    """The most bytes a frame of ``raw_bytes`` can take (every plane stored raw): a writer
    plans the header with it before the frame's real size is known.

    Example:
        >>> frame_bound(10, 1, 8)  # a 32-byte head, two lengths, 10 bytes
        50
    """
    return HEAD_BYTES + 4 * chunk_count(raw_bytes, chunk_bytes) * planes + raw_bytes


def pad_header(header: bytes, size: int) -> bytes:
    """An encoded header (length prefix, JSON, spaces) padded with more spaces to exactly
    ``size`` bytes: a writer that reserved room for a header before knowing its values
    (frames' sizes) fills that room exactly.

    Example:
        >>> import struct
        >>> padded = pad_header(struct.pack("<Q", 8) + b'{}      ', 24)
        >>> len(padded), struct.unpack("<Q", padded[:8])[0], padded[8:10]
        (24, 16, b'{}')
    """
    if len(header) > size:
        raise ValueError(f"header of {len(header)} bytes does not fit in {size}")
    return struct.pack("<Q", size - 8) + header[8:] + b" " * (size - len(header))


def head_length(data: bytes | memoryview) -> int:
    """The length of a frame's head from its first :data:`HEAD_BYTES` (0 if too short),
    bounded by what the fields can say (never more than 32 + 4 * 2**40 bytes)."""
    if len(data) < HEAD_BYTES:
        return 0
    _, _, planes, _, _, _, _, chunks, _ = _HEAD.unpack_from(data)
    return HEAD_BYTES + 4 * chunks * planes


def _implied_rotation(codec: int) -> int:
    """The rotation of a codec whose frames do not carry one: one bit for the first byte
    planes, none for zstd."""
    return 1 if codec == CODEC_BYTEPLANE else 0


def _check_rotation(codec: int, rotation: int, planes: int, where: str) -> None:
    """A plane codec rotates by 1 to 8 * itemsize - 1 bits; the others by none."""
    if codec in PLANE_CODECS:
        if not 0 < rotation < 8 * planes:
            raise HeaderError(
                f"{where}: rotation of {rotation} bits for elements of {planes} bytes "
                f"(1 to {8 * planes - 1})"
            )
    elif rotation:
        raise HeaderError(f"{where}: a {CODEC_NAMES[codec]} frame rotates nothing, not {rotation}")


def _check_table(table: FrameTable, raw_bytes: int, planes: int, where: str) -> None:
    if table.raw_bytes != raw_bytes or table.planes != planes or planes < 1:
        raise HeaderError(f"{where}: frame table does not describe {raw_bytes} bytes")
    if table.chunk_bytes <= 0 or table.chunk_bytes % planes:
        raise HeaderError(f"{where}: chunk size {table.chunk_bytes} is not a multiple of {planes}")
    chunks = chunk_count(raw_bytes, table.chunk_bytes)
    if len(table.stored_lengths) != chunks * planes:
        raise HeaderError(f"{where}: frame table lists the wrong number of planes")
    if raw_bytes % planes:
        raise HeaderError(f"{where}: {raw_bytes} bytes do not split in {planes} planes")
    for index, length in enumerate(table.stored_lengths):
        plane_raw = table.chunk_raw_bytes(index // planes) // planes
        if length > plane_raw:
            raise HeaderError(
                f"{where}: chunk {index // planes} plane {index % planes} is stored in "
                f"{length} bytes, more than its {plane_raw} uncompressed bytes"
            )
        if length == 0 and plane_raw:
            raise HeaderError(f"{where}: chunk {index // planes} plane {index % planes} is empty")


def check_frame_size(table: FrameTable, stored_bytes: int, where: str) -> None:
    """The frame fills the tensor's stored bytes exactly (HeaderError otherwise)."""
    if table.frame_bytes != stored_bytes:
        raise HeaderError(
            f"{where}: compressed frame's table adds up to {table.frame_bytes} bytes, "
            f"but {stored_bytes} are stored"
        )


# --------------------------------------------------------------------------- metadata


def encode_table(tensors: Mapping[str, CompressedTensor]) -> str:
    """The :data:`KEY_COMPRESSED` value for these tensors.

    Example:
        >>> encode_table({"w": CompressedTensor("BF16", (2,), 4, 255)})
        '{"w":{"dtype":"BF16","shape":[2],"crc32c":"000000ff"}}'
    """
    return json.dumps(
        {
            name: {"dtype": t.dtype, "shape": list(t.shape), "crc32c": f"{t.crc32c:08x}"}
            for name, t in tensors.items()
        },
        separators=(",", ":"),
    )


def parse_table(metadata: Mapping[str, str], entries: Mapping[str, Any]) -> dict[str, Any]:
    """The compressed tensors of a parsed header: name -> :class:`CompressedTensor`.

    Every entry of dtype :data:`COMPRESSED_DTYPE` must be described (and be one-dimensional),
    and every description must name such an entry.

    Raises:
        HeaderError: a malformed table, an unknown or sub-byte dtype, a shape out of range,
            or an entry and the table that disagree.

    Example:
        >>> from fastckpt.format.schema import TensorEntry
        >>> meta = {KEY_COMPRESSED: encode_table({"w": CompressedTensor("F32", (3,), 12, 7)})}
        >>> parse_table(meta, {"w": TensorEntry("w", COMPRESSED_DTYPE, (40,), 0, 40)})["w"].nbytes
        12
    """
    marked = [name for name, e in entries.items() if e.dtype == COMPRESSED_DTYPE]
    text = metadata.get(KEY_COMPRESSED)
    if text is None:
        if marked:
            raise HeaderError(
                f"tensor {short(marked[0])} is {COMPRESSED_DTYPE} but {KEY_COMPRESSED} is missing"
            )
        return {}
    raw = loads_strict(text, KEY_COMPRESSED)
    if not isinstance(raw, dict):
        raise HeaderError(f"{KEY_COMPRESSED} must be a JSON object, got {json_type(raw)}")
    table = {}
    for name, value in raw.items():
        where = f"{KEY_COMPRESSED}[{short(name)}]"
        entry = entries.get(name)
        if entry is None or entry.dtype != COMPRESSED_DTYPE:
            raise HeaderError(f"{where}: no {COMPRESSED_DTYPE} tensor of that name")
        if len(entry.shape) != 1:
            raise HeaderError(f"tensor {short(name)}: a compressed tensor's shape is one length")
        if not isinstance(value, dict) or sorted(value) != list(_DESCRIPTOR_KEYS):
            raise HeaderError(f"{where} must be an object with keys {', '.join(_DESCRIPTOR_KEYS)}")
        dtype, shape, crc = value["dtype"], value["shape"], value["crc32c"]
        if type(dtype) is not str or dtype not in DTYPES or dtype not in ITEMSIZE:
            raise HeaderError(f"{where}: dtype {short(dtype)} cannot be compressed")
        if not isinstance(shape, list) or not all(is_count(dim) for dim in shape):
            raise HeaderError(f"{where}: shape {short(shape)} must be a list of integers")
        too_big = int64_dims_error(shape)
        if too_big is not None:
            raise HeaderError(f"{where}: shape {short(shape)}: {too_big}")
        nbytes = tensor_nbytes(dtype, shape)
        if nbytes is None or nbytes >= 2**63:
            raise HeaderError(f"{where}: shape {short(shape)} of {dtype} overflows")
        if type(crc) is not str or not _CRC_PATTERN.fullmatch(crc):
            raise HeaderError(f"{where}: crc32c {short(crc)} must be 8 lowercase hex digits")
        table[name] = CompressedTensor(dtype, tuple(shape), nbytes, int(crc, 16))
    missing = [name for name in marked if name not in table]
    if missing:
        raise HeaderError(f"tensor {short(missing[0])} is {COMPRESSED_DTYPE} but not described")
    return table
