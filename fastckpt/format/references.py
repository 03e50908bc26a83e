"""The header keys of incremental checkpoints: every tensor's strong content hash, and the
references of an incremental file to tensors stored in earlier files.

:data:`KEY_XXH3_128` maps each stored tensor to the XXH3-128 digest of its bytes (32
lowercase hex digits, fixed width: a writer sizes the header before it knows them).
:data:`KEY_REFERENCES` lists the tensors a file does not hold::

    {"files": ["../step-000000000000/state.safetensors"],
     "tensors": {"model/w": {"file": 0, "tensor": "model/w", "dtype": "F32",
                             "shape": [4, 4], "xxh3_128": "<32 hex digits>"}}}

``files`` are paths relative to the referencing file's directory, in POSIX form: never
absolute, and climbing at most :data:`MAX_PARENT_STEPS` directories (``..``) so that a
checkpoint series' step directories can refer to their siblings while a header cannot point
anywhere else on the machine. This module is pure: it decodes and checks what a header says;
opening the files is the checkpoint layer's job.

Example:
    >>> refs = References(("../a/x.safetensors",), {"w": Reference(0, "w", "F32", (2,), "0" * 32)})
    >>> parse_references(references_json(refs)) == refs
    True
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastckpt.errors import HeaderError
from fastckpt.format.header import json_type, loads_strict
from fastckpt.format.schema import DTYPES, short

__all__ = [
    "KEY_XXH3_128",
    "KEY_REFERENCES",
    "INCREMENTAL_VERSION",
    "MAX_PARENT_STEPS",
    "HASH_HEX_DIGITS",
    "Reference",
    "References",
    "check_reference_path",
    "hashes_json",
    "parse_hashes",
    "references_json",
    "parse_references",
]

#: Stored tensor name -> XXH3-128 of its bytes, 32 lowercase hex digits.
KEY_XXH3_128 = "fastckpt.xxh3_128"
#: Tensors held by other files (see the module's docstring).
KEY_REFERENCES = "fastckpt.references"
#: The format version of a file with references: a fastckpt that predates them refuses it
#: ("written by a newer fastckpt") instead of loading a checkpoint with tensors missing.
INCREMENTAL_VERSION = "3"
#: How many leading ``..`` a reference path may have: 1 reaches the sibling directories of
#: the file's own (``step-N/`` -> ``../step-M/``), and nothing above them.
MAX_PARENT_STEPS = 1
HASH_HEX_DIGITS = 32
_HASH = re.compile(r"[0-9a-f]{32}")
_REFERENCE_KEYS = ("dtype", "file", "shape", "tensor", "xxh3_128")
_MAX_FILES = 1 << 16


@dataclass(frozen=True)
class Reference:
    """One tensor held by another file: ``files[file]``'s tensor ``tensor``, whose bytes
    have XXH3-128 ``xxh3_128`` (hex) and are ``dtype`` of ``shape``."""

    file: int
    tensor: str
    dtype: str
    shape: tuple[int, ...]
    xxh3_128: str


@dataclass(frozen=True)
class References:
    """The decoded :data:`KEY_REFERENCES`: the files referred to and the tensors in them."""

    files: tuple[str, ...]
    tensors: dict[str, Reference]


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def check_reference_path(path: Any) -> str:
    """``path`` if it may name a referenced file, else HeaderError saying why: a relative
    POSIX path, normalized, with at most :data:`MAX_PARENT_STEPS` leading ``..``.

    Example:
        >>> check_reference_path("../step-1/state.safetensors")
        '../step-1/state.safetensors'
        >>> check_reference_path("/etc/passwd")
        Traceback (most recent call last):
        ...
        fastckpt.errors.HeaderError: reference path '/etc/passwd' is absolute: references are relative to the referencing file's directory
    """
    if type(path) is not str or not path or "\x00" in path or "\\" in path:
        raise HeaderError(f"reference path {short(path)} must be a non-empty POSIX path")
    if path.startswith("/"):
        raise HeaderError(
            f"reference path {short(path)} is absolute: references are relative to the "
            "referencing file's directory"
        )
    parts = path.split("/")
    climbs = 0
    while climbs < len(parts) and parts[climbs] == "..":
        climbs += 1
    rest = parts[climbs:]
    if not rest or any(p in ("", ".", "..") for p in rest) or posixpath.normpath(path) != path:
        raise HeaderError(
            f"reference path {short(path)} is not a normalized path to a file "
            "(no '.', '..' after a name, or empty parts)"
        )
    if climbs > MAX_PARENT_STEPS:
        raise HeaderError(
            f"reference path {short(path)} climbs {climbs} directories up; references may "
            f"climb at most {MAX_PARENT_STEPS} (to a sibling directory)"
        )
    return path


def hashes_json(hashes: Mapping[str, str]) -> str:
    """Encodes :data:`KEY_XXH3_128` (ValueError for a digest that is not 32 hex digits)."""
    for name, digest in hashes.items():
        if type(digest) is not str or not _HASH.fullmatch(digest):
            raise ValueError(f"XXH3-128 of tensor {name!r} must be 32 hex digits, got {digest!r}")
    return _dumps(dict(hashes))


def parse_hashes(text: str) -> dict[str, str]:
    """Decodes :data:`KEY_XXH3_128`; that it names stored tensors is the reader's check."""
    table = loads_strict(text, KEY_XXH3_128)
    if not isinstance(table, dict):
        raise HeaderError(f"{KEY_XXH3_128} must be a JSON object, got {json_type(table)}")
    for name, value in table.items():
        if type(value) is not str or not _HASH.fullmatch(value):
            raise HeaderError(
                f"{KEY_XXH3_128}[{short(name)}] = {short(value)}: expected 32 lowercase hex digits"
            )
    return table


