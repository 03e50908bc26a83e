"""Sharded checkpoints in the Hugging Face convention: shards plus ``model.safetensors.index.json``.

``fastckpt.save(state_dict, directory, max_shard_size="5GB")`` writes::

    directory/model-00001-of-00003.safetensors
    directory/model-00002-of-00003.safetensors
    directory/model-00003-of-00003.safetensors
    directory/model.safetensors.index.json   {"metadata": {"total_size": ...}, "weight_map": {...}}

as ``transformers``' ``save_pretrained`` and ``huggingface_hub``'s ``save_torch_state_dict``
do, so each reads what the other writes. A state dict that fits in one shard is written as
``directory/model.safetensors`` alone, as they do too. Sizes are decimal (``"5GB"`` is
5 * 10**9 bytes, as ``huggingface_hub`` counts); ``"5GiB"`` means 5 * 2**30.

Sharding: tensors are taken in the state dict's order and a new shard starts when the next
one would overflow the limit; a tensor larger than the limit gets a shard of its own;
tensors sharing storage (tied weights) go to one shard, where the file stores them under each
name (so safetensors readers see every key; each copy counts toward the shard's size) and
fastckpt reads them once, tied again.

Each shard is a fastckpt file (aligned for direct I/O, with checksums), written in parallel
under a temporary name; once every shard is durable the set is published in one atomic step
(:mod:`fastckpt.io.commit_set`): the index, written last, or the rename of a lone
``model.safetensors``. A reader finds the old set or the new one, never a mix, and a failed
save leaves the old set unchanged. Into a directory that holds no checkpoint the shards get
Hugging Face's names; over an existing one they get names its index does not reference
(``model-00001-of-00003-<8 hex>.safetensors``; every reader follows the index). Files of
the earlier set are removed after the publish step.

``fastckpt.load(directory)`` (or the index file's path) returns one flat dict of the tensors
the index names, each read from the shard the index names, shards in parallel;
``fastckpt.open(directory)`` gives a :class:`ShardedReader`, the one
:class:`~fastckpt.Reader` type over a reader per shard, reading tensors lazily. Both take the
directories that ``transformers`` and ``huggingface_hub`` write. The directory may be a URL
(see :mod:`fastckpt.integrations.remote`).

Example:
    >>> import tempfile, torch, fastckpt
    >>> directory = tempfile.mkdtemp()
    >>> state = {f"layer{i}.weight": torch.full((256,), float(i)) for i in range(4)}
    >>> fastckpt.save(state, directory, max_shard_size="2KB")
    >>> sorted(os.listdir(directory))[:2]
    ['model-00001-of-00004.safetensors', 'model-00002-of-00004.safetensors']
    >>> fastckpt.load(directory)["layer3.weight"][0].item()
    3.0
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import os
import re
from collections.abc import Mapping, Sequence, Set
from typing import Any

import torch

from fastckpt import format, storage
from fastckpt.checkpoint import save as checkpoint_save
from fastckpt.checkpoint.header_view import TensorInfo
from fastckpt.checkpoint.open_readers import HeaderOnly, ReaderCache
from fastckpt.checkpoint.range_read import TensorSlice
from fastckpt.checkpoint.read import open_checkpoint
from fastckpt.checkpoint.reader import Reader, RoutedReads
from fastckpt.errors import HeaderError
from fastckpt.integrations import remote
from fastckpt.io import commit_set
from fastckpt.io.commit import AtomicFile
from fastckpt.storage.directory_kinds import directory_kind

__all__ = [
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "foreign_files",
    "refuse_foreign_files",
    "retire_sharded_set",
    "ShardedReader",
    "is_sharded",
    "load_sharded",
    "open_sharded",
    "parse_shard_size",
    "plan_shards",
    "save_sharded",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: Shard names a sharded save writes: Hugging Face's, and those with a set's random tag.
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}(-[0-9a-f]{8})?\.safetensors")
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
#: Shards written or read at the same time.
DEFAULT_PARALLEL = 4


def parse_shard_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or ``"5GB"`` (decimal, as huggingface_hub) / ``"5GiB"``.

    Example:
        >>> parse_shard_size("5GB"), parse_shard_size("1.5MiB"), parse_shard_size(100)
        (5000000000, 1572864, 100)
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"max_shard_size must be an int or a str like '5GB', got {size!r}")
    if isinstance(size, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"max_shard_size {size!r} is not a size (examples: '5GB', '500MB', '2GiB')"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size}")
    return size


# --------------------------------------------------------------------------- paths


def _local(path: Any) -> str | None:
    """The local path of ``path`` (str, PathLike or ``file://`` URL), or None for a URL."""
    return storage.to_local(path)


def is_sharded(path: Any) -> bool:
    """Whether ``path`` names a sharded checkpoint: a local directory or an ``*.index.json``.

    A URL counts when it ends with ``.index.json`` or ``/`` (object stores have no cheap
    directory test; :mod:`~fastckpt.integrations.remote` also hands over URLs it finds to
    be directories).

    Example:
        >>> import tempfile
        >>> is_sharded(tempfile.mkdtemp()), is_sharded("s3://b/run/model.safetensors.index.json")
        (True, True)
    """
    if not isinstance(path, (str, os.PathLike)):
        return False
    text = os.fspath(path)
    if text.endswith(".index.json"):
        return True
    local = _local(text)
    if local is None:
        return text.endswith("/")
    return os.path.isdir(local)


# --------------------------------------------------------------------------- save


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    # Tensors sharing storage (tied weights, views of one buffer) must land in one shard.
    if t.device.type == "meta":
        return ("tensor", id(t))
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _tied_groups(state_dict: Mapping[str, torch.Tensor]) -> list[tuple[list[str], int]]:
    """The state dict's names grouped by the storage they share, in order of first
    appearance, each group with the bytes its shard will hold: a shard stores a tied tensor
    once per name (safetensors readers see every key), so every name counts.

    Example:
        >>> w = torch.zeros(100)  # 400 bytes
        >>> _tied_groups({"a": w, "b": torch.zeros(10), "tied": w})
        [(['a', 'tied'], 800), (['b'], 40)]
    """
    groups: dict[tuple[Any, ...], tuple[list[str], list[int]]] = {}
    for name, t in state_dict.items():
        names, size = groups.setdefault(_storage_key(t), ([], [0]))
        names.append(name)
        size[0] += t.numel() * t.element_size()
    return [(names, size[0]) for names, size in groups.values()]


def plan_shards(
    state_dict: Mapping[str, torch.Tensor], max_shard_size: int | str
) -> list[list[str]]:
    """Names per shard, in the state dict's order (see the module docstring for the rules).
    Tensors sharing storage go to one shard, and each of their names counts toward its size
    (the shard stores a copy per name).

    Example:
        >>> import torch
        >>> w = torch.zeros(100)  # 400 bytes
        >>> plan_shards({"a": w, "b": torch.zeros(100), "tied": w, "big": torch.zeros(300)}, 800)
        [['a', 'tied'], ['big'], ['b']]
    """
    limit = parse_shard_size(max_shard_size)
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for names, size in _tied_groups(state_dict):
        if size > limit:
            shards.append(names)
            continue
        if current and current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current += names
        current_size += size
    if current:
        shards.append(current)
    return shards


def _check_state_dict(state_dict: Any) -> None:
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"a sharded save takes a flat str -> Tensor dict (a state_dict), "
            f"got {type(state_dict).__name__}"
        )
    for name, t in state_dict.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(
                f"a sharded save takes a flat str -> Tensor dict; entry {name!r} holds "
                f"{type(t).__name__}"
            )
        if type(t) is not torch.Tensor and type(t.detach()) is not torch.Tensor:
            # DTensor and other wrapper subclasses have no local storage to shard by
            raise TypeError(
                f"entry {name!r} is a {type(t).__name__}, a tensor subclass that a sharded "
                "save cannot store: pass plain tensors (for a DTensor, .full_tensor() on "
                "every rank), or save the distributed state dict through fastckpt.dcp"
            )


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _final_names(count: int, referenced: Set[str]) -> list[str]:
    """The shards' names: Hugging Face's own into a directory with no published set; else
    names the published set does not reference (``model-00001-of-00003-<8 hex>.safetensors``),
    so no file a reader may be following is written (see :mod:`fastckpt.io.commit_set`).
    One shard is ``model.safetensors`` (its rename publishes it), unless the published index
    names that file: then it gets a fresh name and an index."""
    if count == 1 and not (INDEX_NAME in referenced and WEIGHTS_NAME in referenced):
        return [WEIGHTS_NAME]
    names = [f"model-{i:05d}-of-{count:05d}" for i in range(1, count + 1)]
    if not referenced:
        return [name + ".safetensors" for name in names]
    return [commit_set.fresh_name(name, ".safetensors", referenced) for name in names]


