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
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Callable

import torch

from fastckpt import storage
from fastckpt.checkpoint import asynchronous, read, stream_save
from fastckpt.checkpoint import load as local_load
from fastckpt.checkpoint import save as local_save
from fastckpt.checkpoint.load_into import IncompatibleKeys, read_into
from fastckpt.checkpoint.reader import Reader, check_framework, open_with
from fastckpt.distributed import group_reader
from fastckpt.integrations import hf_shards, remote
from fastckpt.storage.file_object import is_file_object

__all__ = ["save", "load", "open", "async_save", "load_into", "Reader", "weights_file"]

_STORAGE_OPTIONS = """storage_options: for a URL, passed to its fsspec file system (default: the
            JSON object in ``FASTCKPT_STORAGE_OPTIONS``). ``f`` may also be an fsspec URL
            (any protocol) or a Hugging Face sharded directory / its ``*.index.json``."""
_MAX_SHARD_SIZE = """max_shard_size: write Hugging Face shards plus ``model.safetensors.index.json``
            into the directory ``f``, each at most this size (``"5GB"`` is 5 * 10**9 bytes,
            ``"5GiB"`` 5 * 2**30, or an int); the index is written last."""
_GROUP = """group: read once across a process group: every rank calls with the same
            checkpoint, each reads a stripe of the bytes from storage (verified there) and
            the rest arrives over collectives (a ``ProcessGroup``, or True for fastckpt's
            checkpoint group; default None: each rank reads alone). See docs/read-once.md."""
_SHARDS = """``f`` may also be a Hugging Face sharded directory or its ``*.index.json`` (the
            tensors its index names, each from the shard it names; ``parallel`` shards at once)."""

# Options of the native engine, which a save to a URL has no use for (a URL's async_save
# takes max_pending itself).
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


