"""The fastckpt file format: safetensors headers, laid out for direct I/O.

A fastckpt file is a safetensors file::

    u64 little-endian N | N bytes of JSON header | data section

The header maps each tensor name to ``{"dtype", "shape", "data_offsets"}``
(offsets relative to the start of the data section) plus an optional
``"__metadata__"`` object of strings. fastckpt adds two things, both invisible
to other safetensors readers:

* the JSON is padded with trailing spaces so that ``8 + N`` is a multiple of
  the alignment (4096 by default): the data section starts on an aligned file
  offset, which direct I/O needs;
* tensors are ordered so that as many as possible start on aligned offsets
  (see :func:`plan_layout`); they stay contiguous because the reference reader
  rejects gaps.

fastckpt's own metadata lives under the ``fastckpt.`` prefix (see
:func:`build_metadata` and :func:`split_metadata`): besides one CRC32C per tensor,
``fastckpt.piece_crc32c`` records a CRC32C per fixed-size piece (4 MiB by default) of every
tensor larger than one piece, so that a byte range can be verified by reading only the pieces
covering it. Its ``fastckpt.header_crc`` checksums
the whole header (names, shapes, offsets, tree, aliases, checksum table, user metadata): a
fastckpt header without a valid one is refused, except for format version 1 files, written
before it existed. Parsing is bounded by the header's size: at most one JSON object or array
per :data:`MIN_BYTES_PER_NODE` bytes, at most :data:`MAX_TENSORS` tensors, and every
dimension and element count within int64.

This package is pure: no file I/O and no torch, only bytes, ints and strings
(:func:`read_header_from` reads through the caller's function).
It is where hostile input is stopped: every check raises
:class:`fastckpt.errors.HeaderError` with a message saying what is wrong and
where, and no check allocates more than the input's size.

Example:
    >>> entries = plan_layout([("w", "F32", (2, 3)), ("b", "F32", (3,))])
    >>> [(e.name, e.begin, e.end) for e in entries]
    [('b', 0, 12), ('w', 12, 36)]
    >>> header = encode_header(entries, {"format": "pt"})
    >>> len(header) % 4096
    0
    >>> n = parse_header_length(header[:8], len(header) + 36)
    >>> parsed = parse_header(header[8 : 8 + n], len(header) + 36)
    >>> parsed.data_offset, list(parsed.entries)
    (4096, ['b', 'w'])
"""

from fastckpt.format.header import parse_header, parse_header_length, read_header_from
from fastckpt.format.layout import encode_header, plan_layout
from fastckpt.format.metadata import build_metadata, split_metadata
from fastckpt.format.references import (
    HASH_HEX_DIGITS,
    KEY_REFERENCES,
    KEY_XXH3_128,
    Reference,
    References,
)
from fastckpt.format.schema import (
    DEFAULT_ALIGNMENT,
    DEFAULT_PIECE_SIZE,
    FORMAT_VERSION,
    HEADER_LIMIT,
    ITEMSIZE,
    KEY_ALIASES,
    KEY_CRC32C,
    KEY_HEADER_CRC,
    KEY_PIECE_CRC32C,
    KEY_TREE,
    KEY_VERSION,
    MAX_PIECE_SIZE,
    MAX_TENSORS,
    META_PREFIX,
    METADATA_KEY,
    MIN_BYTES_PER_NODE,
    READABLE_VERSIONS,
    FastckptMeta,
    Header,
    PieceTable,
    TensorEntry,
    piece_count,
)

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEFAULT_PIECE_SIZE",
    "FORMAT_VERSION",
    "HASH_HEX_DIGITS",
    "KEY_REFERENCES",
    "KEY_XXH3_128",
    "Reference",
    "References",
    "HEADER_LIMIT",
    "ITEMSIZE",
    "MAX_PIECE_SIZE",
    "MAX_TENSORS",
    "MIN_BYTES_PER_NODE",
    "READABLE_VERSIONS",
    "KEY_ALIASES",
    "KEY_CRC32C",
    "KEY_HEADER_CRC",
    "KEY_PIECE_CRC32C",
    "KEY_TREE",
    "KEY_VERSION",
    "METADATA_KEY",
    "META_PREFIX",
    "FastckptMeta",
    "Header",
    "PieceTable",
    "TensorEntry",
    "build_metadata",
    "encode_header",
    "parse_header",
    "parse_header_length",
    "piece_count",
    "plan_layout",
    "read_header_from",
    "split_metadata",
]
