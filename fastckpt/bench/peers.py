"""The savers and loaders benchmarks compare: fastckpt and its peers, one registry.

Each method is set up outside the timed section (imports, first-use warm-ups, checks that
it can run here) and returns a thunk that does exactly the timed work:

* :data:`SAVERS`: ``setup(state, path) -> thunk()`` that saves ``state`` to ``path`` and
  returns once the data is durable (fsync of the file and its directory).
* :data:`LOADERS`: ``setup(path, device) -> thunk()`` returning the loaded tensors as a
  flat ``name -> tensor`` dict (the parallel-``preadv`` ceiling returns one byte tensor).

A method that cannot run here (a peer not installed, an argument this fastckpt lacks)
raises :class:`Skip` from its setup, with the reason.

Example:
    >>> import os, tempfile, torch
    >>> from fastckpt.bench.peers import LOADERS, SAVERS
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> SAVERS["fastckpt"].setup({"w": torch.ones(3)}, path)()
    >>> LOADERS["safetensors"].setup(path, "cpu")()["w"].tolist()
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable

from fastckpt.bench.caches import make_durable
from fastckpt.bench.ceilings import (
    direct_preadv_file,
    direct_pwrite_file,
    preadv_file,
    pwrite_file,
)
from fastckpt.bench.fio import FIO_LOCKED, fio_path, fio_sequential
from fastckpt.config import READ_MODES

__all__ = ["LOADERS", "SAVERS", "Loader", "Saver", "Skip", "Timed", "install_hint"]

#: What installs the peers without pulling a CUDA build of torch.
PEERS_INSTALL = 'pip install -c benchmarks/constraints.txt -e ".[bench]"'


class Skip(Exception):
    """A method cannot run here; the message says why."""


def install_hint(module: str) -> str:
    """Why a peer is left out, with the command that installs it."""
    return f"{module} is not installed ({PEERS_INSTALL})"


def _require(module: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise Skip(f"{install_hint(module)}: {exc}") from None


@dataclass(frozen=True)
class Saver:
    """A way to save: ``label`` for tables, ``file`` the kind of file written."""

    label: str
    file: str
    setup: Callable[[dict[str, Any], str], Callable[[], None]]


@dataclass(frozen=True)
class Loader:
    """A way to load: ``label`` for tables, ``file`` the kind of file it reads."""

    label: str
    file: str
    setup: Callable[[str, str], Callable[[], Any]]


# ----------------------------------------------------------------------------- saves


def _save_fastckpt(state: dict[str, Any], path: str) -> Callable[[], None]:
    from fastckpt.api import save  # resolved (its modules imported) outside the timed section

    return lambda: save(state, path, progress=False)  # fsyncs and commits itself


def _save_torch(state: dict[str, Any], path: str) -> Callable[[], None]:
    import torch

    def run() -> None:
        torch.save(state, path)
        make_durable(path)

    return run


def _save_safetensors(state: dict[str, Any], path: str) -> Callable[[], None]:
    _require("safetensors.torch")
    from safetensors.torch import save_file

    def run() -> None:
        save_file(state, path)
        make_durable(path)

    return run


def _pwrite(parallel: bool) -> Callable[[dict[str, Any], str], Callable[[], None]]:
    def setup(state: dict[str, Any], path: str) -> Callable[[], None]:
        import torch

        tensors = [t for t in state.values() if isinstance(t, torch.Tensor)]
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            raise Skip("the pwrite ceiling writes contiguous CPU tensors")
        # Raw bytes of each tensor (bfloat16 has no buffer format of its own).
        buffers = [t.view(torch.uint8).reshape(-1).numpy() for t in tensors if t.numel()]
        threads = len(os.sched_getaffinity(0)) if parallel else 1

        def run() -> None:
            pwrite_file(path, buffers, threads)

        return run

    return setup


# fio stands for the device from this size up (smaller files are below its block size, and
# its process start would weigh on the figure); its blocks are of _FIO_BLOCK bytes.
_FIO_MIN = 64 << 20
_FIO_BLOCK = 4 << 20


@dataclass(frozen=True)
class Timed:
    """What a ceiling's thunk returns when it timed itself (fio's own runtime, without
    starting its process): :func:`fastckpt.bench.comparison.compare` takes these seconds."""

    seconds: float


def _direct_write(state: dict[str, Any], path: str) -> Callable[[], Any]:
    """The device's write ceiling for as many bytes as ``state`` holds (its bytes are not
    what is written: the device's speed does not depend on them): fio's sequential O_DIRECT
    write (io_uring, 4 MiB x 32, locked buffers, ``end_fsync``) where fio is installed, else
    16 threads of 4 MiB O_DIRECT ``pwritev`` + fsync."""
    import torch

    nbytes = sum(
        t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor)
    )
    try:
        direct_pwrite_file(path, 1)  # can this file system take O_DIRECT? (one block)
    except OSError as exc:
        raise Skip(str(exc)) from None
    if fio_path() is not None and nbytes >= _FIO_MIN:
        # fio writes whole 4 MiB blocks: its time is scaled back to the state's size
        whole = -(-nbytes // _FIO_BLOCK) * _FIO_BLOCK

        def run_fio() -> Timed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            out = fio_sequential("write", path, whole, bs="4M", extra=FIO_LOCKED)
            if "error" in out:
                raise OSError(errno.EIO, f"the fio ceiling failed: {out['error']}", path)
            return Timed(out["seconds"] * nbytes / out["bytes"])

        return run_fio

    def run() -> None:
        direct_pwrite_file(path, nbytes)

    return run


#: Savers by name; every one is timed until the data is durable.
SAVERS: dict[str, Saver] = {
    "fastckpt": Saver("fastckpt.save", "fastckpt", _save_fastckpt),
    "safetensors": Saver("safetensors save_file + fsync", "safetensors", _save_safetensors),
    "torch": Saver("torch.save + fsync", "torch", _save_torch),
    # Ceilings: raw tensor bytes, a file no loader reads.
    "pwrite-1": Saver("pwrite ceiling, 1 thread", "raw", _pwrite(parallel=False)),
    "pwrite": Saver("parallel pwrite ceiling", "raw", _pwrite(parallel=True)),
    "direct": Saver("device ceiling: O_DIRECT write + fsync (fio)", "raw", _direct_write),
}

# ----------------------------------------------------------------------------- loads


def _load_fastckpt(path: str, device: str) -> Callable[[], Any]:
    from fastckpt.api import load  # resolved (its modules imported) outside the timed section

    return lambda: load(path, map_location=device, progress=False)


def _load_fastckpt_noverify(path: str, device: str) -> Callable[[], Any]:
    from fastckpt.api import load

    return lambda: load(path, map_location=device, verify=False, progress=False)


def _load_fastckpt_mmap(path: str, device: str) -> Callable[[], Any]:
    from fastckpt.api import load

    if "mmap" not in inspect.signature(load).parameters:
        raise Skip("fastckpt.load takes no mmap argument in this version")
    if device != "cpu":
        raise Skip("mmap loads are for CPU tensors")
    return lambda: load(path, mmap=True, progress=False)


def _load_fastckpt_in(mode: str) -> Callable[[str, str], Callable[[], Any]]:
    """``fastckpt.load`` with its cold reads forced to one read mode, to show every path
    beside the one chosen."""

    def setup(path: str, device: str) -> Callable[[], Any]:
        from fastckpt.api import load
        from fastckpt.config import force_read_mode

        force_read_mode(mode)  # this benchmark child reads in this mode only
        return lambda: load(path, map_location=device, progress=False)

    return setup


def _load_fastckpt_pages(pages: str) -> Callable[[str, str], Callable[[], Any]]:
    """``fastckpt.load`` with its arena's pages brought in one way (``FASTCKPT_ARENA_PAGES``:
    huge pages, or populated on every core before the reads)."""

    def setup(path: str, device: str) -> Callable[[], Any]:
        from fastckpt.api import load
        from fastckpt.config import force_arena_pages

        force_arena_pages(pages)  # this benchmark child's arenas only
        return lambda: load(path, map_location=device, progress=False)

    return setup


def _load_safetensors(path: str, device: str) -> Callable[[], Any]:
    _require("safetensors.torch")
    import safetensors.torch

    safetensors.torch.load(safetensors.torch.save({"w": _ones()}))  # first-use setup
    return lambda: safetensors.torch.load_file(path, device=device)


def _load_safetensors_pread(path: str, device: str) -> Callable[[], Any]:
    _require("safetensors.torch")
    import safetensors.torch

    if "backend" not in inspect.signature(safetensors.torch.load_file).parameters:
        raise Skip("this safetensors has no backend= argument (pread reads came in 0.8)")
    safetensors.torch.load(safetensors.torch.save({"w": _ones()}))  # first-use setup
    return lambda: safetensors.torch.load_file(path, device=device, backend="pread")


def _load_safe_open(path: str, device: str) -> Callable[[], Any]:
    _require("safetensors")
    from safetensors import safe_open

    def run() -> dict[str, Any]:
        with safe_open(path, framework="pt", device=device) as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict

    return run


def _load_torch_mmap(path: str, device: str) -> Callable[[], Any]:
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"w": _ones()}, buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)  # the unpickler's lazy imports, outside the timing
    return lambda: torch.load(path, map_location=device, weights_only=True, mmap=True)


def _load_torch(path: str, device: str) -> Callable[[], Any]:
    _load_torch_mmap(path, device)
    import torch

    return lambda: torch.load(path, map_location=device, weights_only=True)


def _load_runai(path: str, device: str) -> Callable[[], Any]:
    _require("runai_model_streamer")
    import logging

    from runai_model_streamer import SafetensorsStreamer

    logging.getLogger("runai_model_streamer").setLevel(logging.WARNING)  # no throughput lines

    def run() -> dict[str, Any]:
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(path, device=device)  # owned tensors: valid after the loop
            return dict(streamer.get_tensors())

    return run


def _load_fastsafetensors(path: str, device: str) -> Callable[[], Any]:
    _require("fastsafetensors")
    from fastsafetensors import fastsafe_open

    nogds = device == "cpu"

    def run() -> dict[str, Any]:
        # The tensors share ownership of their buffer: valid after the context closes.
        with fastsafe_open(path, framework="pt", device=device, nogds=nogds) as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict

    return run


def _preadv(prefault: bool) -> Callable[[str, str], Callable[[], Any]]:
    def setup(path: str, device: str) -> Callable[[], Any]:
        import torch

        if device != "cpu":
            raise Skip("the preadv ceiling reads into host memory")
        threads = len(os.sched_getaffinity(0))

        def run() -> dict[str, Any]:
            buffer, _ = preadv_file(path, threads, prefault=prefault)
            return {"file": torch.frombuffer(buffer, dtype=torch.uint8)}

        return run

    return setup


def _direct_read(path: str, device: str) -> Callable[[], Any]:
    """The device's read ceiling: the file read with O_DIRECT (fio's sequential read where
    fio is installed, else threads into reused buffers); nothing is returned but the time
    fio measured, since there is no tensor to give."""
    if fio_path() is not None and os.path.getsize(path) >= _FIO_MIN:

        def run_fio() -> Timed:
            size = os.path.getsize(path)  # fio's write: whole 4 MiB blocks
            out = fio_sequential("read", path, size, bs="4M", extra=FIO_LOCKED)
            if "error" in out:
                raise OSError(errno.EIO, f"the fio ceiling failed: {out['error']}", path)
            return Timed(out["seconds"])

        return run_fio

    def run() -> dict[str, Any]:
        direct_preadv_file(path)
        return {}

    return run


def _ones() -> Any:
    import torch

    return torch.ones(2)


#: Loaders by name. ``file`` says which saver's file each reads ("any" reads the file given).
LOADERS: dict[str, Loader] = {
    "fastckpt": Loader("fastckpt.load", "fastckpt", _load_fastckpt),
    "fastckpt-noverify": Loader("fastckpt.load(verify=False)", "fastckpt", _load_fastckpt_noverify),
    "fastckpt-mmap": Loader("fastckpt.load(mmap=True)", "fastckpt", _load_fastckpt_mmap),
    **{
        f"fastckpt-{mode}": Loader(
            f"fastckpt.load, {mode} reads", "fastckpt", _load_fastckpt_in(mode)
        )
        for mode in READ_MODES
    },
    "fastckpt-huge": Loader(
        "fastckpt.load, arena in huge pages", "fastckpt", _load_fastckpt_pages("huge")
    ),
    "fastckpt-populate": Loader(
        "fastckpt.load, arena populated first", "fastckpt", _load_fastckpt_pages("populate")
    ),
    "safetensors": Loader("safetensors load_file (mmap)", "safetensors", _load_safetensors),
    "safetensors-pread": Loader(
        "safetensors load_file(backend=pread)", "safetensors", _load_safetensors_pread
    ),
    "safe_open": Loader("safetensors safe_open + get_tensor", "safetensors", _load_safe_open),
    "torch": Loader("torch.load", "torch", _load_torch),
    "torch-mmap": Loader("torch.load(mmap=True)", "torch", _load_torch_mmap),
    "runai": Loader("Run:ai SafetensorsStreamer", "safetensors", _load_runai),
    "fastsafetensors": Loader("fastsafetensors (nogds)", "safetensors", _load_fastsafetensors),
    "preadv": Loader("parallel preadv ceiling", "safetensors", _preadv(prefault=False)),
    "direct": Loader("device ceiling: O_DIRECT read (fio)", "raw", _direct_read),
    "preadv-prefault": Loader(
        "parallel preadv ceiling, prefaulted buffer", "safetensors", _preadv(prefault=True)
    ),
}
