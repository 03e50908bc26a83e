"""The cuFile runtime: whether GPUDirect Storage runs here, buffer registration, transfers.

Bytes move between a file and GPU memory through NVIDIA's cuFile library: by DMA when the nvidia-fs
kernel driver is loaded (true GPUDirect Storage), else in cuFile's *compatibility mode*,
where cuFile itself reads into host memory and copies to the GPU.

Where things come from:

- ``libcufile`` is opened with ``dlopen`` at run time (nothing CUDA is needed to build):
  a copy the process already loaded, then ``libcufile.so.0``/``libcufile.so`` from the
  dynamic linker's search path (the CUDA toolkit's GDS package), then the
  ``nvidia-cufile`` wheels (``nvidia/cufile/lib``, ``nvidia/cu13/lib``). The environment
  variable ``FASTCKPT_CUFILE_LIBRARY`` names one file to use instead.
- cuFile reads its configuration from ``/etc/cufile.json`` or the file named by
  ``CUFILE_ENV_PATH_JSON``; ``"allow_compat_mode": true`` there (the default) lets it run
  without nvidia-fs, ``"force_compat_mode": true`` makes it always do so.

Errors: a cuFile status becomes :class:`CuFileError` (a :class:`fastckpt.FastCkptError`
and a ``RuntimeError``) whose ``status`` is the status code's name, e.g.
``"CU_FILE_DRIVER_NOT_INITIALIZED"``; a file-system error that cuFile reports through
``errno`` becomes ``OSError(errno, message, filename)``; a short transfer is continued and
an unexpected end of file is ``OSError(ENODATA)``. Asking for a ``gds_handle`` where
GPUDirect Storage cannot run raises :class:`fastckpt.EngineUnavailableError` saying why.

Buffers not pinned with :meth:`gds_handle.pin_device_tensor` are registered with cuFile
for the duration of each operation and deregistered after. Where cuFile cannot pin them
(its BAR1 budget is spent, or the memory is already registered by someone else) the
operation still runs, unregistered, through cuFile's internal GPU bounce buffers, as
cuFile documents for unregistered memory.

Example:
    >>> mode() in ("gds", "compat", None)
    True
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import tempfile
import threading
from typing import Any

from fastckpt import _C, config
from fastckpt.errors import EngineUnavailableError
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, BufferRef, buffer_ref
from fastckpt.io.files import File

__all__ = [
    "CuFileError",
    "status",
    "device_ref",
    "pin",
    "require",
    "transfer_range",
    "unpin",
    "library_candidates",
    "mode",
    "transfer",
]

#: The exception a failed cuFile call raises; ``status`` holds the status code's name.
CuFileError = _C.CuFileError

LIBRARY_ENV = "FASTCKPT_CUFILE_LIBRARY"

# cuFileGetParameterBool's CUFileBoolConfigParameter_t values.
_PARAM_ALLOW_COMPAT_MODE = 1
_PARAM_FORCE_COMPAT_MODE = 2

# Statuses with which cuFileBufRegister says it cannot pin this memory; the I/O then runs
# unregistered, through cuFile's own bounce buffers.
_CANNOT_PIN = frozenset(
    {
        "CU_FILE_MEMORY_ALREADY_REGISTERED",
        "CU_FILE_GPU_MEMORY_PINNING_FAILED",
        "CU_FILE_INVALID_MAPPING_SIZE",
        "CU_FILE_INVALID_MAPPING_RANGE",
        "CU_FILE_CUDA_MEMORY_TYPE_INVALID",  # e.g. memory of cudaMallocAsync pools
    }
)


# ------------------------------------------------------------------------------- probing


def library_candidates() -> list[str]:
    """The libcufile files of installed ``nvidia-cufile`` wheels, the one matching torch's
    CUDA first.

    Example:
        >>> all(p.endswith("libcufile.so.0") for p in library_candidates())
        True
    """
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    subdirs = ["cufile/lib", "cu13/lib", "cu12/lib"]
    cuda_major = _torch_cuda_major()
    if cuda_major == "13":
        subdirs = ["cu13/lib", "cufile/lib", "cu12/lib"]
    found = []
    for sub in subdirs:
        for root in spec.submodule_search_locations:
            path = os.path.join(root, sub, "libcufile.so.0")
            if os.path.isfile(path) and path not in found:
                found.append(path)
    return found


def _torch_cuda_major() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    version = getattr(torch.version, "cuda", None)
    return version.split(".")[0] if version else None


def _cuda_problem() -> str | None:
    """Why torch cannot use a CUDA GPU here, or None when it can."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if getattr(torch.version, "cuda", None) is None:
        return f"this PyTorch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA GPU is usable (torch.cuda.is_available() is False)"
    return None


