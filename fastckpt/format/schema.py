"""The vocabulary of the file format: dtypes, limits, metadata keys, and what a header holds.

Example:
    >>> ITEMSIZE["BF16"], HEADER_LIMIT
    (2, 104857600)
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

#: Bytes per element of every safetensors dtype of whole-byte elements.
#: The sub-byte dtypes are in :data:`PACKED_BITS`.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}

#: Bits per element of the safetensors dtypes that pack elements below one byte: ``F4``
#: (two per byte) and the ``F6`` types (four per three bytes). A tensor of them must end on
#: a byte boundary, as the reference reader requires.
PACKED_BITS: dict[str, int] = {
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}

#: Every safetensors dtype name a header may hold (all that safetensors 0.8 knows).
DTYPES: frozenset[str] = frozenset(ITEMSIZE) | frozenset(PACKED_BITS)

#: The dtype name of a compressed tensor's entry (:mod:`fastckpt.format.compressed`): no
#: safetensors reader accepts it, so they refuse such a file instead of misreading it.
COMPRESSED_DTYPE = "fastckpt.compressed"

#: Largest header accepted, the same cap as the reference reader.
HEADER_LIMIT = 100 * 1024 * 1024
DEFAULT_ALIGNMENT = 4096
#: The one header key that is not a tensor name.
METADATA_KEY = "__metadata__"

#: Version 2 added the header checksum (:data:`KEY_HEADER_CRC`). Version 1 files, which
#: have none, are still read; a file of a newer version is refused with a clear message.
FORMAT_VERSION = "2"
#: Versions this reader understands.
#: Version 3 marks files with references to tensors in other files (incremental
#: checkpoints, :mod:`fastckpt.format.references`); files without them stay version 2.
READABLE_VERSIONS = ("1", "2", "3")
META_PREFIX = "fastckpt."
KEY_VERSION = "fastckpt.version"
#: zlib.crc32 of the canonical JSON of the whole header without this key, as 8 hex digits
#: (fixed width: a writer sizes the header before it knows the tensors' checksums).
KEY_HEADER_CRC = "fastckpt.header_crc"
KEY_CRC32C = "fastckpt.crc32c"
KEY_ALIASES = "fastckpt.aliases"
KEY_TREE = "fastckpt.checkpoint.tree"
#: CRC32Cs of the fixed-size pieces of every tensor larger than one piece, so that a byte
#: range of a tensor can be verified by reading only the pieces that cover it:
#: ``{"piece_size": P, "crcs": {name: hex}}``, where ``hex`` is 8 lowercase hex digits per
#: piece, pieces counted from the tensor's first byte (the last one may be shorter).
KEY_PIECE_CRC32C = "fastckpt.piece_crc32c"
#: Bytes per checksummed piece written by default: 4 MiB keeps the table near 200 KB for
#: 100 GB of tensors, and piece reads aligned for direct I/O.
DEFAULT_PIECE_SIZE = 1024 * DEFAULT_ALIGNMENT
#: Largest piece size accepted in a header (1 GiB).
MAX_PIECE_SIZE = 1 << 30

_ENTRY_KEYS = ("dtype", "shape", "data_offsets")
_U64_LIMIT = 2**64
#: Every dimension, and the element count, must fit torch's int64 sizes.
_I64_LIMIT = 2**63

# Limits that keep parsing an untrusted header cheap: memory and work grow with the header's
# size, never faster. Each JSON object or array costs 60-200 bytes of Python memory, so a
# header of N bytes may hold at most max(N // MIN_BYTES_PER_NODE, SMALL_NODE_COUNT) of them
# (counted with one pass of bytes.count before decoding; brackets inside strings count too,
# which only errs on the safe side). Real headers use 17 bytes or more per container (a
# tensor entry is ~50 bytes for 3 containers); ``[],[],...`` uses 3. Nesting is bounded by
# the interpreter's recursion limit for the JSON and by the tree's own MAX_DEPTH.
#: Bytes of header text per JSON object or array, at least.
MIN_BYTES_PER_NODE = 12
#: So many containers are always allowed, whatever the header's size.
SMALL_NODE_COUNT = 4096
#: Bytes of header text per tensor entry, at least, beyond SMALL_TENSOR_COUNT entries: a
#: decoded entry costs ~650 bytes of Python memory while the header is parsed, so this keeps
#: parsing within ~10x the header's size. Real entries take 64-120 bytes
#: (``"model.layers.0.mlp.up_proj.weight":{"dtype":"BF16","shape":[...],...}``).
MIN_BYTES_PER_TENSOR = 64
#: So many tensors are always allowed, whatever the header's size.
SMALL_TENSOR_COUNT = 1 << 16
#: Most tensors one file may hold: parsing and loading cost time per tensor, and real files
#: hold far fewer (a whole 671B-parameter MoE model has ~92k tensors; with its optimizer
#: state ~280k). Writers refuse more (:func:`~fastckpt.format.encode_header`); at
#: MIN_BYTES_PER_TENSOR bytes each the header still fits HEADER_LIMIT, and parsing stays
#: within ~10x the header's size.
MAX_TENSORS = 1 << 20
_CRC_PATTERN = re.compile(r"[0-9a-f]{8}")
_CRC_SLICE = 4096


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the data section: bytes ``[begin, end)``.

    Example:
        >>> TensorEntry("w", "F32", (2, 3), 0, 24).nbytes
        24
    """

    # Slots: a header may list ~500k entries, and each must cost little memory.
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Length of the tensor's bytes."""
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A parsed, validated header.

    Attributes:
        entries: tensor name -> entry, in file order (by offset).
        metadata: the ``__metadata__`` strings (empty when absent).
        data_offset: file offset of the data section (``8 + N``).
        data_size: length of the data section; the file ends right after it.
    """

    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_offset: int
    data_size: int


def piece_count(nbytes: int, piece_size: int) -> int:
    """How many checksummed pieces a tensor of ``nbytes`` has: 0 when it fits one piece (its
    whole CRC32C covers it), else ``ceil(nbytes / piece_size)``.

    Example:
        >>> piece_count(4096, 4096), piece_count(4097, 4096), piece_count(0, 4096)
        (0, 2, 0)
    """
    return 0 if nbytes <= piece_size else -(-nbytes // piece_size)


@dataclass(frozen=True)
class PieceTable:
    """The per-piece CRC32Cs of :data:`KEY_PIECE_CRC32C`, decoded.

    Attributes:
        piece_size: bytes per piece (a multiple of :data:`DEFAULT_ALIGNMENT`).
        digests: tensor name -> 4 big-endian bytes per piece (kept packed: a table of
            millions of pieces costs its size in memory, not a Python int per piece).

    Example:
        >>> table = PieceTable(4096, {"w": bytes.fromhex("0000000a000000ff")})
        >>> table.crcs("w"), table.crcs("b")
        ([10, 255], None)
    """

    piece_size: int
    digests: dict[str, bytes]

    def crcs(self, name: str) -> list[int] | None:
        """The CRC32C of each piece of tensor ``name``, or None when it has no pieces."""
        digest = self.digests.get(name)
        if digest is None:
            return None
        return [int.from_bytes(digest[i : i + 4], "big") for i in range(0, len(digest), 4)]

    def crc(self, name: str, index: int) -> int:
        """The CRC32C of piece ``index`` of tensor ``name`` (KeyError/IndexError if none)."""
        digest = self.digests[name]
        if not 0 <= index < len(digest) // 4:
            raise IndexError(f"tensor {name!r} has no piece {index}")
        return int.from_bytes(digest[4 * index : 4 * index + 4], "big")


@dataclass(frozen=True)
class FastckptMeta:
    """``__metadata__`` split into the user's keys and fastckpt's own.

    Attributes:
        user: every key outside the ``fastckpt.`` prefix (``"format"`` included).
        crcs: tensor name -> CRC32C, or None when the file has no checksums.
        aliases: alias name -> name of the stored tensor it shares.
        tree: the decoded JSON structure description, or None for a flat dict.
        version: the ``fastckpt.version`` string, or None for a plain
            safetensors file; the caller decides which versions it reads.
        pieces: the per-piece CRC32Cs, or None when the file records none (written before
            they existed, or without checksums).
        hashes: stored tensor name -> XXH3-128 hex digest, or None when none are recorded.
        references: the tensors held by other files (an incremental checkpoint), or None.
    """

    user: dict[str, str]
    crcs: dict[str, int] | None
    aliases: dict[str, str] = field(default_factory=dict)
    tree: Any = None
    version: str | None = None
    pieces: PieceTable | None = None
    hashes: dict[str, str] | None = None
    references: Any = None  # fastckpt.format.references.References


# --------------------------------------------------------- checked arithmetic


def short(value: Any, limit: int = 60) -> str:
    """repr() clipped, so a hostile 100 MB value does not end up in a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_count(value: Any) -> bool:
    # Exact int (JSON true is not 1) that fits the reference reader's u64.
    return type(value) is int and 0 <= value < _U64_LIMIT


