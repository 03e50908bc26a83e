"""``fastckpt.load``: read a checkpoint back into the object that was saved.

One load for every storage: the checkpoint is opened as a :class:`~fastckpt.Reader` (a local
file, a file at a URL, or a sharded directory opened by the caller) and read through it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, BinaryIO, Callable, Mapping, Sequence, Union

import torch

from fastckpt import config
from fastckpt.checkpoint import tree
from fastckpt.checkpoint.read import open_checkpoint
from fastckpt.checkpoint.reader import Reader
from fastckpt.checkpoint.small_load import NOT_HANDLED, load_small
from fastckpt.storage import is_url
from fastckpt.storage.file_object import FileObjectStorage
from fastckpt.storage.resident_file import PageCacheFile, ResidentFile

__all__ = ["check_target", "load", "load_bytes", "resolve_device"]

MapLocation = Union[None, str, torch.device, Mapping[str, Any], Callable[..., Any]]
_CPU = torch.device("cpu")

# A file of at most this many bytes, mostly in memory, is read without the engine's worker
# threads: whole by small_load.py (ResidentFile), or one pread per run of tensors when only
# some are asked for: measured on the 2-core benchmark VM, see docs/benchmarks.md.
SMALL_FILE_BYTES = 64 << 20

# Checking CRC32Cs costs little (each step is checksummed while still in the CPU cache, on
# every core), so loads verify by default when the file has checksums. See the benchmarks.
VERIFY_DEFAULT = True


def resolve_device(
    map_location: MapLocation, device: str | torch.device | None
) -> torch.device | Callable[..., Any]:
    """The target device from ``torch.load``-style ``map_location`` or ``device``.

    A file records no device, so a dict ``map_location`` maps from ``"cpu"`` (what every
    tensor is read into first); ``{"cuda:0": "cpu"}`` therefore loads on the CPU.

    Example:
        >>> resolve_device(None, None)
        device(type='cpu')
        >>> resolve_device({"cuda:1": "cpu"}, None)
        device(type='cpu')
    """
    if device is not None and map_location is not None:
        raise ValueError("pass either map_location or device, not both")
    where = device if device is not None else map_location
    if where is None:
        return torch.device("cpu")
    if isinstance(where, (str, torch.device)):
        return torch.device(where)
    if isinstance(where, Mapping):
        return torch.device(where.get("cpu", "cpu"))
    if callable(where):
        return where
    raise TypeError(
        f"map_location must be a str, torch.device, dict or callable, got {type(where).__name__}"
    )


def _apply_callable(fn: Callable[..., Any], t: torch.Tensor) -> torch.Tensor:
    """``torch.load``'s ``map_location(storage, location)`` applied to one tensor."""
    result = fn(t.untyped_storage(), "cpu")
    if result is None or not hasattr(result, "device") or result.device == t.device:
        return t
    return t.to(result.device)


def check_target(
    map_location: MapLocation,
    device: str | torch.device | None,
    *,
    keys: Sequence[str] | None = None,
    mmap: bool = False,
    pin_memory: bool = False,
) -> torch.device | Callable[..., Any]:
    """The target of a load, with every argument checked before anything is read.

    Example:
        >>> check_target("mps", None)
        Traceback (most recent call last):
        ...
        ValueError: device mps is not supported (use 'cpu', 'cuda[:N]' or 'meta')
    """
    target = resolve_device(map_location, device)
    if isinstance(target, torch.device) and target.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"device {target} is not supported (use 'cpu', 'cuda[:N]' or 'meta')")
    if keys is not None and (isinstance(keys, str) or not isinstance(keys, Sequence)):
        raise TypeError("keys must be a list of tensor names")
    on_cuda = isinstance(target, torch.device) and target.type == "cuda"
    if mmap and (on_cuda or pin_memory):
        raise ValueError(
            "mmap=True maps the file into CPU memory: it takes no CUDA device or pin_memory"
        )
    return target


