"""Checkpoints at fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...): streamed save.

``fastckpt.save`` and ``async_save`` hand a URL here; a local path (or a ``file://`` URL,
which :mod:`fastckpt.storage` turns back into one) keeps the native direct-I/O path. Reading
a URL is the checkpoint layer's one reader over :class:`~fastckpt.storage.url.UrlStorage`
(:func:`open_url` and :func:`load` are that reader, spelled for URLs).

Save. The checkpoint layer plans the file and streams it header first
(:func:`fastckpt.checkpoint.ordered_save.write_in_order`: save's plan, header and checksums)
through the URL's atomic sink (:meth:`~fastckpt.storage.Storage.write_atomically`): bounded
memory, parallel parts on S3, and a checkpoint at a URL is complete or absent. ``base=`` makes
an incremental checkpoint against an earlier URL (only its header is read; see
docs/incremental.md); options that only tune a local disk are ignored
(:data:`IGNORED_AT_URLS`), and those a URL cannot honour (a lazy save, unknown names) are
refused, naming the option and the URL.

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

import threading
from collections.abc import Mapping
from typing import Any

from fastckpt import format, storage
from fastckpt.checkpoint import asynchronous, save_order
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
    "IGNORED_AT_URLS",
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


#: Options of the native path that tune how a local disk is written: a URL is written through
#: fsspec, so a save to a URL accepts and ignores them (objects have no permission bits
#: either, hence ``overwrite_readonly``).
IGNORED_AT_URLS = (
    "engine",
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "direct_io",
    "progress",
    "staging_bytes",
    "overwrite_readonly",
)


def _check_url_options(options: Mapping[str, Any], url: str, call: str) -> None:
    """TypeError naming an option that a save to ``url`` does not know (rather than
    silently writing something else than asked)."""
    for name in options:
        if name not in IGNORED_AT_URLS:
            raise TypeError(
                f"{call}() got an unexpected keyword argument {name!r} for the URL {url}"
            )


def _refuse_lazy(lazy: bool, fence: Any, fence_bytes: int | None, url: str) -> None:
    """A lazy save streams from the live tensors under a fence; the URL writer reads each
    tensor twice (checksums, then upload), so it cannot keep that promise: refused."""
    no_fence = fence is None or (isinstance(fence, (list, tuple)) and not fence)
    given = [
        name
        for name, asked in (
            ("lazy", bool(lazy)),
            ("fence", not no_fence),
            ("fence_bytes", fence_bytes is not None),
        )
        if asked
    ]
    if given:
        raise ValueError(
            f"{given[0]}= is not supported for a save to the URL {url}: lazy saves write "
            "local files only; a URL's async_save snapshots the tensors in the call "
            "(snapshot=True, the default)"
        )


_previous_lock = threading.Lock()
_previous: dict[str, asynchronous.SaveFuture] = {}  # URL -> its last asynchronous save


def save(
    obj: Any,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
    alignment: int = format.DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    piece_size: int = format.DEFAULT_PIECE_SIZE,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    compress: bool | str | None = None,
    base: str | None = None,
    frozen: Any = None,
    **local_options: Any,
) -> None:
    """Saves ``obj`` at ``url`` (what ``fastckpt.save`` does for a URL).

    Memory: at most ``parallel + 1`` parts of ``part_size`` bytes beyond the tensors (plus the
    HTTP client's copies of the parts in flight).

    Args:
        storage_options: passed to the fsspec file system (``key``, ``secret``,
            ``endpoint_url``, ``client_kwargs``, ...); ``base`` is read with them too.
        part_size: bytes per uploaded part (S3: at least 5 MiB; grown for huge files).
        parallel: parts uploaded at once (S3).
        base, frozen: an incremental save, as for a local file: ``base`` is the URL of an
            earlier checkpoint (its header alone is read), and the new object holds only
            the tensors that changed, with references relative to its own URL.
        local_options: I/O options of the native path: used for ``file://`` URLs, ignored
            for other URLs (:data:`IGNORED_AT_URLS`); any other name is a TypeError.
        Other arguments: as :func:`fastckpt.save`.

    Raises:
        OSError (``FileNotFoundError``, ``PermissionError``, ...): naming the URL, for a
            missing bucket, refused credentials or a failed transfer; nothing is left at
            the URL.
        MissingBaseError: ``base`` is missing.
        ValueError: ``base`` is a local path (or ``url`` a local one and ``base`` a URL).

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
            piece_size=piece_size,
            compress=compress,
            base=storage.to_local(base) or base if base is not None else None,
            frozen=frozen,
            **local_options,
        )
        return
    _check_url_options(local_options, url, "save")
    save_order.wait_for_earlier(url)  # an asynchronous save to this URL commits first
    plan = plan_save(
        obj,
        allow_pickle=allow_pickle,
        metadata=metadata,
        alignment=alignment,
        checksum=checksum,
        piece_size=piece_size,
        compress=compress,
        base=base,
        frozen=frozen,
        destination=url,
        storage_options=storage_options,
    )
    write_plan(plan, url, storage_options=storage_options, part_size=part_size, parallel=parallel)