def retire_sharded_set(directory: str) -> list[str]:
    """After a save of one ``model.safetensors`` into ``directory``: removes the sharded set
    an earlier save left there, the index first (readers then take the new file at once),
    then its shards and abandoned temporaries, under the directory's publish lock.
    Returns the names removed.

    Example:
        >>> import tempfile, torch
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


def _belongs(name: str) -> bool:
    """Whether a file of a sharded directory is one that a sharded save writes."""
    return name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_PATTERN.fullmatch(name) is not None


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


def _index_bytes(
    shards: list[dict[str, torch.Tensor]], names: list[str], metadata: Mapping[str, str] | None
) -> bytes:
    """The index: every name (a tied tensor's too: its shard stores a copy under each name)
    and the bytes the shards hold."""
    total = sum(t.numel() * t.element_size() for tensors in shards for t in tensors.values())
    index = {
        "metadata": {**dict(metadata or {}), "total_size": total},
        "weight_map": {n: names[i] for i, tensors in enumerate(shards) for n in tensors},
    }
    return (json.dumps(index, indent=2, sort_keys=False) + "\n").encode()


def _save_one(state: dict[str, torch.Tensor], out: AtomicFile, options: dict[str, Any]) -> None:
    """Writes one shard into a staged file (committed with the others by the commit set)."""
    local = {k: v for k, v in options.items() if k not in ("storage_options", "overwrite_readonly")}
    checkpoint_save.save_into(state, out, **local)


def _save_local(
    shards: list[dict[str, torch.Tensor]],
    directory: str,
    options: dict[str, Any],
    parallel: int,
) -> None:
    with commit_set.CommitSet(
        directory, overwrite_readonly=bool(options.get("overwrite_readonly"))
    ) as files:
        hints = _shard_names(len(shards))

        def write(i: int) -> None:
            # Staged, written and closed one at a time per worker: the set holds a bounded
            # number of descriptors whatever the number of shards.
            out = files.stage(hints[i], position=i)
            _save_one(shards[i], out, options)
            out.make_durable()

        with concurrent.futures.ThreadPoolExecutor(min(parallel, len(shards))) as pool:
            for f in [pool.submit(write, i) for i in range(len(shards))]:
                f.result()  # the first failure is raised; the commit set removes every file

        def publish(names: list[str]) -> None:
            index = os.path.join(directory, INDEX_NAME)
            if names == [WEIGHTS_NAME]:  # renamed in place; an index would still win: remove it
                if os.path.exists(index):
                    os.unlink(index)
                    commit_set.fsync_directory(directory)
                return
            data = _index_bytes(shards, names, options.get("metadata"))
            # read-only files of the old set were refused (or allowed) by the commit set
            commit_set.write_atomically(index, data, overwrite_readonly=True)

        files.publish(
            lambda referenced: _final_names(len(shards), referenced),
            publish,
            lambda: _published_local(directory),
            _belongs,
        )


def _save_remote(
    shards: list[dict[str, torch.Tensor]],
    directory: str,
    options: dict[str, Any],
    parallel: int,
) -> None:
    """The same protocol on an object store: new objects under names the published index
    does not reference, the index PUT (or the old index's deletion) publishes, then the old
    objects are deleted. Not serialized between writers (see :mod:`fastckpt.io.commit_set`)."""
    storage_options = options.get("storage_options")
    referenced = _published_remote(directory, storage_options)
    names = _final_names(len(shards), referenced)
    url_options = {k: v for k, v in options.items() if k != "overwrite_readonly"}
    fs, inner = remote.url_to_fs(directory, storage_options)

    def path_of(name: str) -> str:
        return inner.rstrip("/") + "/" + name

    def write(i: int) -> None:
        remote.save(shards[i], remote.join(directory, names[i]), **url_options)

    try:
        with concurrent.futures.ThreadPoolExecutor(min(parallel, len(shards))) as pool:
            for f in [pool.submit(write, i) for i in range(len(shards))]:
                f.result()
        if names == [WEIGHTS_NAME]:
            if INDEX_NAME in referenced:
                fs.rm_file(path_of(INDEX_NAME))
        else:
            data = _index_bytes(shards, names, options.get("metadata"))
            remote.write_bytes(remote.join(directory, INDEX_NAME), data, storage_options)
    except BaseException:
        for name in set(names) - referenced:  # ours, never published
            with contextlib.suppress(OSError):
                fs.rm_file(path_of(name))
        raise
    keep = set(names) | ({INDEX_NAME} if names != [WEIGHTS_NAME] else set())
    for name in referenced - keep:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path_of(name))


def save_sharded(
    state_dict: Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    **save_options: Any,
) -> None:
    """Writes ``state_dict`` as Hugging Face shards plus index into ``directory``.

    The directory goes from the old set of shards to the new one in one atomic step (the
    index, written last, or the rename of ``model.safetensors``), by the protocol of
    :mod:`fastckpt.io.commit_set`: a reader loads the old set or the new one, never a mix;
    a failed save leaves the old set as it was. Concurrent saves into one directory take
    turns at that step: each returns success and the later one's set is what remains.

    Args:
        state_dict: a flat ``str -> Tensor`` dict.
        directory: a local directory (created if missing) or a URL.
        max_shard_size: bytes per shard, an int or ``"5GB"``/``"500MB"``/``"2GiB"``.
        metadata: str -> str stored in every shard's header and in the index's ``metadata``.
        storage_options: for a URL, passed to the fsspec file system.
        parallel: shards written at the same time.
        save_options: as :func:`fastckpt.save` (``checksum``, ``engine``,
            ``overwrite_readonly``, ...).

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> save_sharded({"a": torch.zeros(1000), "b": torch.ones(1000)}, d, max_shard_size="4KB")
        >>> with open(os.path.join(d, INDEX_NAME)) as f:
        ...     json.load(f)["weight_map"]
        {'a': 'model-00001-of-00002.safetensors', 'b': 'model-00002-of-00002.safetensors'}
    """
    _check_state_dict(state_dict)
    if parallel < 1:
        raise ValueError(f"parallel must be positive, got {parallel}")
    directory = os.fspath(directory)
    for name in ("base", "frozen"):
        if save_options.get(name) is not None:
            raise TypeError(
                f"{name}= is not supported for a sharded save (to {directory}): incremental "
                "checkpoints are single files"
            )
    local = _local(directory)
    if local is not None:
        os.makedirs(local, exist_ok=True)
        refuse_foreign_files(local)
        directory = local
    groups = plan_shards(state_dict, max_shard_size) or [[]]
    options = dict(save_options, metadata=metadata, storage_options=storage_options)
    shards = [{n: state_dict[n] for n in group} for group in groups]
    if local is not None:
        _save_local(shards, local, options, parallel)
    else:
        _save_remote(shards, directory, options, parallel)


# --------------------------------------------------------------------------- load


def _resolve(
    path: str, storage_options: Mapping[str, Any] | None
) -> tuple[str, str | None, str | None]:
    """``(directory, index path or None, single weights file or None)`` for a directory or index."""
    if path.endswith(".index.json"):
        directory = path.rsplit("/", 1)[0] if storage.is_url(path) else os.path.dirname(path)
        return directory, path, None
    directory = path.rstrip("/") if storage.is_url(path) else path
    index = storage.join(directory, INDEX_NAME)
    if storage.exists(index, storage_options):
        return directory, index, None
    single = storage.join(directory, WEIGHTS_NAME)
    if storage.exists(single, storage_options):
        return directory, None, single
    raise FileNotFoundError(errno.ENOENT, _not_hugging_face(path), path)


def _not_hugging_face(path: str) -> str:
    """Why the directory ``path`` is not read as a Hugging Face one: what it is and what reads
    it (a DCP checkpoint, a series or one of its steps), or what it lacks."""
    kind = directory_kind(path)
    missing = f"no {INDEX_NAME} or {WEIGHTS_NAME}"
    if kind is None:
        return f"{path}: {missing} in this directory"
    return f"{path}: {kind.what}, not a Hugging Face directory ({missing}); read it with {kind.read_with}"


def _read_index_document(
    index: str, storage_options: Mapping[str, Any] | None
) -> tuple[dict[str, str], dict[str, str]]:
    """``(weight map, metadata)`` of an index file, checked: a JSON object whose
    ``weight_map`` maps names to plain file names and whose ``metadata`` is an object.

    Raises:
        HeaderError: the index is malformed (the message names it and says how).
    """
    data = storage.read_whole(index, storage_options)
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise HeaderError(f"{index}: not a JSON index: {exc}") from None
    if not isinstance(document, dict):
        raise HeaderError(f"{index}: not a JSON object")
    weight_map = document.get("weight_map")
    if not isinstance(weight_map, dict):
        raise HeaderError(f"{index}: no 'weight_map' object")
    for name, shard in weight_map.items():
        if (
            not isinstance(shard, str)
            or not shard
            or "/" in shard
            or "\\" in shard
            or shard in (".", "..")
        ):
            raise HeaderError(f"{index}: tensor {name!r} maps to {shard!r}, not a file name")
    meta = document.get("metadata")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise HeaderError(f"{index}: 'metadata' is not an object")
    return weight_map, {str(k): str(v) for k, v in meta.items()}


def _read_index(index: str, storage_options: Mapping[str, Any] | None) -> dict[str, str]:
    """The weight map of an index file, checked: shard names must be plain file names."""
    return _read_index_document(index, storage_options)[0]


def _index_metadata(index: str | None, storage_options: Mapping[str, Any] | None) -> dict:
    return {} if index is None else _read_index_document(index, storage_options)[1]


def load_sharded(
    path: str | os.PathLike[str],
    map_location: Any = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    **load_options: Any,
) -> dict[str, torch.Tensor]:
    """Loads a sharded directory (or its index file) into one flat dict, shards in parallel:
    the tensors the index names, each from the shard it names (what ``fastckpt.load`` does).

    Args:
        path: the directory, or the path of its ``*.safetensors.index.json``; local or a URL.
        storage_options: for a URL, passed to the fsspec file system.
        parallel: shards read at the same time (and, for a URL, ranges per shard).
        load_options: as :func:`fastckpt.load` (``keys``, ``device``, ``verify``, ...).

    Raises:
        FileNotFoundError: no index or weights file in the directory, or a missing shard.
        HeaderError: a malformed index, or a shard that lacks a tensor its index names.
        KeyError: a name in ``keys`` is not in the index.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> save_sharded({"a": torch.zeros(1000), "b": torch.ones(1000)}, d, max_shard_size="4KB")
        >>> load_sharded(d, keys=["b"])["b"].sum().item()
        1000.0
    """
    from fastckpt.checkpoint.load import check_target, load

    open_options = {k: load_options.pop(k) for k in _OPEN_OPTIONS if k in load_options}
    target = check_target(
        map_location,
        load_options.get("device"),
        keys=load_options.get("keys"),
        mmap=load_options.get("mmap", False),
        pin_memory=load_options.get("pin_memory", False),
    )
    on_cuda = isinstance(target, torch.device) and target.type == "cuda"
    with ShardedReader(
        path,
        storage_options=storage_options,
        parallel=parallel,
        only=load_options.get("keys"),
        device=target if on_cuda else "cpu",
        **open_options,
    ) as reader:
        result = load(reader, map_location, **load_options)
    if not isinstance(result, dict):
        raise HeaderError(f"{path}: a sharded checkpoint holds a flat dict of tensors")
    return result


#: How often a sharded reader opens a set again when a newer save removed a shard of the
#: set it was opening (see :class:`ShardedReader`).
_REPUBLISHED_RETRIES = 2

#: Options of ``fastckpt.load`` that say how shards are opened (the rest, how they are read).
_OPEN_OPTIONS = (
    "gds",
    "direct_io",
    "engine",
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "part_size",
)


class ShardedReader(RoutedReads, Reader):
    """A sharded checkpoint opened for lazy reading: what ``fastckpt.open(directory)`` returns.

    A reader over one :class:`~fastckpt.checkpoint.read.CheckpointReader` per shard: opening
    reads the index and each shard's header; the tensors are those the index names (plus the
    tied names a shard records for them), each read from the shard the index names; a tensor
    a shard holds but the index does not name (left by an earlier save) is not seen.
    ``only`` opens just the shards that hold these indexed names (what ``load(keys=...)`` reads).

    Whatever the number of shards, at most ``open_files`` of them are open at once (default
    64, ``FASTCKPT_OPEN_FILES``; see :mod:`fastckpt.checkpoint.open_readers`): the headers
    are kept in memory, and a shard is opened again when a read needs it, closing the least
    recently used. A prefetch of more shards than that is read again by the shards closed
    since. A shard replaced or removed since the directory was opened raises
    ``FileNotFoundError`` naming it.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> save_sharded({"a": torch.zeros(1000), "b": torch.ones(1000)}, d, max_shard_size="4KB")
        >>> with open_sharded(d) as r:
        ...     sorted(r.keys()), r.get_tensor("b")[:2].tolist()
        (['a', 'b'], [1.0, 1.0])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        parallel: int = DEFAULT_PARALLEL,
        only: Sequence[str] | None = None,
        open_files: int | None = None,
        **open_options: Any,
    ):
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel must be a positive int, got {parallel!r}")
        text = storage.to_local(path) or os.fspath(path)
        self.path = text
        self._parallel = parallel

        def opener(shard: str) -> Any:
            return open_checkpoint(
                shard, storage_options=storage_options, parallel=parallel, **open_options
            )

        self._open_files = open_files
        self._opener = opener
        self._cache = ReaderCache(opener, open_files)
        self._readers: dict[str, HeaderOnly] = {}  # shard path -> its header
        self._closed = False
        self._owner: dict[str, HeaderOnly] = {}  # stored name -> its shard's header
        self._aliases: dict[str, str] = {}
        # A save that publishes a new set removes the old set's shards once its index is in
        # place: a shard named by the index just read can vanish before it is opened. The
        # new index then names shards that exist, so the set is opened again from it.
        for attempt in range(_REPUBLISHED_RETRIES + 1):
            try:
                self._open_set(text, storage_options, parallel, only, open_options)
                return
            except FileNotFoundError:
                self._readers, self._owner, self._aliases = {}, {}, {}
                self._cache = ReaderCache(self._opener, self._open_files)
                if attempt == _REPUBLISHED_RETRIES:
                    self._closed = True
                    raise

    def _open_set(
        self,
        text: str,
        storage_options: Mapping[str, Any] | None,
        parallel: int,
        only: Sequence[str] | None,
        open_options: dict[str, Any],
    ) -> None:
        """Reads the index and opens every shard it names (those ``only`` needs)."""
        directory, index, single = _resolve(text, storage_options)
        if index is not None:
            weight_map, self._metadata = _read_index_document(index, storage_options)
        else:
            weight_map, self._metadata = {}, {}
        if only is not None and index is not None:  # open only the shards these names need
            for name in only:
                if name not in weight_map:
                    raise KeyError(f"no tensor named {name!r} in {index}")
            weight_map = {n: weight_map[n] for n in weight_map if n in set(only)}
        files = [single] if single else [storage.join(directory, n) for n in weight_map.values()]
        try:
            for shard in dict.fromkeys(files):
                opened = self._opener(shard)
                self._readers[shard] = HeaderOnly(opened, shard)
                self._cache.adopt(shard, opened)  # kept open while few are
            if single is not None:
                reader = self._readers[single]
                self._aliases = reader.aliases
                self._owner = {n: reader for n in reader.header.entries if n not in self._aliases}
                self._structure = reader.structure
                return
            self._structure = None
            for name, file_name in weight_map.items():
                reader = self._readers[storage.join(directory, file_name)]
                if reader.aliases.get(name) in reader.header.entries:  # tied: read once
                    self._aliases[name] = reader.aliases[name]
                    self._owner.setdefault(reader.aliases[name], reader)
                elif name in reader.header.entries:
                    self._owner[name] = reader
                else:
                    raise HeaderError(
                        f"{reader.path}: lacks tensor {name!r} that {index} maps to it"
                    )
            for reader in self._readers.values():  # tied names a shard records (not indexed)
                for alias, stored in reader.aliases.items():
                    if self._owner.get(stored) is reader and alias not in weight_map:
                        self._aliases[alias] = stored
        except BaseException:
            self._cache.close()
            raise

    # -- what the index and headers say ----------------------------------------------------
    def keys(self) -> list[str]:
        """Every tensor name the index gives (in its order), then tied names."""
        self._live()
        return list(self._owner) + [a for a in self._aliases if a not in self._owner]

    def metadata(self) -> dict[str, str] | None:
        """The index's ``metadata`` (``total_size`` and any saved metadata), as strings; for a
        directory of one ``model.safetensors``, that file's metadata."""
        self._live()
        if self._metadata or len(self._readers) != 1:
            return dict(self._metadata)
        return next(iter(self._readers.values())).metadata()

    def _route(self, name: str) -> tuple[Reader, str]:
        raise NotImplementedError  # every routed read is overridden: each leases its shard

    def _reader_of(self, name: str) -> tuple[HeaderOnly, str]:
        self._live()  # a closed reader answers nothing, headers kept or not
        if not isinstance(name, str):
            raise TypeError(f"tensor names are str, got {type(name).__name__}")
        stored = self._aliases.get(name, name)
        reader = self._owner.get(stored)
        if reader is None:
            raise KeyError(f"no tensor named {name!r} in {self.path}")
        return reader, stored

    def info(self, name: str) -> TensorInfo:
        reader, stored = self._reader_of(name)
        return reader.info(stored)

    @property
    def has_checksums(self) -> bool:
        return bool(self._readers) and all(r.has_checksums for r in self._readers.values())

    @property
    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    @property
    def structure(self) -> Any:
        return self._structure

    @property
    def read_mode(self) -> str:
        modes = {self._cache.call(h.key, lambda r: r.read_mode) for h in self._live()}
        return modes.pop() if len(modes) == 1 else "mixed"

    @property
    def bytes_read(self) -> int:
        return self._cache.bytes_read

    @property
    def open_count(self) -> int:
        """How many shard files are open now (at most ``open_files`` between reads)."""
        return self._cache.open_count

    def shard_headers(self) -> list[HeaderOnly]:
        """The header of each shard file (its ``path``), in the index's order: what ranks
        compare before they share a read of the directory."""
        return self._live()

    def _live(self) -> list[HeaderOnly]:
        if self._closed:
            raise ValueError(f"{self.path}: the reader is closed")
        return list(self._readers.values())

    # -- reading ---------------------------------------------------------------------------
    def get_slice(self, name: str, *, verify: bool = False) -> TensorSlice:
        header, stored = self._reader_of(name)
        sliced = self._cache.call(header.key, lambda r: r.get_slice(stored, verify=verify))

        def read(lo: int, hi: int) -> torch.Tensor:  # the shard may be closed by then
            return self._cache.call(
                header.key, lambda r: r.get_slice(stored, verify=verify)._read(lo, hi)
            )

        sliced._read = read
        return sliced

    def read_range(
        self,
        name: str,
        start: int,
        stop: int,
        *,
        out: torch.Tensor | None = None,
        verify: bool = False,
    ) -> torch.Tensor:
        header, stored = self._reader_of(name)
        return self._cache.call(
            header.key, lambda r: r.read_range(stored, start, stop, out=out, verify=verify)
        )

    def _by_shard(self, names: Sequence[str] | None) -> dict[HeaderOnly, list[str]]:
        self._live()
        if isinstance(names, str):
            raise TypeError("names must be a sequence of str, not a str")
        groups: dict[HeaderOnly, list[str]] = {}
        for name in list(self._owner) if names is None else names:
            reader, stored = self._reader_of(name)
            groups.setdefault(reader, []).append(stored)
        return groups

    def _each_shard(self, work: Any, groups: dict[HeaderOnly, list[str]]) -> list[Any]:
        """``work(reader, names)`` per shard on its open reader, ``parallel`` shards at once;
        results in order."""

        def on_shard(header: HeaderOnly, names: list[str]) -> Any:
            return self._cache.call(header.key, lambda reader: work(reader, names))

        if len(groups) <= 1:
            return [on_shard(header, names) for header, names in groups.items()]
        with concurrent.futures.ThreadPoolExecutor(min(self._parallel, len(groups))) as pool:
            futures = [pool.submit(on_shard, header, names) for header, names in groups.items()]
            return [f.result() for f in futures]

    def read(
        self,
        names: Sequence[str] | None = None,
        *,
        pin_memory: bool = False,
        verify: bool = False,
        progress: bool | None = None,
    ) -> dict[str, torch.Tensor]:
        self.require_checksums(verify)
        groups = self._by_shard(names)

        def work(reader: Any, stored: list[str]) -> dict[str, torch.Tensor]:
            return reader.read(stored, pin_memory=pin_memory, verify=verify, progress=False)

        merged = {k: v for part in self._each_shard(work, groups) for k, v in part.items()}
        wanted = list(self._owner) if names is None else [self._reader_of(n)[1] for n in names]
        return {n: merged[n] for n in wanted}

    def prefetch(
        self, names: Sequence[str], *, pin_memory: bool = False, verify: bool = False
    ) -> None:
        self.require_checksums(verify)
        for header, stored in self._by_shard(names).items():

            def start(reader: Any, stored: list[str] = stored) -> None:
                reader.prefetch(stored, pin_memory=pin_memory, verify=verify)

            self._cache.call(header.key, start)

    def verify(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> list[str]:
        self._live()
        self.require_checksums()
        groups = self._by_shard(names)
        found = self._each_shard(lambda reader, stored: reader.verify(stored), groups)
        return [name for part in found for name in part]

    def map(
        self, names: Sequence[str] | None = None, *, verify: bool = False
    ) -> dict[str, torch.Tensor]:
        self.require_checksums(verify)
        merged: dict[str, torch.Tensor] = {}
        for header, stored in self._by_shard(names).items():

            def mapped(reader: Any, stored: list[str] = stored) -> dict[str, torch.Tensor]:
                return reader.map(stored, verify=verify)

            merged.update(self._cache.call(header.key, mapped))
        return merged

    def close(self) -> None:
        """Closes every shard (each first waits for its reads in flight)."""
        self._closed = True
        self._cache.close()

    def __enter__(self) -> ShardedReader:
        return self


def open_sharded(path: str | os.PathLike[str], **options: Any) -> ShardedReader:
    """Opens a sharded directory (or index) for lazy reading (see :class:`ShardedReader`)."""
    return ShardedReader(path, **options)
