"""What a checkpoint file holds, as a short digest of its header: the identity that two
readers of "the same checkpoint" must share before one trusts bytes the other read, and that
a file opened again must still have.

A file that records checksums is identified by its content: the names, dtypes, shapes and
sizes of its tensors and fastckpt's own tables (the per-tensor and per-piece CRC32Cs, the
XXH3-128 digests, aliases, structure, references), so two copies of one checkpoint agree
wherever they lie, and two steps of a run differ as soon as one tensor's bytes do. A file
without checksums falls back to its whole header (names, dtypes, shapes, data offsets and
metadata): it tells apart files laid out differently or with different metadata, but not
two files whose headers are byte for byte the same and whose tensor bytes differ.

Example:
    >>> import os, tempfile, torch
    >>> from fastckpt.checkpoint.read import open_checkpoint
    >>> from fastckpt.checkpoint.save import save
    >>> d = tempfile.mkdtemp()
    >>> save({"w": torch.zeros(3)}, os.path.join(d, "a.safetensors"))
    >>> save({"w": torch.ones(3)}, os.path.join(d, "b.safetensors"))
    >>> with open_checkpoint(os.path.join(d, "a.safetensors")) as a:
    ...     with open_checkpoint(os.path.join(d, "b.safetensors")) as b:
    ...         kind, digest = of_view(a)
    ...         kind, digest == of_view(b)[1]
    ('checksums', False)
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

from fastckpt import format

__all__ = ["of_header", "of_view"]

#: Recomputed for each view once: a header of 500k tensors takes milliseconds to hash.
_known: weakref.WeakKeyDictionary[Any, tuple[str, str]] = weakref.WeakKeyDictionary()


def of_header(header: format.Header, meta: format.FastckptMeta) -> tuple[str, str]:
    """``(kind, digest)`` of a parsed header: kind ``"checksums"`` (the content tables and
    the structure) or ``"header"`` (the whole header, for a file without checksums).

    Example:
        >>> from fastckpt.format.layout import encode_header, plan_layout
        >>> from fastckpt.format.header import read_header_from
        >>> data = encode_header(plan_layout([("w", "F32", (2,))]), {}) + bytes(8)
        >>> h = read_header_from(lambda o, n: data[o : o + n], len(data))
        >>> of_header(h, format.split_metadata(h.metadata))[0]
        'header'
    """
    digest = hashlib.blake2b(digest_size=16)

    def add(*parts: Any) -> None:
        digest.update(repr(parts).encode())
        digest.update(b"\n")

    if meta.crcs is not None:
        for entry in header.entries.values():
            add(entry.name, entry.dtype, entry.shape, entry.nbytes)
        for key in sorted(header.metadata):
            # every table of fastckpt's own but the header's checksum, which covers offsets
            # and the user's metadata too
            if key.startswith(format.META_PREFIX) and key != format.KEY_HEADER_CRC:
                add(key, header.metadata[key])
        return "checksums", digest.hexdigest()
    for entry in header.entries.values():
        add(entry.name, entry.dtype, entry.shape, entry.begin, entry.end)
    for key in sorted(header.metadata):
        add(key, header.metadata[key])
    add(header.data_offset, header.data_size)
    return "header", digest.hexdigest()


def of_view(view: Any) -> tuple[str, str]:
    """:func:`of_header` of a reader of one file (anything with ``header`` and ``meta``:
    a :class:`~fastckpt.checkpoint.header_view.HeaderView`), computed once per reader."""
    known = _known.get(view)
    if known is None:
        known = _known[view] = of_header(view.header, view.meta)
    return known
