"""The writing of a Hugging Face sharded directory: each planned shard written as a fastckpt
file in parallel, then the set published in one atomic step (the index, written last, or the
rename of a lone ``model.safetensors``), locally or at a URL.

What goes into which shard is :mod:`~fastckpt.integrations.hf_shards_plan`'s; which files of
the directory may be replaced is :mod:`~fastckpt.integrations.hf_shards_files`'.

Example:
    >>> import os, tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> save_sharded({"a": torch.zeros(1000), "b": torch.ones(1000)}, d, max_shard_size="4KB")
    >>> sorted(os.listdir(d))[0]
    'model-00001-of-00002.safetensors'
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Mapping
from typing import Any

import torch

from fastckpt.checkpoint import save as checkpoint_save
from fastckpt.integrations import remote
from fastckpt.integrations.hf_shards_files import (
    _published_local,
    _published_remote,
    refuse_foreign_files,
)
from fastckpt.integrations.hf_shards_plan import (
    DEFAULT_PARALLEL,
    INDEX_NAME,
    WEIGHTS_NAME,
    _belongs,
    _check_state_dict,
    _final_names,
    _index_bytes,
    _local,
    _shard_names,
    plan_shards,
)
from fastckpt.io import commit_set
from fastckpt.io.commit import AtomicFile

__all__ = ["save_sharded"]


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
        >>> import json, tempfile, torch
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