def int64_dims_error(shape: list[int]) -> str | None:
    """Why torch cannot hold a tensor of ``shape``, or None when it can.

    Each dimension and the product of the non-zero ones must be below 2**63, even for
    a tensor of zero elements: ``[2**63, 0]`` is refused.

    Example:
        >>> int64_dims_error([2**61, 0, 3]) is None, int64_dims_error([2**63, 0])
        (True, 'dimension 9223372036854775808 overflows int64')
    """
    numel = 1
    for dim in shape:
        if dim >= _I64_LIMIT:
            return f"dimension {dim} overflows int64"
        if dim:
            numel *= dim
            if numel >= _I64_LIMIT:
                return "the number of elements overflows int64"
    return None


def element_bits(dtype: str) -> int:
    """Bits per element of a safetensors dtype name (KeyError for an unknown one).

    Example:
        >>> element_bits("BF16"), element_bits("F4"), element_bits("F6_E2M3")
        (16, 4, 6)
    """
    return PACKED_BITS[dtype] if dtype in PACKED_BITS else 8 * ITEMSIZE[dtype]


def tensor_nbytes(dtype: str, shape: list[int]) -> int | None:
    """Byte size of a tensor of ``dtype`` and ``shape``; None where the reference reader's
    u64 arithmetic overflows.

    Raises:
        ValueError: a packed dtype's elements do not end on a byte boundary.

    Example:
        >>> tensor_nbytes("F32", [2, 3]), tensor_nbytes("F4", [2, 6]), tensor_nbytes("F6_E3M2", [4])
        (24, 6, 3)
    """
    if dtype not in PACKED_BITS:
        return nbytes_u64(shape, ITEMSIZE[dtype])
    nbits = nbytes_u64(shape, PACKED_BITS[dtype])  # the same checked product, in bits
    if nbits is None:
        return None
    if nbits % 8:
        raise ValueError(
            f"{short(shape)} elements of {dtype} ({PACKED_BITS[dtype]} bits each) do not end "
            "on a byte boundary"
        )
    return nbits // 8


