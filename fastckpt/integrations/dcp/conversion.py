"""Whole DCP checkpoints in one process: to full tensors (:func:`load_full`), to one
fastckpt file (:func:`consolidate`) and from one (:func:`to_dcp`).

Both kinds of DCP checkpoint are read: ours (FastCkptWriter) and those of DCP's own
``FileSystemWriter``. Nothing is unpickled without limits unless ``allow_pickle=True``: the
``.metadata`` goes through the restricted unpickler of
:mod:`fastckpt.integrations.dcp.metadata`, and non-tensor values (stored by DCP with
``torch.save``) are loaded with ``torch.load(weights_only=True)``.

Example:
    >>> import os, tempfile, torch
    >>> from fastckpt.checkpoint.load import load
    >>> from fastckpt.checkpoint.save import save
    >>> d = tempfile.mkdtemp()
    >>> save({"w": torch.ones(2), "step": 5}, d + "/full.safetensors")
    >>> to_dcp(d + "/full.safetensors", d + "/ckpt")
    >>> consolidate(d + "/ckpt", d + "/again.safetensors")
    >>> load(d + "/again.safetensors")["step"]
    5
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from fastckpt.checkpoint import load as local_load
from fastckpt.checkpoint import save as local_save
from fastckpt.errors import FastCkptError, UnsafePickleError
from fastckpt.integrations import remote
from fastckpt.integrations.dcp._paths import location
from fastckpt.integrations.dcp.metadata import is_ours, read_dcp_metadata
from fastckpt.integrations.dcp.reader import FastCkptReader
from fastckpt.integrations.dcp.writer import FastCkptWriter

__all__ = ["load_full", "consolidate", "to_dcp"]


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Silences DCP's warning that a ``no_dist=True`` call runs in one process (it is meant to)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield


class _ValuesPlanner(DefaultLoadPlanner):
    """DCP's load planner over a flat state dict, whose non-tensor values are unpickled with
    ``torch.load(weights_only=True)`` (DCP's own planner unpickles them without limits)
    unless ``allow_pickle``."""

    def __init__(self, path: str, allow_pickle: bool):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.path = path
        self.allow_pickle = allow_pickle

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as exc:
            if self.allow_pickle:
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UnsafePickleError(
                f"{self.path}: value {key!r} is a pickle of objects other than tensors and "
                f"plain containers ({first}); unpickling it runs code from the checkpoint: if "
                "you trust it, pass allow_pickle=True (--allow-pickle on the command line)",
                filename=self.path,
            ) from None


def _restricted_filesystem_reader(path: str, allow_pickle: bool) -> StorageReader:
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read by fastckpt's restricted
    unpickler (DCP's own unpickles it without limits)."""
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            metadata = read_dcp_metadata(path, allow_pickle=allow_pickle)
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(path)


def _reader_for(
    path: str,
    metadata: Metadata,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> StorageReader:
    if not metadata.storage_data or is_ours(metadata):
        return FastCkptReader(
            path, storage_options=storage_options, allow_pickle=allow_pickle, _metadata=metadata
        )
    if remote.is_url(path):
        raise ValueError(
            f"{path} was written by DCP's FileSystemWriter; at a URL only checkpoints "
            "written by FastCkptWriter are read here"
        )
    return _restricted_filesystem_reader(path, allow_pickle)


def _unflatten(flat: dict[str, Any], mapping: dict[str, Any] | None) -> dict[str, Any]:
    """Rebuilds the nested state dict from DCP's flat keys and its ``planner_data`` paths."""
    root: dict[Any, Any] = {}
    for fqn, value in flat.items():
        path = tuple(mapping[fqn]) if mapping and fqn in mapping else (fqn,)
        node: Any = root
        for key, after in zip(path[:-1], path[1:]):
            if isinstance(node, list):
                while len(node) <= key:
                    node.append(None)
                if node[key] is None:
                    node[key] = [] if isinstance(after, int) else {}
                node = node[key]
            else:
                node = node.setdefault(key, [] if isinstance(after, int) else {})
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
        node[last] = value
    return root


def _own_error(exc: BaseException) -> FastCkptError | None:
    """The fastckpt error inside DCP's ``CheckpointException`` of a one-process load, so
    that callers see what went wrong instead of DCP's wrapper."""
    for failure in getattr(exc, "failures", {}).values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, FastCkptError):
            return error
    return None


def load_full(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """Every value of a DCP checkpoint (ours or DCP's own; at a URL, ours), as full tensors,
    in one process.

    Non-tensor values (stored by DCP with ``torch.save``) are loaded with
    ``torch.load(weights_only=True)``: plain containers, numbers, strings and tensors.

    Args:
        allow_pickle: unpickle ``.metadata`` and non-tensor values without limits (runs any
            code they hold: only for checkpoints you trust).

    Raises:
        fastckpt.errors.UnsafePickleError: ``.metadata`` or a value names an object that
            needs ``allow_pickle=True``.

    Example:
        >>> import os, tempfile, torch
        >>> import torch.distributed.checkpoint as dcp
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = dcp.save({"m": {"w": torch.ones(2)}, "n": 3}, storage_writer=FastCkptWriter(path), no_dist=True)
        >>> load_full(path)
        {'m': {'w': tensor([1., 1.])}, 'n': 3}
    """
    import torch.distributed.checkpoint as dcp

    where = location(path)
    metadata = read_dcp_metadata(where, storage_options=storage_options, allow_pickle=allow_pickle)
    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            flat[fqn] = None  # filled with the unpickled value
    try:
        with _single_process():
            dcp.load(
                flat,
                storage_reader=_reader_for(where, metadata, storage_options, allow_pickle),
                planner=_ValuesPlanner(where, allow_pickle),
                no_dist=True,
            )
    except dcp.CheckpointException as exc:
        own = _own_error(exc)
        if own is None:
            raise
        raise own from None
    return _unflatten(flat, metadata.planner_data)


def consolidate(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, allow_pickle: bool = False
) -> None:
    """Writes a DCP checkpoint directory (ours or DCP's own) as one fastckpt/safetensors file
    of full tensors; ``fastckpt.load(dst)`` returns the nested state dict.

    Args:
        allow_pickle: unpickle ``.metadata`` and non-tensor values without limits, and keep
            objects with no safe encoding (pickled into ``dst``): only for trusted sources.

    Example:
        >>> import os, tempfile, torch
        >>> import torch.distributed.checkpoint as dcp
        >>> from fastckpt.checkpoint.load import load
        >>> d = tempfile.mkdtemp()
        >>> _ = dcp.save({"w": torch.ones(2)}, storage_writer=FastCkptWriter(d + "/ckpt"), no_dist=True)
        >>> consolidate(d + "/ckpt", d + "/full.safetensors")
        >>> load(d + "/full.safetensors")["w"].tolist()
        [1.0, 1.0]
    """
    state = load_full(src, allow_pickle=allow_pickle)
    target = location(dst)
    if remote.is_url(target):
        remote.save(state, target, allow_pickle=allow_pickle)
    else:
        local_save.save(state, target, allow_pickle=allow_pickle)


def to_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Writes a fastckpt/safetensors file (a dict at the top) as a DCP checkpoint directory
    with :class:`FastCkptWriter`, for ``dcp.load`` with any number of ranks.

    Example:
        >>> import os, tempfile, torch
        >>> from fastckpt.checkpoint.save import save
        >>> d = tempfile.mkdtemp()
        >>> save({"w": torch.ones(2), "step": 5}, d + "/full.safetensors")
        >>> to_dcp(d + "/full.safetensors", d + "/ckpt")
        >>> load_full(d + "/ckpt")["step"]
        5
    """
    import torch.distributed.checkpoint as dcp

    source = location(src)
    state = remote.load(source) if remote.is_url(source) else local_load.load(source)
    if not isinstance(state, dict):
        raise TypeError(f"{src}: holds a {type(state).__name__}; a DCP checkpoint needs a dict")
    with _single_process():
        dcp.save(state, storage_writer=FastCkptWriter(dst), no_dist=True)