def async_save(
    obj: Any,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    snapshot: bool = True,
    lazy: bool = False,
    fence: Any = (),
    fence_bytes: int | None = None,
    max_pending: int = asynchronous.DEFAULT_MAX_PENDING,
    metadata: Mapping[str, str] | None = None,
    alignment: int = format.DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    piece_size: int = format.DEFAULT_PIECE_SIZE,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    compress: bool | str | None = None,
    base: str | None = None,
    frozen: Any = None,
    **local_options: Any,
) -> Any:
    """Saves like :func:`save` in a background thread; returns a ``fastckpt.SaveFuture``.

    With ``snapshot=True`` (the default) the tensors are copied to host memory first, so the
    caller may change them as soon as this returns. ``base``/``frozen`` are decided in the
    call (the references are to the call-time state); a base still being saved
    asynchronously is waited for. Saves to one URL commit in call order.
    ``lazy``/``fence``/``fence_bytes`` are refused at a URL (ValueError); they and
    ``compress`` are passed on for a ``file://`` URL.

    Example:
        >>> import torch
        >>> future = async_save({"w": torch.ones(3)}, "memory://doc/async.safetensors")
        >>> future.result()
        >>> load("memory://doc/async.safetensors")["w"].tolist()
        [1.0, 1.0, 1.0]
    """
    local = storage.to_local(url)
    if local is not None:
        lazy_options = {"lazy": lazy, "fence": fence, "fence_bytes": fence_bytes}
        if compress is not None:
            local_options["compress"] = compress
        return asynchronous.async_save(
            obj,
            local,
            snapshot=snapshot,
            max_pending=max_pending,
            metadata=metadata,
            alignment=alignment,
            checksum=checksum,
            allow_pickle=allow_pickle,
            piece_size=piece_size,
            base=storage.to_local(base) or base if base is not None else None,
            frozen=frozen,
            **lazy_options,
            **local_options,
        )
    _check_url_options(local_options, url, "async_save")
    _refuse_lazy(lazy, fence, fence_bytes, url)
    future = asynchronous.SaveFuture(url)
    try:
        plan = plan_save(
            obj,
            allow_pickle=allow_pickle,
            metadata=metadata,
            alignment=alignment,
            checksum=checksum,
            piece_size=piece_size,
            compress=compress,
            base=base,
            frozen=frozen,
            destination=url,
            storage_options=storage_options,
        )
        if snapshot:
            plan.tensors = {n: t.detach().to("cpu", copy=True) for n, t in plan.tensors.items()}
    except BaseException as exc:
        future._set(None, exc)
        return future
    order = save_order.register(url)  # a later save to (or based on) this URL waits for it
    with _previous_lock:
        earlier, _previous[url] = _previous.get(url), future

    started = threading.Event()

    def work() -> None:
        started.set()
        try:
            if earlier is not None:
                earlier.wait()  # saves to one URL commit in call order
            write_plan(
                plan, url, storage_options=storage_options, part_size=part_size, parallel=parallel
            )
        finally:
            save_order.finish(order)
            with _previous_lock:
                if _previous.get(url) is future:
                    del _previous[url]

    try:  # fastckpt.wait_all() waits for it
        asynchronous.run_pending(future, work, name="fastckpt-save:url", max_pending=max_pending)
    except BaseException:
        if not started.is_set():  # no thread runs it: later saves must not wait for it
            save_order.finish(order)
        raise
    if future.done() and not started.is_set():  # it failed before its thread started
        save_order.finish(order)
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
