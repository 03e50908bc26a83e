"""The public checkpoint functions, whatever storage the checkpoint lives on.

``fastckpt.save``, ``load``, ``open`` and ``async_save`` take local paths, ``file://`` URLs,
fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...) and Hugging Face sharded directories
alike. A single file, local or at a URL, is read by :mod:`fastckpt.checkpoint` over the
storage layer (:mod:`fastckpt.storage`; local files never go through fsspec); a sharded
directory by a reader over its shards (:mod:`fastckpt.integrations.hf_shards`). URLs are
written by :mod:`fastckpt.integrations.remote`. Each function has the signature and
documentation of its local counterpart plus ``storage_options`` (and ``max_shard_size`` for
``save``).

Example:
    >>> import torch, fastckpt
    >>> fastckpt.save({"w": torch.ones(2)}, "memory://fastckpt-doc/w.safetensors")
    >>> fastckpt.load("memory://fastckpt-doc/w.safetensors")["w"].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable

from fastckpt import storage
from fastckpt.checkpoint import asynchronous, read
from fastckpt.checkpoint import load as local_load
from fastckpt.checkpoint import save as local_save
from fastckpt.checkpoint.reader import Reader
from fastckpt.integrations import hf_shards, remote

__all__ = ["save", "load", "open", "async_save", "Reader"]

_STORAGE_OPTIONS = """storage_options: for a URL, passed to its fsspec file system (default: the
            JSON object in ``FASTCKPT_STORAGE_OPTIONS``). ``f`` may also be an fsspec URL
            (any protocol) or a Hugging Face sharded directory / its ``*.index.json``."""
_MAX_SHARD_SIZE = """max_shard_size: write Hugging Face shards plus ``model.safetensors.index.json``
            into the directory ``f``, each at most this size (``"5GB"`` is 5 * 10**9 bytes,
            ``"5GiB"`` 5 * 2**30, or an int); the index is written last."""
_SHARDS = """``f`` may also be a Hugging Face sharded directory or its ``*.index.json`` (the
            tensors its index names, each from the shard it names; ``parallel`` shards at once)."""

# Options of the native engine, which a save to a URL has no use for.
_NATIVE_ONLY = (
    "progress",
    "staging_bytes",
    "engine",
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "pin_memory",
    "gds",
    "max_pending",
)


def _for_url(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options that apply to a save to a URL (the native engine's settings do not)."""
    return {k: v for k, v in options.items() if k not in _NATIVE_ONLY}


def _local(f: Any) -> Any:
    """A ``file://`` URL as its path; anything else unchanged (checked by the callee)."""
    return storage.to_local(f) if storage.handles(f) and not storage.is_url(f) else f


def _routed(
    local: Callable[..., Any], extra: dict[str, str]
) -> Callable[[Callable[..., Any]], Any]:
    """Gives the public function ``local``'s signature and docstring, plus ``extra``
    keyword-only parameters (name -> documentation; ``"shards"`` adds documentation only)."""

    def decorate(route: Callable[..., Any]) -> Callable[..., Any]:
        returns = inspect.signature(route).return_annotation  # open() gives a Reader
        functools.update_wrapper(route, local)
        # the signature below is the true one (set in the function's namespace, where
        # update_wrapper put __wrapped__: a Callable declares neither attribute)
        del vars(route)["__wrapped__"]
        signature = inspect.signature(local)
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
            for name in extra
            if name not in signature.parameters and name != "shards"
        ]
        params = list(signature.parameters.values())
        tail = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
        head = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
        vars(route)["__signature__"] = signature.replace(
            parameters=head + added + tail,
            return_annotation=returns
            if returns is not inspect.Signature.empty
            else signature.return_annotation,
        )
        doc = local.__doc__ or ""
        at = doc.find("\n    Returns:")
        at = doc.find("\n    Raises:") if at < 0 else at
        at = doc.find("\n    Example") if at < 0 else at
        lines = "".join(f"        {text}\n" for text in extra.values())
        if at >= 0:
            route.__doc__ = doc[:at].rstrip() + "\n" + lines.rstrip("\n") + "\n" + doc[at:]
        return route

    return decorate


@_routed(local_save.save, {"storage_options": _STORAGE_OPTIONS, "max_shard_size": _MAX_SHARD_SIZE})
def save(
    obj: Any, f: Any, *, storage_options: Any = None, max_shard_size: Any = None, **options: Any
) -> None:
    if max_shard_size is not None:
        return hf_shards.save_sharded(
            obj,
            _local(f),
            max_shard_size=max_shard_size,
            storage_options=storage_options,
            **(_for_url(options) if storage.is_url(f) else options),
        )
    if storage.is_url(f):
        return remote.save(obj, f, storage_options=storage_options, **_for_url(options))
    return local_save.save(obj, _local(f), **options)


@_routed(local_load.load, {"shards": _SHARDS})
def load(f: Any, map_location: Any = None, **options: Any) -> Any:
    if hf_shards.is_sharded(f):
        return hf_shards.load_sharded(f, map_location, **options)
    try:
        return local_load.load(f, map_location, **options)
    except IsADirectoryError:
        if not storage.is_url(f):
            raise
        # a URL of a directory of shards, without the index's name in it
        return hf_shards.load_sharded(f, map_location, **options)


@_routed(read.open_checkpoint, {"shards": _SHARDS})
def open(f: Any, **options: Any) -> Reader:  # noqa: A001
    if hf_shards.is_sharded(f):
        return hf_shards.open_sharded(f, **options)
    try:
        return read.open_checkpoint(f, **options)
    except IsADirectoryError:
        if not storage.is_url(f):
            raise
        return hf_shards.open_sharded(f, **options)


@_routed(asynchronous.async_save, {"storage_options": _STORAGE_OPTIONS})
def async_save(obj: Any, f: Any, *, storage_options: Any = None, **options: Any) -> Any:
    if storage.is_url(f):
        return remote.async_save(obj, f, storage_options=storage_options, **_for_url(options))
    return asynchronous.async_save(obj, _local(f), **options)
