"""Parsing and validating headers from untrusted bytes: every check raises HeaderError.

Example:
    >>> from fastckpt.format.layout import encode_header, plan_layout
    >>> header = encode_header(plan_layout([("w", "F32", (2,))]), {})
    >>> n = parse_header_length(header[:8], len(header) + 8)
    >>> list(parse_header(header[8 : 8 + n], len(header) + 8).entries)
    ['w']
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Callable

from fastckpt.errors import HeaderError
from fastckpt.format.other_formats import other_format
from fastckpt.format.schema import (
    _ENTRY_KEYS,
    COMPRESSED_DTYPE,
    DTYPES,
    FORMAT_VERSION,
    HEADER_LIMIT,
    ITEMSIZE,
    KEY_HEADER_CRC,
    KEY_VERSION,
    MAX_TENSORS,
    META_PREFIX,
    METADATA_KEY,
    MIN_BYTES_PER_NODE,
    MIN_BYTES_PER_TENSOR,
    PACKED_BITS,
    READABLE_VERSIONS,
    SMALL_NODE_COUNT,
    SMALL_TENSOR_COUNT,
    Header,
    TensorEntry,
    canonical_crc,
    element_bits,
    int64_dims_error,
    is_count,
    short,
    tensor_nbytes,
)
from fastckpt.format.torch_save import SNIFF_BYTES, torch_save_format

# a compressed tensor's blob is one more dtype here, of bytes (see compressed.py)
_DTYPE_NAMES = {name: name for name in DTYPES | {COMPRESSED_DTYPE}}
# dtypes of whole bytes per element: bytes per element (the fast entry check, _plain_entry)
_WHOLE_BYTES = {name: size for name, size in ITEMSIZE.items() if name not in PACKED_BITS}
_I64, _U64 = 2**63, 2**64

_TORCH_SAVE_KINDS = {"zip": "a zip archive", "pickle": "a pickle", "tar": "a tar archive"}


def _format_hint(head: bytes) -> str | None:
    """The message for another tool's file (a torch.save file, NumPy's, GGUF, JSON, a
    pickle), or None when ``head`` (its first bytes) looks like none of them."""
    kind = torch_save_format(head)
    other = other_format(head)
    if other is None:
        return None
    if kind is not None and other.reader == "torch.load":
        return (
            f"this is a torch.save file ({_TORCH_SAVE_KINDS[kind]}), not a safetensors/fastckpt "
            "file: convert it with `fastckpt convert FILE OUT.safetensors`, or load it with "
            "torch.load"
        )
    read = f": read it with {other.reader}" if other.reader else ""
    return f"this is {other.description}, not a safetensors/fastckpt file{read}"


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
        first8: the file's first bytes (at least 8 unless the file is shorter; up to
            512 name another tool's file better when the length is impossible).
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
    head = bytes(first8[:SNIFF_BYTES])
    (length,) = struct.unpack("<Q", head[:8])
    try:
        _check_length(length, file_size)
    except HeaderError:
        # Only when the length is impossible: a real header length may begin with these bytes.
        hint = _format_hint(head)
        if hint is not None:
            raise HeaderError(hint) from None
        raise
    return length


def _reject_constant(name: str) -> None:
    raise HeaderError(f"invalid JSON: {name} is not a JSON value")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise HeaderError(f"invalid JSON: duplicate key {short(key)}")
            seen.add(key)
    return result


class _Packed(tuple):
    """A tensor entry as decoded from a header, ``(dtype, shape, data_offsets)``: a tuple
    costs a third of the dict it replaces, and a header may hold 500k entries."""

    __slots__ = ()

    def as_dict(self) -> dict[str, Any]:
        return dict(zip(_ENTRY_KEYS, self))


def _plain(value: Any) -> Any:
    return value.as_dict() if type(value) is _Packed else value


def _counting(limit: int, message: str) -> Any:
    """An object hook like :func:`_no_duplicates` that refuses the object after ``limit``,
    so memory is bounded while decoding, not only afterwards."""
    count = 0

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any] | _Packed:
        nonlocal count
        count += 1
        if count > limit:
            raise HeaderError(message)
        if len(pairs) == 3 and tuple(key for key, _ in pairs) == _ENTRY_KEYS:
            dtype = pairs[0][1]
            if type(dtype) is str:
                dtype = _DTYPE_NAMES.get(dtype, dtype)
            return _Packed((dtype, pairs[1][1], pairs[2][1]))
        return _no_duplicates(pairs)

    return hook


_STRICT = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)


def loads_strict(text: str, what: str, max_objects: int | None = None, too_many: str = "") -> Any:
    """Strict JSON: no NaN/Infinity, no duplicate keys, errors as HeaderError; at most
    ``max_objects`` JSON objects when given (else HeaderError(``too_many``))."""
    try:
        if max_objects is None and type(text) is str and not text.startswith("\ufeff"):
            # what json.loads does, with a decoder made once (making one costs more than
            # decoding a checksum table); json.loads names a BOM, so it takes those
            return _STRICT.decode(text)
        hook = _no_duplicates if max_objects is None else _counting(max_objects, too_many)
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=hook)
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
            raise HeaderError(f"{what} {short(text)} is not valid Unicode") from None


def _parse_metadata(raw: Any) -> dict[str, str]:
    if raw is None:  # the reference reader accepts null
        return {}
    if not isinstance(raw, dict):
        raise HeaderError(f"__metadata__ must be an object of strings, got {json_type(raw)}")
    for key, value in raw.items():
        _check_text(key, "__metadata__ key")
        if type(value) is not str:
            raise HeaderError(
                f"__metadata__[{short(key)}] must be a string, got {json_type(value)}"
            )
        _check_text(value, f"__metadata__[{short(key)}]")
    return raw


def json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer"}
    names[_Packed] = "object"
    names.update({float: "number", type(None): "null"})
    return names.get(type(value), type(value).__name__)


def _parse_entry(name: str, raw: Any) -> TensorEntry:
    if type(raw) is _Packed:
        entry = _plain_entry(name, *raw)
        if entry is not None:
            return entry
    return _checked_parse_entry(name, raw)


def _plain_entry(name: str, dtype: Any, shape: Any, offsets: Any) -> TensorEntry | None:
    """The entry of the common case, checked in one pass (an ASCII name, a dtype of whole
    bytes, at most 8 non-zero dimensions that fill the offsets), or None when any of that
    does not hold: :func:`_checked_parse_entry` then accepts it or says what is wrong. It
    accepts nothing that one refuses (each bound here is as tight or tighter)."""
    itemsize = _WHOLE_BYTES.get(dtype) if type(dtype) is str else None
    if (
        itemsize is None
        or not name.isascii()
        or type(shape) is not list
        or len(shape) > 8
        or type(offsets) is not list
        or len(offsets) != 2
    ):
        return None
    for dim in shape:
        if type(dim) is not int or not 0 < dim < _I64:
            return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end < _U64:
        return None
    numel = math.prod(shape)
    if numel >= _I64 or numel * itemsize != end - begin:
        return None
    return TensorEntry(name, _DTYPE_NAMES[dtype], tuple(shape), begin, end)


def _checked_parse_entry(name: str, raw: Any) -> TensorEntry:
    where = f"tensor {short(name)}"
    _check_text(name, "tensor name")
    if type(raw) is _Packed:  # the three keys, in order, once each
        dtype, shape, offsets = raw
        return _checked_entry(where, name, dtype, shape, offsets)
    if not isinstance(raw, dict):
        raise HeaderError(f"{where}: entry must be an object, got {json_type(raw)}")
    missing = [key for key in _ENTRY_KEYS if key not in raw]
    if missing:
        raise HeaderError(f"{where}: missing {', '.join(missing)}")
    extra = sorted(set(raw) - set(_ENTRY_KEYS))
    if extra:
        raise HeaderError(f"{where}: unexpected key(s) {', '.join(map(repr, extra))}")

    return _checked_entry(where, name, raw["dtype"], raw["shape"], raw["data_offsets"])


def _checked_entry(where: str, name: str, dtype: Any, shape: Any, offsets: Any) -> TensorEntry:
    if type(dtype) is not str or dtype not in _DTYPE_NAMES:
        raise HeaderError(f"{where}: unknown dtype {short(dtype)}")
    sized_as = "U8" if dtype == COMPRESSED_DTYPE else dtype  # a compressed blob counts bytes
    if not isinstance(shape, list) or not all(is_count(dim) for dim in shape):
        raise HeaderError(f"{where}: shape {short(shape)} must be a list of integers in [0, 2**64)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets))):
        raise HeaderError(
            f"{where}: data_offsets {short(offsets)} must be two integers in [0, 2**64)"
        )
    begin, end = offsets
    if begin > end:
        raise HeaderError(f"{where}: data_offsets [{begin}, {end}] begin after they end")
    too_big = int64_dims_error(shape)
    if too_big is not None:
        raise HeaderError(f"{where}: shape {short(shape)}: {too_big}, the most torch can hold")
    try:
        nbytes = tensor_nbytes(sized_as, shape)
    except ValueError as exc:
        raise HeaderError(f"{where}: shape {exc}") from None
    if nbytes is None:
        raise HeaderError(f"{where}: shape {short(shape)} of {dtype} overflows 64 bits")
    if nbytes != end - begin:
        raise HeaderError(
            f"{where}: shape {short(shape)} of {dtype} ({element_bits(sized_as)} bits each) "
            f"does not fill data_offsets [{begin}, {end}] ({end - begin} bytes)"
        )
    # The table's own string for the dtype: one shared object instead of one per entry.
    return TensorEntry(name, _DTYPE_NAMES[dtype], tuple(shape), begin, end)


def _check_data_end(entries: list[TensorEntry], data_offset: int, file_size: int) -> None:
    """The tensors must end within the file; one that ends past it says the file was cut
    short (or its header damaged), with the size the header expects."""
    last = max(entries, key=lambda entry: entry.end, default=None)
    data_size = file_size - data_offset
    if last is not None and last.end > data_size:
        raise HeaderError(
            f"truncated: the file is {file_size} bytes, its header says the data ends at "
            f"{data_offset + last.end} (tensor {short(last.name)}: data_offsets "
            f"[{last.begin}, {last.end}] run past the data section of {data_size} bytes)"
        )


def _check_coverage(entries: list[TensorEntry], data_size: int) -> None:
    """Tensors must tile the data section exactly, as the reference reader demands."""
    offset = 0
    previous: TensorEntry | None = None
    for entry in entries:
        if entry.begin < offset:
            assert previous is not None  # offset only grows past 0 at an entry
            raise HeaderError(
                f"tensor {short(entry.name)} at [{entry.begin}, {entry.end}] overlaps "
                f"tensor {short(previous.name)} at [{previous.begin}, {previous.end}]"
            )
        if entry.begin > offset:
            raise HeaderError(
                f"gap of {entry.begin - offset} bytes before tensor {short(entry.name)} "
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


def _check_node_count(raw: bytes, size: int | None = None) -> None:
    """Refuse a header with more JSON containers than its size allows, before decoding it;
    ``size``: the header's length when ``raw`` is it without its trailing padding."""
    size = len(raw) if size is None else size
    limit = max(size // MIN_BYTES_PER_NODE, SMALL_NODE_COUNT)
    nodes = raw.count(b"{") + raw.count(b"[")
    if nodes > limit:
        raise HeaderError(
            f"header of {size} bytes holds {nodes} JSON objects/arrays, more than the "
            f"limit of one per {MIN_BYTES_PER_NODE} bytes: not a real header"
        )


def _newer(version: str) -> bool:
    return version.isdigit() and len(version) < 10 and int(version) > int(FORMAT_VERSION)


def check_integrity(document: dict[str, Any]) -> None:
    """Check the format version and the header checksum of a decoded header.

    A header with any ``fastckpt.`` metadata key was written by fastckpt and must carry a
    valid :data:`~fastckpt.format.schema.KEY_HEADER_CRC` (zlib.crc32 of the canonical JSON of
    the header without that key): a damaged name, shape, offset, tree, alias, checksum table
    or user value is refused instead of loaded. Exception: files of format version ``"1"``
    (written before the header checksum existed) are read without one. Plain safetensors
    headers (no ``fastckpt.`` key) carry no checksum.

    Raises:
        HeaderError: a newer format version ("written by a newer fastckpt"), an unknown
            version, or a missing or wrong header checksum.

    Example:
        >>> check_integrity({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})
        >>> check_integrity({"__metadata__": {"fastckpt.version": "9"}})
        Traceback (most recent call last):
        ...
        fastckpt.errors.HeaderError: written by a newer fastckpt (format version '9'; this one reads versions 1 to 3): upgrade fastckpt to read it
    """
    meta = document.get(METADATA_KEY)
    if not isinstance(meta, dict) or not any(
        type(key) is str and key.startswith(META_PREFIX) for key in meta
    ):
        return
    version = meta.get(KEY_VERSION)
    if version not in READABLE_VERSIONS:
        if type(version) is str and _newer(version):
            raise HeaderError(
                f"written by a newer fastckpt (format version {short(version)}; this one reads "
                f"versions {READABLE_VERSIONS[0]} to {READABLE_VERSIONS[-1]}): "
                "upgrade fastckpt to read it"
            )
        raise HeaderError(
            f"unknown {KEY_VERSION} {short(version)}: the header is damaged "
            f"(this fastckpt reads versions {READABLE_VERSIONS[0]} to {READABLE_VERSIONS[-1]})"
        )
    stored = meta.get(KEY_HEADER_CRC)
    if stored is None:
        if version == "1":
            return  # written before header checksums existed
        raise HeaderError(f"{KEY_HEADER_CRC} is missing: the header is damaged")
    if type(stored) is not str or len(stored) != 8:
        raise HeaderError(f"{KEY_HEADER_CRC} = {short(stored)}: expected 8 hex digits")
    rest = {key: value for key, value in meta.items() if key != KEY_HEADER_CRC}
    actual = canonical_crc({**document, METADATA_KEY: rest}, _plain)
    if actual != stored:
        raise HeaderError(
            f"header checksum mismatch ({KEY_HEADER_CRC} is {short(stored)}, the header "
            f"hashes to {actual!r}): the header is damaged"
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
    raw_bytes = json_bytes if type(json_bytes) is bytes else bytes(json_bytes)
    # The padding is JSON whitespace, but scanning it (twice) costs more than a small header's
    # JSON: left out when spaces alone follow the last "}" (bytes.rstrip(b" ") is slower).
    end = raw_bytes.rfind(b"}") + 1
    if end and raw_bytes.count(b" ", end) == length - end:
        raw_bytes = raw_bytes[:end]
    _check_node_count(raw_bytes, length)
    try:
        text = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"header is not valid UTF-8: {exc}") from None
    del raw_bytes
    # Every JSON object of a valid header is a tensor entry, __metadata__ or the header itself.
    allowed = min(max(length // MIN_BYTES_PER_TENSOR, SMALL_TENSOR_COUNT), MAX_TENSORS)
    document = loads_strict(
        text,
        "header",
        max_objects=allowed + 2,
        too_many=f"more than {allowed} tensors, the most allowed in a header of {length} bytes "
        f"(one per {MIN_BYTES_PER_TENSOR} bytes beyond {SMALL_TENSOR_COUNT}, at most {MAX_TENSORS})",
    )
    del text
    document = _plain(document)
    if not isinstance(document, dict):
        raise HeaderError(f"header must be a JSON object, got {json_type(document)}")
    if METADATA_KEY in document:
        document[METADATA_KEY] = _plain(document[METADATA_KEY])
    check_integrity(document)

    data_offset = 8 + length
    data_size = file_size - data_offset
    metadata = _parse_metadata(document.pop(METADATA_KEY, None))
    parsed = []
    while document:  # popping keeps one copy of each entry alive, not two
        name, raw = document.popitem()
        parsed.append(_parse_entry(name, raw))
    parsed.reverse()
    # Stable sort: zero-size tensors sharing an offset keep their header order.
    parsed.sort(key=lambda entry: (entry.begin, entry.end))
    _check_data_end(parsed, data_offset, file_size)
    _check_coverage(parsed, data_size)
    return Header(
        entries={entry.name: entry for entry in parsed},
        metadata=metadata,
        data_offset=data_offset,
        data_size=data_size,
    )


#: ``read_at(offset, nbytes)``: bytes ``[offset, offset + nbytes)`` of a file (fewer, or
#: ``EOFError``, where the file ends).
ReadAt = Callable[[int, int], bytes]


def _name_other_format(read_at: ReadAt, file_size: int) -> None:
    """Raises the HeaderError that names the tool whose file this is (a NumPy ``.npz``
    archive needs its first member's name, past the 8 bytes of a length), if any."""
    try:
        head = read_at(0, min(file_size, SNIFF_BYTES))
    except (EOFError, OSError):
        return  # the first error stands
    hint = _format_hint(head)
    if hint is not None:
        raise HeaderError(hint)


def read_header_from(
    read_at: ReadAt, file_size: int, *, where: str | None = None, probe: int = 8
) -> Header:
    """The header of a file of ``file_size`` bytes that ``read_at`` reads: the one header
    reader of every storage (local files, descriptors, URLs). This module does no I/O of its
    own; the caller's ``read_at`` does.

    The first read takes ``probe`` bytes (at least the 8 of the length): 8 for a local file,
    then the header in a second read; a URL reader asks for more, which usually holds the
    whole header in one request.

    Args:
        read_at: reads bytes by offset and count.
        file_size: the whole file's size in bytes.
        where: the file's path or URL, put before every message (none when None).
        probe: bytes of the first read.

    Raises:
        HeaderError: not a valid safetensors file, or it ended while reading the header.

    Example:
        >>> from fastckpt.format.layout import encode_header, plan_layout
        >>> data = encode_header(plan_layout([("w", "F32", (2,))]), {}) + bytes(8)
        >>> read_at = lambda offset, nbytes: data[offset : offset + nbytes]
        >>> list(read_header_from(read_at, len(data)).entries)
        ['w']
        >>> read_header_from(read_at, 4, where="/tmp/short.safetensors")
        Traceback (most recent call last):
        ...
        fastckpt.errors.HeaderError: /tmp/short.safetensors: not a safetensors file: \
4 bytes, fewer than the 8-byte header length
    """
    prefix = "" if where is None else f"{where}: "
    try:
        first = read_at(0, min(file_size, max(8, probe))) if file_size else b""
        try:
            length = parse_header_length(first[:8], file_size)
        except HeaderError:
            _name_other_format(read_at, file_size)  # not safetensors: which tool wrote it?
            raise
        raw = first[8 : 8 + length] if len(first) >= 8 + length else read_at(8, length)
        if len(raw) < length:
            raise EOFError
        return parse_header(raw, file_size)
    except HeaderError as exc:
        raise HeaderError(f"{prefix}{exc}") from None
    except EOFError:
        raise HeaderError(f"{prefix}the file ended while reading the header") from None