def load(
    f: str | os.PathLike[str] | Reader | BinaryIO | FileObjectStorage,
    map_location: MapLocation = None,
    *,
    device: str | torch.device | None = None,
    pin_memory: bool = False,
    weights_only: bool = True,
    keys: Sequence[str] | None = None,
    verify: bool | None = None,
    progress: bool | None = None,
    mmap: bool = False,
    direct_io: bool | None = None,
    gds: bool | None = None,
    engine: str | None = None,
    block_size: int | None = None,
    queue_depth: int | None = None,
    intra_op_parallelism: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    part_size: int | None = None,
    parallel: int | None = None,
) -> Any:
    """Loads what :func:`fastckpt.save` saved, or any safetensors file (as a flat dict).

    The data section is read on every core into one page-aligned arena (page-locked with
    ``pin_memory=True``); the returned tensors lie in it, each with a storage of its own at
    offset 0 as ``torch.load``'s have (no copy). Bytes already in memory (a
    hot page cache, tmpfs) are read through the page cache at memory speed, others with
    O_DIRECT at the device's speed (see :attr:`fastckpt.Reader.read_mode`); a small file
    in memory (at most ``SMALL_FILE_BYTES``) is read with no I/O engine set up: its whole
    data section by one ``pread`` (two halves on two threads from 8 MiB), each CRC32C taken
    in the same pass.

    Args:
        map_location: as ``torch.load``'s: a device string or ``torch.device``, a dict
            (mapping ``"cpu"``), or a callable ``(storage, location) -> storage``.
        device: the target device; an alternative spelling of ``map_location``.
        pin_memory: page-lock the arena (faster copies to a GPU later). Where the memory
            cannot be locked (``ulimit -l`` too small, no ``CAP_IPC_LOCK``) the tensors are
            returned in ordinary memory with a ``UserWarning`` that says why; turn it into an
            error with ``warnings.simplefilter("error", UserWarning)``.
        weights_only: refuse to unpickle objects saved with ``allow_pickle=True``
            (raises ``fastckpt.WeightsOnlyError``); pass False only for trusted files.
        keys: load only these tensors (reading only their bytes); returns a flat
            ``name -> tensor`` dict. For nested checkpoints names look like ``"model/fc.weight"``
            (see ``fastckpt.open(f).keys()``).
        verify: check every tensor's CRC32C (``ChecksumError`` names a damaged one), the
            copy of a tied tensor stored under its alias included (readers that know no
            aliases return that copy; checking it reads its bytes once more). Default: on
            when the file has checksums.
        progress: show a progress bar (default: on a terminal).
        mmap: like ``torch.load(mmap=True)``: tensors are views of a copy-on-write mapping of
            the file, read lazily as their pages are touched (zero copies; memory only for
            touched pages; writes stay private to this process). Checksums are then checked
            only with ``verify=True`` (which touches every page). CPU only. A file truncated
            by another process while mapped raises SIGBUS when a missing page is touched.
        direct_io: ``True`` reads with O_DIRECT, ``False`` through the page cache; default
            (None, or ``FASTCKPT_DIRECT_IO``): through the page cache when most of the data
            is already in memory or the file system refuses O_DIRECT, else O_DIRECT.
        gds: loading to CUDA, read with GPUDirect Storage straight into GPU memory
            (``True``: GDS or ``EngineUnavailableError``; default: when ``FASTCKPT_GDS=1``
            and GDS runs here). Otherwise disk reads into page-locked staging buffers
            overlap the copies to the GPU.
        storage_options: for a URL, passed to its fsspec file system.
        part_size: for a URL, bytes per ranged read.
        parallel: for a URL, ranged reads in flight.

    ``f`` may also be a readable binary file object (``open(path, "rb")``, ``io.BytesIO``;
    read with ``seek``/``readinto`` from its current position, or whole when it cannot seek,
    and left open), or an open :class:`~fastckpt.Reader` (opened on the target's device),
    read here and left open: every storage loads through this one function.

    Raises:
        FileNotFoundError: no such file (an ``OSError`` with errno and filename).
        HeaderError: not a valid safetensors file (the message says what and where).
        ChecksumError: a tensor's bytes do not match its checksum.
        KeyError: a name in ``keys`` is not in the file.

    Example:
        >>> import torch, fastckpt
        >>> opt_state = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
        >>> fastckpt.save(opt_state, "/tmp/fastckpt-load.safetensors")
        >>> back = fastckpt.load("/tmp/fastckpt-load.safetensors")
        >>> back["param_groups"][0]["lr"], list(back["state"])
        (0.1, [0])
    """
    target = check_target(map_location, device, keys=keys, mmap=mmap, pin_memory=pin_memory)
    on_cuda = isinstance(target, torch.device) and target.type == "cuda"
    if isinstance(f, Reader):
        return _read_object(f, target, pin_memory, weights_only, keys, verify, progress, mmap)
    io_options = (direct_io, gds, engine, block_size, queue_depth, intra_op_parallelism)
    url_options = (storage_options, part_size, parallel)
    plain = not on_cuda and all(o is None for o in io_options + url_options)
    light = _light_storage(f, mmap=mmap) if plain else None
    if light is not None:
        if keys is None and not pin_memory and target == _CPU:
            # the whole file to the CPU: one pass, no reader (small_load.py)
            try:
                loaded = load_small(light, verify=verify, weights_only=weights_only, mmap=mmap)
            except BaseException:
                light.close()
                raise
            if loaded is not NOT_HANDLED:
                light.close()
                return loaded
        with open_checkpoint(light) as reader:
            return _read_object(
                reader, target, pin_memory, weights_only, keys, verify, progress, mmap
            )
    with open_checkpoint(
        f,
        device=target if isinstance(target, torch.device) and on_cuda else "cpu",
        gds=gds,
        direct_io=direct_io,
        engine=engine,
        block_size=block_size,
        queue_depth=queue_depth,
        intra_op_parallelism=intra_op_parallelism,
        storage_options=storage_options,
        part_size=part_size,
        parallel=parallel,
    ) as reader:
        return _read_object(reader, target, pin_memory, weights_only, keys, verify, progress, mmap)