def nbytes_u64(shape: list[int], itemsize: int) -> int | None:
    """Byte size of ``shape``, or None where the reference reader's u64 arithmetic overflows.

    Multiplying left to right and stopping at 2**64 keeps a hostile shape cheap,
    and rejects exactly what the reference rejects: ``[2**40, 2**40, 0]``
    overflows there before the 0 is reached.
    """
    numel = 1
    for dim in shape:
        numel *= dim
        if numel >= _U64_LIMIT:
            return None
    nbytes = numel * itemsize
    return nbytes if nbytes < _U64_LIMIT else None


def canonical_crc(document: dict[str, Any], plain: Any = None) -> str:
    """The header checksum: zlib.crc32 of the canonical JSON of ``document`` as 8 hex digits.

    ``document`` is the whole header as decoded JSON (tensor entries and ``__metadata__``)
    without :data:`KEY_HEADER_CRC`; canonical means sorted keys, no spaces, ASCII escapes,
    so every writer and reader of the same header computes the same value. ``plain``, when
    given, maps each top-level value to its JSON form first.

    Example:
        >>> canonical_crc({"b": 1, "a": [2]}) == canonical_crc({"a": [2], "b": 1})
        True
    """
    # The same bytes as json.dumps(document, sort_keys=True, ...), hashed in slices of keys
    # so that a 100 MB header is never held twice more as one string.
    encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    keys = sorted(document)
    crc = zlib.crc32(b"{")
    for start in range(0, len(keys), _CRC_SLICE):
        chunk = keys[start : start + _CRC_SLICE]
        if plain is None:
            text = encoder.encode({key: document[key] for key in chunk})
        else:
            text = encoder.encode({key: plain(document[key]) for key in chunk})
        piece = text[1:-1] if start == 0 else "," + text[1:-1]
        crc = zlib.crc32(piece.encode("ascii"), crc)
    return f"{zlib.crc32(b'}', crc):08x}"
