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
:func:`build_metadata` and :func:`split_metadata`).

This module is pure: no file I/O and no torch, only bytes, ints and strings.
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

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastckpt.errors import HeaderError

__all__ = [
    "DEFAULT_ALIGNMENT",
    "FORMAT_VERSION",
    "HEADER_LIMIT",
    "ITEMSIZE",
    "KEY_ALIASES",
    "KEY_CRC32C",
    "KEY_TREE",
    "KEY_VERSION",
    "METADATA_KEY",
    "META_PREFIX",
    "FastckptMeta",
    "Header",
    "TensorEntry",
    "build_metadata",
    "encode_header",
    "parse_header",
    "parse_header_length",
    "plan_layout",
    "split_metadata",
]

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


# --------------------------------------------------------------------------- layout


def _check_alignment(alignment: int) -> None:
    if type(alignment) is not int or alignment < 8 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 8, got {alignment!r}")


def _checked_nbytes(name: str, dtype: str, shape: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """(shape as a tuple, byte size) of a tensor to write; ValueError if no reader could read it."""
    if dtype not in ITEMSIZE:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
    dims = tuple(shape)
    if not all(type(dim) is int and dim >= 0 for dim in dims):
        raise ValueError(f"tensor {name!r}: shape {list(dims)} must hold non-negative ints")
    nbytes = _nbytes_u64(list(dims), ITEMSIZE[dtype])
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
        return (not fills_blocks, -ITEMSIZE[dtype], name)

    entries = []
    offset = 0
    for name, dtype, dims, nbytes in sorted(sized, key=order):
        entries.append(TensorEntry(name, dtype, dims, offset, offset + nbytes))
        offset += nbytes
    return entries


# --------------------------------------------------------------------------- encode


def _check_metadata(metadata: Mapping[str, str]) -> None:
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
    (file) order, then spaces up to the next multiple of ``alignment``.

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
    _check_contiguous(entries)
    document: dict[str, Any] = {}
    if metadata:
        _check_metadata(metadata)
        document[METADATA_KEY] = dict(metadata)
    for entry in entries:
        document[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [entry.begin, entry.end],
        }
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=False)
    try:
        # Raw UTF-8 keeps names readable; lone surrogates cannot be written
        # as UTF-8 and would make the file unreadable elsewhere.
        encoded = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"header holds a string that is not valid Unicode: {exc}") from None
    padded = -(-(8 + len(encoded)) // alignment) * alignment
    length = padded - 8
    if length > HEADER_LIMIT:
        raise ValueError(f"header of {length} bytes exceeds the limit of {HEADER_LIMIT} bytes")
    return struct.pack("<Q", length) + encoded + b" " * (length - len(encoded))


# --------------------------------------------------------------------------- parse


def _check_length(length: int, file_size: int) -> None:
    if length == 0:
        raise HeaderError("header length is 0: not a safetensors file")
    if length > HEADER_LIMIT:
        raise HeaderError(
            f"header length {length} exceeds the limit of {HEADER_LIMIT} bytes: "
            "not a safetensors file, or a damaged one"
        )
    if length > file_size - 8:
        raise HeaderError(
            f"file truncated: header length is {length} but only "
            f"{max(file_size - 8, 0)} bytes follow the 8-byte length"
        )


def parse_header_length(first8: bytes, file_size: int) -> int:
    """Read and check the header length N from a file's first 8 bytes.

    Args:
        first8: the file's first bytes (at least 8 unless the file is shorter).
        file_size: the whole file's size in bytes.

    Raises:
        HeaderError: the file is too short, N is 0, N exceeds
            :data:`HEADER_LIMIT`, or N runs past the end of the file.

    Example:
        >>> parse_header_length(b"\\x10\\x00\\x00\\x00\\x00\\x00\\x00\\x00", 100)
        16
    """
    if file_size < 8 or len(first8) < 8:
        raise HeaderError(
            f"not a safetensors file: {min(file_size, len(first8))} bytes, "
            "fewer than the 8-byte header length"
        )
    (length,) = struct.unpack("<Q", bytes(first8[:8]))
    _check_length(length, file_size)
    return length


def _reject_constant(name: str) -> None:
    raise HeaderError(f"invalid JSON: {name} is not a JSON value")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise HeaderError(f"invalid JSON: duplicate key {_short(key)}")
            seen.add(key)
    return result


def _loads(text: str, what: str) -> Any:
    """Strict JSON: no NaN/Infinity, no duplicate keys, errors as HeaderError."""
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except HeaderError as exc:
        raise HeaderError(f"{what}: {exc}") from None
    except RecursionError:
        raise HeaderError(f"{what}: JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an int with too many digits
        raise HeaderError(f"{what}: invalid JSON: {exc}") from None


def _check_text(text: str, what: str) -> None:
    # Python's JSON accepts "\ud800"; the reference reader rejects lone surrogates.
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise HeaderError(f"{what} {_short(text)} is not valid Unicode") from None


def _parse_metadata(raw: Any) -> dict[str, str]:
    if raw is None:  # the reference reader accepts null
        return {}
    if not isinstance(raw, dict):
        raise HeaderError(f"__metadata__ must be an object of strings, got {_json_type(raw)}")
    for key, value in raw.items():
        _check_text(key, "__metadata__ key")
        if type(value) is not str:
            raise HeaderError(
                f"__metadata__[{_short(key)}] must be a string, got {_json_type(value)}"
            )
        _check_text(value, f"__metadata__[{_short(key)}]")
    return raw


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer"}
    names.update({float: "number", type(None): "null"})
    return names.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
    """repr() clipped, so a hostile 100 MB value does not end up in a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_count(value: Any) -> bool:
    # Exact int (JSON true is not 1) that fits the reference reader's u64.
    return type(value) is int and 0 <= value < _U64_LIMIT


def _nbytes_u64(shape: list[int], itemsize: int) -> int | None:
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


def _parse_entry(name: str, raw: Any, data_size: int) -> TensorEntry:
    where = f"tensor {_short(name)}"
    _check_text(name, "tensor name")
    if not isinstance(raw, dict):
        raise HeaderError(f"{where}: entry must be an object, got {_json_type(raw)}")
    missing = [key for key in _ENTRY_KEYS if key not in raw]
    if missing:
        raise HeaderError(f"{where}: missing {', '.join(missing)}")
    extra = sorted(set(raw) - set(_ENTRY_KEYS))
    if extra:
        raise HeaderError(f"{where}: unexpected key(s) {', '.join(map(repr, extra))}")

    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if type(dtype) is not str or dtype not in ITEMSIZE:
        raise HeaderError(f"{where}: unknown dtype {_short(dtype)}")
    if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
        raise HeaderError(
            f"{where}: shape {_short(shape)} must be a list of integers in [0, 2**64)"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise HeaderError(
            f"{where}: data_offsets {_short(offsets)} must be two integers in [0, 2**64)"
        )
    begin, end = offsets
    if begin > end:
        raise HeaderError(f"{where}: data_offsets [{begin}, {end}] begin after they end")
    if end > data_size:
        raise HeaderError(
            f"{where}: data_offsets [{begin}, {end}] run past the data section of {data_size} bytes"
        )
    nbytes = _nbytes_u64(shape, ITEMSIZE[dtype])
    if nbytes is None:
        raise HeaderError(f"{where}: shape {_short(shape)} of {dtype} overflows 64 bits")
    if nbytes != end - begin:
        raise HeaderError(
            f"{where}: shape {_short(shape)} of {dtype} ({ITEMSIZE[dtype]} bytes each) "
            f"does not fill data_offsets [{begin}, {end}] ({end - begin} bytes)"
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _check_coverage(entries: list[TensorEntry], data_size: int) -> None:
    """Tensors must tile the data section exactly, as the reference reader demands."""
    offset = 0
    previous = None
    for entry in entries:
        if entry.begin < offset:
            raise HeaderError(
                f"tensor {_short(entry.name)} at [{entry.begin}, {entry.end}] overlaps "
                f"tensor {_short(previous.name)} at [{previous.begin}, {previous.end}]"
            )
        if entry.begin > offset:
            raise HeaderError(
                f"gap of {entry.begin - offset} bytes before tensor {_short(entry.name)} "
                f"at offset {entry.begin}"
            )
        if entry.end > offset:
            previous = entry
        offset = entry.end
    if offset != data_size:
        raise HeaderError(
            f"{data_size - offset} bytes after the last tensor: the data section "
            f"is {data_size} bytes but tensors cover only {offset}"
        )


def parse_header(json_bytes: bytes, file_size: int) -> Header:
    """Decode and validate a header: ``json_bytes`` are the N bytes after the length.

    Args:
        json_bytes: exactly the header's N bytes.
        file_size: the whole file's size; the tensors must end exactly there.

    Raises:
        HeaderError: anything malformed; the message names the tensor, field
            and values at fault.

    Example:
        >>> raw = b'{"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
        >>> h = parse_header(raw, 8 + len(raw) + 2)
        >>> h.entries["x"].shape, h.data_size
        ((2,), 2)
    """
    length = len(json_bytes)
    _check_length(length, file_size)
    if json_bytes[:1] != b"{":
        raise HeaderError(
            f"header does not start with '{{' (starts with {bytes(json_bytes[:16])!r}): "
            "not a safetensors file"
        )
    try:
        text = bytes(json_bytes).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"header is not valid UTF-8: {exc}") from None
    document = _loads(text, "header")
    if not isinstance(document, dict):
        raise HeaderError(f"header must be a JSON object, got {_json_type(document)}")

    data_offset = 8 + length
    data_size = file_size - data_offset
    metadata = _parse_metadata(document.pop(METADATA_KEY, None))
    parsed = [_parse_entry(name, raw, data_size) for name, raw in document.items()]
    # Stable sort: zero-size tensors sharing an offset keep their header order.
    parsed.sort(key=lambda entry: (entry.begin, entry.end))
    _check_coverage(parsed, data_size)
    return Header(
        entries={entry.name: entry for entry in parsed},
        metadata=metadata,
        data_offset=data_offset,
        data_size=data_size,
    )


# --------------------------------------------------------------------------- metadata


def _dumps(value: Any) -> str:
    # ASCII-only JSON: lone surrogates in the object survive as \u escapes.
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def build_metadata(
    user: Mapping[str, str] | None = None,
    *,
    crcs: Mapping[str, int] | None = None,
    aliases: Mapping[str, str] | None = None,
    tree: Any = None,
) -> dict[str, str]:
    """Assemble ``__metadata__``: ``"format": "pt"``, the user's keys, fastckpt's keys.

    Args:
        user: the caller's str -> str metadata; keys must not start with ``fastckpt.``.
            ``"format"`` defaults to ``"pt"`` unless given here.
        crcs: tensor name -> CRC32C (0 <= crc < 2**32), stored as 8 hex digits.
        aliases: alias name -> stored tensor name (only written when non-empty).
        tree: a JSON-able structure description (from :mod:`fastckpt.tree`),
            or None for a flat dict.

    Example:
        >>> build_metadata({"step": "10"}, crcs={"w": 255}, aliases={"b": "w"})
        {'format': 'pt', 'step': '10', 'fastckpt.version': '1', \
'fastckpt.crc32c': '{"w":"000000ff"}', 'fastckpt.aliases': '{"b":"w"}'}
    """
    result = {"format": "pt"}
    if user is not None:
        _check_metadata(user)
        for key in user:
            if key.startswith(META_PREFIX):
                raise ValueError(f"metadata key {key!r}: the prefix {META_PREFIX!r} is reserved")
        result.update(user)
    result[KEY_VERSION] = FORMAT_VERSION
    if crcs is not None:
        for name, crc in crcs.items():
            if type(crc) is not int or not 0 <= crc < 2**32:
                raise ValueError(f"CRC32C of tensor {name!r} must be a 32-bit int, got {crc!r}")
        result[KEY_CRC32C] = _dumps({name: f"{crc:08x}" for name, crc in crcs.items()})
    if aliases:
        result[KEY_ALIASES] = _dumps(dict(aliases))
    if tree is not None:
        try:
            result[KEY_TREE] = _dumps(tree)
        except RecursionError:
            raise ValueError("the structure description is nested too deeply for JSON") from None
    return result


def _parse_crcs(text: str) -> dict[str, int]:
    table = _loads(text, KEY_CRC32C)
    if not isinstance(table, dict):
        raise HeaderError(f"{KEY_CRC32C} must be a JSON object, got {_json_type(table)}")
    crcs = {}
    for name, value in table.items():
        if type(value) is not str or not _CRC_PATTERN.fullmatch(value):
            raise HeaderError(
                f"{KEY_CRC32C}[{_short(name)}] = {_short(value)}: expected 8 lowercase hex digits"
            )
        crcs[name] = int(value, 16)
    return crcs


def _parse_aliases(text: str) -> dict[str, str]:
    table = _loads(text, KEY_ALIASES)
    if not isinstance(table, dict):
        raise HeaderError(f"{KEY_ALIASES} must be a JSON object, got {_json_type(table)}")
    for alias, target in table.items():
        if type(target) is not str:
            raise HeaderError(
                f"{KEY_ALIASES}[{_short(alias)}] must be a tensor name, got {_json_type(target)}"
            )
    return table


def split_metadata(meta: Mapping[str, str]) -> FastckptMeta:
    """Separate the user's metadata from fastckpt's keys and decode the latter.

    Unknown ``fastckpt.*`` keys (from a newer writer) are ignored. Checking
    that aliases and checksums name tensors of the file is the caller's job.

    Raises:
        HeaderError: a fastckpt key holds malformed JSON or values.

    Example:
        >>> m = split_metadata(build_metadata({"a": "b"}, crcs={"w": 1}))
        >>> m.user, m.crcs, m.aliases, m.tree, m.version
        ({'format': 'pt', 'a': 'b'}, {'w': 1}, {}, None, '1')
    """
    user = {key: value for key, value in meta.items() if not key.startswith(META_PREFIX)}
    crcs = _parse_crcs(meta[KEY_CRC32C]) if KEY_CRC32C in meta else None
    aliases = _parse_aliases(meta[KEY_ALIASES]) if KEY_ALIASES in meta else {}
    tree = _loads(meta[KEY_TREE], KEY_TREE) if KEY_TREE in meta else None
    if KEY_TREE in meta and tree is None:
        raise HeaderError(f"{KEY_TREE} is null")
    version = meta.get(KEY_VERSION)
    return FastckptMeta(user=user, crcs=crcs, aliases=aliases, tree=tree, version=version)
