"""Measurements in fresh child processes: each method starts from the same state (no warm
allocator, no imports left over), and a crash or hang costs one result, not the run.

The child prints one marked JSON line; the parent reads it back.

Example:
    >>> code = "from fastckpt.bench.children import report; report({'x': 1})"
    >>> run_child([sys.executable, "-c", code], timeout=60)
    {'x': 1}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Callable

__all__ = ["RESULT_MARK", "child_main", "report", "run_child", "spawn"]


#: Prefix of the one stdout line a child process reports its result on.
RESULT_MARK = "@@BENCH-RESULT "


def report(result: dict[str, Any]) -> None:
    """Called in a child: hands ``result`` to the parent (one marked JSON line on stdout)."""
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def run_child(
    argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs ``argv`` and returns the dict it :func:`report` ed, or ``{"error": ...}``.

    Example:
        >>> code = "from fastckpt.bench.children import report; report({'x': 1})"
        >>> run_child([sys.executable, "-c", code], timeout=60)
        {'x': 1}
    """
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"error": f"exit status {proc.returncode}: " + " | ".join(tail)}


def child_main(spec_json: str, handlers: Mapping[str, Callable[[dict[str, Any]], dict]]) -> int:
    """A benchmark's child side: runs ``handlers[spec["op"]](spec)`` and reports its dict
    (or the exception as ``{"error": ...}``, so the parent goes on with the other methods).
    """
    spec = json.loads(spec_json)
    try:
        result = handlers[spec["op"]](spec)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result = {"error": f"{type(exc).__name__}: {exc}"}
    report(result)
    return 0


def spawn(script: str | os.PathLike[str], spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs ``python script --child SPEC`` (progress bars off) and returns what it reported."""
    env = dict(os.environ, FASTCKPT_NO_PROGRESS="1")
    argv = [sys.executable, os.fspath(script), "--child", json.dumps(spec)]
    return run_child(argv, timeout=timeout, env=env)
