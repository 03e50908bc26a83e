"""Where tensors go in the data section, and the header bytes that describe them.

Example:
    >>> entries = plan_layout([("w", "F32", (2, 3)), ("b", "F32", (3,))])
    >>> len(encode_header(entries, {"format": "pt"})) % 4096
    0
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastckpt.format.schema import (
    COMPRESSED_DTYPE,
    DEFAULT_ALIGNMENT,
    DTYPES,
    HEADER_LIMIT,
    KEY_HEADER_CRC,
    MAX_TENSORS,
    META_PREFIX,
    METADATA_KEY,
    MIN_BYTES_PER_TENSOR,
    SMALL_TENSOR_COUNT,
    TensorEntry,
    canonical_crc,
    element_bits,
    int64_dims_error,
    tensor_nbytes,
)

# --------------------------------------------------------------------------- layout


def _check_alignment(alignment: int) -> None:
    if type(alignment) is not int or alignment < 8 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 8, got {alignment!r}")


def _checked_nbytes(name: str, dtype: str, shape: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """(shape as a tuple, byte size) of a tensor to write; ValueError if no reader could read it."""
    if dtype not in DTYPES and dtype != COMPRESSED_DTYPE:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
    sized_as = "U8" if dtype == COMPRESSED_DTYPE else dtype  # a compressed blob counts bytes
    dims = tuple(shape)
    if not all(type(dim) is int and dim >= 0 for dim in dims):
        raise ValueError(f"tensor {name!r}: shape {list(dims)} must hold non-negative ints")
    too_big = int64_dims_error(list(dims))
    if too_big is not None:
        raise ValueError(f"tensor {name!r}: shape {list(dims)}: {too_big}")
    try:
        nbytes = tensor_nbytes(sized_as, list(dims))
    except ValueError as exc:
        raise ValueError(f"tensor {name!r}: shape {exc}") from None
    if nbytes is None:
        raise ValueError(f"tensor {name!r}: shape {list(dims)} of {dtype} overflows 64 bits")
    return dims, nbytes


def plan_layout(
    specs: Iterable[tuple[str, str, Sequence[int]]], alignment: int = DEFAULT_ALIGNMENT
) -> list[TensorEntry]:
    """Place tensors contiguously in the data section, aligned where possible.

    Order: first every tensor whose byte size is a non-zero multiple of
    ``alignment`` (so each starts on an aligned offset), then the rest; each
    group by element size descending, then name. Since the data section starts
    aligned, every tensor then starts at a multiple of its own element size.

    Args:
        specs: ``(name, dtype, shape)`` per tensor, dtype a safetensors name.
        alignment: a power of two >= 8.

    Returns:
        The entries in file order, the first at offset 0, without gaps.

    Example:
        >>> [(e.name, e.begin) for e in plan_layout(
        ...     [("small", "U8", (3,)), ("big", "F32", (1024,)), ("mid", "I64", (2,))])]
        [('big', 0), ('mid', 4096), ('small', 4112)]
    """
    _check_alignment(alignment)
    sized: list[tuple[str, str, tuple[int, ...], int]] = []
    seen: set[str] = set()
    for name, dtype, shape in specs:
        if type(name) is not str or name == METADATA_KEY:
            raise ValueError(f"invalid tensor name {name!r}")
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        seen.add(name)
        dims, nbytes = _checked_nbytes(name, dtype, shape)
        sized.append((name, dtype, dims, nbytes))

    def order(item: tuple[str, str, tuple[int, ...], int]) -> tuple[bool, int, str]:
        name, dtype, _, nbytes = item
        fills_blocks = nbytes > 0 and nbytes % alignment == 0
        return (not fills_blocks, -element_bits("U8" if dtype == COMPRESSED_DTYPE else dtype), name)

    entries = []
    offset = 0
    for name, dtype, dims, nbytes in sorted(sized, key=order):
        entries.append(TensorEntry(name, dtype, dims, offset, offset + nbytes))
        offset += nbytes
    return entries


# --------------------------------------------------------------------------- encode


def check_metadata(metadata: Mapping[str, str]) -> None:
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of str -> str, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if type(key) is not str:
            raise TypeError(f"metadata key {key!r} must be a str, not {type(key).__name__}")
        if type(value) is not str:
            raise TypeError(f"metadata[{key!r}] must be a str, not {type(value).__name__}")


def _check_contiguous(entries: Sequence[TensorEntry]) -> None:
    # A header that fastckpt writes must be one that it (and every reader) accepts.
    offset = 0
    seen: set[str] = set()
    for entry in entries:
        if entry.name == METADATA_KEY or type(entry.name) is not str:
            raise ValueError(f"invalid tensor name {entry.name!r}")
        if entry.name in seen:
            raise ValueError(f"duplicate tensor name {entry.name!r}")
        seen.add(entry.name)
        dims, nbytes = _checked_nbytes(entry.name, entry.dtype, entry.shape)
        if entry.begin != offset:
            raise ValueError(
                f"tensor {entry.name!r} begins at {entry.begin}, expected {offset}: "
                "entries must be contiguous and in file order"
            )
        if entry.nbytes != nbytes:
            raise ValueError(
                f"tensor {entry.name!r}: {entry.nbytes} bytes do not match "
                f"shape {list(dims)} of {entry.dtype}"
            )
        offset = entry.end


def encode_header(
    entries: Sequence[TensorEntry],
    metadata: Mapping[str, str] | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> bytes:
    """Encode the 8-byte length and the JSON header, padded to ``alignment``.

    The JSON is compact, ``__metadata__`` first, then the entries in the given
    (file) order, then spaces up to the next multiple of ``alignment``. When the metadata
    holds any ``fastckpt.`` key, the header checksum ``fastckpt.header_crc`` (fixed width,
    so the header's size does not depend on it) is computed and added.

    Args:
        entries: contiguous entries from offset 0, as :func:`plan_layout` gives.
        metadata: str -> str, or None for none.
        alignment: a power of two >= 8.

    Returns:
        ``len(result) % alignment == 0``; the data section follows it directly.

    Example:
        >>> header = encode_header(plan_layout([("x", "U8", (5,))]), alignment=64)
        >>> len(header), header[8:40]
        (64, b'{"x":{"dtype":"U8","shape":[5],"')
    """
    _check_alignment(alignment)
    if len(entries) > MAX_TENSORS:
        raise ValueError(
            f"{len(entries)} tensors: more than MAX_TENSORS ({MAX_TENSORS}), the most one "
            "file may hold (readers refuse more); save them as several files (max_shard_size=)"
        )
    _check_contiguous(entries)
    document: dict[str, Any] = {}
    if metadata:
        check_metadata(metadata)
        document[METADATA_KEY] = {k: v for k, v in metadata.items() if k != KEY_HEADER_CRC}
    for entry in entries:
        document[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [entry.begin, entry.end],
        }
    if metadata and any(key.startswith(META_PREFIX) for key in metadata):
        try:
            document[METADATA_KEY][KEY_HEADER_CRC] = canonical_crc(document)
        except UnicodeEncodeError as exc:  # lone surrogates: refused below all the same
            raise ValueError(f"header holds a string that is not valid Unicode: {exc}") from None
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=False)
    try:
        # Raw UTF-8 keeps names readable; lone surrogates cannot be written
        # as UTF-8 and would make the file unreadable elsewhere.
        encoded = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"header holds a string that is not valid Unicode: {exc}") from None
    # Readers allow one tensor per MIN_BYTES_PER_TENSOR header bytes beyond a small count
    # (their guard against hostile headers): short entries get padding so the file passes.
    needed = len(entries) * MIN_BYTES_PER_TENSOR if len(entries) > SMALL_TENSOR_COUNT else 0
    padded = -(-(8 + max(len(encoded), needed)) // alignment) * alignment
    length = padded - 8
    if length > HEADER_LIMIT:
        raise ValueError(f"header of {length} bytes exceeds the limit of {HEADER_LIMIT} bytes")
    return struct.pack("<Q", length) + encoded + b" " * (length - len(encoded))
