"""Naming other tools' files from their first bytes, so that an error says "this is a NumPy
.npz archive" rather than quoting an impossible header length.

Only asked once a file has failed as safetensors (its first 8 bytes, read as a header length,
are impossible): a real header length may begin with any of these bytes.

Pure: bytes in, a description out; no I/O.

Example:
    >>> other_format(b"GGUF\\x03\\x00\\x00\\x00")
    OtherFormat(description='a GGUF file (llama.cpp)', reader='')
    >>> other_format(b'{"a": 1}').description
    'a JSON document'
    >>> other_format(b"\\x00" * 8) is None
    True
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from fastckpt.format.torch_save import torch_save_format

__all__ = ["OtherFormat", "other_format"]

_NPY_MAGIC = b"\x93NUMPY"
_GGUF_MAGIC = b"GGUF"
_ZIP_MAGIC = b"PK\x03\x04"
#: A zip local file header: its name's length at byte 26 (u16), the name from byte 30.
_ZIP_NAME_LENGTH = 26
_ZIP_NAME = 30
_PICKLE_PROTO = 0x80
_TORCH_FORMATS = {"zip": "a zip archive", "pickle": "a pickle", "tar": "a legacy tar archive"}


class OtherFormat(NamedTuple):
    """A file format in words, and what reads it (empty when nothing in particular)."""

    description: str
    reader: str = ""


_NPY = OtherFormat("a NumPy .npy file", "numpy.load")
_NPZ = OtherFormat("a NumPy .npz archive (a zip of .npy files)", "numpy.load")
_GGUF = OtherFormat("a GGUF file (llama.cpp)")
_JSON = OtherFormat("a JSON document")


def _first_zip_member(head: bytes) -> str | None:
    """The name of a zip archive's first member, when ``head`` holds it."""
    if len(head) < _ZIP_NAME:
        return None
    (length,) = struct.unpack_from("<H", head, _ZIP_NAME_LENGTH)
    name = head[_ZIP_NAME : _ZIP_NAME + length]
    if length == 0 or len(name) < length:
        return None
    return name.decode("utf-8", "replace")


def _zip_format(head: bytes) -> OtherFormat:
    """A zip archive told by its first member: NumPy's ``.npz`` holds ``.npy`` files,
    torch.save's holds ``<name>/data.pkl`` first."""
    first = _first_zip_member(head)
    if first is not None and first.endswith(".npy"):
        return _NPZ
    if first is None or first.endswith("data.pkl"):
        return OtherFormat("a torch.save file (a zip archive)", "torch.load")
    return OtherFormat(f"a zip archive (its first member is {first!r}, not torch.save's data.pkl)")


def other_format(head: bytes) -> OtherFormat | None:
    """What ``head`` (a file's first bytes; 512 tell every format) starts, in words: a NumPy
    ``.npy`` file or ``.npz`` archive, a GGUF file, a JSON document, a torch.save file (a zip
    archive with ``data.pkl``, a pickle or a tar archive), another pickle; None otherwise.

    Example:
        >>> other_format(b"\\x93NUMPY\\x01\\x00v\\x00")
        OtherFormat(description='a NumPy .npy file', reader='numpy.load')
        >>> other_format(b"\\x80\\x04\\x95\\x10\\x00\\x00\\x00\\x00\\x00\\x00\\x00}").description
        'a Python pickle (protocol 4, not torch.save)'
    """
    head = bytes(head)
    if head.startswith(_NPY_MAGIC):
        return _NPY
    if head.startswith(_GGUF_MAGIC):
        return _GGUF
    if head.startswith(_ZIP_MAGIC):
        return _zip_format(head)
    torch_format = torch_save_format(head)
    if torch_format is not None:
        return OtherFormat(f"a torch.save file ({_TORCH_FORMATS[torch_format]})", "torch.load")
    if len(head) >= 2 and head[0] == _PICKLE_PROTO and 2 <= head[1] <= 5:
        return OtherFormat(
            f"a Python pickle (protocol {head[1]}, not torch.save)",
            "pickle.load, for trusted files only",
        )
    if head.lstrip(b" \t\r\n")[:1] in (b"{", b"["):
        return _JSON
    return None
