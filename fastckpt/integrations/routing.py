"""Where a checkpoint path leads: an fsspec URL (:mod:`~fastckpt.integrations.remote`), a
Hugging Face sharded directory (:mod:`~fastckpt.integrations.hf_shards`), or, for a
``file://`` URL, back to the local path. :mod:`fastckpt.api` asks here first.

Example:
    >>> routed("s3://bucket/x.safetensors"), routed("/tmp/x.safetensors")
    (True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastckpt.integrations import hf_shards, remote

__all__ = ["routed", "route_save", "route_load", "route_open", "route_async_save"]

# --------------------------------------------------------------------------- routing
# ``fastckpt.save``/``load``/``open``/``async_save`` hand their arguments here, unchanged, when
# the target is a URL or a sharded directory.

_NATIVE_ONLY = (
    "progress",
    "staging_bytes",
    "engine",
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "pin_memory",
    "gds",
)


def routed(f: Any) -> bool:
    """Whether ``fastckpt.load``/``open`` hand ``f`` here: a URL or a sharded directory/index.

    Example:
        >>> routed("s3://bucket/x.safetensors"), routed("/tmp/x.safetensors")
        (True, False)
    """
    return remote.handles(f) or hf_shards.is_sharded(f)


def _for_url(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options that apply to a URL (the native engine's settings do not)."""
    return {k: v for k, v in options.items() if k not in _NATIVE_ONLY}


def route_save(
    obj: Any,
    f: Any,
    *,
    max_shard_size: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> None:
    """``fastckpt.save`` of a URL or, with ``max_shard_size``, of a sharded directory."""
    if max_shard_size is not None:
        hf_shards.save_sharded(
            obj,
            f,
            max_shard_size=max_shard_size,
            storage_options=storage_options,
            **(_for_url(options) if remote.is_url(f) else options),
        )
    elif remote.is_url(f):
        remote.save(obj, f, storage_options=storage_options, **_for_url(options))
    else:
        import fastckpt

        fastckpt.save(obj, remote.local_path(f), **options)


def route_load(
    f: Any,
    map_location: Any = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> Any:
    """``fastckpt.load`` of a URL or a sharded directory."""
    if hf_shards.is_sharded(f):
        if remote.is_url(f):
            options = _for_url(options)
        return hf_shards.load_sharded(f, map_location, storage_options=storage_options, **options)
    if remote.is_url(f):
        try:
            return remote.load(
                f, map_location, storage_options=storage_options, **_for_url(options)
            )
        except IsADirectoryError:  # a directory of shards without an index file name in f
            return hf_shards.load_sharded(
                f, map_location, storage_options=storage_options, **_for_url(options)
            )
    import fastckpt

    return fastckpt.load(remote.local_path(f), map_location, **options)


def route_open(f: Any, *, storage_options: Mapping[str, Any] | None = None, **options: Any) -> Any:
    """``fastckpt.open`` of a URL or a sharded directory."""
    if hf_shards.is_sharded(f):
        if remote.is_url(f):
            options = _for_url(options)
        return hf_shards.open_sharded(f, storage_options=storage_options, **options)
    if remote.is_url(f):
        try:
            return remote.open_url(f, storage_options=storage_options, **_for_url(options))
        except IsADirectoryError:  # a directory of shards without an index file name in f
            return hf_shards.open_sharded(f, storage_options=storage_options)
    import fastckpt

    return fastckpt.open(remote.local_path(f), **options)


def route_async_save(
    obj: Any, f: Any, *, storage_options: Mapping[str, Any] | None = None, **options: Any
) -> Any:
    """``fastckpt.async_save`` of a URL."""
    if not remote.is_url(f):
        import fastckpt

        return fastckpt.async_save(obj, remote.local_path(f), **options)
    options = _for_url(options)
    options.pop("max_pending", None)
    return remote.async_save(obj, f, storage_options=storage_options, **options)
