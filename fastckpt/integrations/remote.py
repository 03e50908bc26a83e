"""Checkpoints at fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...): streamed save.

``fastckpt.save`` and ``async_save`` hand a URL here; a local path (or a ``file://`` URL,
which :mod:`fastckpt.storage` turns back into one) keeps the native direct-I/O path. Reading
a URL is the checkpoint layer's one reader over :class:`~fastckpt.storage.url.UrlStorage`
(:func:`open_url` and :func:`load` are that reader, spelled for URLs).

Save. The checkpoint layer plans the file and streams it header first
(:func:`fastckpt.checkpoint.ordered_save.write_in_order`: save's plan, header and checksums)
through the URL's atomic sink (:meth:`~fastckpt.storage.Storage.write_atomically`): bounded
memory, parallel parts on S3, and a checkpoint at a URL is complete or absent.

Example:
    >>> import torch, fastckpt
    >>> fastckpt.save({"w": torch.ones(2, 2), "step": 7}, "memory://doc/ckpt.safetensors")
    >>> fastckpt.load("memory://doc/ckpt.safetensors")["step"]
    7
    >>> with fastckpt.open("memory://doc/ckpt.safetensors") as r:
    ...     r.get_tensor("w").sum().item()
    4.0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastckpt import format, storage
from fastckpt.checkpoint import asynchronous
from fastckpt.checkpoint import load as checkpoint_load
from fastckpt.checkpoint import save as checkpoint_save
from fastckpt.checkpoint.ordered_save import write_in_order
from fastckpt.checkpoint.read import CheckpointReader, open_checkpoint
from fastckpt.checkpoint.save import SavePlan, plan_save
from fastckpt.storage.locations import handles, is_url, join, local_path, url_to_fs
from fastckpt.storage.url import DEFAULT_PARALLEL, DEFAULT_PART_SIZE, UrlStorage, url_errors

# The context manager that restates a failure as an OSError naming the URL; it lives in the
# storage layer now (DCP's listing still reaches it by this name).
_Errors = url_errors

__all__ = [
    "DEFAULT_PART_SIZE",
    "DEFAULT_PARALLEL",
    "RemoteReader",
    "async_save",
    "handles",
    "local_path",
    "is_url",
    "join",
    "load",
    "open_url",
    "read_bytes",
    "save",
    "write_bytes",
    "url_to_fs",
]


# --------------------------------------------------------------------------- save


def write_plan(
    plan: SavePlan,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
) -> None:
    """Writes a planned checkpoint to ``url``: checksums first, then header and data, streamed
    through the URL's atomic sink."""
    sink = UrlStorage(url, storage_options=storage_options, part_size=part_size, parallel=parallel)
    write_in_order(plan, sink, piece_bytes=part_size)


def save(
    obj: Any,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
    alignment: int = format.DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    compress: bool | str | None = None,
    **local_options: Any,
) -> None:
    """Saves ``obj`` at ``url`` (what ``fastckpt.save`` does for a URL).

    Memory: at most ``parallel + 1`` parts of ``part_size`` bytes beyond the tensors (plus the
    HTTP client's copies of the parts in flight).

    Args:
        storage_options: passed to the fsspec file system (``key``, ``secret``,
            ``endpoint_url``, ``client_kwargs``, ...).
        part_size: bytes per uploaded part (S3: at least 5 MiB; grown for huge files).
        parallel: parts uploaded at once (S3).
        local_options: I/O options of the native path, used for ``file://`` URLs.
        Other arguments: as :func:`fastckpt.save`.

    Raises:
        OSError (``FileNotFoundError``, ``PermissionError``, ...): naming the URL, for a
            missing bucket, refused credentials or a failed transfer; nothing is left at
            the URL.

    Example:
        >>> import torch
        >>> save({"x": torch.arange(3)}, "memory://doc/save.safetensors")
        >>> load("memory://doc/save.safetensors")["x"].tolist()
        [0, 1, 2]
    """
    local = storage.to_local(url)
    if local is not None:
        checkpoint_save.save(
            obj,
            local,
            metadata=metadata,
            alignment=alignment,
            checksum=checksum,
            allow_pickle=allow_pickle,
            compress=compress,
            **local_options,
        )
        return
    plan = plan_save(
        obj,
        allow_pickle=allow_pickle,
        metadata=metadata,
        alignment=alignment,
        checksum=checksum,
        compress=compress,
    )
    write_plan(plan, url, storage_options=storage_options, part_size=part_size, parallel=parallel)


