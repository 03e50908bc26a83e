"""``__metadata__``: the user's strings and fastckpt's own keys (checksums, aliases, tree).

Example:
    >>> meta = split_metadata(build_metadata({"step": "3"}, crcs={"w": 7}))
    >>> meta.user["step"], meta.crcs
    ('3', {'w': 7})
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastckpt.errors import HeaderError
from fastckpt.format.header import json_type, loads_strict
from fastckpt.format.layout import check_metadata
from fastckpt.format.references import (
    INCREMENTAL_VERSION,
    KEY_REFERENCES,
    KEY_XXH3_128,
    References,
    hashes_json,
    parse_hashes,
    parse_references,
    references_json,
)
from fastckpt.format.schema import (
    _CRC_PATTERN,
    DEFAULT_ALIGNMENT,
    FORMAT_VERSION,
    KEY_ALIASES,
    KEY_CRC32C,
    KEY_PIECE_CRC32C,
    KEY_TREE,
    KEY_VERSION,
    MAX_PIECE_SIZE,
    META_PREFIX,
    FastckptMeta,
    PieceTable,
    short,
)

_HEX_PIECES = re.compile(r"(?:[0-9a-f]{8})+")
_PIECE_KEYS = ("piece_size", "crcs")

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
    pieces: Mapping[str, Sequence[int]] | None = None,
    piece_size: int | None = None,
    hashes: Mapping[str, str] | None = None,
    references: References | None = None,
) -> dict[str, str]:
    """Assemble ``__metadata__``: ``"format": "pt"``, the user's keys, fastckpt's keys.

    Args:
        user: the caller's str -> str metadata; keys must not start with ``fastckpt.``.
            ``"format"`` defaults to ``"pt"`` unless given here.
        crcs: tensor name -> CRC32C (0 <= crc < 2**32), stored as 8 hex digits.
        aliases: alias name -> stored tensor name (only written when non-empty).
        tree: a JSON-able structure description (from :mod:`fastckpt.checkpoint.tree`),
            or None for a flat dict.
        pieces: tensor name -> the CRC32C of each of its pieces of ``piece_size`` bytes
            (only tensors larger than one piece; written only when non-empty).
        piece_size: bytes per piece, a positive multiple of ``DEFAULT_ALIGNMENT``.
        hashes: tensor name -> XXH3-128 hex digest (:mod:`fastckpt.format.references`).
        references: tensors held by other files; their presence makes the file version
            :data:`~fastckpt.format.references.INCREMENTAL_VERSION`.

    Example:
        >>> build_metadata({"step": "10"}, crcs={"w": 255}, aliases={"b": "w"})
        {'format': 'pt', 'step': '10', 'fastckpt.version': '2', \
'fastckpt.crc32c': '{"w":"000000ff"}', 'fastckpt.aliases': '{"b":"w"}'}
    """
    result = {"format": "pt"}
    if user is not None:
        check_metadata(user)
        for key in user:
            if key.startswith(META_PREFIX):
                raise ValueError(f"metadata key {key!r}: the prefix {META_PREFIX!r} is reserved")
        result.update(user)
    result[KEY_VERSION] = INCREMENTAL_VERSION if references is not None else FORMAT_VERSION
    if crcs is not None:
        for name, crc in crcs.items():
            if type(crc) is not int or not 0 <= crc < 2**32:
                raise ValueError(f"CRC32C of tensor {name!r} must be a 32-bit int, got {crc!r}")
        result[KEY_CRC32C] = _dumps({name: f"{crc:08x}" for name, crc in crcs.items()})
    if pieces:
        result[KEY_PIECE_CRC32C] = _pieces_json(pieces, piece_size)
    if hashes is not None:
        result[KEY_XXH3_128] = hashes_json(hashes)
    if references is not None:
        result[KEY_REFERENCES] = references_json(references)
    if aliases:
        result[KEY_ALIASES] = _dumps(dict(aliases))
    if tree is not None:
        try:
            result[KEY_TREE] = _dumps(tree)
        except RecursionError:
            raise ValueError("the structure description is nested too deeply for JSON") from None
    return result


def _check_piece_size(size: Any) -> str | None:
    """Why ``size`` cannot be a piece size, or None when it can."""
    if type(size) is not int or not 0 < size <= MAX_PIECE_SIZE or size % DEFAULT_ALIGNMENT:
        return (
            f"must be a positive multiple of {DEFAULT_ALIGNMENT} up to {MAX_PIECE_SIZE}, "
            f"got {short(size)}"
        )
    return None


def _pieces_json(pieces: Mapping[str, Sequence[int]], piece_size: int | None) -> str:
    why = _check_piece_size(piece_size)
    if why is not None:
        raise ValueError(f"piece_size {why}")
    table = {}
    for name, crcs in pieces.items():
        if not crcs:
            raise ValueError(f"tensor {name!r}: a piece table needs at least one CRC32C")
        for crc in crcs:
            if type(crc) is not int or not 0 <= crc < 2**32:
                raise ValueError(
                    f"piece CRC32C of tensor {name!r} must be a 32-bit int, got {crc!r}"
                )
        table[name] = "".join(f"{crc:08x}" for crc in crcs)
    return _dumps({"piece_size": piece_size, "crcs": table})


def _parse_pieces(text: str) -> PieceTable:
    """Decodes :data:`KEY_PIECE_CRC32C`; that names and counts match the tensors is
    checked by the reader, which knows their sizes."""
    value = loads_strict(text, KEY_PIECE_CRC32C)
    if not isinstance(value, dict) or sorted(value) != sorted(_PIECE_KEYS):
        raise HeaderError(
            f"{KEY_PIECE_CRC32C} must be a JSON object with keys {' and '.join(_PIECE_KEYS)}, "
            f"got {short(value if not isinstance(value, dict) else sorted(value))}"
        )
    why = _check_piece_size(value["piece_size"])
    if why is not None:
        raise HeaderError(f"{KEY_PIECE_CRC32C}: piece_size {why}")
    table = value["crcs"]
    if not isinstance(table, dict):
        raise HeaderError(f"{KEY_PIECE_CRC32C}: crcs must be a JSON object, got {json_type(table)}")
    digests = {}
    for name, hex_crcs in table.items():
        if type(hex_crcs) is not str or not _HEX_PIECES.fullmatch(hex_crcs):
            raise HeaderError(
                f"{KEY_PIECE_CRC32C}[{short(name)}] = {short(hex_crcs)}: expected 8 lowercase "
                "hex digits per piece, at least one piece"
            )
        digests[name] = bytes.fromhex(hex_crcs)
    return PieceTable(value["piece_size"], digests)


def _parse_crcs(text: str) -> dict[str, int]:
    table = loads_strict(text, KEY_CRC32C)
    if not isinstance(table, dict):
        raise HeaderError(f"{KEY_CRC32C} must be a JSON object, got {json_type(table)}")
    crcs = {}
    for name, value in table.items():
        if type(value) is not str or not _CRC_PATTERN.fullmatch(value):
            raise HeaderError(
                f"{KEY_CRC32C}[{short(name)}] = {short(value)}: expected 8 lowercase hex digits"
            )
        crcs[name] = int(value, 16)
    return crcs


def _parse_aliases(text: str) -> dict[str, str]:
    table = loads_strict(text, KEY_ALIASES)
    if not isinstance(table, dict):
        raise HeaderError(f"{KEY_ALIASES} must be a JSON object, got {json_type(table)}")
    for alias, target in table.items():
        if type(target) is not str:
            raise HeaderError(
                f"{KEY_ALIASES}[{short(alias)}] must be a tensor name, got {json_type(target)}"
            )
    return table


def split_metadata(meta: Mapping[str, str]) -> FastckptMeta:
    """Separate the user's metadata from fastckpt's keys and decode the latter.

    Unknown ``fastckpt.*`` keys (from a newer writer) are ignored; the version and the
    header checksum are checked by :func:`~fastckpt.format.parse_header`. Checking
    that aliases and checksums name tensors of the file is the caller's job.

    Raises:
        HeaderError: a fastckpt key holds malformed JSON or values.

    Example:
        >>> m = split_metadata(build_metadata({"a": "b"}, crcs={"w": 1}))
        >>> m.user, m.crcs, m.aliases, m.tree, m.version, m.pieces
        ({'format': 'pt', 'a': 'b'}, {'w': 1}, {}, None, '2', None)
        >>> m = split_metadata(build_metadata(pieces={"w": [1, 2]}, piece_size=4096))
        >>> m.pieces.piece_size, m.pieces.crcs("w")
        (4096, [1, 2])
    """
    user = {key: value for key, value in meta.items() if not key.startswith(META_PREFIX)}
    crcs = _parse_crcs(meta[KEY_CRC32C]) if KEY_CRC32C in meta else None
    aliases = _parse_aliases(meta[KEY_ALIASES]) if KEY_ALIASES in meta else {}
    tree = loads_strict(meta[KEY_TREE], KEY_TREE) if KEY_TREE in meta else None
    if KEY_TREE in meta and tree is None:
        raise HeaderError(f"{KEY_TREE} is null")
    version = meta.get(KEY_VERSION)
    pieces = _parse_pieces(meta[KEY_PIECE_CRC32C]) if KEY_PIECE_CRC32C in meta else None
    hashes = parse_hashes(meta[KEY_XXH3_128]) if KEY_XXH3_128 in meta else None
    references = parse_references(meta[KEY_REFERENCES]) if KEY_REFERENCES in meta else None
    if references is not None and version != INCREMENTAL_VERSION:
        # an older fastckpt would load such a file without its referenced tensors
        raise HeaderError(
            f"{KEY_REFERENCES} in a file of version {short(version)}: files with references "
            f"are version {INCREMENTAL_VERSION}"
        )
    return FastckptMeta(
        user=user,
        crcs=crcs,
        aliases=aliases,
        tree=tree,
        version=version,
        pieces=pieces,
        hashes=hashes,
        references=references,
    )
