"""Which native I/O engines run here, and how ``engine="auto"`` picks one.

Example:
    >>> import fastckpt
    >>> info = fastckpt.engines()
    >>> info["threads"].available
    True
"""

from __future__ import annotations

import dataclasses
import functools

from fastckpt import _C
from fastckpt.errors import EngineUnavailableError
from fastckpt.io import cufile

__all__ = ["EngineInfo", "engines", "gds_info", "resolve_engine", "ENGINE_NAMES"]

# In the order "auto" prefers them.
ENGINE_NAMES = ("io_uring", "libaio", "threads")


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """Whether an engine can run here; ``reason`` says why not."""

    name: str
    available: bool
    reason: str = ""


@functools.lru_cache(maxsize=None)
def _probe(name: str) -> EngineInfo:
    available, reason = _C.engine_status(name)
    return EngineInfo(name, available, reason)


def engines() -> dict[str, EngineInfo]:
    """Every engine fastckpt knows, with its availability on this machine.

    ``gds`` (GPUDirect Storage through cuFile) is listed too; it needs a CUDA GPU.

    Example:
        >>> import fastckpt
        >>> sorted(fastckpt.engines())[:3]
        ['gds', 'io_uring', 'libaio']
    """
    found = {name: _probe(name) for name in ENGINE_NAMES}
    found["gds"] = gds_info()
    return found


def gds_info() -> EngineInfo:
    """Whether the ``gds`` engine (GPUDirect Storage through cuFile) can run here, and why not.

    Available only when torch sees a CUDA GPU, libcufile loads and the cuFile driver opens.
    When available, ``reason`` says whether transfers are true GPUDirect Storage or cuFile's
    compatibility mode (see :func:`fastckpt.gds.mode`). Worked out once per process.

    Example:
        >>> info = gds_info()
        >>> info.available or "CUDA" in info.reason or "cufile" in info.reason.lower()
        True
    """
    available, reason = cufile.status()
    return EngineInfo("gds", available, reason)


def resolve_engine(name: str) -> str:
    """Turns ``"auto"`` into the best available engine; checks a named one is available.

    Raises:
        EngineUnavailableError: a named engine cannot run here (the message says why).
        ValueError: the name is not an engine.
    """
    if name == "auto":
        for candidate in ENGINE_NAMES:
            if _probe(candidate).available:
                return candidate
        raise EngineUnavailableError("no I/O engine is available")  # threads always is
    if name not in ENGINE_NAMES:
        raise ValueError(f"engine must be one of {('auto',) + ENGINE_NAMES}, got {name!r}")
    info = _probe(name)
    if not info.available:
        raise EngineUnavailableError(f"engine {name!r} is not available here: {info.reason}")
    return name
