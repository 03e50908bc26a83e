"""storage: where bytes live. Local files (the native engine, O_DIRECT or the page cache, the
commit protocol of :mod:`fastckpt.io.commit`) and fsspec URLs, behind one interface
(:class:`Storage`), so the checkpoint layer reads and writes them alike.

:func:`open_storage` picks the implementation from the location (a ``file://`` URL is a local
path); :func:`exists`, :func:`list_names`, :func:`delete`, :func:`read_whole` and
:func:`write_whole` work on either.

Example:
    >>> write_whole("memory://doc-store/run/a.json", b"{}")
    >>> list_names("memory://doc-store/run"), read_whole("memory://doc-store/run/a.json")
    (['a.json'], b'{}')
    >>> delete("memory://doc-store/run/a.json"); exists("memory://doc-store/run/a.json")
    False
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastckpt.io.commit import write_atomically
from fastckpt.storage.base import Storage
from fastckpt.storage.locations import handles, is_url, join, local_path, to_local, url_to_fs
from fastckpt.storage.url import url_errors

__all__ = [
    "Storage",
    "delete",
    "exists",
    "handles",
    "is_url",
    "join",
    "list_names",
    "local_path",
    "open_storage",
    "read_whole",
    "to_local",
    "url_to_fs",
    "write_whole",
]

Options = Mapping[str, Any] | None


def open_storage(
    location: Any,
    *,
    storage_options: Options = None,
    create: bool = False,
    **options: Any,
) -> Storage:
    """The :class:`Storage` of the file at ``location`` (a path, ``file://`` URL or URL).

    Args:
        storage_options: for a URL, passed to its fsspec file system.
        create: the file is to be written (it need not exist; nothing is opened).
        options: for a local file ``direct_io``, ``engine``, ``block_size``, ``queue_depth``,
            ``intra_op_parallelism``; for a URL ``part_size`` and ``parallel``.

    Example:
        >>> type(open_storage("memory://doc-store/new.bin", create=True)).__name__
        'UrlStorage'
    """
    local = to_local(location)
    if local is not None:
        from fastckpt.storage.local import LocalStorage

        return LocalStorage(local, create=create, **options)
    if not isinstance(location, str):
        raise TypeError(f"f must be a path or a URL, got {type(location).__name__}")
    from fastckpt.storage.url import UrlStorage

    storage = UrlStorage(location, storage_options=storage_options, **options)
    if not create:
        storage.size()  # FileNotFoundError / IsADirectoryError now, naming the URL
    return storage


def exists(location: str, storage_options: Options = None) -> bool:
    """Whether a file is at ``location``."""
    local = to_local(location)
    if local is not None:
        return os.path.isfile(local)
    with url_errors(location, "stat"):
        fs, path = url_to_fs(location, storage_options)
        return bool(fs.isfile(path))


def list_names(directory: str, storage_options: Options = None) -> list[str]:
    """The names of the files in ``directory``, sorted."""
    local = to_local(directory)
    if local is not None:
        return sorted(n for n in os.listdir(local) if os.path.isfile(os.path.join(local, n)))
    with url_errors(directory, "listing"):
        fs, path = url_to_fs(directory, storage_options)
        found = fs.ls(path, detail=True)
    return sorted(
        str(item["name"]).rstrip("/").rsplit("/", 1)[-1]
        for item in found
        if item.get("type") != "directory"
    )


def delete(location: str, storage_options: Options = None) -> None:
    """Removes the file at ``location`` (``FileNotFoundError`` when there is none)."""
    open_storage(location, storage_options=storage_options, create=True).delete()


def read_whole(location: str, storage_options: Options = None) -> bytes:
    """A whole small file (an index, metadata); errors name the path or URL."""
    local = to_local(location)
    if local is not None:
        with open(local, "rb") as f:
            return f.read()
    with url_errors(location, "read"):
        fs, path = url_to_fs(location, storage_options)
        return bytes(fs.cat_file(path))


def write_whole(location: str, data: bytes, storage_options: Options = None) -> None:
    """Writes a small file whole: it appears complete and durable, or not at all."""
    local = to_local(location)
    if local is not None:
        write_atomically(local, data)
        return
    storage = open_storage(location, storage_options=storage_options, create=True)
    storage.write_atomically([data] if data else [], len(data))