def _load_library() -> tuple[bool, str]:
    override = config.cufile_library()
    if override:
        return _C.cufile_load([override], False)
    loaded, text = _C.cufile_load(library_candidates(), True)
    if not loaded:
        text += (
            " (install the nvidia-cufile-cu12 or nvidia-cufile wheel, or the CUDA toolkit's GDS "
            f"package, or name the file with {LIBRARY_ENV})"
        )
    return loaded, text


def _nvidia_fs_loaded() -> bool:
    return os.path.isdir("/sys/module/nvidia_fs") or os.path.isdir("/proc/driver/nvidia-fs")


@dataclasses.dataclass(frozen=True)
class _Probe:
    available: bool
    reason: str
    mode: str | None  # "gds", "compat" or None


def _register_problem() -> str | None:
    """Why cuFile cannot register a real file (in the temporary directory), or None.

    An open driver alone proves little: registration is where cuFile checks the file
    system and its compatibility-mode settings, so "available" is said only after it works.
    """
    fd = -1
    try:
        with tempfile.NamedTemporaryFile(prefix="fastckpt-gds-probe-") as probe:
            probe.write(bytes(BUFFER_ALIGNMENT))
            probe.flush()
            flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
            try:
                fd = os.open(probe.name, flags)
            except OSError:
                fd = os.open(
                    probe.name, os.O_RDONLY
                )  # no O_DIRECT here: compat mode may still work
            handle = _C.cufile_handle_register(fd, probe.name)
            _C.cufile_handle_deregister(handle)
    except (CuFileError, OSError) as exc:
        return str(exc)
    finally:
        if fd >= 0:
            os.close(fd)
    return None


@functools.lru_cache(maxsize=1)
def _probe() -> _Probe:
    problems = []
    cuda_problem = _cuda_problem()
    if cuda_problem:
        problems.append(cuda_problem)
    loaded, text = _load_library()
    if not loaded:
        problems.append(text)
    if problems:
        return _Probe(False, "; ".join(problems), None)
    try:
        # Opened once and kept for the process: the cuFile driver is process-wide, and
        # opening it costs far more than any single transfer.
        _C.cufile_driver_open()
    except CuFileError as exc:
        return _Probe(False, f"{exc} (libcufile at {text})", None)
    problem = _register_problem()
    if problem is not None:
        return _Probe(
            False, f"cuFile cannot register a file here: {problem} (libcufile at {text})", None
        )
    force = _C.cufile_get_bool_parameter(_PARAM_FORCE_COMPAT_MODE)
    if force:
        return _Probe(
            True,
            "cuFile compatibility mode: force_compat_mode is set in cufile.json; "
            "cuFile reads through host memory",
            "compat",
        )
    if not _nvidia_fs_loaded():
        return _Probe(
            True,
            "cuFile compatibility mode: the nvidia-fs kernel driver is not loaded; "
            "cuFile reads through host memory",
            "compat",
        )
    fallback = ""
    if _C.cufile_get_bool_parameter(_PARAM_ALLOW_COMPAT_MODE):
        fallback = "; files it cannot serve fall back to compatibility mode (allow_compat_mode)"
    return _Probe(
        True, f"GPUDirect Storage through nvidia-fs (libcufile at {text}){fallback}", "gds"
    )


def status() -> tuple[bool, str]:
    """(available, reason): whether cuFile runs here, and why not (or in which mode).

    Example:
        >>> available, reason = status()
        >>> available or bool(reason)
        True
    """
    probe = _probe()
    return probe.available, probe.reason


def mode() -> str | None:
    """``"gds"`` (DMA through nvidia-fs), ``"compat"`` (cuFile's POSIX fallback) or None
    (unavailable).

    Example:
        >>> mode() in ("gds", "compat", None)
        True
    """
    return _probe().mode


def require() -> None:
    probe = _probe()
    if not probe.available:
        raise EngineUnavailableError(f"GPUDirect Storage is not available here: {probe.reason}")


# ------------------------------------------------------------------- buffer registration


class _Registration:
    __slots__ = ("nbytes", "owner", "pinned", "users")

    def __init__(self, nbytes: int, owner: Any, pinned: bool):
        self.nbytes, self.owner, self.pinned, self.users = nbytes, owner, pinned, 0


# cuFile's registrations are process-wide, so this table is too: base address -> entry.
_registry: dict[int, _Registration] = {}
_registry_lock = threading.Lock()


def _find(address: int, nbytes: int) -> int | None:
    for base, entry in _registry.items():
        if base <= address and address + nbytes <= base + entry.nbytes:
            return base
    return None


