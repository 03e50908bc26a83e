"""Which files of a DCP checkpoint directory no checkpoint needs any more, decided so that
concurrent saves into one directory never remove each other's files.

A save is *live* from its global plan until its ``.metadata`` is published (or it failed):
its coordinator holds a :class:`LiveSave`, a temporary file ``.saving-<save id>.<random>.tmp``
locked for that whole time by :class:`fastckpt.io.commit.AtomicFile` (the same ``flock``
that protects every writer's temporary files; a dead process's lock is free). The rank files
of a save are all written after its marker is taken.

:func:`stale_local_files` is run by a coordinator after it published ``.metadata``:

1. list the rank files in the directory;
2. remove the temporary files whose writer is gone (:func:`~fastckpt.io.commit.remove_stale_temporaries`
   leaves the locked ones of live writers alone) and note the saves still live;
3. read the ``.metadata`` published now;
4. stale = the listed rank files that this metadata does not reference and whose save is
   not live.

A save whose file was listed in 1 either is live in 2 (kept) or had ended before 2, so the
metadata read in 3 is its own or a later one: a published checkpoint's files are never
removed, nor are those of a save still running.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> live = LiveSave(d, "0123456789ab")
    >>> sorted(live_saves(d))
    ['0123456789ab']
    >>> live.release()
    >>> sorted(live_saves(d)), os.listdir(d)
    ([], [])
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any

from fastckpt.errors import FastCkptError
from fastckpt.integrations import remote
from fastckpt.integrations.dcp._paths import METADATA_FILE, RANK_FILE, save_id_of
from fastckpt.integrations.dcp.metadata import file_of, read_dcp_metadata
from fastckpt.io.commit import AtomicFile, remove_stale_temporaries

__all__ = [
    "LiveSave",
    "live_saves",
    "stale_local_files",
    "unlink_all",
    "remove_stale_at_url",
]

_log = logging.getLogger("fastckpt")

_MARKER = ".saving-"
_MARKER_FILE = re.compile(r"^\.saving-([0-9a-f]+)\.[0-9a-f]{12}\.tmp$")
#: A temporary file of the commit protocol: ``<final name>.<12 hex>.tmp``.
_TEMPORARY = re.compile(r"^(.+)\.[0-9a-f]{12}\.tmp$")
#: Temporaries an upload to a URL may leave (object stores hold no locks to ask).
_STALE_TMP_AT_URL = re.compile(r"^(__\d+_[0-9a-f]+\.safetensors|\.metadata)\.[0-9a-f]+\.tmp$")


class LiveSave:
    """Marks the save ``save_id`` into ``directory`` as running until :meth:`release`
    (or until its process ends): its files are then never taken for stale."""

    def __init__(self, directory: str, save_id: str):
        self.save_id = save_id
        self._marker: AtomicFile | None = AtomicFile(
            os.path.join(directory, _MARKER + save_id), direct=False
        )

    def release(self) -> None:
        """Removes the marker; the save's files are then judged by the published metadata."""
        marker, self._marker = self._marker, None
        if marker is not None:
            marker.abort()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # a writer dropped mid-save; exit frees it anyway
            self.release()


def _ours(name: str) -> bool:
    return name == METADATA_FILE or bool(RANK_FILE.match(name)) or name.startswith(_MARKER)


def live_saves(directory: str) -> set[str]:
    """The ids of the saves into ``directory`` whose process still holds their marker; the
    markers and other temporary files of dead writers are removed on the way."""
    bases = {m.group(1) for m in map(_TEMPORARY.match, os.listdir(directory)) if m}
    for base in sorted(b for b in bases if _ours(b)):
        remove_stale_temporaries(os.path.join(directory, base))
    return {m.group(1) for m in map(_MARKER_FILE.match, os.listdir(directory)) if m}


def stale_local_files(directory: str) -> list[str]:
    """The rank files in ``directory`` that neither the published ``.metadata`` nor a live
    save needs (removes dead writers' temporaries on the way; see the module's notes).
    Without a readable published checkpoint nothing is stale."""
    listed = [name for name in os.listdir(directory) if RANK_FILE.match(name)]
    live = live_saves(directory)
    try:
        metadata = read_dcp_metadata(directory)
    except (OSError, FastCkptError) as exc:
        _log.warning("%s: old files kept, the published metadata is unreadable: %s", directory, exc)
        return []
    referenced = {file_of(v) for v in (metadata.storage_data or {}).values()}
    return [
        os.path.join(directory, name)
        for name in listed
        if name not in referenced and save_id_of(name) not in live
    ]


def unlink_all(paths: list[str]) -> None:
    """Removes files that no checkpoint refers to; one already gone is no error, and one
    that cannot be removed stays for the next save's cleanup."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("could not remove %s, left from an earlier save: %s", path, exc)


def remove_stale_at_url(url: str, referenced: set[str], storage_options: Any = None) -> None:
    """Deletes rank files (and temporaries) of earlier or failed saves at ``url``; a
    deletion that fails leaves only an unreferenced file, so it is not an error.

    Object stores hold no locks, so saves into one URL must not run concurrently."""
    fs, inner = remote.url_to_fs(url, storage_options)
    fs.invalidate_cache(inner)  # a listing cached before the ranks' uploads is stale
    with remote._Errors(url, "listing"):
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(inner, detail=False)]
    stale = [
        f"{inner.rstrip('/')}/{name}"
        for name in names
        if (RANK_FILE.match(name) and name not in referenced) or _STALE_TMP_AT_URL.match(name)
    ]
    if stale:
        try:
            fs.rm(stale)
        except Exception:  # best effort: the checkpoint is committed either way
            pass
        fs.invalidate_cache(inner)
