"""Names inside a DCP checkpoint directory: the metadata file, the rank files, the stored
name of each item, and where a checkpoint lives (a local directory or an fsspec URL).

Example:
    >>> rank_file(1, "0123456789ab"), save_id_of("__1_0123456789ab.safetensors")
    ('__1_0123456789ab.safetensors', '0123456789ab')
"""

from __future__ import annotations

import os
import re

from torch.distributed.checkpoint.metadata import MetadataIndex

from fastckpt.integrations import remote

__all__ = [
    "METADATA_FILE",
    "RANK_FILE",
    "SAVE_ID_HEX",
    "item_name",
    "rank_file",
    "save_id_of",
    "location",
]

#: DCP's metadata file name inside a checkpoint directory (the same name DCP's own uses).
METADATA_FILE = ".metadata"
#: A rank file: ``__<rank>_<save id>[<suffix>].safetensors``.
RANK_FILE = re.compile(r"^__(\d+)_([0-9a-f]+)\.safetensors$")
#: Hex digits of a save id (the first ones of a rank file's id name its save).
SAVE_ID_HEX = 12


def item_name(index: MetadataIndex) -> str:
    """The tensor name under which one write item is stored in its rank's file."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


def rank_file(rank: int, save_id: str) -> str:
    """The file one rank writes in the save ``save_id``."""
    return f"__{rank}_{save_id}.safetensors"


def save_id_of(file_name: str) -> str | None:
    """The save a rank file belongs to (None: not a rank file)."""
    match = RANK_FILE.match(file_name)
    return match.group(2)[:SAVE_ID_HEX] if match else None


def location(checkpoint_id: str | os.PathLike[str]) -> str:
    """A local directory (a plain path, or a ``file://`` URL turned back into one) or an fsspec
    URL (``s3://``, ``memory://``, ...), without a trailing ``/``.

    Example:
        >>> location("file:///tmp/ckpt"), location("memory://bucket/ckpt/")
        ('/tmp/ckpt', 'memory://bucket/ckpt')
    """
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(checkpoint_id).__name__}")
    path = os.fspath(checkpoint_id)
    if remote.is_url(path):
        return path.rstrip("/")
    return remote.local_path(path) if remote.handles(path) else path