def _for_url(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options that apply to a save to a URL (the native engine's settings do not)."""
    return {k: v for k, v in options.items() if k not in _NATIVE_ONLY}


# What an async_save into a file object honours besides: when the tensors are copied, and
# how many saves may be in flight.
_STREAM_ASYNC = ("snapshot", "max_pending")
# What a save into a file object can honour: the file's contents, not how a disk is written.
_STREAM_OPTIONS = (
    "metadata",
    "alignment",
    "checksum",
    "allow_pickle",
    "piece_size",
    "progress",
    "compress",
)


def _save_to_file_object(obj: Any, f: Any, options: Mapping[str, Any]) -> None:
    stream_save.save_to_stream(obj, f, **_stream_options(options))


def _stream_options(options: Mapping[str, Any], also: tuple[str, ...] = ()) -> dict[str, Any]:
    """The options of a save into a file object (and ``also``); TypeError naming any other."""
    for name, value in options.items():
        if name not in _STREAM_OPTIONS + also and value is not None:
            raise TypeError(f"f is a file object: {name}= applies to files on disk or at URLs only")
    return {k: v for k, v in options.items() if k in _STREAM_OPTIONS + also and k != "progress"}


#: What a save's ``f`` may be, as its errors say.
_SAVE_TARGETS = (
    "a path (str or os.PathLike), a URL (s3://..., file://...), or a writable binary file "
    "object (io.BytesIO(), open(path, 'wb'))"
)


def _check_save_target(obj: Any, f: Any, function: str) -> None:
    """Names a misplaced ``f`` of ``save``/``async_save`` before anything is planned: None,
    another type, or the arguments swapped (the path first, as ``save_file`` users may not
    expect, or as ``torch.save(obj, f)``'s order was misremembered).

    Example:
        >>> _check_save_target({"w": 1}, None, "save")
        Traceback (most recent call last):
        ...
        TypeError: save(obj, f): f (where to save) is None; pass a path (str or os.PathLike), a URL (s3://..., file://...), or a writable binary file object (io.BytesIO(), open(path, 'wb'))
    """
    if isinstance(f, (str, os.PathLike)) or is_file_object(f):
        return
    if isinstance(f, (bytes, bytearray)):
        raise TypeError(
            f"{function}(obj, f): f is {type(f).__name__}; pass the path as str or os.PathLike "
            "(os.fsdecode(f)), or write into io.BytesIO() (fastckpt.save_bytes(obj) returns "
            "a checkpoint's bytes)"
        )
    got = "None" if f is None else f"of type {type(f).__name__}"
    if isinstance(obj, (str, os.PathLike)):
        where = os.fspath(obj)
        raise TypeError(
            f"{function}(obj, f) takes what to save first and where second: obj is the path "
            f"{where!r} and f is {got}; call {function}(state, {where!r})"
        )
    raise TypeError(f"{function}(obj, f): f (where to save) is {got}; pass {_SAVE_TARGETS}")


def _check_load_source(f: Any, function: str) -> None:
    """A checkpoint's bytes passed where its path goes get a pointer to ``load_bytes``
    (as a path they fail with "embedded null byte").

    Example:
        >>> _check_load_source(bytearray(8), "load")
        Traceback (most recent call last):
        ...
        TypeError: load(f): f is 8 bytes of data (bytearray), a checkpoint's contents rather than its path; read bytes in memory with fastckpt.load_bytes(data) (or pass io.BytesIO(data))
    """
    # A path holds no NUL byte; a checkpoint always does (its header length's high bytes).
    if isinstance(f, (bytearray, memoryview)) or (isinstance(f, bytes) and b"\0" in f):
        raise TypeError(
            f"{function}(f): f is {memoryview(f).nbytes} bytes of data ({type(f).__name__}), a "
            "checkpoint's contents rather than its path; read bytes in memory with "
            "fastckpt.load_bytes(data) (or pass io.BytesIO(data))"
        )


def weights_file(
    f: Any, *, for_save: bool = False, storage_options: Mapping[str, Any] | None = None
) -> str | None:
    """The single-file checkpoint that a directory ``f`` stands for, Hugging Face's way:
    ``f/model.safetensors``. None when ``f`` is not such a directory.

    For a save, ``f`` is a directory when it ends with ``/`` or names an existing local
    directory. For a load, when it is a local directory (or a URL ending with ``/``) that
    holds ``model.safetensors`` and no ``model.safetensors.index.json`` (a sharded
    directory, which is read through its index).

    Example:
        >>> weights_file("out/", for_save=True), weights_file("out.safetensors", for_save=True)
        ('out/model.safetensors', None)
    """
    if not isinstance(f, (str, os.PathLike)):
        return None
    text = os.fspath(f)
    if not isinstance(text, str):
        return None
    if storage.is_url(text):
        if not text.endswith("/"):
            return None
        single = storage.join(text, hf_shards.WEIGHTS_NAME)
        if for_save:
            return single
        index = storage.join(text, hf_shards.INDEX_NAME)
        if storage.exists(index, storage_options):
            return None
        return single if storage.exists(single, storage_options) else None
    local = storage.to_local(text)
    if local is None:
        return None
    single = os.path.join(local, hf_shards.WEIGHTS_NAME)
    if for_save:
        return single if local.endswith(("/", os.sep)) or os.path.isdir(local) else None
    if not os.path.isdir(local) or os.path.exists(os.path.join(local, hf_shards.INDEX_NAME)):
        return None
    return single if os.path.isfile(single) else None


def _local(f: Any) -> Any:
    """A ``file://`` URL as its path; anything else unchanged (checked by the callee)."""
    return storage.to_local(f) if storage.handles(f) and not storage.is_url(f) else f


def _routed(
    local: Callable[..., Any], extra: dict[str, str], positional: tuple[str, ...] = ()
) -> Callable[[Callable[..., Any]], Any]:
    """Gives the public function ``local``'s signature and docstring, plus ``extra``
    keyword-only parameters (name -> documentation; ``"shards"`` adds documentation only).
    The parameters named in ``positional`` may also be passed by position, after ``local``'s
    positional ones (as safetensors' ``save_file(tensors, filename, metadata)`` takes them)."""

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
        by_position = [p for p in head if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        promoted = [
            p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
            for name in positional
            for p in head
            if p.name == name
        ]
        rest = [p for p in head if p not in by_position and p.name not in positional]
        head = by_position + promoted + rest
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


def _check_metadata_argument(metadata: Any) -> None:
    """A module as the third argument is torch.save's ``pickle_module``, which has no use
    here (nothing is pickled): say so rather than fail on it as metadata."""
    if isinstance(metadata, ModuleType):
        raise TypeError(
            f"metadata (the third argument, as in safetensors' save_file) must be a str -> str "
            f"mapping, got the module {metadata.__name__}: fastckpt pickles nothing, so "
            "torch.save's pickle_module has no counterpart"
        )


@_routed(
    local_save.save,
    {"storage_options": _STORAGE_OPTIONS, "max_shard_size": _MAX_SHARD_SIZE},
    positional=("metadata",),
)
def save(
    obj: Any,
    f: Any,
    metadata: Any = None,
    *,
    storage_options: Any = None,
    max_shard_size: Any = None,
    **options: Any,
) -> None:
    _check_save_target(obj, f, "save")
    if metadata is not None:
        _check_metadata_argument(metadata)
        options["metadata"] = metadata
    if is_file_object(f):
        if max_shard_size is not None or storage_options is not None:
            raise TypeError("f is a file object: max_shard_size and storage_options need a path")
        return _save_to_file_object(obj, f, options)
    if max_shard_size is not None:
        return hf_shards.save_sharded(
            obj,
            _local(f),
            max_shard_size=max_shard_size,
            storage_options=storage_options,
            **(_for_url(options) if storage.is_url(f) else options),
        )
    single = weights_file(f, for_save=True)
    if single is not None and storage.is_url(single):
        return remote.save(obj, single, storage_options=storage_options, **_for_url(options))
    if storage.is_url(f):
        return remote.save(obj, f, storage_options=storage_options, **_for_url(options))
    if single is None:
        return local_save.save(obj, _local(f), **options)
    directory = os.path.dirname(single)
    os.makedirs(directory, exist_ok=True)
    hf_shards.refuse_foreign_files(directory)  # never replace another tool's checkpoint
    local_save.save(obj, single, **options)
    # as a one-shard save does: shards and an index left by an earlier save would be read
    # instead of the new file
    hf_shards.retire_sharded_set(directory)


# What load() does with the tensors once read; the rest of its options open the checkpoint.
_READING = ("device", "pin_memory", "weights_only", "keys", "verify", "progress", "mmap")


def _load_shared(f: Any, map_location: Any, group: Any, options: dict[str, Any]) -> Any:
    """load() over a group: the checkpoint is opened on every rank and read once."""
    reading = {k: options.pop(k) for k in _READING if k in options}
    if reading.get("mmap"):
        raise ValueError(
            "mmap=True maps the file on each rank, group= shares one read: pass one of them"
        )
    target = local_load.check_target(
        map_location, reading.get("device"), pin_memory=bool(reading.get("pin_memory"))
    )
    if isinstance(f, Reader):  # opened by the caller on every rank, and left open
        return local_load.load(group_reader.GroupReader(f, group), map_location, **reading)
    if isinstance(target, torch.device) and target.type == "cuda":
        options["device"] = target
    with group_reader.open_shared(lambda: open(f, **options), group) as reader:
        return local_load.load(reader, map_location, **reading)


@_routed(local_load.load, {"shards": _SHARDS, "group": _GROUP})
def load(f: Any, map_location: Any = None, *, group: Any = None, **options: Any) -> Any:
    _check_load_source(f, "load")
    shared = group_reader.resolve_group(group)
    if shared is not None:
        return _load_shared(f, map_location, shared, options)
    single = weights_file(f, storage_options=options.get("storage_options"))
    if single is not None:
        return load(single, map_location, **options)
    if hf_shards.is_sharded(f):
        return hf_shards.load_sharded(f, map_location, **options)
    try:
        return local_load.load(f, map_location, **options)
    except IsADirectoryError:
        if not storage.is_url(f):
            raise
        # a URL of a directory of shards, without the index's name in it
        return hf_shards.load_sharded(f, map_location, **options)


@_routed(read.open_checkpoint, {"shards": _SHARDS, "group": _GROUP})
def open(  # noqa: A001
    f: Any, framework: str = "pt", device: Any = None, *, group: Any = None, **options: Any
) -> Reader:
    check_framework(framework)
    _check_load_source(f, "open")
    if device is not None:  # safe_open's device=0 is the first GPU
        options["device"] = f"cuda:{device}" if isinstance(device, int) else device
    shared = group_reader.resolve_group(group)
    if shared is not None:
        return group_reader.open_shared(lambda: open(f, **options), shared)
    single = weights_file(f, storage_options=options.get("storage_options"))
    if single is not None:
        return open(single, **options)
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
    _check_save_target(obj, f, "async_save")
    if is_file_object(f):  # written into it in the background (snapshot at the call)
        if storage_options is not None:
            raise TypeError("f is a file object: storage_options needs a URL")
        return asynchronous.async_save(obj, f, **_stream_options(options, _STREAM_ASYNC))
    single = weights_file(f, for_save=True)
    if single is not None:
        if not storage.is_url(single):
            os.makedirs(os.path.dirname(single), exist_ok=True)
            hf_shards.refuse_foreign_files(os.path.dirname(single))
        f = single
    if storage.is_url(f):
        return remote.async_save(obj, f, storage_options=storage_options, **_for_url(options))
    return asynchronous.async_save(obj, _local(f), **options)


def load_into(
    model_or_state_dict: Any,
    f: Any,
    *,
    strict: bool = True,
    verify: bool | None = None,
    group: Any = None,
    **options: Any,
) -> IncompatibleKeys:
    """Reads a checkpoint straight into a model's parameters and buffers, or into a state
    dict's tensors: each tensor's bytes land in the destination's own memory, with no
    intermediate arena (the memory of a load is the model's). Like
    ``model.load_state_dict(fastckpt.load(f), strict=strict)``, without the second copy.

    Args:
        model_or_state_dict: a ``torch.nn.Module`` or a dict of tensors to fill in place.
        f: a file, directory or URL, as :func:`fastckpt.open` takes; a checkpoint of a flat
            state dict (``fastckpt.save(model.state_dict(), f)``, any safetensors file).
        strict: raise ``RuntimeError`` when keys differ (as ``load_state_dict`` does);
            with ``strict=False`` the matching tensors are filled.
        verify: check CRC32Cs (default: when the file has them).
        group: read once across a process group (a ``ProcessGroup``, or True for fastckpt's
            checkpoint group; default None: each rank reads alone). Every rank calls with the
            same checkpoint and its own model; each reads a stripe of the bytes, verified
            there, and every rank's tensors are filled from the shared bytes.
        options: :func:`fastckpt.open`'s (``storage_options``, ``direct_io``, ...).

    Returns:
        ``(missing_keys, unexpected_keys)``, a named tuple as ``load_state_dict`` returns.

    A destination of another dtype, a strided view or a GPU tensor is read into host memory
    and copied with ``copy_`` (converting the dtype); shapes must match.

    Example:
        >>> import torch, fastckpt
        >>> fastckpt.save(torch.nn.Linear(4, 2).state_dict(), "/tmp/fastckpt-load-into.safetensors")
        >>> model = torch.nn.Linear(4, 2)
        >>> fastckpt.load_into(model, "/tmp/fastckpt-load-into.safetensors")
        IncompatibleKeys(missing_keys=[], unexpected_keys=[])
    """
    shared = group_reader.resolve_group(group)
    if shared is not None:
        with group_reader.open_shared(lambda: open(f, **options), shared) as reader:
            return group_reader.read_into_shared(
                model_or_state_dict, reader, shared, strict=strict, verify=verify
            )
    with open(f, **options) as reader:
        return read_into(model_or_state_dict, reader, strict=strict, verify=verify)


open_with(open)  # calling fastckpt.Reader(f, ...) opens f, as safetensors.safe_open(f, ...) does
