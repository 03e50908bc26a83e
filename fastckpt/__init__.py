"""fastckpt: PyTorch checkpoints at the speed of the storage device.

Two faces:

- :func:`save`, :func:`load` and :func:`open`: a drop-in for ``torch.save``/``torch.load``
  writing safetensors-compatible files laid out for direct I/O. :func:`open` returns a
  :class:`Reader`, the same type for a local file, an fsspec URL and a sharded directory
  (``CheckpointReader`` is another name of it).
- :mod:`fastckpt.aio`: the DeepNVMe API (``aio_handle``, ``aio_read``, ``aio_write``,
  ``deepspeed_memcpy``, ``gds_handle``) over a native engine (io_uring, Linux AIO, a
  thread pool, or cuFile for GPUDirect Storage).

The public names are loaded on first use, so ``import fastckpt`` (and the command line's
``--help``) stays light: torch is imported only when a name that needs it is touched.
PyTorch is an optional dependency (``pip install torch``, or ``pip install '.[torch]'`` in a clone): without it,
:mod:`fastckpt.aio` works on numpy arrays and buffers, :mod:`fastckpt.format` and
``fastckpt inspect`` work, and the checkpoint functions raise ``ImportError`` saying so.

Example:
    >>> import fastckpt
    >>> fastckpt.engines()["threads"].available
    True
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute in it)
_PUBLIC = {
    "save": ("fastckpt.api", "save"),
    "load": ("fastckpt.api", "load"),
    "open": ("fastckpt.api", "open"),
    "async_save": ("fastckpt.api", "async_save"),
    "load_into": ("fastckpt.api", "load_into"),
    "add_safe_classes": ("fastckpt.checkpoint.config_objects", "add_safe_classes"),
    "CheckpointManager": ("fastckpt.series.manager", "CheckpointManager"),
    "save_bytes": ("fastckpt.checkpoint.stream_save", "save_bytes"),
    "load_bytes": ("fastckpt.checkpoint.load", "load_bytes"),
    "async_load": ("fastckpt.checkpoint.asynchronous", "async_load"),
    "SaveFuture": ("fastckpt.checkpoint.asynchronous", "SaveFuture"),
    "LoadFuture": ("fastckpt.checkpoint.asynchronous", "LoadFuture"),
    "wait_all": ("fastckpt.checkpoint.asynchronous", "wait_all"),
    "release_staging": ("fastckpt.checkpoint.asynchronous", "release_staging"),
    "prepare_staging": ("fastckpt.checkpoint.asynchronous", "prepare_staging"),
    # fastckpt.api makes calling Reader open a checkpoint; CheckpointReader is its older name
    "Reader": ("fastckpt.api", "Reader"),
    "CheckpointReader": ("fastckpt.api", "Reader"),
    "TensorInfo": ("fastckpt.checkpoint.header_view", "TensorInfo"),
    "engines": ("fastckpt.io.engines", "engines"),
    "EngineInfo": ("fastckpt.io.engines", "EngineInfo"),
    "FastCkptError": ("fastckpt.errors", "FastCkptError"),
    "HeaderError": ("fastckpt.errors", "HeaderError"),
    "ChecksumError": ("fastckpt.errors", "ChecksumError"),
    "EngineUnavailableError": ("fastckpt.errors", "EngineUnavailableError"),
    "WeightsOnlyError": ("fastckpt.errors", "WeightsOnlyError"),
    "UnsafePickleError": ("fastckpt.errors", "UnsafePickleError"),
    "NoChecksumsError": ("fastckpt.errors", "NoChecksumsError"),
    "LazySaveError": ("fastckpt.errors", "LazySaveError"),
    "MissingBaseError": ("fastckpt.errors", "MissingBaseError"),
    "RestoreError": ("fastckpt.errors", "RestoreError"),
    "CuFileError": ("fastckpt.io.cufile", "CuFileError"),
}
# public submodules reachable as attributes (fastckpt.aio, ...)
_SUBMODULES = ("aio", "gds", "config", "format", "errors")

__all__ = [
    "save",
    "load",
    "open",
    "async_save",
    "load_into",
    "add_safe_classes",
    "save_bytes",
    "load_bytes",
    "async_load",
    "SaveFuture",
    "LoadFuture",
    "wait_all",
    "release_staging",
    "prepare_staging",
    "Reader",
    "CheckpointReader",
    "TensorInfo",
    "aio",
    "engines",
    "EngineInfo",
    "FastCkptError",
    "HeaderError",
    "ChecksumError",
    "EngineUnavailableError",
    "WeightsOnlyError",
    "UnsafePickleError",
    "NoChecksumsError",
    "LazySaveError",
    "MissingBaseError",
    "RestoreError",
    "CheckpointManager",
    "CuFileError",
]

if TYPE_CHECKING:
    from fastckpt import aio
    from fastckpt.api import async_save, load, load_into, open, save  # noqa: A004
    from fastckpt.checkpoint.asynchronous import (
        LoadFuture,
        SaveFuture,
        async_load,
        prepare_staging,
        release_staging,
        wait_all,
    )
    from fastckpt.checkpoint.config_objects import add_safe_classes
    from fastckpt.checkpoint.header_view import TensorInfo
    from fastckpt.checkpoint.load import load_bytes
    from fastckpt.checkpoint.reader import Reader
    from fastckpt.checkpoint.reader import Reader as CheckpointReader
    from fastckpt.checkpoint.stream_save import save_bytes
    from fastckpt.errors import (
        ChecksumError,
        EngineUnavailableError,
        FastCkptError,
        HeaderError,
        LazySaveError,
        MissingBaseError,
        NoChecksumsError,
        RestoreError,
        UnsafePickleError,
        WeightsOnlyError,
    )
    from fastckpt.io.cufile import CuFileError
    from fastckpt.io.engines import EngineInfo, engines
    from fastckpt.series.manager import CheckpointManager


_DISTRIBUTION = "fastckpt-io"


def _extension_names(stub: str) -> set[str]:
    """The top-level names a ``_C.pyi`` stub declares (functions, classes, constants).

    Example:
        >>> sorted(_extension_names("X: int\\ndef f() -> None: ...\\nclass E:\\n    y: int\\n"))
        ['E', 'X', 'f']
    """
    return set(re.findall(r"^(?:def |class )?([A-Za-z_]\w*)\s*[:(]", stub, re.MULTILINE))


def _installed_extension() -> str | None:
    """The path of the native module that the installed ``fastckpt-io`` distribution holds,
    or None when no distribution of that name lists one."""
    from importlib import machinery, metadata

    try:
        files = metadata.distribution(_DISTRIBUTION).files or []
    except metadata.PackageNotFoundError:
        return None
    for entry in files:
        parts = entry.parts
        if len(parts) == 2 and parts[0] == "fastckpt" and parts[1].startswith("_C."):
            if any(parts[1].endswith(suffix) for suffix in machinery.EXTENSION_SUFFIXES):
                return str(entry.locate())
    return None


def _shadowed_native(missing: ModuleNotFoundError) -> ModuleType:
    """``fastckpt._C`` when this package was imported from a source tree without a built
    native module while a ``pip install .`` put one in site-packages: Python run from a
    clone's root finds the clone's ``fastckpt/`` first (the current directory leads
    ``sys.path``) and the installed package, which holds ``_C``, is never searched. The
    installed module is loaded when it provides every name this tree's ``_C.pyi`` declares;
    otherwise an ImportError says what happened and what to do.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    installed = _installed_extension()
    advice = (
        f"fastckpt was imported from {here}, a source tree where the native module "
        "fastckpt._C is not built (the current directory or PYTHONPATH puts it before any "
        "installed fastckpt)"
    )
    if installed is None or not os.path.isfile(installed):
        raise ImportError(
            f"{advice}, and no installed {_DISTRIBUTION} provides one: in the clone, run "
            "pip install -e . (builds it in place), or pip install . and run Python outside "
            "the clone",
            name="fastckpt._C",
        ) from missing
    if os.path.dirname(os.path.abspath(installed)) == here:
        raise missing  # this is the installed package: its own _C is what is missing
    spec = importlib.util.spec_from_file_location("fastckpt._C", installed)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        with open(os.path.join(here, "_C.pyi"), encoding="utf-8") as stub:
            lacking = sorted(_extension_names(stub.read()) - set(dir(module)))
    except FileNotFoundError:
        lacking = []
    if lacking:
        raise ImportError(
            f"{advice}; the installed {_DISTRIBUTION}'s native module {installed} was built "
            f"from other sources (it lacks {', '.join(lacking[:5])}): run Python outside "
            f"{os.path.dirname(here)} to use the installed fastckpt, or pip install -e . "
            "in the clone to use its sources",
            name="fastckpt._C",
            path=installed,
        ) from missing
    sys.modules["fastckpt._C"] = module
    return module


def _native() -> ModuleType:
    """``fastckpt._C``, the private native module (see :func:`_shadowed_native`)."""
    try:
        return importlib.import_module("fastckpt._C")
    except ModuleNotFoundError as exc:
        if exc.name != "fastckpt._C":
            raise
        return _shadowed_native(exc)


def __getattr__(name: str) -> Any:
    """Loads a public name's layer on first use (PEP 562) and caches it on the package."""
    if name == "_C":
        value: Any = _native()
    elif name in _PUBLIC:
        module, attribute = _PUBLIC[name]
        try:
            value = getattr(importlib.import_module(module), attribute)
        except ImportError as exc:
            if exc.name != "torch" and "torch" not in str(exc):
                raise
            raise ImportError(
                f"fastckpt.{name} needs PyTorch, which is not installed here: "
                "pip install torch (or, in a clone of fastckpt, pip install '.[torch]'); "
                "fastckpt.aio, fastckpt.format and the command line work without it"
            ) from exc
    elif name in _SUBMODULES:
        value = importlib.import_module(f"fastckpt.{name}")
    else:
        raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | set(_SUBMODULES))
