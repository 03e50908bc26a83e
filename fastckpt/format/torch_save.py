"""Recognising a file written by ``torch.save`` from its first bytes.

``torch.save`` has written three formats, and ``torch.load`` still reads all of them:

* ``"zip"``: a zip archive (the default since torch 1.6), whatever the pickle protocol;
* ``"pickle"``: the legacy stream (``_use_new_zipfile_serialization=False``), which opens
  with torch's magic number pickled with protocol 2 to 5: ``0x80 P``, for protocols 4 and
  5 a frame opcode and its 8-byte length, then the number as ``LONG1`` of 10 bytes;
* ``"tar"``: the oldest format (torch before 0.4), a tar archive, known by the ``ustar``
  mark at byte 257 of its first block.

A safetensors file cannot be mistaken for the first two: read as a header length, their
first 8 bytes are far beyond the 100 MB cap. A plain safetensors header length may begin
with ``0x80 0x02`` (640 bytes), which is why the whole magic number is compared, not only
the protocol byte.

Pure: bytes in, a name out; no I/O.

Example:
    >>> torch_save_format(b"PK\\x03\\x04\\x00\\x00\\x08\\x08")
    'zip'
    >>> torch_save_format(b"\\x80\\x02\\x8a\\x0al\\xfc\\x9cF\\xf9 j\\xa8P\\x19.")
    'pickle'
    >>> torch_save_format(b"\\x80\\x02\\x00\\x00\\x00\\x00\\x00\\x00{}") is None
    True
"""

from __future__ import annotations

__all__ = ["SNIFF_BYTES", "torch_save_format"]

#: How many leading bytes :func:`torch_save_format` needs to tell every format (one tar block).
SNIFF_BYTES = 512

_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTOCOLS = range(2, 6)
_PROTO = 0x80
_FRAME = 0x95  # protocols 4 and 5 frame the stream: opcode, then an 8-byte length
#: torch.serialization.MAGIC_NUMBER as pickle writes it: LONG1, 10 bytes, little-endian.
_PICKLED_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_TAR_MARK_OFFSET = 257
_TAR_MARK = b"ustar"


def _is_torch_pickle(head: bytes) -> bool:
    if len(head) < 2 or head[0] != _PROTO or head[1] not in _PICKLE_PROTOCOLS:
        return False
    rest = head[2:]
    if head[1] >= 4 and rest[:1] == bytes([_FRAME]):
        rest = rest[9:]
    # A head cut short is judged on what it holds (the header-length check sees 8 bytes).
    return _PICKLED_MAGIC.startswith(rest[: len(_PICKLED_MAGIC)])


def torch_save_format(head: bytes) -> str | None:
    """``"zip"``, ``"pickle"`` or ``"tar"`` when ``head`` starts a ``torch.save`` file, else None.

    Args:
        head: the file's first bytes; :data:`SNIFF_BYTES` of them tell every format. Fewer
            are judged on what they hold: 4 bytes tell a zip archive, 2 a pickle (8 or more
            check torch's magic number too), and a tar archive needs 262.

    Example:
        >>> import pickle  # torch.save's legacy format starts by pickling its magic number
        >>> torch_save_format(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=4))
        'pickle'
        >>> torch_save_format(b"\\xf8\\x0f\\x00\\x00\\x00\\x00\\x00\\x00") is None  # a fastckpt file
        True
    """
    head = bytes(head[:SNIFF_BYTES])
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if _is_torch_pickle(head):
        return "pickle"
    if head[_TAR_MARK_OFFSET : _TAR_MARK_OFFSET + len(_TAR_MARK)] == _TAR_MARK:
        return "tar"
    return None
