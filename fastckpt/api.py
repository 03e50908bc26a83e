"""The public checkpoint functions, routed by where the checkpoint lives.

``fastckpt.save``, ``load``, ``open`` and ``async_save`` take local paths, fsspec URLs
(``s3://``, ``gs://``, ``memory://``, ...) and Hugging Face sharded directories alike. Local
files go straight to :mod:`fastckpt.checkpoint` (no fsspec in between); URLs and sharded
directories to :mod:`fastckpt.integrations.remote` and :mod:`fastckpt.integrations.hf_shards`.
Each function has the signature and documentation of its local counterpart plus
``storage_options`` (and ``max_shard_size`` for ``save``).

Example:
    >>> import torch, fastckpt
    >>> fastckpt.save({"w": torch.ones(2)}, "memory://fastckpt-doc/w.safetensors")
    >>> fastckpt.load("memory://fastckpt-doc/w.safetensors")["w"].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from fastckpt.checkpoint import asynchronous, read
from fastckpt.checkpoint import load as local_load
from fastckpt.checkpoint import save as local_save
from fastckpt.integrations import routing

__all__ = ["save", "load", "open", "async_save"]

_STORAGE_OPTIONS = """storage_options: for a URL, passed to its fsspec file system (default: the
            JSON object in ``FASTCKPT_STORAGE_OPTIONS``). ``f`` may also be an fsspec URL
            (any protocol) or a Hugging Face sharded directory / its ``*.index.json``."""
_MAX_SHARD_SIZE = """max_shard_size: write Hugging Face shards plus ``model.safetensors.index.json``
            into the directory ``f``, each at most this size (``"5GB"`` is 5 * 10**9 bytes,
            ``"5GiB"`` 5 * 2**30, or an int); the index is written last."""


def _routed(
    local: Callable[..., Any], extra: dict[str, str]
) -> Callable[[Callable[..., Any]], Any]:
    """Gives the routing function ``local``'s signature and docstring, plus ``extra``
    keyword-only parameters (name -> documentation)."""

    def decorate(route: Callable[..., Any]) -> Callable[..., Any]:
        functools.update_wrapper(route, local)
        del route.__wrapped__  # the signature below is the true one
        signature = inspect.signature(local)
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in extra
        ]
        params = list(signature.parameters.values())
        tail = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
        head = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
        route.__signature__ = signature.replace(parameters=head + added + tail)
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
    if max_shard_size is not None or routing.remote.handles(f):
        return routing.route_save(
            obj, f, max_shard_size=max_shard_size, storage_options=storage_options, **options
        )
    return local_save.save(obj, f, **options)


@_routed(local_load.load, {"storage_options": _STORAGE_OPTIONS})
def load(f: Any, map_location: Any = None, *, storage_options: Any = None, **options: Any) -> Any:
    if routing.routed(f):
        return routing.route_load(f, map_location, storage_options=storage_options, **options)
    return local_load.load(f, map_location, **options)


@_routed(read.open_checkpoint, {"storage_options": _STORAGE_OPTIONS})
def open(f: Any, *, storage_options: Any = None, **options: Any) -> Any:  # noqa: A001
    if routing.routed(f):
        return routing.route_open(f, storage_options=storage_options, **options)
    return read.open_checkpoint(f, **options)


@_routed(asynchronous.async_save, {"storage_options": _STORAGE_OPTIONS})
def async_save(obj: Any, f: Any, *, storage_options: Any = None, **options: Any) -> Any:
    if routing.remote.handles(f):
        return routing.route_async_save(obj, f, storage_options=storage_options, **options)
    return asynchronous.async_save(obj, f, **options)
