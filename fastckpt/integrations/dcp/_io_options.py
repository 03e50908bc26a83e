"""The I/O settings a DCP writer or reader passes on to fastckpt's engine.

Example:
    >>> engine_options({"engine": "threads", "part_size": 8 << 20})
    {'engine': 'threads'}
"""

from __future__ import annotations

from typing import Any

__all__ = ["engine_options"]

_ENGINE_KEYS = ("engine", "block_size", "queue_depth", "intra_op_parallelism")


def engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """The engine's settings among a writer's or reader's keyword options."""
    return {k: options[k] for k in _ENGINE_KEYS if k in options}
