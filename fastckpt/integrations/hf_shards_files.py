"""The files of a Hugging Face sharded directory: which of them a sharded save writes, which
the published set references (its index and shards, or a lone ``model.safetensors``), and
whether fastckpt wrote them.

A save into a directory replaces only a set that fastckpt wrote (:func:`refuse_foreign_files`
names any other tool's files and refuses), and the files a new set no longer references are
removed only under the directory's publish lock (:mod:`fastckpt.io.commit_set`).

Example:
    >>> import tempfile
    >>> foreign_files(tempfile.mkdtemp())
    []
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping
from typing import Any

from fastckpt import format
from fastckpt.errors import HeaderError
from fastckpt.integrations import remote
from fastckpt.integrations.hf_shards_plan import INDEX_NAME, WEIGHTS_NAME, _belongs
from fastckpt.io import commit_set

__all__ = ["foreign_files", "refuse_foreign_files", "retire_sharded_set"]


def retire_sharded_set(directory: str) -> list[str]:
    """After a save of one ``model.safetensors`` into ``directory``: removes the sharded set
    an earlier save left there, the index first (readers then take the new file at once),
    then its shards and abandoned temporaries, under the directory's publish lock.
    Returns the names removed.

    Example:
        >>> import tempfile, torch
        >>> from fastckpt.integrations.hf_shards import save_sharded
        >>> d = tempfile.mkdtemp()
        >>> save_sharded({"a": torch.zeros(1000), "b": torch.ones(1000)}, d, max_shard_size="4KB")
        >>> retire_sharded_set(d)[0]
        'model.safetensors.index.json'
    """
    removed = []
    with commit_set.directory_lock(directory):
        try:
            os.unlink(os.path.join(directory, INDEX_NAME))
            removed.append(INDEX_NAME)
        except FileNotFoundError:
            pass
        removed += commit_set.remove_unreferenced(directory, _belongs, {WEIGHTS_NAME})
    return removed


def _written_by_fastckpt(path: str) -> bool | None:
    """Whether ``path`` is a checkpoint fastckpt wrote: a safetensors file whose header
    carries fastckpt's version key (every fastckpt save writes it; other tools do not);
    None when it is gone (another save of the directory removed it since it was listed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        header = format.read_header_from(lambda at, n: os.pread(fd, n, at), size, where=path)
    except (OSError, EOFError, HeaderError):
        return False
    finally:
        os.close(fd)
    return format.KEY_VERSION in header.metadata


def _index_shards(path: str) -> set[str] | None:
    """The shard names an index file references, or None when it cannot be read as one."""
    try:
        with open(path, "rb") as f:
            weight_map = json.loads(f.read()).get("weight_map")
        return {v for v in weight_map.values() if isinstance(v, str)}
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def foreign_files(directory: str) -> list[str]:
    """The files of a checkpoint in ``directory`` that a save of a new one there would replace
    or remove, but that fastckpt did not write (``save_pretrained``'s shards and index, say).

    A shard or ``model.safetensors`` is fastckpt's when its header carries fastckpt's keys; an
    index when it names shards that exist and all of them are fastckpt's. Temporaries and files of other
    names are never touched by a save, so never listed.

    Example:
        >>> import tempfile, torch
        >>> from fastckpt.integrations.hf_shards import save_sharded
        >>> d = tempfile.mkdtemp()
        >>> save_sharded({"a": torch.zeros(1000), "b": torch.ones(1000)}, d, max_shard_size="4KB")
        >>> foreign_files(d)
        []
        >>> with open(os.path.join(d, "model-00007-of-00009.safetensors"), "wb") as f:
        ...     _ = f.write(b"not fastckpt's")
        >>> foreign_files(d)
        ['model-00007-of-00009.safetensors']
    """
    try:
        with os.scandir(directory) as listing:
            names = sorted(
                e.name for e in listing if _belongs(e.name) and e.is_file(follow_symlinks=False)
            )
    except (FileNotFoundError, NotADirectoryError):
        return []
    verdicts = {
        n: _written_by_fastckpt(os.path.join(directory, n)) for n in names if n != INDEX_NAME
    }
    # a file gone since the listing (a concurrent save's cleanup) is nothing to replace
    names = [n for n in names if verdicts.get(n, True) is not None]
    ours = {n for n, verdict in verdicts.items() if verdict}
    foreign = [n for n in names if n != INDEX_NAME and n not in ours]
    if INDEX_NAME in names and os.path.lexists(os.path.join(directory, INDEX_NAME)):
        shards = _index_shards(os.path.join(directory, INDEX_NAME))
        # An index published by a concurrent save since the listing names shards the
        # listing missed: those are looked at now (names of this directory's shards only).
        for late in (shards or set()) - set(verdicts):
            if _belongs(late) and os.path.basename(late) == late:
                verdicts[late] = _written_by_fastckpt(os.path.join(directory, late))
        existing = {n for n in shards or () if verdicts.get(n) is not None}
        if not existing or not all(verdicts[n] for n in existing):
            foreign.insert(0, INDEX_NAME)  # unreadable, or naming no shard of ours
    return foreign


def refuse_foreign_files(directory: str) -> None:
    """Raises ``FileExistsError`` naming the files that a save into ``directory`` would
    replace or remove and that fastckpt did not write (see :func:`foreign_files`): fastckpt
    never deletes another tool's files.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> with open(os.path.join(d, INDEX_NAME), "w") as f:
        ...     _ = f.write('{"weight_map": {}}')
        >>> refuse_foreign_files(d)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileExistsError: [Errno 17] ... holds a checkpoint that fastckpt did not write ...
    """
    foreign = foreign_files(directory)
    if not foreign:
        return
    listed = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
    raise FileExistsError(
        errno.EEXIST,
        f"{directory} holds a checkpoint that fastckpt did not write ({listed}), which a save "
        "into the directory would replace: save to a file in it (such as "
        f"{os.path.join(directory, 'adapter.safetensors')}) or to another directory, or "
        "remove those files first",
        os.path.join(directory, foreign[0]),
    )


def _referenced_by(index: bytes | None, weights_exists: bool) -> set[str]:
    """The files the published set names: the index and its shards, else the weights file."""
    if index is None:
        return {WEIGHTS_NAME} if weights_exists else set()
    try:
        weight_map = json.loads(index).get("weight_map")
        shards = {v for v in weight_map.values() if isinstance(v, str)}
    except (ValueError, AttributeError, TypeError):
        shards = set()  # a damaged index: nothing of it is kept but itself
    return {INDEX_NAME} | shards


def _published_local(directory: str) -> set[str]:
    try:
        with open(os.path.join(directory, INDEX_NAME), "rb") as f:
            index = f.read()
    except FileNotFoundError:
        index = None
    return _referenced_by(index, os.path.isfile(os.path.join(directory, WEIGHTS_NAME)))


def _published_remote(directory: str, storage_options: Mapping[str, Any] | None) -> set[str]:
    fs, inner = remote.url_to_fs(directory, storage_options)
    index_path = inner.rstrip("/") + "/" + INDEX_NAME
    index = fs.cat_file(index_path) if fs.isfile(index_path) else None
    return _referenced_by(index, fs.isfile(inner.rstrip("/") + "/" + WEIGHTS_NAME))