def references_json(refs: References) -> str:
    """Encodes :data:`KEY_REFERENCES` (checked as a reader would, so no writer makes a file
    that fastckpt refuses)."""
    text = _dumps(
        {
            "files": list(refs.files),
            "tensors": {
                name: {
                    "file": r.file,
                    "tensor": r.tensor,
                    "dtype": r.dtype,
                    "shape": list(r.shape),
                    "xxh3_128": r.xxh3_128,
                }
                for name, r in refs.tensors.items()
            },
        }
    )
    try:
        parse_references(text)
    except HeaderError as exc:
        raise ValueError(str(exc)) from None
    return text


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(type(d) is not int or d < 0 for d in value):
        raise HeaderError(f"{where}: shape must be a list of non-negative ints, got {short(value)}")
    if len(value) > 64 or any(d >= 2**63 for d in value):
        raise HeaderError(f"{where}: shape {short(value)} is out of range")
    return tuple(value)


def parse_references(text: str) -> References:
    """Decodes :data:`KEY_REFERENCES`, refusing malformed entries and paths that are
    absolute or climb too far (HeaderError naming them). That a referenced file exists and
    holds the tensor with that hash is checked when it is opened.

    Example:
        >>> parse_references('{"files":["../../x"],"tensors":{}}')
        Traceback (most recent call last):
        ...
        fastckpt.errors.HeaderError: fastckpt.references: reference path '../../x' climbs 2 directories up; references may climb at most 1 (to a sibling directory)
    """
    value = loads_strict(text, KEY_REFERENCES)
    if not isinstance(value, dict) or sorted(value) != ["files", "tensors"]:
        raise HeaderError(f"{KEY_REFERENCES} must be a JSON object with keys files and tensors")
    files, tensors = value["files"], value["tensors"]
    if not isinstance(files, list) or len(files) > _MAX_FILES:
        raise HeaderError(f"{KEY_REFERENCES}: files must be a list of paths")
    try:
        checked = tuple(check_reference_path(p) for p in files)
    except HeaderError as exc:
        raise HeaderError(f"{KEY_REFERENCES}: {exc}") from None
    if len(set(checked)) != len(checked):
        raise HeaderError(f"{KEY_REFERENCES}: files lists a path twice")
    if not isinstance(tensors, dict):
        raise HeaderError(f"{KEY_REFERENCES}: tensors must be a JSON object")
    out: dict[str, Reference] = {}
    for name, ref in tensors.items():
        where = f"{KEY_REFERENCES}[{short(name)}]"
        if not isinstance(ref, dict) or sorted(ref) != list(_REFERENCE_KEYS):
            raise HeaderError(f"{where} must be an object with keys {', '.join(_REFERENCE_KEYS)}")
        index = ref["file"]
        if type(index) is not int or not 0 <= index < len(checked):
            raise HeaderError(f"{where}: file {short(index)} is not an index into files")
        if type(ref["tensor"]) is not str:
            raise HeaderError(f"{where}: tensor must be a name, got {json_type(ref['tensor'])}")
        if type(ref["dtype"]) is not str or ref["dtype"] not in DTYPES:
            raise HeaderError(f"{where}: unknown dtype {short(ref['dtype'])}")
        digest = ref["xxh3_128"]
        if type(digest) is not str or not _HASH.fullmatch(digest):
            raise HeaderError(f"{where}: xxh3_128 {short(digest)} is not 32 lowercase hex digits")
        out[name] = Reference(
            index, ref["tensor"], ref["dtype"], _shape(ref["shape"], where), digest
        )
    return References(checked, out)