def _acquire(ref: BufferRef) -> tuple[int, int, int | None]:
    """(base, offset of ref in it, base to release or None) for one operation on ``ref``."""
    with _registry_lock:
        base = _find(ref.address, ref.nbytes)
        if base is not None:
            _registry[base].users += 1
            return base, ref.address - base, base
    try:
        _C.cufile_buf_register(ref.address, ref.nbytes)
    except CuFileError as exc:
        if exc.status in _CANNOT_PIN:
            return ref.address, 0, None
        raise
    with _registry_lock:
        entry = _Registration(ref.nbytes, ref.owner, pinned=False)
        entry.users = 1
        _registry[ref.address] = entry
    return ref.address, 0, ref.address


def _release(base: int | None) -> None:
    if base is None:
        return
    with _registry_lock:
        entry = _registry.get(base)
        if entry is None:
            return
        entry.users -= 1
        if entry.users > 0 or entry.pinned:
            return
        del _registry[base]
    _C.cufile_buf_deregister(base)


def pin(tensor: Any, argname: str) -> bool:
    ref = device_ref(tensor, writable=True, argname=argname)
    if ref.nbytes == 0:
        return True
    with _registry_lock:
        entry = _registry.get(ref.address)
        if entry is not None and entry.nbytes == ref.nbytes:
            entry.pinned, entry.owner = True, tensor
            return True
    _C.cufile_buf_register(ref.address, ref.nbytes)
    with _registry_lock:
        _registry[ref.address] = _Registration(ref.nbytes, tensor, pinned=True)
    return True


def unpin(tensor: Any) -> bool:
    address = tensor.data_ptr()
    with _registry_lock:
        entry = _registry.get(address)
        if entry is None or not entry.pinned:
            return False
        entry.pinned = False
        if entry.users > 0:
            return True  # deregistered when the operations using it finish
        del _registry[address]
    _C.cufile_buf_deregister(address)
    return True


# ------------------------------------------------------------------------------ transfers


def device_ref(buffer: Any, *, writable: bool, argname: str) -> BufferRef:
    ref = buffer_ref(buffer, writable=writable, argname=argname, allow_cuda=True)
    if not ref.is_cuda:
        kind = type(buffer).__name__
        if hasattr(buffer, "device"):
            kind = f"{kind} on {buffer.device}"
        raise TypeError(
            f"{argname}: gds_handle works on CUDA tensors only, got a {kind}; use aio_handle for host memory"
        )
    return ref


def transfer_range(
    file: File, ref: BufferRef, file_offset: int, *, write: bool, threads: int, ready: Any = None
) -> None:
    """Moves ``ref``'s bytes to/from ``file`` through cuFile; blocks, GIL released in the core."""
    if ref.nbytes == 0:
        return
    import torch

    with torch.cuda.device(ref.owner.device):
        # Orders the transfer after the work queued on the tensor when it was submitted, and
        # binds the device's context to this thread (cuFile resolves device memory in it).
        if ready is not None:
            ready.synchronize()
        else:
            torch.cuda.current_stream().synchronize()
        fd = file.direct_fd if file.direct_fd >= 0 else file.fd
        handle = _C.cufile_handle_register(fd, file.path)
        try:
            base, offset, registered = _acquire(ref)
            try:
                move = _C.cufile_write if write else _C.cufile_read
                move(handle, base, ref.nbytes, file_offset, offset, max(1, threads), file.path)
            finally:
                _release(registered)
        finally:
            _C.cufile_handle_deregister(handle)


def transfer(
    file: File,
    tensor: Any,
    file_offset: int,
    *,
    write: bool,
    nbytes: int | None = None,
    threads: int = 1,
) -> None:
    """Reads (or writes, with ``write``) the first ``nbytes`` of a contiguous CUDA tensor
    from (to) ``file`` at ``file_offset`` through cuFile. Blocks until done.

    Work already queued on the tensor's current stream finishes first; the data is in
    place when this returns. ``threads`` splits the transfer into that many parts.

    Raises:
        EngineUnavailableError: GPUDirect Storage cannot run here.
        TypeError: ``tensor`` is not a CUDA tensor.
        CuFileError, OSError: the transfer failed.
    """
    require()
    if isinstance(file_offset, bool) or not isinstance(file_offset, int) or file_offset < 0:
        raise ValueError(f"file_offset must be a non-negative int, got {file_offset!r}")
    ref = device_ref(tensor, writable=not write, argname="tensor")
    if nbytes is not None:
        if nbytes < 0 or nbytes > ref.nbytes:
            raise ValueError(
                f"nbytes must be between 0 and the tensor's {ref.nbytes} bytes, got {nbytes}"
            )
        ref = BufferRef(ref.address, nbytes, ref.owner, True)
    transfer_range(file, ref, file_offset, write=write, threads=threads)
