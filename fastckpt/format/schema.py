"""The vocabulary of the file format: dtypes, limits, metadata keys, and what a header holds.

Example:
    >>> ITEMSIZE["BF16"], HEADER_LIMIT
    (2, 104857600)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

#: Bytes per element of every safetensors dtype fastckpt reads and writes.
#: Sub-byte types (F4, F6_*) are left out: torch has no one-to-one match.
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

#: Largest header accepted, the same cap as the reference reader.
HEADER_LIMIT = 100 * 1024 * 1024
DEFAULT_ALIGNMENT = 4096
#: The one header key that is not a tensor name.
METADATA_KEY = "__metadata__"

FORMAT_VERSION = "1"
META_PREFIX = "fastckpt."
KEY_VERSION = "fastckpt.version"
KEY_CRC32C = "fastckpt.crc32c"
KEY_ALIASES = "fastckpt.aliases"
KEY_TREE = "fastckpt.tree"

_ENTRY_KEYS = ("dtype", "shape", "data_offsets")
_U64_LIMIT = 2**64
_CRC_PATTERN = re.compile(r"[0-9a-f]{8}")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the data section: bytes ``[begin, end)``.

    Example:
        >>> TensorEntry("w", "F32", (2, 3), 0, 24).nbytes
        24
    """

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
    """

    user: dict[str, str]
    crcs: dict[str, int] | None
    aliases: dict[str, str] = field(default_factory=dict)
    tree: Any = None
    version: str | None = None


# --------------------------------------------------------- checked arithmetic


def short(value: Any, limit: int = 60) -> str:
    """repr() clipped, so a hostile 100 MB value does not end up in a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_count(value: Any) -> bool:
    # Exact int (JSON true is not 1) that fits the reference reader's u64.
    return type(value) is int and 0 <= value < _U64_LIMIT


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
