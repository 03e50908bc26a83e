"""The indexes of checkpoints this process saved, so that an incremental save whose base is
one of them need not parse the chain's headers again.

An incremental save starts from its base's index: every tensor name -> the file and tensor
holding its bytes, with its XXH3-128 (:func:`fastckpt.checkpoint.incremental.base_index`).
That opens the base and every file it refers to and parses their headers: measured on a
934-tensor LoRA-like series, about 0.03 s of a 0.126 s incremental save. The save that wrote
the base knew all of it -- what it wrote, and where what it referred to is. So it leaves the
index here, with the exact header bytes it wrote and those of every other file of its chain
(what it refers to, directly or not). A lookup reads those files' headers (no parsing: a few hundred KiB from the page cache)
and returns the index only when every one is byte for byte the same. What parsing finds is a
function of the file's path, its header and the headers of its chain, so a match gives what
parsing would; a file replaced, rewritten or damaged since, or a save that never committed, does not
match and the base is parsed as before.

Kept: the last :data:`MAX_FILES` files saved (local paths; a URL is always parsed).

Example:
    >>> import os, tempfile, torch
    >>> from fastckpt.checkpoint.chained_reader import Location
    >>> path = os.path.join(tempfile.mkdtemp(), "k.safetensors")
    >>> import fastckpt
    >>> fastckpt.save({"w": torch.ones(2)}, path)  # its save leaves the index
    >>> index, files = lookup(path)
    >>> index["w"].tensor, files == {path}
    ('w', True)
    >>> with open(path, "r+b") as f:  # the header rewritten: parsed again, not looked up
    ...     _ = f.seek(9); _ = f.write(b" ")
    >>> lookup(path) is None
    True
"""

from __future__ import annotations

import collections
import os
import struct
import threading
from collections.abc import Iterable, Mapping

from fastckpt.checkpoint.chained_reader import Location
from fastckpt.storage.locations import is_url

__all__ = ["MAX_FILES", "forget", "lookup", "remember"]

#: Files whose index is kept (the least recently saved are forgotten).
MAX_FILES = 16

_lock = threading.Lock()
# path -> (its header's bytes, {other file of its chain: that file's header bytes}, index)
_known: collections.OrderedDict[str, tuple[bytes, dict[str, bytes], dict[str, Location]]] = (
    collections.OrderedDict()
)


def _header_bytes(path: str) -> bytes | None:
    """The encoded header at the start of the file at ``path`` (length prefix included), or
    None when it cannot be read whole."""
    try:
        with open(path, "rb", buffering=0) as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                return None
            (length,) = struct.unpack("<Q", prefix)
            if length > 100 << 20:  # far beyond any header fastckpt writes
                return None
            body = f.read(length)
    except OSError:
        return None
    return prefix + body if len(body) == length else None


def remember(
    path: str, header: bytes, index: Mapping[str, Location], chain: Iterable[str] = ()
) -> None:
    """The file at ``path`` is being written with ``header`` (the exact bytes at its start)
    and holds ``index``; ``chain``: the files it refers to, directly or through others (its
    base's chain and the base), on whose headers its index depends besides the files the
    index points into. Their headers are read now, as they are while ``path`` is written."""
    if is_url(path):
        return
    path = os.path.abspath(path)
    others: dict[str, bytes] = {}
    for file in ({loc.file for loc in index.values()} | set(chain)) - {path}:
        seen = _header_bytes(file)
        if seen is None:
            return  # a file of its chain cannot be read: nothing to keep
        others[file] = seen
    with _lock:
        _known[path] = (bytes(header), others, dict(index))
        _known.move_to_end(path)
        while len(_known) > MAX_FILES:
            _known.popitem(last=False)


def lookup(path: str) -> tuple[dict[str, Location], set[str]] | None:
    """The index :func:`remember` kept for ``path`` and the files of its chain (itself
    included), when its file and every other one still start with the headers seen then;
    else None."""
    if is_url(path):
        return None
    path = os.path.abspath(path)
    with _lock:
        entry = _known.get(path)
    if entry is None:
        return None
    header, others, index = entry
    if _header_bytes(path) != header:
        return None
    for file, expected in others.items():
        if _header_bytes(file) != expected:
            return None
    return dict(index), {path, *others}


def forget(path: str | None = None) -> None:
    """Forgets the index kept for ``path`` (every one when None)."""
    with _lock:
        if path is None:
            _known.clear()
        else:
            _known.pop(os.path.abspath(path), None)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a parent's thread may have held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
