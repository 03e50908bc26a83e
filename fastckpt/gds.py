"""GPUDirect Storage (cuFile) support: availability probe."""

from __future__ import annotations

from fastckpt._engines import EngineInfo


def engine_info() -> EngineInfo:
    """Whether the ``gds`` engine can run here, and why not."""
    return EngineInfo("gds", False, "GPUDirect Storage support is not built yet")