def async_save(
    obj: Any,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    snapshot: bool = True,
    metadata: Mapping[str, str] | None = None,
    alignment: int = format.DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    **local_options: Any,
) -> Any:
    """Saves like :func:`save` in a background thread; returns a ``fastckpt.SaveFuture``.

    With ``snapshot=True`` (the default) the tensors are copied to host memory first, so the
    caller may change them as soon as this returns.

    Example:
        >>> import torch
        >>> future = async_save({"w": torch.ones(3)}, "memory://doc/async.safetensors")
        >>> future.result()
        >>> load("memory://doc/async.safetensors")["w"].tolist()
        [1.0, 1.0, 1.0]
    """
    local = storage.to_local(url)
    if local is not None:
        return asynchronous.async_save(
            obj,
            local,
            snapshot=snapshot,
            metadata=metadata,
            alignment=alignment,
            checksum=checksum,
            allow_pickle=allow_pickle,
            **local_options,
        )
    future = asynchronous.SaveFuture(url)
    try:
        plan = plan_save(
            obj,
            allow_pickle=allow_pickle,
            metadata=metadata,
            alignment=alignment,
            checksum=checksum,
            compress=local_options.get("compress"),
        )
        if snapshot:
            plan.tensors = {n: t.detach().to("cpu", copy=True) for n, t in plan.tensors.items()}
    except BaseException as exc:
        future._set(None, exc)
        return future

    def work() -> None:
        write_plan(
            plan, url, storage_options=storage_options, part_size=part_size, parallel=parallel
        )

    asynchronous.run_pending(
        future, work, name="fastckpt-save:url"
    )  # fastckpt.wait_all() waits for it
    return future


def write_bytes(url: str, data: bytes, storage_options: Mapping[str, Any] | None = None) -> None:
    """Writes a small object (an index file) whole at a URL, or a local file at a plain path,
    with the same commit rule as :func:`save`.

    Example:
        >>> write_bytes("memory://doc/note.json", b"{}")
        >>> read_bytes("memory://doc/note.json")
        b'{}'
    """
    storage.write_whole(url, data, storage_options)


def read_bytes(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """Reads a whole small object (an index file) at a URL, or a local file at a plain path;
    errors name the URL or path.

    Example:
        >>> write_bytes("memory://doc/small.json", b"{}")
        >>> read_bytes("memory://doc/small.json")
        b'{}'
    """
    return storage.read_whole(url, storage_options)


# --------------------------------------------------------------------------- load


def RemoteReader(  # noqa: N802 - the name readers of URLs have always had
    url: str, *, storage_options: Mapping[str, Any] | None = None, **options: Any
) -> CheckpointReader:
    """The checkpoint at ``url`` opened for lazy reading: the one
    :class:`~fastckpt.checkpoint.read.CheckpointReader`, over the URL's storage. ``options``
    are :func:`fastckpt.open`'s (``part_size``, ``parallel``, ``header_probe``: bytes of the
    first read of the header).

    Example:
        >>> import torch
        >>> save({"a": torch.ones(2), "b": torch.zeros(3)}, "memory://doc/reader.safetensors")
        >>> with RemoteReader("memory://doc/reader.safetensors") as r:
        ...     sorted(r.keys()), r.get_tensor("b").tolist()
        (['a', 'b'], [0.0, 0.0, 0.0])
    """
    if not is_url(url):
        raise ValueError(f"{url!r} is not a URL (open local files with fastckpt.open)")
    return open_checkpoint(url, storage_options=storage_options, **options)


def open_url(url: str, **options: Any) -> CheckpointReader:
    """Opens the checkpoint at ``url`` for lazy reading (what ``fastckpt.open(url)`` does);
    the options are :func:`fastckpt.open`'s.

    Example:
        >>> import torch
        >>> save({"x": torch.arange(4)}, "memory://doc/open.safetensors")
        >>> open_url("memory://doc/open.safetensors").get_tensor("x").tolist()
        [0, 1, 2, 3]
    """
    return open_checkpoint(url, **options)


def load(url: str, map_location: Any = None, **options: Any) -> Any:
    """Loads the checkpoint at ``url`` (what ``fastckpt.load(url)`` does): the one load of
    :mod:`fastckpt.checkpoint.load`; ``part_size`` (bytes per ranged read) and ``parallel``
    (ranged reads in flight) tune it.

    Example:
        >>> import torch
        >>> save({"a": torch.ones(2), "b": [1, 2]}, "memory://doc/load.safetensors")
        >>> load("memory://doc/load.safetensors", keys=["a"])["a"].tolist()
        [1.0, 1.0]
    """
    return checkpoint_load.load(url, map_location, **options)