def _light_storage(f: Any, *, mmap: bool) -> PageCacheFile | None:
    """The storage of a load that needs no I/O engine, or None: a local file to be mapped
    (:class:`PageCacheFile`), or a small one mostly in memory (at most ``SMALL_FILE_BYTES``)
    read on this thread, one ``pread`` per run of tensors (:class:`ResidentFile`). Setting
    up the engine (an O_DIRECT descriptor and its probe, worker threads) costs more than
    the whole load of a small state. Forced O_DIRECT (``FASTCKPT_DIRECT_IO=1``) takes the
    full path; a forced read mode is for cold bytes only."""
    if not isinstance(f, (str, os.PathLike)) or is_url(f):
        return None
    if mmap:
        return PageCacheFile.open(f)
    config.read_mode_override()  # a bad FASTCKPT_READ_MODE is an error whatever is resident
    if config.direct_io():
        return None
    return ResidentFile.open_small(f, limit=SMALL_FILE_BYTES)


def _read_object(
    reader: Reader,
    target: torch.device | Callable[..., Any],
    pin_memory: bool,
    weights_only: bool,
    keys: Sequence[str] | None,
    verify: bool | None,
    progress: bool | None,
    mmap: bool,
) -> Any:
    check = reader.has_checksums and (VERIFY_DEFAULT if verify is None else verify)
    reader.require_checksums(bool(verify))
    names = None if keys is None else list(keys)
    on_cuda = isinstance(target, torch.device) and target.type == "cuda"
    if mmap:
        stored = reader.map(names, verify=bool(verify))
    else:
        stored = reader.read(names, pin_memory=pin_memory, verify=check, progress=progress)
        if pin_memory and not on_cuda:
            _warn_unpinned(stored, reader.path)
    if isinstance(target, torch.device) and target.type == "meta":
        stored = {name: t.to("meta") for name, t in stored.items()}
    elif callable(target) and not isinstance(target, torch.device):
        stored = {name: _apply_callable(target, t) for name, t in stored.items()}
    aliases = reader.aliases
    if keys is not None:
        return _named(keys, stored, aliases, reader.structure)
    return tree.unflatten(reader.structure, stored, aliases, weights_only=weights_only)


def _named(
    keys: Sequence[str],
    stored: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    structure: Any,
) -> dict[str, torch.Tensor]:
    """``load(keys=...)``: each name's tensor (tied names share one), in the memory format
    the structure records for it (channels-last tensors come back channels-last)."""
    formats = tree.memory_formats(structure) if structure is not None else {}
    built: dict[str, torch.Tensor] = {}
    result = {}
    for key in keys:
        target = aliases.get(key, key)
        if target not in built:
            memory_format = formats.get(key, formats.get(target))
            tensor = stored[target]
            if memory_format is not None:
                tensor = tree.with_memory_format(tensor, memory_format, key)
            built[target] = tensor
        result[key] = built[target]
    return result


def _warn_unpinned(tensors: Mapping[str, torch.Tensor], path: str) -> None:
    """The arena is page-locked when the system allows; say so when it did not."""
    from fastckpt import _C

    sample = next((t for t in tensors.values() if t.numel() and t.device.type == "cpu"), None)
    if sample is None or _C.is_locked(sample.data_ptr()):
        return
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    warnings.warn(
        f"load({path!r}, pin_memory=True): the memory could not be page-locked (mlock "
        f"failed; RLIMIT_MEMLOCK is {limit}); the tensors are in ordinary memory. Raise "
        "`ulimit -l` or grant CAP_IPC_LOCK to pin",
        UserWarning,
        stacklevel=3,
    )


def load_bytes(
    data: bytes | bytearray | memoryview, map_location: MapLocation = None, **options: Any
) -> Any:
    """Loads a checkpoint held in memory (what :func:`fastckpt.save_bytes` returns, or
    ``safetensors.torch.save``'s bytes), like ``safetensors.torch.load``; the options are
    :func:`load`'s. The tensors are copied out of ``data`` once, into memory of their own.

    Example:
        >>> import torch, fastckpt
        >>> data = fastckpt.save_bytes({"w": torch.ones(2), "step": 3})
        >>> back = fastckpt.load_bytes(data)
        >>> back["w"].tolist(), back["step"]
        ([1.0, 1.0], 3)
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, bytearray or memoryview, got {type(data).__name__}")
    return load(FileObjectStorage(data, argname="data"), map_location, **options)
